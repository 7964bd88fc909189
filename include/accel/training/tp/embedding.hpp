// accel/training/tp/embedding.hpp: Megatron-core's VocabParallelEmbedding as a torch::nn module.
//
// The table [num_embeddings, embedding_dim] split by rows (the vocabulary)
// over the tensor-parallel group: each rank looks up the tokens in its rows,
// writes zeros for the others, and the pieces are summed over the group
// (all-reduce; under sequence_parallel a reduce-scatter along sequence_dim,
// torchtitan's rowwise embedding with a Shard(1) output). The vocabulary
// must split evenly (pad it, as Megatron does, where it does not).
// A new layer draws the whole table as torch::nn::Embedding does (N(0, 1))
// and keeps its rows; load_full loads the rows of a given whole table. Its
// weight has the shape of a ColumnParallelLinear head's over the same
// vocabulary, so the two can share one tensor (tied embeddings).
#pragma once

#include "accel/training/tp/layer.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// This rank's part of looking up `ids` in a table split by rows: the rows
// of the ids in [vocab_start, vocab_start + rows of `piece`), zeros for the
// rest (the group's sum is the whole lookup). An id outside the vocabulary
// would look up nothing on every rank and give a row of zeros:
// torch::nn::Embedding's error instead. The ids are whole on every rank, so
// the check needs no collective; on a GPU it is asynchronous (a device-side
// assertion, no wait for the values). `padding_idx` (whole-table numbering)
// gets no gradient, as torch::nn::Embedding's.
inline at::Tensor vocab_piece_lookup(const at::Tensor& ids, const at::Tensor& piece, int64_t vocab_start,
                                     int64_t num_embeddings, std::optional<int64_t> padding_idx, const char* who) {
  if (!at::isIntegralType(ids.scalar_type(), /*includeBool=*/false))
    throw InvalidArgument(std::string("accel::tp::") + who + ": token ids must be integers, got " +
                          describe_tensor(ids));
  if (ids.numel() > 0)
    require_valid_ids(ids.ge(0).logical_and(ids.lt(num_embeddings)).all(), [&] {
      return std::string("accel::tp::") + who + ": token ids must lie in [0, " + std::to_string(num_embeddings) +
             "), got ids from " + std::to_string(ids.min().item<int64_t>()) + " to " +
             std::to_string(ids.max().item<int64_t>());
    });
  const int64_t rows = piece.size(0);
  const at::Tensor outside = ids.lt(vocab_start).logical_or(ids.ge(vocab_start + rows));
  const at::Tensor local = (ids - vocab_start).masked_fill(outside, 0);
  const bool pads_here = padding_idx && *padding_idx >= vocab_start && *padding_idx < vocab_start + rows;
  // (torch::embedding itself: GCC 14's -Wmaybe-uninitialized misfires on EmbeddingFuncOptions' copies)
  return torch::embedding(piece, local, pads_here ? *padding_idx - vocab_start : -1)
      .masked_fill(outside.unsqueeze(-1), 0);
}
}  // namespace detail::tp

namespace tp {
struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // the whole vocabulary; each rank holds num_embeddings / tp rows
  TORCH_ARG(int64_t, embedding_dim);
  // Reduce-scatter the output along sequence_dim instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(GroupPtr, group) = {};  // null: the process's Dim::TP group
};

class VocabParallelEmbeddingImpl : public torch::nn::Module, public detail::tp::ParallelLayer {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options)
      : ParallelLayer(options.group(), "VocabParallelEmbedding"), options(options) {
    const int64_t rows = piece_length(options.num_embeddings(), "num_embeddings", "VocabParallelEmbedding");
    vocab_start_ = tp_rank() * rows;
    weight = register_parameter("weight", initial_piece({options.num_embeddings(), options.embedding_dim()}, 0,
                                                        [](at::Tensor& t) { torch::nn::init::normal_(t); }));
  }

  // token ids [...] (integers in [0, num_embeddings); whole on every rank)
  // -> [..., embedding_dim], summed over the group; under sequence_parallel,
  // this rank's piece of sequence_dim.
  at::Tensor forward(const at::Tensor& ids) {
    const at::Tensor mine = detail::tp::vocab_piece_lookup(ids, weight, vocab_start_, options.num_embeddings(),
                                                           std::nullopt, "VocabParallelEmbedding");
    return options.sequence_parallel()
               ? tp::reduce_scatter_to_sequence_parallel_region(mine, options.sequence_dim(), group())
               : tp::reduce_from_parallel_region(mine, group());
  }

  // Loads this rank's rows of a whole table [num_embeddings, embedding_dim].
  void load_full(const at::Tensor& whole_weight) {
    load_piece(weight, whole_weight, 0, {options.num_embeddings(), options.embedding_dim()}, "weight",
               "VocabParallelEmbedding");
  }
  int64_t vocab_start() const { return vocab_start_; }  // the first row this rank holds
  std::vector<detail::tp::SplitParameter> split_parameters() const override { return {{weight, 0}}; }

  void pretty_print(std::ostream& stream) const override {
    stream << "accel::tp::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
           << ", embedding_dim=" << options.embedding_dim() << ", tp=" << tp_size() << ")";
  }

  VocabParallelEmbeddingOptions options;
  at::Tensor weight;  // [num_embeddings / tp, embedding_dim]

 private:
  int64_t vocab_start_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);
}  // namespace tp

ACCEL_NAMESPACE_END
