// accel/distributed/rendezvous.hpp: rendezvous: the store ranks meet on, and agreeing on the world.
//
// How ranks meet (a c10d store: FileStore, TCPStore, or torchrun's agent
// store) and agree on the world before building anything; the groups are
// made over the store afterwards (distributed/make_groups.hpp).
#pragma once

#include "accel/distributed/backends.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A c10d::TCPStore. From 2.4 on LibTorch serves it with libuv by default
// (TCPStoreOptions::useLibUV), which only builds made with libuv have
// (pytorch.org and pip: yes; Debian: no), and the check for it fails every
// rank. As in Python, USE_LIBUV=0/1 decides when set; unset, libuv where the
// build has it and the classic server where it does not (LibTorch's own
// availability check is not exported, so the first try tells). Before 2.4
// there is only the classic server.
template <class Options>
c10::intrusive_ptr<c10d::Store> tcp_store(const std::string& host, Options options) {
  const auto use = getenv_str("USE_LIBUV");
  if (use && *use != "0" && *use != "1") throw InvalidArgument("USE_LIBUV=" + *use + " (expected 0 or 1)");
  if constexpr (requires { options.useLibUV; }) {
    static std::atomic<bool> build_has_libuv{true};
    options.useLibUV = use ? *use == "1" : build_has_libuv.load();
    if (!use && options.useLibUV) {
      try {
        return c10::make_intrusive<c10d::TCPStore>(host, options);
      } catch (const std::exception& e) {
        if (std::string_view(e.what()).find("without libuv") == std::string_view::npos) throw;
        build_has_libuv = false;
        options.useLibUV = false;
      }
    }
  }
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

// The rendezvous store lives for the whole process: a later instance() after
// destroy() reuses it (with a fresh key prefix) instead of racing rank 0's
// closing and re-opening of MASTER_PORT.
//
// Where every rank is on this host and ACCEL_STORE_DIR names a directory
// (accel::spawn and accel_launch make a private one), the store is a
// c10d::FileStore in it: a local run then opens no TCP port at all. Else a
// c10d::TCPStore served by rank 0 at MASTER_ADDR:MASTER_PORT, except under
// torchrun, whose agent already serves one there and says so with
// TORCHELASTIC_USE_AGENT_STORE=True: then every rank is a client (as Python's
// _create_c10d_store), and the keys of each restart attempt
// (TORCHELASTIC_RESTART_COUNT) are kept apart in case the store outlives it.
// Where the store is, read from the environment on the calling thread (a
// malformed MASTER_PORT or ACCEL_STORE_DIR fails here, before any wait).
struct StoreAddress {
  std::optional<std::string> dir;  // a FileStore in it, else a TCPStore
  bool agent_store = false;
  std::string host;
  int port = 0;
  std::string where;  // for errors
};
inline StoreAddress store_address() {
  StoreAddress a;
  a.dir = getenv_str("ACCEL_STORE_DIR");
  if (a.dir && !all_ranks_local()) a.dir.reset();
  a.agent_store = !a.dir && getenv_str("TORCHELASTIC_USE_AGENT_STORE") == "True";
  a.host = getenv_str("MASTER_ADDR").value_or("127.0.0.1");
  a.port = a.dir ? 0 : env_int("MASTER_PORT", 29500, 0);
  if (a.port > 65535) throw InvalidArgument("accel: MASTER_PORT=" + std::to_string(a.port) + " is not a TCP port");
  a.where = a.dir ? "file store " + *a.dir + "/store" : a.host + ":" + std::to_string(a.port);
  if (a.dir) {
    struct stat info{};
    if (stat(a.dir->c_str(), &info) != 0 || !S_ISDIR(info.st_mode))
      throw InvalidArgument("ACCEL_STORE_DIR=" + *a.dir + " is not a directory");
    if (info.st_uid != geteuid() || (info.st_mode & 077) != 0)
      throw InvalidArgument("ACCEL_STORE_DIR=" + *a.dir +
                            " must be private (owned by this user, mode 0700): other users could join");
  }
  return a;
}

struct KeptStore {
  std::string where;
  int rank = 0, world = 0;
  c10::intrusive_ptr<c10d::Store> store;
  int generation = 0;  // of key prefixes handed out
  int epoch = 0;       // bumped when a store is forgotten
};
struct RendezvousState {
  std::mutex mutex;  // held for bookkeeping only, never across a store operation
  KeptStore kept;
};
inline RendezvousState& rendezvous_state() {
  static RendezvousState state;
  return state;
}
// Drops the kept store (one that stopped answering): the next rendezvous
// connects afresh, and a connection still under way is not kept.
inline void forget_rendezvous() {
  auto& state = rendezvous_state();
  std::lock_guard lock(state.mutex);
  state.kept.store.reset();
  ++state.kept.epoch;
}

// A TCPStore at the address: the server (rank 0, unless torchrun's agent
// serves) or a client. No wait for the workers here: the arrival after it
// waits, and can say who is missing.
inline c10::intrusive_ptr<c10d::Store> tcp_connection(const StoreAddress& a, bool serve, int world,
                                                      std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(a.port);
  options.isServer = serve;
  options.numWorkers = static_cast<std::size_t>(world);
  options.waitWorkers = false;
  options.timeout = timeout;
  return tcp_store(a.host, options);
}

// How long past the timeout a store call that c10d does not bound (see
// run_within) may take before it is abandoned as hung.
inline constexpr std::chrono::seconds kStoreGrace{5};

// A further client connection (a group's own, see make_groups), within the
// timeout: LibTorch 2.x's client waits for the server's answer while
// connecting, for ever if the serving rank stopped after the rendezvous.
inline c10::intrusive_ptr<c10d::Store> bounded_connection(const StoreAddress& a, int world,
                                                          std::chrono::milliseconds timeout) {
  auto store = run_within<c10::intrusive_ptr<c10d::Store>>(
      timeout + kStoreGrace, [a, world, timeout] { return tcp_connection(a, /*serve=*/false, world, timeout); });
  if (!store)
    throw DistributedError("accel: a group's connection to the store at " + a.where + " got no answer within " +
                           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()) +
                           " s (the timeout) + " + std::to_string(kStoreGrace.count()) +
                           " s: is the process serving it (rank 0, or torchrun's agent) hung or stopped?");
  return *store;
}

// The kept store, or a new connection (which LibTorch 2.x's TCPStore client
// makes by waiting for the server's answer, without a timeout), and a fresh
// key prefix.
inline c10::intrusive_ptr<c10d::Store> connect(const StoreAddress& a, int rank, int world,
                                               std::chrono::milliseconds timeout, std::string& prefix) {
  auto& state = rendezvous_state();
  std::unique_lock lock(state.mutex);
  KeptStore& kept = state.kept;
  if (!kept.store || kept.where != a.where || kept.rank != rank || kept.world != world) {
    const int epoch = kept.epoch;
    lock.unlock();
    c10::intrusive_ptr<c10d::Store> store;
    try {
      if (a.dir) {
        store = c10::make_intrusive<c10d::FileStore>(*a.dir + "/store", world);
      } else {
        store = tcp_connection(a, /*serve=*/rank == 0 && !a.agent_store, world, timeout);
      }
    } catch (const std::exception& e) {
      throw DistributedError("accel: rendezvous at " + a.where + " failed for rank " + std::to_string(rank) + " of " +
                             std::to_string(world) + (a.dir ? " (ACCEL_STORE_DIR)" : " (MASTER_ADDR/MASTER_PORT)") +
                             ": " + error_text(e));
    }
    lock.lock();
    if (kept.epoch != epoch) throw DistributedError("accel: rendezvous at " + a.where + " was abandoned");
    kept.store = std::move(store);
    kept.where = a.where;
    kept.rank = rank;
    kept.world = world;
  }
  kept.store->setTimeout(timeout);
  prefix = "accel/";
  if (a.agent_store) prefix += "attempt_" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0, 0)) + "/";
  prefix += std::to_string(kept.generation++) + "/";
  return kept.store;
}
// The rendezvous protocol, on a fresh key prefix: every rank arrives before
// any creates a group, so none is still tearing down the groups of a
// previous initialisation (after destroy()) while the others connect. Every
// rank must believe in the same world size: the first to arrive records its
// own; one that disagrees tells everyone (the others find the note after the
// arrival wait) and fails at once. Debug mode must be alike on every rank
// (it adds collectives). Four store round trips; on timeout the error names
// the ranks that never arrived.
inline void wait_for_every_rank(c10d::Store& store, const std::string& prefix, int rank, int world, bool debug,
                                std::chrono::seconds timeout) {
  const std::string mine = std::to_string(world);
  const std::vector<uint8_t> bytes(mine.begin(), mine.end());
  if (const std::vector<uint8_t> first = store.compareSet(prefix + "world_size", {}, bytes); first != bytes) {
    const std::string text = "rank " + std::to_string(rank) + " believes WORLD_SIZE=" + mine +
                             " but a rank before it believes WORLD_SIZE=" + std::string(first.begin(), first.end()) +
                             "; every rank must be started with the same world size";
    store.set(prefix + "mismatch", std::vector<uint8_t>(text.begin(), text.end()));
    store.set(prefix + "all_arrived", std::vector<uint8_t>{1});
    throw InvalidArgument(text);
  }
  store.set(prefix + "arrived/" + std::to_string(rank), std::vector<uint8_t>{1});
  store.add(prefix + "debug", debug ? 1 : 0);
  if (store.add(prefix + "arrived", 1) == world) store.set(prefix + "all_arrived", std::vector<uint8_t>{1});
  try {
    store.wait({prefix + "all_arrived"});
  } catch (const std::exception& e) {
    // How many are missing is one counter read; who, the first 16 found (a
    // round trip per rank looked at, so a huge WORLD_SIZE reports at once).
    const int64_t count = world - store.add(prefix + "arrived", 0);
    std::string missing;
    int64_t named = 0;
    for (int r = 0; r < world && named < std::min<int64_t>(count, 16); ++r)
      if (!store.check({prefix + "arrived/" + std::to_string(r)})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        ++named;
      }
    if (count > named) missing += ", ...";
    throw DistributedError("accel: rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                           " s (the timeout) at the rendezvous, but " + std::to_string(count) + " of " +
                           std::to_string(world) + " ranks never arrived (rank" + (count > 1 ? "s " : " ") + missing +
                           "): were they started, with the same MASTER_ADDR/MASTER_PORT? (" + error_text(e) + ")");
  }
  if (store.check({prefix + "mismatch"})) {
    const std::vector<uint8_t> text = store.get(prefix + "mismatch");
    throw InvalidArgument(std::string(text.begin(), text.end()));
  }
  if (const int64_t in_debug = store.add(prefix + "debug", 0); in_debug != 0 && in_debug != world)
    throw InvalidArgument("debug mode is on in " + std::to_string(in_debug) + " of " + std::to_string(world) +
                          " ranks (here: " + (debug ? "on" : "off") + "); set ACCEL_DEBUG_MODE alike on every rank");
}

// The store (kept from an earlier rendezvous, or connected now) and a fresh
// key prefix, after wait_for_every_rank(): all within the timeout (plus 5 s), whatever the
// store does. c10d's store clients wait for an answer without a timeout of
// their own (a TCPStore client connecting to, or a compareSet sent to, a
// serving rank that is stopped never returns), so the work runs on a thread
// of its own (run_within), abandoned (with the kept store) when it overruns.
struct Rendezvoused {
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;
};
inline Rendezvoused rendezvous(const StoreAddress& address, int rank, int world, bool debug,
                               std::chrono::seconds timeout) {
  auto connected = std::make_shared<std::atomic<bool>>(false);
  std::optional<Rendezvoused> met =
      run_within<Rendezvoused>(timeout + kStoreGrace, [address, rank, world, debug, timeout, connected] {
        Rendezvoused made;
        made.store = connect(address, rank, world, timeout, made.prefix);
        connected->store(true);
        wait_for_every_rank(*made.store, made.prefix, rank, world, debug, timeout);
        return made;
      });
  if (!met) {
    forget_rendezvous();
    // Still connecting: an unreachable address, or (LibTorch 2.x validates
    // the connection) a server that does not answer; both are a failed
    // rendezvous. Connected: the server stopped answering.
    const std::string late = " did not answer rank " + std::to_string(rank) + " within the timeout (" +
                             std::to_string(timeout.count()) + " s + " + std::to_string(kStoreGrace.count()) + " s)";
    if (!connected->load())
      throw DistributedError("accel: rendezvous at " + address.where + " failed for rank " + std::to_string(rank) +
                             " of " + std::to_string(world) +
                             (address.dir ? " (ACCEL_STORE_DIR)" : " (MASTER_ADDR/MASTER_PORT)") + ": the store" +
                             late +
                             " while connecting: is the address reachable, and the process serving it (rank "
                             "0, or torchrun's agent) running, not hung or stopped?");
    throw DistributedError("accel: the rendezvous store at " + address.where + late +
                           ": is the process serving it (rank 0, or torchrun's agent) hung or stopped?");
  }
  return std::move(*met);
}

}  // namespace detail

ACCEL_NAMESPACE_END
