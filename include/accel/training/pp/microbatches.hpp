// accel/training/pp/microbatches.hpp: a batch cut into a pipeline's micro-batches along its first dimension, and the last stage's outputs put back together.
//
// torch's schedules cut step()'s inputs and target with
// split_args_kwargs_into_chunks (torch.tensor_split along dimension 0) and
// merge the last stage's outputs with torch.cat. torch.tensor_split accepts
// a batch that does not divide evenly and makes micro-batches of two sizes;
// here that is an error naming the numbers, before anything is sent: every
// micro-batch of a step has one shape, so a stage's activation can be
// received into a buffer sized once per step (training/pp/messages.hpp),
// and the loss of each micro-batch weighs the same in the step's mean
// (docs/differences.md).
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
inline std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int microbatches, const char* what) {
  if (!batch.defined())
    throw InvalidArgument(std::string("accel::pp: step() needs the ") + what +
                          " here (this rank holds the pipeline's " +
                          (std::string_view(what) == "inputs" ? "first" : "last") + " stage)");
  if (batch.dim() == 0 || batch.size(0) % microbatches != 0 || batch.size(0) == 0)
    throw InvalidArgument(std::string("accel::pp: the ") + what + "' batch of " +
                          (batch.dim() == 0 ? std::string("a 0-dimensional tensor") : std::to_string(batch.size(0))) +
                          " rows does not cut into " + std::to_string(microbatches) +
                          " micro-batches of equal size (dimension 0 must be a positive multiple of " +
                          std::to_string(microbatches) + ")");
  return batch.chunk(microbatches, 0);
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END
