// accel/training/data_parallel.hpp: DataParallel (buckets, ZeRO-2 shards, ZeRO-3 units) and unit_forward.
#pragma once

#include "accel/distributed/operations.hpp"
#include "accel/training/buckets.hpp"
#include "accel/training/comm_hooks.hpp"

ACCEL_NAMESPACE_BEGIN

// Data parallelism for one module on one group, the DistributedDataParallel
// design: parameters and buffers are broadcast from the group's rank 0;
// gradients are averaged in buckets (DDP's assignment: one dtype and device
// each, the first at least 1 MiB, then at least bucket_bytes, in reverse
// parameter order, roughly the order backward produces them; see
// accel/training/buckets.hpp). A
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
// steps the shards, gather() all-gathers them into every parameter and
// releases the parameters' gradients.
//
// Fully sharded (ZeRO-3, FSDP's FULL_SHARD), given units as well: the
// parameters of each unit (a submodule) hold no memory at rest. LibTorch
// modules have no forward hooks, so a unit runs through accel::unit_forward
// (see below), which gathers its parameters from the shards (waiting for a
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
// Why not LibTorch's own c10d::Reducer (the engine of Python's DDP)? Its
// header includes torch/csrc/distributed/autograd/context/context.h, which
// Debian's libtorch-dev does not ship, so it cannot be included there.
class DataParallel {
  struct State;  // (below)

 public:
  static constexpr int64_t kFirstBucketBytes = 1 << 20;  // as torch's DDP

  // group: where parameters are broadcast from, and gradients averaged over
  // when not sharded. shard (of more than one rank): shard along it, and
  // average along replicate as well when given. units (sharded only):
  // submodules whose parameters are sharded at rest (FULL_SHARD).
  DataParallel(const std::shared_ptr<torch::nn::Module>& module, GroupPtr group, int64_t bucket_bytes,
               GroupPtr shard = {}, GroupPtr replicate = {},
               const std::vector<std::shared_ptr<torch::nn::Module>>& units = {})
      : module_(module), state_(std::make_shared<State>()) {
    state_->group = std::move(group);
    if (!state_->group) return;  // not distributed: plain local training
    if (shard && shard->getSize() > 1) {
      state_->shard = std::move(shard);
      if (replicate && replicate->getSize() > 1) state_->replicate = std::move(replicate);
      state_->replicas = state_->shard->getSize() * (state_->replicate ? state_->replicate->getSize() : 1);
    } else {
      state_->replicas = state_->group->getSize();
    }
    sync_module_states();
    std::vector<at::Tensor> params;
    for (const auto& p : module_->parameters())
      if (p.requires_grad()) params.push_back(p);
    std::reverse(params.begin(), params.end());
    const auto unit_of = state_->shard ? assign_units(units, params) : std::vector<int64_t>(params.size(), -1);
    std::vector<detail::BucketInput> inputs;
    for (std::size_t k = 0; k < params.size(); ++k)
      inputs.push_back({params[k].scalar_type(), params[k].device(), params[k].numel() * params[k].element_size(),
                        unit_of[k]});
    for (const auto& indices : detail::compute_bucket_assignment_by_size(inputs, {kFirstBucketBytes, bucket_bytes}).buckets) {
      const at::Tensor& first = params[indices.front()];
      Bucket bucket{.dtype = first.scalar_type(), .device = first.device(), .packing = detail::Packing(first.scalar_type())};
      bucket.unit = unit_of[indices.front()];
      if (bucket.unit >= 0) state_->units[static_cast<std::size_t>(bucket.unit)].buckets.push_back(state_->buckets.size());
      for (std::size_t k : indices) {
        bucket.params.push_back(params[k]);
        bucket.used.push_back(0);
        bucket.seen.push_back(0);
        bucket.packing.add(params[k]);
      }
      bucket.packing.add({static_cast<int64_t>(bucket.params.size())}, bucket.dtype);  // the used-flags
      accumulators_.resize(accumulators_.size() + bucket.params.size());
      state_->buckets.push_back(std::move(bucket));
    }
    if (state_->shard) make_shards();
    for (std::size_t u = 0; u < state_->units.size(); ++u) {
      release(*state_, u);  // at rest: the shards only
      std::lock_guard lock(registry_mutex());
      registry()[state_->units[u].module] = {state_, u};
    }
    hook_accumulators();
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  ~DataParallel() {
    {
      std::lock_guard lock(registry_mutex());
      for (const auto& unit : state_->units) registry().erase(unit.module);
    }
    std::lock_guard lock(state_->mutex);
    state_->alive = false;  // the hooks outlive us inside the autograd graph: make them inert
  }

  // Copies the parameters and buffers of the group's rank `src` to every
  // rank of the group.
  void sync_module_states(int src = 0) {
    if (!state_->group) return;
    std::vector<at::Tensor> states;
    for (const auto& p : module_->parameters()) states.push_back(p);
    for (const auto& b : module_->buffers()) states.push_back(b);
    broadcast(std::move(states), src, state_->group);
  }

  // Arms the hooks for the next backward; without it, backward accumulates
  // gradients locally (no_sync).
  void prepare_for_backward() {
    if (!state_->group) return;
    hook_accumulators();
    std::lock_guard lock(state_->mutex);
    state_->armed = true;
    state_->next = 0;
    state_->fired = 0;
    for (auto& bucket : state_->buckets) {
      bucket.ready = 0;
      std::fill(bucket.seen.begin(), bucket.seen.end(), 0);
      bucket.work = {};  // (a Work left from a backward that never finished is waited for)
    }
  }

  // Waits for every bucket's all-reduce and writes the averaged gradients
  // back. Buckets with parameters that got no gradient in this backward are
  // reduced here, in the same order on every rank. Returns whether the
  // module took part (false: no parameter of it got a gradient, nothing was
  // communicated; with `always`, it takes part regardless).
  bool finish(bool always = false) {
    std::lock_guard lock(state_->mutex);
    end_unit_pass(*state_);
    if (!state_->armed) return false;
    state_->armed = false;
    if (state_->fired == 0 && !always) return false;
    for (std::size_t b = state_->next; b < state_->buckets.size(); ++b) issue_bucket(*state_, b);
    state_->next = state_->buckets.size();
    at::NoGradGuard no_grad;
    if (state_->shard) {
      finish_sharded();
      return true;
    }
    for (auto& bucket : state_->buckets) {
      try {
        bucket.flat = bucket.work.wait();
      } catch (const DistributedError& e) {
        throw DistributedError(std::string("accel::DataParallel: a gradient bucket's all_reduce failed: ") + e.what());
      }
      if (!bucket.flat.defined() || bucket.flat.numel() != bucket.packing.elements())
        throw RuntimeError("accel::DataParallel: the communication hook returned " +
                           (bucket.flat.defined() ? std::to_string(bucket.flat.numel()) + " elements" : "nothing") +
                           " for bucket " + std::to_string(&bucket - state_->buckets.data()) + " of " +
                           std::to_string(bucket.packing.elements()));
      if (bucket.flat.scalar_type() != bucket.dtype) bucket.flat = bucket.flat.to(bucket.dtype);  // decompressed
      bucket.flat = bucket.flat.reshape({-1});
      if (state_->bucket_view && !bucket.flat.is_alias_of(bucket.views)) bucket.flat = bucket.views.copy_(bucket.flat);
      const std::size_t n = bucket.params.size();
      const at::Tensor used_anywhere = bucket.packing.view(bucket.flat, n).gt(0).to(c10::kCPU);
      const bool* used = used_anywhere.data_ptr<bool>();
      for (std::size_t i = 0; i < n; ++i) {
        at::Tensor& p = bucket.params[i];
        if (used[i]) {
          at::Tensor averaged = bucket.packing.view(bucket.flat, i);
          if (state_->bucket_view) p.mutable_grad() = averaged;  // (already there when it was a view)
          else if (p.grad().defined()) p.mutable_grad().copy_(averaged);
          else p.mutable_grad() = averaged.clone();
        }
        bucket.used[i] = 0;
      }
    }
    return true;
  }

  // A rank that has run out of inputs stands in for one backward of the
  // others (DDP's join): every bucket's all-reduce, in order, with zero
  // gradients and no used-flags; its own gradients are left alone.
  void shadow_backward() {
    if (!state_->group) return;
    std::lock_guard lock(state_->mutex);
    std::vector<Work<at::Tensor>> works;
    for (std::size_t b = 0; b < state_->buckets.size(); ++b) {  // through the hook: the same collective as the others'
      const Bucket& bucket = state_->buckets[b];
      GradBucket zeros = grad_bucket(*state_, b, bucket.packing.buffer(bucket.params.front().options()).zero_());
      works.push_back(state_->hook(state_->group, zeros));
    }
    for (auto& work : works) {
      try {
        work.wait();
      } catch (const DistributedError& e) {
        throw DistributedError(std::string("accel::DataParallel: a joined rank's gradient all_reduce failed: ") +
                               e.what());
      }
    }
  }

  // DDP's register_comm_hook (see CommHook): once, as DDP allows, and not
  // between a backward and its finish(); not under sharding.
  void register_comm_hook(CommHook hook) {
    if (!hook) throw InvalidArgument("accel::DataParallel::register_comm_hook: an empty hook");
    if (state_->shard)
      throw InvalidArgument("accel::DataParallel::register_comm_hook: the buckets of a sharded model are "
                            "reduce-scattered, not all-reduced; communication hooks need NO_SHARD");
    std::lock_guard lock(state_->mutex);
    if (state_->hooked)
      throw LogicError("accel::DataParallel::register_comm_hook: a communication hook is already registered (as "
                       "DDP, once per model)");
    if (state_->armed)
      throw LogicError("accel::DataParallel::register_comm_hook: inside a backward; register before training");
    state_->hook = std::move(hook);
    state_->hooked = true;
  }
  // DDP's gradient_as_bucket_view: each parameter's .grad becomes a view
  // into its bucket, which stays allocated, so the gradients are not copied
  // into the bucket and back, and no bucket is allocated per step. Keep the
  // gradients (zero_grad with set_to_none = false: LibTorch 2.x's default
  // sets them to none): a gradient set to none is copied into its view at
  // the next sync, as DDP does. NO_SHARD only.
  void gradient_as_bucket_view(bool on) {
    if (state_->shard && on)
      throw InvalidArgument("accel::DataParallel::gradient_as_bucket_view: a sharded model's gradients are "
                            "reduce-scattered into its shards");
    std::lock_guard lock(state_->mutex);
    if (state_->armed) throw LogicError("accel::DataParallel::gradient_as_bucket_view: inside a backward");
    state_->bucket_view = on;
    if (!on)
      for (auto& bucket : state_->buckets) {  // the gradients become tensors of their own again
        for (auto& p : bucket.params)
          if (p.grad().defined() && bucket.views.defined() && p.grad().is_alias_of(bucket.views))
            p.mutable_grad() = p.grad().clone();
        bucket.views = at::Tensor();
      }
  }

  // -- sharded (see above) --

  bool sharded() const { return state_->shard != nullptr; }
  const GroupPtr& shard_group() const { return state_->shard; }
  // The shard standing in for parameter p; undefined when p is not one of
  // this module's sharded parameters.
  at::Tensor shard_of(const at::Tensor& p) const {
    const auto found = shard_index_.find(p.unsafeGetTensorImpl());
    return found == shard_index_.end() ? at::Tensor() : state_->buckets[found->second.first].shards[found->second.second];
  }
  // Puts the shards in place of this module's parameters in the optimizer's
  // groups (so it steps, and keeps state for, the shards only). Before its
  // first step; not an LBFGS (its line search needs whole-vector products).
  void shard_optimizer(torch::optim::Optimizer& optimizer) {
    if (!state_->shard) return;
    bool touched = false;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) {
        const auto found = shard_index_.find(p.unsafeGetTensorImpl());
        if (found == shard_index_.end()) continue;
        if (!optimizer.state().empty())
          throw InvalidArgument("accel::Accelerator::prepare: the optimizer has already stepped; under sharding "
                                "prepare it before its first step (its state becomes per-shard)");
        if (dynamic_cast<torch::optim::LBFGS*>(&optimizer))
          throw InvalidArgument("accel::Accelerator::prepare: LBFGS cannot step shards (its line search needs "
                                "products over whole parameters); use NO_SHARD");
        Bucket& bucket = state_->buckets[found->second.first];
        p = bucket.shards[found->second.second];
        bucket.in_optimizer[found->second.second] = 1;
        touched = true;
      }
    if (touched && std::find(optimizers_.begin(), optimizers_.end(), &optimizer) == optimizers_.end())
      optimizers_.push_back(&optimizer);
  }
  bool steps_with(const torch::optim::Optimizer& optimizer) const {
    return std::find(optimizers_.begin(), optimizers_.end(), &optimizer) != optimizers_.end();
  }
  // Before a backward, each shard against its chunk of the parameter
  // (LibTorch's optimizers write through .data(), which version counters do
  // not see, so values are compared; one pass over 1/S of the parameters
  // and one device sync). A shard that changed since the last gather()
  // means its optimizer was stepped directly, not through the handle
  // prepare() returned, and this forward used stale parameters: an error.
  // A parameter changed since then (by hand, Module::load) is taken into its
  // shard. Every shard must be in a prepared optimizer.
  void check_shards() {
    if (!state_->shard) return;
    std::lock_guard lock(state_->mutex);
    at::NoGradGuard no_grad;
    const int64_t r = state_->shard->getRank();
    std::vector<at::Tensor> differs;  // per shard: [differs from its chunk, differs from its sum at the gather]
    for (auto& bucket : state_->buckets)
      for (std::size_t i = 0; i < bucket.params.size(); ++i) {
        if (!bucket.in_optimizer[i])
          throw InvalidArgument("accel::Accelerator::backward: a parameter of shape " +
                                c10::str(bucket.params[i].sizes()) +
                                " of a sharded model is in no prepared optimizer; under sharding its optimizer "
                                "steps the shards, so prepare it (accelerator.prepare(model, optimizer))");
        if (bucket.unit >= 0) continue;  // gathered from the shards at each use: never stale
        const at::Tensor flat = bucket.params[i].reshape({-1});
        const int64_t begin = std::min(r * bucket.chunks[i], flat.numel()),
                      length = std::min(bucket.chunks[i], flat.numel() - begin);
        differs.push_back(bucket.shards[i].narrow(0, 0, length).ne(flat.narrow(0, begin, length)).any());
        differs.push_back(bucket.shards[i].sum().ne(bucket.sums[i]));
      }
    if (differs.empty()) return;
    const at::Tensor found = at::stack(differs).to(c10::kCPU);
    const bool* flag = found.data_ptr<bool>();
    for (auto& bucket : state_->buckets)
      for (std::size_t i = 0; i < bucket.params.size() && bucket.unit < 0; ++i, flag += 2) {
        if (!flag[0]) continue;
        if (flag[1])
          throw InvalidArgument("accel::Accelerator::backward: under sharding, step the optimizer through the "
                                "handle accelerator.prepare() returned (its step() gathers the updated shards "
                                "into the parameters); the parameters this forward used are stale");
        read_chunk(bucket.params[i], r, bucket.chunks[i], bucket.shards[i]);
        bucket.sums[i] = bucket.shards[i].sum();
      }
  }
  // After the optimizer stepped the shards: every parameter all-gathered
  // from them (one all_gather per bucket), and the parameters' gradients
  // released (the shards' hold this step's).
  void gather() {
    if (!state_->shard) return;
    std::lock_guard lock(state_->mutex);
    end_unit_pass(*state_);  // a prefetch made before this step holds old values
    at::NoGradGuard no_grad;
    std::vector<Work<at::Tensor>> works;
    try {
      for (const auto& bucket : state_->buckets)
        if (bucket.unit < 0) works.push_back(all_gather_async(at::cat(bucket.shards), state_->shard));
      for (std::size_t b = 0, w = 0; b < state_->buckets.size(); ++b) {
        Bucket& bucket = state_->buckets[b];
        if (bucket.unit >= 0) continue;  // FULL_SHARD: gathered when the unit runs
        const at::Tensor rows = works[w++].wait();  // (S, segment without the flags)
        for (std::size_t i = 0; i < bucket.params.size(); ++i) {
          write_rows(rows, bucket.offsets[i], bucket.chunks[i], bucket.params[i]);
          bucket.params[i].mutable_grad().reset();
          bucket.sums[i] = bucket.shards[i].sum();
        }
      }
    } catch (const DistributedError& e) {
      throw DistributedError(std::string("accel::DataParallel: gathering the parameters from their shards failed: ") +
                             e.what());
    }
  }
  // Every shard taken again from its parameter (after Module::load, which
  // gives every parameter storage of its own); units' parameters are freed
  // again.
  void reshard() {
    if (!state_->shard) return;
    std::lock_guard lock(state_->mutex);
    at::NoGradGuard no_grad;
    for (auto& bucket : state_->buckets)
      for (std::size_t i = 0; i < bucket.params.size(); ++i) {
        read_chunk(bucket.params[i], state_->shard->getRank(), bucket.chunks[i], bucket.shards[i]);
        bucket.sums[i] = bucket.shards[i].sum();
      }
    for (std::size_t u = 0; u < state_->units.size(); ++u) {
      for (std::size_t b : state_->units[u].buckets) state_->buckets[b].resident = true;
      release(*state_, u);
    }
  }

  // FSDP's summon_full_params: every unit's parameters gathered for as long
  // as the returned object lives (a collective on the shard group: every
  // rank makes one, in the same order). With writeback, what the
  // parameters hold then goes back into the shards. Nothing to do unless
  // fully sharded.
  class FullParameters {
   public:
    FullParameters(FullParameters&& other) noexcept : state_(std::move(other.state_)), writeback_(other.writeback_) {}
    FullParameters(const FullParameters&) = delete;
    FullParameters& operator=(const FullParameters&) = delete;
    FullParameters& operator=(FullParameters&&) = delete;
    ~FullParameters() {
      if (!state_) return;
      std::lock_guard lock(state_->mutex);
      if (--state_->held > 0) return;
      at::NoGradGuard no_grad;
      for (std::size_t u = 0; u < state_->units.size(); ++u) {
        if (writeback_)
          for (std::size_t b : state_->units[u].buckets) {
            Bucket& bucket = state_->buckets[b];
            for (std::size_t i = 0; i < bucket.params.size(); ++i)
              read_chunk(bucket.params[i], state_->shard->getRank(), bucket.chunks[i], bucket.shards[i]);
          }
        release(*state_, u);
      }
    }

   private:
    friend class DataParallel;
    FullParameters(std::shared_ptr<State> state, bool writeback) : state_(std::move(state)), writeback_(writeback) {}
    std::shared_ptr<State> state_;
    bool writeback_;
  };
  [[nodiscard]] FullParameters summon_full_params(bool writeback = false) {
    if (state_->units.empty()) return FullParameters(nullptr, false);
    std::lock_guard lock(state_->mutex);
    for (std::size_t u = 0; u < state_->units.size(); ++u) materialize(*state_, u);
    ++state_->held;
    return FullParameters(state_, writeback);
  }
  // Whether parameters are sharded at rest (FULL_SHARD), and in how many units.
  std::size_t unit_count() const { return state_->units.size(); }
  // Whether `module` is a unit of a live fully sharded DataParallel.
  static bool is_unit(const torch::nn::Module* module) { return find_unit(module).first != nullptr; }

  // accel::unit_forward's machinery: fn(args...) with the parameters of the
  // unit `module` gathered (plainly fn(args...) when it is not a unit).
  template <class Fn, class... Args>
  static auto unit_call(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
    auto found = find_unit(module);  // (no structured binding: lambdas below capture these; clang 14)
    const std::shared_ptr<State> state = std::move(found.first);
    const std::size_t u = found.second;
    if (!state) return std::forward<Fn>(fn)(std::forward<Args>(args)...);
    {
      std::lock_guard lock(state->mutex);
      if (state->new_pass) {  // the first unit of a forward: the last forward's order guides prefetching
        if (!state->order.empty()) state->last_order = std::move(state->order);
        state->order.clear();
        state->new_pass = false;
      }
      if (std::find(state->order.begin(), state->order.end(), u) == state->order.end()) state->order.push_back(u);
      materialize(*state, u);
      const auto at = std::find(state->last_order.begin(), state->last_order.end(), u);
      if (at != state->last_order.end() && at + 1 != state->last_order.end()) fetch(*state, *(at + 1));
    }
    struct Release {  // after the forward, also when it throws
      State& state;
      std::size_t unit;
      ~Release() {
        std::lock_guard lock(state.mutex);
        release(state, unit);
      }
    } release_after{*state, u};
    const std::weak_ptr<State> weak = state;
    auto enter = [&]<class A>(A&& a) -> decltype(auto) {
      if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
        if (!a.requires_grad() || !at::GradMode::is_enabled()) return at::Tensor(a);
        at::Tensor in = a.view_as(a);  // a node of our own: its gradient means the unit's backward is done
        in.register_hook([weak, u](const at::Tensor&) {
          if (const auto s = weak.lock()) {
            std::lock_guard lock(s->mutex);
            if (s->alive) release(*s, u);
          }
        });
        return in;
      } else {
        return std::forward<A>(a);
      }
    };
    auto out = std::forward<Fn>(fn)(enter(std::forward<Args>(args))...);
    if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
      if (out.requires_grad() && at::GradMode::is_enabled())
        out.register_hook([weak, u](const at::Tensor&) {  // before the unit's backward
          if (const auto s = weak.lock()) {
            std::lock_guard lock(s->mutex);
            if (!s->alive) return;
            materialize(*s, u);
            const auto at = std::find(s->order.begin(), s->order.end(), u);
            if (at != s->order.end() && at != s->order.begin()) fetch(*s, *(at - 1));
          }
        });
    } else {
      static_assert(std::is_same_v<decltype(out), at::Tensor>,
                    "accel::unit_forward: a fully sharded unit's forward returns one at::Tensor");
    }
    return out;
  }

  bool distributed() const { return state_->group != nullptr; }
  std::size_t bucket_count() const { return state_->buckets.size(); }
  const GroupPtr& group() const { return state_->group; }
  // Called (on the autograd thread, under a lock) as each bucket's
  // all-reduce is issued: for logging, profiling and tests.
  void on_bucket_issued(std::function<void(std::size_t bucket)> callback) {
    std::lock_guard lock(state_->mutex);
    state_->on_issued = std::move(callback);
  }

 private:
  struct Bucket {
    // Every member has an initializer: GCC 14's -Wextra flags designated
    // initializers that leave out members without one.
    std::vector<at::Tensor> params{};
    std::vector<uint8_t> used{};  // per parameter: a gradient arrived since the last sync
    std::vector<uint8_t> seen{};  // per parameter: ... in the armed backward
    c10::ScalarType dtype;
    c10::Device device;
    detail::Packing packing;  // of `flat`: the gradients, then one used-flag per parameter
    std::size_t ready = 0;
    at::Tensor flat{};
    at::Tensor views{};  // gradient_as_bucket_view: the persistent bucket the gradients are views of
    Work<at::Tensor> work{};
    // Sharded: a rank's segment holds its chunk of each parameter
    // (chunks[i] elements at offsets[i]), then the used-flags; `segment`
    // elements in all.
    std::vector<int64_t> offsets{}, chunks{};
    int64_t segment = 0;
    std::vector<at::Tensor> shards{};
    std::vector<uint8_t> in_optimizer{};
    std::vector<at::Tensor> sums{};  // each shard's sum at the last gather (see check_shards)
    // FULL_SHARD: the unit whose parameters these are (-1: none), whether
    // they hold their values now, and a prefetch in flight.
    int64_t unit = -1;
    bool resident = true;
    Work<at::Tensor> gathering{};
  };
  struct Unit {
    const torch::nn::Module* module = nullptr;
    std::vector<std::size_t> buckets{};
  };
  struct State {
    std::mutex mutex;
    GroupPtr group;
    GroupPtr shard, replicate;  // sharded: see above
    int64_t replicas = 1;       // gradients are averaged over this many ranks
    std::vector<Bucket> buckets;
    std::size_t next = 0;   // buckets launch strictly in order: the same on every rank
    std::size_t fired = 0;  // parameters whose gradient arrived in the armed backward
    bool armed = false, alive = true;
    std::function<void(std::size_t)> on_issued;
    CommHook hook = comm_hooks::allreduce_hook();  // (see register_comm_hook)
    bool hooked = false;
    bool bucket_view = false;  // (see gradient_as_bucket_view)
    // FULL_SHARD: the units; the order they ran in this forward and the
    // last (prefetching follows it); summon_full_params() objects alive.
    std::vector<Unit> units;
    std::vector<std::size_t> order, last_order;
    bool new_pass = true;
    int held = 0;
  };

  // Which unit each of `params` belongs to (-1: none). A parameter in two
  // units, and one that shares storage or is a view, cannot be freed alone:
  // errors.
  std::vector<int64_t> assign_units(const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                    const std::vector<at::Tensor>& params) {
    std::unordered_map<const c10::TensorImpl*, int64_t> owner;
    for (std::size_t u = 0; u < units.size(); ++u) {
      state_->units.push_back(Unit{.module = units[u].get()});
      for (const auto& p : units[u]->parameters()) {
        if (!owner.emplace(p.unsafeGetTensorImpl(), static_cast<int64_t>(u)).second)
          throw InvalidArgument("accel::DataParallel: a parameter of shape " + c10::str(p.sizes()) +
                                " is in two fully sharded units; units must not nest or share parameters");
      }
    }
    std::unordered_map<const void*, int64_t> storages;  // parameters on each storage, the whole model's
    for (const auto& p : module_->parameters()) ++storages[p.storage().unsafeGetStorageImpl()];
    std::vector<int64_t> out;
    for (const auto& p : params) {
      const auto found = owner.find(p.unsafeGetTensorImpl());
      out.push_back(found == owner.end() ? -1 : found->second);
      if (out.back() < 0) continue;
      if (storages[p.storage().unsafeGetStorageImpl()] > 1 || p.storage_offset() != 0 || !p.is_contiguous() ||
          p.storage().nbytes() != static_cast<std::size_t>(p.numel()) * p.element_size())
        throw InvalidArgument("accel::DataParallel: under FULL_SHARD every parameter of a unit must own its "
                              "storage (a parameter of shape " + c10::str(p.sizes()) +
                              " is a view or shares storage: tied weights belong in no unit)");
    }
    return out;
  }
  using Registry = std::unordered_map<const torch::nn::Module*, std::pair<std::weak_ptr<State>, std::size_t>>;
  static Registry& registry() {
    static Registry units;  // every live DataParallel's units, for accel::unit_forward
    return units;
  }
  static std::mutex& registry_mutex() {
    static std::mutex mutex;
    return mutex;
  }
  // The live DataParallel state whose unit `module` is, and the unit's index (null: no unit).
  static std::pair<std::shared_ptr<State>, std::size_t> find_unit(const torch::nn::Module* module) {
    std::lock_guard lock(registry_mutex());
    const auto found = registry().find(module);
    if (found == registry().end()) return {nullptr, 0};
    return {found->second.first.lock(), found->second.second};
  }

  // A unit's parameters: fetch() issues the all-gather of its shards
  // (asynchronously, unless it holds them or one is in flight);
  // materialize() gives the parameters storage again and writes the gathered
  // values in (through variable_data(): version counters stay, so autograd
  // accepts the values it saved in forward); release() frees their storage.
  static void fetch(State& s, std::size_t u) {
    at::NoGradGuard no_grad;
    for (std::size_t b : s.units[u].buckets) {
      Bucket& bucket = s.buckets[b];
      if (bucket.resident || bucket.gathering.valid()) continue;
      try {
        bucket.gathering = all_gather_async(at::cat(bucket.shards), s.shard);
      } catch (const DistributedError& e) {
        throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") + e.what());
      }
    }
  }
  static void materialize(State& s, std::size_t u) {
    fetch(s, u);
    at::NoGradGuard no_grad;
    for (std::size_t b : s.units[u].buckets) {
      Bucket& bucket = s.buckets[b];
      if (bucket.resident) continue;
      at::Tensor rows;
      try {
        rows = bucket.gathering.wait();  // (S, segment without the flags)
      } catch (const DistributedError& e) {
        throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") + e.what());
      }
      bucket.gathering = {};
      for (std::size_t i = 0; i < bucket.params.size(); ++i) {
        c10::StorageImpl* storage = bucket.params[i].storage().unsafeGetStorageImpl();
        const std::size_t bytes = static_cast<std::size_t>(bucket.params[i].numel()) * bucket.params[i].element_size();
        c10::Allocator* allocator = storage->allocator() ? storage->allocator() : c10::GetAllocator(bucket.device.type());
        storage->set_data_ptr_noswap(allocator->allocate(bytes));
        storage->set_nbytes(bytes);
        at::Tensor values = bucket.params[i].variable_data();
        write_rows(rows, bucket.offsets[i], bucket.chunks[i], values);
      }
      bucket.resident = true;
    }
  }
  static void release(State& s, std::size_t u) {
    if (s.held > 0) return;  // summon_full_params() keeps them
    for (std::size_t b : s.units[u].buckets) {
      Bucket& bucket = s.buckets[b];
      if (!bucket.resident) continue;
      for (const auto& p : bucket.params) {
        c10::StorageImpl* storage = p.storage().unsafeGetStorageImpl();
        storage->set_data_ptr_noswap(c10::DataPtr(nullptr, p.device()));
        storage->set_nbytes(0);
      }
      bucket.resident = false;
    }
  }
  // The end of a backward: prefetches that found no use are waited for (a
  // collective cannot be taken back) and dropped, every unit is freed, and
  // the next forward records the order anew.
  static void end_unit_pass(State& s) {
    if (s.units.empty()) return;
    for (auto& bucket : s.buckets)
      if (bucket.gathering.valid()) {
        try {
          bucket.gathering.wait();
        } catch (const DistributedError& e) {
          throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                                 e.what());
        }
        bucket.gathering = {};
      }
    for (std::size_t u = 0; u < s.units.size(); ++u) release(s, u);
    s.new_pass = true;
  }

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
        accumulator->add_post_hook(std::make_unique<ReadyHook>(state_, b, i));
        accumulators_[k] = std::move(accumulator);  // hooks live as long as their node
      }
  }

  // What a hook gets for bucket b laid out in `buffer`. The parameters and
  // the gradients' views only for a registered hook: the default needs the
  // buffer alone, and this runs for every bucket of every step.
  static GradBucket grad_bucket(const State& s, std::size_t b, const at::Tensor& buffer) {
    const Bucket& bucket = s.buckets[b];
    GradBucket out{.buffer = buffer, .index = b, .is_last = b + 1 == s.buckets.size()};
    if (s.hooked) {
      out.parameters = bucket.params;
      for (std::size_t i = 0; i < bucket.params.size(); ++i) out.gradients.push_back(bucket.packing.view(buffer, i));
    }
    return out;
  }

  // Flattens a bucket's gradients and used-flags (pre-divided by the group
  // size, as DDP does) and issues its all-reduce without waiting.
  static void issue_bucket(State& state, std::size_t b) {
    Bucket& bucket = state.buckets[b];
    at::NoGradGuard no_grad;
    const std::size_t n = bucket.params.size();
    if (state.shard) {  // rank after rank: each rank's chunk of every gradient, then the flags
      const int64_t S = state.shard->getSize();
      bucket.flat = at::zeros({S * bucket.segment}, bucket.params.front().options());
      const at::Tensor rows = bucket.flat.view({S, bucket.segment});
      for (std::size_t i = 0; i < n; ++i)
        if (bucket.params[i].grad().defined()) {
          read_rows(bucket.params[i].grad(), rows, bucket.offsets[i], bucket.chunks[i]);
          if (bucket.unit >= 0) bucket.params[i].mutable_grad().reset();  // the shard's gradient accumulates it
        }
      rows.narrow(1, bucket.segment - static_cast<int64_t>(n), static_cast<int64_t>(n))
          .copy_(at::from_blob(bucket.used.data(), {1, static_cast<int64_t>(n)}, at::TensorOptions(c10::kByte)).expand({S, static_cast<int64_t>(n)}));
      bucket.flat.div_(state.replicas);
      try {
        bucket.work = reduce_scatter_async(bucket.flat, ReduceOp::SUM, state.shard);
      } catch (const DistributedError& e) {
        throw DistributedError(std::string("accel::DataParallel: issuing a gradient bucket's reduce_scatter failed: ") +
                               e.what());
      }
      if (state.on_issued) state.on_issued(b);
      return;
    }
    if (state.bucket_view) {  // the bucket is persistent and the gradients are its views
      if (!bucket.views.defined()) bucket.views = bucket.packing.buffer(bucket.params.front().options());
      bucket.flat = bucket.views;
    } else {
      bucket.flat = bucket.packing.buffer(bucket.params.front().options());
    }
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor& p = bucket.params[i];
      const at::Tensor view = bucket.packing.view(bucket.flat, i);
      if (!p.grad().defined()) {
        view.zero_();
      } else if (!state.bucket_view || !p.grad().is_alias_of(view)) {
        view.copy_(p.grad());
        if (state.bucket_view) p.mutable_grad() = view;  // (a gradient set to none, or the first backward)
      }
    }
    bucket.packing.view(bucket.flat, n)
        .copy_(at::from_blob(bucket.used.data(), {static_cast<int64_t>(n)}, at::TensorOptions(c10::kByte)));
    try {
      GradBucket hooked = grad_bucket(state, b, bucket.flat);
      bucket.work = state.hook(state.group, hooked);
    } catch (const DistributedError& e) {
      throw DistributedError(std::string("accel::DataParallel: issuing a gradient bucket's all_reduce failed: ") +
                             e.what());
    }
    if (state.on_issued) state.on_issued(b);
  }

  // The chunk layout: t flattened and zero-padded to S chunks of c, chunk r
  // being row r. read_rows copies t's rows into columns [off, off + c) of
  // rows (which start zeroed); write_rows copies them back into t;
  // read_chunk copies row r alone into `out`.
  static void read_rows(const at::Tensor& t, const at::Tensor& rows, int64_t off, int64_t c) {
    const at::Tensor flat = t.reshape({-1});
    const int64_t n = flat.numel(), full = c ? n / c : 0, rest = n - full * c;
    const at::Tensor columns = rows.narrow(1, off, c);
    if (full) columns.narrow(0, 0, full).copy_(flat.narrow(0, 0, full * c).view({full, c}));
    if (rest) columns[full].narrow(0, 0, rest).copy_(flat.narrow(0, full * c, rest));
  }
  static void write_rows(const at::Tensor& rows, int64_t off, int64_t c, at::Tensor& t) {
    const int64_t n = t.numel(), full = c ? n / c : 0, rest = n - full * c;
    const at::Tensor columns = rows.narrow(1, off, c);
    if (!t.is_contiguous()) {
      t.copy_(columns.reshape({-1}).narrow(0, 0, n).view(t.sizes()));
      return;
    }
    const at::Tensor flat = t.view({-1});
    if (full) flat.narrow(0, 0, full * c).view({full, c}).copy_(columns.narrow(0, 0, full));
    if (rest) flat.narrow(0, full * c, rest).copy_(columns[full].narrow(0, 0, rest));
  }
  static void read_chunk(const at::Tensor& t, int64_t r, int64_t c, const at::Tensor& out) {
    const at::Tensor flat = t.reshape({-1});
    const int64_t begin = std::min(r * c, flat.numel()), length = std::min(c, flat.numel() - begin);
    if (length) out.narrow(0, 0, length).copy_(flat.narrow(0, begin, length));
    if (length < c) out.narrow(0, length, c - length).zero_();
  }

  // Cuts every parameter into its chunks and makes this rank's shards.
  void make_shards() {
    const int64_t S = state_->shard->getSize(), r = state_->shard->getRank();
    at::NoGradGuard no_grad;
    for (std::size_t b = 0; b < state_->buckets.size(); ++b) {
      Bucket& bucket = state_->buckets[b];
      int64_t at = 0;
      for (std::size_t i = 0; i < bucket.params.size(); ++i) {
        const at::Tensor& p = bucket.params[i];
        const int64_t c = (p.numel() + S - 1) / S;
        bucket.offsets.push_back(at);
        bucket.chunks.push_back(c);
        at += c;
        at::Tensor shard = at::empty({c}, p.options());
        read_chunk(p, r, c, shard);
        shard.set_requires_grad(true);  // a leaf with a gradient, as the parameter it stands for
        bucket.shards.push_back(shard);
        bucket.in_optimizer.push_back(0);
        bucket.sums.push_back(shard.sum());
        shard_index_.emplace(p.unsafeGetTensorImpl(), std::make_pair(b, i));
      }
      bucket.segment = at + static_cast<int64_t>(bucket.params.size());
    }
  }

  // Sharded finish: each bucket's reduce-scatter waited for (and its
  // all-reduce along the replicate group), then each used parameter's
  // averaged chunk written to its shard's gradient, replacing it (the
  // parameter's own gradient holds everything accumulated since the step).
  void finish_sharded() {
    try {
      for (auto& bucket : state_->buckets) bucket.flat = bucket.work.wait();
      if (state_->replicate) {
        std::vector<Work<at::Tensor>> works;
        for (auto& bucket : state_->buckets) works.push_back(all_reduce_async(bucket.flat, ReduceOp::SUM, state_->replicate));
        for (std::size_t b = 0; b < works.size(); ++b) state_->buckets[b].flat = works[b].wait();
      }
    } catch (const DistributedError& e) {
      throw DistributedError(std::string("accel::DataParallel: a gradient bucket's reduction failed: ") + e.what());
    }
    for (auto& bucket : state_->buckets) {
      const auto n = static_cast<int64_t>(bucket.params.size());
      const at::Tensor used_anywhere = bucket.flat.narrow(0, bucket.segment - n, n).gt(0).to(c10::kCPU);
      const bool* used = used_anywhere.data_ptr<bool>();
      for (int64_t i = 0; i < n; ++i) {
        if (used[i]) {
          at::Tensor& shard = bucket.shards[static_cast<std::size_t>(i)];
          const at::Tensor averaged = bucket.flat.narrow(0, bucket.offsets[i], bucket.chunks[i]);
          if (!shard.grad().defined()) shard.mutable_grad() = averaged.clone();
          else if (bucket.unit >= 0) shard.mutable_grad().add_(averaged);  // the parameter's was released
          else shard.mutable_grad().copy_(averaged);  // the parameter's holds all since the step
        }
        bucket.used[static_cast<std::size_t>(i)] = 0;
      }
      bucket.flat = at::Tensor();
    }
  }

  struct ReadyHook : torch::autograd::FunctionPostHook {
    ReadyHook(std::shared_ptr<State> state, std::size_t bucket, std::size_t index)
        : state_(std::move(state)), bucket_(bucket), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      State& s = *state_;
      std::lock_guard lock(s.mutex);
      if (!s.alive) return outputs;
      Bucket& bucket = s.buckets[bucket_];
      bucket.used[index_] = 1;  // also under no_sync: the accumulated gradient counts at the next sync
      if (!s.armed || bucket.seen[index_]) return outputs;
      bucket.seen[index_] = 1;
      ++s.fired;
      if (++bucket.ready == bucket.params.size())
        while (s.next < s.buckets.size() && s.buckets[s.next].ready == s.buckets[s.next].params.size())
          issue_bucket(s, s.next++);
      return outputs;
    }
    std::shared_ptr<State> state_;
    std::size_t bucket_, index_;
  };

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<State> state_;
  // (LibTorch 2.15 holds autograd nodes by intrusive_ptr, earlier versions by shared_ptr.)
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> accumulators_;
  std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> shard_index_;  // (bucket, i)
  std::vector<const torch::optim::Optimizer*> optimizers_;  // those stepping the shards
};

// FULL_SHARD's unit boundary. LibTorch modules have no forward hooks, so in
// a model's forward a unit is called as
//     x = accel::unit_forward(fc1, x);        // instead of fc1->forward(x)
// which gathers the unit's parameters from their shards, runs its forward
// and frees them (see DataParallel). The same code runs under every
// strategy: a module that is no unit is simply called. On a Sequential that
// is not a unit itself, each child is called in turn, through
// unit_forward. A unit's forward returns one tensor.
template <class ModuleHolder, class... Args>
  requires requires(ModuleHolder& m) { m.ptr(); }
auto unit_forward(ModuleHolder& unit, Args&&... args) {
  return DataParallel::unit_call(
      unit.ptr().get(), [&unit](auto&&... a) { return unit->forward(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}
inline at::Tensor unit_forward(torch::nn::Sequential& sequential, at::Tensor x) {
  if (DataParallel::is_unit(sequential.ptr().get()))
    return DataParallel::unit_call(sequential.ptr().get(), [&sequential](const at::Tensor& in) { return sequential->forward(in); }, x);
  for (auto& child : *sequential)
    x = DataParallel::unit_call(child.ptr().get(), [&child](const at::Tensor& in) { return child.forward(in); }, x);
  return x;
}

ACCEL_NAMESPACE_END
