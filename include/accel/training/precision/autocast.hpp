// accel/training/precision/autocast.hpp: AutocastGuard: LibTorch's autocast on for a scope, in the configured precision.
//
// Accelerator::autocast() returns one (Accelerator::AutocastGuard is this
// type); accel::checkpoint restores a forward's autocast state for its
// recomputation through AutocastScope. LibTorch's autocast switches changed
// names in 2.4; this is the one place that knows both.
#pragma once

#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// LibTorch's autocast switches for one device type. LibTorch 2.4 took the
// device type as an argument (and deprecated the per-device functions that
// 1.x and 2.0-2.3 have).
#if ACCEL_TORCH_AT_LEAST(2, 4)
inline bool autocast_enabled(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
inline at::ScalarType autocast_dtype(c10::DeviceType type) { return at::autocast::get_autocast_dtype(type); }
inline void set_autocast(c10::DeviceType type, bool on, at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, on);
}
#else
inline bool autocast_enabled(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline at::ScalarType autocast_dtype(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
}
inline void set_autocast(c10::DeviceType type, bool on, at::ScalarType dtype) {
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(on);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(on);
  }
}
#endif

// Autocast on one device type set to `on` in `dtype` for a scope, and put
// back as it was after (its cache of cast weights cleared where this scope
// turned it on, as torch.autocast's exit does).
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType type, bool on, at::ScalarType dtype)
      : type_(type), saved_enabled_(autocast_enabled(type)), saved_dtype_(autocast_dtype(type)) {
    set_autocast(type_, on, dtype);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  ~AutocastScope() {
    if (!saved_enabled_ && autocast_enabled(type_)) at::autocast::clear_cache();
    set_autocast(type_, saved_enabled_, saved_dtype_);
  }

 private:
  c10::DeviceType type_;
  bool saved_enabled_;
  at::ScalarType saved_dtype_;
};

// RAII autocast for the configured mixed precision: bf16 on the CPU
// through LibTorch's autocast; a no-op for "no".
class AutocastGuard {
 public:
  explicit AutocastGuard(const std::string& mixed_precision, c10::Device device) {
    if (mixed_precision != "no")
      scope_.emplace(device.type(), true, mixed_precision == "fp16" ? at::kHalf : at::kBFloat16);
  }

 private:
  std::optional<AutocastScope> scope_;
};
}  // namespace detail

ACCEL_NAMESPACE_END
