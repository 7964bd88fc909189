// accel/training/tp/regions.hpp: Megatron's region mappings (accel::tp): the collectives around a tensor-parallel region.
//
// A tensor-parallel layer holds a piece of a weight; what enters and leaves
// it is replicated, split along the last (hidden) dimension, or, under
// sequence parallelism, split along the sequence dimension. Each mapping is
// an autograd function whose backward is the adjoint of its forward:
//   copy_to_parallel_region            forward: identity    backward: all-reduce
//   reduce_from_parallel_region        forward: all-reduce  backward: identity
//   scatter_to_parallel_region         forward: this rank's piece of the last dimension
//                                      backward: all-gather along it
//   gather_from_parallel_region        forward: all-gather along the last dimension
//                                      backward: this rank's piece
//   scatter_to_sequence_parallel_region        forward: this rank's piece of `dim`
//                                              backward: all-gather along it
//   gather_from_sequence_parallel_region       forward: all-gather along `dim`
//                                              backward: reduce-scatter along it
//   reduce_scatter_to_sequence_parallel_region forward: reduce-scatter along `dim`
//                                              backward: all-gather along it
// Why not accel::autograd's collectives: their all_reduce also all-reduces
// the gradient, right for outputs each rank uses differently, but a
// replicated region's gradient is already whole on every rank, and
// all-reducing it again multiplies it by the group's size.
//
// The group: the one given, else the process's tp group
// (DistributedInterface's Dim::TP). On a group of one every mapping is the
// identity and issues nothing.
#pragma once

#include "accel/distributed/interface.hpp"
#include "accel/training/parallel/autograd.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// The tensor-parallel group of a layer or a mapping: `group` when given, else
// the live interface's Dim::TP group (null in one process: the identity).
// A launched process without an interface has no tp group to take: taking
// the world instead would split the model over data-parallel peers.
inline GroupPtr group_or_default(const GroupPtr& group, const char* who) {
  if (group) return group;
  if (DistributedInterface::is_initialized()) return DistributedInterface::instance().get_group(Dim::TP);
  if (!is_distributed()) return {};
  throw LogicError(std::string("accel::tp::") + who +
                   ": no group given and no DistributedInterface to take Dim::TP's from; create it first "
                   "(accel::DistributedInterface::instance({.tp_size = N}), or an Accelerator), or pass the group");
}
inline int size_of(const GroupPtr& group) { return group ? group->getSize() : 1; }
inline int rank_in(const GroupPtr& group) { return group ? group->getRank() : 0; }

inline int64_t wrap_dim(const at::Tensor& x, int64_t dim, const char* who) {
  const int64_t rank = x.dim();
  if (dim < -rank || dim >= rank)
    throw InvalidArgument(std::string("accel::tp::") + who + ": dim " + std::to_string(dim) + " is out of range for " +
                          describe_tensor(x));
  return dim < 0 ? dim + rank : dim;
}
inline void check_splits(const at::Tensor& x, int64_t dim, int parts, const char* who) {
  if (x.size(dim) % parts != 0)
    throw InvalidArgument(std::string("accel::tp::") + who + ": dim " + std::to_string(dim) + " of " +
                          describe_tensor(x) + " does not split into " + std::to_string(parts) +
                          " equal pieces (the tensor-parallel group's size)");
}

// Token ids or targets that must lie in range: `valid`, a 0-d bool tensor on
// their device, must be true. On the CPU a clear error (`message` builds
// it); on a GPU a device-side assertion, so the check does not wait for the
// values (torch's own embedding and loss assert the same way there).
inline void require_valid_ids(const at::Tensor& valid, const std::function<std::string()>& message) {
  if (!valid.is_cpu()) at::_assert_async(valid);
  else if (!valid.item<bool>()) throw InvalidArgument(message());
}

// This rank's piece of `dim` (a copy: the piece outlives the whole).
inline at::Tensor piece_of(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  const int64_t length = x.size(dim) / size_of(group);
  return x.narrow(dim, rank_in(group) * length, length).contiguous();
}
// The pieces of every rank, concatenated along `dim` in rank order.
inline at::Tensor gather_along(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  const at::Tensor stacked = accel::all_gather(x.contiguous(), group);  // (group size, *x's shape)
  return stacked.movedim(0, dim).flatten(dim, dim + 1);
}
// `dim` split into the group's pieces, piece r summed over the group and returned on rank r.
inline at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  const int parts = size_of(group);
  const at::Tensor rows = x.unflatten(dim, {parts, x.size(dim) / parts}).movedim(dim, 0).contiguous();
  return accel::reduce_scatter(rows, ReduceOp::SUM, group).squeeze(0);
}
inline at::Tensor sum_over(const at::Tensor& x, const GroupPtr& group) {
  return accel::all_reduce(x.clone(at::MemoryFormat::Contiguous), ReduceOp::SUM, group);
}

enum class Move : int64_t { identity, all_reduce, piece, gather, reduce_scatter };

inline at::Tensor apply_move(Move move, const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  switch (move) {
    case Move::identity: return x;
    case Move::all_reduce: return sum_over(x, group);
    case Move::piece: return piece_of(x, dim, group);
    case Move::gather: return gather_along(x, dim, group);
    case Move::reduce_scatter: return reduce_scatter_along(x, dim, group);
  }
  return x;
}

// One autograd function for every mapping: `forward` moves the values,
// `backward` the gradient (its adjoint), both along `dim`.
struct RegionFunction : torch::autograd::Function<RegionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t forward_move,
                            int64_t backward_move, int64_t dim, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["move"] = backward_move;
    ctx->saved_data["dim"] = dim;
    return apply_move(static_cast<Move>(forward_move), x, dim, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto move = static_cast<Move>(ctx->saved_data["move"].toInt());
    return {apply_move(move, grads[0], ctx->saved_data["dim"].toInt(), saved_group(ctx)), {}, {}, {}, {}};
  }
};

// `forward` then, in backward, `backward`, along `dim`; the identity (no
// collective, no autograd node) on a group of one.
inline at::Tensor map_region(const at::Tensor& x, Move forward, Move backward, int64_t dim, const GroupPtr& group,
                             const char* who) {
  const GroupPtr g = group_or_default(group, who);
  const int parts = size_of(g);
  // (copy_to and reduce_from move whole tensors, a 0-d loss included: no dimension to check)
  if (forward != Move::identity && forward != Move::all_reduce) {
    dim = wrap_dim(x, dim, who);
    if (forward != Move::gather) check_splits(x, dim, parts, who);
  }
  if (parts == 1) return x;
  return RegionFunction::apply(x, static_cast<int64_t>(forward), static_cast<int64_t>(backward), dim, g);
}
}  // namespace detail::tp

namespace tp {
inline at::Tensor copy_to_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::identity, detail::tp::Move::all_reduce, -1, group,
                                "copy_to_parallel_region");
}
inline at::Tensor reduce_from_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::all_reduce, detail::tp::Move::identity, -1, group,
                                "reduce_from_parallel_region");
}
inline at::Tensor scatter_to_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::piece, detail::tp::Move::gather, -1, group,
                                "scatter_to_parallel_region");
}
inline at::Tensor gather_from_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::gather, detail::tp::Move::piece, -1, group,
                                "gather_from_parallel_region");
}
inline at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, int64_t dim = 1,
                                                      const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::piece, detail::tp::Move::gather, dim, group,
                                "scatter_to_sequence_parallel_region");
}
inline at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, int64_t dim = 1,
                                                       const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::gather, detail::tp::Move::reduce_scatter, dim, group,
                                "gather_from_sequence_parallel_region");
}
inline at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, int64_t dim = 1,
                                                             const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::reduce_scatter, detail::tp::Move::gather, dim, group,
                                "reduce_scatter_to_sequence_parallel_region");
}
}  // namespace tp

ACCEL_NAMESPACE_END
