// accel/training/dp_units.hpp: ZeRO-3's units: parameters gathered from their shards for a unit's forward and backward, freed after.
//
// FULL_SHARD's units hold no parameter memory at rest. accel::unit_forward
// calls unit_call, which gathers a unit's parameters (waiting for a prefetch
// where one was issued, prefetching the unit that came next in the last
// forward), runs the forward and frees them; hooks on the unit's output and
// inputs gather them again for its backward and free them after it.
// FullParameters (summon_full_params) keeps every unit gathered.
#pragma once

#include "accel/training/dp_state.hpp"

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
// its storage with another or is a view (it cannot be freed alone).
inline std::vector<int64_t> assign_units(State& state, const torch::nn::Module& module,
                                         const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                         const std::vector<at::Tensor>& params) {
  std::unordered_map<const torch::nn::Module*, std::string> name_of;
  for (const auto& named : module.named_modules()) name_of.emplace(named.value().get(), named.key());
  const std::unordered_set<const torch::nn::Module*> chosen = [&] {
    std::unordered_set<const torch::nn::Module*> set;
    for (const auto& unit : units) set.insert(unit.get());
    return set;
  }();
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
  // Each parameter's unit, over every module that registers it.
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  for (const auto& named : module.named_modules()) {
    const auto found = unit_of_module.find(named.value().get());
    const int64_t u = found == unit_of_module.end() ? -1 : found->second;
    for (const auto& p : named.value()->parameters(/*recurse=*/false)) {
      const auto [at, fresh] = owner.emplace(p.unsafeGetTensorImpl(), u);
      if (!fresh && at->second != u) at->second = -1;
    }
  }
  // Units that hold a parameter, numbered in the order given.
  std::vector<int64_t> renumbered(units.size(), -1);
  for (const auto& p : params) {
    const int64_t u = owner.at(p.unsafeGetTensorImpl());
    if (u >= 0) renumbered[static_cast<std::size_t>(u)] = 0;
  }
  for (std::size_t u = 0; u < units.size(); ++u)
    if (renumbered[u] == 0) {
      renumbered[u] = static_cast<int64_t>(state.units.size());
      state.units.push_back(Unit{.module = units[u].get()});
    }
  std::unordered_map<const void*, int64_t> storages;  // parameters on each storage, the whole model's
  for (const auto& p : unique_tensors(module.parameters())) ++storages[p.storage().unsafeGetStorageImpl()];
  std::vector<int64_t> out;
  for (const auto& p : params) {
    const int64_t u = owner.at(p.unsafeGetTensorImpl());
    out.push_back(u < 0 ? -1 : renumbered[static_cast<std::size_t>(u)]);
    if (u < 0) continue;
    if (storages[p.storage().unsafeGetStorageImpl()] > 1 || p.storage_offset() != 0 || !p.is_contiguous() ||
        p.storage().nbytes() != static_cast<std::size_t>(p.numel()) * p.element_size())
      throw InvalidArgument("accel::DataParallel: under FULL_SHARD every parameter of a unit must own its storage; " +
                            state.names.describe(p) + " of unit '" + name_of[units[static_cast<std::size_t>(u)].get()] +
                            "' is a view or shares its storage with another parameter (share the tensor itself to "
                            "tie weights: a tensor registered in several modules is one parameter)");
  }
  return out;
}
// A MixedPrecisionPolicy taken on (DataParallel's constructor, after the
// shards are made): its dtypes checked and kept, and each unit parameter's
// tensor at rest kept for release() to give back (see Use). The policy is
// the units': a parameter in no unit (the root's own, a tied weight) is
// whole while the model runs, in its own dtype, and computes in it (a unit's
// output_dtype hands such modules the activations in theirs).
inline void apply_policy(State& s, const MixedPrecisionPolicy& policy) {
  for (const auto& dtype : {policy.param_dtype, policy.reduce_dtype, policy.output_dtype})
    if (dtype && !c10::isFloatingType(*dtype))
      throw InvalidArgument(
          std::string("accel::DataParallel: a MixedPrecisionPolicy's dtypes are floating-point; got ") +
          c10::toString(*dtype));
  if (!s.shard)
    throw InvalidArgument(
        "accel::DataParallel: a MixedPrecisionPolicy is for sharded training (FULL_SHARD or HYBRID_SHARD); "
        "this model is not sharded (use mixed_precision = \"bf16\", autocast)");
  s.param_dtype = policy.param_dtype;
  s.reduce_dtype = policy.reduce_dtype ? policy.reduce_dtype : policy.param_dtype;  // (FSDP2's default)
  s.output_dtype = policy.output_dtype;
  s.cast_inputs = policy.cast_forward_inputs;
  if (!s.param_dtype) return;
  for (auto& bucket : s.buckets) {
    if (bucket.unit < 0 || !c10::isFloatingType(bucket.dtype) || bucket.dtype == *s.param_dtype) continue;
    for (const auto& p : bucket.params) {
      bucket.rest.push_back(p.variable_data());
      // The parameter's shape in param_dtype, on a storage of no bytes of its own (materialize points it).
      at::Tensor compute = at::empty({0}, p.options().dtype(*s.param_dtype).requires_grad(false));
      compute.unsafeGetTensorImpl()->set_sizes_contiguous(p.sizes());
      bucket.compute.push_back(std::move(compute));
    }
  }
}

// What a kernel that reads a unit's parameter at rest throws (where
// LibTorch lets it refuse; see refuses_at_rest below): its name, its unit's,
// and the way out.
inline void name_at_rest(State& state, const torch::nn::Module& module) {
  std::unordered_map<const torch::nn::Module*, std::string> modules;
  for (const auto& named : module.named_modules()) modules[named.value().get()] = named.key();
  for (auto& bucket : state.buckets) {
    if (bucket.unit < 0) continue;
    const std::string unit = modules[state.units[static_cast<std::size_t>(bucket.unit)].module];
    for (const auto& p : bucket.params)
      bucket.at_rest.push_back(
          "accel: the parameter '" + state.names.first(p) + "' is sharded at rest (fully sharded unit '" + unit +
          "'): it holds its values only while its unit runs through accel::unit_forward. Call the unit as "
          "accel::unit_forward(unit, ...), not unit->forward(...); read parameters under summon_full_params(); "
          "a module outside the unit that reads it (a tied head) must register it too (register_parameter): a "
          "weight registered in several modules is kept whole at the root");
  }
}

// A parameter at rest has no memory; its shape stays. Where LibTorch lets a
// storage refuse every access with a message of its own (StorageImpl's
// custom data-pointer error, with a way to lift it: newer LibTorch, such as
// the pip wheel's), a parameter at rest keeps its size in bytes and any
// kernel that reads it throws that message: this parameter is sharded at
// rest, call its unit through accel::unit_forward. Without it the storage's
// size is 0 too, so that a view or a checked read is LibTorch's own error,
// and an element-wise kernel, which checks neither, reads a null pointer.
template <class Storage = c10::StorageImpl>
inline constexpr bool refuses_at_rest = requires(Storage& s, std::optional<std::string> m) {
  s.release_data_and_set_meta_custom_data_ptr_error_msg_(m);
  s.clear_data_ptr_access_error_msg_();
};
template <class Storage>
inline void refuse_access(Storage& storage, const std::string& why) {
  if constexpr (refuses_at_rest<Storage>) storage.release_data_and_set_meta_custom_data_ptr_error_msg_(why);
}
template <class Storage>
inline void allow_access(Storage& storage) {
  if constexpr (refuses_at_rest<Storage>) storage.clear_data_ptr_access_error_msg_();
}

// The all-gather of a bucket's shards (`source`: `owned` as it is, or cast
// to a policy's param_dtype) into its parameters' places: once the Work
// lands, into[i] holds parameter i's values. On Gloo with CPU tensors the gather is point to point
// (staging.hpp), without a buffer of c10d's per step: where the bucket's
// pieces are large (large_pieces, dp_state.hpp) and every into[i]
// contiguous, each peer's chunk of each parameter is received straight
// into into[i] (nothing copied after: the values are written once);
// otherwise each peer's whole segment is one message into rows from the
// pool, copied out when it lands. (Every rank takes the same path: the
// sizes and the layout of the parameters are the same everywhere.) Elsewhere c10d's all-gather into the
// rows (NCCL's is the fast one), copied out likewise.
inline Work<at::Tensor> gather_params(State& s, const Bucket& bucket, const at::Tensor& source,
                                      std::vector<at::Tensor> into) {
  const int64_t S = s.shard->getSize(), width = source.numel(), r = s.shard->getRank();
  c10d::ProcessGroup* g = detail::enter_all_gather(source, s.shard);  // (a shard group has 2 ranks or more)
  const bool direct = detail::direct_gather_fits(*g, source, source);
  const bool pieces =
      direct && large_pieces(bucket, static_cast<int64_t>(source.element_size())) &&
      std::all_of(into.begin(), into.end(), [](const at::Tensor& t) { return t.is_cpu() && t.is_contiguous(); });
  if (pieces) {
    std::vector<at::Tensor> mine;
    for (std::size_t i = 0; i < into.size(); ++i)
      mine.push_back(source.narrow(0, bucket.offsets[i], chunk_range(r, bucket.chunks[i], into[i].numel()).second));
    auto place = [&](int from, std::size_t i) {
      const auto [begin, length] = chunk_range(from, bucket.chunks[i], into[i].numel());
      return into[i].view({-1}).narrow(0, begin, length);
    };
    return Work<at::Tensor>(
        detail::then(detail::start_all_gather_pieces(*g, mine, place, kGatherTag), [] { return at::Tensor(); }));
  }
  at::Tensor rows = s.pool.take(S * width, source.options()).view({S, width});
  auto copy_out = [&s, rows, into = std::move(into), offsets = bucket.offsets, chunks = bucket.chunks]() mutable {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < into.size(); ++i) write_rows(rows, offsets[i], chunks[i], into[i]);
    s.pool.give(rows);
    return at::Tensor();
  };
  if (direct)
    return Work<at::Tensor>(
        detail::then(detail::start_all_gather_direct(*g, source, rows, kGatherTag), std::move(copy_out)));
  return Work<at::Tensor>(detail::then(detail::start_all_gather_rows(*g, source, rows), std::move(copy_out)));
}

// A unit's parameters: fetch() takes one pooled buffer per bucket, the
// parameters one after another in it (each starting 64 bytes aligned), and
// issues the all-gather of their shards into it (asynchronously, unless it
// holds them or one is in flight); materialize() waits for it and points
// the parameters' storage into the buffer; release() takes the storage away
// again (the buffer goes back to the pool, and the next unit of about its
// size takes it).
//
// What autograd saved in the forward (a Linear saves its weight, W.t(), a
// view) refers to the parameter's storage object, never to the pool's
// buffer: the storage object stays the parameter's for good, and only
// where it points changes. So the unit's backward, which gathers the
// parameters again first (the hook on its output), reads its own values
// wherever they landed that time, and a saved tensor read while the unit
// is at rest finds no memory (an error), never the values of the unit that
// took the buffer after it. The storage object stays, and with it the
// version counter: autograd accepts the values it saved in forward.
//
// Under a MixedPrecisionPolicy's param_dtype (FSDP2's), a gather for
// compute (Use::compute: a unit's forward and backward) sends the shards
// cast to that dtype, and the parameters take it while the unit runs: each
// parameter's tensor is given its `compute` tensor (that dtype, its own
// storage object pointed into the buffer as above, for the same reason;
// TensorImpl::shallow_copy_from, what Tensor::set_data does, without
// set_data's reset of the gradient accumulator: the accumulator made at
// wrapping, in the parameter's own dtype, stays, and autograd casts the
// gradient to that dtype before it accumulates, so gradients and shards
// keep the parameters' dtype); release() gives each its tensor at rest
// back. Every other gather (summon_full_params, save_model, free_memory)
// is in the parameters' own dtype (Use::full), as FSDP's full-precision
// state dict.
enum class Use { compute, full };
inline int64_t aligned(int64_t elements, int64_t element_size) {
  const int64_t per_line = std::max<int64_t>(1, 64 / element_size);
  return (elements + per_line - 1) / per_line * per_line;
}
// Where each parameter of a unit's bucket starts in its buffer of elements
// of element_size bytes, and the buffer's length (the last entry).
inline std::vector<int64_t> places_in_full(const Bucket& bucket, int64_t element_size) {
  std::vector<int64_t> at{0};
  for (const auto& p : bucket.params) at.push_back(at.back() + aligned(p.numel(), element_size));
  return at;
}
// Whether a gather for `use` is in the policy's param_dtype. Not while
// summon_full_params() holds the units: they stay in full precision, and a
// unit called then computes in it.
inline bool gathers_low(const State& s, const Bucket& bucket, Use use) {
  return use == Use::compute && !bucket.rest.empty() && s.held == 0;
}
inline c10::ScalarType gathered_dtype(const State& s, const Bucket& bucket) {
  return bucket.low ? *s.param_dtype : bucket.dtype;
}
inline void release_bucket(State& s, Bucket& bucket);
// Waits for the bucket's gather in flight. A failed one has ended every
// message of it (staging.hpp's Outstanding), so its buffers go back to the
// pool, and the collective's own error (operation, group, rank) goes on to
// the caller under what the engine was doing.
inline void wait_gathering(State& s, Bucket& bucket) {
  try {
    bucket.gathering.wait();
  } catch (const DistributedError& e) {
    bucket.gathering = {};
    release_bucket(s, bucket);  // (not resident: the buffers only)
    throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                           detail::error_text(e));
  }
  bucket.gathering = {};
}
// The storage parameter i of the bucket computes on: its own, or under a
// policy's param_dtype its `compute` tensor's.
inline c10::StorageImpl* computing_storage(const Bucket& bucket, std::size_t i) {
  return (bucket.low ? bucket.compute[i] : bucket.params[i]).storage().unsafeGetStorageImpl();
}
// A bucket's parameters back at rest, and its buffers back in the pool.
inline void release_bucket(State& s, Bucket& bucket) {
  if (bucket.resident)
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      if (bucket.low)  // (its own storage never left rest)
        bucket.params[i].unsafeGetTensorImpl()->shallow_copy_from(bucket.rest[i].getIntrusivePtr());
      c10::StorageImpl* storage = computing_storage(bucket, i);
      storage->set_data_ptr_noswap(c10::DataPtr(nullptr, bucket.params[i].device()));
      if constexpr (refuses_at_rest<>) refuse_access(*storage, bucket.at_rest[i]);
      else storage->set_nbytes(0);
    }
  for (at::Tensor* lent : {&bucket.full, &bucket.cast}) {
    s.pool.give(*lent);
    *lent = at::Tensor();
  }
  bucket.resident = false;
  bucket.low = false;
}
inline void fetch(State& s, std::size_t u, Use use) {
  at::NoGradGuard no_grad;
  for (std::size_t b : s.units[u].buckets) {
    Bucket& bucket = s.buckets[b];
    const bool low = gathers_low(s, bucket, use);
    if (bucket.resident || bucket.gathering.valid()) {
      if (bucket.low == low) continue;
      if (bucket.gathering.valid()) wait_gathering(s, bucket);  // (a collective cannot be taken back)
      release_bucket(s, bucket);                                // in the other precision: gathered again
    }
    bucket.low = low;
    const c10::ScalarType dtype = gathered_dtype(s, bucket);
    const std::vector<int64_t> at = places_in_full(bucket, static_cast<int64_t>(c10::elementSize(dtype)));
    bucket.full = s.pool.take(at.back(), bucket.owned.options().dtype(dtype));
    if (low) bucket.cast = s.pool.take(bucket.owned.numel(), bucket.full.options()).copy_(bucket.owned);
    std::vector<at::Tensor> into;
    for (std::size_t i = 0; i < bucket.params.size(); ++i)
      into.push_back(bucket.full.narrow(0, at[i], bucket.params[i].numel()));
    try {
      bucket.gathering = gather_params(s, bucket, low ? bucket.cast : bucket.owned, std::move(into));
    } catch (const DistributedError& e) {
      release_bucket(s, bucket);  // (not resident: the buffers only)
      throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                             detail::error_text(e));
    }
  }
}
inline void materialize(State& s, std::size_t u, Use use) {
  fetch(s, u, use);
  for (std::size_t b : s.units[u].buckets) {
    Bucket& bucket = s.buckets[b];
    if (bucket.resident) continue;
    wait_gathering(s, bucket);
    s.pool.give(bucket.cast);
    bucket.cast = at::Tensor();
    const auto element_size = static_cast<int64_t>(bucket.full.element_size());
    const std::vector<int64_t> at = places_in_full(bucket, element_size);
    auto* base = static_cast<char*>(bucket.full.data_ptr());
    for (std::size_t i = 0; i < bucket.params.size(); ++i) {
      at::Tensor& p = bucket.params[i];
      c10::StorageImpl* storage = computing_storage(bucket, i);
      allow_access(*storage);
      // Not owning: the pool keeps the memory; release() takes it back before the buffer is reused.
      storage->set_data_ptr_noswap(c10::DataPtr(base + at[i] * element_size, bucket.device));
      storage->set_nbytes(static_cast<std::size_t>(p.numel() * element_size));
      if (bucket.low) p.unsafeGetTensorImpl()->shallow_copy_from(bucket.compute[i].getIntrusivePtr());
    }
    bucket.resident = true;
  }
}
inline void release(State& s, std::size_t u) {
  if (s.held > 0) return;  // summon_full_params() keeps them
  for (std::size_t b : s.units[u].buckets)
    if (s.buckets[b].resident) release_bucket(s, s.buckets[b]);
}
// The dtype unit u's parameters hold now, where a policy changed it (for
// cast_inputs); none otherwise.
inline std::optional<c10::ScalarType> computes_in(const State& s, std::size_t u) {
  for (std::size_t b : s.units[u].buckets)
    if (s.buckets[b].low) return s.param_dtype;
  return std::nullopt;
}
// Unit u left so that its module works without the engine, whose pool
// goes (release_module, ~DataParallel): a resident unit's parameters get
// memory of their own (copied out of the pool's buffer); a unit gathered
// for compute in a policy's param_dtype goes back to rest instead (what it
// holds is not the parameters' values in their dtype), and so does one
// that holds nothing (at rest, or a gather that failed or is still in
// flight: waited for first, its failure ignored, so that no message still
// writes into the buffers given back). Nothing here reads a parameter at
// rest: the only values copied are those the pool's buffer holds.
inline void own_storage(State& s, std::size_t u) {
  for (std::size_t b : s.units[u].buckets) {
    Bucket& bucket = s.buckets[b];
    if (bucket.gathering.valid()) {
      try {
        bucket.gathering.wait();
      } catch (const std::exception&) {  // (see above)
      }
      bucket.gathering = {};
    }
    if (!bucket.resident || bucket.low) {
      release_bucket(s, bucket);
      continue;
    }
    if (!bucket.full.defined()) continue;  // (its parameters hold memory of their own already)
    for (auto& p : bucket.params) {
      const at::Tensor copy = p.detach().clone();  // its own memory, on p's device
      c10::DataPtr own = copy.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, p.device()));
      p.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(own));
    }
    s.pool.give(bucket.full);
    bucket.full = at::Tensor();
  }
}
// Every unit left as own_storage leaves it, for a DataParallel going away:
// never throws (a destructor calls it, perhaps while an error of the
// caller's unwinds). A unit whose copy fails (out of memory) goes back to
// rest: its parameters then point at nothing, never at a freed buffer.
inline void let_go_of_units(State& s) noexcept {
  for (std::size_t u = 0; u < s.units.size(); ++u) {
    try {
      own_storage(s, u);
    } catch (const std::exception& e) {
      std::cerr << "accel: a fully sharded unit's parameters could not be kept as the engine went ("
                << detail::error_text(e) << "); they are at rest (no values)" << std::endl;
      for (std::size_t b : s.units[u].buckets) release_bucket(s, s.buckets[b]);
    }
  }
}
// The end of a backward: prefetches that found no use are waited for (a
// collective cannot be taken back) and dropped, every unit is freed, and
// the next forward records the order anew.
inline void end_unit_pass(State& s) {
  if (s.units.empty()) return;
  for (auto& bucket : s.buckets)
    if (bucket.gathering.valid()) {
      wait_gathering(s, bucket);
      release_bucket(s, bucket);  // (not resident: the buffers only)
    }
  for (std::size_t u = 0; u < s.units.size(); ++u) release(s, u);
  s.new_pass = true;
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

  // (made by DataParallel::summon_full_params, which has gathered them)
  FullParameters(std::shared_ptr<State> state, bool writeback) : state_(std::move(state)), writeback_(writeback) {}

 private:
  std::shared_ptr<State> state_;
  bool writeback_;
};

// Whole parameters one unit at a time, for an export that must not hold
// every unit at once (Accelerator::save_model): whole(p) gathers the unit
// of parameter p (a collective on the shard group: every rank asks for the
// same parameters in the same order), releasing the unit it gathered
// before, and returns p, which holds its values until the next call; a
// tensor in no unit comes back as it is. Units gathered for other reasons
// (a prefetch, a forward left half done) are released first.
class UnitByUnit {
 public:
  explicit UnitByUnit(std::shared_ptr<State> state) : state_(std::move(state)) {
    std::lock_guard lock(state_->mutex);
    if (state_->held == 0) end_unit_pass(*state_);
  }
  UnitByUnit(const UnitByUnit&) = delete;
  UnitByUnit& operator=(const UnitByUnit&) = delete;
  ~UnitByUnit() {
    std::lock_guard lock(state_->mutex);
    if (current_) release(*state_, *current_);
  }
  const at::Tensor& whole(const at::Tensor& p) {
    std::lock_guard lock(state_->mutex);
    const auto found = state_->shard_index.find(p.unsafeGetTensorImpl());
    if (found == state_->shard_index.end() || state_->buckets[found->second.first].unit < 0) return p;
    const auto u = static_cast<std::size_t>(state_->buckets[found->second.first].unit);
    if (current_ != u) {
      if (current_) release(*state_, *current_);
      current_ = u;
      materialize(*state_, u, Use::full);
    }
    return p;
  }

 private:
  std::shared_ptr<State> state_;
  std::optional<std::size_t> current_;
};

// True on a thread while accel::checkpoint (checkpoint.hpp) runs a forward
// again inside the backward. A unit called then keeps its parameters
// gathered after its forward, because the backward of that forward follows
// at once (its input hook frees them after it), and prefetches nothing: the
// next unit of the forward has had its backward already.
inline bool& recomputing() {
  static thread_local bool on = false;
  return on;
}

// accel::unit_forward's machinery: fn(args...) with the parameters of the
// unit `module` gathered (plainly fn(args...) when it is not a unit).
template <class Fn, class... Args>
inline auto unit_call(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
  auto found = find_unit(module);  // (no structured binding: lambdas below capture these; clang 14)
  const std::shared_ptr<State> state = std::move(found.first);
  const std::size_t u = found.second;
  if (!state) return std::forward<Fn>(fn)(std::forward<Args>(args)...);
  std::optional<c10::ScalarType> cast;    // (a policy's cast_forward_inputs: the dtype the unit computes in)
  std::optional<c10::ScalarType> output;  // (a policy's output_dtype)
  {
    std::lock_guard lock(state->mutex);
    if (state->new_pass) {  // the first unit of a forward: the last forward's order guides prefetching
      if (!state->order.empty()) state->last_order = std::move(state->order);
      state->order.clear();
      state->new_pass = false;
    }
    if (std::find(state->order.begin(), state->order.end(), u) == state->order.end()) state->order.push_back(u);
    materialize(*state, u, Use::compute);
    cast = state->cast_inputs ? computes_in(*state, u) : std::nullopt;
    output = state->output_dtype;
    const auto at = std::find(state->last_order.begin(), state->last_order.end(), u);
    if (state->prefetch_forward && !recomputing() && at != state->last_order.end() && at + 1 != state->last_order.end())
      fetch(*state, *(at + 1), Use::compute);
  }
  struct Release {  // after the forward, also when it throws
    State& state;
    std::size_t unit;
    bool now;
    ~Release() {
      if (!now) return;
      std::lock_guard lock(state.mutex);
      release(state, unit);
    }
  } release_after{*state, u, !recomputing()};
  const std::weak_ptr<State> weak = state;
  auto enter = [&]<class A>(A&& a) -> decltype(auto) {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
      const bool casts = cast && a.is_floating_point() && a.scalar_type() != *cast;
      if (!a.requires_grad() || !at::GradMode::is_enabled()) return casts ? a.to(*cast) : at::Tensor(a);
      // A node of our own: its gradient means the unit's backward is done.
      at::Tensor in = casts ? a.to(*cast) : a.view_as(a);
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
          materialize(*s, u, Use::compute);
          const auto at = std::find(s->order.begin(), s->order.end(), u);
          if (s->prefetch_backward && at != s->order.end() && at != s->order.begin())
            fetch(*s, *(at - 1), Use::compute);
        }
      });
    if (output && out.is_floating_point() && out.scalar_type() != *output) return out.to(*output);
  } else {
    static_assert(std::is_same_v<decltype(out), at::Tensor>,
                  "accel::unit_forward: a fully sharded unit's forward returns one at::Tensor");
  }
  return out;
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
