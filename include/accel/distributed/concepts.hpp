// accel/distributed/concepts.hpp: what the collectives take: Scalar, ScalarVector, TensorLike.
//
// A scalar travels as a 0-d tensor and a std::vector as a 1-d tensor over the
// same memory (no copy on the CPU); results come back in the caller's type.
#pragma once

#include "accel/core/enums.hpp"
#include "accel/distributed/torch.hpp"

ACCEL_NAMESPACE_BEGIN

template <class T>
concept Scalar = std::is_arithmetic_v<T> && !std::same_as<T, bool>;

namespace detail {
template <class T>
struct scalar_vector : std::false_type {};
template <Scalar T>
struct scalar_vector<std::vector<T>> : std::true_type {
  using element = T;
};
}  // namespace detail

template <class T>
concept ScalarVector = detail::scalar_vector<T>::value;

template <class T>
concept TensorLike = std::same_as<T, at::Tensor> || Scalar<T> || ScalarVector<T>;

namespace detail {
template <class T>
struct element_of {
  using type = T;
};
template <ScalarVector T>
struct element_of<T> {
  using type = typename scalar_vector<T>::element;
};
template <class T>
using element_t = typename element_of<T>::type;

// The ATen dtype that holds every value of T exactly, if there is one.
template <Scalar T>
constexpr std::optional<c10::ScalarType> exact_dtype() {
  if constexpr (std::is_same_v<T, float>) return c10::kFloat;
  else if constexpr (std::is_same_v<T, double>) return c10::kDouble;
  else if constexpr (std::is_floating_point_v<T>) return std::nullopt;  // long double
  else if constexpr (sizeof(T) == 1) return std::is_signed_v<T> ? c10::kChar : c10::kByte;
  else if constexpr (!std::is_signed_v<T>) return std::nullopt;  // no unsigned dtypes in 1.x
  else if constexpr (sizeof(T) == 2) return c10::kShort;
  else if constexpr (sizeof(T) == 4) return c10::kInt;
  else return c10::kLong;
}

// Dtypes every backend reduces natively (Gloo has no int16 kernels).
template <Scalar T>
constexpr bool travels_natively() {
  constexpr auto dtype = exact_dtype<T>();
  return dtype.has_value() && *dtype != c10::kShort;
}

// The dtype operate_tensorlike presents to its function: exact where ATen has
// one, otherwise the smallest dtype that holds the values.
template <Scalar T>
constexpr c10::ScalarType value_dtype() {
  if constexpr (exact_dtype<T>().has_value()) return *exact_dtype<T>();
  else if constexpr (std::is_floating_point_v<T>) return c10::kDouble;
  else if constexpr (sizeof(T) == 2) return c10::kInt;
  else return c10::kLong;
}
// ATen's own C++ type for that dtype: data_ptr<T>() and item<T>() exist only
// for these (int64_t, not long long; int8_t, not char).
template <Scalar T>
using value_type_t = c10::impl::ScalarTypeToCPPTypeT<value_dtype<T>()>;

template <Scalar T>
value_type_t<T> to_value(T x) {
  if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8)
    if (x > static_cast<T>(INT64_MAX))
      throw OutOfRange("accel::operate_tensorlike: uint64 value " + std::to_string(x) +
                       " does not fit LibTorch's int64 dtype");
  return static_cast<value_type_t<T>>(x);
}

inline at::TensorOptions cpu_options(c10::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(c10::kCPU);
}

// Tensors that alias the caller's memory.
template <Scalar T>
at::Tensor alias(T& value, c10::ScalarType dtype) {
  return at::from_blob(&value, {}, cpu_options(dtype));
}
template <Scalar T>
at::Tensor alias(std::vector<T>& values, c10::ScalarType dtype) {
  if (values.empty()) return at::empty({0}, cpu_options(dtype));  // (no memory to alias)
  return at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, cpu_options(dtype));
}
template <Scalar T>
at::Tensor alias_bytes(T& value) {
  return at::from_blob(&value, {static_cast<int64_t>(sizeof(T))}, cpu_options(c10::kByte));
}
template <Scalar T>
at::Tensor alias_bytes(std::vector<T>& values) {
  if (values.empty()) return at::empty({0}, cpu_options(c10::kByte));
  return at::from_blob(values.data(), {static_cast<int64_t>(values.size() * sizeof(T))}, cpu_options(c10::kByte));
}

// How data travels in a collective: a view of its own memory, in its dtype
// where every backend reduces it natively, else as raw bytes.
template <class V>
at::Tensor memory_view(V& data) {
  using E = element_t<V>;
  if constexpr (travels_natively<E>()) return alias(data, *exact_dtype<E>());
  else return alias_bytes(data);
}

template <Scalar T>
T from_value_tensor(const at::Tensor& result) {
  if (result.numel() != 1)
    throw InvalidArgument("accel::operate_tensorlike: a scalar's function returned " + std::to_string(result.numel()) +
                          " elements");
  using V = value_type_t<T>;
  return static_cast<T>(result.to(c10::kCPU).to(value_dtype<T>()).template item<V>());
}
template <Scalar T>
std::vector<T> from_value_tensor(const at::Tensor& result, std::vector<T>&& original, const void* original_data) {
  if (result.data_ptr() == original_data && result.numel() == static_cast<int64_t>(original.size()) &&
      result.scalar_type() == value_dtype<T>() && result.is_contiguous())
    return std::move(original);  // the function worked in place
  auto flat = result.to(c10::kCPU).to(value_dtype<T>()).contiguous().reshape({-1});
  const auto* data = flat.template data_ptr<value_type_t<T>>();
  return std::vector<T>(data, data + flat.numel());
}
}  // namespace detail

// Applies fn (at::Tensor -> at::Tensor) to data and returns the result in
// data's C++ type. Types without an exact ATen dtype (unsigned 16/32/64-bit,
// long double) are presented as the smallest dtype that holds their values.
template <TensorLike T, class Fn>
  requires std::invocable<Fn&, at::Tensor&>
T operate_tensorlike(Fn&& fn, T data) {
  if constexpr (std::same_as<T, at::Tensor>) {
    return std::invoke(fn, data);
  } else if constexpr (Scalar<T>) {
    auto value = detail::to_value(data);
    at::Tensor tensor = at::from_blob(&value, {}, detail::cpu_options(detail::value_dtype<T>()));
    at::Tensor result = std::invoke(fn, tensor);
    return detail::from_value_tensor<T>(result);
  } else {
    using E = detail::element_t<T>;
    if constexpr (detail::exact_dtype<E>().has_value()) {
      at::Tensor tensor = detail::alias(data, *detail::exact_dtype<E>());
      const void* original = data.data();
      at::Tensor result = std::invoke(fn, tensor);
      return detail::from_value_tensor<E>(result, std::move(data), original);
    } else {
      std::vector<detail::value_type_t<E>> values;
      values.reserve(data.size());
      for (E x : data) values.push_back(detail::to_value(x));
      at::Tensor tensor = detail::alias(values, detail::value_dtype<E>());
      at::Tensor result = std::invoke(fn, tensor);
      return detail::from_value_tensor<E>(result, {}, nullptr);  // converted back element by element
    }
  }
}

ACCEL_NAMESPACE_END
