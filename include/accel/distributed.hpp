// accel/distributed.hpp: everything but the training helpers: devices, the
// collectives, Work, rendezvous and groups, meshes, DistributedInterface,
// Accelerate's operations, objects, process control, reproducibility. Needs
// LibTorch's ATen and c10d headers, never <torch/torch.h>. accel.hpp is the
// same, in one file.
//
// tools/amalgamate.py inlines the parts into accel.hpp each after the parts
// it includes, else in this order.
#pragma once

#include "accel/core.hpp"

// ACCEL_HPP_TORCH: set by accel.hpp too, so that including both forms in one
// translation unit, in either order, defines everything once.
#ifndef ACCEL_HPP_TORCH
#define ACCEL_HPP_TORCH

#include "accel/distributed/torch.hpp"
#include "accel/distributed/devices.hpp"
#include "accel/distributed/concepts.hpp"
#include "accel/distributed/issue.hpp"
#include "accel/distributed/pending.hpp"
#include "accel/distributed/staging.hpp"
#include "accel/distributed/start_gather.hpp"
#include "accel/distributed/start_reduce.hpp"
#include "accel/distributed/start_broadcast.hpp"
#include "accel/distributed/pieces.hpp"
#include "accel/distributed/debug_check.hpp"
#include "accel/distributed/registration.hpp"
#include "accel/distributed/work.hpp"
#include "accel/distributed/collectives.hpp"
#include "accel/distributed/all_to_all.hpp"
#include "accel/distributed/direct_all_reduce.hpp"
#include "accel/distributed/exchange.hpp"
#include "accel/distributed/backends.hpp"
#include "accel/distributed/rendezvous.hpp"
#include "accel/distributed/make_groups.hpp"
#include "accel/distributed/mesh.hpp"
#include "accel/distributed/world.hpp"
#include "accel/distributed/interface.hpp"
#include "accel/distributed/nested.hpp"
#include "accel/distributed/operations.hpp"
#include "accel/distributed/objects.hpp"
#include "accel/distributed/process_control.hpp"
#include "accel/distributed/reproducibility.hpp"

#endif  // ACCEL_HPP_TORCH
