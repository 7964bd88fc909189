// accel/distributed/exchange.hpp: reduce_to, gather_to, scatter, send/recv, barriers.
//
// The rest of torch.distributed: reduce_to, gather_to, scatter, send, recv,
// monitored_barrier (all_to_all and reduce_scatter: all_to_all.hpp). Ranks
// (src, dst) are ranks within the group; a tensor with zero elements moves
// nothing.
#pragma once

#include "accel/distributed/all_to_all.hpp"
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

template <TensorLike T>
auto start_reduce_data(c10d::ProcessGroup& group, T data, ReduceOp op, int dst) {
  if constexpr (folded<T>()) return start_fold_data(group, std::move(data), op, "reduce_to");  // one gather
  else return start_in_place(std::move(data), [&](at::Tensor t) { return start_reduce(group, std::move(t), op, dst); });
}
}  // namespace detail

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
