// accel/training/tp/sequence_parallel.hpp: all_reduce_sequence_parallel_gradients, the partial gradients of sequence parallelism summed in one collective.
//
// Under sequence parallelism a parameter that is whole on every rank but
// meets only this rank's tokens (a norm's weight and bias, a
// RowParallelLinear's bias) ends the backward with this rank's part of its
// gradient; the whole gradient is the sum over the tensor-parallel group.
// Megatron sums them after the backward (finalize_model_grads); torch's
// DTensor keeps them Partial and all-reduces each one (15 all-reduces for a
// 2-layer Llama's norms). Here: one all-reduce per group and dtype, of every
// such gradient packed together, called once before the optimizer step (and
// after the last backward of an accumulation: a sum is linear, so summing
// the accumulated gradient once is the same as summing each).
// The accel::tp layers name their own partial parameters, and a plan its
// SequenceParallel modules' and its row layers' (tp::parallelize_module); a
// norm no plan styled, the caller lists.
#pragma once

#include "accel/training/parameters.hpp"
#include "accel/training/tp/pieces.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// The gradients summed last, each with its version after the sum: a second
// call before the gradient changes (the Accelerator's backward summed it, and
// the user's loop asks again) leaves it alone instead of multiplying it by
// tp. A gradient written since (a new backward, zero_grad) is summed again.
// Gradients that are views of one buffer (a sharded wrapper's shards') share
// one version counter, so writing one moves the version of all: each call
// records the versions of everything it summed or found summed at its end,
// after its own writes.
class SummedGradients {
 public:
  static SummedGradients& instance() {
    static SummedGradients summed;
    return summed;
  }
  bool unchanged_since_summed(const at::Tensor& grad) const {
    return summed_.find(grad.unsafeGetTensorImpl()) == static_cast<int64_t>(grad._version());
  }
  void record(const at::Tensor& grad) {
    summed_.insert(detail::weak_tensor(grad), static_cast<int64_t>(grad._version()));
  }

 private:
  TensorKeyedMap<int64_t> summed_;  // each gradient's version after the sum
};
}  // namespace detail::tp

namespace tp {
// Sums over their group the gradients of: the partial parameters of every
// accel::tp layer and styled module in `model` (itself included), and
// `sequence_parallel_parameters` (each once; a norm's weight and bias, over
// `group`, null: the process's Dim::TP group). Parameters without a gradient
// are skipped (every rank of a tensor-parallel group runs the same layers on
// the same batch, so the same ones everywhere), and so are gradients this
// function summed that nothing has written since: calling it twice sums
// once. Returns the number of all-reduces issued. The Accelerator calls it
// in backward on the steps that sync, for every prepared model with
// tensor-parallel pieces. List a norm only where it runs on sequence-split
// activations: on whole (replicated) ones its gradient is already whole on
// every rank, and summing it would multiply it by tp. Under sharding
// (SHARD_GRAD_OP, FULL_SHARD: FSDP + TP) the gradient summed is the
// shard's, which the optimizer steps: call it after the data-parallel
// reduction (Accelerator::backward, DataParallel::finish).
inline int all_reduce_sequence_parallel_gradients(torch::nn::Module& model,
                                                  const std::vector<at::Tensor>& sequence_parallel_parameters = {},
                                                  const GroupPtr& group = {}) {
  // The gradients summed together: one pack per (group, dtype, device), in
  // the order of their first gradient (the same on every rank: a map keyed
  // by the group's address could order them differently on each rank, and
  // their all-reduces would then wait on each other).
  struct Pack {
    GroupPtr group;
    at::ScalarType dtype;
    c10::Device device;
    std::vector<at::Tensor> grads;
  };
  std::vector<Pack> packs;
  std::vector<at::Tensor> summed_before;  // found summed by an earlier call, not written since
  std::unordered_set<const c10::TensorImpl*> seen;
  const auto add = [&](const at::Tensor& parameter, const GroupPtr& over) {
    if (!seen.insert(parameter.unsafeGetTensorImpl()).second || detail::tp::size_of(over) == 1) return;
    // (under sharding the gradient the optimizer steps is the shard's: the same chunk of the same tensor on
    // every rank of the tp group, their pieces having the same shapes, and the sum over tp of the averaged
    // chunks is the averaged chunk of the sum)
    const at::Tensor grad = detail::StandIns::instance().of(parameter).grad();
    if (!grad.defined()) return;
    if (detail::tp::SummedGradients::instance().unchanged_since_summed(grad)) {
      summed_before.push_back(grad);
      return;
    }
    auto pack = std::find_if(packs.begin(), packs.end(), [&](const Pack& p) {
      return p.group == over && p.dtype == grad.scalar_type() && p.device == grad.device();
    });
    if (pack == packs.end()) pack = packs.insert(packs.end(), Pack{over, grad.scalar_type(), grad.device(), {}});
    pack->grads.push_back(grad);
  };
  const auto visit = [&](const torch::nn::Module& module) {
    if (const auto pieces = detail::tp::pieces_of(module))
      for (const auto& p : pieces->partial) add(p, pieces->group);
  };
  visit(model);
  for (const auto& child : model.modules(/*include_self=*/false)) visit(*child);
  if (!sequence_parallel_parameters.empty()) {
    const GroupPtr over = detail::tp::group_or_default(group, "all_reduce_sequence_parallel_gradients");
    for (const auto& p : sequence_parallel_parameters) add(p, over);
  }
  const at::NoGradGuard no_grad;
  for (auto& pack : packs) {
    std::vector<at::Tensor> flat;
    for (const auto& g : pack.grads) flat.push_back(g.reshape({-1}));
    at::Tensor packed = at::cat(flat);
    accel::all_reduce(packed, ReduceOp::SUM, pack.group);
    int64_t offset = 0;
    for (auto& g : pack.grads) {
      g.copy_(packed.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
  for (const auto& pack : packs)
    for (const auto& g : pack.grads) detail::tp::SummedGradients::instance().record(g);
  for (const auto& g : summed_before) detail::tp::SummedGradients::instance().record(g);
  return static_cast<int>(packs.size());
}
}  // namespace tp

ACCEL_NAMESPACE_END
