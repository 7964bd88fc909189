// accel/training/dp/unit_forward.hpp: accel::unit_forward, the call that runs a FULL_SHARD unit with its parameters gathered and a styled module with its tensor-parallel style.
#pragma once

#include "accel/training/dp/data_parallel.hpp"
#include "accel/training/tp/styled_forward.hpp"

ACCEL_NAMESPACE_BEGIN

// The call that stands for a forward hook. LibTorch modules have none, so
// in a model's forward a module that FULL_SHARD makes a unit, or that a
// tensor-parallel plan styles (tp::parallelize_module), is called as
//     x = accel::unit_forward(fc1, x);        // instead of fc1->forward(x)
// which gathers the unit's parameters from their shards, runs its forward
// and frees them (see DataParallel), and applies the module's parallel
// style (tp/styled_forward.hpp): its input moved to the layout the style
// needs before the unit, the pieces computed inside it (FSDP + TP: a
// styled Linear may be a unit of its own). The same code runs under every
// strategy and plan: any other module is simply called. On a Sequential
// that is not a unit itself, each child is called in turn, through
// unit_forward. A unit's forward returns one tensor.
template <class ModuleHolder, class... Args>
  requires detail::module_holder<ModuleHolder>
auto unit_forward(ModuleHolder& unit, Args&&... args) {
  const torch::nn::Module* module = unit.ptr().get();
  return detail::tp::styled_forward(
      *unit.ptr(),
      [module](auto&& fn, auto&&... a) {
        return DataParallel::unit_call(module, std::forward<decltype(fn)>(fn), std::forward<decltype(a)>(a)...);
      },
      [&unit](auto&&... a) { return unit->forward(std::forward<decltype(a)>(a)...); }, std::forward<Args>(args)...);
}
inline at::Tensor unit_forward(torch::nn::Sequential& sequential, at::Tensor x) {
  if (DataParallel::is_unit(sequential.ptr().get()))
    return DataParallel::unit_call(
        sequential.ptr().get(), [&sequential](const at::Tensor& in) { return sequential->forward(in); }, x);
  for (auto& child : *sequential) {
    const torch::nn::Module* module = child.ptr().get();
    x = detail::tp::styled_forward(
        *child.ptr(), [module](auto&& fn, const at::Tensor& in) { return DataParallel::unit_call(module, fn, in); },
        [&child](const at::Tensor& in) { return child.forward(in); }, x);
  }
  return x;
}

ACCEL_NAMESPACE_END
