// accel/training/dp/data_parallel.hpp: DataParallel, the class: data parallelism for one module (buckets, ZeRO-2 shards, ZeRO-3 units).
#pragma once

#include "accel/distributed/operations.hpp"
#include "accel/training/dp/strategies.hpp"

ACCEL_NAMESPACE_BEGIN

// Data parallelism for one module on one group, the DistributedDataParallel
// design: parameters and buffers are broadcast from the group's rank 0;
// gradients are averaged in buckets (DDP's assignment: one dtype and device
// each, the first at least 1 MiB, then at least bucket_bytes, in reverse
// parameter order, roughly the order backward produces them; see
// accel/training/dp/buckets.hpp). A
// post-hook on each parameter's gradient accumulator marks it ready; a full
// bucket is flattened and its all-reduce issued at once, asynchronously,
// while backward goes on; finish() waits for them and writes the averages
// back into the gradients, before the optimizer step.
//
// Unused parameters are handled as DDP with find_unused_parameters, without
// its extra collective: each bucket carries, after the gradients, one flag
// per parameter (did this rank produce its gradient since the last sync?),
// summed with the gradients. A parameter no rank used keeps its .grad as it
// was (undefined stays undefined, as in local training); one used anywhere
// gets the average, zeros counted for the ranks that did not use it.
// A backward in which none of the module's parameters got a gradient (the
// loss came from another model) issues nothing and leaves the module alone.
//
// Sharded (ZeRO-2, FSDP's SHARD_GRAD_OP), given a shard group of S ranks:
// every parameter is cut into S equal chunks (the last padded with zeros)
// and rank r keeps chunk r as its shard, a tensor of its own that the
// optimizer steps instead of the parameter (Accelerator::prepare puts the
// shards into the optimizer's groups), so optimizer state is 1/S. A
// bucket's gradients are reduce-scattered instead of all-reduced, laid out
// rank after rank so that each rank receives its chunk of every parameter
// (and every used-flag), averaged along a replicate group too where there
// is one (HSDP), and written to the shards' gradients. After the optimizer
// steps the shards, gather_shards() all-gathers them into every parameter and
// releases the parameters' gradients.
//
// Fully sharded (ZeRO-3, FSDP's FULL_SHARD), given units as well: the
// parameters of each unit (a submodule) hold no memory at rest. LibTorch
// modules have no forward hooks, so a unit runs through accel::unit_forward
// (dp/unit_forward.hpp), which gathers its parameters from the shards (waiting for a
// prefetch where one was issued, and prefetching the unit that came next in
// the last forward), runs its forward and frees them again. Autograd hooks
// on the unit's output and inputs gather them once more before the unit's
// backward (prefetching the unit before it) and free them after it; each
// unit is a bucket of its own, reduce-scattered as soon as its gradients
// are complete, and the parameters' gradients are released right then (the
// shards' gradients accumulate instead). Parameters in no unit (the root's
// own) are sharded as under ZeRO-2. Freed storage is LibTorch's error on use
// ("storage of size 0", "data is not allocated"), never stale values;
// summon_full_params() gathers everything for as long as it lives
// (checkpoints, exports, inspection).
//
// The class owns the state (dp/state.hpp) and keeps the API. It chooses
// the strategy once, in its constructor, and calls it for everything that
// differs by mode (dp/strategy.hpp, defined in dp/strategies.hpp); the work
// is in dp/reducer.hpp (the buckets), dp/shards.hpp (ZeRO-2) and
// dp/unit_plan.hpp, dp/unit_params.hpp, dp/units.hpp (ZeRO-3), on that
// state.
//
// On a GPU, streams as DDP: a bucket is flattened on the stream its
// gradients were made on, and c10d runs its collective on a stream of its
// own (NCCL's; Gloo's copies to and from the host) once that stream has
// reached it; finish() makes the current stream wait for the reduction,
// and the host waits for nothing: the used-flags are written without it,
// and read back only where this rank left a parameter unused (dp/state.hpp;
// the cuda case "gpu: DataParallel's backward ..." proves it under CUDA's
// sync debug mode).
//
// Why not LibTorch's own c10d::Reducer (the engine of Python's DDP)? Its
// header includes torch/csrc/distributed/autograd/context/context.h, which
// Debian's libtorch-dev does not ship, so it cannot be included there.
class DataParallel {
 public:
  static constexpr int64_t kFirstBucketBytes = 1 << 20;  // as torch's DDP

  // group: where parameters are broadcast from, and gradients averaged over
  // when not sharded. shard (of more than one rank): shard along it, and
  // average along replicate as well when given. units (sharded only):
  // submodules whose parameters are sharded at rest (FULL_SHARD). policy
  // (sharded only): the dtypes units compute and gradients reduce in (see
  // MixedPrecisionPolicy). A tensor registered in several modules (tied
  // weights) is one parameter, as in Python's parameters().
  DataParallel(const std::shared_ptr<torch::nn::Module>& module, GroupPtr group, int64_t bucket_bytes,
               GroupPtr shard = {}, GroupPtr replicate = {},
               const std::vector<std::shared_ptr<torch::nn::Module>>& units = {}, MixedPrecisionPolicy policy = {})
      : module_(module), state_(std::make_shared<detail::dp::State>()) {
    state_->group = std::move(group);
    if (!state_->group) return;  // not distributed: plain local training
    // The strategy, chosen here once (the only test of the mode; dp/strategy.hpp):
    // sharded along a shard group of more than one rank.
    if (shard && shard->getSize() > 1) {
      if (replicate && replicate->getSize() == 1) replicate.reset();
      state_->replicas = shard->getSize() * (replicate ? replicate->getSize() : 1);
      state_->mode = std::make_unique<detail::dp::Sharded>(std::move(shard), std::move(replicate));
    } else {
      state_->replicas = state_->group->getSize();
    }
    detail::dp::Strategy& mode = *state_->mode;
    state_->names = detail::ParameterNames(*module_);
    sync_module_states();
    std::vector<at::Tensor> params;
    for (const auto& p : detail::unique_tensors(module_->parameters()))
      if (p.requires_grad()) params.push_back(p);
    std::reverse(params.begin(), params.end());
    const std::vector<int64_t> unit_of = mode.assign_units(*state_, *module_, units, params);
    const std::vector<int64_t> bucket_unit =
        detail::dp::lay_out(*state_, params, unit_of, {kFirstBucketBytes, bucket_bytes});
    accumulators_.resize(params.size());
    mode.lay_out(*state_, bucket_unit);
    if (policy.active()) {
      detail::dp::check_policy(policy);
      mode.take_policy(*state_, policy);
    }
    if constexpr (detail::dp::refuses_at_rest<>)
      if (unit_count() > 0) detail::dp::name_at_rest(*state_, *module_);
    {
      const detail::dp::Locked held(*state_);
      for (std::size_t u = 0; u < unit_count(); ++u) detail::dp::release(held, u);  // at rest: the shards only
    }
    const std::vector<const torch::nn::Module*> unit_modules = mode.unit_modules();
    for (std::size_t u = 0; u < unit_modules.size(); ++u) {
      std::lock_guard lock(detail::dp::unit_registry_mutex());
      detail::dp::unit_registry()[unit_modules[u]] = {state_, u};
    }
    hook_accumulators();
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  ~DataParallel() {
    {
      std::lock_guard lock(detail::dp::unit_registry_mutex());
      for (const auto* unit : state_->mode->unit_modules()) detail::dp::unit_registry().erase(unit);
    }
    const detail::dp::Locked held(*state_);
    state_->alive = false;  // the hooks outlive us inside the autograd graph: make them inert
    // A unit gathered now (a forward interrupted, summon_full_params alive) points into the pool, which
    // dies with the state: its parameters get memory of their own, as the model outlives us. Also after an
    // error (a failed gather, a peer gone): nothing here throws.
    state_->mode->let_go_of_units(held);
  }

  // Copies the parameters and buffers of the group's rank `src` to every
  // rank of the group.
  void sync_module_states(int src = 0) {
    if (!state_->group) return;
    std::vector<at::Tensor> states = module_->parameters();
    for (const auto& b : module_->buffers()) states.push_back(b);
    broadcast(detail::unique_tensors(states), src, state_->group);
  }

  // Arms the hooks for the next backward; without it, backward accumulates
  // gradients locally (no_sync). Nothing while gradient sync is off (below).
  void prepare_for_backward() {
    if (!state_->group || !requires_sync_) return;
    hook_accumulators();
    const detail::dp::Locked held(*state_);
    state_->armed = true;
    state_->next = 0;
    state_->fired = 0;
    state_->timeline.arm(state_->buckets.size());
    for (std::size_t b = 0; b < state_->buckets.size(); ++b) {
      auto& bucket = state_->buckets[b];
      state_->timeline.times.buckets[b].bytes = bucket.packing.bytes();
      bucket.ready = 0;
      std::fill(bucket.seen.begin(), bucket.seen.end(), 0);
      bucket.work = {};  // (a Work left from a backward that never finished is waited for)
    }
    state_->mode->arm(held);
  }

  // FSDP2's set_requires_gradient_sync (DDP's require_backward_grad_sync):
  // while off, prepare_for_backward() arms nothing, so each backward adds
  // its gradients to the parameters' own (under FULL_SHARD too: whole
  // gradients, as FSDP2's no-sync micro-batches keep), and the first
  // backward with it on again reduces their sum. A pipeline stage runs its
  // micro-batches so, reducing on the last; Accelerator::no_sync and
  // accumulate() switch it for the models they name.
  void set_requires_gradient_sync(bool on) { requires_sync_ = on; }
  bool requires_gradient_sync() const { return requires_sync_; }

  // Waits for every bucket's all-reduce and writes the averaged gradients
  // back. Buckets with parameters that got no gradient in this backward are
  // reduced here, in the same order on every rank. Returns whether the
  // module took part (false: no parameter of it got a gradient, nothing was
  // communicated; with `always`, it takes part regardless).
  bool finish(bool always = false) {
    const detail::dp::Locked held(*state_);
    state_->mode->end_unit_pass(held);
    if (!state_->armed) return false;
    state_->armed = false;
    if (state_->fired == 0 && !always) return false;
    state_->timeline.times.finish_began = state_->timeline.now();
    for (std::size_t b = state_->next; b < state_->buckets.size(); ++b) detail::dp::issue_bucket(held, b);
    state_->next = state_->buckets.size();
    at::NoGradGuard no_grad;
    state_->mode->finish(held);
    state_->timeline.times.finished = state_->timeline.now();
    return true;
  }

  // A rank that has run out of inputs stands in for one backward of the
  // others (DDP's join): every bucket's all-reduce, in order, with zero
  // gradients and no used-flags; its own gradients are left alone.
  void shadow_backward() {
    if (!state_->group) return;
    const detail::dp::Locked held(*state_);
    state_->mode->shadow_backward(held);
  }

  // DDP's register_comm_hook (see CommHook): once, as DDP allows, and not
  // between a backward and its finish(); not under sharding.
  void register_comm_hook(CommHook hook) {
    if (!hook) throw InvalidArgument("accel::DataParallel::register_comm_hook: an empty hook");
    const detail::dp::Locked held(*state_);
    state_->mode->register_comm_hook(held, std::move(hook));
  }
  // DDP's gradient_as_bucket_view: each parameter's .grad becomes a view
  // into its (persistent) bucket, so the gradients are not copied into the
  // bucket and back, nor held twice (as gradients and bucket). Keep the
  // gradients (zero_grad with set_to_none = false: LibTorch 2.x's default
  // sets them to none): a gradient set to none is copied into its view at
  // the next sync, as DDP does. NO_SHARD only.
  void gradient_as_bucket_view(bool on) {
    const detail::dp::Locked held(*state_);
    state_->mode->gradient_as_bucket_view(held, on);
  }

  // -- sharded (ZeRO-2 and ZeRO-3: see the top of this part) --

  bool sharded() const { return state_->mode->shards(); }
  // The group parameters are sharded along (null when not sharded).
  const GroupPtr& shard_group() const { return state_->mode->shard_group(); }
  // The shard standing in for parameter p; undefined when p is not one of
  // this module's sharded parameters.
  at::Tensor shard_of(const at::Tensor& p) const { return state_->mode->shard_of(*state_, p); }
  // Puts the shards in place of this module's parameters in the optimizer's
  // groups (see detail::dp::shard_optimizer).
  void shard_optimizer(torch::optim::Optimizer& optimizer) {
    state_->mode->shard_optimizer(detail::dp::Locked(*state_), optimizer);
  }
  bool steps_with(const torch::optim::Optimizer& optimizer) const {
    return state_->mode->steps_with(detail::dp::Locked(*state_), optimizer);
  }
  // Before a backward: every shard checked against its parameter (an
  // optimizer stepped directly, not through prepare()'s handle, is an error).
  void check_shards() { state_->mode->check_shards(detail::dp::Locked(*state_)); }
  // After the optimizer stepped the shards: every parameter all-gathered
  // from them, and the parameters' gradients released.
  void gather_shards() { state_->mode->gather_shards(detail::dp::Locked(*state_)); }
  // The former name of gather_shards(), kept for the programs that call it
  // (it read like accel::gather, which gathers data from every rank).
  void gather() { gather_shards(); }
  // Gives the module back for plain local use, for good (see
  // detail::dp::release_module): under FULL_SHARD its parameters gathered
  // (every rank of the shard group calls it); optimizers that stepped the
  // shards step the parameters again, from a fresh state. Afterwards this
  // DataParallel does nothing; destroy it.
  void release_module() {
    const detail::dp::Locked held(*state_);
    state_->mode->release_module(held);
    state_->alive = false;  // the hooks do nothing from now on
  }
  // What checkpoints read and write of this model (detail::dp::ShardedStateDict:
  // this rank's pieces, written and loaded without gathering).
  detail::dp::ShardedStateDict sharded_state_dict() const { return detail::dp::ShardedStateDict(state_); }

  // FSDP's summon_full_params: every unit's parameters gathered for as long
  // as the returned object lives (a collective on the shard group: every
  // rank makes one, in the same order). With writeback, what the
  // parameters hold then goes back into the shards. Nothing to do unless
  // fully sharded.
  using FullParameters = detail::dp::FullParameters;
  [[nodiscard]] FullParameters summon_full_params(bool writeback = false) {
    if (unit_count() == 0) return FullParameters(nullptr, false);
    state_->mode->summon_units(detail::dp::Locked(*state_));
    return FullParameters(state_, writeback);
  }
  // Whole parameters one unit at a time (detail::dp::UnitByUnit: at most
  // one unit gathered while it lives; every rank of the shard group in the
  // same order).
  detail::dp::UnitByUnit unit_by_unit() { return detail::dp::UnitByUnit(unit_count() > 0 ? state_ : nullptr); }
  // FULL_SHARD: whether a unit's gather is issued while the unit before it
  // computes, in the forward and in the backward (AcceleratorConfig's
  // forward_prefetch and backward_prefetch).
  void set_prefetch(bool forward, bool backward) {
    state_->mode->set_prefetch(detail::dp::Locked(*state_), forward, backward);
  }
  // Whether parameters are sharded at rest (FULL_SHARD), and in how many units.
  std::size_t unit_count() const { return state_->mode->unit_count(); }

  // Sharded: the working buffers the engine keeps from step to step
  // (dp/buffers.hpp), in bytes, as torch.cuda.memory_reserved() counts what
  // the caching allocator keeps; release_buffers() frees those not in use
  // now (as torch.cuda.empty_cache()), and the next step allocates afresh.
  int64_t buffer_bytes() const {
    const detail::dp::Locked held(*state_);
    return state_->pool.bytes();
  }
  void release_buffers() {
    const detail::dp::Locked held(*state_);
    state_->pool.clear();
  }
  // Whether `module` is a unit of a live fully sharded DataParallel.
  static bool is_unit(const torch::nn::Module* module) { return detail::dp::find_unit(module).first != nullptr; }

  // accel::unit_forward's machinery (detail::dp::unit_call).
  template <class Fn, class... Args>
  static auto unit_call(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
    return detail::dp::unit_call(module, std::forward<Fn>(fn), std::forward<Args>(args)...);
  }

  bool distributed() const { return state_->group != nullptr; }
  // The module this DataParallel keeps in sync.
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  std::size_t bucket_count() const { return state_->buckets.size(); }
  const GroupPtr& group() const { return state_->group; }
  // Called (on the autograd thread, under a lock) as each bucket's
  // all-reduce is issued: for logging, profiling and tests.
  void on_bucket_issued(std::function<void(std::size_t bucket)> callback) {
    const detail::dp::Locked held(*state_);
    state_->on_issued = std::move(callback);
  }
  // When each bucket of the last synced backward was ready, issued, waited
  // for and landed, and when finish() ran (ms since prepare_for_backward;
  // detail::dp::BucketTimes says what each moment is): whether the
  // communication hid behind the backward, for benchmarks and profiling.
  detail::dp::BackwardTimeline bucket_timeline() const {
    const detail::dp::Locked held(*state_);
    return state_->timeline.times;
  }

 private:
  // Puts a ReadyHook on each parameter's gradient accumulator. Run again
  // before each synced backward: an operation that replaces a parameter's
  // storage (Module::load's set_, set_data) gives it a new accumulator,
  // which must be hooked too.
  void hook_accumulators() {
    std::size_t k = 0;
    for (std::size_t b = 0; b < state_->buckets.size(); ++b)
      for (std::size_t i = 0; i < state_->buckets[b].params.size(); ++i, ++k) {
        auto accumulator = torch::autograd::impl::grad_accumulator(state_->buckets[b].params[i]);
        if (accumulator == accumulators_[k]) continue;
        accumulator->add_post_hook(std::make_unique<detail::dp::ReadyHook>(state_, b, i));
        accumulators_[k] = std::move(accumulator);  // hooks live as long as their node
      }
  }

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<detail::dp::State> state_;
  // (LibTorch 2.15 holds autograd nodes by intrusive_ptr, earlier versions by shared_ptr.)
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> accumulators_;
  bool requires_sync_ = true;
};

ACCEL_NAMESPACE_END
