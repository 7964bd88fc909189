// accel/training/torch_nn.hpp: the LibTorch headers the training helpers need (<torch/torch.h>).
#pragma once

#include "accel/distributed/torch.hpp"

// GCC 14 at -O2/-O3 warns (-Warray-bounds, -Wstringop-overflow) inside
// LibTorch's own autograd::Function::apply (a std::vector<bool>::reserve it
// inlines), which accel::autograd instantiates: false positives in LibTorch's
// header that would fail a -Werror build. Ignored for LibTorch's headers only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>  // (zero bubble's W: training/pp/split_backward.hpp)
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <bit>
#include <cctype>
#include <cmath>
#include <cstdio>  // renameat2
#include <filesystem>
#include <set>
#include <unistd.h>

ACCEL_NAMESPACE_BEGIN
namespace detail {
// A LibTorch module holder (torch::nn::Linear, a TORCH_MODULE of yours): what
// the Accelerator takes as a model.
template <class M>
concept module_holder = requires(M& m) { m.ptr(); };
}  // namespace detail
ACCEL_NAMESPACE_END
