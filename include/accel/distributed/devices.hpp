// accel/distributed/devices.hpp: devices: which accelerator a process uses, binding and synchronising it.
//
// Everything goes through c10's device-guard registry, so a CPU-only LibTorch
// compiles and links without CUDA, MPS or XPU symbols.
#pragma once

#include "accel/core/environment.hpp"
#include "accel/distributed/torch.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline int guard_device_count(c10::DeviceType type) {
  if (!c10::impl::hasDeviceGuardImpl(type)) return 0;
  try {
    return static_cast<int>(c10::impl::getDeviceGuardImpl(type)->deviceCount());
  } catch (const std::exception&) {
    return 0;  // a registered backend without a usable driver
  }
}

inline c10::DeviceType to_c10(DeviceType type) {
  switch (type) {
    case DeviceType::CPU: return c10::DeviceType::CPU;
    case DeviceType::CUDA: return c10::DeviceType::CUDA;
    case DeviceType::META: return c10::DeviceType::Meta;
    case DeviceType::MPS: return c10::DeviceType::MPS;
    case DeviceType::NPU: return c10::DeviceType::PrivateUse1;
    case DeviceType::XPU: return c10::DeviceType::XPU;
  }
  return c10::DeviceType::CPU;
}
inline DeviceType from_c10(c10::DeviceType type) {
  for (auto t :
       {DeviceType::CPU, DeviceType::CUDA, DeviceType::META, DeviceType::MPS, DeviceType::NPU, DeviceType::XPU})
    if (to_c10(t) == type) return t;
  throw InvalidArgument(std::string("accel: device type ") + c10::DeviceTypeName(type) + " is not one accel.hpp knows");
}
}  // namespace detail

inline bool is_torch_cuda_available() { return detail::guard_device_count(c10::DeviceType::CUDA) > 0; }
inline bool is_torch_mps_available() { return detail::guard_device_count(c10::DeviceType::MPS) > 0; }
inline bool is_torch_xpu_available() { return detail::guard_device_count(c10::DeviceType::XPU) > 0; }
inline bool is_torch_npu_available() {
#if ACCEL_TORCH_AT_LEAST(2, 1)
  // Ascend registers itself as the PrivateUse1 backend named "npu".
  return c10::get_privateuse1_backend() == "npu" && detail::guard_device_count(c10::DeviceType::PrivateUse1) > 0;
#else
  return false;
#endif
}

inline bool is_available(DeviceType type) {
  switch (type) {
    case DeviceType::CPU:
    case DeviceType::META: return true;
    case DeviceType::CUDA: return is_torch_cuda_available();
    case DeviceType::MPS: return is_torch_mps_available();
    case DeviceType::NPU: return is_torch_npu_available();
    case DeviceType::XPU: return is_torch_xpu_available();
  }
  return false;
}

// The accelerator this process uses, without an index. ACCEL_DEVICE forces a
// type; with check_available, forcing an unavailable one is an error.
namespace detail {
// A device type asked for (by `who`), checked to be usable.
inline c10::Device forced_device(DeviceType type, const std::string& who, bool check_available = true) {
  if (check_available && !is_available(type))
    throw RuntimeError("accel: " + who + ", but this LibTorch has no usable " + std::string(to_string(type)) +
                       " device (CPU-only build, or no device visible)");
  return c10::Device(to_c10(type));
}
}  // namespace detail

inline c10::Device get_current_accelerator(bool check_available = true) {
  if (auto forced = detail::getenv_str("ACCEL_DEVICE")) {
    DeviceType type;
    try {
      type = from_string<DeviceType>(*forced);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("accel: ACCEL_DEVICE: ") + e.what());
    }
    return detail::forced_device(type, "ACCEL_DEVICE=" + *forced, check_available);
  }
  for (auto type : {DeviceType::CUDA, DeviceType::NPU, DeviceType::XPU, DeviceType::MPS})
    if (is_available(type)) return c10::Device(detail::to_c10(type));
  return c10::Device(c10::DeviceType::CPU);
}

// Devices of the current accelerator on this host; 1 for the CPU.
inline int get_device_count() {
  auto type = get_current_accelerator().type();
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return 1;
  return detail::guard_device_count(type);
}

namespace detail {
// Binds this process to device LOCAL_RANK of `type` (no-op on the CPU).
// A peer that dies mid-collective leaves its sockets closed, and writing to
// one raises SIGPIPE, whose default ends this process before c10d can report
// the failure (seen: status 141 instead of a DistributedError). Python
// ignores SIGPIPE from startup; a distributed accel.hpp process does the
// same, unless the program chose a disposition of its own. (Children that
// launch_processes starts get the default back, as Python's subprocess does.)
inline void ignore_sigpipe() {
  struct sigaction current{};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL)
    signal(SIGPIPE, SIG_IGN);
}

inline void bind_device(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return;
  int local_rank = get_local_rank();
  int count = detail::guard_device_count(type);
  if (local_rank >= count)
    throw RuntimeError("accel: LOCAL_RANK=" + std::to_string(local_rank) + " but only " + std::to_string(count) + " " +
                       c10::DeviceTypeName(type, true) + " device(s) are visible");
  c10::impl::getDeviceGuardImpl(type)->setDevice(c10::Device(type, static_cast<c10::DeviceIndex>(local_rank)));
}

// The current device of `type`, with its index.
inline c10::Device current_device_of(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return c10::Device(type);
  return c10::impl::getDeviceGuardImpl(type)->getDevice();
}
}  // namespace detail

// Binds this process to the device LOCAL_RANK (no-op on the CPU).
inline void set_device_index() { detail::bind_device(get_current_accelerator().type()); }

inline c10::Device get_current_device() { return detail::current_device_of(get_current_accelerator().type()); }

// Waits for the work queued on the local device; not a barrier.
inline void synchronize() {
  auto type = get_current_accelerator().type();
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(type);
  auto device = impl->getDevice();
#if ACCEL_TORCH_AT_LEAST(2, 1)
  impl->synchronizeDevice(device.index());
#else
  // 1.x has no device-wide synchronisation in the guard interface: wait for
  // the current stream, where LibTorch queues the work of this thread.
  impl->synchronizeStream(impl->getStream(device));
#endif
}

namespace detail {
// "nccl" for CUDA, "hccl" for NPU, "gloo" otherwise; ACCEL_BACKEND overrides.
inline std::string backend_for(c10::DeviceType type) {
  if (auto forced = detail::getenv_str("ACCEL_BACKEND")) {
    if (*forced == "gloo") return *forced;
    if (*forced == "nccl") {
      if (!ACCEL_WITH_NCCL)
        throw RuntimeError(
            "accel: ACCEL_BACKEND=nccl, but accel.hpp was compiled against a LibTorch "
            "without NCCL (no CUDA build or no <nccl.h>); use ACCEL_BACKEND=gloo");
      // c10d's own refusal comes later, from inside the group set-up, and
      // reads differently on each version: say it here, before the rendezvous.
      if (!is_torch_cuda_available())
        throw RuntimeError(
            "accel: ACCEL_BACKEND=nccl, but this process sees no CUDA device (no GPU, no driver, or "
            "CUDA_VISIBLE_DEVICES hides them); NCCL moves only device memory: use ACCEL_BACKEND=gloo");
      return *forced;
    }
    throw InvalidArgument("accel: ACCEL_BACKEND='" + *forced + "' is not supported (expected gloo or nccl)");
  }
  switch (type) {
    case c10::DeviceType::CUDA: return "nccl";
    case c10::DeviceType::PrivateUse1: return "hccl";
    default: return "gloo";
  }
}
}  // namespace detail

// The backend for the current accelerator (see detail::backend_for).
inline std::string get_process_group_backend() { return detail::backend_for(get_current_accelerator().type()); }

ACCEL_NAMESPACE_END
