// accel/core/enums.hpp: ReduceOp, Dim, DeviceType and friends, with their string forms.
#pragma once

#include "accel/core/errors.hpp"

ACCEL_NAMESPACE_BEGIN

enum class DeviceType { CPU, CUDA, META, MPS, NPU, XPU };
enum class ReduceOp { SUM, MEAN, MAX, MIN };
enum class Dim { MP_REPLICATE, MP_SHARD, DP, CP, TP, PP };

namespace detail {
template <class E>
struct enum_names;
template <>
struct enum_names<DeviceType> {
  static constexpr std::string_view type = "DeviceType";
  static constexpr std::array<std::string_view, 6> names{"cpu", "cuda", "meta", "mps", "npu", "xpu"};
};
template <>
struct enum_names<ReduceOp> {
  static constexpr std::string_view type = "ReduceOp";
  static constexpr std::array<std::string_view, 4> names{"sum", "mean", "max", "min"};
};
template <>
struct enum_names<Dim> {
  static constexpr std::string_view type = "Dim";
  static constexpr std::array<std::string_view, 6> names{"mp_replicate", "mp_shard", "dp", "cp", "tp", "pp"};
};
template <class E>
concept AccelEnum = requires { enum_names<E>::names; };
}  // namespace detail

template <detail::AccelEnum E>
constexpr std::string_view to_string(E value) {
  return detail::enum_names<E>::names.at(static_cast<std::size_t>(value));
}

template <detail::AccelEnum E>
E from_string(std::string_view text) {
  const auto& names = detail::enum_names<E>::names;
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == text) return static_cast<E>(i);
  std::string expected;
  for (auto name : names) expected += (expected.empty() ? "" : ", ") + std::string(name);
  throw InvalidArgument("accel::from_string<" + std::string(detail::enum_names<E>::type) + ">: unknown value '" +
                        std::string(text) + "' (expected one of: " + expected + ")");
}

template <detail::AccelEnum E>
std::ostream& operator<<(std::ostream& os, E value) {
  return os << to_string(value);
}

ACCEL_NAMESPACE_END
