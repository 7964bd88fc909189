// accel/distributed/objects.hpp: objects through the pickler: broadcast_object_list, gather_object, ....
//
// Objects travel as c10::IValue, serialized with LibTorch's own pickler
// (torch::jit::pickle_save: the format of torch.save), framed by a header
// with the payload's length and hash, so truncated or corrupted bytes are an
// exception before the unpickler sees them. (The check is not optional:
// LibTorch 1.13's pickle_load reads past its buffer on some corrupted
// archives — a heap-buffer-overflow in its zip reader, found with ASan.)
#pragma once

#include "accel/distributed/operations.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
template <class T>
using picklable_leaf = std::bool_constant<std::is_arithmetic_v<T> || std::is_same_v<T, std::string> ||
                                          std::is_same_v<T, at::Tensor> || std::is_same_v<T, c10::IValue>>;
template <class T>
using picklable = nested_fold<picklable_leaf, true, T>;
}  // namespace detail

// What gather_object and broadcast_object_list move: c10::IValue, numbers,
// bool, std::string, tensors, and vectors, string-keyed maps, tuples and
// pairs of those.
template <class T>
concept Picklable = detail::picklable<T>::value;

namespace detail {
template <Picklable T>
c10::IValue to_ivalue(const T& x) {
  if constexpr (std::is_same_v<T, c10::IValue>) {
    return x;
  } else if constexpr (std::is_same_v<T, bool>) {
    return c10::IValue(x);
  } else if constexpr (std::is_integral_v<T>) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8)
      if (x > static_cast<T>(INT64_MAX))
        throw OutOfRange("accel: uint64 value " + std::to_string(x) + " does not fit an IValue's int64");
    return c10::IValue(static_cast<int64_t>(x));
  } else if constexpr (std::is_floating_point_v<T>) {
    return c10::IValue(static_cast<double>(x));  // IValue holds doubles
  } else if constexpr (std::is_same_v<T, std::string>) {
    return c10::IValue(x);
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    // The pickler writes a tensor's whole storage: a view (a row of a
    // dataset, a slice of a batch) travels as a compact copy instead.
    const bool compact =
        !x.defined() || x.layout() != at::kStrided ||
        (x.is_contiguous() && x.storage_offset() == 0 && x.storage().nbytes() == static_cast<std::size_t>(x.nbytes()));
    return c10::IValue(compact ? x : x.clone(at::MemoryFormat::Contiguous));
  } else if constexpr (is_vector<T>::value) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(x.size());
    if constexpr (std::is_same_v<typename T::value_type, bool>)  // std::vector<bool> has no bool&
      for (bool element : x) list.push_back(c10::IValue(element));
    else
      for (const auto& element : x) list.push_back(to_ivalue(element));
    return list;
  } else if constexpr (is_string_map<T>::value) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (auto* entry : entries_by_key(x)) dict.insert(entry->first, to_ivalue(entry->second));
    return dict;
  } else {
    std::vector<c10::IValue> elements;
    std::apply([&](const auto&... element) { (elements.push_back(to_ivalue(element)), ...); }, x);
    return c10::ivalue::Tuple::create(std::move(elements));
  }
}

[[noreturn]] inline void wrong_object(const char* expected, const c10::IValue& v) {
  throw InvalidArgument(std::string("accel: received object is a ") + v.tagKind() + ", expected " + expected);
}

template <Picklable T>
T from_ivalue(const c10::IValue& v) {
  if constexpr (std::is_same_v<T, c10::IValue>) {
    return v;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.isBool()) wrong_object("bool", v);
    return v.toBool();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.isInt()) wrong_object("int", v);
    const int64_t i = v.toInt();
    if (!c10::overflows<T>(i) || (std::is_unsigned_v<T> && sizeof(T) == 8 && i >= 0)) return static_cast<T>(i);
    throw OutOfRange("accel: received integer " + std::to_string(i) + " does not fit the requested type");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.isDouble()) wrong_object("float", v);
    return static_cast<T>(v.toDouble());
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.isString()) wrong_object("string", v);
    return v.toStringRef();
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    if (!v.isTensor()) wrong_object("tensor", v);
    return v.toTensor();
  } else if constexpr (is_vector<T>::value) {
    if (!v.isList()) wrong_object("list", v);
    T out;
    for (const c10::IValue& element : v.toListRef()) out.push_back(from_ivalue<typename T::value_type>(element));
    return out;
  } else if constexpr (is_string_map<T>::value) {
    if (!v.isGenericDict()) wrong_object("dict", v);
    T out;
    for (const auto& entry : v.toGenericDict()) {
      if (!entry.key().isString()) wrong_object("string key", entry.key());
      out.emplace(entry.key().toStringRef(), from_ivalue<typename T::mapped_type>(entry.value()));
    }
    return out;
  } else {
    if (!v.isTuple()) wrong_object("tuple", v);
    const c10::ArrayRef<c10::IValue> elements = v.toTupleRef().elements().asArrayRef();
    if (elements.size() != std::tuple_size_v<T>)
      throw InvalidArgument("accel: received a tuple of " + std::to_string(elements.size()) + " elements, expected " +
                            std::to_string(std::tuple_size_v<T>));
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return T{from_ivalue<std::tuple_element_t<I, T>>(elements[I])...};
    }(std::make_index_sequence<std::tuple_size_v<T>>{});
  }
}

constexpr char kObjectMagic[8] = {'A', 'C', 'C', 'E', 'L', 'O', 'B', '1'};
constexpr std::size_t kObjectHeader = 24;  // magic, payload length, payload hash

inline std::vector<char> save_object(const c10::IValue& value) {
  std::vector<char> payload = torch::jit::pickle_save(value);
  std::vector<char> framed(kObjectHeader + payload.size());
  const uint64_t length = payload.size(), hash = fnv1a(payload.data(), payload.size());
  std::memcpy(framed.data(), kObjectMagic, 8);
  std::memcpy(framed.data() + 8, &length, 8);
  std::memcpy(framed.data() + 16, &hash, 8);
  std::memcpy(framed.data() + kObjectHeader, payload.data(), payload.size());
  return framed;
}

// Throws RuntimeError on bytes that save_object did not write intact.
inline c10::IValue load_object(const char* data, std::size_t size) {
  auto corrupt = [&](const std::string& why) {
    return RuntimeError("accel: received object bytes are not intact (" + why + ", " + std::to_string(size) +
                        " bytes)");
  };
  if (size < kObjectHeader || std::memcmp(data, kObjectMagic, 8) != 0) throw corrupt("no accel object header");
  uint64_t length = 0, hash = 0;
  std::memcpy(&length, data + 8, 8);
  std::memcpy(&hash, data + 16, 8);
  if (length != size - kObjectHeader) throw corrupt("length " + std::to_string(length) + " in the header");
  if (hash != fnv1a(data + kObjectHeader, length)) throw corrupt("hash mismatch");
  try {
    return torch::jit::pickle_load(std::vector<char>(data + kObjectHeader, data + size));
  } catch (const std::exception& e) {
    throw RuntimeError("accel: cannot unpickle a received object: " + error_text(e));
  }
}
}  // namespace detail

namespace detail {
// gather_object's result: a vector's elements, or the objects themselves.
template <class T>
struct gathered_objects {
  using type = std::vector<T>;
};
template <class T>
struct gathered_objects<std::vector<T>> {
  using type = std::vector<T>;
};
}  // namespace detail

// Gathers an object from every rank of the group, in rank order, on every
// rank: a std::vector is concatenated (as Accelerate flattens lists), any
// other object becomes one element. One size exchange, one payload collective.
template <Picklable T>
auto gather_object(const T& object, const GroupPtr& group = {}) {
  using Result = typename detail::gathered_objects<T>::type;
  auto flatten_into = [](Result& out, T&& piece) {
    if constexpr (detail::is_vector<T>::value)
      out.insert(out.end(), std::make_move_iterator(piece.begin()), std::make_move_iterator(piece.end()));
    else out.push_back(std::move(piece));
  };
  Result result;
  c10d::ProcessGroup* g = detail::resolve(group, "gather_object");
  if (!g) {
    flatten_into(result, T(object));
    return result;
  }
  detail::check_same_call(*g, [] { return std::string("gather_object()"); });
  std::vector<char> mine = detail::save_object(detail::to_ivalue(object));
  const int size = g->getSize();
  const std::vector<int64_t> lengths =
      detail::exchange_counts(*g, {static_cast<int64_t>(mine.size())}, "gather_object");
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  mine.resize(static_cast<std::size_t>(longest));
  std::vector<char> all(static_cast<std::size_t>(longest) * size);
  detail::all_gather_cpu(*g, reinterpret_cast<const uint8_t*>(mine.data()), longest,
                         reinterpret_cast<uint8_t*>(all.data()), "gather_object");
  for (int r = 0; r < size; ++r)
    flatten_into(result, detail::from_ivalue<T>(
                             detail::load_object(all.data() + longest * r, static_cast<std::size_t>(lengths[r]))));
  return result;
}

namespace detail {
// What `step` threw, as text; "" when it returned.
template <class Step>
std::string error_of(Step&& step) {
  try {
    step();
    return {};
  } catch (const std::exception& e) {
    return error_text(e);
  }
}
// Every rank of the group passes its error ("" if none); if any rank has one,
// every rank throws the same Error listing them, by rank. A collective: it
// also orders what comes before it on every rank before what comes after.
template <class Error = RuntimeError>
void fail_together(const std::string& error, std::string_view function, const GroupPtr& group = {}) {
  const std::vector<std::string> errors = accel::gather_object(error, group);
  std::string message;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      message +=
          (message.empty() ? "" : "; ") + (errors.size() > 1 ? "rank " + std::to_string(r) + ": " : "") + errors[r];
  if (!message.empty()) throw Error(std::string(function) + ": " + message);
}
}  // namespace detail

// Replaces `objects` on every rank with rank `from_process`'s (a rank within
// the group; the others' lists may have any length). One size broadcast,
// one payload broadcast. Returns objects.
template <Picklable T>
std::vector<T>& broadcast_object_list(std::vector<T>& objects, int from_process = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "broadcast_object_list");
  detail::check_source(g, from_process, "broadcast_object_list", "from_process");
  if (!g) return objects;
  detail::check_same_call(*g, [&] { return "broadcast_object_list(src=" + std::to_string(from_process) + ")"; });
  const bool source = g->getRank() == from_process;
  std::vector<char> bytes;
  if (source) bytes = detail::save_object(detail::to_ivalue(objects));
  int64_t length = static_cast<int64_t>(bytes.size());
  at::Tensor length_view = at::from_blob(&length, {1}, detail::cpu_options(c10::kLong));
  detail::broadcast_tensor(*g, length_view, from_process);
  bytes.resize(static_cast<std::size_t>(length));
  at::Tensor payload = at::from_blob(bytes.data(), {length}, detail::cpu_options(c10::kByte));
  detail::broadcast_tensor(*g, payload, from_process);
  if (!source) objects = detail::from_ivalue<std::vector<T>>(detail::load_object(bytes.data(), bytes.size()));
  return objects;
}

ACCEL_NAMESPACE_END
