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
// A variant starting with gpt_ (gpt_no_shard, gpt_full_shard) trains a
// small GPT-2-shaped decoder instead (tests/gpt_model.hpp: 4 blocks, hidden
// 64, 4 heads, a vocabulary of 512, its head tied to the token embedding;
// 8 sequences of 64 tokens per process, next-token cross entropy), a
// FULL_SHARD unit per block (about 50K parameters each) and the root holding
// the embeddings, the final norm and the tie: where each unit's collectives
// are latency, not bandwidth (bench_sharding.py's gpt_ variants: DDP and
// FSDP2 on the same model).
//
// forward_ms, backward_ms (with finish(): the wait for the reduction),
// optimizer_ms: the step's phases, medians. Every process prints the last
// step's bucket timeline (TIMELINE lines, see print_timeline). With
// "collectives" after <steps>: then the step's collectives alone (see
// time_collectives_alone).
//
//     bench_sharding [gpt_]<no_shard|shard_grad_op|full_shard|full_shard_bf16|hybrid_shard>[_fused] <trials> <steps> [collectives]
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
#include "../gpt_model.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <time.h>

namespace {
constexpr int64_t kWidth = 2048, kLayers = 4, kBatch = 16;
// The gpt_ variants' model and batch (bench_sharding.py's GPT_*).
constexpr training_fixtures::GptOptions kGpt{.vocab = 512, .positions = 64, .width = 64, .heads = 4, .layers = 4};
constexpr int64_t kGptBatch = 8, kGptTime = 64;

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
// The last step's bucket timeline (DataParallel::bucket_timeline), on every
// process, as lines
//     TIMELINE,<world>,<variant>,<rank>,<bucket>,<bytes>,<ready>,<issued>,<waiting>,<landed>,<forward_ms>,<backward_ms>,<finish_began>
// in ms since the backward was armed; the forward ran the <forward_ms> before
// that, and the backward (with finish) took <backward_ms>. tests/bench/plot_timeline.sh
// draws them. Printed in rank order (one process at a time, a barrier between).
void print_timeline(accel::Accelerator& accelerator, const accel::detail::dp::BackwardTimeline& timeline,
                    const std::array<double, 3>& phases, const std::string& variant) {
  for (int rank = 0; rank < accelerator.num_processes(); ++rank) {
    if (rank == accelerator.process_index()) {
      for (std::size_t b = 0; b < timeline.buckets.size(); ++b) {
        const auto& t = timeline.buckets[b];
        std::printf("TIMELINE,%d,%s,%d,%zu,%lld,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f\n", accelerator.num_processes(),
                    variant.c_str(), rank, b, static_cast<long long>(t.bytes), t.ready, t.issued, t.waiting, t.landed,
                    phases[0], phases[1], timeline.finish_began);
      }
      std::fflush(stdout);
    }
    accelerator.wait_for_everyone();
  }
}

// The step's collectives alone, with no compute: the same buckets (their
// sizes from the last step's timeline), each issued as the step issues it,
// all waited for at the end; wall and CPU time per process per step
// (medians of `trials` rounds of `steps`):
//   NO_SHARD: each bucket all-reduced by Gloo (what the step runs for
//     buckets above dp/reducer.hpp's all_reduces_directly sizes), and each
//     point to point (what it runs below them: a reduce-scatter then an
//     all-gather, distributed/direct_all_reduce.hpp; the same bytes as a
//     ring), whatever their sizes;
//   FULL_SHARD and HYBRID_SHARD: each unit's bucket gathered twice (forward,
//     backward) and reduce-scattered, point to point as the engine runs them
//     (the replicate group's all-reduce of HSDP left out); SHARD_GRAD_OP
//     each bucket reduce-scattered and gathered once.
// Lines: CSV,sharding_collectives_ms / sharding_collectives_cpu_ms,<world>,<variant>[_p2p],...
void time_collectives_alone(accel::Accelerator& accelerator, const accel::DataParallel& dp, const std::string& variant,
                            int trials, int steps) {
  namespace ad = accel::detail;
  const accel::GroupPtr group = dp.sharded() ? dp.shard_group() : dp.group();
  c10d::ProcessGroup& g = *group;
  const int S = g.getSize(), me = g.getRank();
  std::vector<at::Tensor> buffers, rows;
  for (const auto& t : dp.bucket_timeline().buckets) {
    const int64_t n = (t.bytes / 4 + S - 1) / S * S;  // (float32, whole chunks)
    buffers.push_back(at::randn({n}));
    rows.push_back(at::empty({S, n / S}));
  }
  // One bucket point to point: phase 1 sends each peer its chunk (reduce-scatter) or this rank's chunk to every
  // peer (all-gather). A distinct tag per bucket and phase: nothing else runs on these ranks meanwhile.
  auto exchange = [&](std::size_t k, bool scatter) {
    const int64_t c = rows[k].size(1);
    return ad::start_exchange_pieces(
        g, 1, [&](int to, std::size_t) { return buffers[k].narrow(0, (scatter ? to : me) * c, c); },
        [&](int from, std::size_t) { return scatter ? rows[k][from] : buffers[k].narrow(0, from * c, c); },
        1000 + 2 * static_cast<int>(k) + (scatter ? 0 : 1), scatter ? ad::kDirectScatter : ad::kDirectGather);
  };
  auto fold = [&](std::size_t k) {
    const int64_t c = rows[k].size(1);
    rows[k][me].copy_(buffers[k].narrow(0, me * c, c));
    at::Tensor mine = buffers[k].narrow(0, me * c, c);
    at::sum_out(mine, rows[k], {0});
  };
  using Waits = std::vector<std::function<void()>>;
  auto keep = [](Waits& waits, auto pending) {
    auto held = std::make_shared<decltype(pending)>(std::move(pending));
    waits.push_back([held] { held->wait(); });
  };
  auto one_step = [&](bool p2p) {
    Waits waits;
    if (!dp.sharded() && !p2p) {
      for (auto& b : buffers) keep(waits, accel::all_reduce_async(b, accel::ReduceOp::SUM, group));
    } else if (!dp.sharded()) {  // every first phase issued, then every second (as the step's finish does)
      using First = decltype(ad::start_all_reduce_direct(g, buffers[0], rows[0], 0));
      std::vector<First> firsts;
      for (std::size_t k = 0; k < buffers.size(); ++k)
        firsts.push_back(ad::start_all_reduce_direct(g, buffers[k], rows[k], 1000));
      for (auto& first : firsts) keep(waits, first.wait());
    } else {
      const int gathers = dp.unit_count() > 0 ? 2 : 1;
      for (int pass = 0; pass < gathers; ++pass)  // (forward, then backward: each unit gathered as it runs)
        for (std::size_t k = 0; k < buffers.size(); ++k) exchange(k, false).wait();
      for (std::size_t k = 0; k < buffers.size(); ++k) {
        keep(waits, exchange(k, true));
        if (k > 0) waits[k - 1]();
        if (k > 0) fold(k - 1);
      }
      waits.back()();
      fold(buffers.size() - 1);
      waits.clear();
    }
    for (auto& wait : waits) wait();
  };
  for (const bool p2p : {false, true}) {
    if (p2p && dp.sharded()) continue;  // (the sharded step is point to point already)
    one_step(p2p);  // warm-up
    std::vector<double> wall, cpu;
    for (int t = 0; t < trials; ++t) {
      accelerator.wait_for_everyone();
      const double cpu_start = process_cpu_ms();
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) one_step(p2p);
      wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
                     steps);
      cpu.push_back((process_cpu_ms() - cpu_start) / steps);
    }
    std::sort(wall.begin(), wall.end());
    std::sort(cpu.begin(), cpu.end());
    const double w = accel::all_reduce(wall[wall.size() / 2], accel::ReduceOp::MAX),
                 c = accel::all_reduce(cpu[cpu.size() / 2], accel::ReduceOp::SUM) / accelerator.num_processes();
    if (accelerator.is_main_process())
      for (const auto& [figure, value] : {std::pair{"collectives_ms", w}, std::pair{"collectives_cpu_ms", c}})
        std::printf("CSV,sharding_%s,%d,%s%s,0,%.6g,ms\n", figure, accelerator.num_processes(), variant.c_str(),
                    p2p ? "_p2p" : "", value);
    std::fflush(stdout);
  }
}
}  // namespace

int main(int argc, char** argv) {
  const std::string variant_name = argc > 1 ? argv[1] : "shard_grad_op";
  const bool fused = variant_name.ends_with("_fused"), gpt = variant_name.starts_with("gpt_");
  const std::string strategy = variant_name.substr(gpt ? 4 : 0, variant_name.size() - (gpt ? 4 : 0) - (fused ? 6 : 0));
  const int trials = argc > 2 ? std::stoi(argv[2]) : 3;
  const bool checkpoint = argc > 3 && std::string(argv[3]) == "checkpoint";
  const bool collectives_alone = argc > 4 && std::string(argv[4]) == "collectives";
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
  if (gpt) config.auto_wrap_policy = training_fixtures::gpt_blocks;  // a unit per block, the tie at the root
  accel::Accelerator accelerator(config);
  const double rss_before = resident_mb();  // (LibTorch and the process group: what no variant changes)
  torch::manual_seed(0);
  torch::nn::Sequential mlp{nullptr};
  training_fixtures::Gpt decoder{nullptr};
  if (gpt) {
    decoder = training_fixtures::Gpt(kGpt);
  } else {
    mlp = torch::nn::Sequential();
    for (int64_t i = 0; i < kLayers; ++i) {
      mlp->push_back(torch::nn::Linear(kWidth, kWidth));
      mlp->push_back(torch::nn::ReLU());
    }
  }
  torch::nn::Module& model = gpt ? static_cast<torch::nn::Module&>(*decoder) : *mlp;
  std::unique_ptr<torch::optim::Optimizer> adam;
  if (fused) adam = std::make_unique<accel::FusedAdam>(model.parameters(), torch::optim::AdamOptions(1e-4));
  else adam = std::make_unique<torch::optim::Adam>(model.parameters(), torch::optim::AdamOptions(1e-4));
  if (gpt) accelerator.prepare(decoder);
  else accelerator.prepare(mlp);
  accel::AcceleratedOptimizer optimizer = accelerator.prepare(*adam);
  std::vector<at::Tensor> tensors;  // each parameter once (LibTorch lists a tied tensor once per name)
  for (const auto& p : model.parameters())
    if (std::none_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) { return t.is_same(p); }))
      tensors.push_back(p);
  int64_t params = 0;
  for (const auto& p : tensors) params += p.numel();
  const at::Device device = accelerator.device();
  const std::string variant =  // "_cuda_gloo": Gloo on CUDA tensors (ACCEL_BACKEND=gloo, processes sharing one GPU)
      variant_name + (!device.is_cuda()                                             ? ""
                      : accel::DistributedInterface::instance().backend() == "gloo" ? "_cuda_gloo"
                                                                                    : "_cuda");
  auto generator = at::detail::createCPUGenerator(1 + accelerator.process_index());
  const at::Tensor x = gpt ? at::Tensor() : at::randn({kBatch, kWidth}, generator).to(device),
                   y = gpt ? at::Tensor() : at::randn({kBatch, kWidth}, generator).to(device),
                   tokens = gpt ? at::randint(kGpt.vocab, {kGptBatch, kGptTime}, generator).to(device) : at::Tensor();
  auto forward_loss = [&] {
    if (gpt) return training_fixtures::next_token_loss(decoder(tokens), tokens);
    return torch::mse_loss(accel::unit_forward(mlp, x).to(at::kFloat), y);  // (bf16 out: fp32 loss)
  };
  // Each step's phases (ms): forward, backward (with the reduction's wait, finish()), optimizer step.
  std::vector<std::array<double, 3>> phases;
  auto step = [&] {
    using Clock = std::chrono::steady_clock;
    optimizer.zero_grad(/*set_to_none=*/true);
    const auto t0 = Clock::now();
    const at::Tensor loss = forward_loss();
    const auto t1 = Clock::now();
    accelerator.backward(loss);
    const auto t2 = Clock::now();
    optimizer.step();
    const auto t3 = Clock::now();
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    phases.push_back({ms(t0, t1), ms(t1, t2), ms(t2, t3)});
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
  for (const auto& p : tensors) {
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
  const int64_t buffers = accelerator.data_parallel() ? accelerator.data_parallel()->buffer_bytes() : 0;

  const double rss_between = resident_mb();
  if (!device.is_cuda()) reset_peak_resident();
  std::vector<double> times;
  phases.clear();
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
  for (std::size_t k = 0; k < 3; ++k) {  // the phases' medians (the slowest process's)
    std::vector<double> phase;
    for (const auto& p : phases) phase.push_back(p[k]);
    std::sort(phase.begin(), phase.end());
    report(k == 0 ? "forward_ms" : k == 1 ? "backward_ms" : "optimizer_ms", phase[phase.size() / 2], "ms");
  }
  if (const accel::DataParallel* dp = accelerator.data_parallel(); dp && dp->distributed()) {
    print_timeline(accelerator, dp->bucket_timeline(), phases.back(), variant);
    if (collectives_alone) time_collectives_alone(accelerator, *dp, variant, trials, steps);
  }
  report("cpu_ms", cpu_per_step, "ms", accel::ReduceOp::SUM);  // all processes together
  std::fflush(stdout);
  accel::DistributedInterface::instance().destroy();
}
