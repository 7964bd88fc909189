// accel/training/tp/dropout.hpp: tp::dropout, one random mask for the whole activation whichever piece a rank holds.
//
// Dropout inside a tensor-parallel model must draw, for each element of the
// whole activation, one decision that every rank agrees on: where the
// activation is replicated, the same mask on every rank (else the replicas
// drift apart); where it is split (a column layer's output, or under
// sequence parallelism the tokens between layers), each rank the mask of its
// own piece, and the pieces together the mask of the whole. torch's DTensor
// does this with OffsetBasedRNGTracker (each shard's offset into one shared
// random stream); Megatron with a second, per-rank stream (its masks then
// differ from one process's). Here each rank draws the whole activation's
// mask from the default generator, the same on every rank of the group
// (seed them alike: accel::set_seed(seed)), and keeps its piece: on the CPU
// the values are those of torch::dropout in one process on the whole
// activation, and every generator advances as that one would. Costs a whole
// mask for a moment (tp times the piece).
#pragma once

#include "accel/training/tp/layer.hpp"

ACCEL_NAMESPACE_BEGIN

namespace tp {
// x: the whole activation (sharded_dim empty), or this rank's piece of
// dimension *sharded_dim of it (pieces in rank order, as the layers split).
// p: the probability of an element being zeroed; the rest are scaled by
// 1 / (1 - p), as torch::dropout.
inline at::Tensor dropout(const at::Tensor& x, double p, bool training, std::optional<int64_t> sharded_dim = {},
                          const GroupPtr& group = {}) {
  if (p < 0 || p > 1) throw InvalidArgument("accel::tp::dropout: p must lie in [0, 1], got " + std::to_string(p));
  const GroupPtr g = detail::tp::group_or_default(group, "dropout");
  const int parts = detail::tp::size_of(g);
  if (!training || p == 0 || p == 1 || !sharded_dim || parts == 1 || x.numel() == 0)
    return torch::dropout(x, p, training);
  // torch::dropout's own steps on the CPU (ATen's _dropout_impl: a Bernoulli
  // noise tensor of the input's shape, divided by 1 - p, multiplied in), on
  // the whole shape, of which this rank keeps its piece.
  const int64_t dim = detail::tp::wrap_dim(x, *sharded_dim, "dropout");
  std::vector<int64_t> whole(x.sizes().begin(), x.sizes().end());
  whole[dim] *= parts;
  at::Tensor noise = at::empty(whole, x.options()).bernoulli_(1 - p);
  noise = noise.narrow(dim, detail::tp::rank_in(g) * x.size(dim), x.size(dim)).contiguous();
  return x * noise.div_(1 - p);
}
}  // namespace tp

ACCEL_NAMESPACE_END
