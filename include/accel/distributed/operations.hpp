// accel/distributed/operations.hpp: Accelerate's operations: gather, pad_across_processes, reduce, ....
#pragma once

#include "accel/distributed/exchange.hpp"
#include "accel/distributed/nested.hpp"

ACCEL_NAMESPACE_BEGIN

// Nested data whose every leaf is an at::Tensor (what the collectives below take).
template <class T>
concept TensorTree = detail::tensor_tree<T>::value;

// Applies fn (tensor -> tensor) to every tensor leaf; everything else is
// copied through. Values under a map key listed in skip_keys are left alone.
template <class T, class Fn>
  requires std::invocable<Fn&, const at::Tensor&>
T recursively_apply(Fn&& fn, T data, const std::vector<std::string>& skip_keys = {}) {
  auto apply = [&](at::Tensor& t) { t = std::invoke(fn, std::as_const(t)); };
  detail::for_each_tensor(data, apply, skip_keys.empty() ? nullptr : &skip_keys);
  return data;
}

// Moves every tensor leaf to `device` (values under skip_keys stay).
template <class T>
T send_to_device(T data, c10::Device device, bool non_blocking = false,
                 const std::vector<std::string>& skip_keys = {}) {
  return recursively_apply([&](const at::Tensor& t) { return t.to(device, non_blocking); }, std::move(data), skip_keys);
}

// The size along dim 0 of the first tensor leaf; nullopt when there is none.
template <class T>
std::optional<int64_t> find_batch_size(const T& data) {
  auto leaves = detail::tensor_leaves(data);
  if (leaves.empty()) return std::nullopt;
  if (leaves.front().dim() == 0)
    throw InvalidArgument("accel::find_batch_size: the first tensor is 0-d and has no batch dimension");
  return leaves.front().size(0);
}

// The device of the first tensor leaf; nullopt when there is none.
template <class T>
std::optional<c10::Device> find_device(const T& data) {
  auto leaves = detail::tensor_leaves(data);
  if (leaves.empty()) return std::nullopt;
  return leaves.front().device();
}

// Concatenates structures of the same layout leaf by leaf along `dim`;
// non-tensor leaves come from the first structure.
template <class T>
T concatenate(const std::vector<T>& data, int64_t dim = 0) {
  if (data.empty()) throw InvalidArgument("accel::concatenate: nothing to concatenate");
  auto layout = [](const T& x) {
    std::string out;
    detail::describe_nested(out, x, [](const at::Tensor&) { return std::string("tensor"); });
    return out;
  };
  const std::string expected = layout(data.front());
  std::vector<std::vector<at::Tensor>> columns;
  for (std::size_t k = 0; k < data.size(); ++k) {
    if (k > 0 && layout(data[k]) != expected)
      throw InvalidArgument("accel::concatenate: element " + std::to_string(k) + " is laid out as " + layout(data[k]) +
                            ", element 0 as " + expected);
    auto leaves = detail::tensor_leaves(data[k]);
    columns.resize(leaves.size());
    for (std::size_t i = 0; i < leaves.size(); ++i) columns[i].push_back(std::move(leaves[i]));
  }
  std::vector<at::Tensor> joined;
  joined.reserve(columns.size());
  for (auto& column : columns) joined.push_back(at::cat(column, dim));
  return detail::with_leaves(data.front(), std::move(joined));
}

// Indexes every tensor leaf along dim 0: slice_tensors(batch, 0) is the
// first sample, slice_tensors(batch, at::indexing::Slice(0, 8)) the first 8.
template <class T>
T slice_tensors(T data, int64_t index) {
  return recursively_apply([&](const at::Tensor& t) { return t.select(0, index); }, std::move(data));
}
template <class T>
T slice_tensors(T data, const at::indexing::Slice& slice) {
  return recursively_apply([&](const at::Tensor& t) { return t.index({slice}); }, std::move(data));
}

// float16 and bfloat16 leaves become float32; other leaves are unchanged.
template <class T>
T convert_to_fp32(T data) {
  return recursively_apply(
      [](const at::Tensor& t) {
        const auto dtype = t.scalar_type();
        return dtype == c10::kHalf || dtype == c10::kBFloat16 ? t.to(c10::kFloat) : t;
      },
      std::move(data));
}

namespace detail {
// Every rank's int64 values (the same count on every rank), rank-major.
inline std::vector<int64_t> exchange_counts(c10d::ProcessGroup& group, const std::vector<int64_t>& mine,
                                            const char* op) {
  std::vector<int64_t> all(mine.size() * static_cast<std::size_t>(group.getSize()));
  if (!mine.empty()) all_gather_cpu<int64_t>(group, mine.data(), static_cast<int64_t>(mine.size()), all.data(), op);
  return all;
}

inline int64_t row_bytes(const at::Tensor& t) {
  int64_t bytes = static_cast<int64_t>(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) bytes *= t.size(d);
  return bytes;
}

inline std::vector<int64_t> with_rows(const at::Tensor& t, int64_t rows) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes[0] = rows;
  return sizes;
}
}  // namespace detail

// Gathers nested tensors from every rank of the group, concatenated along
// dim 0 in rank order (a 0-d tensor becomes 1-d), on every rank. Sizes along
// dim 0 may differ between ranks: they are exchanged first (one small
// all_gather), then every leaf of a device travels in one byte buffer padded
// to the longest rank's, and is trimmed on arrival.
template <TensorTree T>
T gather(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "gather");
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "gather");
  for (auto& leaf : leaves)
    if (leaf.dim() == 0) leaf = leaf.reshape({1});
  if (!g) return detail::with_leaves(data, std::move(leaves));
  detail::check_same_call(*g, [&] {
    return detail::describe_call(
        "gather", data, [](const at::Tensor& t) { return t.dim() ? std::optional<int64_t>(0) : std::nullopt; });
  });
  if (leaves.empty()) return data;
  const int size = g->getSize();
  const auto n = leaves.size();
  std::vector<int64_t> my_rows;
  for (const auto& leaf : leaves) my_rows.push_back(leaf.size(0));
  const std::vector<int64_t> rows = detail::exchange_counts(*g, my_rows, "gather");
  auto rows_of = [&](int r, std::size_t i) { return rows[static_cast<std::size_t>(r) * n + i]; };

  std::vector<std::vector<at::Tensor>> pieces(n, std::vector<at::Tensor>(size));
  at::NoGradGuard no_grad;
  for (const auto& bucket : detail::group_leaves(leaves, &detail::device_key)) {
    const std::vector<std::size_t>& members = bucket.second;
    // Each rank's leaves have their own rows: one layout per rank, every
    // rank's buffer as long as the longest.
    std::vector<detail::Packing> layouts(static_cast<std::size_t>(size));
    int64_t longest = 0;
    for (int r = 0; r < size; ++r) {
      for (std::size_t i : members)
        layouts[r].add(detail::with_rows(leaves[i], rows_of(r, i)), leaves[i].scalar_type());
      longest = std::max(longest, layouts[r].bytes());
    }
    const auto options = leaves[members.front()].options();
    at::Tensor mine = layouts[g->getRank()].buffer(options, longest);
    for (std::size_t k = 0; k < members.size(); ++k) layouts[g->getRank()].view(mine, k).copy_(leaves[members[k]]);
    at::Tensor all = at::empty({size, mine.size(0)}, mine.options());
    detail::start_all_gather_rows(*g, mine, all).wait();
    for (int r = 0; r < size; ++r)
      for (std::size_t k = 0; k < members.size(); ++k) pieces[members[k]][r] = layouts[r].view(all.select(0, r), k);
    for (std::size_t i : members) leaves[i] = at::cat(pieces[i], 0);  // owns its memory
  }
  return detail::with_leaves(data, std::move(leaves));
}

namespace detail {
inline ReduceOp parse_reduction(std::string_view reduction) {
  try {
    return from_string<ReduceOp>(reduction);
  } catch (const InvalidArgument&) {
    throw InvalidArgument("accel::reduce: unknown reduction '" + std::string(reduction) +
                          "' (expected \"sum\", \"mean\", \"max\" or \"min\")");
  }
}
}  // namespace detail

// Reduces nested tensors over the group and returns the result; the input
// is left untouched. One all_reduce per dtype (and device): the leaves of a
// dtype are flattened into one buffer. MEAN is SUM divided by the group size.
template <TensorTree T>
T reduce(const T& data, ReduceOp reduction = ReduceOp::MEAN, const GroupPtr& group = {}) {
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "reduce");
  if (reduction == ReduceOp::MEAN)
    for (const auto& leaf : leaves) detail::reject_integral_mean(leaf.scalar_type(), "reduce");
  c10d::ProcessGroup* g = detail::resolve(group, "reduce");
  at::NoGradGuard no_grad;
  if (!g) {
    for (auto& leaf : leaves) leaf = leaf.clone();
    return detail::with_leaves(data, std::move(leaves));
  }
  detail::check_same_call(*g, [&] {
    return detail::describe_call(
        "reduce", data, [](const at::Tensor&) { return std::nullopt; }, ", " + std::string(to_string(reduction)));
  });
  for (const auto& bucket : detail::group_leaves(leaves, &detail::dtype_device_key)) {
    const std::vector<std::size_t>& members = bucket.second;
    detail::Packing packing(bucket.first.first);
    std::vector<at::Tensor> parts;
    for (std::size_t i : members) {
      packing.add(leaves[i]);
      parts.push_back(leaves[i]);
    }
    at::Tensor flat = packing.pack(parts, leaves[members.front()].options());
    detail::all_reduce_tensor(*g, flat, reduction);
    for (std::size_t k = 0; k < members.size(); ++k) leaves[members[k]] = packing.view(flat, k);
  }
  return detail::with_leaves(data, std::move(leaves));
}
// reduction: "sum", "mean", "max" or "min"; anything else is an error (not a
// silent sum, as in Accelerate).
template <TensorTree T>
T reduce(const T& data, std::string_view reduction, const GroupPtr& group = {}) {
  return reduce(data, detail::parse_reduction(reduction), group);
}

// Copies nested tensors from rank `from_process` of the group (a rank within
// the group) into every rank's tensors, in place; returns data. All leaves
// on a device travel as one byte buffer (a lone contiguous leaf travels as itself).
template <TensorTree T>
  requires(!TensorLike<T>)
T broadcast(T data, int from_process = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "broadcast");
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "broadcast");
  detail::check_source(g, from_process, "broadcast", "from_process");
  if (!g) return data;
  detail::check_same_call(*g, [&] {
    return detail::describe_call(
        "broadcast", data, [](const at::Tensor&) { return std::nullopt; }, ", src=" + std::to_string(from_process));
  });
  const bool source = g->getRank() == from_process;
  at::NoGradGuard no_grad;
  for (const auto& bucket : detail::group_leaves(leaves, &detail::device_key)) {
    const std::vector<std::size_t>& members = bucket.second;
    if (members.size() == 1) {
      detail::broadcast_tensor(*g, leaves[members.front()], from_process);
      continue;
    }
    detail::Packing packing;
    for (std::size_t i : members) packing.add(leaves[i]);
    at::Tensor buffer = packing.buffer(leaves[members.front()].options());
    if (source)
      for (std::size_t k = 0; k < members.size(); ++k) packing.view(buffer, k).copy_(leaves[members[k]]);
    detail::broadcast_tensor(*g, buffer, from_process);
    if (!source)
      for (std::size_t k = 0; k < members.size(); ++k) leaves[members[k]].copy_(packing.view(buffer, k));
  }
  return data;
}

// Accelerate's copy_tensor_to_devices: the tensor that exactly one process
// of the group holds (the others pass an undefined at::Tensor, Python's
// None) on every process, without the others knowing its shape or dtype:
// one small all_gather of (holds it, dtype, dimensions), one broadcast of
// its sizes, one of its values. The holder gets its own tensor back; the
// others a new one on the group's device. Accelerate sums a buffer from
// every process, so two holders would add up; here no holder or several
// is an accel::InvalidArgument on every process.
inline at::Tensor copy_tensor_to_devices(const at::Tensor& tensor = {}, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "copy_tensor_to_devices");
  const bool holds = tensor.defined();
  const char* rule = "exactly one process holds the tensor; the others pass an undefined at::Tensor";
  if (!g) {
    if (!holds) throw InvalidArgument(std::string("accel::copy_tensor_to_devices: ") + rule + " (no process does)");
    return tensor;
  }
  detail::check_same_call(*g, [] { return std::string("copy_tensor_to_devices()"); });
  const std::vector<int64_t> all = detail::exchange_counts(
      *g, {holds, holds ? static_cast<int64_t>(tensor.scalar_type()) : 0, holds ? tensor.dim() : 0},
      "copy_tensor_to_devices");
  std::vector<int> holders;
  for (int r = 0; r < g->getSize(); ++r)
    if (all[3 * static_cast<std::size_t>(r)]) holders.push_back(r);
  if (holders.size() != 1) {
    std::string which = holders.empty() ? "none does" : "processes";
    for (int r : holders) which += " " + std::to_string(r);
    if (!holders.empty()) which += " do";
    throw InvalidArgument(std::string("accel::copy_tensor_to_devices: ") + rule + " (" + which + ")");
  }
  const int from = holders.front();
  const auto dtype = static_cast<c10::ScalarType>(all[3 * static_cast<std::size_t>(from) + 1]);
  const int64_t dims = all[3 * static_cast<std::size_t>(from) + 2];
  std::vector<int64_t> sizes = holds ? tensor.sizes().vec() : std::vector<int64_t>(static_cast<std::size_t>(dims));
  at::NoGradGuard no_grad;
  if (dims > 0)
    detail::broadcast_tensor(*g, at::from_blob(sizes.data(), {dims}, detail::cpu_options(c10::kLong)), from);
  at::Tensor out =
      holds ? tensor.contiguous() : at::empty(sizes, at::TensorOptions().dtype(dtype).device(detail::group_device(*g)));
  detail::broadcast_tensor(*g, out, from);
  return holds ? tensor : out;
}

// Pads every tensor leaf along `dim` with pad_index to the largest size any
// rank of the group has there (at the end, or at the start with pad_first).
// Leaves with fewer dimensions than `dim` are left as they are. One small
// all_gather of the sizes.
template <TensorTree T>
T pad_across_processes(const T& data, int64_t dim = 0, const at::Scalar& pad_index = 0, bool pad_first = false,
                       const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "pad_across_processes");
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "pad_across_processes");
  if (!g) return data;
  auto axis = [dim](const at::Tensor& t) -> std::optional<int64_t> {
    if (dim >= t.dim() || dim < -t.dim()) return std::nullopt;
    return dim < 0 ? dim + t.dim() : dim;
  };
  detail::check_same_call(*g, [&] {
    std::ostringstream args;
    args << ", dim=" << dim << ", pad_index=" << pad_index << ", pad_first=" << std::boolalpha << pad_first;
    return detail::describe_call("pad_across_processes", data, axis, args.str());
  });
  std::vector<int64_t> mine;
  for (const auto& leaf : leaves) mine.push_back(axis(leaf) ? leaf.size(*axis(leaf)) : 0);
  const std::vector<int64_t> all = detail::exchange_counts(*g, mine, "pad_across_processes");
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    auto d = axis(leaves[i]);
    if (!d) continue;
    int64_t longest = 0;
    for (int r = 0; r < g->getSize(); ++r) longest = std::max(longest, all[r * leaves.size() + i]);
    if (longest == mine[i]) continue;
    std::vector<int64_t> sizes(leaves[i].sizes().begin(), leaves[i].sizes().end());
    sizes[*d] = longest;
    at::Tensor padded = at::full(sizes, pad_index, leaves[i].options());
    padded.narrow(*d, pad_first ? longest - mine[i] : 0, mine[i]).copy_(leaves[i]);
    leaves[i] = std::move(padded);
  }
  return detail::with_leaves(data, std::move(leaves));
}

ACCEL_NAMESPACE_END
