// accel/training/dp/sharded_state_dict.hpp: what checkpoints ask of a sharded DataParallel: each rank's pieces, written and loaded without gathering.
//
// The checkpoint family (checkpoint/shards.hpp, checkpoint/state.hpp) reads
// and writes a sharded model through one ShardedStateDict, which
// DataParallel::sharded_state_dict() returns: this rank's piece of each
// parameter, whether this rank writes pieces (under HSDP the first replica
// does), what a load reads for each parameter and putting it in place, and
// the two steps around a Module::load. Every method takes the engine's lock
// for its call (dp/state.hpp's Locked); on a model that is not sharded
// each one does nothing, and the pieces are whole tensors.
#pragma once

#include "accel/training/dp/shards.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// Before Module::load: it replaces each parameter's storage (set_), which
// reads the old storage's data pointer, so a unit's parameter at rest
// stops refusing access (it still holds nothing); reshard() afterwards takes
// the shards from what was loaded and puts the units at rest again.
inline void open_for_load(const Locked& held) {
  const State& s = held.state();
  for (const Unit& unit : sharded(s).units.list)
    for (const UnitBucket& ub : unit.buckets)
      if (!ub.resident)
        for (const auto& p : s.buckets[ub.bucket].params) allow_access(*p.storage().unsafeGetStorageImpl());
}
// Every shard taken again from its parameter (after Module::load, which
// gives every parameter storage of its own); units' parameters are freed
// again.
inline void reshard(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  at::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (std::size_t i = 0; i < s.buckets[b].params.size(); ++i) {
      ShardedBucket& bucket = z.buckets[b];
      read_chunk(s.buckets[b].params[i], z.shard->getRank(), bucket.chunks[i], bucket.shards[i]);
      bucket.sums[i] = bucket.shards[i].sum();
    }
  for (std::size_t u = 0; u < z.units.list.size(); ++u) {
    for (UnitBucket& ub : z.units.list[u].buckets) ub.resident = true;
    release(held, u);
  }
}

// This rank's Piece of parameter p (dp/strategy.hpp): a unit's parameter
// holds nothing at rest, so its shard's; any other's own chunk, which
// check_shards treats as the truth. None when p is not sharded here.
inline std::optional<Piece> piece_of(const Locked& held, const at::Tensor& p) {
  const Sharded& z = sharded(held.state());
  const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
  if (found == z.shard_index.end()) return std::nullopt;
  const auto [b, i] = found->second;
  const ShardedBucket& bucket = z.buckets[b];
  const auto [begin, length] = chunk_range(z.shard->getRank(), bucket.chunks[i], p.numel());
  const bool whole = bucket.unit < 0 || [&] {
    const UnitBucket& ub = unit_bucket(z.units, bucket.unit, b);
    return ub.resident && !ub.low;  // (low: in a policy's param_dtype)
  }();
  return Piece{whole ? p.detach().reshape({-1}).narrow(0, begin, length) : bucket.shards[i].narrow(0, 0, length),
               begin};
}
// What a load reads for parameter p, as (begin, length) of p flattened: a
// unit's parameter only its piece (its shard is all it keeps), unless
// summon_full_params() holds the units gathered; every other one whole.
inline std::pair<int64_t, int64_t> load_range(const Locked& held, const at::Tensor& p) {
  const Sharded& z = sharded(held.state());
  const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
  if (found == z.shard_index.end() || z.units.held > 0 || z.buckets[found->second.first].unit < 0)
    return {0, p.numel()};
  return chunk_range(z.shard->getRank(), z.buckets[found->second.first].chunks[found->second.second], p.numel());
}
// Puts what a load read in place: values(p) holds load_range(p)'s elements
// of each sharded parameter. Prefetches and gathered units are dropped
// first (they hold the old values); a parameter read whole gives its shard
// its chunk.
inline void load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) {
  State& s = held.state();
  Sharded& z = sharded(s);
  if (z.units.held == 0) end_unit_pass(held);
  at::NoGradGuard no_grad;
  const int64_t r = z.shard->getRank();
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (std::size_t i = 0; i < s.buckets[b].params.size(); ++i) {
      at::Tensor& p = s.buckets[b].params[i];
      ShardedBucket& bucket = z.buckets[b];
      const at::Tensor v = values(p).reshape({-1});
      if (bucket.unit < 0 || z.units.held > 0) {
        p.detach().copy_(v.view(p.sizes()));
        read_chunk(p, r, bucket.chunks[i], bucket.shards[i]);
      } else {
        bucket.shards[i].narrow(0, 0, v.numel()).copy_(v);
        bucket.shards[i].narrow(0, v.numel(), bucket.chunks[i] - v.numel()).zero_();
      }
      bucket.sums[i] = bucket.shards[i].sum();
    }
}

class ShardedStateDict {
 public:
  explicit ShardedStateDict(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // This rank's piece of parameter p (see Piece); none: p is not sharded here.
  std::optional<Piece> piece_of(const at::Tensor& p) const { return state_->mode->piece_of(Locked(*state_), p); }
  bool writes_pieces() const { return state_->mode->writes_pieces(); }
  std::pair<int64_t, int64_t> load_range(const at::Tensor& p) const {
    return state_->mode->load_range(Locked(*state_), p);
  }
  void load_values(const std::function<at::Tensor(const at::Tensor&)>& values) {
    state_->mode->load_values(Locked(*state_), values);
  }
  // Module::load into the parameters, then every shard taken again from
  // its parameter: open_for_load() before the load, reshard() after it.
  void open_for_load() { state_->mode->open_for_load(Locked(*state_)); }
  void reshard() { state_->mode->reshard(Locked(*state_)); }

 private:
  std::shared_ptr<State> state_;
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END
