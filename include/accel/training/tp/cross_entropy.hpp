// accel/training/tp/cross_entropy.hpp: vocab_parallel_cross_entropy (torch's loss_parallel, Megatron's vocab-parallel cross entropy).
//
// The cross-entropy loss of logits split along the vocabulary (a
// ColumnParallelLinear head without gather_output) without gathering them:
// each rank holds [tokens, vocabulary / tp]; the loss needs per token only
// the largest logit, the sum of the exponentials and the target's logit,
// three numbers that cross the group (one all-reduce MAX, and one SUM of the
// other two together) instead of tokens x vocabulary. The backward is local:
// softmax minus the target's one-hot, on this rank's columns.
// Reduction as torch's cross_entropy's default: the mean over the tokens
// whose target is not ignore_index (NaN when every one is, as torch's).
// Half and bfloat16 logits are computed in float32: the loss is float32,
// their gradient in their dtype.
#pragma once

#include "accel/training/tp/layer.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  // logits [tokens, vocabulary / tp], target [tokens] -> each token's loss [tokens]
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            GroupPtr group) {
    const bool reduced = logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16;
    const at::Tensor x = reduced ? logits.to(at::kFloat) : logits;
    const int64_t columns = x.size(-1);
    const int64_t start = rank_in(group) * columns;
    const bool shared = size_of(group) > 1;

    at::Tensor largest = std::get<0>(x.max(-1));
    if (shared) accel::all_reduce(largest, ReduceOp::MAX, group);
    const at::Tensor shifted = x - largest.unsqueeze(-1);
    const at::Tensor inside = target.ge(start).logical_and(target.lt(start + columns));
    const at::Tensor column = (target - start).masked_fill(inside.logical_not(), 0);
    const at::Tensor exps = shifted.exp();
    // One all-reduce for the two sums: [tokens, 2] = (sum of exp, target's shifted logit).
    at::Tensor sums = at::stack(
        {exps.sum(-1), shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1).masked_fill(inside.logical_not(), 0)}, -1);
    if (shared) accel::all_reduce(sums, ReduceOp::SUM, group);
    const at::Tensor sum_exp = sums.select(-1, 0);
    const at::Tensor loss = sum_exp.log() - sums.select(-1, 1);

    ctx->save_for_backward({exps.div_(sum_exp.unsqueeze(-1)), column, inside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax over the whole vocabulary, this rank's columns
    grad.scatter_add_(-1, saved[1].unsqueeze(-1), saved[2].to(grad.scalar_type()).neg().unsqueeze(-1));
    grad.mul_(grads[0].unsqueeze(-1));
    return {grad.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt())), {}, {}};
  }
};
}  // namespace detail::tp

namespace tp {
// local_logits [..., vocabulary / tp]: this rank's columns (rank r holds
// r * vocabulary / tp onwards, as ColumnParallelLinear splits them);
// target [...] with the whole vocabulary's ids, the same on every rank.
inline at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                               int64_t ignore_index = -100, const GroupPtr& group = {}) {
  constexpr const char* who = "vocab_parallel_cross_entropy";
  const GroupPtr g = detail::tp::group_or_default(group, who);
  if (local_logits.dim() < 1 || target.sizes() != local_logits.sizes().slice(0, local_logits.dim() - 1))
    throw InvalidArgument(std::string("accel::tp::") + who +
                          ": target must have the logits' shape without its last "
                          "(vocabulary) dimension; got logits " +
                          detail::describe_tensor(local_logits) + " and target " + detail::describe_tensor(target));
  if (!at::isIntegralType(target.scalar_type(), /*includeBool=*/false))
    throw InvalidArgument(std::string("accel::tp::") + who + ": target must hold integer ids, got " +
                          detail::describe_tensor(target));
  const at::Tensor logits = local_logits.reshape({-1, local_logits.size(-1)});
  const at::Tensor ids = target.reshape({-1}).to(at::kLong);
  // A target outside the vocabulary would match no rank's column: torch's error instead (asynchronous on a GPU).
  const int64_t vocabulary = logits.size(-1) * detail::tp::size_of(g);
  if (ids.numel() > 0)
    detail::tp::require_valid_ids(
        ids.eq(ignore_index).logical_or(ids.ge(0).logical_and(ids.lt(vocabulary))).all(), [&] {
          return std::string("accel::tp::") + who + ": target ids must lie in [0, " + std::to_string(vocabulary) +
                 ") (the vocabulary: " + std::to_string(logits.size(-1)) + " columns x tp " +
                 std::to_string(detail::tp::size_of(g)) + ") or equal ignore_index " + std::to_string(ignore_index);
        });
  const at::Tensor losses = detail::tp::VocabParallelCrossEntropy::apply(logits, ids, g);
  const at::Tensor kept = ids.ne(ignore_index).to(losses.scalar_type());
  return (losses * kept).sum() / kept.sum();
}
}  // namespace tp

ACCEL_NAMESPACE_END
