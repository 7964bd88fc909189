// accel/training/dp/timeline.hpp: when each gradient bucket of the last synced backward was ready, issued, waited for and landed.
//
// Whether communication hides behind compute is a question of times: a
// bucket's reduction can only overlap the backward if it is issued well
// before the backward ends and lands before anyone waits for it. The
// engine stamps four moments per bucket in every synced backward (a clock
// read each, nothing else), and DataParallel::bucket_timeline() returns
// those of the last one, for benchmarks and profiling
// (tests/bench/bench_sharding.cpp plots them: docs/benchmarks.md).
#pragma once

#include "accel/training/torch_nn.hpp"

#include <chrono>

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// One bucket's moments, in ms since the backward was armed
// (DataParallel::prepare_for_backward, just before autograd starts):
//   ready:   its last gradient arrived;
//   issued:  its reduction was handed to the backend (every bucket before
//            it too: ranks issue in the same order);
//   waiting: the engine began to wait for it (in finish(), or under
//            sharding when one more bucket in flight would be too many);
//   landed:  that wait returned: the reduction was complete, at the latest
//            then (where waiting and landed are equal it had landed before
//            anyone waited: the communication was hidden).
// A moment that did not happen stays -1: `ready` of a bucket that finish()
// issued because some gradient never arrived (a parameter no loss used).
// A backward under no_sync arms nothing and leaves the last synced one's.
struct BucketTimes {
  double ready = -1, issued = -1, waiting = -1, landed = -1;
  int64_t bytes = 0;  // what it reduces: its gradients and used-flags
};
struct BackwardTimeline {
  std::vector<BucketTimes> buckets;
  double finish_began = -1, finished = -1;  // DataParallel::finish(): called, returned
};

// The stamps, kept in the State: the clock's zero and the times so far.
struct TimelineClock {
  using Clock = std::chrono::steady_clock;
  Clock::time_point armed{};
  BackwardTimeline times{};
  void arm(std::size_t buckets) {
    armed = Clock::now();
    times.buckets.assign(buckets, BucketTimes{});
    times.finish_began = times.finished = -1;
  }
  double now() const { return std::chrono::duration<double, std::milli>(Clock::now() - armed).count(); }
  // (a bucket index past what arm() laid out: a backward that was never armed, not recorded)
  void stamp(std::size_t b, double BucketTimes::* moment) {
    if (b < times.buckets.size()) times.buckets[b].*moment = now();
  }
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END
