// accel/training/tp/styled_forward.hpp: a styled module run with its parallel style: its inputs moved to the layouts it needs, its pieces computed, its output moved to the layout the plan says.
//
// accel::unit_forward calls detail::tp::styled_forward for every module; a
// module no plan styled is simply called. Where torch's DTensor knows each
// activation's layout, here the plan's input_layouts say it, and every style
// hands on this rank's local tensor.
#pragma once

#include "accel/training/tp/embedding.hpp"
#include "accel/training/tp/pieces.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// PrepareModuleInput's all-gather of a sequence-split input. Its gradient
// depends on who reads the gathered tensor, as a DTensor's redistribution
// does: a column layer (whose input gradient is this rank's part of a sum)
// needs the parts reduce-scattered, any other reader (whose gradient is
// whole on every rank) needs only this rank's piece of its gradient. So the
// gather has two outputs with the same values: the one the module gets, and
// a twin that column layers take instead when they are given the first
// (SequenceGatherTwins). The backward sums both kinds right: attention's
// q, k and v projections cost one reduce-scatter together, and a reader the
// plan does not know of is still correct.
struct TwinGatherFunction : torch::autograd::Function<TwinGatherFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                                                GroupPtr group) {
    ctx->set_materialize_grads(false);
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    at::Tensor whole = gather_along(x, dim, group);
    // The twin shares the storage but is no view of `whole` (a view would hold `whole` alive, and the
    // registry, which keeps the twin while `whole` lives, would then keep both, and their graph, forever).
    at::Tensor twin = whole.detach();
    return {whole, twin};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const GroupPtr group = saved_group(ctx);
    at::Tensor grad;
    if (grads[0].defined()) grad = piece_of(grads[0], dim, group);  // whole readers: this rank's piece
    if (grads[1].defined()) {                                       // column layers: their parts summed
      at::Tensor summed = reduce_scatter_along(grads[1], dim, group);
      grad = grad.defined() ? grad + summed : summed;
    }
    return {grad, {}, {}};
  }
};

// The gathered tensors whose twin a column layer takes, by the gathered
// tensor's address (TensorKeyedMap: a freed tensor's address can be reused).
// An entry lives until the next gather after its tensor has gone.
class SequenceGatherTwins {
 public:
  static SequenceGatherTwins& instance() {
    static SequenceGatherTwins twins;
    return twins;
  }
  at::Tensor gather(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
    auto outputs = TwinGatherFunction::apply(x, dim, group);
    if (outputs[1].requires_grad()) twins_.insert(detail::weak_tensor(outputs[0]), outputs[1]);
    return outputs[0];
  }
  // How many gathered tensors are alive (their twins kept): after a backward, none should be.
  std::size_t live() const { return twins_.live(); }
  // The twin of `x` when it is such a gathered tensor, else undefined.
  at::Tensor twin_of(const at::Tensor& x) const { return twins_.find(x.unsafeGetTensorImpl()).value_or(at::Tensor()); }

 private:
  TensorKeyedMap<at::Tensor> twins_;
};

// An activation moved from one layout to another (PrepareModuleInput):
// all-gathered (with twins), split, or left; between two Shard dimensions
// (an all-to-all) refused.
inline at::Tensor move_layout(const Styled& s, std::size_t input, const at::Tensor& x, const accel::tp::Layout& from,
                              const accel::tp::Layout& to) {
  const auto from_dim = shard_dim(from, x.dim()), to_dim = shard_dim(to, x.dim());
  if (from_dim == to_dim) return x;
  const std::string which = s.who() + "'s input " + std::to_string(input);
  if (from_dim && to_dim)
    throw InvalidArgument("accel::tp: " + which + ": moving from " + describe(from) + " to " + describe(to) +
                          " (an all-to-all) is not supported");
  if (from_dim) {
    if (*from_dim < 0 || *from_dim >= x.dim())
      throw InvalidArgument("accel::tp: " + which + ": " + describe(from) + " is out of range for " +
                            describe_tensor(x));
    return SequenceGatherTwins::instance().gather(x, *from_dim, s.group);
  }
  return accel::tp::scatter_to_sequence_parallel_region(x, *to_dim, s.group);
}

// Token ids given split (input_layouts Shard(d)) are gathered: ids carry no gradient.
inline at::Tensor whole_ids(const Styled& s, const at::Tensor& ids, const accel::tp::Layout& layout) {
  const auto dim = shard_dim(layout, ids.dim());
  return dim ? gather_along(ids, *dim, s.group) : ids;
}

// A column layer's input made whole: gathered along the sequence (the
// backward reduce-scatters this rank's part of the gradient), the twin of
// a gathered tensor, or the whole input itself (the backward all-reduces).
inline at::Tensor column_input(const Styled& s, const at::Tensor& x, const accel::tp::Layout& layout) {
  if (const auto dim = shard_dim(layout, x.dim()))
    return accel::tp::gather_from_sequence_parallel_region(x, *dim, s.group);
  if (at::Tensor twin = SequenceGatherTwins::instance().twin_of(x); twin.defined()) return twin;
  return accel::tp::copy_to_parallel_region(x, s.group);
}

inline void check_last_is_sharded(const Styled& s, const accel::tp::Layout& layout, const at::Tensor& x,
                                  const char* what) {
  if (const auto dim = shard_dim(layout, x.dim()); dim && *dim != x.dim() - 1)
    throw InvalidArgument("accel::tp: " + s.who() + ": its " + what + " " + describe(layout) +
                          " must split the last dimension (Shard(-1)) or be Replicate(), for " + describe_tensor(x));
}

// Where a styled module's own tensors are read: `in_unit(compute, x)` runs
// compute(x) inside the module's FULL_SHARD unit (its parameters gathered;
// plainly compute(x) when it is none). What moves the input to the layout
// the pieces need runs before, outside it, on the tensor the caller gave
// (the twin of a gathered input is found by that tensor).
using InUnit = std::function<at::Tensor(const std::function<at::Tensor(const at::Tensor&)>&, const at::Tensor&)>;

// A styled Linear: F::linear on this rank's pieces with the collectives around it.
inline at::Tensor styled_linear(const Styled& s, const torch::nn::LinearImpl& linear, const at::Tensor& x,
                                const InUnit& in_unit) {
  const int64_t in_piece = linear.weight.size(1);
  if (const auto* col = std::get_if<accel::tp::ColwiseParallel>(&s.style)) {
    at::Tensor whole = column_input(s, x, col->input_layouts);
    if (whole.dim() == 0 || whole.size(-1) != in_piece)
      throw InvalidArgument("accel::tp: " + s.who() + " takes inputs of " + std::to_string(in_piece) +
                            " features in the last dimension, got " + describe_tensor(whole));
    at::Tensor mine = in_unit(
        [&](const at::Tensor& in) { return torch::nn::functional::linear(in, linear.weight, linear.bias); }, whole);
    check_last_is_sharded(s, col->output_layouts, mine, "output_layouts");
    if (std::holds_alternative<accel::tp::Replicate>(col->output_layouts))
      return accel::tp::gather_from_parallel_region(mine, s.group);
    return mine;
  }
  const auto& row = std::get<accel::tp::RowwiseParallel>(s.style);
  if (x.dim() > 0) check_last_is_sharded(s, row.input_layouts, x, "input_layouts");
  at::Tensor mine = std::holds_alternative<accel::tp::Replicate>(row.input_layouts)
                        ? accel::tp::scatter_to_parallel_region(x, s.group)
                        : x;
  if (mine.dim() == 0 || mine.size(-1) != in_piece) {
    const bool whole = x.dim() > 0 && x.size(-1) == s.whole_features;
    throw InvalidArgument(
        "accel::tp: " + s.who() + " takes this rank's piece of the last dimension (" + std::to_string(in_piece) +
        " of " + std::to_string(s.whole_features) + " features), got " + describe_tensor(x) +
        (whole ? ": a whole input; where the plan gives it whole, say input_layouts = Replicate()" : std::string()));
  }
  // (the sum inside the unit too: the bias, a tensor of the unit, is added after it)
  return in_unit(
      [&](const at::Tensor& in) {
        const at::Tensor partial = torch::nn::functional::linear(in, linear.weight);
        at::Tensor out = [&] {
          if (const auto dim = shard_dim(row.output_layouts, partial.dim()))
            return accel::tp::reduce_scatter_to_sequence_parallel_region(partial, *dim, s.group);
          return accel::tp::reduce_from_parallel_region(partial, s.group);
        }();
        return linear.bias.defined() ? out + linear.bias : out;
      },
      mine);
}

// A styled Embedding: columns (ColwiseParallel) or rows (RowwiseParallel) of the table.
inline at::Tensor styled_embedding(const Styled& s, const torch::nn::EmbeddingImpl& embedding, const at::Tensor& ids,
                                   const InUnit& in_unit) {
  const auto& padding = embedding.options.padding_idx();  // (c10::optional on LibTorch 1.13)
  if (const auto* col = std::get_if<accel::tp::ColwiseParallel>(&s.style)) {
    // (torch::embedding itself: GCC 14's -Wmaybe-uninitialized misfires on a chained EmbeddingFuncOptions)
    at::Tensor mine = in_unit(
        [&](const at::Tensor& whole) {
          return torch::embedding(embedding.weight, whole, padding ? *padding : -1,
                                  embedding.options.scale_grad_by_freq(), embedding.options.sparse());
        },
        whole_ids(s, ids, col->input_layouts));
    if (std::holds_alternative<accel::tp::Replicate>(col->output_layouts))
      return accel::tp::gather_from_parallel_region(mine, s.group);
    check_last_is_sharded(s, col->output_layouts, mine, "output_layouts");
    return mine;
  }
  const auto& row = std::get<accel::tp::RowwiseParallel>(s.style);
  at::Tensor mine = in_unit(
      [&](const at::Tensor& whole) {
        return vocab_piece_lookup(whole, embedding.weight, s.vocab_start, s.whole_features,
                                  padding ? std::optional<int64_t>(*padding) : std::nullopt, "RowwiseParallel");
      },
      whole_ids(s, ids, row.input_layouts));
  if (const auto dim = shard_dim(row.output_layouts, mine.dim()))
    return accel::tp::reduce_scatter_to_sequence_parallel_region(mine, *dim, s.group);
  return accel::tp::reduce_from_parallel_region(mine, s.group);
}

// A column or row style's forward, marked for the CallWatch.
inline at::Tensor styled_pieces_forward(const Styled& s, const torch::nn::Module& module, const at::Tensor& x,
                                        const InUnit& in_unit) {
  at::Tensor out;
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module))
    out = styled_linear(s, *linear, x, in_unit);
  else out = styled_embedding(s, dynamic_cast<const torch::nn::EmbeddingImpl&>(module), x, in_unit);
  if (out.requires_grad() && at::GradMode::is_enabled()) {
    std::vector<at::Tensor> split;
    for (const auto& piece : styled_split_parameters(s, module))
      if (piece.tensor.requires_grad()) split.push_back(piece.tensor);
    if (!split.empty())
      out.register_hook([watch = s.watch, split = std::move(split)](const at::Tensor& grad) {
        watch->mark(split);
        return grad;
      });
  }
  return out;
}

// The module's forward with its style applied, if a plan gave it one.
// `unit(fn, args...)` runs fn(args...) inside the module's FULL_SHARD unit
// (plainly when it is none); `forward(args...)` is the module's forward.
// An unstyled module, a SequenceParallel one (its style is in the layouts
// around it) and PrepareModuleInput's (its inputs moved first) run their
// forward in the unit; a column or row style computes its pieces in it.
template <class Unit, class Forward, class... Args>
auto styled_forward(const torch::nn::Module& module, Unit&& unit, Forward&& forward, Args&&... args) {
  using Out = decltype(unit(forward, std::forward<Args>(args)...));
  const std::shared_ptr<const Styled> styled = StyledRegistry::instance().find(&module);
  if (!styled || std::holds_alternative<accel::tp::SequenceParallel>(styled->style))
    return unit(forward, std::forward<Args>(args)...);
  if (const auto* prepare = std::get_if<accel::tp::PrepareModuleInput>(&styled->style)) {
    const auto enter = [&]<std::size_t I, class A>(A&& a) -> decltype(auto) {
      if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
        if (I < prepare->input_layouts.size() && prepare->input_layouts[I] && prepare->desired_input_layouts[I])
          return move_layout(*styled, I, a, *prepare->input_layouts[I], *prepare->desired_input_layouts[I]);
        return at::Tensor(a);
      } else {
        return std::forward<A>(a);
      }
    };
    return [&]<std::size_t... I>(std::index_sequence<I...>) -> Out {
      return unit(forward, enter.template operator()<I>(std::forward<Args>(args))...);
    }(std::index_sequence_for<Args...>{});
  }
  // Column and row styles apply to a Linear or an Embedding (parallelize_module checked): one tensor in, one out.
  if constexpr (sizeof...(Args) == 1 && (std::is_same_v<std::decay_t<Args>, at::Tensor> && ...) &&
                std::is_same_v<Out, at::Tensor>) {
    const InUnit in_unit = [&unit](const std::function<at::Tensor(const at::Tensor&)>& compute, const at::Tensor& x) {
      return unit(compute, x);
    };
    return styled_pieces_forward(*styled, module, args..., in_unit);
  } else {
    throw LogicError("accel::tp: " + styled->who() + " takes one tensor and returns one");
  }
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END
