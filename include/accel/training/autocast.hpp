// accel/training/autocast.hpp: AutocastGuard: LibTorch's autocast on for a scope, in the configured precision.
//
// Accelerator::autocast() returns one (Accelerator::AutocastGuard is this
// type). LibTorch's autocast switches changed names in 2.4; this is the one
// place that knows both.
#pragma once

#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// RAII autocast for the configured mixed precision: bf16 on the CPU
// through LibTorch's autocast; a no-op for "no".
class AutocastGuard {
 public:
  explicit AutocastGuard(const std::string& mixed_precision, c10::Device device) : type_(device.type()) {
    if (mixed_precision == "no") return;
    saved_enabled_ = enabled(type_);
    saved_dtype_ = dtype(type_);
    set(type_, true, mixed_precision == "fp16" ? at::kHalf : at::kBFloat16);
    active_ = true;
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  ~AutocastGuard() {
    if (!active_) return;
    at::autocast::clear_cache();
    set(type_, saved_enabled_, saved_dtype_);
  }

 private:
  // LibTorch 2.4 took the device type as an argument (and deprecated the
  // per-device functions that 1.x and 2.0-2.3 have).
#if ACCEL_TORCH_AT_LEAST(2, 4)
  static bool enabled(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
  static at::ScalarType dtype(c10::DeviceType type) { return at::autocast::get_autocast_dtype(type); }
  static void set(c10::DeviceType type, bool on, at::ScalarType dtype) {
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::set_autocast_enabled(type, on);
  }
#else
  static bool enabled(c10::DeviceType type) {
    return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
  }
  static at::ScalarType dtype(c10::DeviceType type) {
    return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                        : at::autocast::get_autocast_gpu_dtype();
  }
  static void set(c10::DeviceType type, bool on, at::ScalarType dtype) {
    if (type == c10::DeviceType::CPU) {
      at::autocast::set_autocast_cpu_dtype(dtype);
      at::autocast::set_cpu_enabled(on);
    } else {
      at::autocast::set_autocast_gpu_dtype(dtype);
      at::autocast::set_enabled(on);
    }
  }
#endif
  c10::DeviceType type_;
  bool active_ = false, saved_enabled_ = false;
  at::ScalarType saved_dtype_ = at::kBFloat16;
};
}  // namespace detail

ACCEL_NAMESPACE_END
