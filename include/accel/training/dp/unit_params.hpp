// accel/training/dp/unit_params.hpp: ZeRO-3's parameters gathered into a pooled buffer for a unit's forward and backward, and put back at rest after.
#pragma once

#include "accel/training/dp/chunks.hpp"
#include "accel/training/dp/unit_plan.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
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
// (distributed/pieces.hpp), without a buffer of c10d's per step: where the bucket's
// pieces are large (large_pieces, dp/state.hpp) and every into[i]
// contiguous, each peer's chunk of each parameter is received straight
// into into[i] (nothing copied after: the values are written once);
// otherwise each peer's whole segment is one message into rows from the
// pool, copied out when it lands. (Every rank takes the same path: the
// sizes and the layout of the parameters are the same everywhere.) Elsewhere c10d's all-gather into the
// rows (NCCL's is the fast one), copied out likewise.
inline Work<at::Tensor> gather_params(const Locked& held, std::size_t b, const at::Tensor& source,
                                      std::vector<at::Tensor> into) {
  State& s = held.state();
  const Sharded& z = sharded(s);
  const ShardedBucket& bucket = z.buckets[b];
  const int64_t S = z.shard->getSize(), width = source.numel(), r = z.shard->getRank();
  c10d::ProcessGroup* g = detail::enter_all_gather(source, z.shard);  // (a shard group has 2 ranks or more)
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
  Lease lease = s.pool.take(S * width, source.options());
  const at::Tensor rows = lease.tensor().view({S, width});
  // (the lease goes with the landing: the rows return to the pool once copied out, or with the Work)
  auto copy_out = [lease = std::move(lease), rows, into = std::move(into), offsets = bucket.offsets,
                   chunks = bucket.chunks]() mutable {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < into.size(); ++i) write_rows(rows, offsets[i], chunks[i], into[i]);
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
inline std::vector<int64_t> places_in_full(const Bucket& layout, int64_t element_size) {
  std::vector<int64_t> at{0};
  for (const auto& p : layout.params) at.push_back(at.back() + aligned(p.numel(), element_size));
  return at;
}
// Whether a gather for `use` is in the policy's param_dtype. Not while
// summon_full_params() holds the units: they stay in full precision, and a
// unit called then computes in it.
inline bool gathers_low(const Units& units, const UnitBucket& ub, Use use) {
  return use == Use::compute && !ub.rest.empty() && units.held == 0;
}
inline c10::ScalarType gathered_dtype(const Units& units, const Bucket& layout, const UnitBucket& ub) {
  return ub.low ? *units.param_dtype : layout.dtype;
}
inline void release_bucket(const Bucket& layout, UnitBucket& ub);
// Waits for the bucket's gather in flight. A failed one has ended every
// message of it (distributed/pieces.hpp's Outstanding), so its buffers go back to the
// pool, and the collective's own error (operation, group, rank) goes on to
// the caller under what the engine was doing.
inline void wait_gathering(const Bucket& layout, UnitBucket& ub) {
  try {
    ub.gathering.wait();
  } catch (const DistributedError& e) {
    ub.gathering = {};
    release_bucket(layout, ub);  // (not resident: the buffers only)
    throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                           detail::error_text(e));
  }
  ub.gathering = {};
}
// The storage parameter i of the bucket computes on: its own, or under a
// policy's param_dtype its `compute` tensor's.
inline c10::StorageImpl* computing_storage(const Bucket& layout, const UnitBucket& ub, std::size_t i) {
  return (ub.low ? ub.compute[i] : layout.params[i]).storage().unsafeGetStorageImpl();
}
// A bucket's parameters back at rest, and its buffers back in the pool.
inline void release_bucket(const Bucket& layout, UnitBucket& ub) {
  if (ub.resident)
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      if (ub.low)  // (its own storage never left rest)
        layout.params[i].unsafeGetTensorImpl()->shallow_copy_from(ub.rest[i].getIntrusivePtr());
      c10::StorageImpl* storage = computing_storage(layout, ub, i);
      storage->set_data_ptr_noswap(c10::DataPtr(nullptr, layout.params[i].device()));
      if constexpr (refuses_at_rest<>) refuse_access(*storage, ub.at_rest[i]);
      else storage->set_nbytes(0);
    }
  ub.full.reset();
  ub.cast.reset();
  ub.resident = false;
  ub.low = false;
}
inline void fetch(const Locked& held, std::size_t u, Use use) {
  State& s = held.state();
  Sharded& z = sharded(s);
  at::NoGradGuard no_grad;
  for (UnitBucket& ub : z.units.list[u].buckets) {
    const Bucket& layout = s.buckets[ub.bucket];
    const at::Tensor& owned = z.buckets[ub.bucket].owned;
    const bool low = gathers_low(z.units, ub, use);
    if (ub.resident || ub.gathering.valid()) {
      if (ub.low == low) continue;
      if (ub.gathering.valid()) wait_gathering(layout, ub);  // (a collective cannot be taken back)
      release_bucket(layout, ub);                            // in the other precision: gathered again
    }
    ub.low = low;
    const c10::ScalarType dtype = gathered_dtype(z.units, layout, ub);
    const std::vector<int64_t> at = places_in_full(layout, static_cast<int64_t>(c10::elementSize(dtype)));
    ub.full = s.pool.take(at.back(), owned.options().dtype(dtype));
    if (low) {
      ub.cast = s.pool.take(owned.numel(), ub.full.tensor().options());
      ub.cast.tensor().copy_(owned);
    }
    std::vector<at::Tensor> into;
    for (std::size_t i = 0; i < layout.params.size(); ++i)
      into.push_back(ub.full.tensor().narrow(0, at[i], layout.params[i].numel()));
    try {
      ub.gathering = gather_params(held, ub.bucket, low ? ub.cast.tensor() : owned, std::move(into));
    } catch (const DistributedError& e) {
      release_bucket(layout, ub);  // (not resident: the buffers only)
      throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                             detail::error_text(e));
    }
  }
}
inline void materialize(const Locked& held, std::size_t u, Use use) {
  State& s = held.state();
  fetch(held, u, use);
  for (UnitBucket& ub : sharded(s).units.list[u].buckets) {
    const Bucket& layout = s.buckets[ub.bucket];
    if (ub.resident) continue;
    wait_gathering(layout, ub);
    ub.cast.reset();
    const auto element_size = static_cast<int64_t>(ub.full.tensor().element_size());
    const std::vector<int64_t> at = places_in_full(layout, element_size);
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      const at::Tensor& p = layout.params[i];
      c10::StorageImpl* storage = computing_storage(layout, ub, i);
      allow_access(*storage);
      // Borrowed from the lease: the buffer is not taken again while this pointer lives (release() drops it).
      storage->set_data_ptr_noswap(ub.full.borrow(static_cast<std::size_t>(at[i] * element_size), layout.device));
      storage->set_nbytes(static_cast<std::size_t>(p.numel() * element_size));
      if (ub.low) p.unsafeGetTensorImpl()->shallow_copy_from(ub.compute[i].getIntrusivePtr());
    }
    ub.resident = true;
  }
}
inline void release(const Locked& held, std::size_t u) {
  State& s = held.state();
  Units& units = sharded(s).units;
  if (units.held > 0) return;  // summon_full_params() keeps them
  for (UnitBucket& ub : units.list[u].buckets)
    if (ub.resident) release_bucket(s.buckets[ub.bucket], ub);
}
// The dtype unit u's parameters hold now, where a policy changed it (for
// cast_inputs); none otherwise.
inline std::optional<c10::ScalarType> computes_in(const Locked& held, std::size_t u) {
  const Units& units = sharded(held.state()).units;
  for (const UnitBucket& ub : units.list[u].buckets)
    if (ub.low) return units.param_dtype;
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
inline void own_storage(const Locked& held, std::size_t u) {
  State& s = held.state();
  for (UnitBucket& ub : sharded(s).units.list[u].buckets) {
    const Bucket& layout = s.buckets[ub.bucket];
    if (ub.gathering.valid()) {
      try {
        ub.gathering.wait();
      } catch (const std::exception&) {  // (see above)
      }
      ub.gathering = {};
    }
    if (!ub.resident || ub.low) {
      release_bucket(layout, ub);
      continue;
    }
    if (!ub.full) continue;  // (its parameters hold memory of their own already)
    for (const auto& p : layout.params) {
      const at::Tensor copy = p.detach().clone();  // its own memory, on p's device
      c10::DataPtr own = copy.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, p.device()));
      p.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(own));
    }
    ub.full.reset();
  }
}
// Every unit left as own_storage leaves it, for a DataParallel going away:
// never throws (a destructor calls it, perhaps while an error of the
// caller's unwinds). A unit whose copy fails (out of memory) goes back to
// rest: its parameters then point at nothing, never at a freed buffer.
inline void let_go_of_units(const Locked& held) noexcept {
  State& s = held.state();
  Units& units = sharded(s).units;
  for (std::size_t u = 0; u < units.list.size(); ++u) {
    try {
      own_storage(held, u);
    } catch (const std::exception& e) {
      std::cerr << "accel: a fully sharded unit's parameters could not be kept as the engine went ("
                << detail::error_text(e) << "); they are at rest (no values)" << std::endl;
      for (UnitBucket& ub : units.list[u].buckets) release_bucket(s.buckets[ub.bucket], ub);
    }
  }
}
// The end of a backward: prefetches that found no use are waited for (a
// collective cannot be taken back) and dropped, every unit is freed, and
// the next forward records the order anew. Nothing without units.
inline void end_unit_pass(const Locked& held) {
  State& s = held.state();
  Units& units = sharded(s).units;
  if (units.list.empty()) return;
  for (Unit& unit : units.list)
    for (UnitBucket& ub : unit.buckets)
      if (ub.gathering.valid()) {
        wait_gathering(s.buckets[ub.bucket], ub);
        release_bucket(s.buckets[ub.bucket], ub);  // (not resident: the buffers only)
      }
  for (std::size_t u = 0; u < units.list.size(); ++u) release(held, u);
  units.new_pass = true;
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
