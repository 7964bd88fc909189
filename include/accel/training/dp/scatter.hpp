// accel/training/dp/scatter.hpp: ZeRO's gradient reduce-scatter: issued from reused buffers, landed in the shards' gradients.
//
// Under sharding a bucket's gradients are laid out rank after rank (each
// rank's chunk of every gradient, then one used-flag per parameter) and
// reduce-scattered over the shard group, so that each rank receives the
// sum of its own chunks; along a replicate group (HSDP) that is all-reduced
// too. issue_scatter starts it as soon as the bucket is complete;
// land_scatter waits for it and gives the averaged chunks to the shards'
// gradients. The buffers are leases from the state's pool (dp/buffers.hpp) and
// few buckets are in flight (room_in_flight): issuing one more lands the
// oldest first, so the pool holds one or two large buckets' buffers, or
// small ones' up to a few MiB, never the whole model's. A bucket
// of large parameters on Gloo skips the laying out: its reduce-scatter runs
// point to point from the gradients themselves (start_direct_scatter).
#pragma once

#include "accel/distributed/exchange.hpp"
#include "accel/training/dp/chunks.hpp"
#include "accel/training/dp/state.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// Whether one more bucket (`bytes`) may join the `count` reduce-scatters
// in flight (holding `in_flight` bytes of gradients) without landing the
// oldest first. Each holds its gradients (whole until reduced) and what it
// receives: about twice the bucket's size. Without units (SHARD_GRAD_OP,
// whose whole parameters stay resident anyway) two, so a bucket's
// messages also overlap the next layer's backward: one measured up to 6 %
// slower there. With fully sharded units (FULL_SHARD, HYBRID_SHARD:
// chosen to save memory) as many as together hold at most kAheadBytes
// (dp/state.hpp), and at least one: a large unit's bucket lands the one
// before it, as FSDP2 keeps one reduce-scatter outstanding (measured on
// the sharding benchmark, tests/bench/run_sharding_bench.sh, 16 MiB units
// at 2 and 4 processes: the same step time as two, the peak 32 MiB lower);
// small units' buckets stay in flight together instead of each waiting for
// the one before, which made every small unit's backward wait for a round
// trip to every peer (the small LLaMA of run_llama_bench.sh's `small` set).
inline bool room_in_flight(const Sharded& z, std::size_t count, int64_t in_flight, int64_t bytes) {
  if (z.units.list.empty()) return count < 2;
  return count == 0 || in_flight + bytes <= kAheadBytes;
}

// A bucket's pooled buffers given back (after its reduce-scatter landed, or
// was waited for and dropped).
inline void give_back(ShardedBucket& bucket) {
  bucket.laid_out.reset();
  bucket.received.reset();
  bucket.folded.reset();
}

// The bucket's owned_grads, made on first use: the shards' gradients, then
// room for the used-flags (`segment` elements), so a reduction can fold
// straight into it.
inline const at::Tensor& owned_grads(ShardedBucket& bucket, const at::TensorOptions& options) {
  if (!bucket.owned_grads.defined()) bucket.owned_grads = at::empty({bucket.segment}, options);
  return bucket.owned_grads;
}

// Waits for bucket b's reduce-scatter (and its all-reduce along the
// replicate group), then gives each used parameter's shard its averaged
// chunk as gradient. Where the reduction folded straight into owned_grads
// (every shard's gradient was none: the first use, or zero_grad() set them
// to none) each gradient becomes its piece of it, kept across steps;
// otherwise the chunks are added into the gradients there, as a
// parameter's gradient accumulates. The parameters' own gradients were
// released when the bucket was issued.
inline void land_scatter(const Locked& held, std::size_t b) {
  State& s = held.state();
  Sharded& z = sharded(s);
  Bucket& layout = s.buckets[b];
  ShardedBucket& bucket = z.buckets[b];
  at::Tensor reduced;
  try {
    s.timeline.stamp(b, &BucketTimes::waiting);
    reduced = layout.work.wait();  // (owned_grads, or the pooled buffer it folded into)
    if (z.replicate) reduced = all_reduce_async(reduced, ReduceOp::SUM, z.replicate).wait();
    s.timeline.stamp(b, &BucketTimes::landed);
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: a gradient bucket's reduction failed: ") +
                           detail::error_text(e));
  }
  const auto n = static_cast<int64_t>(layout.params.size());
  const bool all_used = used_by_all_here(layout);  // (then the reduced flags need not be read)
  if (!all_used) {
    const at::Tensor flags = reduced.narrow(0, bucket.segment - n, n);
    if (flags.is_cpu()) at::gt_out(bucket.used_anywhere, flags, 0);  // (no allocation per step)
    else bucket.used_anywhere.copy_(flags.gt(0));
  }
  const bool* used = all_used ? nullptr : bucket.used_anywhere.data_ptr<bool>();
  const bool in_place = bucket.owned_grads.defined() && reduced.is_alias_of(bucket.owned_grads);
  for (int64_t i = 0; i < n; ++i) {
    if (all_used || used[i]) {
      at::Tensor& shard = bucket.shards[static_cast<std::size_t>(i)];
      const at::Tensor averaged = reduced.narrow(0, bucket.offsets[i], bucket.chunks[i]);
      if (in_place) {
        shard.mutable_grad() = averaged.detach();  // (a leaf's gradient, not an autograd view)
      } else if (shard.grad().defined()) {
        shard.mutable_grad().add_(averaged);
      } else {
        shard.mutable_grad() =
            owned_grads(bucket, bucket.owned.options()).narrow(0, bucket.offsets[i], bucket.chunks[i]).detach();
        shard.mutable_grad().copy_(averaged);
      }
    }
    layout.used[static_cast<std::size_t>(i)] = 0;
  }
  give_back(bucket);
}

// Bucket b's reduce-scatter point to point, straight from the gradients
// (Gloo with CPU tensors, and pieces as large as gather_params wants them,
// dp/unit_params.hpp): to each peer its chunk of every gradient, a message each,
// and this rank's used-flags; what arrives lands in the rows of `received`
// by sender, this rank's own row copied in from its gradients, and the
// rows are folded as the all-to-all's would be (the same sum in the same
// order; the division by the replicas follows the fold, since the
// gradients are not ours to change). No laid-out copy of the bucket is
// made: each gradient is sent from where autograd left it, and kept alive
// until the bucket lands. Every rank must take the same path, so the
// choice rests on what all ranks share (the backend, the device, the
// bucket's sizes), never on this rank's gradients: one that is none here
// (a parameter this rank did not use) sends zeros, as the rows path lays
// them out.
inline bool scatters_directly(const State& s, std::size_t b) {
  return sharded(s).shard->getBackendName() == "gloo" && s.buckets[b].device.is_cpu() &&
         large_pieces(sharded(s).buckets[b], static_cast<int64_t>(c10::elementSize(reduce_dtype(s, b))));
}
inline Work<at::Tensor> start_direct_scatter(const State& s, std::size_t b, const at::Tensor& out) {
  const Sharded& z = sharded(s);
  const Bucket& layout = s.buckets[b];
  const ShardedBucket& bucket = z.buckets[b];
  const std::size_t n = layout.params.size();
  const int64_t S = z.shard->getSize(), me = z.shard->getRank(), flags = bucket.segment - static_cast<int64_t>(n);
  const at::Tensor rows = bucket.received.tensor().view({S, bucket.segment});
  std::vector<at::Tensor> grads;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& p = layout.params[i];
    // (in the reduction's dtype: a policy's reduce_dtype casts)
    grads.push_back(p.grad().defined() ? p.grad().reshape({-1}).to(rows.scalar_type())
                                       : at::zeros({p.numel()}, rows.options()));
    p.mutable_grad().reset();  // the shard's gradient accumulates it from here
    const auto [begin, length] = chunk_range(me, bucket.chunks[i], grads[i].numel());
    rows[me].narrow(0, bucket.offsets[i], length).copy_(grads[i].narrow(0, begin, length));
    if (length < bucket.chunks[i]) rows.narrow(1, bucket.offsets[i] + length, bucket.chunks[i] - length).zero_();
  }
  write_used_flags(rows[me].narrow(0, flags, static_cast<int64_t>(n)), layout);
  auto sent = [&](int to, std::size_t i) {
    if (i == n) return rows[me].narrow(0, flags, static_cast<int64_t>(n));
    const auto [begin, length] = chunk_range(to, bucket.chunks[i], grads[i].numel());
    return grads[i].narrow(0, begin, length);
  };
  auto into = [&](int from, std::size_t i) {
    if (i == n) return rows[from].narrow(0, flags, static_cast<int64_t>(n));
    return rows[from].narrow(0, bucket.offsets[i], chunk_range(me, bucket.chunks[i], grads[i].numel()).second);
  };
  auto pending = detail::start_exchange_pieces(*z.shard, n + 1, sent, into, kGatherTag, detail::kDirectScatter);
  // (grads moved into the landing only now: `sent` reads them above, and a
  // function's arguments may be evaluated in any order)
  return Work<at::Tensor>(detail::then(
      std::move(pending), [rows, out = at::Tensor(out), grads = std::move(grads), replicas = s.replicas]() mutable {
        detail::fold_rows_into(rows, out, ReduceOp::SUM);
        if (replicas != 1) out.div_(replicas);
        return out;
      }));
}

// Lays bucket b's gradients out rank after rank (pre-divided by the number
// of replicas, as DDP does) and starts its reduce-scatter without waiting,
// first landing the oldest buckets in flight while room_in_flight says no.
// Large buckets on Gloo go point to point instead (start_direct_scatter).
inline void issue_scatter(const Locked& held, std::size_t b) {
  State& s = held.state();
  Sharded& z = sharded(s);
  std::size_t count = 0;
  int64_t in_flight = 0;
  for (std::size_t e = 0; e < b; ++e)
    if (s.buckets[e].work.valid()) {
      ++count;
      in_flight += s.buckets[e].packing.bytes();
    }
  for (std::size_t e = 0; e < b && !room_in_flight(z, count, in_flight, s.buckets[b].packing.bytes()); ++e)
    if (s.buckets[e].work.valid()) {
      land_scatter(held, e);
      --count;
      in_flight -= s.buckets[e].packing.bytes();
    }
  Bucket& layout = s.buckets[b];
  ShardedBucket& bucket = z.buckets[b];
  at::NoGradGuard no_grad;
  const std::size_t n = layout.params.size();
  const int64_t S = z.shard->getSize();
  // (the shards' options, in the reduction's dtype: a parameter may hold a
  // policy's param_dtype now, while its unit runs)
  const c10::TensorOptions options = bucket.owned.options().dtype(reduce_dtype(s, b));
  // Where the folded chunks land: straight in the shards' gradients when
  // every one is none (the usual step, after zero_grad()) and the reduction
  // is in their dtype, so that landing copies nothing; else in a pooled
  // buffer, added into them when it lands.
  const bool into_grads =
      options.dtype() == bucket.owned.dtype() &&
      std::none_of(bucket.shards.begin(), bucket.shards.end(), [](const at::Tensor& t) { return t.grad().defined(); });
  try {
    bucket.received = s.pool.take(S * bucket.segment, options);
    c10d::ProcessGroup* g = detail::enter_reduce_scatter(bucket.received.tensor(), ReduceOp::SUM, z.shard);
    if (!into_grads) bucket.folded = s.pool.take(bucket.segment, options);
    const at::Tensor out = into_grads ? owned_grads(bucket, options) : bucket.folded.tensor();
    if (scatters_directly(s, b)) {
      layout.work = start_direct_scatter(s, b, out);
      return;
    }
    bucket.laid_out = s.pool.take(S * bucket.segment, options);  // (every element written below)
    const at::Tensor& laid_out = bucket.laid_out.tensor();
    const at::Tensor rows = laid_out.view({S, bucket.segment});
    for (std::size_t i = 0; i < n; ++i)
      if (layout.params[i].grad().defined()) {
        read_rows(layout.params[i].grad(), rows, bucket.offsets[i], bucket.chunks[i]);
        layout.params[i].mutable_grad().reset();  // the shard's gradient accumulates it from here
      } else {
        rows.narrow(1, bucket.offsets[i], bucket.chunks[i]).zero_();
      }
    write_used_flags(rows.narrow(1, bucket.segment - static_cast<int64_t>(n), static_cast<int64_t>(n)), layout);
    if (s.replicas != 1) laid_out.div_(s.replicas);
    layout.work =
        Work<at::Tensor>(detail::start_reduce_scatter_into(*g, laid_out, bucket.received.tensor(), out, ReduceOp::SUM));
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: issuing a gradient bucket's reduce_scatter failed: ") +
                           detail::error_text(e));
  }
}

// The end of a sharded backward: every bucket still in flight landed, in order.
inline void finish_sharded(const Locked& held) {
  State& s = held.state();
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    if (s.buckets[b].work.valid()) land_scatter(held, b);
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
