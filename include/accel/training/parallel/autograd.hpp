// accel/training/parallel/autograd.hpp: autograd-aware collectives (accel::autograd).
//
// torch.distributed.nn.functional's: collectives inside model code (tensor
// and context parallelism) whose backward is the adjoint collective, so
// gradients flow across ranks. accel::autograd::
//   all_reduce(x, op = SUM, group)      backward: all_reduce of the gradient
//   all_gather(x, group)                backward: reduce_scatter (SUM) of it
//   reduce_scatter(x, op = SUM, group)  backward: all_gather of it
//   all_to_all(x, group)                backward: all_to_all of it
//   all_to_all(x, out_splits, in_splits, group)   backward: the splits swapped
// SUM and MEAN only (MEAN's adjoint divides the gradient as its forward
// divides the values); the gradient of MAX or MIN is not a collective, and
// torch's reuse of the forward op for it is wrong, so they are refused.
// Forward results are new tensors (the input is left alone). Every rank must
// run the backward too, in the same order, as with DDP.
// The backward sums what each rank's loss asks of a value: right where each
// rank's loss is its own (context parallelism's tokens). Where the ranks of
// a group compute one loss together on the same batch (tensor parallelism),
// accel::tp's region mappings are the ones to use (tp/regions.hpp says why).
#pragma once

#include "accel/distributed/exchange.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The group travels through the autograd context as a capsule (c10d's
// ProcessGroup is a torch::CustomClassHolder), which keeps it alive until
// backward has run.
inline GroupPtr saved_group(torch::autograd::AutogradContext* ctx) {
  c10::intrusive_ptr<torch::CustomClassHolder> holder = ctx->saved_data["group"].toCapsule();
  return GroupPtr::reclaim(static_cast<c10d::ProcessGroup*>(holder.release()));
}
inline void save_group(torch::autograd::AutogradContext* ctx, const GroupPtr& group) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(group);
}
inline GroupPtr differentiable_on(const GroupPtr& group, ReduceOp op, const char* name) {
  if (op != ReduceOp::SUM && op != ReduceOp::MEAN)
    throw InvalidArgument(std::string("accel::autograd::") + name + ": ReduceOp::" + std::string(to_string(op)) +
                          " has no collective as its gradient; SUM and MEAN do");
  c10d::ProcessGroup* g = resolve(group, name);
  return g ? GroupPtr::unsafe_reclaim_from_nonowning(g) : GroupPtr();
}

struct AllReduceFunction : torch::autograd::Function<AllReduceFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, ReduceOp op, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    return accel::all_reduce(x.clone(at::MemoryFormat::Contiguous), op, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    return {accel::all_reduce(grads[0].clone(at::MemoryFormat::Contiguous), op, saved_group(ctx)), {}, {}};
  }
};
struct AllGatherFunction : torch::autograd::Function<AllGatherFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["sizes"] = x.sizes().vec();
    return accel::all_gather(x, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor mine = accel::reduce_scatter(grads[0].contiguous(), ReduceOp::SUM, saved_group(ctx));
    return {mine.view(ctx->saved_data["sizes"].toIntVector()), {}};
  }
};
struct ReduceScatterFunction : torch::autograd::Function<ReduceScatterFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, ReduceOp op, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    ctx->saved_data["sizes"] = x.sizes().vec();
    return accel::reduce_scatter(x, op, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const GroupPtr group = saved_group(ctx);
    at::Tensor all = accel::all_gather(grads[0], group).view(ctx->saved_data["sizes"].toIntVector());
    if (static_cast<ReduceOp>(ctx->saved_data["op"].toInt()) == ReduceOp::MEAN) all.div_(group->getSize());
    return {all, {}, {}};
  }
};
struct AllToAllFunction : torch::autograd::Function<AllToAllFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::vector<int64_t> output_split_sizes, std::vector<int64_t> input_split_sizes,
                            GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["out"] = output_split_sizes;
    ctx->saved_data["in"] = input_split_sizes;
    return accel::all_to_all(x, std::move(output_split_sizes), std::move(input_split_sizes), group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The gradient goes back the way the rows came.
    return {accel::all_to_all(grads[0], ctx->saved_data["in"].toIntVector(), ctx->saved_data["out"].toIntVector(),
                              saved_group(ctx)),
            {},
            {},
            {}};
  }
};
}  // namespace detail

namespace autograd {
inline at::Tensor all_reduce(const at::Tensor& x, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, op, "all_reduce");
  if (!g) return x.clone();
  return detail::AllReduceFunction::apply(x, op, g);
}
inline at::Tensor all_gather(const at::Tensor& x, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, ReduceOp::SUM, "all_gather");
  if (!g) return x.unsqueeze(0).clone();
  return detail::AllGatherFunction::apply(x, g);
}
inline at::Tensor reduce_scatter(const at::Tensor& x, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, op, "reduce_scatter");
  if (!g) {
    detail::enter_reduce_scatter(x, op, group);  // the checks of every world size
    return x.clone();
  }
  return detail::ReduceScatterFunction::apply(x, op, g);
}
inline at::Tensor all_to_all(const at::Tensor& x, std::vector<int64_t> output_split_sizes = {},
                             std::vector<int64_t> input_split_sizes = {}, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, ReduceOp::SUM, "all_to_all");
  if (!g) {
    detail::check_all_to_all_splits(nullptr, x, std::move(output_split_sizes), std::move(input_split_sizes));
    return x.clone();
  }
  return detail::AllToAllFunction::apply(x, std::move(output_split_sizes), std::move(input_split_sizes), g);
}
}  // namespace autograd

ACCEL_NAMESPACE_END
