// accel/distributed/make_groups.hpp: several c10d groups made at once over the rendezvous store, and every rank waiting until all are made.
#pragma once

#include "accel/distributed/rendezvous.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Groups made at once. On LibTorch 1.13 making a group is mostly waiting
// for its members' store round trips, which made one after another add up
// (on 2.6 it measured no gain; README, Benchmarks part 4); so each group of
// more than one rank beyond the first is made on a thread of its own, with a
// store connection of its own (LibTorch 1.13's TCPStore client is not safe
// to share between threads, and 2.x's Store::clone is not in 1.13). A
// FileStore is not opened twice (its destructor deletes the file when its
// own count of users falls to zero, under the others' feet): with one, the
// groups are made in order. Every member asks for the same groups, each on
// keys of its own, so the order in which they are made does not matter.
struct GroupRequest {
  std::string name;  // for the registry and errors, e.g. "dp{cp=1}"
  std::string key;   // the group's prefix in the store
  int rank = 0, size = 1;
  std::vector<int> dims;  // of a mesh's root, for the mesh that asked
};
struct MadeGroup {
  GroupPtr group;
  c10::intrusive_ptr<c10d::Store> store;  // the group's own keys
};
// What make_groups is asked, and where each group's outcome goes.
struct GroupsCall {
  const std::string& backend;
  const c10::intrusive_ptr<c10d::Store>& store;
  const std::optional<StoreAddress>& address;
  const std::vector<GroupRequest>& requests;
  std::chrono::milliseconds timeout;
  std::vector<MadeGroup> made;
  std::vector<std::exception_ptr> failed;
};
// Makes group i of a call. A function, not a lambda, because a thread runs
// it: in every file that makes a virtual call (as releasing a tensor does),
// GCC analyses whatever the call's possible targets reach, and a thread's
// body is one (std::thread's state is polymorphic). Reached through a
// function pointer, this code is analysed only where groups are made, not in
// every file that calls a collective (over a quarter of the functions GCC
// took up for a file with one all_reduce).
inline void make_group_of(GroupsCall& call, std::size_t i, bool own_connection) {
  const GroupRequest& request = call.requests[i];
  try {
    call.made[i].store = c10::make_intrusive<c10d::PrefixStore>(
        request.key, own_connection ? bounded_connection(*call.address, request.size, call.timeout) : call.store);
    call.made[i].group = make_group(call.backend, call.made[i].store, request.rank, request.size, call.timeout);
  } catch (...) {
    call.failed[i] = std::current_exception();
  }
}
inline std::vector<MadeGroup> make_groups(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::optional<StoreAddress>& address,
                                          const std::vector<GroupRequest>& requests,
                                          std::chrono::milliseconds timeout) {
  GroupsCall call{backend,
                  store,
                  address,
                  requests,
                  timeout,
                  std::vector<MadeGroup>(requests.size()),
                  std::vector<std::exception_ptr>(requests.size())};
  // Made on this thread, with the shared store: every group of one rank (no
  // round trip), and the first that talks.
  std::vector<bool> here(requests.size(), true);
  if (address && !address->dir)
    for (std::size_t i = 0, talking = 0; i < requests.size(); ++i)
      if (requests[i].size > 1) here[i] = talking++ == 0;
  std::vector<std::thread> threads;
  std::exception_ptr unstarted;
  for (std::size_t i = 0; i < requests.size() && !unstarted; ++i) {
    if (here[i]) continue;
    try {
      threads.emplace_back(&make_group_of, std::ref(call), i, /*own_connection=*/true);
    } catch (...) {  // no thread: the ones started finish before this throws
      unstarted = std::current_exception();
    }
  }
  if (!unstarted)
    for (std::size_t i = 0; i < requests.size(); ++i)
      if (here[i]) make_group_of(call, i, /*own_connection=*/false);
  for (std::thread& t : threads) t.join();
  if (unstarted) std::rethrow_exception(unstarted);
  // Every caller's failure is a DistributedError naming the group (c10d
  // throws its own c10::Error, outside accel's family).
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!call.failed[i]) continue;
    try {
      std::rethrow_exception(call.failed[i]);
    } catch (const DistributedError&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError("accel: making group '" + requests[i].name + "' (rank " +
                             std::to_string(requests[i].rank) + " of " + std::to_string(requests[i].size) +
                             ") failed: " + error_text(e));
    }
  }
  return std::move(call.made);
}

// Called on this rank when its groups are made, before it waits for the
// others' (tests hold a rank there); a no-op otherwise.
inline std::function<void()>& groups_made_hook() {
  static std::function<void()> hook = [] {};
  return hook;
}

// Waits until every rank has made its groups of this call (key: one per
// call). Only then may a rank destroy its groups or exit: a peer still
// making its own would lose the connections it makes to this rank, or the
// store this rank serves (rank 0), and fail with "Connection reset by peer".
// One store round trip each, the last rank's answering the others (Python's
// init_process_group ends with such a store-based barrier when
// TORCH_DIST_INIT_BARRIER=1, its default up to torch 2.0). A rank that
// could not make its groups answers instead (groups_failed), so the others
// fail at once rather than at the timeout.
inline void wait_for_groups_made(c10d::Store& store, const std::string& key, int rank, int world,
                                 std::chrono::seconds timeout) {
  groups_made_hook()();
  const std::vector<uint8_t> done{1};
  std::vector<uint8_t> answer;
  try {
    if (store.add(key, 1) == world) store.set(key + "/all", done);
    answer = store.get(key + "/all");  // (waits for the key)
  } catch (const std::exception& e) {
    std::string late = "some";
    try {
      late = std::to_string(world - store.add(key, 0)) + " of " + std::to_string(world);
    } catch (const std::exception&) {  // the store is gone too: the first error says so
    }
    throw DistributedError("accel: rank " + std::to_string(rank) + " made its groups and waited " +
                           std::to_string(timeout.count()) + " s (the timeout), but " + late +
                           " ranks did not make theirs: " + error_text(e));
  }
  if (answer != done)
    throw DistributedError("accel: rank " + std::to_string(rank) + " made its groups, but " +
                           std::string(answer.begin(), answer.end()));
}
inline void groups_failed(c10d::Store& store, const std::string& key, int rank, const std::string& why) {
  const std::string text = "rank " + std::to_string(rank) + " could not make its own: " + why;
  try {
    store.set(key + "/all", std::vector<uint8_t>(text.begin(), text.end()));
  } catch (const std::exception&) {  // the store is gone: the others find that out themselves
  }
}
}  // namespace detail

ACCEL_NAMESPACE_END
