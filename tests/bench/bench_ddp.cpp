// accel.hpp's side of the data-parallel training benchmark against Python's
// DistributedDataParallel (bench_ddp.py): the same MLP, sizes, optimizer and
// step, trained with accel::Accelerator. Rank 0 prints
//     CSV,ddp_step,<world>,accel_accelerator,<params>,<ms per step>,ms
// once per trial. Run under tests/launch.cpp (run_ddp_bench.sh does).
//
//     bench_ddp <trials> <steps>
#define ACCEL_TRAINING
#include "accel.hpp"

#include <chrono>
#include <cstdio>
#include <string>

namespace {
constexpr int64_t kIn = 256, kHidden = 1024, kBatch = 64;

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : body(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, kHidden),
             torch::nn::ReLU(), torch::nn::Linear(kHidden, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, 1)) {
    register_module("body", body);
  }
  at::Tensor forward(const at::Tensor& x) { return body->forward(x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(Mlp);
}  // namespace

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::stoi(argv[1]) : 5;
  const int steps = argc > 2 ? std::stoi(argv[2]) : 30;
  accel::Accelerator accelerator;
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  accelerator.prepare(model, optimizer);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  auto generator = at::detail::createCPUGenerator(1 + accelerator.process_index());
  const at::Tensor x = at::randn({kBatch, kIn}, generator), y = at::randn({kBatch, 1}, generator);
  auto step = [&] {
    optimizer.zero_grad();
    accelerator.backward(torch::mse_loss(model(x), y));
    optimizer.step();
  };
  for (int i = 0; i < 5; ++i) step();  // warm-up
  for (int t = 0; t < trials; ++t) {
    accelerator.wait_for_everyone();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    accelerator.wait_for_everyone();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
    if (accelerator.is_main_process())
      std::printf("CSV,ddp_step,%d,accel_accelerator,%lld,%.6g,ms\n", accelerator.num_processes(),
                  static_cast<long long>(params), ms);
    std::fflush(stdout);
  }
  accel::DistributedInterface::instance().destroy();
}
