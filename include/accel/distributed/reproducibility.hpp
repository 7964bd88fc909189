// accel/distributed/reproducibility.hpp: set_seed and synchronize_rng_states.
#pragma once

#include "accel/distributed/collectives.hpp"
#include "accel/distributed/operations.hpp"

ACCEL_NAMESPACE_BEGIN

// Seeds C's rand() and LibTorch's default generators (CPU and every CUDA
// device); with device_specific the seed is offset by the global rank.
// Returns the seed used.
inline uint64_t set_seed(uint64_t seed, bool device_specific = false) {
  if (device_specific) seed += static_cast<uint64_t>(get_rank());
  std::srand(static_cast<unsigned>(seed));
  auto seed_generator = [seed](at::Generator generator) {
    std::lock_guard lock(generator.mutex());
    generator.set_current_seed(seed);
  };
  seed_generator(at::detail::getDefaultCPUGenerator());
  for (int i = 0; i < detail::guard_device_count(c10::DeviceType::CUDA); ++i)
    seed_generator(
        at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i))));
  return seed;
}

namespace detail {
inline void synchronize_generator(at::Generator generator, const GroupPtr& group) {
  at::Tensor state;
  {
    std::lock_guard lock(generator.mutex());
    state = generator.get_state();
  }
  state = broadcast(std::move(state), 0, group);
  std::lock_guard lock(generator.mutex());
  generator.set_state(state);
}
}  // namespace detail

// Copies rank 0's random-generator states to every rank of the group:
// "torch" (LibTorch's CPU generator), "cuda" (the current CUDA device's),
// "generator" (the one passed). No types: "torch", plus "cuda" when a CUDA
// device is present.
inline void synchronize_rng_states(const std::vector<std::string>& rng_types = {},
                                   std::optional<at::Generator> generator = std::nullopt, const GroupPtr& group = {}) {
  std::vector<std::string> types = rng_types;
  if (types.empty()) {
    types.push_back("torch");
    if (is_torch_cuda_available()) types.push_back("cuda");
  }
  for (const auto& type : types) {
    if (type == "torch") {
      detail::synchronize_generator(at::detail::getDefaultCPUGenerator(), group);
    } else if (type == "cuda") {
      if (!is_torch_cuda_available())
        throw InvalidArgument("accel::synchronize_rng_states: \"cuda\" asked for, but no CUDA device is available");
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      detail::synchronize_generator(at::globalContext().defaultGenerator(impl->getDevice()), group);
    } else if (type == "generator") {
      if (!generator)
        throw InvalidArgument("accel::synchronize_rng_states: \"generator\" asked for, but no generator passed");
      detail::synchronize_generator(*generator, group);
    } else {
      throw InvalidArgument("accel::synchronize_rng_states: unknown rng type '" + type +
                            "' (expected \"torch\", \"cuda\" or \"generator\")");
    }
  }
}

ACCEL_NAMESPACE_END
