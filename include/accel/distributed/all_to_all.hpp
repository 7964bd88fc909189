// accel/distributed/all_to_all.hpp: all_to_all (even and uneven) and reduce_scatter, both on c10d's all-to-all.
//
// torch.distributed's all_to_all_single and reduce_scatter. One c10d
// all-to-all carries both: reduce_scatter sends each rank its part of
// every rank's data and folds what arrives (Gloo in LibTorch 1.13 has no
// reduce_scatter of its own). Ranks are ranks within the group; a tensor
// with zero elements moves nothing.
#pragma once

#include "accel/distributed/collectives.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Folds the rows of `rows` (dim 0: one per rank) with op, in a dtype that
// holds the sum (float32 for the 16-bit and 8-bit floats, int64 for the
// integers, whose sum then wraps as the backend's would), back in rows' dtype.
// (check_reduction has rejected what is undefined.)
inline at::Tensor fold_rows(const at::Tensor& rows, ReduceOp op) {
  const c10::ScalarType dtype = rows.scalar_type();
  if (c10::isComplexType(dtype))
    return at::view_as_complex(fold_rows(at::view_as_real(rows.contiguous()), op).contiguous());
  if (dtype == c10::kBool) return op == ReduceOp::MIN ? rows.all(0) : rows.any(0);  // SUM: an or, as all_reduce
  const at::Tensor wide =
      rows.to(c10::isFloatingType(dtype) ? (dtype == c10::kDouble ? c10::kDouble : c10::kFloat) : c10::kLong);
  at::Tensor out;
  switch (op) {
    case ReduceOp::SUM: out = wide.sum(0); break;
    case ReduceOp::MEAN: out = wide.sum(0).div_(rows.size(0)); break;
    case ReduceOp::MAX: out = std::get<0>(wide.max(0)); break;
    case ReduceOp::MIN: out = std::get<0>(wide.min(0)); break;
  }
  return out.to(dtype);
}

inline std::vector<int64_t> equal_splits(int64_t rows, int parts) {
  return std::vector<int64_t>(static_cast<std::size_t>(parts), rows / parts);
}

inline void check_splits(const std::vector<int64_t>& splits, int size, const char* what, const char* op) {
  if (static_cast<int>(splits.size()) != size)
    throw InvalidArgument(std::string("accel::") + op + ": " + what + " has " + std::to_string(splits.size()) +
                          " entries; the group has " + std::to_string(size) + " ranks");
  for (int64_t s : splits)
    if (s < 0) throw InvalidArgument(std::string("accel::") + op + ": " + what + " holds a negative size");
}

// c10d's all-to-all of one tensor: all_to_all_single from LibTorch 2.15 on,
// which deprecates the older name alltoall_base (a -Werror build would fail
// on the warning). (A template, so that the requires-expression can fail.)
template <class Group>
c10::intrusive_ptr<c10d::Work> alltoall_single(Group& group, at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
  if constexpr (requires { group.all_to_all_single(out, in, out_splits, in_splits); })
    return group.all_to_all_single(out, in, out_splits, in_splits);
  else return group.alltoall_base(out, in, out_splits, in_splits);
}

// Rows of `input` (dim 0) go to the ranks in order, splits[r] rows to rank
// r; lands as the rows received, by source rank, out_splits[r] from rank r.
// One c10d all-to-all on a contiguous tensor (its bytes, for a dtype the
// backend lacks). Gloo divides by the rows of each side, so a side with no
// rows sends itself one phantom byte, removed on arrival. `into` (checked
// by the caller: the output's shape and dtype) receives the rows: directly
// where c10d can write it (contiguous, on the group's device), else
// through a staged copy.
inline auto start_all_to_all_rows(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<int64_t> out_splits,
                                  std::vector<int64_t> in_splits, const char* op, const at::Tensor& into = {}) {
  at::NoGradGuard no_grad;
  const int rank = group.getRank();
  const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape[0] = out_rows;
  const auto device = staging_device(group, input);
  const c10::Device lands_on = device.value_or(input.device());
  const bool into_direct = into.defined() && into.is_contiguous() && into.device() == lands_on;
  at::Tensor output = into_direct ? into : at::empty(out_shape, input.options().device(lands_on));
  const int64_t row_bytes = c10::multiply_integers(input.sizes().slice(1)) * static_cast<int64_t>(input.element_size());
  const at::Tensor source = device ? input.to(*device).contiguous() : input.contiguous();
  const bool phantom = input.size(0) == 0 || out_rows == 0;
  const bool equal = std::all_of(in_splits.begin(), in_splits.end(), [&](int64_t s) { return s == in_splits[0]; }) &&
                     in_splits == out_splits;
  at::Tensor in_bytes, out_bytes;  // the uneven form's buffers
  int64_t out_at = 0;              // where this rank's own segment ends in the output
  c10::intrusive_ptr<c10d::Work> work;
  if (row_bytes == 0) {
    // rows of nothing, on every rank: nothing moves
  } else if (equal && !phantom) {  // the backend's plain alltoall (Gloo's alltoallv is slower), no split sizes
    std::vector<int64_t> none;
    at::Tensor in = backend_view(group, source), out = backend_view(group, output);
    work = issue(op, group, [&] { return alltoall_single(group, out, in, none, none); });
  } else {
    in_bytes = source.reshape({-1}).view(c10::kByte);
    out_bytes = output.reshape({-1}).view(c10::kByte);
    for (auto& s : in_splits) s *= row_bytes;
    for (auto& s : out_splits) s *= row_bytes;
    if (phantom) {
      int64_t in_at = 0;
      for (int r = 0; r <= rank; ++r) {
        in_at += in_splits[r];
        out_at += out_splits[r];
      }
      const at::Tensor one = at::zeros({1}, in_bytes.options());
      in_bytes = at::cat({in_bytes.narrow(0, 0, in_at), one, in_bytes.narrow(0, in_at, in_bytes.size(0) - in_at)});
      out_bytes = at::empty({out_bytes.size(0) + 1}, out_bytes.options());
      ++in_splits[rank];
      ++out_splits[rank];
    }
    work = issue(op, group, [&] { return alltoall_single(group, out_bytes, in_bytes, out_splits, in_splits); });
  }
  return Pending{
      &group, op, std::move(work),
      [output = std::move(output), source, in_bytes = std::move(in_bytes), out_bytes = std::move(out_bytes), phantom,
       out_at, home = input.device(), into] {
        at::NoGradGuard no_grad;
        if (phantom && out_bytes.defined()) {
          at::Tensor real = output.reshape({-1}).view(c10::kByte);
          real.narrow(0, 0, out_at).copy_(out_bytes.narrow(0, 0, out_at));
          real.narrow(0, out_at, real.size(0) - out_at).copy_(out_bytes.narrow(0, out_at + 1, real.size(0) - out_at));
        }
        if (into.defined()) return output.is_same(into) ? into : into.copy_(output);
        return output.device() == home ? output : output.to(home);
      }};
}

// A std::vector's bytes, split in group-size equal parts for all_to_all.
template <ScalarVector V>
auto start_all_to_all_vector(c10d::ProcessGroup& group, V data, const char* op) {
  const int size = group.getSize();
  at::Tensor bytes = alias_bytes(data).reshape({size, -1});
  auto pending = start_all_to_all_rows(group, bytes, equal_splits(size, size), equal_splits(size, size), op);
  return then(std::move(pending), [data = std::move(data)](const at::Tensor& received) mutable {
    if (!data.empty()) std::memcpy(data.data(), received.data_ptr(), data.size() * sizeof(element_t<V>));
    return std::move(data);
  });
}

// Part r of data reduced over the group, on rank r.
template <TensorLike T>
auto start_reduce_scatter(c10d::ProcessGroup& group, const T& data, ReduceOp op) {
  const int size = group.getSize();
  if constexpr (std::same_as<T, at::Tensor>) {
    const auto splits = equal_splits(data.size(0), size);
    std::vector<int64_t> rows_shape = data.sizes().vec();
    rows_shape[0] = data.size(0) / size;
    rows_shape.insert(rows_shape.begin(), size);
    return then(start_all_to_all_rows(group, data, splits, splits, "reduce_scatter"),
                [rows_shape = std::move(rows_shape), op](const at::Tensor& received) {
                  at::NoGradGuard no_grad;
                  return fold_rows(received.view(rows_shape), op);
                });
  } else {
    return then(start_all_to_all_vector(group, data, "reduce_scatter"), [op, size](const T& received) {
      const std::size_t part = received.size() / static_cast<std::size_t>(size);
      T out(part);
      for (std::size_t i = 0; i < part; ++i)
        out[i] = fold<element_t<T>>(op, received.data() + i, size, static_cast<int>(part));
      return out;
    });
  }
}

// The S rows of `rows` folded into `out`, which the caller keeps: a SUM
// of float or double in place, in the kernel fold_rows uses, so the result
// is the same; anything else as fold_rows does, copied in. (Also the fold
// of the sharding engine's point-to-point reduce-scatter, dp/scatter.hpp.)
inline void fold_rows_into(const at::Tensor& rows, at::Tensor& out, ReduceOp op) {
  at::NoGradGuard no_grad;
  const c10::ScalarType dtype = rows.scalar_type();
  const int64_t first = 0;  // (the dim folded)
  if (op == ReduceOp::SUM && (dtype == c10::kFloat || dtype == c10::kDouble))
    at::sum_out(out, rows, at::IntArrayRef(first));
  else out.copy_(fold_rows(rows, op));
}

// reduce_scatter of a 1-d tensor into buffers the caller keeps and reuses
// (the sharding engine's gradient buckets, dp/scatter.hpp): the all-to-all
// lands in `received` (data's size), and the fold of its S rows goes into
// `out` (data's size / S), by fold_rows_into.
inline auto start_reduce_scatter_into(c10d::ProcessGroup& group, const at::Tensor& data, const at::Tensor& received,
                                      const at::Tensor& out, ReduceOp op) {
  const int size = group.getSize();
  const auto splits = equal_splits(data.size(0), size);
  return then(start_all_to_all_rows(group, data, splits, splits, "reduce_scatter", received),
              [out = out, op, size](const at::Tensor& landed) mutable {
                fold_rows_into(landed.view({size, -1}), out, op);
                return out;
              });
}

template <TensorLike T>
  requires(!Scalar<T>)
c10d::ProcessGroup* enter_reduce_scatter(const T& data, ReduceOp op, const GroupPtr& group) {
  if constexpr (std::same_as<T, at::Tensor>) check_reduction(data.scalar_type(), op, "reduce_scatter");
  else if (op == ReduceOp::MEAN && std::is_integral_v<element_t<T>>)
    reject_integral_mean(value_dtype<element_t<T>>(), "reduce_scatter");
  c10d::ProcessGroup* g = resolve(group, "reduce_scatter");
  const int size = g ? g->getSize() : 1;
  if constexpr (std::same_as<T, at::Tensor>) {
    if (data.dim() == 0 || data.size(0) % size != 0)
      throw InvalidArgument("accel::reduce_scatter: dim 0 of " + describe_tensor(data) + " does not split into " +
                            std::to_string(size) + " equal parts");
  } else if (data.size() % static_cast<std::size_t>(size) != 0) {
    throw InvalidArgument("accel::reduce_scatter: " + std::to_string(data.size()) + " elements do not split into " +
                          std::to_string(size) + " equal parts");
  }
  if (g)
    check_same_call(
        *g, [&] { return "reduce_scatter(" + describe_tensorlike(data) + ", " + std::string(to_string(op)) + ")"; });
  return g;
}

template <TensorLike T>
  requires(!Scalar<T>)
c10d::ProcessGroup* enter_all_to_all(const T& data, const GroupPtr& group) {
  c10d::ProcessGroup* g = resolve(group, "all_to_all");
  const int size = g ? g->getSize() : 1;
  if constexpr (std::same_as<T, at::Tensor>) {
    if (data.dim() == 0 || data.size(0) % size != 0)
      throw InvalidArgument("accel::all_to_all: dim 0 of " + describe_tensor(data) + " does not split into " +
                            std::to_string(size) + " equal parts" + (g ? " (" + describe(*g) + ")" : std::string()));
  } else if (data.size() % static_cast<std::size_t>(size) != 0) {
    throw InvalidArgument("accel::all_to_all: " + std::to_string(data.size()) + " elements do not split into " +
                          std::to_string(size) + " equal parts" + (g ? " (" + describe(*g) + ")" : std::string()));
  }
  if (g) check_same_call(*g, [&] { return "all_to_all(" + describe_tensorlike(data) + ")"; });
  return g;
}

template <TensorLike T>
auto start_all_to_all(c10d::ProcessGroup& group, const T& data) {
  if constexpr (std::same_as<T, at::Tensor>) {
    const auto splits = equal_splits(data.size(0), group.getSize());
    return start_all_to_all_rows(group, data, splits, splits, "all_to_all");
  } else {
    return start_all_to_all_vector(group, data, "all_to_all");
  }
}

// The uneven all_to_all's checks: returns the split sizes to use.
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> check_all_to_all_splits(
    c10d::ProcessGroup* g, const at::Tensor& data, std::vector<int64_t> output_split_sizes,
    std::vector<int64_t> input_split_sizes) {
  const int size = g ? g->getSize() : 1;
  if (data.dim() == 0) throw InvalidArgument("accel::all_to_all: a 0-d tensor has no rows to split");
  if (input_split_sizes.empty()) {
    if (data.size(0) % size != 0)
      throw InvalidArgument("accel::all_to_all: dim 0 of " + describe_tensor(data) + " does not split into " +
                            std::to_string(size) + " equal parts; pass input_split_sizes");
    input_split_sizes = equal_splits(data.size(0), size);
  }
  if (output_split_sizes.empty()) output_split_sizes = equal_splits(data.size(0), size);
  check_splits(input_split_sizes, size, "input_split_sizes", "all_to_all");
  check_splits(output_split_sizes, size, "output_split_sizes", "all_to_all");
  if (const int64_t sum = std::accumulate(input_split_sizes.begin(), input_split_sizes.end(), int64_t{0});
      sum != data.size(0))
    throw InvalidArgument("accel::all_to_all: input_split_sizes add up to " + std::to_string(sum) +
                          ", but dim 0 of the input is " + std::to_string(data.size(0)));
  if (!g && output_split_sizes != input_split_sizes)
    throw InvalidArgument("accel::all_to_all: output_split_sizes differ from input_split_sizes on one process");
  if (g && checking_calls()) [[unlikely]] {
    verify_call(*g, "all_to_all(" + describe_tensor(data, 0) + ", split sizes)");
    // Every rank's sizes, so that every rank finds a disagreement alike.
    std::vector<int64_t> mine = input_split_sizes;
    mine.insert(mine.end(), output_split_sizes.begin(), output_split_sizes.end());
    std::vector<int64_t> all(mine.size() * static_cast<std::size_t>(size));
    all_gather_cpu<int64_t>(*g, mine.data(), static_cast<int64_t>(mine.size()), all.data(), "debug-mode check");
    for (int i = 0; i < size; ++i)
      for (int j = 0; j < size; ++j)
        if (const int64_t sent = all[static_cast<std::size_t>(i * 2 * size + j)],
            expected = all[static_cast<std::size_t>(j * 2 * size + size + i)];
            sent != expected)
          throw DistributedError("accel [ACCEL_DEBUG_MODE]: all_to_all on group '" + group_name(*g) + "': rank " +
                                 std::to_string(i) + " sends " + std::to_string(sent) + " rows to rank " +
                                 std::to_string(j) + ", which expects " + std::to_string(expected));
  }
  return {std::move(output_split_sizes), std::move(input_split_sizes)};
}

// all_to_all_single's output against what this rank receives: its rows,
// the input's row shape and dtype, writable, apart from the input.
inline void check_all_to_all_output(const at::Tensor& output, const at::Tensor& input,
                                    const std::vector<int64_t>& out_splits) {
  if (!output.defined()) throw InvalidArgument("accel::all_to_all_single: output is an undefined tensor");
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  if (output.sizes() != at::IntArrayRef(shape) || output.scalar_type() != input.scalar_type())
    throw InvalidArgument("accel::all_to_all_single: output is " + describe_tensor(output) +
                          ", but this rank receives " + c10::str(input.scalar_type(), at::IntArrayRef(shape)));
  check_no_overlap(output, "all_to_all_single");
  if (output.numel() > 0 && input.numel() > 0 && output.is_alias_of(input))
    throw InvalidArgument(
        "accel::all_to_all_single: output and input share memory; c10d reads one while writing the other");
}
}  // namespace detail

// Splits data along dim 0 (a std::vector: its elements) into group-size equal
// parts, reduces part r over the group and returns it on rank r. Built on
// one all_to_all and a local fold on every backend (Gloo in LibTorch 1.13
// has no reduce_scatter): each rank sends and receives (P-1)/P of the data,
// as a ring reduce_scatter does, never the whole of it.
template <TensorLike T>
  requires(!Scalar<T>)
T reduce_scatter(const T& data, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_reduce_scatter(data, op, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return data.clone();
    else return data;
  }
  return detail::start_reduce_scatter(*g, data, op).wait();
}
template <TensorLike T>
  requires(!Scalar<T>)
Work<T> reduce_scatter_async(const T& data, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_reduce_scatter(data, op, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return Work<T>(detail::ready(g, "reduce_scatter", data.clone()));
    else return Work<T>(detail::ready(g, "reduce_scatter", data));
  }
  return Work<T>(detail::start_reduce_scatter(*g, data, op));  // (its input is a copy, or a tensor kept alive)
}

// Splits data along dim 0 (a std::vector: its elements) into group-size equal
// parts and sends part r to rank r; returns the parts received, in rank order.
template <TensorLike T>
  requires(!Scalar<T>)
T all_to_all(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_to_all(data, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return data.clone();
    else return data;
  }
  return detail::start_all_to_all(*g, data).wait();
}
template <TensorLike T>
  requires(!Scalar<T>)
Work<T> all_to_all_async(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_to_all(data, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return Work<T>(detail::ready(g, "all_to_all", data.clone()));
    else return Work<T>(detail::ready(g, "all_to_all", data));
  }
  return Work<T>(detail::start_all_to_all(*g, data));
}

// Uneven all_to_all (torch's all_to_all_single with split sizes): rows
// input_split_sizes[r] of data go to rank r; output_split_sizes[r] rows come
// from rank r. An empty list means equal parts. The sizes must agree across
// ranks (rank i's input_split_sizes[j] is rank j's output_split_sizes[i]):
// debug mode checks that too.
inline at::Tensor all_to_all(const at::Tensor& data, std::vector<int64_t> output_split_sizes,
                             std::vector<int64_t> input_split_sizes, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_to_all");
  auto [out, in] =
      detail::check_all_to_all_splits(g, data, std::move(output_split_sizes), std::move(input_split_sizes));
  if (!g) return data.clone();
  return detail::start_all_to_all_rows(*g, data, std::move(out), std::move(in), "all_to_all").wait();
}
inline Work<at::Tensor> all_to_all_async(const at::Tensor& data, std::vector<int64_t> output_split_sizes,
                                         std::vector<int64_t> input_split_sizes, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_to_all");
  auto [out, in] =
      detail::check_all_to_all_splits(g, data, std::move(output_split_sizes), std::move(input_split_sizes));
  if (!g) return Work<at::Tensor>(detail::ready(g, "all_to_all", data.clone()));
  return Work<at::Tensor>(detail::start_all_to_all_rows(*g, data, std::move(out), std::move(in), "all_to_all"));
}

// torch's all_to_all_single(output, input, output_split_sizes,
// input_split_sizes): all_to_all (equal parts when the sizes are empty)
// into `output`, which the caller keeps from call to call: nothing is
// allocated for the result where c10d can write into it (contiguous, on
// the group's device). output holds the rows this rank receives, in the
// input's row shape and dtype; returns it (the _async form: its Work's
// result).
inline Work<at::Tensor> all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                                std::vector<int64_t> output_split_sizes = {},
                                                std::vector<int64_t> input_split_sizes = {},
                                                const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_to_all_single");
  auto [out, in] =
      detail::check_all_to_all_splits(g, input, std::move(output_split_sizes), std::move(input_split_sizes));
  detail::check_all_to_all_output(output, input, out);
  if (!g) {
    at::NoGradGuard no_grad;
    return Work<at::Tensor>(detail::ready(g, "all_to_all", output.copy_(input)));
  }
  return Work<at::Tensor>(
      detail::start_all_to_all_rows(*g, input, std::move(out), std::move(in), "all_to_all", output));
}
inline at::Tensor all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                    std::vector<int64_t> output_split_sizes = {},
                                    std::vector<int64_t> input_split_sizes = {}, const GroupPtr& group = {}) {
  return all_to_all_single_async(output, input, std::move(output_split_sizes), std::move(input_split_sizes), group)
      .wait();
}

ACCEL_NAMESPACE_END
