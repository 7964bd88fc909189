// accel/distributed/work.hpp: accel::Work: an operation in flight, what the _async forms return.
//
// Asynchronous work. The _async forms issue the operation at once, in
// call order like every collective (so ranks must still call them in the
// same order), and return an accel::Work<R> instead of R.
#pragma once

#include "accel/distributed/pending.hpp"
#include "accel/distributed/pieces.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What every accel::Work holds whatever its result: the operation's group
// (kept alive while it runs) and c10d Work, and how to tell completion.
class WorkCore {
 public:
  WorkCore(c10d::ProcessGroup* group, const char* op, c10::intrusive_ptr<c10d::Work> work)
      : group_(group ? GroupPtr::unsafe_reclaim_from_nonowning(group) : GroupPtr()), op_(op), work_(std::move(work)) {
    // Gloo's send and recv (also those of a direct all-gather, reduce-scatter or all-reduce, pieces.hpp)
    // report completion only from inside wait() (their isCompleted() stays
    // false until then, and a wait with a timeout that expires closes every
    // connection of the group): a thread of our own waits for them once
    // someone asks without waiting.
    watched_ = work_ && group_->getBackendName() == "gloo" && point_to_point(op);
  }
  WorkCore(const WorkCore&) = delete;
  WorkCore& operator=(const WorkCore&) = delete;
  virtual ~WorkCore() = default;  // a watcher thread is joined by its future

  bool completed() {
    if (!work_) return true;
    if (!watched_) return work_->isCompleted();
    watch();
    return watcher_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  bool wait_for(std::chrono::milliseconds timeout) {
    if (completed() || timeout <= std::chrono::milliseconds(0)) return completed();  // (c10d reads 0 as "for ever")
    if (watched_) return watcher_.wait_for(timeout) == std::future_status::ready;
    if (group_->getBackendName() == "gloo") {
      // Gloo's collectives wait on a condition variable; one that times out
      // throws "Operation timed out!" and changes nothing. A failure of the
      // operation itself is thrown again by wait().
      try {
        work_->wait(timeout);
      } catch (const std::exception&) {
      }
      return work_->isCompleted();
    }
    // Other backends (NCCL: completion of the device work) are asked until
    // the deadline, at most every millisecond.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto pause = std::chrono::microseconds(20); std::chrono::steady_clock::now() < deadline;
         pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1))) {
      if (work_->isCompleted()) return true;
      std::this_thread::sleep_for(pause);
    }
    return work_->isCompleted();
  }

  // Waits for the operation; a failure becomes the DistributedError its
  // blocking form throws.
  void wait() {
    if (!work_) return;
    if (!watched_ || !watcher_.valid()) return await(op_, *group_, *work_);
    try {
      watcher_.get();
    } catch (const std::exception& e) {
      throw failure(op_, *group_, e);
    }
  }

 private:
  void watch() {
    if (!watcher_.valid()) watcher_ = std::async(std::launch::async, &wait_on, op_, group_, work_);
  }
  // A function, not a lambda, for the reason make_group_of (rendezvous.hpp)
  // gives: the thread's body is reached from every virtual call in a file.
  // (bounded by the group's timeout: a live peer that never sends ends it too)
  static void wait_on(const char* op, GroupPtr group, c10::intrusive_ptr<c10d::Work> work) {
    wait_bounded(op, *group, *work);
  }

  GroupPtr group_;
  const char* op_;
  c10::intrusive_ptr<c10d::Work> work_;
  bool watched_ = false;
  std::future<void> watcher_;
};

template <class R>
class WorkOf : public WorkCore {
 public:
  using WorkCore::WorkCore;
  virtual R land() = 0;
};
template <class R, class Land>
class PendingWork final : public WorkOf<R> {
 public:
  explicit PendingWork(Pending<Land>&& pending)
      : WorkOf<R>(pending.group, pending.op, std::move(pending.work)), land_(std::move(pending.land)) {}
  R land() override { return land_(); }

 private:
  Land land_;
};
}  // namespace detail

// An operation in flight (torch.distributed's Work, with its result): what an
// _async form returns. It owns every buffer the operation uses, so the
// caller's data may go out of scope. Move-only; not for concurrent use from
// several threads (as std::future).
//   R wait()              waits and returns the result (as the blocking form
//                         does; a tensor passed in holds it from then on);
//                         failures throw the blocking form's DistributedError.
//                         Once, as std::future::get: a second wait() is a
//                         LogicError, and valid() is false afterwards.
//   bool wait_for(ms)     waits at most ms; true once the operation completed
//                         (wait() then returns at once, or throws its error),
//                         and after wait() (as torch's Work).
//   bool is_completed()   wait_for without waiting.
// A default-constructed or moved-from Work holds no operation: asking it
// anything is a LogicError.
// Destroying a Work that was never waited for waits for the operation (its
// buffers must outlive it) and lands it (a tensor passed in holds the
// result) but drops what wait() would return; a failure is then printed to
// stderr, as nothing else can report it.
template <class R>
class Work {
 public:
  Work() = default;
  template <class Land>
  explicit Work(detail::Pending<Land> pending)
      : flight_(std::make_unique<detail::PendingWork<R, Land>>(std::move(pending))) {}
  Work(Work&& other) noexcept : flight_(std::move(other.flight_)), waited_(std::exchange(other.waited_, false)) {}
  Work& operator=(Work&& other) noexcept {
    if (this != &other) {
      abandon();
      flight_ = std::move(other.flight_);
      waited_ = std::exchange(other.waited_, false);
    }
    return *this;
  }
  ~Work() { abandon(); }

  bool valid() const noexcept { return flight_ != nullptr; }
  R wait() {
    if (waited_)
      throw LogicError(
          "accel::Work::wait: already waited for; wait() returns the result once (as std::future::get), "
          "is_completed() and wait_for() stay true");
    std::unique_ptr<detail::WorkOf<R>> flight = std::move(flight_);
    if (!flight) throw_empty("wait");
    waited_ = true;  // also when the operation failed: it ended, and wait() reported how
    flight->wait();
    return flight->land();
  }
  bool wait_for(std::chrono::milliseconds timeout) {
    if (waited_) return true;
    if (!flight_) throw_empty("wait_for");
    return flight_->wait_for(timeout);
  }
  bool is_completed() {
    if (waited_) return true;
    if (!flight_) throw_empty("is_completed");
    return flight_->completed();
  }

 private:
  [[noreturn]] static void throw_empty(const char* member) {
    throw LogicError(std::string("accel::Work::") + member +
                     ": this Work holds no operation (default-constructed or moved from)");
  }
  void abandon() noexcept {
    if (!flight_) return;
    try {
      flight_->wait();
      flight_->land();  // in place: the caller's tensor holds the result
    } catch (const std::exception& e) {
      std::cerr << "accel: " << detail::error_text(e) << " (its accel::Work was destroyed without wait())" << std::endl;
    }
    flight_.reset();
  }

  std::unique_ptr<detail::WorkOf<R>> flight_;
  bool waited_ = false;  // wait() was called: completed from then on
};

ACCEL_NAMESPACE_END
