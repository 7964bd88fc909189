// accel.hpp's side of the data-parallel training benchmark against Python's
// DistributedDataParallel (bench_ddp.py): the same MLP, sizes, optimizer and
// step, trained with accel::Accelerator, with or without a communication hook
// (fp16: fp16_compress_hook; powersgd: powerSGD_hook of rank 1 from step 2,
// as the Python side). Rank 0 prints
//     CSV,ddp_step,<world>,accel_accelerator[_fp16],<params>,<ms per step>,ms
// once per trial, and its loss after the last step:
//     CSV,ddp_loss,<world>,accel_accelerator[_fp16],<params>,<loss>,mse
// Run under tests/launch.cpp (run_ddp_bench.sh does). On a machine with a
// GPU the Accelerator takes it (NCCL; the variant ends in _cuda), and so does
// bench_ddp.py with ACCEL_BENCH_DEVICE=cuda (tests/gpu/run_gpu.sh).
//
//     bench_ddp <trials> <steps> [none|fp16|powersgd]
#define ACCEL_TRAINING
#include "accel.hpp"

#include <chrono>
#include <cstdio>
#include <string>

namespace {
constexpr int64_t kIn = 256, kHidden = 1024, kBatch = 64;

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : body(torch::nn::Linear(kIn, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, kHidden), torch::nn::ReLU(),
             torch::nn::Linear(kHidden, kHidden), torch::nn::ReLU(), torch::nn::Linear(kHidden, 1)) {
    register_module("body", body);
  }
  at::Tensor forward(const at::Tensor& x) { return body->forward(x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(Mlp);

// "_cuda" on a GPU, "_cuda_gloo" for Gloo on CUDA tensors (ACCEL_BACKEND=gloo: processes sharing one GPU).
std::string device_suffix(accel::Accelerator& accelerator) {
  if (!accelerator.device().is_cuda()) return "";
  return accel::DistributedInterface::instance().backend() == "gloo" ? "_cuda_gloo" : "_cuda";
}
}  // namespace

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::stoi(argv[1]) : 5;
  const int steps = argc > 2 ? std::stoi(argv[2]) : 30;
  const std::string hook = argc > 3 ? argv[3] : "none";
  accel::AcceleratorConfig config;
  if (hook == "fp16") config.comm_hook = accel::DDPCommunicationHookType::FP16;
  accel::Accelerator accelerator(config);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-3).momentum(0.9));
  accelerator.prepare(model, optimizer);
  if (hook == "powersgd")
    accelerator.data_parallel(model)->register_comm_hook(accel::comm_hooks::powerSGD_hook(
        std::make_shared<accel::PowerSGDState>(accel::PowerSGDState{.start_powerSGD_iter = 2})));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const std::string variant =
      (hook == "none" ? "accel_accelerator" : "accel_accelerator_" + hook) + device_suffix(accelerator);
  auto generator = at::detail::createCPUGenerator(1 + accelerator.process_index());
  const at::Tensor x = at::randn({kBatch, kIn}, generator).to(accelerator.device()),
                   y = at::randn({kBatch, 1}, generator).to(accelerator.device());
  double loss = 0;
  auto step = [&] {
    optimizer.zero_grad();
    const at::Tensor l = torch::mse_loss(model(x), y);
    accelerator.backward(l);
    optimizer.step();
    loss = l.item<double>();
  };
  for (int i = 0; i < 5; ++i) step();  // warm-up
  for (int t = 0; t < trials; ++t) {
    accelerator.wait_for_everyone();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    accelerator.wait_for_everyone();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
    if (accelerator.is_main_process())
      std::printf("CSV,ddp_step,%d,%s,%lld,%.6g,ms\n", accelerator.num_processes(), variant.c_str(),
                  static_cast<long long>(params), ms);
    std::fflush(stdout);
  }
  if (accelerator.is_main_process())
    std::printf("CSV,ddp_loss,%d,%s,%lld,%.9g,mse\n", accelerator.num_processes(), variant.c_str(),
                static_cast<long long>(params), loss);
  accel::DistributedInterface::instance().destroy();
}
