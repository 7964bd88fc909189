// accel/training/dp/strategy.hpp: Strategy, what NO_SHARD and the sharded strategies do differently: the one place DataParallel branches on its mode.
//
// DataParallel's constructor makes one strategy (dp/state.hpp's Replicated
// or Sharded, each holding its own state) and every operation whose work
// depends on the mode is a call through this interface; no other code tests
// which mode it runs (the strategies' own code knows). Why an interface and
// not a std::variant visited at each call: the operations are many, and a
// new strategy (one that takes pieces of tensor-parallel parameters, say) is
// then one class listing them all, checked by the compiler, instead of a
// case added to every visit. The strategies define these in
// dp/strategies.hpp, after the engine's parts they call into.
//
// Every operation that reads or changes the engine's state takes the lock
// token (dp/state.hpp's Locked); the defaults are what a strategy that
// keeps no shards does: nothing, or the whole tensor.
#pragma once

#include "accel/training/dp/comm_hooks.hpp"
#include "accel/training/precision/policy.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
struct State;
class Locked;

// For sharded checkpoints (checkpoint/shards.hpp), which neither gather
// nor load whole what a rank keeps in pieces: elements [begin, begin +
// values.numel()) of a parameter flattened, `values` a flat view (see
// Sharded's piece_of in dp/sharded_state_dict.hpp).
struct Piece {
  at::Tensor values;
  int64_t begin = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  // Whether parameters are cut into shards here (SHARD_GRAD_OP, FULL_SHARD,
  // HYBRID_SHARD), and along which group (null when they are not).
  virtual bool shards() const { return false; }
  virtual const GroupPtr& shard_group() const;

  // -- building (DataParallel's constructor, in this order) --
  // The FULL_SHARD unit each of `params` belongs to (-1: none).
  virtual std::vector<int64_t> assign_units(State& s, const torch::nn::Module& module,
                                            const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                            const std::vector<at::Tensor>& params) = 0;
  // The strategy's own state for the common layout just made (bucket_unit:
  // each bucket's unit, -1 for none).
  virtual void lay_out(State& s, const std::vector<int64_t>& bucket_unit) = 0;
  // A MixedPrecisionPolicy, its dtypes already checked (see check_policy).
  virtual void take_policy(State& s, const MixedPrecisionPolicy& policy) = 0;
  // The modules that are FULL_SHARD units, in order (none elsewhere).
  virtual std::size_t unit_count() const { return 0; }
  virtual std::vector<const torch::nn::Module*> unit_modules() const { return {}; }

  // -- a synced backward --
  // Before it: whatever the last step's reductions still hold handed back.
  virtual void arm(const Locked&) {}
  // Bucket b's reduction started, its gradients all ready (all-reduce or reduce-scatter).
  virtual void issue(const Locked& held, std::size_t b) = 0;
  // Every reduction waited for and its result written where the optimizer reads it.
  virtual void finish(const Locked& held) = 0;
  // The end of a forward and backward pass: FULL_SHARD's units freed.
  virtual void end_unit_pass(const Locked&) {}
  // A joined rank standing in for the others' backward (DDP's join).
  virtual void shadow_backward(const Locked& held) = 0;

  // -- NO_SHARD's options (refused by the sharded strategies) --
  virtual void register_comm_hook(const Locked& held, CommHook hook) = 0;
  virtual void gradient_as_bucket_view(const Locked& held, bool on) = 0;

  // -- the shards and the optimizers that step them --
  virtual at::Tensor shard_of(const State&, const at::Tensor&) const { return {}; }
  virtual void shard_optimizer(const Locked&, torch::optim::Optimizer&) {}
  virtual bool steps_with(const Locked&, const torch::optim::Optimizer&) const { return false; }
  virtual void check_shards(const Locked&) {}
  virtual void gather_shards(const Locked&) {}
  // DataParallel::release_module: the module whole again, the optimizers
  // given its parameters back.
  virtual void release_module(const Locked&) {}

  // -- FULL_SHARD's units --
  // summon_full_params: every unit gathered until the returned count of holders drops.
  virtual void summon_units(const Locked&) {}
  virtual void set_prefetch(const Locked&, bool /*forward*/, bool /*backward*/) {}
  // For the destructor: the units' parameters given memory of their own. Never throws.
  virtual void let_go_of_units(const Locked&) noexcept {}

  // -- what a checkpoint reads and writes (ShardedStateDict) --
  virtual std::optional<Piece> piece_of(const Locked&, const at::Tensor&) const { return std::nullopt; }
  virtual bool writes_pieces() const { return false; }
  virtual std::pair<int64_t, int64_t> load_range(const Locked&, const at::Tensor& p) const { return {0, p.numel()}; }
  virtual void load_values(const Locked&, const std::function<at::Tensor(const at::Tensor&)>&) {}
  virtual void open_for_load(const Locked&) {}
  virtual void reshard(const Locked&) {}
};
inline const GroupPtr& Strategy::shard_group() const {
  static const GroupPtr none;
  return none;
}

// A MixedPrecisionPolicy's dtypes are floating-point, whatever the strategy.
inline void check_policy(const MixedPrecisionPolicy& policy) {
  for (const auto& dtype : {policy.param_dtype, policy.reduce_dtype, policy.output_dtype})
    if (dtype && !c10::isFloatingType(*dtype))
      throw InvalidArgument(
          std::string("accel::DataParallel: a MixedPrecisionPolicy's dtypes are floating-point; got ") +
          c10::toString(*dtype));
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
