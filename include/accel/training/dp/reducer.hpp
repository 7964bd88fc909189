// accel/training/dp/reducer.hpp: DataParallel's reducer: a bucket issued as soon as its gradients are ready.
//
// A ReadyHook on each parameter's gradient accumulator marks the gradient
// ready; when a bucket is complete (and every bucket before it issued, so
// that every rank issues the same sequence) issue_bucket flattens it and
// starts its all-reduce (through a registered communication hook, or the
// default's division made by the flattening copy) or, sharded, its
// reduce-scatter (dp/scatter.hpp), without waiting; without a hook, a
// small bucket on Gloo is all-reduced point to point instead
// (all_reduces_directly). finish_unsharded waits for the all-reduces and
// writes the averaged gradients back.
#pragma once

#include "accel/distributed/direct_all_reduce.hpp"
#include "accel/distributed/exchange.hpp"
#include "accel/training/dp/scatter.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// Whether bucket b's default all-reduce runs point to point
// (distributed/direct_all_reduce.hpp: a reduce-scatter and an all-gather,
// one round of messages each) rather than as Gloo's ring, whose 2 (P - 1)
// steps each wait for the rank before: for a small bucket those waits are
// the cost. Measured on 2 cores, torch 2.15, one thread per rank
// (run_all_reduce_paths_bench.sh; docs/benchmarks.md, part 8), both paths
// alone from 4 KiB to 16 MiB: point to point is 1.3-1.9x faster up to
// 256 KiB at 2 ranks, 1.53x alone and 0.84x with four in flight at
// 512 KiB, 0.72x from 1 MiB on; at 4 ranks 1.1-1.9x up to 2 MiB (four in
// flight), 0.89x from 4 MiB on. In a step, the GPT benchmark's one 0.9 MiB
// bucket (run_sharding_bench.sh's gpt set) point to point took a NO_SHARD
// step from 56.4 to 54.2 ms at 4 processes and left it as it was at 2
// (24.9 against 24.8; medians of 3 rounds). Hence up to 512 KiB per peer,
// at most 2 MiB (beyond 4 ranks an extrapolation: the ring's steps grow
// with the ranks, its bytes do not). Every rank takes the same path: the
// choice rests on the backend, the device, the group's size and the
// bucket's, never on this rank's gradients.
inline constexpr int64_t kDirectAllReducePeerBytes = int64_t{512} << 10;
inline constexpr int64_t kDirectAllReduceMaxBytes = int64_t{2} << 20;
inline bool all_reduces_directly(const State& state, std::size_t b) {
  const int64_t peers = state.group->getSize() - 1;
  const Bucket& bucket = state.buckets[b];
  return peers > 0 && !replicated(state).hooked && state.group->getBackendName() == "gloo" && bucket.device.is_cpu() &&
         bucket.packing.bytes() <= std::min(kDirectAllReducePeerBytes * peers, kDirectAllReduceMaxBytes);
}
// Starts the default all-reduce (a sum) of bucket b's `flat`: Gloo's into
// Bucket::work, or point to point's first phase into `scattering`
// (issue_second_phases issues the second).
inline void start_default_all_reduce(State& state, std::size_t b, const at::Tensor& flat) {
  ReplicatedBucket& reduced = replicated(state).buckets[b];
  if (!all_reduces_directly(state, b)) {
    state.buckets[b].work = all_reduce_async(flat, ReduceOp::SUM, state.group);
    return;
  }
  const int64_t P = state.group->getSize(), columns = (flat.numel() + P - 1) / P;
  if (!reduced.rows.defined() || reduced.rows.scalar_type() != flat.scalar_type() || reduced.rows.size(1) != columns)
    reduced.rows = at::empty({P, columns}, flat.options());
  reduced.scattering =
      Work<Work<at::Tensor>>(detail::then(detail::start_all_reduce_direct(*state.group, flat, reduced.rows, kGatherTag),
                                          [](auto gather) { return Work<at::Tensor>(std::move(gather)); }));
}
// Every bucket's second phase issued, in bucket order on every rank, before
// any bucket is waited for: its all-gather becomes Bucket::work.
inline void issue_second_phases(State& state) {
  for (std::size_t b = 0; b < state.buckets.size(); ++b) {
    ReplicatedBucket& reduced = replicated(state).buckets[b];
    if (reduced.scattering.valid()) state.buckets[b].work = reduced.scattering.wait();
  }
}

// Bucket b's all-reduce (NO_SHARD): its gradients and used-flags
// flattened (pre-divided by the group size, as DDP does) and the
// all-reduce issued without waiting.
inline void issue_all_reduce(const Locked& held, std::size_t b) {
  State& state = held.state();
  Bucket& bucket = state.buckets[b];
  Replicated& mode = replicated(state);
  ReplicatedBucket& reduced = mode.buckets[b];
  const std::size_t n = bucket.params.size();
  // The bucket persists across steps, as DDP's: a buffer this large allocated
  // per step would come back from the kernel as fresh pages each time (page
  // faults and zeroing, a tenth of a CPU step's time). Under
  // gradient_as_bucket_view the gradients are its views; otherwise they are
  // copied in here and the averages copied back out in finish. (Made
  // anew only if the module moved to another device since.)
  const at::TensorOptions options = bucket.params.front().options();
  if (!reduced.persistent.defined() || reduced.persistent.device() != options.device())
    reduced.persistent = bucket.packing.buffer(options);
  reduced.flat = reduced.persistent;
  // Without a registered hook the default one's work is done here: the
  // gradients divided by the group's size, then all-reduced. Where they are
  // copied in anyway (not gradient_as_bucket_view) the copy itself divides,
  // as DDP's copy_grad_to_bucket does: one pass over the bucket instead of
  // two, with div_'s kernel and divisor, so the same bits. The used-flags
  // stay undivided there: finish reads only whether they are above zero.
  const bool by_default = !mode.hooked, divide_in_copy = by_default && !mode.bucket_view;
  if (by_default && !reduced.divisor.defined()) {
    // A wrapped number, as div_(Scalar) makes of its argument, made once: in
    // the bucket's dtype, so that no division casts it (and allocates); in
    // float for bfloat16 and float16, whose kernels read the divisor as
    // float (so a world size they cannot hold exactly still divides exactly).
    const bool half_width = bucket.dtype == at::kBFloat16 || bucket.dtype == at::kHalf;
    reduced.divisor =
        at::scalar_tensor(static_cast<double>(state.group->getSize()), half_width ? at::kFloat : bucket.dtype);
    reduced.divisor.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  for (std::size_t i = 0; i < n; ++i) {
    at::Tensor& p = bucket.params[i];
    at::Tensor view = bucket.packing.view(reduced.flat, i);
    if (!p.grad().defined()) {
      view.zero_();
    } else if (divide_in_copy) {
      at::div_out(view, p.grad().is_sparse() ? p.grad().to_dense() : p.grad(),
                  reduced.divisor);  // (sparse: into dense)
    } else if (!mode.bucket_view || !p.grad().is_alias_of(view)) {
      view.copy_(p.grad());
      if (mode.bucket_view) p.mutable_grad() = view;  // (a gradient set to none, or the first backward)
    }
  }
  write_used_flags(bucket.packing.view(reduced.flat, n), bucket);
  try {
    if (by_default) {
      if (!divide_in_copy) reduced.flat.div_(reduced.divisor);  // (the views: divided where they lie)
      start_default_all_reduce(state, b, reduced.flat);
    } else {
      GradBucket hooked = grad_bucket(held, b, reduced.flat);
      bucket.work = mode.hook(state.group, hooked);
    }
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: issuing a gradient bucket's all_reduce failed: ") +
                           detail::error_text(e));
  }
}
// Issues bucket b's reduction, now that its gradients are ready: the
// strategy's (issue_all_reduce above, or dp/scatter.hpp's issue_scatter).
inline void issue_bucket(const Locked& held, std::size_t b) {
  State& state = held.state();
  at::NoGradGuard no_grad;
  state.mode->issue(held, b);
  state.timeline.stamp(b, &BucketTimes::issued);
  if (state.on_issued) state.on_issued(b);
}

// finish() of a model that is not sharded: waits for each bucket's
// all-reduce (through the communication hook) and writes the averaged
// gradients of the parameters used on any rank back into their .grad.
inline void finish_unsharded(const Locked& held) {
  State& state = held.state();
  Replicated& mode = replicated(state);
  try {
    issue_second_phases(state);
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: a gradient bucket's all_reduce failed: ") +
                           detail::error_text(e));
  }
  for (std::size_t b = 0; b < state.buckets.size(); ++b) {
    Bucket& bucket = state.buckets[b];
    ReplicatedBucket& reduced = mode.buckets[b];
    try {
      state.timeline.stamp(b, &BucketTimes::waiting);
      reduced.flat = bucket.work.wait();
      state.timeline.stamp(b, &BucketTimes::landed);
    } catch (const DistributedError& e) {
      throw DistributedError(std::string("accel::DataParallel: a gradient bucket's all_reduce failed: ") +
                             detail::error_text(e));
    }
    if (!reduced.flat.defined() || reduced.flat.numel() != bucket.packing.elements())
      throw RuntimeError("accel::DataParallel: the communication hook returned " +
                         (reduced.flat.defined() ? std::to_string(reduced.flat.numel()) + " elements" : "nothing") +
                         " for bucket " + std::to_string(b) + " of " + std::to_string(bucket.packing.elements()));
    if (reduced.flat.scalar_type() != bucket.dtype) reduced.flat = reduced.flat.to(bucket.dtype);  // decompressed
    reduced.flat = reduced.flat.reshape({-1});
    if (mode.bucket_view && !reduced.flat.is_alias_of(reduced.persistent))
      reduced.flat = reduced.persistent.copy_(reduced.flat);
    const std::size_t n = bucket.params.size();
    // Which parameters some rank used: known here when this rank used them all.
    const bool all_used = used_by_all_here(bucket);
    const at::Tensor used_anywhere = all_used ? at::Tensor() : bucket.packing.view(reduced.flat, n).gt(0).to(c10::kCPU);
    const bool* used = all_used ? nullptr : used_anywhere.data_ptr<bool>();
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor& p = bucket.params[i];
      if (all_used || used[i]) {
        at::Tensor averaged = bucket.packing.view(reduced.flat, i);
        if (mode.bucket_view) p.mutable_grad() = averaged;  // (already there when it was a view)
        else if (p.grad().defined()) p.mutable_grad().copy_(averaged);
        else p.mutable_grad() = averaged.clone();
      }
      bucket.used[i] = 0;
    }
  }
}

// DataParallel::shadow_backward's collectives: every bucket's all-reduce,
// in order, with zero gradients and no used-flags, on the path the others'
// take (the hook's, or the default's: Gloo's or point to point, phase by
// phase).
inline void shadow_backward(const Locked& held) {
  State& state = held.state();
  Replicated& mode = replicated(state);
  try {
    for (std::size_t b = 0; b < state.buckets.size(); ++b) {
      Bucket& bucket = state.buckets[b];
      const at::Tensor zeros = bucket.packing.buffer(bucket.params.front().options()).zero_();
      if (!mode.hooked) {
        start_default_all_reduce(state, b, zeros);  // (zeros need no division)
      } else {
        GradBucket hooked = grad_bucket(held, b, zeros);
        bucket.work = mode.hook(state.group, hooked);
      }
    }
    issue_second_phases(state);
    for (auto& bucket : state.buckets) bucket.work.wait();
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: a joined rank's gradient all_reduce failed: ") +
                           detail::error_text(e));
  }
}

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::shared_ptr<State> state, std::size_t bucket, std::size_t index)
      : state_(std::move(state)), bucket_(bucket), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    const Locked held(*state_);
    State& s = held.state();
    if (!s.alive) return outputs;
    Bucket& bucket = s.buckets[bucket_];
    bucket.used[index_] = 1;  // also under no_sync: the accumulated gradient counts at the next sync
    if (!s.armed || bucket.seen[index_]) return outputs;
    bucket.seen[index_] = 1;
    ++s.fired;
    if (++bucket.ready == bucket.params.size()) {
      s.timeline.stamp(bucket_, &BucketTimes::ready);
      while (s.next < s.buckets.size() && s.buckets[s.next].ready == s.buckets[s.next].params.size())
        issue_bucket(held, s.next++);
    }
    return outputs;
  }
  std::shared_ptr<State> state_;
  std::size_t bucket_, index_;
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END
