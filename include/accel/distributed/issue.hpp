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
// Turns debug mode on or off for this process; nullopt re-reads ACCEL_DEBUG_MODE.
inline void set_debug_mode(std::optional<bool> on) {
  detail::debug_state().store(on ? static_cast<int>(*on) : -1, std::memory_order_relaxed);
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
};
// Never destroyed: the singleton may release its groups during static
// destruction at exit, after a registry with a destructor would be gone.
inline GroupRegistry& registry() {
  static GroupRegistry* instance = new GroupRegistry;
  return *instance;
}

inline void register_group(const GroupPtr& group, std::string name, c10::intrusive_ptr<c10d::Store> store = {},
                           bool is_world = false) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.entries[group.get()] = {std::move(name), std::move(store)};
  if (is_world) reg.world.store(group.get());
}
inline void unregister_group(const GroupPtr& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.entries.erase(group.get());
  c10d::ProcessGroup* expected = group.get();
  reg.world.compare_exchange_strong(expected, nullptr);
}

inline std::string group_name(const c10d::ProcessGroup& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  auto it = reg.entries.find(&group);
  return it == reg.entries.end() ? std::string("unnamed") : it->second.name;
}

inline std::string describe(const c10d::ProcessGroup& group) {
  return "group '" + group_name(group) + "' (" + group.getBackendName() + ", rank " + std::to_string(group.getRank()) +
         " of " + std::to_string(group.getSize()) + ")";
}

// The group a collective runs on, not owned (the caller's group, or the
// world group the interface keeps alive); null when not distributed, where
// collectives are the identity. No reference counting on the hot path.
inline c10d::ProcessGroup* resolve(const GroupPtr& group, const char* op) {
  if (group) return group.get();
  if (auto* world = registry().world.load()) return world;
  if (!is_distributed()) return nullptr;
  throw LogicError(std::string("accel::") + op +
                   ": RANK is set but no world group exists; call "
                   "accel::DistributedInterface::instance() first or pass a group");
}

inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// Runs `work` on a thread of its own and waits for it at most `limit`:
// its result (or its exception), or nullopt when it overran. An overrun
// thread is abandoned, still running, so `work` must own everything it uses
// (capture by value). For calls into c10d's store clients, which can wait
// for an answer with no timeout of their own (a stopped serving rank).
template <class R, class Work>
std::optional<R> run_within(std::chrono::milliseconds limit, Work work) {
  auto done = std::make_shared<std::promise<R>>();
  std::future<R> result = done->get_future();
  std::thread([done, work = std::move(work)]() mutable {
    try {
      done->set_value(work());
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (result.wait_for(limit) != std::future_status::ready) return std::nullopt;
  return result.get();
}

// After a collective timed out: which ranks of the group did not time out
// with it? Every rank that gets here reports in the group's store and waits
// up to `grace` for the others; those that never report are named (hung, or
// stuck somewhere else). A hint, as " (...)" for the error message, or "".
// The store may itself be served by the hung rank (a TCPStore on rank 0):
// the roll call runs on a thread of its own and is abandoned after
// grace + 1 s, so it can never add more than that to the error.
inline std::string roll_call(c10d::ProcessGroup& group, std::chrono::milliseconds grace = std::chrono::seconds(2)) {
  c10::intrusive_ptr<c10d::Store> store;
  int call = 0;
  {
    auto& reg = registry();
    std::lock_guard lock(reg.mutex);
    auto it = reg.entries.find(&group);
    if (it == reg.entries.end() || !it->second.store) return "";
    store = it->second.store;
    call = ++it->second.roll_calls;
  }
  const int size = group.getSize(), rank = group.getRank();
  const auto answer = run_within<std::string>(grace + std::chrono::seconds(1), [store, size, rank, call, grace] {
    try {
      const std::string base = "accel_roll_call/" + std::to_string(call) + "/";
      store->set(base + std::to_string(rank), std::vector<uint8_t>{1});
      if (store->add(base + "reported", 1) == size) store->set(base + "all", std::vector<uint8_t>{1});
      // Polled: Store::wait's own timeout cannot be shorter than the store's
      // (FileStore in 1.13 waits the store's timeout whatever it is given).
      for (const auto deadline = std::chrono::steady_clock::now() + grace; std::chrono::steady_clock::now() < deadline;
           std::this_thread::sleep_for(std::chrono::milliseconds(20)))
        if (store->check({base + "all"})) return std::string();  // everyone timed out alike
      const int64_t reported = store->add(base + "reported", 0);
      std::string missing;
      int64_t named = 0;
      for (int r = 0; r < size && named < std::min<int64_t>(size - reported, 16); ++r)
        if (!store->check({base + std::to_string(r)})) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          ++named;
        }
      if (size - reported > named) missing += ", ...";
      return " (roll call: rank" + std::string(size - reported > 1 ? "s " : " ") + missing + " of the group " +
             "did not reach this timeout within " + std::to_string(grace.count()) +
             " ms of this rank: hung, or stuck elsewhere)";
    } catch (...) {
      return std::string();
    }
  });
  return answer ? *answer : " (roll call: the group's store did not answer either; is the rank serving it hung?)";
}

inline bool is_timeout(const std::string& text) {
  const std::string lower = lowercase(text);
  return lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos;
}

// Issues one c10d operation (the call itself can fail: a dtype or a shape
// the backend rejects) and waits for it; any failure becomes a
// DistributedError that names the operation and the group (after a timeout,
// also the ranks that seem to be the cause: roll_call).
inline DistributedError failure(const char* op, c10d::ProcessGroup& group, const std::exception& e) {
  const std::string text = error_text(e);
  return DistributedError(std::string("accel::") + op + " failed on " + describe(group) + ": " + text +
                          (is_timeout(text) ? roll_call(group) : std::string()));
}
template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(const char* op, c10d::ProcessGroup& group, Issue&& issue) {
  try {
    return issue();
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
inline void await(const char* op, c10d::ProcessGroup& group, c10d::Work& work) {
  try {
    work.wait();
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
