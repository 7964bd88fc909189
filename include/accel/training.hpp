// accel/training.hpp: all of accel, with the training helpers (autograd-aware
// collectives, DataParallel and its ZeRO-2/ZeRO-3 sharding, data loading,
// checkpoints, safetensors, the Accelerator), which include <torch/torch.h>.
// accel.hpp with ACCEL_TRAINING defined is the same, in one file.
//
// Every part is listed, by family (folder); tools/amalgamate.py inlines them
// into accel.hpp each after the parts it includes, else in this order.
#pragma once

#include "accel/distributed.hpp"

// ACCEL_HPP_TRAINING: set by accel.hpp too, so that including both forms in one
// translation unit, in either order, defines everything once.
#ifndef ACCEL_HPP_TRAINING
#define ACCEL_HPP_TRAINING

// the tier's base: LibTorch, a module's parameters, the Accelerator's configuration, activation checkpointing,
// facts kept beside tensors and modules
#include "accel/training/torch_nn.hpp"
#include "accel/training/parameters.hpp"
#include "accel/training/accelerator_config.hpp"
#include "accel/training/recompute.hpp"
#include "accel/training/weak_keyed_map.hpp"

// autograd-aware collectives (tensor and context parallelism)
#include "accel/training/parallel/autograd.hpp"

// tensor parallelism: Megatron's region mappings and layers, the vocabulary-parallel loss
#include "accel/training/tp/regions.hpp"
#include "accel/training/tp/layer.hpp"
#include "accel/training/tp/linear.hpp"
#include "accel/training/tp/embedding.hpp"
#include "accel/training/tp/cross_entropy.hpp"
#include "accel/training/tp/dropout.hpp"
#include "accel/training/tp/styles.hpp"
#include "accel/training/tp/registry.hpp"
#include "accel/training/tp/pieces.hpp"
#include "accel/training/tp/sequence_parallel.hpp"
#include "accel/training/tp/styled_forward.hpp"
#include "accel/training/tp/plan.hpp"
#include "accel/training/pp/microbatches.hpp"
#include "accel/training/pp/messages.hpp"
#include "accel/training/pp/split_backward.hpp"
#include "accel/training/pp/stage.hpp"
#include "accel/training/pp/runtime.hpp"
#include "accel/training/pp/shape_check.hpp"
#include "accel/training/pp/schedules.hpp"

// precision: autocast, the loss scaler, FSDP2's MixedPrecisionPolicy
#include "accel/training/precision/autocast.hpp"
#include "accel/training/precision/grad_scaler.hpp"
#include "accel/training/precision/policy.hpp"

// optimizers
#include "accel/training/optim/fused_adam.hpp"

// data: the sampler, the loaders' shared state, dispatching batches, prepared loaders
#include "accel/training/data/sampler.hpp"
#include "accel/training/data/loader_state.hpp"
#include "accel/training/data/dispatch.hpp"
#include "accel/training/data/loaders.hpp"

// data parallelism: DataParallel and its ZeRO-2/ZeRO-3 engine, joins
#include "accel/training/dp/comm_hooks.hpp"
#include "accel/training/dp/buckets.hpp"
#include "accel/training/dp/buffers.hpp"
#include "accel/training/dp/timeline.hpp"
#include "accel/training/dp/strategy.hpp"
#include "accel/training/dp/state.hpp"
#include "accel/training/dp/chunks.hpp"
#include "accel/training/dp/scatter.hpp"
#include "accel/training/dp/reducer.hpp"
#include "accel/training/dp/unit_plan.hpp"
#include "accel/training/dp/unit_params.hpp"
#include "accel/training/dp/units.hpp"
#include "accel/training/dp/shards.hpp"
#include "accel/training/dp/sharded_state_dict.hpp"
#include "accel/training/dp/strategies.hpp"
#include "accel/training/dp/data_parallel.hpp"
#include "accel/training/dp/unit_forward.hpp"
#include "accel/training/accelerator/join.hpp"

// files: JSON, XXH64 digests, checked writes, safetensors
#include "accel/training/io/json.hpp"
#include "accel/training/io/file_digest.hpp"
#include "accel/training/io/checked_file.hpp"
#include "accel/training/io/safetensors.hpp"

// checkpoints and exported weights
#include "accel/training/checkpoint/file_names.hpp"
#include "accel/training/checkpoint/prepared.hpp"
#include "accel/training/checkpoint/manifest.hpp"
#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/world.hpp"
#include "accel/training/checkpoint/optimizer_slots.hpp"
#include "accel/training/checkpoint/reshard.hpp"
#include "accel/training/checkpoint/optimizer_from_pieces.hpp"
#include "accel/training/checkpoint/shards.hpp"
#include "accel/training/checkpoint/sharded_weights.hpp"
#include "accel/training/checkpoint/context.hpp"
#include "accel/training/checkpoint/item.hpp"
#include "accel/training/checkpoint/model_items.hpp"
#include "accel/training/checkpoint/state_items.hpp"
#include "accel/training/checkpoint/from_python.hpp"
#include "accel/training/checkpoint/weights.hpp"
#include "accel/training/checkpoint/pipeline_weights.hpp"
#include "accel/training/checkpoint/state.hpp"

// the Accelerator
#include "accel/training/accelerator/trackers.hpp"
#include "accel/training/accelerator/setup.hpp"
#include "accel/training/accelerator/accelerator.hpp"
#include "accel/training/accelerator/properties.hpp"
#include "accel/training/accelerator/preparing.hpp"
#include "accel/training/accelerator/training_step.hpp"
#include "accel/training/accelerator/process_operations.hpp"
#include "accel/training/accelerator/checkpoints.hpp"

#endif  // ACCEL_HPP_TRAINING
