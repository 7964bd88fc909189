// accel.hpp's side of the pipeline benchmark against Python's
// torch.distributed.pipelining (bench_pipeline.py): the same model (an input
// projection, BLOCKS residual blocks x + tanh(Linear H -> H), a head; fp32),
// cut into the same stages (1 per rank for gpipe and 1f1b, 2 for
// interleaved_1f1b, zbv and dualpipev), the same batch and micro-batches, SGD. Per trial
// rank 0 prints the step's median time (schedule.step() and the optimizer's
// step) and every rank's measured bubble (1 - the time in its stages'
// computations / schedule.step()'s), averaged over the ranks and the trial's
// steps, and the most micro-batches any stage held:
//     CSV,pp_step,<world>,accel_<schedule>,<microbatches>,<ms per step>,ms
//     CSV,pp_bubble,<world>,accel_<schedule>,<microbatches>,<fraction>,fraction
//     CSV,pp_in_flight,<world>,accel_<schedule>,<microbatches>,<micro-batches>,count
// Run under tests/launch.cpp (run_pipeline_bench.sh does).
//
//     bench_pipeline <schedule> <microbatches> <trials> <steps>
#define ACCEL_TRAINING
#include "accel.hpp"

#include <chrono>
#include <cstdio>
#include <string>

namespace {
constexpr int64_t kIn = 256, kHidden = 1024, kOut = 16, kBlocks = 8, kBatch = 64;

struct ResidualImpl : torch::nn::Module {
  ResidualImpl() { lin = register_module("lin", torch::nn::Linear(kHidden, kHidden)); }
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(lin(x)); }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Residual);

torch::nn::Sequential make_stage(int k, int stages) {
  torch::nn::Sequential seq;
  if (k == 0) seq->push_back(torch::nn::Linear(kIn, kHidden));
  for (int64_t b = 0; b < kBlocks / stages; ++b) seq->push_back(Residual());
  if (k == stages - 1) seq->push_back(torch::nn::Linear(kHidden, kOut));
  return seq;
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  const std::string schedule_name = argc > 1 ? argv[1] : "1f1b";
  const int m = argc > 2 ? std::stoi(argv[2]) : 8, trials = argc > 3 ? std::stoi(argv[3]) : 3,
            steps = argc > 4 ? std::stoi(argv[4]) : 10;
  auto& world = accel::DistributedInterface::instance(accel::DistributedConfig{.pp_size = accel::get_world_size()});
  const int P = world.get_world_size(), r = world.get_rank(accel::Dim::PP);
  const bool v = schedule_name == "zbv" || schedule_name == "dualpipev",
             looped = schedule_name != "gpipe" && schedule_name != "1f1b";
  const int S = looped ? 2 * P : P;
  std::vector<int> indices{r};
  if (looped) indices.push_back(v ? 2 * P - 1 - r : r + P);
  std::vector<torch::nn::Sequential> modules;
  std::vector<accel::pp::PipelineStage> stages;
  std::vector<at::Tensor> params;
  torch::manual_seed(0);
  for (const int k : indices) {
    modules.push_back(make_stage(k, S));
    stages.emplace_back(modules.back(), k, S);
    for (const auto& p : modules.back()->parameters()) params.push_back(p);
  }
  auto mse = [](const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target); };
  std::vector<std::reference_wrapper<accel::pp::PipelineStage>> refs(stages.begin(), stages.end());
  std::unique_ptr<accel::pp::PipelineSchedule> schedule;
  if (schedule_name == "gpipe") schedule = std::make_unique<accel::pp::ScheduleGPipe>(stages[0], m, mse);
  else if (schedule_name == "1f1b") schedule = std::make_unique<accel::pp::Schedule1F1B>(stages[0], m, mse);
  else if (schedule_name == "interleaved_1f1b")
    schedule = std::make_unique<accel::pp::ScheduleInterleaved1F1B>(refs, m, mse);
  else if (schedule_name == "zbv") schedule = std::make_unique<accel::pp::ScheduleZBVZeroBubble>(refs, m, mse);
  else schedule = std::make_unique<accel::pp::ScheduleDualPipeV>(refs, m, mse);
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(1e-3));
  const bool first = std::ranges::count(indices, 0) == 1, last = std::ranges::count(indices, S - 1) == 1;
  auto generator = at::detail::createCPUGenerator(1);
  const at::Tensor x = at::randn({kBatch, kIn}, generator), y = at::randn({kBatch, kOut}, generator);
  std::vector<double> step_ms, bubble;
  auto step = [&] {
    const auto began = std::chrono::steady_clock::now();
    schedule->step(first ? x : at::Tensor(), last ? y : at::Tensor());
    const auto stepped = std::chrono::steady_clock::now();
    optimizer.step();
    optimizer.zero_grad();
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count());
    // (the pipeline's own step: the optimizer's is no part of the bubble)
    bubble.push_back(1 - schedule->compute_seconds() / std::chrono::duration<double>(stepped - began).count());
  };
  for (int i = 0; i < 3; ++i) step();  // warm-up
  const std::string variant = "accel_" + schedule_name;
  for (int t = 0; t < trials; ++t) {
    world.barrier();
    step_ms.clear();
    bubble.clear();
    std::size_t held = 0;
    for (int i = 0; i < steps; ++i) {
      step();
      for (const auto& s : stages) held = std::max(held, s.peak_microbatches_in_flight());
    }
    const double mean_bubble =
        accel::all_reduce(std::accumulate(bubble.begin(), bubble.end(), 0.0) / bubble.size()) / P;
    const auto most_held = accel::all_reduce(static_cast<int64_t>(held), accel::ReduceOp::MAX);
    if (r == 0) {
      std::printf("CSV,pp_step,%d,%s,%d,%.6g,ms\n", P, variant.c_str(), m, median(step_ms));
      std::printf("CSV,pp_bubble,%d,%s,%d,%.6g,fraction\n", P, variant.c_str(), m, mean_bubble);
      std::printf("CSV,pp_in_flight,%d,%s,%d,%lld,count\n", P, variant.c_str(), m, static_cast<long long>(most_held));
      std::fflush(stdout);
    }
  }
  world.destroy();
}
