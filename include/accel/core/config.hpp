// accel/core/config.hpp: compile-time knobs, the environment's names, the ABI namespace.
//
// The compile-time knobs (macros defined before including accel.hpp) and
// the environment variables read at run time are listed, each with its
// meaning, in one table: README.md, "Configuration". The macros' defaults
// are set below.
#pragma once

#include "accel/core/version.hpp"

// Timeout of the store and of every group when DistributedConfig says nothing
// else (LLaMA-Factory's).
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
#include <set>
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
