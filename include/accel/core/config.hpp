// accel/core/config.hpp: compile-time knobs, the environment's names, the ABI namespace.
//
// Compile-time knobs (define before including accel.hpp):
//   ACCEL_DEFAULT_TIMEOUT_SECONDS  timeout of the store and of every process
//                                  group when DistributedConfig says nothing
//                                  else (default 18000, as LLaMA-Factory).
//   ACCEL_WITH_NCCL                1 or 0 to force the NCCL path on or off;
//                                  by default it is on exactly when LibTorch
//                                  is a CUDA build and <nccl.h> is visible.
//   ACCEL_TRAINING                 also compile the training helpers
//                                  (Accelerator, DataParallel), which need
//                                  torch::nn and so <torch/torch.h>.
//   ACCEL_CORE_ONLY                stop before everything that needs LibTorch:
//                                  enums, environment and strategy validation
//                                  only, for tools that do not link LibTorch.
//
// Run-time environment:
//   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE   torchrun's contract
//   MASTER_ADDR, MASTER_PORT   rendezvous (a c10d::TCPStore served by rank 0;
//                              defaults 127.0.0.1 and 29500)
//   TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT   set by torchrun:
//                              its agent serves the store, every rank connects
//   USE_LIBUV                  0/1: LibTorch >= 2.4's libuv TCPStore server
//                              (default: on where the build has libuv)
//   ACCEL_DEVICE               cpu|cuda|mps|xpu|npu|meta: force the device
//   ACCEL_BACKEND              gloo|nccl: force the process-group backend
//   GLOO_SOCKET_IFNAME         network interface(s) for Gloo, comma-separated
//   ACCEL_DEBUG_MODE           1/0, true/false, yes/no, on/off: every collective
//                              first checks that all ranks made the same call
//   ACCEL_TIMEOUT              seconds: the default DistributedConfig::timeout
//   ACCEL_STORE_DIR            a private directory (0700): when every rank is
//                              local, rendezvous in a c10d::FileStore there
//                              (accel::spawn and accel_launch set it)
//   Without RANK, the first complete set of Open MPI (OMPI_COMM_WORLD_*),
//   MPICH/Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS),
//   MVAPICH (MV2_COMM_WORLD_*) or Slurm (SLURM_PROCID, SLURM_NTASKS,
//   SLURM_LOCALID, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE).
#pragma once

#include "accel/core/version.hpp"

#ifndef ACCEL_DEFAULT_TIMEOUT_SECONDS
#define ACCEL_DEFAULT_TIMEOUT_SECONDS 18000
#endif
// cuda_cmake_macros.h is generated only by CUDA builds of LibTorch, so CPU
// packages that ship the c10/cuda headers anyway are not mistaken for CUDA.
#ifndef ACCEL_WITH_NCCL
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>) && __has_include(<nccl.h>)
#define ACCEL_WITH_NCCL 1
#else
#define ACCEL_WITH_NCCL 0
#endif
#endif

// The knobs change inline bodies, so they are part of every name's linkage:
// everything lives in an inline namespace named after the version and the
// configuration (as json.hpp's ABI tags). Two translation units configured
// differently then link to different functions instead of silently sharing
// one body (each has its own DistributedInterface, too: configure alike).
// ACCEL_DEFAULT_TIMEOUT_SECONDS must therefore be an integer literal.
#define ACCEL_ABI_NAME_(major, minor, patch, timeout, nccl) abi_v##major##_##minor##_##patch##_t##timeout##_nccl##nccl
#define ACCEL_ABI_NAME(major, minor, patch, timeout, nccl) ACCEL_ABI_NAME_(major, minor, patch, timeout, nccl)
#define ACCEL_ABI_NAMESPACE                                                                                    \
  ACCEL_ABI_NAME(ACCEL_VERSION_MAJOR, ACCEL_VERSION_MINOR, ACCEL_VERSION_PATCH, ACCEL_DEFAULT_TIMEOUT_SECONDS, \
                 ACCEL_WITH_NCCL)
#define ACCEL_NAMESPACE_BEGIN \
  namespace accel {           \
  inline namespace ACCEL_ABI_NAMESPACE {
#define ACCEL_NAMESPACE_END \
  }                         \
  }

#if __cplusplus < 202002L
#error "accel.hpp needs C++20 (-std=c++20)"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#endif
