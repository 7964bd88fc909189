// accel/distributed/issue.hpp: debug mode, the group registry, issuing c10d operations, their errors.
//
// A null group means the world group of DistributedInterface, or identity
// when the process is not distributed. `src` is a rank within the group.
//
// Debug mode (ACCEL_DEBUG_MODE=1, or set_debug_mode(true)) makes every
// collective first compare what each rank passes (the operation, structure,
// shapes, dtypes, devices); on a mismatch EVERY rank throws the same
// DistributedError listing each rank's call, instead of hanging or returning
// garbage. It costs one small all_gather per collective when on, and one
// relaxed atomic load when off. Set it alike on every rank.
#pragma once

#include "accel/core/environment.hpp"
#include "accel/distributed/torch.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline std::atomic<int>& debug_state() {  // -1: not read from the environment yet
  static std::atomic<int> state{-1};
  return state;
}
}  // namespace detail

inline bool debug_mode() {
  int state = detail::debug_state().load(std::memory_order_relaxed);
  if (state < 0) [[unlikely]] {
    state = detail::env_bool("ACCEL_DEBUG_MODE", false) ? 1 : 0;
    detail::debug_state().store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

namespace detail {
struct GroupRegistry {
  // The interface owns the world group; this is only where collectives with
  // a null group find it, without a lock.
  std::atomic<c10d::ProcessGroup*> world{nullptr};
  std::mutex mutex;  // guards entries (read only to word and diagnose errors)
  struct Entry {
    std::string name;
    c10::intrusive_ptr<c10d::Store> store;  // the group's own keys, for roll calls; may be null
    int roll_calls = 0;
  };
  std::map<const c10d::ProcessGroup*, Entry> entries;
  // The text of a failed operation's error (explain_failure in
  // registration.hpp: the group's name, rank and size, and after a timeout a
  // roll call of the group's ranks through its store). failure() reaches it
  // through this pointer, which register_group sets, instead of calling it,
  // so that only the translation units that make groups compile it (a thread
  // and a store protocol), not every one that calls a collective: it was a
  // third of what one call costs to compile.
  // Debug mode's check that every rank made the same call (verify_same_call)
  // is pointed to for the same reason: set by register_group and set_debug_mode.
  std::atomic<std::string (*)(const char* op, c10d::ProcessGroup& group, const std::exception& e)> explain_failure{
      nullptr};
  std::atomic<void (*)(c10d::ProcessGroup&, const std::string&)> verify_same_call{nullptr};
  // debug_mode() itself (its parse of ACCEL_DEBUG_MODE, with its errors), for
  // collectives that meet a state not read yet (checking_calls); set with
  // verify_same_call.
  std::atomic<bool (*)()> read_debug_mode{nullptr};
};
// Never destroyed: the singleton may release its groups during static
// destruction at exit, after a registry with a destructor would be gone.
inline GroupRegistry& registry() {
  static GroupRegistry* instance = new GroupRegistry;
  return *instance;
}

// Whether a collective runs debug mode's check: debug_mode(), reached
// through the registry's pointer so that its parse of the variable is not
// compiled into every file that calls a collective. A process where
// nothing set the check up yet (only groups made with c10d directly) has no
// reader; there the variable merely being set sends the call on to
// verify_call, whose error says how to set the check up.
inline bool checking_calls() {
  const int state = debug_state().load(std::memory_order_relaxed);
  if (state >= 0) [[likely]]
    return state == 1;
  if (auto* read = registry().read_debug_mode.load(std::memory_order_acquire)) return read();
  return std::getenv("ACCEL_DEBUG_MODE") != nullptr;
}

inline std::string group_name(const c10d::ProcessGroup& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  auto it = reg.entries.find(&group);
  return it == reg.entries.end() ? std::string("unnamed") : it->second.name;
}

inline std::string describe(const c10d::ProcessGroup& group) {
  std::ostringstream text;  // (not std::string's +: each + is inlined code in every file that calls a collective)
  text << "group '" << group_name(group) << "' (" << group.getBackendName() << ", rank " << group.getRank() << " of "
       << group.getSize() << ")";
  return text.str();
}

// The group a collective runs on, not owned (the caller's group, or the
// world group the interface keeps alive); null when no launcher's
// environment is set, where collectives are the identity. No reference
// counting on the hot path.
inline c10d::ProcessGroup* resolve(const GroupPtr& group, const char* op) {
  if (group) return group.get();
  if (auto* world = registry().world.load()) return world;
  const char* launcher = launcher_in_environment();
  if (!launcher) return nullptr;
  const std::string what =
      launcher == kLaunchers[0].launcher ? "RANK is set" : launcher + std::string("'s environment is set");
  throw LogicError(std::string("accel::") + op + ": " + what +
                   " but no world group exists; call accel::DistributedInterface::instance() first or pass a group");
}

inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// Runs `work` on a thread of its own and waits for it at most `limit`:
// true when it finished (rethrowing what it threw), false when it overran.
// An overrun thread is abandoned, still running, so `work` must own
// everything it uses (capture by value). For calls into c10d's store
// clients, which can wait for an answer with no timeout of their own (a
// stopped serving rank). Not a template, so that the thread and promise
// machinery is compiled once, not once per caller.
inline bool finished_within(std::chrono::milliseconds limit, std::function<void()> work) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread([done, work = std::move(work)] {
    try {
      work();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (finished.wait_for(limit) != std::future_status::ready) return false;
  finished.get();
  return true;
}
// The same for work with a result: the result, or nullopt when it overran.
template <class R, class Work>
std::optional<R> run_within(std::chrono::milliseconds limit, Work work) {
  auto result = std::make_shared<std::optional<R>>();  // shared with a thread that may outlive this call
  if (!finished_within(limit, [result, work = std::move(work)]() mutable { *result = work(); })) return std::nullopt;
  return std::move(*result);
}

// Issues one c10d operation (the call itself can fail: a dtype or a shape
// the backend rejects) and waits for it; any failure becomes a
// DistributedError that names the operation and the group (after a timeout,
// also the ranks that seem to be the cause: explain_failure in
// registration.hpp, which every group accel makes sets up). A process that
// never made an accel group (only groups made with c10d directly) gets the
// operation and the exception's own text (with LibTorch's backtrace).
inline DistributedError failure(const char* op, c10d::ProcessGroup& group, const std::exception& e) {
  if (auto* explain = registry().explain_failure.load(std::memory_order_acquire))
    return DistributedError(explain(op, group, e));
  return DistributedError(std::string("accel::") + op + " failed: " + e.what());
}
template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(const char* op, c10d::ProcessGroup& group, Issue&& issue) {
  try {
    return issue();
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
// A Gloo group's timeout (its options'), for waits that must end by it:
// c10d waits for a Gloo point-to-point message without one unless given
// one, so a receive from a live peer that never sends would wait forever.
// None for another backend (NCCL's watchdog bounds its waits).
inline std::optional<std::chrono::milliseconds> gloo_timeout([[maybe_unused]] c10d::ProcessGroup& group) {
#if ACCEL_HAS_GLOO
#if ACCEL_TORCH_AT_LEAST(2, 0)
  if (group.getBackendName() != "gloo") return std::nullopt;
  auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.getBackend(c10::DeviceType::CPU).get());
#else
  auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(&group);
#endif
  if (gloo) return std::chrono::duration_cast<std::chrono::milliseconds>(gloo->getOptions()->timeout);
#endif
  return std::nullopt;
}

// Whether `op` is made of point-to-point messages: send, recv, and what
// accel builds from them (named "... (point to point)": the direct
// collectives of pieces.hpp, the pipeline's messages).
inline bool point_to_point(std::string_view op) {
  return op == "send" || op == "recv" || op.find("(point to point)") != std::string_view::npos;
}
// A wait for `work`, bounded where c10d would not bound it (a Gloo
// point-to-point message: by the group's timeout); c10d's result (false:
// the work was aborted).
inline bool wait_bounded(const char* op, c10d::ProcessGroup& group, c10d::Work& work) {
  const std::optional<std::chrono::milliseconds> timeout =
      point_to_point(op) ? gloo_timeout(group) : std::optional<std::chrono::milliseconds>();
  return timeout ? work.wait(*timeout) : work.wait();
}
inline void await(const char* op, c10d::ProcessGroup& group, c10d::Work& work) {
  try {
    wait_bounded(op, group, work);
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
template <class Issue>
void run(const char* op, c10d::ProcessGroup& group, Issue&& issue) {
  try {
    issue()->wait();
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
}  // namespace detail

ACCEL_NAMESPACE_END
