// accel/training/precision/policy.hpp: MixedPrecisionPolicy: the dtypes fully sharded units compute and reduce in, as FSDP2's.
//
// FSDP2's MixedPrecisionPolicy (fully_shard's mp_policy; Accelerate's
// FullyShardedDataParallelPlugin.mixed_precision_policy). The parameters,
// their shards, gradients and optimizer state keep their own dtype (fp32
// masters); what changes is what travels and computes:
// - param_dtype: each unit's parameters are all-gathered in this dtype (half
//   the bytes of fp32 for bf16) and hold it while the unit runs, so its
//   forward and backward compute in it; between units and between steps the
//   parameters are at rest in their own dtype.
// - reduce_dtype: the gradients are reduce-scattered in this dtype, then
//   added to the shards' gradients in theirs. Unset: param_dtype, as FSDP2
//   (set it to the parameters' dtype, e.g. kFloat, for full-precision
//   reductions).
// - output_dtype: a unit's floating-point output is cast to this dtype
//   (FSDP2's output_dtype). Unset: it stays in the dtype the unit computed
//   in.
// - cast_forward_inputs: a unit's floating-point input tensors are cast to
//   the dtype its parameters hold (FSDP2's default).
// It applies to the units of FULL_SHARD and HYBRID_SHARD. Parameters in no
// unit (the root's own, a tied weight, which FSDP2 keeps in the root's
// group) are whole while the model runs and compute in their own dtype, as
// under FSDP2 a root given no policy of its own: a module there that meets
// a unit's bf16 output (GPT-2's tied head after the last unit) needs
// output_dtype = at::kFloat, or a cast of its own. The gradients of every
// parameter are reduced in reduce_dtype. Elsewhere mixed precision is
// mixed_precision = "bf16" (autocast). Where nothing is sharded (one
// process, mp_shard_size == 1) there is no gather to cast in, and the model
// trains in its own dtype.
#pragma once

#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype{};
  std::optional<c10::ScalarType> reduce_dtype{};
  std::optional<c10::ScalarType> output_dtype{};
  bool cast_forward_inputs = true;

  // Whether it changes anything (a dtype set).
  bool active() const { return param_dtype.has_value() || reduce_dtype.has_value() || output_dtype.has_value(); }
};

ACCEL_NAMESPACE_END
