// accel/distributed/registration.hpp: registering the groups accel makes, with the code that diagnoses their failures.
//
// The text of a failure (with the roll call after a timeout) and debug mode's
// check of every rank's call are reached through pointers that registering a group (or
// set_debug_mode) sets, not called directly by every collective: a
// translation unit compiles the code its calls reach, and these two were most
// of what one collective costs to compile. Only the translation units that
// make groups or switch debug mode compile them.
#pragma once

#include "accel/distributed/issue.hpp"
#include "accel/distributed/debug_check.hpp"

ACCEL_NAMESPACE_BEGIN

// Turns debug mode on or off for this process; nullopt re-reads ACCEL_DEBUG_MODE.
inline void set_debug_mode(std::optional<bool> on) {
  detail::registry().verify_same_call.store(&detail::verify_same_call, std::memory_order_release);
  detail::registry().read_debug_mode.store(&debug_mode, std::memory_order_release);
  detail::debug_state().store(on ? static_cast<int>(*on) : -1, std::memory_order_relaxed);
}

namespace detail {
// The roll call of a group's failure, through the group's store: every rank
// whose collective timed out, or lost its connection to a peer, reports in
// the group's `call`-th roll call, and a rank that timed out waits for the
// others to report. The ranks that never report are named: hung, dead, or
// stuck somewhere else. Why a rank that lost its connection reports too:
// when several ranks wait for one hung peer, the first to time out closes
// its connections, so the others fail with "Connection closed by peer"
// instead of their own timeout a moment later; unreported, they would be
// named beside the hung rank.
inline std::string roll_call_key(int call) { return "accel_roll_call/" + std::to_string(call) + "/"; }

// Reports this rank present in the `call`-th roll call (two store operations).
inline void report_in_roll_call(c10d::Store& store, int size, int rank, int call) {
  const std::string base = roll_call_key(call);
  store.set(base + std::to_string(rank), std::vector<uint8_t>{1});
  if (store.add(base + "reported", 1) == size) store.set(base + "all", std::vector<uint8_t>{1});
}

// After a collective timed out: reports, then waits up to `grace` for the
// others. A hint, as " (...)" for the error message, or "". The store may
// itself be served by the hung rank (a TCPStore on rank 0): the roll call
// runs on a thread of its own and is abandoned after grace + 1 s, so it can
// never add more than that to the error.
inline std::string roll_call_in_store(c10::intrusive_ptr<c10d::Store> store, int size, int rank, int call,
                                      std::chrono::milliseconds grace) {
  const auto answer = run_within<std::string>(grace + std::chrono::seconds(1), [store, size, rank, call, grace] {
    try {
      const std::string base = roll_call_key(call);
      report_in_roll_call(*store, size, rank, call);
      // Polled: Store::wait's own timeout cannot be shorter than the store's
      // (FileStore in 1.13 waits the store's timeout whatever it is given).
      for (const auto deadline = std::chrono::steady_clock::now() + grace; std::chrono::steady_clock::now() < deadline;
           std::this_thread::sleep_for(std::chrono::milliseconds(20)))
        if (store->check({base + "all"})) return std::string();  // everyone failed alike
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

// The store and the number of the next roll call of a group accel made
// (registered with its store), or a null store.
inline std::pair<c10::intrusive_ptr<c10d::Store>, int> next_roll_call(c10d::ProcessGroup& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  auto it = reg.entries.find(&group);
  if (it == reg.entries.end() || !it->second.store) return {};
  return {it->second.store, ++it->second.roll_calls};
}

// The roll call of a group accel made after a timeout, or "".
inline std::string roll_call(c10d::ProcessGroup& group, std::chrono::milliseconds grace = std::chrono::seconds(2)) {
  auto [store, call] = next_roll_call(group);
  if (!store) return "";
  return roll_call_in_store(std::move(store), group.getSize(), group.getRank(), call, grace);
}

// After a lost connection: reports without waiting (a peer that died never
// reports, and waiting for it would delay every dead peer's error by the
// grace), bounded by a second in case the store's server is the rank that
// is gone. A hint for the error message.
inline std::string report_lost_connection(c10d::ProcessGroup& group) {
  auto [store, call] = next_roll_call(group);
  if (!store) return "";
  const int size = group.getSize(), rank = group.getRank();
  run_within<bool>(std::chrono::seconds(1), [store, size, rank, call] {
    try {
      report_in_roll_call(*store, size, rank, call);
    } catch (...) {  // the store's server may be the peer that is gone
    }
    return true;
  });
  return " (a peer closed the connection: it exited or failed, or it timed out first, and then its own error "
         "names the ranks it waited for)";
}

inline bool is_timeout(const std::string& text) {
  const std::string lower = lowercase(text);
  return lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos;
}
inline bool is_lost_connection(const std::string& text) {
  const std::string lower = lowercase(text);
  for (const char* sign : {"closed by peer", "reset by peer", "connection closed", "broken pipe", "socket closed"})
    if (lower.find(sign) != std::string::npos) return true;
  return false;
}

// The text of a failed operation's error (failure() in issue.hpp reaches it
// through the registry).
inline std::string explain_failure(const char* op, c10d::ProcessGroup& group, const std::exception& e) {
  const std::string cause = error_text(e);  // (without LibTorch's backtrace)
  std::string message = std::string("accel::") + op + " failed on " + describe(group) + ": " + cause;
  if (is_timeout(cause)) message += roll_call(group);
  else if (is_lost_connection(cause)) message += report_lost_connection(group);
  return message;
}

// Groups accel makes are named for error messages and keep their store for
// the roll call; collectives accept other groups as well.
inline void register_group(const GroupPtr& group, std::string name, c10::intrusive_ptr<c10d::Store> store = {},
                           bool is_world = false) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.entries[group.get()] = {std::move(name), std::move(store)};
  reg.verify_same_call.store(&verify_same_call, std::memory_order_release);
  reg.explain_failure.store(&explain_failure, std::memory_order_release);
  reg.read_debug_mode.store(&debug_mode, std::memory_order_release);
  if (is_world) reg.world.store(group.get());
}
inline void unregister_group(const GroupPtr& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.entries.erase(group.get());
  c10d::ProcessGroup* expected = group.get();
  reg.world.compare_exchange_strong(expected, nullptr);
}

}  // namespace detail

ACCEL_NAMESPACE_END
