// accel/distributed/backends.hpp: one c10d process group made on either LibTorch generation, over a store.
//
// The c10d backends' constructors and options changed between LibTorch 1.x
// and 2.x; make_group hides that, and picks the network interface Gloo
// binds (loopback when every rank is on this host).
#pragma once

#include "accel/distributed/issue.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline std::atomic<int>& groups_created() {  // per process, for tests and benchmarks
  static std::atomic<int> count{0};
  return count;
}

// Constructs a c10d backend and returns it as a ProcessGroup: in 1.x the
// backends are ProcessGroups; from 2.0 on they are c10d::Backend, wrapped in
// a ProcessGroup bound to their device type.
template <class Impl, class Options>
GroupPtr new_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   c10::intrusive_ptr<Options> options, [[maybe_unused]] c10::DeviceType device,
                   [[maybe_unused]] std::chrono::milliseconds timeout) {
  ++groups_created();
  auto backend = c10::make_intrusive<Impl>(store, rank, size, options);
#if ACCEL_TORCH_AT_LEAST(2, 0)
  const auto type =
      device == c10::DeviceType::CUDA ? c10d::ProcessGroup::BackendType::NCCL : c10d::ProcessGroup::BackendType::GLOO;
  // 2.6 dropped ProcessGroup::Options from the constructor (the backend
  // carries its own options and timeout).
  // (Group is ProcessGroup, dependent so that only the taken branch is compiled.)
  using Group = std::conditional_t<sizeof(Impl) != 0, c10d::ProcessGroup, void>;
  c10::intrusive_ptr<Group> group;
  if constexpr (std::is_constructible_v<Group, c10::intrusive_ptr<c10d::Store>, int, int>)
    group = c10::make_intrusive<Group>(store, rank, size);
  else
    group = c10::make_intrusive<Group>(
        store, rank, size, c10::make_intrusive<typename Group::Options>(backend->getBackendName(), timeout));
  group->setBackend(device, type, backend);
  // Gloo reduces CUDA tensors too (through the host), as Python's gloo
  // groups do ("cpu:gloo,cuda:gloo"): without this, a CUDA tensor on a gloo
  // group fails with "No backend type associated with device type cuda".
  if (type == c10d::ProcessGroup::BackendType::GLOO && device != c10::DeviceType::CUDA)
    group->setBackend(c10::DeviceType::CUDA, type, backend);
  group->setDefaultBackend(type);
  return group;
#else
  return backend;
#endif
}

inline bool all_ranks_local() { return get_local_world_size() == get_world_size(); }

// The local IP address the kernel would send from to reach `host` (a UDP
// connect sends nothing); nullopt when it cannot tell.
inline std::optional<std::string> local_address_towards(const std::string& host) {
#if defined(__linux__)
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) return std::nullopt;
  std::optional<std::string> result;
  for (addrinfo* a = found; a && !result; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[INET6_ADDRSTRLEN] = {};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* ip = local.ss_family == AF_INET
                           ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                           : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, ip, text, sizeof text)) result = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return result;
#else
  (void)host;
  return std::nullopt;
#endif
}

inline GroupPtr make_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout) {
  if (backend == "gloo") {
#if ACCEL_HAS_GLOO
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    if (auto ifnames = getenv_str("GLOO_SOCKET_IFNAME")) {
      std::stringstream list(*ifnames);
      for (std::string name; std::getline(list, name, ',');)
        if (!name.empty()) options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    } else if (all_ranks_local()) {
      // Every rank on this host: loopback is always reachable and exposes
      // nothing to the network.
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else if (auto address = local_address_towards(getenv_str("MASTER_ADDR").value_or("127.0.0.1"))) {
      // The address this host uses to reach MASTER_ADDR reaches the others
      // too (the hostname Gloo would resolve by default may not).
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(*address));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return new_group<c10d::ProcessGroupGloo>(store, rank, size, options, c10::DeviceType::CPU, timeout);
#else
    throw RuntimeError(
        "accel: the gloo backend needs the Gloo headers when compiling, and this program was compiled without "
        "them (PyPI's torch wheels and pytorch.org's zips ship none; Debian/Ubuntu: libgloo-dev)");
#endif
  }
  if (backend == "nccl") {
#if ACCEL_WITH_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return new_group<c10d::ProcessGroupNCCL>(store, rank, size, options, c10::DeviceType::CUDA, timeout);
#else
    throw RuntimeError(
        "accel: the nccl backend is not available in this build "
        "(CPU LibTorch or no <nccl.h>); set ACCEL_BACKEND=gloo");
#endif
  }
  throw RuntimeError("accel: process-group backend '" + backend + "' is not supported by accel.hpp (use gloo or nccl)");
}

}  // namespace detail

ACCEL_NAMESPACE_END
