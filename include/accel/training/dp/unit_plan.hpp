// accel/training/dp/unit_plan.hpp: ZeRO-3's units planned: which unit holds each parameter, the registry accel::unit_forward finds a unit in, the policy's dtypes, the names a read at rest reports.
//
// FULL_SHARD's units hold no parameter memory at rest (dp/unit_params.hpp
// gathers and frees it, dp/units.hpp runs a unit). This part is what is
// decided once, in DataParallel's constructor: every module that is a unit,
// the parameters each holds (a tied one belongs to the unit holding every
// module that registers it, else to the root), and what a MixedPrecisionPolicy
// changes.
#pragma once

#include "accel/training/dp/state.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
using Registry = std::unordered_map<const torch::nn::Module*, std::pair<std::weak_ptr<State>, std::size_t>>;
inline Registry& unit_registry() {
  static Registry units;  // every live DataParallel's units, for accel::unit_forward
  return units;
}
inline std::mutex& unit_registry_mutex() {
  static std::mutex mutex;
  return mutex;
}
// The live DataParallel state whose unit `module` is, and the unit's index (null: no unit).
inline std::pair<std::shared_ptr<State>, std::size_t> find_unit(const torch::nn::Module* module) {
  std::lock_guard lock(unit_registry_mutex());
  const auto found = unit_registry().find(module);
  if (found == unit_registry().end()) return {nullptr, 0};
  return {found->second.first.lock(), found->second.second};
}

// For DataParallel's constructor: which unit each of `params` (each tensor
// once) belongs to (-1: none), with state.units made for the units that
// hold a parameter. A parameter belongs to the unit whose modules include
// every module that registers it. One registered outside units too, or in
// two of them (a tied weight: GPT-2's token embedding and its head), belongs
// to none: it is sharded as the root's own parameters are (whole while the
// model runs, ZeRO-2's way), so every module that reads it finds its values,
// as FSDP2 keeps a tied weight in the root's group. Errors name the
// parameter or unit: units inside units, and a unit's parameter that shares
// its storage with another (it cannot be freed alone). A unit's parameter
// that is a view of a larger tensor gets a storage of its own (below).
// For assign_units: the unit (an index into `units`) each parameter of
// `module` belongs to, over every module that registers it; -1 for none.
inline std::unordered_map<const c10::TensorImpl*, int64_t> unit_of_parameters(
    const torch::nn::Module& module, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
    std::unordered_map<const torch::nn::Module*, std::string>& name_of) {
  std::unordered_set<const torch::nn::Module*> chosen;
  for (const auto& unit : units) chosen.insert(unit.get());
  // The unit each module lies in; -1 where a module lies in two (shared by both).
  std::unordered_map<const torch::nn::Module*, int64_t> unit_of_module;
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const auto& inner : units[u]->modules(/*include_self=*/false))
      if (chosen.count(inner.get()))
        throw InvalidArgument("accel::DataParallel: the fully sharded unit '" + name_of[inner.get()] +
                              "' lies inside the unit '" + name_of[units[u].get()] +
                              "'; units must not nest (auto_wrap_policy: a unit's own submodules are not asked)");
    for (const auto& inner : units[u]->modules(/*include_self=*/true)) {
      const auto [at, fresh] = unit_of_module.emplace(inner.get(), static_cast<int64_t>(u));
      if (!fresh && at->second != static_cast<int64_t>(u)) at->second = -1;
    }
  }
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  for (const auto& named : module.named_modules()) {
    const auto found = unit_of_module.find(named.value().get());
    const int64_t u = found == unit_of_module.end() ? -1 : found->second;
    for (const auto& p : named.value()->parameters(/*recurse=*/false)) {
      const auto [at, fresh] = owner.emplace(p.unsafeGetTensorImpl(), u);
      if (!fresh && at->second != u) at->second = -1;
    }
  }
  return owner;
}

inline std::vector<int64_t> assign_units(State& state, const torch::nn::Module& module,
                                         const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                         const std::vector<at::Tensor>& params) {
  std::unordered_map<const torch::nn::Module*, std::string> name_of;
  for (const auto& named : module.named_modules()) name_of.emplace(named.value().get(), named.key());
  const auto owner = unit_of_parameters(module, units, name_of);
  // Units that hold a parameter, numbered in the order given.
  std::vector<int64_t> renumbered(units.size(), -1);
  for (const auto& p : params) {
    const int64_t u = owner.at(p.unsafeGetTensorImpl());
    if (u >= 0) renumbered[static_cast<std::size_t>(u)] = 0;
  }
  for (std::size_t u = 0; u < units.size(); ++u)
    if (renumbered[u] == 0) {
      renumbered[u] = static_cast<int64_t>(sharded(state).units.list.size());
      sharded(state).units.list.push_back(Unit{.module = units[u].get()});
    }
  std::unordered_map<const void*, int64_t> storages;  // parameters on each storage, the whole model's
  for (const auto& p : unique_tensors(module.parameters())) ++storages[p.storage().unsafeGetStorageImpl()];
  std::vector<int64_t> out;
  for (const auto& p : params) {
    const int64_t u = owner.at(p.unsafeGetTensorImpl());
    out.push_back(u < 0 ? -1 : renumbered[static_cast<std::size_t>(u)]);
    if (u < 0) continue;
    if (storages[p.storage().unsafeGetStorageImpl()] > 1)
      throw InvalidArgument(
          "accel::DataParallel: under FULL_SHARD every parameter of a unit must have its storage "
          "to itself; " +
          state.names.describe(p) + " of unit '" + name_of[units[static_cast<std::size_t>(u)].get()] +
          "' shares its storage with another parameter (share the tensor itself to tie weights: a "
          "tensor registered in several modules is one parameter)");
    // A piece of a larger tensor (a tensor-parallel shard narrowed from the
    // whole, a view): its storage holds more than the parameter, so freeing
    // it at rest would free the rest too. It takes a copy as a storage of
    // its own, as FSDP2 replaces the parameters it shards; the tensor it
    // was cut from keeps its values and no longer sees the parameter's.
    if (p.storage_offset() != 0 || !p.is_contiguous() ||
        p.storage().nbytes() != static_cast<std::size_t>(p.numel()) * p.element_size())
      p.unsafeGetTensorImpl()->shallow_copy_from(p.detach().clone(at::MemoryFormat::Contiguous).getIntrusivePtr());
  }
  return out;
}
// Each bucket given to its unit (bucket_unit[b], as lay_out returned it;
// -1: none), once the shards are made.
inline void make_units(Sharded& z, const std::vector<int64_t>& bucket_unit) {
  for (std::size_t b = 0; b < bucket_unit.size(); ++b) {
    z.buckets[b].unit = bucket_unit[b];
    if (bucket_unit[b] >= 0)
      z.units.list[static_cast<std::size_t>(bucket_unit[b])].buckets.push_back(UnitBucket{.bucket = b});
  }
}
// A MixedPrecisionPolicy taken on (DataParallel's constructor, after the
// shards are made): its dtypes checked and kept, and each unit parameter's
// tensor at rest kept for release() to give back (see Use). The policy is
// the units': a parameter in no unit (the root's own, a tied weight) is
// whole while the model runs, in its own dtype, and computes in it (a unit's
// output_dtype hands such modules the activations in theirs).
inline void apply_policy(State& s, const MixedPrecisionPolicy& policy) {
  Sharded& z = sharded(s);
  z.reduce_dtype = policy.reduce_dtype ? policy.reduce_dtype : policy.param_dtype;  // (FSDP2's default)
  z.units.param_dtype = policy.param_dtype;
  z.units.output_dtype = policy.output_dtype;
  z.units.cast_inputs = policy.cast_forward_inputs;
  if (!policy.param_dtype) return;
  for (Unit& unit : z.units.list)
    for (UnitBucket& ub : unit.buckets) {
      const Bucket& layout = s.buckets[ub.bucket];
      if (!c10::isFloatingType(layout.dtype) || layout.dtype == *policy.param_dtype) continue;
      for (const auto& p : layout.params) {
        ub.rest.push_back(p.variable_data());
        // The parameter's shape in param_dtype, on a storage of no bytes of its own (materialize points it).
        at::Tensor compute = at::empty({0}, p.options().dtype(*policy.param_dtype).requires_grad(false));
        compute.unsafeGetTensorImpl()->set_sizes_contiguous(p.sizes());
        ub.compute.push_back(std::move(compute));
      }
    }
}

// What a kernel that reads a unit's parameter at rest throws (where
// LibTorch lets it refuse; see refuses_at_rest below): its name, its unit's,
// and the way out.
inline void name_at_rest(State& state, const torch::nn::Module& module) {
  std::unordered_map<const torch::nn::Module*, std::string> modules;
  for (const auto& named : module.named_modules()) modules[named.value().get()] = named.key();
  for (Unit& unit_of : sharded(state).units.list)
    for (UnitBucket& ub : unit_of.buckets) {
      const std::string unit = modules[unit_of.module];
      for (const auto& p : state.buckets[ub.bucket].params)
        ub.at_rest.push_back(
            "accel: the parameter '" + state.names.first(p) + "' is sharded at rest (fully sharded unit '" + unit +
            "'): it holds its values only while its unit runs through accel::unit_forward. Call the unit as "
            "accel::unit_forward(unit, ...), not unit->forward(...); read parameters under summon_full_params(); "
            "a module outside the unit that reads it (a tied head) must register it too (register_parameter): a "
            "weight registered in several modules is kept whole at the root");
    }
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
