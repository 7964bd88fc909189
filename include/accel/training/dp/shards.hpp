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
  const auto found = s.shard_index.find(p.unsafeGetTensorImpl());
  return found == s.shard_index.end() ? at::Tensor() : s.buckets[found->second.first].shards[found->second.second];
}

// Puts the shards in place of this module's parameters in the optimizer's
// groups (so it steps, and keeps state for, the shards only). Before its
// first step; not an LBFGS (its line search needs whole-vector products).
inline void shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) {
  State& s = held.state();
  if (!s.shard) return;
  bool touched = false;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      const auto found = s.shard_index.find(p.unsafeGetTensorImpl());
      if (found == s.shard_index.end()) continue;
      if (!optimizer.state().empty())
        throw InvalidArgument(
            "accel::Accelerator::prepare: the optimizer has already stepped; under sharding "
            "prepare it before its first step (its state becomes per-shard)");
      if (dynamic_cast<torch::optim::LBFGS*>(&optimizer))
        throw InvalidArgument(
            "accel::Accelerator::prepare: LBFGS cannot step shards (its line search needs "
            "products over whole parameters); use NO_SHARD");
      Bucket& bucket = s.buckets[found->second.first];
      p = bucket.shards[found->second.second];
      bucket.in_optimizer[found->second.second] = 1;
      touched = true;
    }
  if (touched && std::find(s.optimizers.begin(), s.optimizers.end(), &optimizer) == s.optimizers.end())
    s.optimizers.push_back(&optimizer);
}

inline bool steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) {
  const State& s = held.state();
  return std::find(s.optimizers.begin(), s.optimizers.end(), &optimizer) != s.optimizers.end();
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
  if (!s.shard) return;
  at::NoGradGuard no_grad;
  const int64_t r = s.shard->getRank();
  // Per shard that may differ: [differs from its chunk, differs from its sum at the gather]. On the CPU
  // at::equal compares without allocating or a device sync, so only a shard that differs is looked at.
  std::vector<std::pair<Bucket*, std::size_t>> looked;
  std::vector<at::Tensor> differs;
  for (auto& bucket : s.buckets)
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      if (!bucket.in_optimizer[i])
        throw InvalidArgument("accel::Accelerator::backward: the parameter " + s.names.describe(bucket.params[i]) +
                              " of a sharded model is in no prepared optimizer; under sharding its optimizer "
                              "steps the shards, so prepare it (accelerator.prepare(model, optimizer))");
      if (bucket.unit >= 0) continue;  // gathered from the shards at each use: never stale
      const at::Tensor flat = bucket.params[i].reshape({-1});
      const auto [begin, length] = chunk_range(r, bucket.chunks[i], flat.numel());
      const at::Tensor shard = bucket.shards[i].narrow(0, 0, length), chunk = flat.narrow(0, begin, length);
      if (flat.is_cpu() && at::equal(shard, chunk)) continue;
      looked.emplace_back(&bucket, i);
      differs.push_back(shard.ne(chunk).any());
      differs.push_back(bucket.shards[i].sum().ne(bucket.sums[i]));
    }
  if (differs.empty()) return;
  const at::Tensor found = at::stack(differs).to(c10::kCPU);
  const bool* flag = found.data_ptr<bool>();
  for (const auto& [bucket, i] : looked) {
    const bool changed = flag[0], stepped = flag[1];
    flag += 2;
    if (!changed) continue;
    if (stepped)
      throw InvalidArgument(
          "accel::Accelerator::backward: under sharding, step the optimizer through the "
          "handle accelerator.prepare() returned (its step() gathers the updated shards "
          "into the parameters); the parameters this forward used are stale");
    read_chunk(bucket->params[i], r, bucket->chunks[i], bucket->shards[i]);
    bucket->sums[i] = bucket->shards[i].sum();
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
  if (!s.shard) return;
  end_unit_pass(held);  // a prefetch made before this step holds old values
  at::NoGradGuard no_grad;
  // At most kGathersInFlight all-gathers at once (where they land in rows, those come from the pool).
  std::deque<std::pair<std::size_t, Work<at::Tensor>>> works;
  auto land = [&] {
    Bucket& bucket = s.buckets[works.front().first];
    works.front().second.wait();
    works.pop_front();
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      // The values were written through variable_data(), which no version
      // counter sees; this is an in-place change of the parameter.
      bucket.params[i].unsafeGetTensorImpl()->bump_version();
      bucket.params[i].mutable_grad().reset();
      at::sum_out(bucket.sums[i], bucket.shards[i]);
    }
  };
  try {
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      Bucket& bucket = s.buckets[b];
      if (bucket.unit >= 0) continue;  // FULL_SHARD: gathered when the unit runs
      if (works.size() >= kGathersInFlight) land();
      std::vector<at::Tensor> into;
      for (const auto& p : bucket.params) into.push_back(p.variable_data());
      works.emplace_back(b, gather_params(held, bucket, bucket.owned, std::move(into)));
    }
    while (!works.empty()) land();
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: gathering the parameters from their shards failed: ") +
                           detail::error_text(e));
  }
}

// Before Module::load: it replaces each parameter's storage (set_), which
// reads the old storage's data pointer, so a unit's parameter at rest
// stops refusing access (it still holds nothing); reshard() afterwards takes
// the shards from what was loaded and puts the units at rest again.
inline void open_for_load(const Locked& held) {
  const State& s = held.state();
  for (const auto& bucket : s.buckets)
    if (bucket.unit >= 0 && !bucket.resident)
      for (const auto& p : bucket.params) allow_access(*p.storage().unsafeGetStorageImpl());
}
// Every shard taken again from its parameter (after Module::load, which
// gives every parameter storage of its own); units' parameters are freed
// again.
inline void reshard(const Locked& held) {
  State& s = held.state();
  if (!s.shard) return;
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets)
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      read_chunk(bucket.params[i], s.shard->getRank(), bucket.chunks[i], bucket.shards[i]);
      bucket.sums[i] = bucket.shards[i].sum();
    }
  for (std::size_t u = 0; u < s.units.size(); ++u) {
    for (std::size_t b : s.units[u].buckets) s.buckets[b].resident = true;
    release(held, u);
  }
}

// For sharded checkpoints (checkpoint/shards.hpp), which neither gather
// nor load whole what a rank keeps in pieces. This rank's piece of
// parameter p: elements [begin, begin + values.numel()) of p flattened,
// `values` a flat view (a unit's parameter holds nothing at rest: its
// shard's; any other's own chunk, which check_shards treats as the truth).
// None when p is not sharded here.
struct Piece {
  at::Tensor values;
  int64_t begin = 0;
};
inline std::optional<Piece> piece_of(const Locked& held, const at::Tensor& p) {
  const State& s = held.state();
  const auto found = s.shard_index.find(p.unsafeGetTensorImpl());
  if (!s.shard || found == s.shard_index.end()) return std::nullopt;
  const Bucket& bucket = s.buckets[found->second.first];
  const std::size_t i = found->second.second;
  const auto [begin, length] = chunk_range(s.shard->getRank(), bucket.chunks[i], p.numel());
  const bool whole = bucket.unit < 0 || (bucket.resident && !bucket.low);  // (low: in a policy's param_dtype)
  return Piece{whole ? p.detach().reshape({-1}).narrow(0, begin, length) : bucket.shards[i].narrow(0, 0, length),
               begin};
}
// What a load reads for parameter p, as (begin, length) of p flattened: a
// unit's parameter only its piece (its shard is all it keeps), unless
// summon_full_params() holds the units gathered; every other one whole.
inline std::pair<int64_t, int64_t> load_range(const Locked& held, const at::Tensor& p) {
  const State& s = held.state();
  const auto found = s.shard_index.find(p.unsafeGetTensorImpl());
  if (!s.shard || found == s.shard_index.end() || s.held > 0 || s.buckets[found->second.first].unit < 0)
    return {0, p.numel()};
  return chunk_range(s.shard->getRank(), s.buckets[found->second.first].chunks[found->second.second], p.numel());
}
// Puts what a load read in place: values(p) holds load_range(p)'s elements
// of each sharded parameter. Prefetches and gathered units are dropped
// first (they hold the old values); a parameter read whole gives its shard
// its chunk.
inline void load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) {
  State& s = held.state();
  if (!s.shard) return;
  if (s.held == 0) end_unit_pass(held);
  at::NoGradGuard no_grad;
  const int64_t r = s.shard->getRank();
  for (auto& bucket : s.buckets)
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      const at::Tensor v = values(bucket.params[i]).reshape({-1});
      if (bucket.unit < 0 || s.held > 0) {
        bucket.params[i].detach().copy_(v.view(bucket.params[i].sizes()));
        read_chunk(bucket.params[i], r, bucket.chunks[i], bucket.shards[i]);
      } else {
        bucket.shards[i].narrow(0, 0, v.numel()).copy_(v);
        bucket.shards[i].narrow(0, v.numel(), bucket.chunks[i] - v.numel()).zero_();
      }
      bucket.sums[i] = bucket.shards[i].sum();
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
// cannot be put back together here). The hooks do nothing afterwards.
inline void release_module(const Locked& held) {
  State& s = held.state();
  if (s.shard) {
    end_unit_pass(held);
    for (std::size_t u = 0; u < s.units.size(); ++u) {
      materialize(held, u, Use::full);
      own_storage(held, u);  // the module outlives the pool
    }
    ++s.held;  // (release() frees nothing while held)
    // Each shard's parameter, to put back in its place.
    std::unordered_map<const c10::TensorImpl*, const at::Tensor*> parameter_of;
    for (const auto& bucket : s.buckets)
      for (std::size_t i = 0; i < bucket.shards.size(); ++i)
        parameter_of[bucket.shards[i].unsafeGetTensorImpl()] = &bucket.params[i];
    for (torch::optim::Optimizer* optimizer : s.optimizers)
      for (auto& group : optimizer->param_groups())
        for (auto& p : group.params()) {
          const auto found = parameter_of.find(p.unsafeGetTensorImpl());
          if (found == parameter_of.end()) continue;
          erase_state(optimizer->state(), p.unsafeGetTensorImpl());
          p = *found->second;
        }
    s.optimizers.clear();
  }
  s.alive = false;
}

// Cuts every parameter into its chunks and makes this rank's shards.
inline void make_shards(State& s) {
  const int64_t S = s.shard->getSize(), r = s.shard->getRank();
  at::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    Bucket& bucket = s.buckets[b];
    int64_t at = 0;
    for (const auto& p : bucket.params) {
      const int64_t c = (p.numel() + S - 1) / S;
      bucket.offsets.push_back(at);
      bucket.chunks.push_back(c);
      at += c;
    }
    bucket.owned = at::empty({at}, bucket.params.front().options().requires_grad(false));
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      const at::Tensor& p = bucket.params[i];
      // detach(): a leaf of its own on owned's memory, not an autograd view
      // of it (optimizers step it in place, as they step a parameter).
      at::Tensor shard = bucket.owned.narrow(0, bucket.offsets[i], bucket.chunks[i]).detach();
      read_chunk(p, r, bucket.chunks[i], shard);
      shard.set_requires_grad(true);  // a leaf with a gradient, as the parameter it stands for
      bucket.shards.push_back(shard);
      bucket.in_optimizer.push_back(0);
      bucket.sums.push_back(shard.sum());
      s.shard_index.emplace(p.unsafeGetTensorImpl(), std::make_pair(b, i));
    }
    bucket.segment = at + static_cast<int64_t>(bucket.params.size());
    bucket.used_anywhere = at::empty({static_cast<int64_t>(bucket.params.size())}, at::TensorOptions(c10::kBool));
  }
}

}  // namespace detail::dp

ACCEL_NAMESPACE_END
