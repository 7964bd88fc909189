// accel/distributed/exchange.hpp: reduce_scatter, all_to_all, reduce_to, gather_to, scatter, send/recv, barriers.
//
// The rest of torch.distributed: reduce_scatter, all_to_all, reduce_to,
// gather_to, scatter, send, recv, monitored_barrier. Ranks (src, dst) are
// ranks within the group; a tensor with zero elements moves nothing.
#pragma once

#include "accel/distributed/collectives.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The device a group's collectives run on: the current CUDA device for an
// NCCL group, else the CPU.
inline c10::Device group_device([[maybe_unused]] const c10d::ProcessGroup& group) {
#if ACCEL_WITH_NCCL
  if (group.getBackendName() == "nccl") return get_current_device();
#endif
  return c10::Device(c10::kCPU);
}

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
// rows sends itself one phantom byte, removed on arrival.
inline auto start_all_to_all_rows(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<int64_t> out_splits,
                                  std::vector<int64_t> in_splits, const char* op) {
  at::NoGradGuard no_grad;
  const int rank = group.getRank();
  const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape[0] = out_rows;
  const auto device = staging_device(group, input);
  at::Tensor output = at::empty(out_shape, input.options().device(device.value_or(input.device())));
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
       out_at, home = input.device()] {
        at::NoGradGuard no_grad;
        if (phantom && out_bytes.defined()) {
          at::Tensor real = output.reshape({-1}).view(c10::kByte);
          real.narrow(0, 0, out_at).copy_(out_bytes.narrow(0, 0, out_at));
          real.narrow(0, out_at, real.size(0) - out_at).copy_(out_bytes.narrow(0, out_at + 1, real.size(0) - out_at));
        }
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

template <TensorLike T>
auto start_reduce_data(c10d::ProcessGroup& group, T data, ReduceOp op, int dst) {
  if constexpr (folded<T>()) return start_fold_data(group, std::move(data), op, "reduce_to");  // one gather
  else return start_in_place(std::move(data), [&](at::Tensor t) { return start_reduce(group, std::move(t), op, dst); });
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
  if (g && debug_mode()) [[unlikely]] {
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

// Reduces data over the group onto rank `dst` (a rank within the group) and
// returns it there; on the other ranks the returned value is unspecified
// (as torch.distributed.reduce leaves it). A tensor is reduced in place.
template <TensorLike T>
T reduce_to(T data, int dst, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  detail::check_writable(data, "reduce_to");
  if constexpr (std::same_as<T, at::Tensor>) detail::check_reduction(data.scalar_type(), op, "reduce_to");
  else if (op == ReduceOp::MEAN && std::is_integral_v<detail::element_t<T>>)
    detail::reject_integral_mean(detail::value_dtype<detail::element_t<T>>(), "reduce_to");
  c10d::ProcessGroup* g = detail::resolve(group, "reduce_to");
  detail::check_source(g, dst, "reduce_to", "dst");
  if (!g) return data;
  detail::check_same_call(*g, [&] {
    return "reduce_to(" + detail::describe_tensorlike(data) + ", dst=" + std::to_string(dst) + ", " +
           std::string(to_string(op)) + ")";
  });
  return detail::start_reduce_data(*g, std::move(data), op, dst).wait();
}

// Gathers data from every rank onto rank `dst`, stacked as all_gather does:
// a tensor of shape s gives (group_size, *s) on dst and an empty tensor
// elsewhere; a scalar or std::vector gives one entry per rank on dst and an
// empty std::vector elsewhere. Only dst receives anything.
template <TensorLike T>
auto gather_to(const T& data, int dst, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "gather_to");
  detail::check_source(g, dst, "gather_to", "dst");
  if (!g) return all_gather(data, group);
  detail::check_same_call(
      *g, [&] { return "gather_to(" + detail::describe_tensorlike(data) + ", dst=" + std::to_string(dst) + ")"; });
  const int size = g->getSize();
  const bool root = g->getRank() == dst;
  at::NoGradGuard no_grad;
  auto gather_into = [&](const at::Tensor& input, const std::vector<at::Tensor>& outputs) {
    if (input.numel() == 0) return;  // nothing to move
    const auto device = detail::staging_device(*g, input);
    std::vector<at::Tensor> inputs{
        detail::backend_view(*g, device ? input.to(*device).contiguous() : input.contiguous())};
    std::vector<at::Tensor> staged;
    std::vector<std::vector<at::Tensor>> lists;
    if (root) {
      for (const auto& t : outputs) staged.push_back(at::empty(t.sizes(), inputs[0].options().dtype(t.scalar_type())));
      lists.emplace_back();
      for (const auto& t : staged) lists[0].push_back(detail::backend_view(*g, t));
    }
    c10d::GatherOptions opts;
    opts.rootRank = dst;
    detail::run("gather_to", *g, [&] { return g->gather(lists, inputs, opts); });
    for (std::size_t r = 0; r < staged.size(); ++r) outputs[r].copy_(staged[r]);
  };
  if constexpr (std::same_as<T, at::Tensor>) {
    if (!root) {
      gather_into(data, {});
      return at::empty({0}, data.options());
    }
    at::Tensor stacked =
        at::empty(detail::stacked_shape(size, data), data.options().memory_format(c10::MemoryFormat::Contiguous));
    std::vector<at::Tensor> rows;
    for (int r = 0; r < size; ++r) rows.push_back(stacked.select(0, r));
    gather_into(data, rows);
    return stacked;
  } else {
    std::vector<T> result(root ? static_cast<std::size_t>(size) : 0, data);
    std::vector<at::Tensor> outputs;
    for (auto& slot : result) outputs.push_back(detail::memory_view(slot));
    gather_into(detail::memory_view(const_cast<T&>(data)), outputs);  // c10d only reads a gather's input
    return result;
  }
}

namespace detail {
// scatter's tensor form: src first broadcasts a header (dtype, rank and
// sizes, or -1 when its parts disagree), so that every rank can allocate
// its output.
inline at::Tensor scatter_tensor(c10d::ProcessGroup& group, const std::vector<at::Tensor>& parts_on_src, int src,
                                 bool root) {
  // The header: dtype, rank and sizes (or -1 and why, when the parts disagree).
  constexpr int kMaxDims = 64;
  std::array<int64_t, 2 + kMaxDims> header{};
  if (root) {
    const at::Tensor& first = parts_on_src[0];
    header[0] = static_cast<int64_t>(first.scalar_type());
    header[1] = first.dim();
    for (const auto& part : parts_on_src)
      if (!part.defined() || part.sizes() != first.sizes() || part.scalar_type() != first.scalar_type() ||
          part.device() != first.device() || first.dim() > kMaxDims)
        header[1] = -1;
    for (int64_t d = 0; d < std::min<int64_t>(first.dim(), kMaxDims); ++d) header[2 + d] = first.size(d);
  }
  at::Tensor header_view = at::from_blob(header.data(), {2 + kMaxDims}, cpu_options(c10::kLong));
  broadcast_tensor(group, header_view, src);
  if (header[1] < 0)
    throw InvalidArgument("accel::scatter: the parts on the source (rank " + std::to_string(src) + " of " +
                          describe(group) +
                          ") must all be defined and share one shape, dtype and device"
                          " (at most 64 dimensions)");
  const auto dtype = static_cast<c10::ScalarType>(header[0]);
  const std::vector<int64_t> shape(header.begin() + 2, header.begin() + 2 + header[1]);
  const c10::Device device = root ? parts_on_src[0].device() : group_device(group);
  at::Tensor output = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  if (output.numel() == 0) return output;
  const auto staging = staging_device(group, output);
  at::Tensor target = staging ? at::empty(shape, output.options().device(*staging)) : output;
  std::vector<at::Tensor> outputs{backend_view(group, target)};
  std::vector<std::vector<at::Tensor>> inputs;
  if (root) {
    inputs.emplace_back();
    for (const auto& part : parts_on_src)
      inputs[0].push_back(backend_view(group, staging ? part.to(*staging).contiguous() : part.contiguous()));
  }
  c10d::ScatterOptions opts;
  opts.rootRank = src;
  run("scatter", group, [&] { return group.scatter(outputs, inputs, opts); });
  if (staging) output.copy_(target);
  return output;
}
// scatter's scalar and std::vector forms: bytes, each part with its length.
template <TensorLike T>
T scatter_values(c10d::ProcessGroup& group, const std::vector<T>& parts_on_src, int src, bool root) {
  using E = element_t<T>;
  std::vector<std::vector<char>> pieces;
  if (root)
    for (const auto& part : parts_on_src) {
      if constexpr (Scalar<T>) {
        const auto* bytes = reinterpret_cast<const char*>(&part);
        pieces.emplace_back(bytes, bytes + sizeof(T));
      } else {
        const auto* bytes = reinterpret_cast<const char*>(part.data());
        pieces.emplace_back(bytes, bytes + part.size() * sizeof(E));
      }
    }
  std::vector<char> mine = scatter_bytes(group, src, pieces, "scatter");
  if (root) mine = pieces[static_cast<std::size_t>(src)];
  T out{};
  if constexpr (Scalar<T>) {
    std::memcpy(&out, mine.data(), sizeof(T));
  } else {
    out.resize(mine.size() / sizeof(E));
    if (!mine.empty()) std::memcpy(out.data(), mine.data(), mine.size());
  }
  return out;
}
}  // namespace detail

// Rank `src` sends parts_on_src[r] to rank r of the group; every rank returns
// its own part. Only src reads parts_on_src (the others may pass {}); src
// tells the others the shape and dtype first (tensors: one small broadcast;
// scalars and std::vectors travel with their lengths, which may differ).
template <TensorLike T>
T scatter(const std::vector<T>& parts_on_src, int src, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "scatter");
  detail::check_source(g, src, "scatter", "src");
  const int size = g ? g->getSize() : 1;
  const bool root = !g || g->getRank() == src;
  if (root && static_cast<int>(parts_on_src.size()) != size)
    throw InvalidArgument("accel::scatter: the source passes " + std::to_string(parts_on_src.size()) +
                          " parts; the group has " + std::to_string(size) + " ranks");
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return parts_on_src[0].clone();
    else return parts_on_src[0];
  }
  detail::check_same_call(*g, [&] {
    if constexpr (std::same_as<T, at::Tensor>) return "scatter(tensor, src=" + std::to_string(src) + ")";
    else if constexpr (Scalar<T>) return "scatter(" + detail::type_tag<T>() + ", src=" + std::to_string(src) + ")";
    else return "scatter(vector<" + detail::type_tag<detail::element_t<T>>() + ">, src=" + std::to_string(src) + ")";
  });
  at::NoGradGuard no_grad;
  if constexpr (std::same_as<T, at::Tensor>) return detail::scatter_tensor(*g, parts_on_src, src, root);
  else return detail::scatter_values(*g, parts_on_src, src, root);
}

// Sends data to rank `dst` of the group, which receives it with recv (the
// same tag, the same shape and dtype). Point-to-point: debug mode cannot
// compare the two sides (no collective runs).
template <TensorLike T>
void send(const T& data, int dst, const GroupPtr& group = {}, int tag = 0) {
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, dst, "send", "dst");
  detail::start_send_data(*g, data, dst, tag).wait();
}
template <TensorLike T>
Work<void> isend(const T& data, int dst, const GroupPtr& group = {}, int tag = 0) {
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, dst, "send", "dst");
  if constexpr (std::same_as<T, at::Tensor>) {
    return Work<void>(detail::start_send_data(*g, data, dst, tag));  // keeps a contiguous copy or the tensor itself
  } else {
    auto box = detail::copy_for_async(data);
    auto pending = detail::start_send_data(*g, *box, dst, tag);
    return Work<void>(detail::keep_until_landed(std::move(pending), std::move(box)));
  }
}

// Receives into data (which gives the shape and dtype, or the size of a
// std::vector) from rank `src` of the group, and returns it (a tensor: in place).
template <TensorLike T>
T recv(T data, int src, const GroupPtr& group = {}, int tag = 0) {
  detail::check_writable(data, "recv");
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, src, "recv", "src");
  return detail::start_recv_data(*g, std::move(data), src, tag).wait();
}
template <TensorLike T>
Work<T> irecv(T data, int src, const GroupPtr& group = {}, int tag = 0) {
  detail::check_writable(data, "recv");
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, src, "recv", "src");
  return Work<T>(detail::start_recv_data(*g, std::move(data), src, tag));
}

// A barrier that names the ranks that did not arrive within the timeout
// (default: the group's), instead of waiting on them for ever: Gloo groups
// only, as in torch.distributed.
inline void monitored_barrier(const GroupPtr& group = {},
                              std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
  c10d::ProcessGroup* g = detail::resolve(group, "monitored_barrier");
  if (!g) return;
  if (g->getBackendName() != "gloo")
    throw InvalidArgument("accel::monitored_barrier: needs a Gloo group; " + detail::describe(*g) +
                          " is not (as in torch.distributed)");
  detail::check_same_call(*g, [] { return std::string("monitored_barrier()"); });
  c10d::BarrierOptions opts;
  if (timeout) opts.timeout = *timeout;
  try {
    g->monitoredBarrier(opts, /*wait_all_ranks=*/true);
  } catch (const std::exception& e) {
    throw DistributedError("accel::monitored_barrier failed on " + detail::describe(*g) +
                           " (ranks within the group): " + detail::error_text(e));
  }
}

// Blocks until every rank of the group (default: the world) arrives.
inline void barrier(const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "barrier");
  if (!g) return;
  detail::check_same_call(*g, [] { return std::string("barrier()"); });
  detail::run("barrier", *g, [&] { return g->barrier(); });
}

// Runs body on the main process (local rank 0, or global rank 0 when
// local_only is false) first, then on the others, and returns its result.
// If the main process throws, it still releases the others, which then throw
// DistributedError instead of running body on a state the main failed to make.
template <class Body>
std::invoke_result_t<Body&> main_process_first(Body&& body, bool local_only = true) {
  c10d::ProcessGroup* world = detail::resolve({}, "main_process_first");
  if (!world) return std::invoke(body);
  auto g = GroupPtr::unsafe_reclaim_from_nonowning(world);
  const bool is_main = local_only ? get_local_rank() == 0 : get_rank() == 0;
  // One all_reduce releases the others and tells them whether (and which)
  // main process failed: MAX of rank+1 over the failing mains, 0 if none.
  auto release = [&](int64_t failed_rank_plus_one) { return all_reduce(failed_rank_plus_one, ReduceOp::MAX, g); };
  using R = std::invoke_result_t<Body&>;
  if (is_main) {
    std::exception_ptr failure;
    if constexpr (std::is_void_v<R>) {
      try {
        std::invoke(body);
      } catch (...) {
        failure = std::current_exception();
      }
      release(failure ? get_rank() + 1 : 0);
      if (failure) std::rethrow_exception(failure);
    } else {
      std::optional<R> result;
      try {
        result.emplace(std::invoke(body));
      } catch (...) {
        failure = std::current_exception();
      }
      release(failure ? get_rank() + 1 : 0);
      if (failure) std::rethrow_exception(failure);
      return std::move(*result);
    }
  } else {
    if (int64_t failed = release(0); failed != 0)
      throw DistributedError("accel::main_process_first: the main process (rank " + std::to_string(failed - 1) +
                             ") threw; this rank did not run the body");
    return std::invoke(body);
  }
}

ACCEL_NAMESPACE_END
