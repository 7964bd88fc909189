// Sharded data parallel, per process: allocator bytes and step time of
// accel::Accelerator with NO_SHARD, SHARD_GRAD_OP (ZeRO-2) and FULL_SHARD
// (ZeRO-3, each Linear a unit; full_shard_bf16: under a MixedPrecisionPolicy
// of bf16 parameters and fp32 reductions), Adam on an MLP
// of 4 x 2048 x 2048 (16.8 M parameters). Every CPU allocation LibTorch makes
// goes through a counting allocator (c10::SetCPUAllocator), so the figures
// are allocator bytes, not RSS. Rank 0 prints, per figure, the largest over
// the processes:
//     CSV,sharding_<figure>,<world>,<strategy>,<params>,<value>,<unit>
// figures: params_mb, grads_mb, optimizer_mb (held by tensors, counted from
// them: parameters and shards, the gradients of both, optimizer state;
// between two steps, i.e. after optimizer.step() and before the next
// zero_grad); between_steps_mb, peak_mb (every live CPU byte: between two
// steps, and the highest during the timed steps); buffers_mb (of
// between_steps_mb, the sharding engine's working buffers kept for the next
// step, as CUDA's caching allocator keeps blocks); step_ms (per step, the
// median of the trials). Run under tests/launch.cpp
// (run_sharding_bench.sh does). On a GPU (NCCL; the variant ends in _cuda;
// tests/gpu/run_gpu.sh) the allocator figures, which count CPU bytes, are
// not printed: the tensors live on the device.
//
// A variant ending in _fused steps with accel::FusedAdam instead of
// torch::optim::Adam (LibTorch 2.4 or newer). hybrid_shard: HYBRID_SHARD on
// a (2, world / 2) model mesh (HSDP: units sharded along the second
// dimension, replicated along the first; an even world of 4 or more).
//
//     bench_sharding <no_shard|shard_grad_op|full_shard|full_shard_bf16|hybrid_shard>[_fused] <trials> <steps>
//     bench_sharding <variant> <trials> checkpoint
//
// checkpoint: instead of the step figures, save_state and load_state of the
// trained model and Adam's state (about 200 MB over the processes) into a
// directory under $ACCEL_BENCH_CHECKPOINT_DIR (default: the temp
// directory), `trials` rounds, each round with the files' digests (hashed
// as written, checked as read) and without (file_digests_on() off), in
// alternating order; the medians, ms, as checkpoint_save_ms and
// checkpoint_load_ms (variants <strategy> and <strategy>_no_digests).
#define ACCEL_TRAINING
#include "accel.hpp"

#include "../counting_allocator.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <time.h>

namespace {
constexpr int64_t kWidth = 2048, kLayers = 4, kBatch = 16;

int64_t bytes_of(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// This process's resident memory (VmRSS) or its peak since the last reset (VmHWM), MiB, from /proc: the same
// figure bench_sharding.py reads for Python, whose allocator has no counting hook.
double resident_mb(const std::string& field = "VmRSS") {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  return std::nan("");
}
void reset_peak_resident() { std::ofstream("/proc/self/clear_refs") << "5"; }  // VmHWM starts again from VmRSS
// CPU time of every thread of this process so far, ms (Python's time.process_time()).
double process_cpu_ms() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) * 1e3 + static_cast<double>(now.tv_nsec) / 1e6;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string variant_name = argc > 1 ? argv[1] : "shard_grad_op";
  const bool fused = variant_name.ends_with("_fused");
  const std::string strategy = fused ? variant_name.substr(0, variant_name.size() - 6) : variant_name;
  const int trials = argc > 2 ? std::stoi(argv[2]) : 3;
  const bool checkpoint = argc > 3 && std::string(argv[3]) == "checkpoint";
  const int steps = argc > 3 && !checkpoint ? std::stoi(argv[3]) : 5;
  accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();  // counts to the end
  counting.install();

  accel::AcceleratorConfig config;
  const bool bf16 = strategy == "full_shard_bf16";
  config.sharding_strategy = strategy == "shard_grad_op"        ? accel::ShardingStrategy::SHARD_GRAD_OP
                             : strategy == "full_shard" || bf16 ? accel::ShardingStrategy::FULL_SHARD
                             : strategy == "hybrid_shard"       ? accel::ShardingStrategy::HYBRID_SHARD
                                                                : accel::ShardingStrategy::NO_SHARD;
  if (bf16) config.mixed_precision_policy = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat};
  if (strategy == "hybrid_shard") config.distributed.mp_replicate_size = 2;  // bench_sharding.py's (2, world / 2) mesh
  accel::Accelerator accelerator(config);
  const double rss_before = resident_mb();  // (LibTorch and the process group: what no variant changes)
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int64_t i = 0; i < kLayers; ++i) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    model->push_back(torch::nn::ReLU());
  }
  std::unique_ptr<torch::optim::Optimizer> adam;
  if (fused) adam = std::make_unique<accel::FusedAdam>(model->parameters(), torch::optim::AdamOptions(1e-4));
  else adam = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-4));
  auto prepared = accelerator.prepare(model, *adam);
  accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const at::Device device = accelerator.device();
  const std::string variant =  // "_cuda_gloo": Gloo on CUDA tensors (ACCEL_BACKEND=gloo, processes sharing one GPU)
      variant_name + (!device.is_cuda()                                             ? ""
                      : accel::DistributedInterface::instance().backend() == "gloo" ? "_cuda_gloo"
                                                                                    : "_cuda");
  auto generator = at::detail::createCPUGenerator(1 + accelerator.process_index());
  const at::Tensor x = at::randn({kBatch, kWidth}, generator).to(device),
                   y = at::randn({kBatch, kWidth}, generator).to(device);
  auto step = [&] {
    optimizer.zero_grad(/*set_to_none=*/true);
    accelerator.backward(torch::mse_loss(accel::unit_forward(model, x).to(at::kFloat), y));  // (bf16 out: fp32 loss)
    optimizer.step();
  };
  for (int i = 0; i < 2; ++i) step();  // warm-up: optimizer state exists
  if (checkpoint) {
    namespace fs = std::filesystem;
    const char* base = std::getenv("ACCEL_BENCH_CHECKPOINT_DIR");
    const fs::path dir = fs::path(base ? base : fs::temp_directory_path().string()) / "accel_bench_checkpoint";
    std::vector<double> save[2], load[2];  // [digests off, on]
    for (int t = 0; t < trials; ++t)
      for (const bool digests : {t % 2 == 0, t % 2 != 0}) {
        accel::detail::file_digests_on() = digests;
        accelerator.wait_for_everyone();
        const auto start = std::chrono::steady_clock::now();
        accelerator.save_state(dir);
        accelerator.wait_for_everyone();
        const auto saved = std::chrono::steady_clock::now();
        accelerator.load_state(dir);
        accelerator.wait_for_everyone();
        const auto loaded = std::chrono::steady_clock::now();
        save[digests].push_back(std::chrono::duration<double, std::milli>(saved - start).count());
        load[digests].push_back(std::chrono::duration<double, std::milli>(loaded - saved).count());
      }
    accel::detail::file_digests_on() = true;
    if (accelerator.is_main_process()) fs::remove_all(dir);
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    if (accelerator.is_main_process())
      for (const bool digests : {true, false})
        for (const auto& [figure, times] : {std::pair{"save", save[digests]}, std::pair{"load", load[digests]}})
          std::printf("CSV,checkpoint_%s_ms,%d,%s%s,%lld,%.6g,ms\n", figure, accelerator.num_processes(),
                      variant.c_str(), digests ? "" : "_no_digests", static_cast<long long>(params), median(times));
    std::fflush(stdout);
    accel::DistributedInterface::instance().destroy();
    return 0;
  }

  // Held by tensors, between two steps.
  int64_t param_bytes = 0, grad_bytes = 0, state_bytes = 0;
  for (const auto& p : model->parameters()) {
    bool holds = false;  // none at rest under FULL_SHARD, where newer LibTorch keeps the
    try {                // storage's size but refuses even to show its data pointer
      holds = p.storage().data() != nullptr;
    } catch (const c10::Error&) {
    }
    if (holds) param_bytes += static_cast<int64_t>(p.storage().nbytes());
    grad_bytes += bytes_of(p.grad());
  }
  for (const auto& group : adam->param_groups())
    for (const auto& p : group.params())
      if (accelerator.sharding_strategy() != accel::ShardingStrategy::NO_SHARD) {
        param_bytes += bytes_of(p);  // the shards
        grad_bytes += bytes_of(p.grad());
      }
  for (const auto& entry : adam->state()) {
    const auto& s = static_cast<torch::optim::AdamParamState&>(*entry.second);
    state_bytes += bytes_of(s.exp_avg()) + bytes_of(s.exp_avg_sq()) + bytes_of(s.max_exp_avg_sq());
  }
  const int64_t between_steps = counting.live();
  // Of those, the sharding engine's working buffers, kept for the next step (DataParallel::buffer_bytes).
  const int64_t buffers = accelerator.data_parallel(model) ? accelerator.data_parallel(model)->buffer_bytes() : 0;

  const double rss_between = resident_mb();
  if (!device.is_cuda()) reset_peak_resident();
  std::vector<double> times;
  counting.reset_peak();
  const double cpu_start = process_cpu_ms();
  for (int t = 0; t < trials; ++t) {
    accelerator.wait_for_everyone();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    accel::synchronize();  // the device's queued work (nothing on the CPU)
    accelerator.wait_for_everyone();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
                    steps);
  }
  // CPU time of every thread of this process (the compute thread, Gloo's and
  // the engine's), per step: with more busy threads than cores the step's
  // wall time is this work shared out, and unlike wall time it does not swing
  // with the scheduler.
  const double cpu_per_step = (process_cpu_ms() - cpu_start) / (trials * steps);
  std::sort(times.begin(), times.end());
  const int64_t peak = counting.peak();

  const double mb = 1024.0 * 1024.0;
  auto report = [&](const char* figure, double value, const char* unit, accel::ReduceOp op = accel::ReduceOp::MAX) {
    value = accel::all_reduce(value, op);
    if (accelerator.is_main_process())
      std::printf("CSV,sharding_%s,%d,%s,%lld,%.6g,%s\n", figure, accelerator.num_processes(), variant.c_str(),
                  static_cast<long long>(params), value, unit);
  };
  report("params_mb", static_cast<double>(param_bytes) / mb, "MiB");
  report("grads_mb", static_cast<double>(grad_bytes) / mb, "MiB");
  report("optimizer_mb", static_cast<double>(state_bytes) / mb, "MiB");
  if (!device.is_cuda()) {  // CPU bytes only
    report("between_steps_mb", static_cast<double>(between_steps) / mb, "MiB");
    report("buffers_mb", static_cast<double>(buffers) / mb, "MiB");
    report("peak_mb", static_cast<double>(peak) / mb, "MiB");
    report("rss_between_mb", rss_between - rss_before, "MiB");  // as Python's: what training added
    report("rss_peak_mb", resident_mb("VmHWM") - rss_before, "MiB");
  }
  report("step_ms", times[times.size() / 2], "ms");
  report("cpu_ms", cpu_per_step, "ms", accel::ReduceOp::SUM);  // all processes together
  std::fflush(stdout);
  accel::DistributedInterface::instance().destroy();
}
