// accel/training/dp/strategies.hpp: the two strategies' operations (Replicated: NO_SHARD; Sharded: ZeRO-2, ZeRO-3, HSDP), each a call into the engine's part that does it.
//
// dp/strategy.hpp declares what a strategy does, dp/state.hpp each
// strategy's state; here each operation of each one is defined, after the
// parts that do the work (the reducer, the shards, the units, the
// checkpoints' pieces). Reading one strategy top to bottom says what a
// step of it runs. Calls into the engine's functions are written dp::name:
// several have the name of the operation calling them, which would find the
// member instead.
#pragma once

#include "accel/training/dp/reducer.hpp"
#include "accel/training/dp/sharded_state_dict.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// -- Replicated (NO_SHARD): buckets all-reduced, gradients written back whole --

inline std::vector<int64_t> Replicated::assign_units(State&, const torch::nn::Module&,
                                                     const std::vector<std::shared_ptr<torch::nn::Module>>&,
                                                     const std::vector<at::Tensor>& params) {
  return std::vector<int64_t>(params.size(), -1);  // (units are a sharded strategy's)
}
inline void Replicated::lay_out(State& s, const std::vector<int64_t>&) { buckets.resize(s.buckets.size()); }
inline void Replicated::take_policy(State&, const MixedPrecisionPolicy&) {
  throw InvalidArgument(
      "accel::DataParallel: a MixedPrecisionPolicy is for sharded training (FULL_SHARD or HYBRID_SHARD); "
      "this model is not sharded (use mixed_precision = \"bf16\", autocast)");
}
inline void Replicated::issue(const Locked& held, std::size_t b) { issue_all_reduce(held, b); }
inline void Replicated::finish(const Locked& held) { finish_unsharded(held); }
inline void Replicated::shadow_backward(const Locked& held) { dp::shadow_backward(held); }
inline void Replicated::register_comm_hook(const Locked& held, CommHook to_register) {
  if (hooked)
    throw LogicError(
        "accel::DataParallel::register_comm_hook: a communication hook is already registered (as "
        "DDP, once per model)");
  if (held.state().armed)
    throw LogicError("accel::DataParallel::register_comm_hook: inside a backward; register before training");
  hook = std::move(to_register);
  hooked = true;
}
inline void Replicated::gradient_as_bucket_view(const Locked& held, bool on) {
  State& s = held.state();
  if (s.armed) throw LogicError("accel::DataParallel::gradient_as_bucket_view: inside a backward");
  bucket_view = on;
  if (!on)
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {  // the gradients become tensors of their own again
      const at::Tensor& persistent = buckets[b].persistent;
      for (auto& p : s.buckets[b].params)
        if (p.grad().defined() && persistent.defined() && p.grad().is_alias_of(persistent))
          p.mutable_grad() = p.grad().clone();
    }
}

// -- Sharded (SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD): buckets reduce-scattered into shards --

inline std::vector<int64_t> Sharded::assign_units(State& s, const torch::nn::Module& module,
                                                  const std::vector<std::shared_ptr<torch::nn::Module>>& unit_list,
                                                  const std::vector<at::Tensor>& params) {
  return dp::assign_units(s, module, unit_list, params);  // (dp/unit_plan.hpp)
}
inline void Sharded::lay_out(State& s, const std::vector<int64_t>& bucket_unit) {
  make_shards(s);                  // (dp/shards.hpp)
  make_units(*this, bucket_unit);  // (dp/unit_plan.hpp)
}
inline void Sharded::take_policy(State& s, const MixedPrecisionPolicy& policy) { apply_policy(s, policy); }
inline std::size_t Sharded::unit_count() const { return units.list.size(); }
inline std::vector<const torch::nn::Module*> Sharded::unit_modules() const {
  std::vector<const torch::nn::Module*> modules;
  for (const Unit& unit : units.list) modules.push_back(unit.module);
  return modules;
}
inline void Sharded::arm(const Locked&) {
  for (auto& bucket : buckets) give_back(bucket);  // (the last step's pooled buffers)
}
inline void Sharded::issue(const Locked& held, std::size_t b) { issue_scatter(held, b); }
inline void Sharded::finish(const Locked& held) { finish_sharded(held); }
inline void Sharded::end_unit_pass(const Locked& held) { dp::end_unit_pass(held); }
inline void Sharded::shadow_backward(const Locked&) {
  throw LogicError(
      "accel::DataParallel::shadow_backward: a sharded model cannot be stood in for (a joined process "
      "would have to step its shard too); use NO_SHARD, or even batches");
}
inline void Sharded::register_comm_hook(const Locked&, CommHook) {
  throw InvalidArgument(
      "accel::DataParallel::register_comm_hook: the buckets of a sharded model are "
      "reduce-scattered, not all-reduced; communication hooks need NO_SHARD");
}
inline void Sharded::gradient_as_bucket_view(const Locked&, bool on) {
  if (on)
    throw InvalidArgument(
        "accel::DataParallel::gradient_as_bucket_view: a sharded model's gradients are "
        "reduce-scattered into its shards");
}
inline at::Tensor Sharded::shard_of(const State& s, const at::Tensor& p) const { return dp::shard_of(s, p); }
inline void Sharded::shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) {
  dp::shard_optimizer(held, optimizer);
}
inline bool Sharded::steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) const {
  return dp::steps_with(held, optimizer);
}
inline void Sharded::check_shards(const Locked& held) { dp::check_shards(held); }
inline void Sharded::gather_shards(const Locked& held) { dp::gather_shards(held); }
inline void Sharded::release_module(const Locked& held) { dp::release_module(held); }
inline void Sharded::summon_units(const Locked& held) {
  for (std::size_t u = 0; u < units.list.size(); ++u) materialize(held, u, Use::full);
  ++units.held;
}
inline void Sharded::set_prefetch(const Locked&, bool forward, bool backward) {
  units.prefetch_forward = forward;
  units.prefetch_backward = backward;
}
inline void Sharded::let_go_of_units(const Locked& held) noexcept { dp::let_go_of_units(held); }
inline std::optional<Piece> Sharded::piece_of(const Locked& held, const at::Tensor& p) const {
  return dp::piece_of(held, p);
}
inline bool Sharded::writes_pieces() const { return !replicate || replicate->getRank() == 0; }  // (HSDP: one replica)
inline std::pair<int64_t, int64_t> Sharded::load_range(const Locked& held, const at::Tensor& p) const {
  return dp::load_range(held, p);
}
inline void Sharded::load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) {
  dp::load_values(held, values);
}
inline void Sharded::open_for_load(const Locked& held) { dp::open_for_load(held); }
inline void Sharded::reshard(const Locked& held) { dp::reshard(held); }
}  // namespace detail::dp

ACCEL_NAMESPACE_END
