// accel/distributed/torch.hpp: feature detection and the LibTorch headers the collectives need.
#pragma once

#include "accel/core/config.hpp"

// c10d's ProcessGroupGloo.hpp declares nothing unless USE_C10D_GLOO is
// defined; LibTorch itself is built with it, so a program only has to see the
// Gloo headers (Debian: libgloo-dev; PyPI's wheels ship none). Gloo's types
// are reached only through pointers here, so the headers of a Gloo version
// other than the one inside LibTorch will do (the pip leg uses Debian's).
// Whether the gloo backend is compiled follows the headers (ACCEL_HAS_GLOO),
// not that macro: some LibTorch packages (torch 2.11's CMake config) define
// it for every consumer, though their wheels ship no Gloo headers.
#if __has_include(<gloo/algorithm.h>)
#define ACCEL_HAS_GLOO 1
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#else
#define ACCEL_HAS_GLOO 0
#endif

// ProcessGroupNCCL.hpp declares nothing unless USE_C10D_NCCL is defined. Its
// inclusion follows ACCEL_WITH_NCCL, not that macro: some LibTorch packages
// (torch 2.11's CMake config) define it for every consumer, also where the
// CUDA headers it pulls in cannot compile (ACCEL_WITH_NCCL=0).
#if ACCEL_WITH_NCCL && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL 1
#endif

// Debian installs torch/version.h under the C++ API's own include root.
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#elif __has_include(<torch/csrc/api/include/torch/version.h>)
#include <torch/csrc/api/include/torch/version.h>
#else
#error "accel.hpp: cannot find LibTorch's torch/version.h"
#endif

#define ACCEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <ATen/core/ivalue.h>
#include <c10/macros/Export.h>
#if ACCEL_HAS_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if ACCEL_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

// LibTorch's pickler (the format of torch.save), declared here exactly as
// torch/csrc/jit/serialization/pickle.h declares it in 1.13 and 2.x: that
// header pulls in the whole pickler and unpickler, about 40% of ATen's own
// compile time at -O2, for these two functions.
namespace torch {
namespace jit {
TORCH_API std::vector<char> pickle_save(const c10::IValue& ivalue);
TORCH_API c10::IValue pickle_load(const std::vector<char>& data);
}  // namespace jit
}  // namespace torch

ACCEL_NAMESPACE_BEGIN

using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

ACCEL_NAMESPACE_END
