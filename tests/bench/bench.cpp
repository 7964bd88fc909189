// accel.hpp benchmarks, side by side with raw c10d in the same process.
// Launch with tests/launch.cpp; rank 0 prints one CSV line per figure:
//   CSV,<part>,<world>,<variant>,<size>,<value>,<unit>
// Timings are medians over interleaved trials (A, B, A, B, ...), so both
// variants see the same machine noise. tests/bench/run_bench.sh drives it.
//
//   bench overhead | bandwidth | batching | mesh | alloc | collectives | all_reduce_paths | gpu_all_reduce
//         | callgrind <calls> [all_reduce|all_to_all]

#include "accel.hpp"

#include "../counting_allocator.hpp"

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define ACCEL_BENCH_HAS_CALLGRIND 1
#else
#define ACCEL_BENCH_HAS_CALLGRIND 0
#endif

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using accel::ReduceOp;

// Starts counting a group's collectives (as tests/test_helpers.hpp's
// start_sequence: LibTorch 2.15 always counts and dropped the call).
template <class Group>
void start_sequence(const c10::intrusive_ptr<Group>& g) {
  if constexpr (requires { g->setSequenceNumberForGroup(); }) g->setSequenceNumberForGroup();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int world_size() { return accel::get_world_size(); }
bool is_rank0() { return accel::get_rank() == 0; }

void csv(const std::string& part, const std::string& variant, long long size, double value, const char* unit) {
  if (is_rank0())
    std::printf("CSV,%s,%d,%s,%lld,%.6g,%s\n", part.c_str(), world_size(), variant.c_str(), size, value, unit);
}

// Seconds per call of each variant: `trials` rounds, each variant run `reps`
// times per round, in alternating order. A barrier lines the ranks up first.
std::vector<double> interleaved(const std::vector<std::function<void()>>& variants, int trials, int reps) {
  std::vector<std::vector<double>> samples(variants.size());
  auto group = accel::DistributedInterface::instance().world_group();
  for (int t = 0; t < trials; ++t) {
    for (std::size_t k = 0; k < variants.size(); ++k) {
      std::size_t v = (t % 2 == 0) ? k : variants.size() - 1 - k;  // A,B then B,A
      accel::barrier(group);
      auto start = Clock::now();
      for (int r = 0; r < reps; ++r) variants[v]();
      samples[v].push_back(std::chrono::duration<double>(Clock::now() - start).count() / reps);
    }
  }
  std::vector<double> medians;
  for (auto& s : samples) medians.push_back(median(s));
  return medians;
}

void raw_allreduce(c10d::ProcessGroup& pg, at::Tensor& t) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  pg.allreduce(tensors, opts)->wait();
}

// NCCL on a GPU (tests/gpu/run_gpu.sh, a world of one): all_reduce through
// accel and through c10d, each followed by a device synchronisation (NCCL
// only queues the work on its stream), on a CUDA tensor and on CPU data
// staged through the device. c10d's NCCL takes no CPU tensor: that
// reference copies to the GPU and back by hand, as accel does for it.
void gpu_all_reduce() {
  auto g = accel::DistributedInterface::instance().world_group();
  const c10::Device device = accel::get_current_device();
  for (long long bytes = 1LL << 20; bytes <= (256LL << 20); bytes *= 4) {
    const long long n = bytes / 4;
    const int reps = static_cast<int>(std::clamp<long long>((1LL << 30) / bytes / 4, 2, 100));
    at::Tensor on_device = at::ones({n}, at::TensorOptions().device(device)), host = at::ones({n});
    auto m = interleaved({[&] {
                            raw_allreduce(*g, on_device);
                            accel::synchronize();
                          },
                          [&] {
                            accel::all_reduce(on_device, ReduceOp::SUM, g);
                            accel::synchronize();
                          },
                          [&] {
                            at::Tensor staged = host.to(device);
                            raw_allreduce(*g, staged);
                            host.copy_(staged);
                          },
                          [&] { accel::all_reduce(host, ReduceOp::SUM, g); }},
                         11, reps);
    csv("gpu_all_reduce", "raw_c10d", bytes, m[0] * 1e6, "us");
    csv("gpu_all_reduce", "accel_tensor", bytes, m[1] * 1e6, "us");
    csv("gpu_all_reduce_staged", "raw_c10d", bytes, m[2] * 1e6, "us");
    csv("gpu_all_reduce_staged", "accel_tensor", bytes, m[3] * 1e6, "us");
  }
}

void overhead() {
  auto& dist = accel::DistributedInterface::instance();
  auto g = dist.world_group();
  at::Tensor t = at::ones({1});
  // raw_c10d_again runs the very same code as raw_c10d: its ratio is the
  // resolution of this measurement on this machine (an A/A control).
  auto m = interleaved({[&] { raw_allreduce(*g, t); }, [&] { accel::all_reduce(t, ReduceOp::SUM, g); },
                        [&] { dist.all_reduce(t, ReduceOp::SUM, accel::Dim::DP); }, [&] { raw_allreduce(*g, t); }},
                       31, 2000);
  csv("overhead", "raw_c10d", 4, m[0] * 1e6, "us");
  csv("overhead", "accel_all_reduce", 4, m[1] * 1e6, "us");
  csv("overhead", "accel_interface_dp", 4, m[2] * 1e6, "us");
  csv("overhead", "raw_c10d_again", 4, m[3] * 1e6, "us");
}

void bandwidth() {
  auto g = accel::DistributedInterface::instance().world_group();
  const int P = g->getSize();
  for (long long bytes = 4 << 10; bytes <= (64LL << 20); bytes *= 4) {
    const long long n = bytes / 4;
    const int reps = static_cast<int>(std::clamp<long long>((256LL << 20) / bytes / 8, 2, 200));
    const int trials = bytes >= (1LL << 20) ? 15 : 11;
    at::Tensor t = at::ones({n});
    std::vector<float> vec(static_cast<std::size_t>(n), 1.0f);
    // all_reduce: raw tensor, accel tensor, accel std::vector.
    auto ar = interleaved({[&] { raw_allreduce(*g, t); }, [&] { accel::all_reduce(t, ReduceOp::SUM, g); },
                           [&] { vec = accel::all_reduce(std::move(vec), ReduceOp::SUM, g); }},
                          trials, reps);
    csv("all_reduce", "raw_c10d", bytes, ar[0] * 1e6, "us");
    csv("all_reduce", "accel_tensor", bytes, ar[1] * 1e6, "us");
    csv("all_reduce", "accel_vector", bytes, ar[2] * 1e6, "us");
    // all_gather returns a new result, so its reference allocates c10d's P
    // outputs per call; all_gather_into_tensor reuses a buffer, and so does
    // its reference.
    auto raw_gather = [&](std::vector<std::vector<at::Tensor>>& outs) {
      std::vector<at::Tensor> in{t};
      g->allgather(outs, in)->wait();
    };
    std::vector<std::vector<at::Tensor>> kept{std::vector<at::Tensor>()};
    for (int r = 0; r < P; ++r) kept[0].push_back(at::empty({n}));
    at::Tensor stacked = at::empty({P, n});
    auto fresh_outputs = [&] {
      std::vector<std::vector<at::Tensor>> outs{std::vector<at::Tensor>()};
      for (int r = 0; r < P; ++r) outs[0].push_back(at::empty({n}));
      return outs;
    };
    auto ag = interleaved({[&] {  // the same result as accel::all_gather: one stacked tensor
                             auto outs = fresh_outputs();
                             raw_gather(outs);
                             (void)at::stack(outs[0]);
                           },
                           [&] { (void)accel::all_gather(t, g); },
                           [&] {  // c10d's own result: P separate tensors
                             auto outs = fresh_outputs();
                             raw_gather(outs);
                           },
                           [&] { raw_gather(kept); }, [&] { accel::all_gather_into_tensor(stacked, t, g); }},
                          trials, reps);
    csv("all_gather", "raw_c10d", bytes, ag[0] * 1e6, "us");
    csv("all_gather", "accel_tensor", bytes, ag[1] * 1e6, "us");
    csv("all_gather_list", "raw_c10d", bytes, ag[2] * 1e6, "us");
    csv("all_gather_list", "accel_tensor", bytes, ag[1] * 1e6, "us");
    csv("all_gather_into", "raw_c10d", bytes, ag[3] * 1e6, "us");
    csv("all_gather_into", "accel_tensor", bytes, ag[4] * 1e6, "us");
    auto bc = interleaved({[&] {
                             std::vector<at::Tensor> ts{t};
                             c10d::BroadcastOptions o;
                             o.rootRank = 0;
                             g->broadcast(ts, o)->wait();
                           },
                           [&] { accel::broadcast(t, 0, g); }},
                          trials, reps);
    csv("broadcast", "raw_c10d", bytes, bc[0] * 1e6, "us");
    csv("broadcast", "accel_tensor", bytes, bc[1] * 1e6, "us");
  }
}

// The second-wave collectives against raw c10d doing the same, at 64 KiB,
// 1 MiB and 16 MiB per rank. reduce_scatter: raw all-to-all plus the same
// local sum (the algorithm accel.hpp runs; Gloo in 1.13 has no
// reduce_scatter), and a raw all_reduce of the whole tensor (what one does
// without it). send/recv: a ping-pong between ranks 0 and 1, per round trip.
void collectives() {
  auto g = accel::DistributedInterface::instance().world_group();
  const int P = g->getSize(), rank = g->getRank();
  for (long long bytes : {64LL << 10, 1LL << 20, 16LL << 20}) {
    const long long n = bytes / 4 / P * P;
    const int reps = static_cast<int>(std::clamp<long long>((64LL << 20) / bytes / 4, 2, 100));
    const int trials = 9;
    at::Tensor t = at::ones({n});
    at::Tensor out;
    std::vector<int64_t> splits;
    auto raw_alltoall = [&] {  // a fresh output, as accel.hpp returns one
      out = at::empty({n});
      accel::detail::alltoall_single(*g, out, t, splits, splits)
          ->wait();  // c10d's own call, by its name on this version
    };
    auto rs = interleaved({[&] {
                             raw_alltoall();
                             (void)out.view({P, n / P}).sum(0);
                           },
                           [&] { (void)accel::reduce_scatter(t, ReduceOp::SUM, g); }, [&] { raw_allreduce(*g, t); }},
                          trials, reps);
    csv("reduce_scatter", "raw_c10d_alltoall_sum", bytes, rs[0] * 1e6, "us");
    csv("reduce_scatter", "accel_tensor", bytes, rs[1] * 1e6, "us");
    csv("reduce_scatter", "raw_c10d_allreduce", bytes, rs[2] * 1e6, "us");
    // And into an output kept from call to call (torch's all_to_all_single(out, t), as Python's loop does).
    at::Tensor kept = at::empty({n});
    auto raw_alltoall_kept = [&] { accel::detail::alltoall_single(*g, kept, t, splits, splits)->wait(); };
    auto aa = interleaved({raw_alltoall, [&] { (void)accel::all_to_all(t, g); }, raw_alltoall_kept,
                           [&] { (void)accel::all_to_all_single(kept, t, {}, {}, g); }},
                          trials, reps);
    csv("all_to_all", "raw_c10d", bytes, aa[0] * 1e6, "us");
    csv("all_to_all", "accel_tensor", bytes, aa[1] * 1e6, "us");
    csv("all_to_all_out", "raw_c10d", bytes, aa[2] * 1e6, "us");
    csv("all_to_all_out", "accel_tensor", bytes, aa[3] * 1e6, "us");
    // Ping-pong: rank 0 sends, rank 1 answers; the others wait at the barrier.
    auto raw_pingpong = [&] {
      std::vector<at::Tensor> ts{t};
      if (rank == 0) {
        g->send(ts, 1, 0)->wait();
        g->recv(ts, 1, 0)->wait();
      } else if (rank == 1) {
        g->recv(ts, 0, 0)->wait();
        g->send(ts, 0, 0)->wait();
      }
    };
    auto accel_pingpong = [&] {
      if (rank == 0) {
        accel::send(t, 1, g);
        accel::recv(t, 1, g);
      } else if (rank == 1) {
        accel::recv(t, 0, g);
        accel::send(t, 0, g);
      }
    };
    auto pp = interleaved({raw_pingpong, accel_pingpong}, trials, reps);
    csv("send_recv", "raw_c10d", bytes, pp[0] * 1e6, "us");
    csv("send_recv", "accel_tensor", bytes, pp[1] * 1e6, "us");
  }
}

// Where the data-parallel engine's small buckets cross over from Gloo's
// allreduce (a ring: 2 (P - 1) steps) to the all-reduce point to point
// (distributed/direct_all_reduce.hpp: a reduce-scatter and an all-gather,
// one round of messages each): both on the same float32 tensors, from
// 4 KiB to 16 MiB per rank, one at a time and four in flight (as a step's
// buckets are: every first phase issued, then every second, then waited).
// One intra-op thread per rank, as the sharding benchmark runs.
void all_reduce_paths() {
  namespace ad = accel::detail;
  at::set_num_threads(1);
  auto g = accel::DistributedInterface::instance().world_group();
  const int P = g->getSize();
  for (long long bytes = 4LL << 10; bytes <= (16LL << 20); bytes *= 2) {
    const long long n = bytes / 4;
    const int reps = static_cast<int>(std::clamp<long long>((64LL << 20) / bytes / 4, 2, 200)), trials = 9;
    for (int in_flight : {1, 4}) {
      std::vector<at::Tensor> ts, rows;
      for (int k = 0; k < in_flight; ++k) {
        ts.push_back(at::ones({n}));
        rows.push_back(at::empty({P, (n + P - 1) / P}));
      }
      auto gloo = [&] {
        std::vector<accel::Work<at::Tensor>> works;
        for (auto& t : ts) works.push_back(accel::all_reduce_async(t, ReduceOp::SUM, g));
        for (auto& w : works) w.wait();
      };
      auto direct = [&] {
        using Phase1 = decltype(ad::start_all_reduce_direct(*g, ts[0], rows[0], 0));
        using Phase2 = decltype(std::declval<Phase1&>().wait());
        std::vector<Phase1> scatters;
        std::vector<Phase2> gathers;
        for (int k = 0; k < in_flight; ++k) scatters.push_back(ad::start_all_reduce_direct(*g, ts[k], rows[k], 77));
        for (auto& s : scatters) gathers.push_back(s.wait());
        for (auto& s : gathers) (void)s.wait();
      };
      auto m = interleaved({gloo, direct}, trials, reps);
      const std::string suffix = in_flight == 1 ? "" : "_x" + std::to_string(in_flight);
      csv("all_reduce_paths", "gloo_allreduce" + suffix, bytes, m[0] * 1e6, "us");
      csv("all_reduce_paths", "point_to_point" + suffix, bytes, m[1] * 1e6, "us");
    }
  }
}

// What overlap buys: an all_reduce and an independent matrix multiply, one
// after the other (blocking) or with the all_reduce in flight during the
// multiply (accel's all_reduce_async, and raw c10d's Work as the reference).
// One intra-op thread per rank, so the ranks do not fight over the cores for
// the multiply alone.
void overlap() {
  auto g = accel::DistributedInterface::instance().world_group();
  at::set_num_threads(1);
  const at::Tensor a = at::rand({384, 384}), b = at::rand({384, 384});
  for (long long bytes : {1LL << 20, 16LL << 20}) {
    at::Tensor t = at::ones({bytes / 4});
    const int reps = bytes > (1 << 20) ? 3 : 10, trials = 9;
    auto m = interleaved({[&] { accel::all_reduce(t, ReduceOp::SUM, g); }, [&] { (void)at::mm(a, b); },
                          [&] {
                            accel::all_reduce(t, ReduceOp::SUM, g);
                            (void)at::mm(a, b);
                          },
                          [&] {
                            auto work = accel::all_reduce_async(t, ReduceOp::SUM, g);
                            (void)at::mm(a, b);
                            work.wait();
                          },
                          [&] {
                            std::vector<at::Tensor> ts{t};
                            c10d::AllreduceOptions opts;
                            opts.reduceOp = c10d::ReduceOp::SUM;
                            auto work = g->allreduce(ts, opts);
                            (void)at::mm(a, b);
                            work->wait();
                          }},
                         trials, reps);
    csv("overlap", "all_reduce_only", bytes, m[0] * 1e6, "us");
    csv("overlap", "matmul_only", bytes, m[1] * 1e6, "us");
    csv("overlap", "blocking_then_matmul", bytes, m[2] * 1e6, "us");
    csv("overlap", "accel_async_overlapped", bytes, m[3] * 1e6, "us");
    csv("overlap", "raw_c10d_async_overlapped", bytes, m[4] * 1e6, "us");
  }
}

void batching() {
  auto g = accel::DistributedInterface::instance().world_group();
  for (int n : {1, 100, 10000}) {
    std::vector<double> v(static_cast<std::size_t>(n), 1.0);
    at::Tensor t = at::ones({n}, at::kDouble);
    const int reps = n >= 10000 ? 3 : 20;
    auto m = interleaved({[&] { v = accel::all_reduce(std::move(v), ReduceOp::SUM, g); },
                          [&] {
                            for (double& x : v) x = accel::all_reduce(x, ReduceOp::SUM, g);
                          },
                          [&] { raw_allreduce(*g, t); }},
                         n >= 10000 ? 3 : 9, reps);
    csv("batching", "accel_vector", n, m[0] * 1e6, "us");
    csv("batching", "per_element", n, m[1] * 1e6, "us");
    csv("batching", "raw_c10d_tensor", n, m[2] * 1e6, "us");
    start_sequence(g);
    auto before = g->getSequenceNumberForGroup();
    v = accel::all_reduce(std::move(v), ReduceOp::SUM, g);
    csv("batching_collectives", "accel_vector", n, double(g->getSequenceNumberForGroup() - before), "calls");
  }
}

void mesh() {
  // (2, w/2 | w/2, 2): every dimension has a real group of size > 1.
  const int w = world_size();
  accel::DistributedConfig config{.mp_replicate_size = 2, .cp_size = 2, .timeout = std::chrono::seconds(120)};
  // The first initialisation pays the TCP rendezvous, whose time is luck (a
  // client that connects before rank 0 listens waits for a retry). Time the
  // next one, on the established store: the world group and both meshes.
  // Python's side likewise times its groups after init_process_group, a
  // world-sized one included.
  auto& first = accel::DistributedInterface::instance(accel::DistributedConfig{.timeout = config.timeout});
  first.barrier();
  first.destroy();
  auto start = Clock::now();
  const int before = accel::detail::groups_created().load();
  auto& dist = accel::DistributedInterface::instance(config);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const int groups = accel::detail::groups_created().load() - before;
  // The slowest rank decides when the mesh is ready.
  const double slowest = dist.all_reduce(seconds, ReduceOp::MAX, std::nullopt);
  csv("mesh_init", "accel", w, slowest * 1e3, "ms");
  csv("mesh_groups_per_rank", "accel_subgroups", w, groups - 1, "groups");
  // The timing above includes the rendezvous, whose wait for the last rank
  // to arrive also holds the ranks' spread in leaving destroy(). Python's
  // work alone, from a barrier, through the public calls: a world-sized
  // group and the two meshes.
  std::vector<int> everyone(static_cast<std::size_t>(w));
  std::iota(everyone.begin(), everyone.end(), 0);
  dist.barrier();
  start = Clock::now();
  auto whole = dist.new_group(everyone);
  auto model = dist.init_device_mesh({2, w / 2}, {"mp_replicate", "mp_shard"});
  auto data = dist.init_device_mesh({w / 2, 2}, {"dp", "cp"});
  const double api = std::chrono::duration<double>(Clock::now() - start).count();
  csv("mesh_init", "accel_from_barrier", w, dist.all_reduce(api, ReduceOp::MAX, std::nullopt) * 1e3, "ms");
  dist.destroy();
}

// Bytes requested from ATen's CPU allocator during one call: a contiguous
// std::vector must travel through c10d without a copy.
void alloc() {
  auto g = accel::DistributedInterface::instance().world_group();
  accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();
  counting.install();
  const long long n = 1 << 20;  // 4 MiB of float
  std::vector<float> vec(static_cast<std::size_t>(n), 1.0f);
  at::Tensor t = at::ones({n});
  auto measure = [&](auto&& f) {
    f();  // warm-up
    const int64_t before = counting.total();
    f();
    return counting.total() - before;
  };
  // Positive control: the counter sees an ordinary allocation of the same size.
  csv("alloc_bytes_per_call", "control_at_empty", n * 4, double(measure([&] { (void)at::empty({n}); })), "bytes");
  csv("alloc_bytes_per_call", "raw_c10d_tensor", n * 4, double(measure([&] { raw_allreduce(*g, t); })), "bytes");
  csv("alloc_bytes_per_call", "accel_tensor", n * 4, double(measure([&] { accel::all_reduce(t, ReduceOp::SUM, g); })),
      "bytes");
  csv("alloc_bytes_per_call", "accel_vector", n * 4,
      double(measure([&] { vec = accel::all_reduce(std::move(vec), ReduceOp::SUM, g); })), "bytes");
}

// Instructions per call at world size 1 (run under valgrind --tool=callgrind
// --instr-atstart=no): raw c10d's loop, then accel.hpp's, each counted from
// zero and dumped on its own (the dumps .1 and .2 of the output file), so one
// process (one start of LibTorch under valgrind, most of a run's time) counts
// both. `what`: "all_reduce" (one float; tests/callgrind_overhead.sh) or
// "all_to_all" (all_to_all_single into a kept output of 1024 floats against
// c10d's alltoall_base into it, as part 8 compares them: measured by hand,
// not by a test).
void callgrind(int calls, const std::string& what) {
#if !ACCEL_BENCH_HAS_CALLGRIND
  (void)calls;
  (void)what;
  throw std::runtime_error("bench was built without <valgrind/callgrind.h> (Debian: valgrind)");
#else
  auto& dist = accel::DistributedInterface::instance();
  auto g = dist.world_group();
  at::Tensor t = at::ones({what == "all_to_all" ? 1024 : 1}), kept = at::empty_like(t);
  std::vector<int64_t> splits;
  std::function<void()> raw = [&] { raw_allreduce(*g, t); };
  std::function<void()> ours = [&] { accel::all_reduce(t, ReduceOp::SUM, g); };
  if (what == "all_to_all") {
    raw = [&] { accel::detail::alltoall_single(*g, kept, t, splits, splits)->wait(); };
    ours = [&] { (void)accel::all_to_all_single(kept, t, {}, {}, g); };
  } else if (what != "all_reduce") {
    throw std::runtime_error("bench callgrind: all_reduce or all_to_all, not " + what);
  }
  for (int i = 0; i < 100; ++i) raw();  // warm-up, uncounted
  CALLGRIND_START_INSTRUMENTATION;
  CALLGRIND_ZERO_STATS;
  for (int i = 0; i < calls; ++i) raw();
  CALLGRIND_DUMP_STATS_AT("raw");
  for (int i = 0; i < calls; ++i) ours();
  CALLGRIND_DUMP_STATS_AT("accel");
  CALLGRIND_STOP_INSTRUMENTATION;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const std::string part = argc > 1 ? argv[1] : "";
  if (part == "mesh") {
    mesh();
    return 0;
  }
  accel::DistributedInterface::instance(accel::DistributedConfig{.timeout = std::chrono::seconds(120)});
  if (part == "overhead") overhead();
  else if (part == "bandwidth") bandwidth();
  else if (part == "batching") batching();
  else if (part == "alloc") alloc();
  else if (part == "collectives") collectives();
  else if (part == "gpu_all_reduce") gpu_all_reduce();
  else if (part == "overlap") overlap();
  else if (part == "all_reduce_paths") all_reduce_paths();
  else if (part == "callgrind" && argc > 2) callgrind(std::atoi(argv[2]), argc > 3 ? argv[3] : "all_reduce");
  else {
    std::fprintf(stderr,
                 "usage: bench overhead|bandwidth|batching|mesh|alloc|collectives|all_reduce_paths|overlap|"
                 "gpu_all_reduce|callgrind <calls> [all_reduce|all_to_all]\n");
    return 2;
  }
  accel::DistributedInterface::instance().destroy();
  return 0;
}
