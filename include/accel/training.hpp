// accel/training.hpp: all of accel, with the training helpers (autograd-aware
// collectives, DataParallel and its ZeRO-2/ZeRO-3 sharding, data loading,
// checkpoints, safetensors, the Accelerator), which include <torch/torch.h>.
// accel.hpp with ACCEL_TRAINING defined is the same, in one file.
//
// The parts are listed in dependency order: tools/amalgamate.py inlines them
// into accel.hpp in this order and fails if a part includes a later one.
#pragma once

#include "accel/distributed.hpp"

// ACCEL_HPP_TRAINING: set by accel.hpp too, so that including both forms in one
// translation unit, in either order, defines everything once.
#ifndef ACCEL_HPP_TRAINING
#define ACCEL_HPP_TRAINING

#include "accel/training/torch_nn.hpp"
#include "accel/training/parameters.hpp"
#include "accel/training/autograd.hpp"
#include "accel/training/comm_hooks.hpp"
#include "accel/training/mixed_precision.hpp"
#include "accel/training/buckets.hpp"
#include "accel/training/dp_buffers.hpp"
#include "accel/training/dp_state.hpp"
#include "accel/training/dp_scatter.hpp"
#include "accel/training/dp_reducer.hpp"
#include "accel/training/dp_units.hpp"
#include "accel/training/dp_shards.hpp"
#include "accel/training/data_parallel.hpp"
#include "accel/training/sampler.hpp"
#include "accel/training/dispatch.hpp"
#include "accel/training/loaders.hpp"
#include "accel/training/grad_scaler.hpp"
#include "accel/training/fused_adam.hpp"
#include "accel/training/config.hpp"
#include "accel/training/file_digest.hpp"
#include "accel/training/checked_file.hpp"
#include "accel/training/checkpoint_files.hpp"
#include "accel/training/safetensors.hpp"
#include "accel/training/prepared.hpp"
#include "accel/training/checkpoint_reshard.hpp"
#include "accel/training/checkpoint_world.hpp"
#include "accel/training/checkpoint_shards.hpp"
#include "accel/training/checkpoint_state.hpp"
#include "accel/training/join.hpp"
#include "accel/training/trackers.hpp"
#include "accel/training/weights.hpp"
#include "accel/training/autocast.hpp"
#include "accel/training/checkpoint.hpp"
#include "accel/training/accelerator_setup.hpp"
#include "accel/training/accelerator_preparing.hpp"
#include "accel/training/process_operations.hpp"
#include "accel/training/accelerator.hpp"

#endif  // ACCEL_HPP_TRAINING
