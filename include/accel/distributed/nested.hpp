// accel/distributed/nested.hpp: nested data (vectors, maps, tuples of tensors), packed for few collectives.
//
// Hugging Face Accelerate's distributed operations, names kept, over nested
// data: a tensor, or a std::vector, std::map / std::unordered_map with string
// keys, std::tuple or std::pair of nested data. Leaves that are not tensors
// pass through untouched, as in Accelerate's recursively_apply. Maps are
// walked in key order (unordered ones too), so every rank meets the same
// leaves in the same order. Every collective takes a group (default: the
// world), e.g. DistributedInterface::instance().get_group(Dim::DP), and moves a
// whole structure in as few collectives as its dtypes allow.
#pragma once

#include "accel/distributed/debug_check.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};

template <class T>
struct is_string_map : std::false_type {};
template <class V, class C, class A>
struct is_string_map<std::map<std::string, V, C, A>> : std::true_type {};
template <class V, class H, class E, class A>
struct is_string_map<std::unordered_map<std::string, V, H, E, A>> : std::true_type {};

// Folds a property of the leaves over nested data: with All, whether every
// leaf has it; otherwise whether some leaf does. Containers are never leaves.
template <template <class> class Leaf, bool All, class T>
struct nested_fold : Leaf<T> {};
template <template <class> class Leaf, bool All, class T, class A>
struct nested_fold<Leaf, All, std::vector<T, A>> : nested_fold<Leaf, All, T> {};
template <template <class> class Leaf, bool All, class V, class C, class A>
struct nested_fold<Leaf, All, std::map<std::string, V, C, A>> : nested_fold<Leaf, All, V> {};
template <template <class> class Leaf, bool All, class V, class H, class E, class A>
struct nested_fold<Leaf, All, std::unordered_map<std::string, V, H, E, A>> : nested_fold<Leaf, All, V> {};
template <template <class> class Leaf, bool All, class... Ts>
struct nested_fold<Leaf, All, std::tuple<Ts...>>
    : std::conditional_t<All, std::conjunction<nested_fold<Leaf, All, Ts>...>,
                         std::disjunction<nested_fold<Leaf, All, Ts>...>> {};
template <template <class> class Leaf, bool All, class A, class B>
struct nested_fold<Leaf, All, std::pair<A, B>> : nested_fold<Leaf, All, std::tuple<A, B>> {};

template <class T>
using is_tensor = std::is_same<T, at::Tensor>;
// Whether T can hold a tensor somewhere (containers of plain values are
// leaves as a whole: nothing to walk).
template <class T>
using holds_tensor = nested_fold<is_tensor, false, T>;
// Nested data whose every leaf is a tensor: what collectives accept.
template <class T>
using tensor_tree = nested_fold<is_tensor, true, T>;

template <class T>
struct is_ordered_map : std::false_type {};
template <class V, class C, class A>
struct is_ordered_map<std::map<std::string, V, C, A>> : std::true_type {};

// A map's entries in key order (std::map already is; unordered_map is not,
// and its order may differ between processes).
template <class Map>
auto entries_by_key(Map& map) {
  std::vector<decltype(&*map.begin())> entries;
  entries.reserve(map.size());
  for (auto& entry : map) entries.push_back(&entry);
  if constexpr (!is_ordered_map<std::remove_const_t<Map>>::value)
    std::sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
  return entries;
}

// Calls fn(tensor) on every tensor leaf, in the fixed order; values under a
// key in `skip` are left alone. T may be const.
template <class T, class Fn>
void for_each_tensor(T& data, Fn& fn, const std::vector<std::string>* skip = nullptr) {
  using U = std::remove_const_t<T>;
  if constexpr (!holds_tensor<U>::value) {
    return;
  } else if constexpr (std::is_same_v<U, at::Tensor>) {
    fn(data);
  } else if constexpr (is_vector<U>::value) {
    for (auto& element : data) for_each_tensor(element, fn, skip);
  } else if constexpr (is_string_map<U>::value) {
    for (auto* entry : entries_by_key(data)) {
      if (skip && std::find(skip->begin(), skip->end(), entry->first) != skip->end()) continue;
      for_each_tensor(entry->second, fn, skip);
    }
  } else {
    std::apply([&](auto&... element) { (for_each_tensor(element, fn, skip), ...); }, data);
  }
}

template <class T>
std::vector<at::Tensor> tensor_leaves(const T& data) {
  std::vector<at::Tensor> leaves;
  auto collect = [&](const at::Tensor& t) { leaves.push_back(t); };
  for_each_tensor(data, collect);
  return leaves;
}

// Writes `values` into the tensor leaves of `data`, in order.
template <class T>
T with_leaves(T data, std::vector<at::Tensor>&& values) {
  std::size_t next = 0;
  auto assign = [&](at::Tensor& t) { t = std::move(values[next++]); };
  for_each_tensor(data, assign);
  return data;
}

// The structure of nested data as text; `leaf(t)` describes each tensor,
// other leaves show as '_'.
template <class T, class Leaf>
void describe_nested(std::string& out, const T& data, const Leaf& leaf) {
  if constexpr (!holds_tensor<T>::value) {
    out += '_';
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    out += leaf(data);
  } else if constexpr (is_vector<T>::value) {
    out += '[';
    for (std::size_t i = 0; i < data.size(); ++i) {
      if (i) out += ", ";
      describe_nested(out, data[i], leaf);
    }
    out += ']';
  } else if constexpr (is_string_map<T>::value) {
    out += '{';
    bool first = true;
    for (auto* entry : entries_by_key(data)) {
      out += (first ? "'" : ", '") + entry->first + "': ";
      first = false;
      describe_nested(out, entry->second, leaf);
    }
    out += '}';
  } else {
    out += '(';
    bool first = true;
    std::apply(
        [&](const auto&... element) {
          ((out += first ? "" : ", ", first = false, describe_nested(out, element, leaf)), ...);
        },
        data);
    out += ')';
  }
}

// A collective's call as debug mode compares it: the operation, every
// tensor's dtype, shape and device (`free_dim(t)`: a dimension allowed to
// differ between ranks, shown as '*'), and the other arguments.
template <class T, class FreeDim>
std::string describe_call(const char* op, const T& data, const FreeDim& free_dim, const std::string& args = {}) {
  std::string out = std::string(op) + "(";
  describe_nested(out, data, [&](const at::Tensor& t) { return describe_tensor(t, free_dim(t)); });
  return out + args + ")";
}

inline void check_defined(const std::vector<at::Tensor>& leaves, const char* op) {
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (!leaves[i].defined())
      throw InvalidArgument(std::string("accel::") + op + ": tensor leaf " + std::to_string(i) +
                            " (in walking order) is undefined");
}

// Leaves grouped by a key (device, or dtype and device), in first-seen order.
template <class Key>
std::vector<std::pair<Key, std::vector<std::size_t>>> group_leaves(const std::vector<at::Tensor>& leaves,
                                                                   Key (*key)(const at::Tensor&)) {
  std::vector<std::pair<Key, std::vector<std::size_t>>> groups;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    Key k = key(leaves[i]);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {i}});
    else it->second.push_back(i);
  }
  return groups;
}
inline c10::Device device_key(const at::Tensor& t) { return t.device(); }
inline std::pair<c10::ScalarType, c10::Device> dtype_device_key(const at::Tensor& t) {
  return {t.scalar_type(), t.device()};
}

// The one packing path: several tensors travel in one flat buffer (gather,
// broadcast, reduce, DataParallel's buckets). Parts of one dtype lie back to
// back, so that a reduction runs on the buffer as that dtype; in a byte
// buffer (collectives that only move bytes) parts of any dtypes each start at
// a 16-byte boundary, so every part's view is aligned for its dtype. Views
// share the buffer's storage, and keep it alive.
constexpr int64_t kAlign = 16;
class Packing {
 public:
  explicit Packing(c10::ScalarType dtype = c10::kByte)
      : dtype_(dtype), unit_(static_cast<int64_t>(c10::elementSize(dtype))) {}
  // Places a part; returns its index.
  std::size_t add(c10::IntArrayRef sizes, c10::ScalarType dtype) {
    TORCH_INTERNAL_ASSERT(dtype_ == c10::kByte || dtype == dtype_, "accel: a part of another dtype in a typed packing");
    const int64_t align = dtype_ == c10::kByte ? kAlign : unit_;
    end_ = (end_ + align - 1) / align * align;
    parts_.push_back(Part{end_, sizes.vec(), dtype});
    end_ += c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
    return parts_.size() - 1;
  }
  std::size_t add(const at::Tensor& t) { return add(t.sizes(), t.scalar_type()); }
  std::size_t size() const { return parts_.size(); }
  // Bytes the layout spans, rounded up to kAlign in a byte packing (so that
  // buffers laid side by side keep every part aligned).
  int64_t bytes() const { return dtype_ == c10::kByte ? (end_ + kAlign - 1) / kAlign * kAlign : end_; }
  // An uninitialised buffer of the packing's dtype, at least `bytes` long
  // (never empty: Gloo divides by the element count).
  at::Tensor buffer(const at::TensorOptions& options, int64_t bytes = 0) const {
    return at::empty({std::max(bytes / unit_, elements())}, options.dtype(dtype_));
  }
  // Elements of the packing's dtype in a buffer (at least one).
  int64_t elements() const { return std::max(bytes(), dtype_ == c10::kByte ? kAlign : unit_) / unit_; }
  // Part k of a buffer laid out as this packing (it may be a row of a larger one).
  at::Tensor view(const at::Tensor& buffer, std::size_t k) const {
    const Part& part = parts_[k];
    const auto unit = static_cast<int64_t>(c10::elementSize(part.dtype));
    const int64_t start = buffer.storage_offset() * static_cast<int64_t>(buffer.element_size()) + part.offset;
    TORCH_INTERNAL_ASSERT(start % unit == 0, "accel: a packed part is misaligned");
    std::vector<int64_t> strides(part.sizes.size(), 1);
    for (std::size_t d = part.sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(part.sizes[d], 1);
    return at::empty({0}, buffer.options().dtype(part.dtype)).set_(buffer.storage(), start / unit, part.sizes, strides);
  }
  // A new buffer holding copies of `tensors` (tensors[k] is part k).
  at::Tensor pack(c10::ArrayRef<at::Tensor> tensors, const at::TensorOptions& options) const {
    at::Tensor out = buffer(options);
    for (std::size_t k = 0; k < tensors.size(); ++k) view(out, k).copy_(tensors[k]);
    return out;
  }

 private:
  struct Part {
    int64_t offset;  // bytes
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
  };
  c10::ScalarType dtype_;
  int64_t unit_;
  int64_t end_ = 0;
  std::vector<Part> parts_;
};

}  // namespace detail

ACCEL_NAMESPACE_END
