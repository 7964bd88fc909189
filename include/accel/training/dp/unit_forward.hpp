// accel/training/dp/unit_forward.hpp: accel::unit_forward, the call that runs a FULL_SHARD unit with its parameters gathered.
#pragma once

#include "accel/training/dp/data_parallel.hpp"

ACCEL_NAMESPACE_BEGIN

// FULL_SHARD's unit boundary. LibTorch modules have no forward hooks, so in
// a model's forward a unit is called as
//     x = accel::unit_forward(fc1, x);        // instead of fc1->forward(x)
// which gathers the unit's parameters from their shards, runs its forward
// and frees them (see DataParallel). The same code runs under every
// strategy: a module that is no unit is simply called. On a Sequential that
// is not a unit itself, each child is called in turn, through
// unit_forward. A unit's forward returns one tensor.
template <class ModuleHolder, class... Args>
  requires detail::module_holder<ModuleHolder>
auto unit_forward(ModuleHolder& unit, Args&&... args) {
  return DataParallel::unit_call(
      unit.ptr().get(), [&unit](auto&&... a) { return unit->forward(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}
inline at::Tensor unit_forward(torch::nn::Sequential& sequential, at::Tensor x) {
  if (DataParallel::is_unit(sequential.ptr().get()))
    return DataParallel::unit_call(
        sequential.ptr().get(), [&sequential](const at::Tensor& in) { return sequential->forward(in); }, x);
  for (auto& child : *sequential)
    x = DataParallel::unit_call(child.ptr().get(), [&child](const at::Tensor& in) { return child.forward(in); }, x);
  return x;
}

ACCEL_NAMESPACE_END
