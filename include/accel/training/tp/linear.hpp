// accel/training/tp/linear.hpp: Megatron-core's ColumnParallelLinear and RowParallelLinear as torch::nn modules.
//
// A Linear's weight [out, in] split over the tensor-parallel group:
//   ColumnParallelLinear  rows (out) split: each rank computes its piece of
//                         the output's last dimension from the whole input.
//   RowParallelLinear     columns (in) split: each rank multiplies its piece
//                         of the input's last dimension, and the partial
//                         products are summed over the group.
// Column then Row (an MLP's up and down projection, attention's q/k/v and
// output) needs one all-reduce forward and one backward for the pair.
// With sequence_parallel, activations outside the pair are split along the
// sequence dimension (`sequence_dim`, 1 for [batch, sequence, hidden] as
// torchtitan's Shard(1); Megatron's [sequence, batch, hidden] is 0): the
// Column layer all-gathers them and the Row layer reduce-scatters its sum,
// the same bytes as the all-reduce, and norms and dropout between pairs
// run on 1/tp of the tokens.
//
// A new layer draws the whole weight as torch::nn::Linear does (Kaiming
// uniform, the bias uniform in +-1/sqrt(in)) and keeps its piece: on every
// rank with the same random state, the pieces of the Linear a single process
// would have made. load_full(weight, bias) loads the pieces of given whole
// tensors instead.
#pragma once

#include "accel/training/tp/layer.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// torch::nn::Linear's initial values, drawn whole.
inline void init_linear_weight(at::Tensor& weight) { torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0)); }
inline std::function<void(at::Tensor&)> init_linear_bias(int64_t in_features) {
  return [in_features](at::Tensor& bias) {
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    torch::nn::init::uniform_(bias, -bound, bound);
  };
}
}  // namespace detail::tp

namespace tp {
struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);  // the whole layer's; each rank holds out_features / tp
  TORCH_ARG(bool, bias) = true;
  // All-gather the output's pieces (a whole, replicated output) instead of
  // returning this rank's piece of the last dimension.
  TORCH_ARG(bool, gather_output) = false;
  // The input is split along sequence_dim (and all-gathered here).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(GroupPtr, group) = {};  // null: the process's Dim::TP group
};

class ColumnParallelLinearImpl : public torch::nn::Module, public detail::tp::ParallelLayer {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features)
      : ColumnParallelLinearImpl(ColumnParallelLinearOptions(in_features, out_features)) {}
  explicit ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options)
      : ParallelLayer(options.group(), "ColumnParallelLinear"), options(options) {
    if (options.gather_output() && options.sequence_parallel())
      throw InvalidArgument(
          "accel::tp::ColumnParallelLinear: gather_output and sequence_parallel exclude each other (a "
          "sequence-parallel region ends at a RowParallelLinear, which reduce-scatters along the sequence)");
    piece_length(options.out_features(), "out_features", "ColumnParallelLinear");
    weight = register_parameter(
        "weight", initial_piece({options.out_features(), options.in_features()}, 0, detail::tp::init_linear_weight));
    if (options.bias())
      bias = register_parameter(
          "bias", initial_piece({options.out_features()}, 0, detail::tp::init_linear_bias(options.in_features())));
  }

  // input [..., in_features] (under sequence_parallel, this rank's piece of
  // sequence_dim) -> [..., out_features / tp], or [..., out_features] with
  // gather_output.
  at::Tensor forward(const at::Tensor& input) {
    const at::Tensor whole_input =
        options.sequence_parallel() ? tp::gather_from_sequence_parallel_region(input, options.sequence_dim(), group())
                                    : tp::copy_to_parallel_region(input, group());
    const at::Tensor mine = torch::nn::functional::linear(whole_input, weight, bias);
    return options.gather_output() ? tp::gather_from_parallel_region(mine, group()) : mine;
  }

  // Loads this rank's rows of a whole weight [out_features, in_features] and
  // bias [out_features] (an undefined bias leaves the layer's as it is).
  void load_full(const at::Tensor& whole_weight, const at::Tensor& whole_bias = {}) {
    load_piece(weight, whole_weight, 0, {options.out_features(), options.in_features()}, "weight",
               "ColumnParallelLinear");
    if (whole_bias.defined()) {
      if (!bias.defined())
        throw InvalidArgument("accel::tp::ColumnParallelLinear::load_full: a bias was given to a layer without one");
      load_piece(bias, whole_bias, 0, {options.out_features()}, "bias", "ColumnParallelLinear");
    }
  }

  // Makes `shared` this layer's weight, registered under the same name:
  // a head tied to a VocabParallelEmbedding over the same vocabulary (one
  // tensor, the same rows on each rank: Megatron's shared embedding).
  // torch::nn::Module cannot re-register a parameter from outside.
  void tie_weight(const at::Tensor& shared) {
    if (!shared.defined() || shared.sizes() != weight.sizes())
      throw InvalidArgument("accel::tp::ColumnParallelLinear::tie_weight: the weight must have this rank's shape " +
                            c10::str(weight.sizes()) + ", got " +
                            (shared.defined() ? detail::describe_tensor(shared) : std::string("an undefined tensor")));
    parameters_["weight"] = shared;
    weight = shared;
  }

  std::vector<detail::tp::SplitParameter> split_parameters() const override {
    if (bias.defined()) return {{weight, 0}, {bias, 0}};
    return {{weight, 0}};
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "accel::tp::ColumnParallelLinear(in_features=" << options.in_features()
           << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
           << ", tp=" << tp_size() << ")";
  }

  ColumnParallelLinearOptions options;
  at::Tensor weight;  // [out_features / tp, in_features]: rows tp_rank() * out / tp onwards
  at::Tensor bias;    // [out_features / tp], or undefined
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);  // the whole layer's; each rank holds in_features / tp
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;  // whole on every rank, added after the sum
  // The input is already this rank's piece of the last dimension (a
  // ColumnParallelLinear's output); false: the whole input, split here.
  TORCH_ARG(bool, input_is_parallel) = true;
  // Reduce-scatter the output along sequence_dim instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(GroupPtr, group) = {};  // null: the process's Dim::TP group
};

class RowParallelLinearImpl : public torch::nn::Module, public detail::tp::ParallelLayer {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features)
      : RowParallelLinearImpl(RowParallelLinearOptions(in_features, out_features)) {}
  explicit RowParallelLinearImpl(const RowParallelLinearOptions& options)
      : ParallelLayer(options.group(), "RowParallelLinear"), options(options) {
    if (options.sequence_parallel() && !options.input_is_parallel())
      throw InvalidArgument(
          "accel::tp::RowParallelLinear: sequence_parallel needs input_is_parallel (the input is a "
          "ColumnParallelLinear's piece of the last dimension)");
    piece_length(options.in_features(), "in_features", "RowParallelLinear");
    weight = register_parameter(
        "weight", initial_piece({options.out_features(), options.in_features()}, 1, detail::tp::init_linear_weight));
    if (options.bias()) {
      // Whole on every rank: drawn as the whole layer's, so every rank draws the same.
      at::Tensor whole = torch::empty({options.out_features()});
      detail::tp::init_linear_bias(options.in_features())(whole);
      bias = register_parameter("bias", whole);
    }
  }

  // input [..., in_features / tp] (input_is_parallel) or [..., in_features]
  // -> [..., out_features], summed over the group; under sequence_parallel,
  // this rank's piece of sequence_dim.
  at::Tensor forward(const at::Tensor& input) {
    const at::Tensor mine = options.input_is_parallel() ? input : tp::scatter_to_parallel_region(input, group());
    const at::Tensor partial = torch::nn::functional::linear(mine, weight);
    at::Tensor output = options.sequence_parallel()
                            ? tp::reduce_scatter_to_sequence_parallel_region(partial, options.sequence_dim(), group())
                            : tp::reduce_from_parallel_region(partial, group());
    return bias.defined() ? output + bias : output;
  }

  // Loads this rank's columns of a whole weight [out_features, in_features]
  // and the whole bias [out_features] (undefined: left as it is).
  void load_full(const at::Tensor& whole_weight, const at::Tensor& whole_bias = {}) {
    load_piece(weight, whole_weight, 1, {options.out_features(), options.in_features()}, "weight", "RowParallelLinear");
    if (whole_bias.defined()) {
      if (!bias.defined())
        throw InvalidArgument("accel::tp::RowParallelLinear::load_full: a bias was given to a layer without one");
      if (whole_bias.sizes() != bias.sizes())
        throw InvalidArgument("accel::tp::RowParallelLinear::load_full: the bias must have shape " +
                              c10::str(bias.sizes()) + ", got " + detail::describe_tensor(whole_bias));
      const at::NoGradGuard no_grad;
      bias.copy_(whole_bias);
    }
  }

  std::vector<detail::tp::SplitParameter> split_parameters() const override { return {{weight, 1}}; }
  // Under sequence parallelism the bias is added to this rank's tokens only.
  std::vector<at::Tensor> partial_parameters() const override {
    if (options.sequence_parallel() && bias.defined()) return {bias};
    return {};
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "accel::tp::RowParallelLinear(in_features=" << options.in_features()
           << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
           << ", tp=" << tp_size() << ")";
  }

  RowParallelLinearOptions options;
  at::Tensor weight;  // [out_features, in_features / tp]: columns tp_rank() * in / tp onwards
  at::Tensor bias;    // [out_features], whole, or undefined
};
TORCH_MODULE(RowParallelLinear);
}  // namespace tp

ACCEL_NAMESPACE_END
