// accel/distributed/debug_check.hpp: debug mode's check that every rank made the same call, and the texts that describe a call.
#pragma once

#include "accel/distributed/start_gather.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// FNV-1a: the same on every host and compiler (std::hash promises neither).
inline uint64_t fnv1a(const void* data, std::size_t size) {
  uint64_t hash = 1469598103934665603ull;
  for (std::size_t i = 0; i < size; ++i) {
    hash ^= static_cast<const unsigned char*>(data)[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

// Debug mode: one fixed-size all_gather of (hash, length) of every rank's
// description of its call; only on a mismatch a second one carries the
// texts, so that every rank throws the same listing. Both are the same size
// on every rank whatever was passed, so the check itself cannot desynchronise.
inline void verify_same_call(c10d::ProcessGroup& group, const std::string& call) {
  const int size = group.getSize();
  std::array<int64_t, 2> mine{static_cast<int64_t>(fnv1a(call.data(), call.size())), static_cast<int64_t>(call.size())};
  std::vector<int64_t> all(2 * static_cast<std::size_t>(size));
  all_gather_cpu<int64_t>(group, mine.data(), 2, all.data(), "debug-mode check");
  // Decided on data every rank holds, so every rank decides alike.
  int64_t longest = 0;
  bool same = true;
  for (int r = 0; r < size; ++r) {
    same = same && all[2 * r] == all[0] && all[2 * r + 1] == all[1];
    longest = std::max(longest, all[2 * r + 1]);
  }
  if (same) return;
  std::string padded = call;
  padded.resize(static_cast<std::size_t>(longest), '\0');
  std::string texts(static_cast<std::size_t>(longest) * size, '\0');
  all_gather_cpu(group, reinterpret_cast<const uint8_t*>(padded.data()), longest,
                 reinterpret_cast<uint8_t*>(texts.data()), "debug-mode check");
  std::string message = "accel [ACCEL_DEBUG_MODE]: the ranks of group '" + group_name(group) + "' (" +
                        group.getBackendName() + ", " + std::to_string(size) + " ranks) made different calls:";
  for (int r = 0; r < size; ++r)
    message += "\n  rank " + std::to_string(r) + ": " +
               texts.substr(static_cast<std::size_t>(longest) * r, static_cast<std::size_t>(all[2 * r + 1]));
  throw DistributedError(message);
}

// Debug mode's check, through the pointer that registering a group or
// set_debug_mode sets (registration.hpp says why).
inline void verify_call(c10d::ProcessGroup& group, const std::string& call) {
  auto* verify = registry().verify_same_call.load(std::memory_order_acquire);
  if (!verify)
    throw LogicError(
        "accel: debug mode is on (or ACCEL_DEBUG_MODE is set) but its check is not set up in this process: it comes "
        "with the groups accel makes (DistributedInterface::instance(), new_group, split_group, meshes) and with "
        "accel::set_debug_mode(); call accel::set_debug_mode(true) before using a group made with c10d directly "
        "(or set_debug_mode(std::nullopt) to go by ACCEL_DEBUG_MODE)");
  verify(group, call);
}
// Runs the debug-mode check when it is on; `describe` builds the text only then.
template <class Describe>
void check_same_call(c10d::ProcessGroup& group, Describe&& describe) {
  if (checking_calls()) [[unlikely]]
    verify_call(group, describe());
}

inline std::string describe_tensor(const at::Tensor& t, std::optional<int64_t> free_dim = std::nullopt) {
  if (!t.defined()) return "undefined tensor";
  std::ostringstream os;
  os << t.scalar_type() << "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) os << ", ";
    if (free_dim && *free_dim == i) os << '*';
    else os << t.size(i);
  }
  os << "] " << t.device();
  return os.str();
}

// Debug mode's texts are built only when it is on, but their code is
// compiled in every file that calls a collective; so the building is done by
// these functions, compiled once per file, rather than at each call site.
// A number type (int32, uint8, float64); a std::vector of them with its size.
inline std::string number_type(bool floating, bool is_signed, std::size_t bytes) {
  return (floating ? "float" : is_signed ? "int" : "uint") + std::to_string(bytes * 8);
}
inline std::string vector_of(const std::string& element, std::size_t size) {
  return "vector<" + element + ">[" + std::to_string(size) + "]";
}
// A call: "op(arg, arg)".
inline std::string call_text(const char* op, std::initializer_list<std::string_view> args) {
  std::string text = std::string(op) + "(";
  for (std::string_view arg : args) text.append(text.back() == '(' ? "" : ", ").append(arg);
  return text + ")";
}

template <Scalar T>
std::string type_tag() {
  return number_type(std::is_floating_point_v<T>, std::is_signed_v<T>, sizeof(T));
}

template <TensorLike T>
std::string describe_tensorlike(const T& data) {
  if constexpr (std::same_as<T, at::Tensor>) return describe_tensor(data);
  else if constexpr (Scalar<T>) return type_tag<T>();
  else return vector_of(type_tag<element_t<T>>(), data.size());
}

// An in-place operation (all_reduce, broadcast, reduce_to, recv) writes every element of
// the tensor it is given. Elements that share memory (expand(), a stride of 0)
// would each receive a result in the same place: c10d notices only after the
// collective ran (a c10::Error on every rank), and nothing notices on one
// process, so it is refused before anything is sent, at every world size.
inline void check_no_overlap(const at::Tensor& t, const char* op) {
  if (!t.defined() || at::has_internal_overlap(t) != at::MemOverlap::Yes) return;
  std::ostringstream os;
  os << "accel::" << op << ": the " << describe_tensor(t) << " has elements that share memory (strides " << t.strides()
     << ", as from expand()), so it cannot receive the result in place; pass .contiguous() or .clone()";
  throw InvalidArgument(os.str());
}
template <TensorLike T>
void check_writable(const T& data, const char* op) {
  if constexpr (std::same_as<T, at::Tensor>) check_no_overlap(data, op);
}
}  // namespace detail

ACCEL_NAMESPACE_END
