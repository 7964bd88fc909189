// accel/training/tp/styles.hpp: torch's parallel styles (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput) and the layouts they name, as plain values for a plan.
//
// A plan (tp::parallelize_module) maps submodule names to styles. The fields
// and defaults are torch.distributed.tensor.parallel's:
//   ColwiseParallel{.input_layouts = Replicate(), .output_layouts = Shard(-1)}
//   RowwiseParallel{.input_layouts = Shard(-1), .output_layouts = Replicate()}
//   SequenceParallel{.sequence_dim = 1}
//   PrepareModuleInput{.input_layouts = {...}, .desired_input_layouts = {...}}
// A layout says how an activation lies over the tensor-parallel group:
// whole on every rank (Replicate) or split into equal pieces along a
// dimension (Shard). LibTorch has no DTensor, so every style hands on this
// rank's local tensor (torch's use_local_output=True); the next style's
// input_layouts says what that tensor is.
#pragma once

#include "accel/training/torch_nn.hpp"

#include <variant>

ACCEL_NAMESPACE_BEGIN

namespace tp {
// Whole on every rank of the group.
struct Replicate {
  bool operator==(const Replicate&) const = default;
};
// This rank's equal piece along `dim` (negative: from the end).
struct Shard {
  int64_t dim = 0;
  bool operator==(const Shard&) const = default;
};
using Layout = std::variant<Replicate, Shard>;

// A Linear's weight rows (out_features) split, its bias too: the output is
// this rank's piece of the last dimension. An Embedding's columns
// (embedding_dim) split. The input is all-gathered first where it is
// sharded (input_layouts = Shard(1): sequence parallelism's all-gather);
// output_layouts = Replicate() all-gathers the output's pieces.
struct ColwiseParallel {
  Layout input_layouts = Replicate{};
  Layout output_layouts = Shard{-1};
};
// A Linear's weight columns (in_features) split, its bias whole and added
// after the sum: the input is this rank's piece of the last dimension, the
// partial products summed over the group (output_layouts = Shard(1):
// reduce-scattered along the sequence instead). An Embedding's rows (the
// vocabulary) split: each rank looks up its rows and the pieces are summed.
struct RowwiseParallel {
  Layout input_layouts = Shard{-1};
  Layout output_layouts = Replicate{};
};
// A module whose parameters stay whole (a norm, dropout) run on this rank's
// piece of the sequence: its parameters' gradients leave the backward
// partial, and tp::all_reduce_sequence_parallel_gradients sums them.
struct SequenceParallel {
  int64_t sequence_dim = 1;
};
// The module's positional tensor inputs moved from input_layouts[i] to
// desired_input_layouts[i] before its forward (an empty entry: left as it
// is): attention's input all-gathered along the sequence, torchtitan's
// PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)).
struct PrepareModuleInput {
  std::vector<std::optional<Layout>> input_layouts;
  std::vector<std::optional<Layout>> desired_input_layouts;
};
using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput>;
}  // namespace tp

namespace detail::tp {
inline std::string describe(const accel::tp::Layout& layout) {
  if (const auto* shard = std::get_if<accel::tp::Shard>(&layout)) return "Shard(" + std::to_string(shard->dim) + ")";
  return "Replicate()";
}
inline const char* style_name(const accel::tp::ParallelStyle& style) {
  static constexpr const char* names[] = {"ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                                          "PrepareModuleInput"};
  return names[style.index()];
}
// The dimension a layout splits, wrapped for a tensor of `rank` dimensions (none: Replicate).
inline std::optional<int64_t> shard_dim(const accel::tp::Layout& layout, int64_t rank) {
  const auto* shard = std::get_if<accel::tp::Shard>(&layout);
  if (!shard) return std::nullopt;
  return shard->dim < 0 ? shard->dim + rank : shard->dim;
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END
