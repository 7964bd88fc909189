// accel/distributed/staging.hpp: what c10d gets for a tensor: dtypes every backend moves, staged copies, the device NCCL needs, reductions checked.
#pragma once

#include "accel/distributed/devices.hpp"
#include "accel/distributed/concepts.hpp"
#include "accel/distributed/issue.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::MAX: return c10d::ReduceOp::MAX;
    case ReduceOp::MIN: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;  // MEAN is SUM, then a division
  }
}

inline void reject_integral_mean(c10::ScalarType dtype, const char* op = "all_reduce") {
  if (!c10::isFloatingType(dtype) && !c10::isComplexType(dtype))
    throw InvalidArgument(std::string("accel::") + op + ": ReduceOp::MEAN on integral type " + c10::toString(dtype) +
                          " would truncate; use ReduceOp::SUM and divide by the group size, "
                          "or pass a floating-point value");
}

// Dtypes Gloo moves and reduces on every LibTorch version: float32/64,
// float16, int8, uint8, int32 and int64; NCCL has every real dtype. Others
// travel in another form: as their bytes where an operation only moves data;
// for a reduction (stage), bool as uint8, complex as its real
// and imaginary parts, other floating types (bfloat16) in float32 and other
// integers (int16, unsigned) in int64. (Python's torch.distributed fails on
// most of these with Gloo: "Invalid scalar type".) The common dtypes answer
// without asking the backend's name.
inline bool native_dtype(const c10d::ProcessGroup& group, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kChar:
    case c10::kByte:
    case c10::kInt:
    case c10::kLong: return true;
    default: return !c10::isComplexType(dtype) && group.getBackendName() != "gloo";
  }
}
// What c10d gets for a contiguous tensor: itself, or a view of its bytes
// where the backend does not move its dtype (native_dtype).
inline at::Tensor backend_view(const c10d::ProcessGroup& group, const at::Tensor& contiguous) {
  if (native_dtype(group, contiguous.scalar_type())) return contiguous;
  return contiguous.reshape({-1}).view(c10::kByte);
}

// NCCL only moves device memory: CPU data visits the current device. (Only
// builds with NCCL can hold an NCCL group, so others skip the name lookup.)
inline std::optional<c10::Device> staging_device([[maybe_unused]] const c10d::ProcessGroup& group,
                                                 [[maybe_unused]] const at::Tensor& tensor) {
#if ACCEL_WITH_NCCL
  if (!tensor.is_cuda() && group.getBackendName() == "nccl") return get_current_device();
#endif
  return std::nullopt;
}

// How an in-place operation (all_reduce, reduce_to, broadcast, recv) reaches
// c10d: `c10d_tensor` is the tensor c10d gets. The common case runs on the
// caller's tensor itself (contiguous, on the group's device, a dtype the
// backend handles) and leaves `staged` undefined; otherwise it runs on
// `staged`, a contiguous copy on the group's device, which land_in_place
// copies back. A reduction of a dtype the backend cannot reduce is staged
// in a form it can (native_dtype): bool as uint8 (SUM then MAX: a logical
// or, as NCCL's bool sum), complex as its real and imaginary parts, other
// floating types in float32, other integers in int64.
inline bool direct(const c10d::ProcessGroup& group, const at::Tensor& tensor) {
  return !staging_device(group, tensor) && native_dtype(group, tensor.scalar_type()) && tensor.is_contiguous();
}
struct InPlace {
  at::Tensor staged;
  at::Tensor c10d_tensor;
  ReduceOp op = ReduceOp::SUM;  // what c10d_tensor is reduced with
};
inline InPlace stage(const c10d::ProcessGroup& group, const at::Tensor& tensor,
                     std::optional<ReduceOp> reduction = std::nullopt) {
  ReduceOp op = reduction.value_or(ReduceOp::SUM);
  if (direct(group, tensor)) [[likely]]
    return {{}, tensor, op};
  const auto device = staging_device(group, tensor);
  const c10::ScalarType dtype = tensor.scalar_type();
  const bool native = native_dtype(group, dtype);
  at::NoGradGuard no_grad;
  at::Tensor staged = tensor;
  if (reduction && !native) {
    if (dtype == c10::kBool) {
      if (op == ReduceOp::SUM) op = ReduceOp::MAX;
    } else if (c10::isFloatingType(dtype)) {
      staged = staged.to(c10::kFloat);
    } else if (!c10::isComplexType(dtype)) {
      staged = staged.to(c10::kLong);
    }
  }
  if (device) staged = staged.to(*device);
  staged = staged.contiguous();
  at::Tensor c10d_tensor =
      reduction && c10::isComplexType(dtype) ? at::view_as_real(staged) : backend_view(group, staged);
  return {staged.is_same(tensor) ? at::Tensor() : staged, std::move(c10d_tensor), op};
}
// After an in-place operation: MEAN's division (on the staged form, before
// any rounding back to the caller's dtype), then the copy back.
inline void land_in_place(at::Tensor& tensor, const at::Tensor& staged, int64_t divisor) {
  at::NoGradGuard no_grad;
  if (divisor > 1) (staged.defined() ? staged : tensor).div_(divisor);
  if (staged.defined()) tensor.copy_(staged);
}

// Whether a reduction of dtype with op is defined (checked before anything
// moves, on every world size, so that one process behaves as many).
inline void check_other_reduction(c10::ScalarType dtype, ReduceOp op, const char* name);
inline void check_reduction(c10::ScalarType dtype, ReduceOp op, const char* name) {
  if (dtype != c10::kFloat && dtype != c10::kDouble) [[unlikely]]  // (every op is defined on these)
    check_other_reduction(dtype, op, name);
}
inline void check_other_reduction(c10::ScalarType dtype, ReduceOp op, const char* name) {
  if (op == ReduceOp::MEAN) reject_integral_mean(dtype, name);
  if (c10::isComplexType(dtype) && (op == ReduceOp::MAX || op == ReduceOp::MIN))
    throw InvalidArgument(std::string("accel::") + name + ": ReduceOp::" + std::string(to_string(op)) + " of " +
                          c10::toString(dtype) + " is undefined (complex numbers have no order); SUM and MEAN work");
  if (dtype != c10::kBool && !c10::isFloatingType(dtype) && !c10::isComplexType(dtype) &&
      !c10::isIntegralType(dtype, /*includeBool=*/false))
    throw InvalidArgument(std::string("accel::") + name + ": dtype " + c10::toString(dtype) + " cannot be reduced");
}
}  // namespace detail

ACCEL_NAMESPACE_END
