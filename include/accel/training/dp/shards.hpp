// accel/training/dp/shards.hpp: ZeRO-2's shards: each parameter cut in S chunks, this rank's kept and stepped.
//
// Given a shard group of S ranks, every parameter is cut into S equal
// chunks (the last padded with zeros) and rank r keeps chunk r as its
// shard, a tensor of its own that the optimizer steps instead of the
// parameter, so optimizer state is 1/S. A bucket's gradients are
// reduce-scattered (dp/reducer.hpp) so that each rank receives its chunk of
// every parameter, averaged along a replicate group too where there is one
// (HSDP); finish_sharded writes them to the shards' gradients. After the
// optimizer steps the shards, gather_shards all-gathers them into every
// parameter. ZeRO-3's units (dp/units.hpp) gather theirs at each use instead.
#pragma once

#include "accel/training/dp/scatter.hpp"
#include "accel/training/dp/units.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// The shard standing in for parameter p; undefined when p is not one of
// this module's sharded parameters.
inline at::Tensor shard_of(const State& s, const at::Tensor& p) {
  const Sharded& z = sharded(s);
  const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
  return found == z.shard_index.end() ? at::Tensor() : z.buckets[found->second.first].shards[found->second.second];
}

// Puts the shards in place of this module's parameters in the optimizer's
// groups (so it steps, and keeps state for, the shards only). Before its
// first step; not an LBFGS (its line search needs whole-vector products).
inline void shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) {
  Sharded& z = sharded(held.state());
  bool touched = false;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
      if (found == z.shard_index.end()) continue;
      if (!optimizer.state().empty())
        throw InvalidArgument(
            "accel::Accelerator::prepare: the optimizer has already stepped; under sharding "
            "prepare it before its first step (its state becomes per-shard)");
      if (dynamic_cast<torch::optim::LBFGS*>(&optimizer))
        throw InvalidArgument(
            "accel::Accelerator::prepare: LBFGS cannot step shards (its line search needs "
            "products over whole parameters); use NO_SHARD");
      ShardedBucket& bucket = z.buckets[found->second.first];
      p = bucket.shards[found->second.second];
      bucket.in_optimizer[found->second.second] = 1;
      touched = true;
    }
  if (touched && std::find(z.optimizers.begin(), z.optimizers.end(), &optimizer) == z.optimizers.end())
    z.optimizers.push_back(&optimizer);
}

inline bool steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) {
  const Sharded& z = sharded(held.state());
  return std::find(z.optimizers.begin(), z.optimizers.end(), &optimizer) != z.optimizers.end();
}

// Before a backward, each shard against its chunk of the parameter
// (LibTorch's optimizers write through .data(), which version counters do
// not see, so values are compared; one pass over 1/S of the parameters
// and one device sync). A shard that changed since the last gather_shards()
// means its optimizer was stepped directly, not through the handle
// prepare() returned, and this forward used stale parameters: an error.
// A parameter changed since then (by hand, Module::load) is taken into its
// shard. Every shard must be in a prepared optimizer.
inline void check_shards(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  at::NoGradGuard no_grad;
  const int64_t r = z.shard->getRank();
  // Per shard that may differ: [differs from its chunk, differs from its sum at the gather]. On the CPU
  // at::equal compares without allocating or a device sync, so only a shard that differs is looked at.
  std::vector<std::pair<std::size_t, std::size_t>> looked;
  std::vector<at::Tensor> differs;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const Bucket& layout = s.buckets[b];
    ShardedBucket& bucket = z.buckets[b];
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      if (!bucket.in_optimizer[i])
        throw InvalidArgument("accel::Accelerator::backward: the parameter " + s.names.describe(layout.params[i]) +
                              " of a sharded model is in no prepared optimizer; under sharding its optimizer "
                              "steps the shards, so prepare it (accelerator.prepare(model, optimizer))");
      if (bucket.unit >= 0) continue;  // gathered from the shards at each use: never stale
      const at::Tensor flat = layout.params[i].reshape({-1});
      const auto [begin, length] = chunk_range(r, bucket.chunks[i], flat.numel());
      const at::Tensor shard = bucket.shards[i].narrow(0, 0, length), chunk = flat.narrow(0, begin, length);
      if (flat.is_cpu() && at::equal(shard, chunk)) continue;
      looked.emplace_back(b, i);
      differs.push_back(shard.ne(chunk).any());
      differs.push_back(bucket.shards[i].sum().ne(bucket.sums[i]));
    }
  }
  if (differs.empty()) return;
  const at::Tensor found = at::stack(differs).to(c10::kCPU);
  const bool* flag = found.data_ptr<bool>();
  for (const auto& [b, i] : looked) {
    const bool changed = flag[0], stepped = flag[1];
    flag += 2;
    if (!changed) continue;
    if (stepped)
      throw InvalidArgument(
          "accel::Accelerator::backward: under sharding, step the optimizer through the "
          "handle accelerator.prepare() returned (its step() gathers the updated shards "
          "into the parameters); the parameters this forward used are stale");
    ShardedBucket& bucket = z.buckets[b];
    read_chunk(s.buckets[b].params[i], r, bucket.chunks[i], bucket.shards[i]);
    bucket.sums[i] = bucket.shards[i].sum();
  }
}

// How many of gather_shards' all-gathers may be in flight at once: two, so
// that one bucket's messages travel while the next is issued. (They land
// in the parameters themselves, so this bounds the pool only where a
// bucket of small parameters lands in rows.)
inline constexpr std::size_t kGathersInFlight = 2;

// After the optimizer stepped the shards: every parameter all-gathered
// from them (one all_gather per bucket, straight into the parameters where
// it can: gather_params), and the parameters' gradients released (the
// shards' hold this step's).
inline void gather_shards(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  end_unit_pass(held);  // a prefetch made before this step holds old values
  at::NoGradGuard no_grad;
  // At most kGathersInFlight all-gathers at once (where they land in rows, those come from the pool).
  std::deque<std::pair<std::size_t, Work<at::Tensor>>> works;
  auto land = [&] {
    const std::size_t b = works.front().first;
    works.front().second.wait();
    works.pop_front();
    for (std::size_t i = 0; i < s.buckets[b].params.size(); ++i) {
      // The values were written through variable_data(), which no version
      // counter sees; this is an in-place change of the parameter.
      at::Tensor& p = s.buckets[b].params[i];
      p.unsafeGetTensorImpl()->bump_version();
      p.mutable_grad().reset();
      at::sum_out(z.buckets[b].sums[i], z.buckets[b].shards[i]);
    }
  };
  try {
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      if (z.buckets[b].unit >= 0) continue;  // FULL_SHARD: gathered when the unit runs
      if (works.size() >= kGathersInFlight) land();
      std::vector<at::Tensor> into;
      for (const auto& p : s.buckets[b].params) into.push_back(p.variable_data());
      works.emplace_back(b, gather_params(held, b, z.buckets[b].owned, std::move(into)));
    }
    while (!works.empty()) land();
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: gathering the parameters from their shards failed: ") +
                           detail::error_text(e));
  }
}

// An optimizer's key for one parameter's state (LibTorch 1.x keys it by the
// parameter's address as text, c10::guts::to_string's, 2.x by the address).
template <class StateMap>
typename StateMap::key_type state_key(const StateMap&, c10::TensorImpl* parameter) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream key;
    key << static_cast<const void*>(parameter);
    return key.str();
  } else {
    return parameter;
  }
}
// Drops an optimizer's state for one parameter.
template <class StateMap>
void erase_state(StateMap& state, c10::TensorImpl* parameter) {
  state.erase(state_key(state, parameter));
}

// The module given back for local use (Accelerator::free_memory): every
// unit's parameters gathered for good (a collective on the shard group),
// and every optimizer that stepped the shards given the parameters back in
// their place, its state for the shards dropped (the optimizer starts
// afresh: LibTorch's per-parameter state types are its own, so 1/S of each
// cannot be put back together here). DataParallel then makes its hooks inert.
inline void release_module(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  end_unit_pass(held);
  for (std::size_t u = 0; u < z.units.list.size(); ++u) {
    materialize(held, u, Use::full);
    own_storage(held, u);  // the module outlives the pool
  }
  ++z.units.held;  // (release() frees nothing while held)
  // Each shard's parameter, to put back in its place.
  std::unordered_map<const c10::TensorImpl*, const at::Tensor*> parameter_of;
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (std::size_t i = 0; i < z.buckets[b].shards.size(); ++i)
      parameter_of[z.buckets[b].shards[i].unsafeGetTensorImpl()] = &s.buckets[b].params[i];
  for (torch::optim::Optimizer* optimizer : z.optimizers)
    for (auto& group : optimizer->param_groups())
      for (auto& p : group.params()) {
        const auto found = parameter_of.find(p.unsafeGetTensorImpl());
        if (found == parameter_of.end()) continue;
        erase_state(optimizer->state(), p.unsafeGetTensorImpl());
        p = *found->second;
      }
  z.optimizers.clear();
}

// Cuts every parameter into its chunks and makes this rank's shards.
inline void make_shards(State& s) {
  Sharded& z = sharded(s);
  const int64_t S = z.shard->getSize(), r = z.shard->getRank();
  at::NoGradGuard no_grad;
  z.buckets.resize(s.buckets.size());
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const std::vector<at::Tensor>& params = s.buckets[b].params;
    ShardedBucket& bucket = z.buckets[b];
    int64_t at = 0;
    for (const auto& p : params) {
      const int64_t c = (p.numel() + S - 1) / S;
      bucket.offsets.push_back(at);
      bucket.chunks.push_back(c);
      at += c;
    }
    bucket.owned = at::empty({at}, params.front().options().requires_grad(false));
    for (std::size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      // detach(): a leaf of its own on owned's memory, not an autograd view
      // of it (optimizers step it in place, as they step a parameter).
      at::Tensor shard = bucket.owned.narrow(0, bucket.offsets[i], bucket.chunks[i]).detach();
      read_chunk(p, r, bucket.chunks[i], shard);
      shard.set_requires_grad(true);  // a leaf with a gradient, as the parameter it stands for
      bucket.shards.push_back(shard);
      bucket.in_optimizer.push_back(0);
      bucket.sums.push_back(shard.sum());
      z.shard_index.emplace(p.unsafeGetTensorImpl(), std::make_pair(b, i));
      StandIns::instance().add(p, shard);
    }
    bucket.segment = at + static_cast<int64_t>(params.size());
    bucket.used_anywhere = at::empty({static_cast<int64_t>(params.size())}, at::TensorOptions(c10::kBool));
  }
}

}  // namespace detail::dp

ACCEL_NAMESPACE_END
