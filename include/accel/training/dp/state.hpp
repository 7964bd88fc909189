// accel/training/dp/state.hpp: DataParallel's state: the buckets' common layout and the strategy's own (Replicated, or Sharded with FULL_SHARD's Units), shared with its autograd hooks.
//
// A DataParallel keeps everything in one State behind a shared_ptr: the
// autograd hooks it registers outlive it inside the graph, and see
// `alive` turn false when it goes. The reducer (dp/reducer.hpp), the
// ZeRO-3 units (dp/units.hpp), the sharded reduce-scatter (dp/scatter.hpp)
// and DataParallel itself work on it, always under its mutex: only
// DataParallel's public methods, the handles it returns, unit_forward and
// the autograd hooks take it, each by making a Locked, and every engine
// function that reads or changes the State after its construction takes
// that Locked (below), so the compiler checks the rule.
#pragma once

#include "accel/distributed/nested.hpp"
#include "accel/training/dp/strategy.hpp"
#include "accel/training/dp/buckets.hpp"
#include "accel/training/dp/buffers.hpp"
#include "accel/training/dp/timeline.hpp"
#include "accel/training/parameters.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// DataParallel's state is one common layout of buckets (below) and the
// strategy's own state, held in State::mode by one of the two strategies
// (dp/strategy.hpp's interface; their operations are in dp/strategies.hpp):
//   Replicated (NO_SHARD): each bucket all-reduced, through a communication hook;
//   Sharded (SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD): each parameter cut in
//     chunks, each bucket reduce-scattered into this rank's shards; with
//     Units (FULL_SHARD, HYBRID_SHARD) the parameters of each unit also
//     gathered only while the unit runs.
// FULL_SHARD is no third type: it is ZeRO-2 for every bucket (its root's
// parameters are sharded exactly as SHARD_GRAD_OP's) plus Units, which
// SHARD_GRAD_OP has none of; the units' code runs over the units' buckets
// only, so it needs no test of the mode. The mode is chosen once, in
// DataParallel's constructor; the engine's functions of one strategy reach
// its state through replicated() / sharded().

// A bucket as every strategy lays it out: its parameters (one dtype and
// device), the flags of which had a gradient, and its reduction in flight.
struct Bucket {
  // Every member has an initializer: GCC 14's -Wextra flags designated
  // initializers that leave out members without one.
  std::vector<at::Tensor> params{};
  std::vector<uint8_t> used{};  // per parameter: a gradient arrived since the last sync
  std::vector<uint8_t> seen{};  // per parameter: ... in the armed backward
  c10::ScalarType dtype;
  c10::Device device;
  detail::Packing packing;  // of the reduced buffer: the gradients, then one used-flag per parameter
  std::size_t ready = 0;
  Work<at::Tensor> work{};  // its all-reduce (Replicated) or reduce-scatter (Sharded) in flight
};

// NO_SHARD's per bucket: the buffer being reduced (`persistent`, or what
// the communication hook returned), the buffer kept across steps (under
// gradient_as_bucket_view the gradients' storage too), and without a
// registered hook the group's size, the gradients' divisor (dp/reducer.hpp).
// A small bucket all-reduced point to point (dp/reducer.hpp's
// all_reduces_directly) has its reduce-scatter in `scattering` until
// finish issues the all-gather (then Bucket::work), and the peers' chunks
// land in `rows`, kept across steps as `persistent` is.
struct ReplicatedBucket {
  at::Tensor flat{}, persistent{}, divisor{}, rows{};
  Work<Work<at::Tensor>> scattering{};
};
struct Replicated final : Strategy {
  std::vector<ReplicatedBucket> buckets{};       // (State::buckets' order)
  CommHook hook = comm_hooks::allreduce_hook();  // (see register_comm_hook)
  bool hooked = false;
  bool bucket_view = false;  // (see gradient_as_bucket_view)

  std::vector<int64_t> assign_units(State& s, const torch::nn::Module& module,
                                    const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                    const std::vector<at::Tensor>& params) override;
  void lay_out(State& s, const std::vector<int64_t>& bucket_unit) override;
  void take_policy(State& s, const MixedPrecisionPolicy& policy) override;
  void issue(const Locked& held, std::size_t b) override;
  void finish(const Locked& held) override;
  void shadow_backward(const Locked& held) override;
  void register_comm_hook(const Locked& held, CommHook hook) override;
  void gradient_as_bucket_view(const Locked& held, bool on) override;
};

// Sharding's per bucket. A rank's segment holds its chunk of each
// parameter (chunks[i] elements at offsets[i]), then the used-flags;
// `segment` elements in all.
struct ShardedBucket {
  std::vector<int64_t> offsets{}, chunks{};
  int64_t segment = 0;
  // This rank's shards, one after another in `owned` (segment - n
  // elements): shards[i] is a leaf standing on its piece, so the
  // all-gather's input is `owned` itself, never a copy made per step.
  // Their gradients likewise live in `owned_grads` once a reduction wrote
  // them (kept between steps: 1/S of the gradients, as FSDP's sharded
  // gradients; `segment` elements, so that a reduction can fold its
  // used-flags in there too).
  at::Tensor owned{}, owned_grads{};
  at::Tensor used_anywhere{};  // (CPU bools, one per parameter: a reduction's used-flags read back)
  std::vector<at::Tensor> shards{};
  std::vector<uint8_t> in_optimizer{};
  std::vector<at::Tensor> sums{};  // each shard's sum at the last gather (see check_shards)
  // The reduce-scatter's pooled buffers: its laid-out input, what its
  // all-to-all received, and where the chunks fold when they cannot fold
  // straight into the shards' gradients.
  Lease laid_out{}, received{}, folded{};
  int64_t unit = -1;  // the unit whose parameters these are (-1: none, whole while the model runs)
};

// A unit's bucket (FULL_SHARD): which bucket, whether its parameters hold
// their values now, and a gather in flight. `full` is the pooled buffer
// its gather lands in, the parameters' memory while it is resident. Under
// a MixedPrecisionPolicy's param_dtype: whether `full` holds the parameters
// in that dtype (gathered for compute), the shards cast to it while their
// gather is in flight (`cast`, pooled), each parameter as it is at rest
// (`rest`: its own dtype and storage, which it takes back when released),
// and as it computes (`compute`: that dtype, on a storage of its own that
// points into `full` while the unit holds its values and at nothing
// otherwise; dp/unit_params.hpp says why).
struct UnitBucket {
  std::size_t bucket = 0;  // into State::buckets
  bool resident = true;
  Lease full{};
  bool low = false;
  Lease cast{};
  std::vector<at::Tensor> rest{}, compute{};
  std::vector<std::string> at_rest{};  // per parameter: what a kernel that reads it at rest throws
  Work<at::Tensor> gathering{};
};
struct Unit {
  const torch::nn::Module* module = nullptr;
  std::vector<UnitBucket> buckets{};
};
// FULL_SHARD's units; the order they ran in this forward and the last
// (prefetching follows it); summon_full_params() objects alive. Under a
// MixedPrecisionPolicy: the dtype units compute in (gathered in; none: the
// parameters' own), and the one outputs are cast to; cast_inputs: a unit's
// floating-point inputs are cast to the dtype its parameters hold.
struct Units {
  std::vector<Unit> list{};
  std::vector<std::size_t> order{}, last_order{};
  bool new_pass = true;
  bool prefetch_forward = true, prefetch_backward = true;  // (see AcceleratorConfig::forward_prefetch)
  int held = 0;
  std::optional<c10::ScalarType> param_dtype{}, output_dtype{};
  bool cast_inputs = true;
};
struct Sharded final : Strategy {
  Sharded(GroupPtr shard_group, GroupPtr replicate_group)
      : shard(std::move(shard_group)), replicate(std::move(replicate_group)) {}

  GroupPtr shard{}, replicate{};         // sharded along shard, averaged along replicate too (HSDP)
  std::vector<ShardedBucket> buckets{};  // (State::buckets' order)
  // Where each parameter's shard is, and the optimizers stepping them.
  std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> shard_index{};  // (bucket, i)
  std::vector<torch::optim::Optimizer*> optimizers{};
  std::optional<c10::ScalarType> reduce_dtype{};  // a MixedPrecisionPolicy's: the dtype gradients reduce in
  Units units{};                                  // none under SHARD_GRAD_OP

  bool shards() const override { return true; }
  const GroupPtr& shard_group() const override { return shard; }
  std::vector<int64_t> assign_units(State& s, const torch::nn::Module& module,
                                    const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                    const std::vector<at::Tensor>& params) override;
  void lay_out(State& s, const std::vector<int64_t>& bucket_unit) override;
  void take_policy(State& s, const MixedPrecisionPolicy& policy) override;
  std::size_t unit_count() const override;
  std::vector<const torch::nn::Module*> unit_modules() const override;
  void arm(const Locked& held) override;
  void issue(const Locked& held, std::size_t b) override;
  void finish(const Locked& held) override;
  void end_unit_pass(const Locked& held) override;
  void shadow_backward(const Locked& held) override;
  void register_comm_hook(const Locked& held, CommHook hook) override;
  void gradient_as_bucket_view(const Locked& held, bool on) override;
  at::Tensor shard_of(const State& s, const at::Tensor& p) const override;
  void shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) override;
  bool steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) const override;
  void check_shards(const Locked& held) override;
  void gather_shards(const Locked& held) override;
  void release_module(const Locked& held) override;
  void summon_units(const Locked& held) override;
  void set_prefetch(const Locked& held, bool forward, bool backward) override;
  void let_go_of_units(const Locked& held) noexcept override;
  std::optional<Piece> piece_of(const Locked& held, const at::Tensor& p) const override;
  bool writes_pieces() const override;
  std::pair<int64_t, int64_t> load_range(const Locked& held, const at::Tensor& p) const override;
  void load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) override;
  void open_for_load(const Locked& held) override;
  void reshard(const Locked& held) override;
};

// Every parameter of the bucket had a gradient here since the last sync:
// then each was used on some rank, and the reduced flags need not be read
// back (on a GPU that read would make the host wait for the reduction).
inline bool used_by_all_here(const Bucket& bucket) {
  return std::all_of(bucket.used.begin(), bucket.used.end(), [](uint8_t u) { return u != 0; });
}

// Writes the bucket's used-flags (host bytes) into `to`, a view of the
// buffer about to be reduced (repeated along its rows where it has rows).
// On a device, copying from ordinary host memory would make the host wait
// for everything queued before it, once per bucket in the middle of the
// backward; instead every flag set (the usual case) is a fill, and other
// flags travel from page-locked memory without waiting (the caching host
// allocator keeps it until the copy ends), as DDP copies its used map.
inline void write_used_flags(const at::Tensor& to, const Bucket& bucket) {
  const auto n = static_cast<int64_t>(bucket.used.size());
  const at::Tensor flags = at::from_blob(const_cast<uint8_t*>(bucket.used.data()), {n}, at::TensorOptions(c10::kByte));
  if (to.is_cpu()) {
    to.copy_(flags);
  } else if (used_by_all_here(bucket)) {
    to.fill_(1);
  } else if (to.is_cuda()) {
    const at::Tensor staged = at::empty({n}, at::TensorOptions(to.scalar_type()).pinned_memory(true)).copy_(flags);
    to.copy_(staged.to(to.device(), /*non_blocking=*/true));
  } else {
    to.copy_(flags);
  }
}

struct State {
  // The sharded steps' working buffers, reused (dp/buffers.hpp). First, so
  // that it is destroyed last: a bucket's Work still in flight when the
  // state goes lands into the pool as it is destroyed.
  BufferPool pool;
  std::mutex mutex;
  ParameterNames names;  // the module's parameters by name, for errors that name one
  GroupPtr group;
  int64_t replicas = 1;  // gradients are averaged over this many ranks
  std::vector<Bucket> buckets;
  std::size_t next = 0;   // buckets launch strictly in order: the same on every rank
  std::size_t fired = 0;  // parameters whose gradient arrived in the armed backward
  bool armed = false, alive = true;
  std::function<void(std::size_t)> on_issued;
  TimelineClock timeline;  // the last synced backward's moments per bucket (dp/timeline.hpp)
  // The strategy and its state (Replicated when not distributed).
  std::unique_ptr<Strategy> mode = std::make_unique<Replicated>();
};
// The strategy's state, for the engine's functions of that strategy (each
// is called only through it: a wrong one is a bug of ours, said so).
inline Sharded& sharded(State& s) {
  if (!s.mode->shards()) throw LogicError("accel::DataParallel: a sharded operation on a model that is not sharded");
  return static_cast<Sharded&>(*s.mode);
}
inline const Sharded& sharded(const State& s) { return sharded(const_cast<State&>(s)); }
inline Replicated& replicated(State& s) {
  if (s.mode->shards()) throw LogicError("accel::DataParallel: a NO_SHARD operation on a sharded model");
  return static_cast<Replicated&>(*s.mode);
}
inline const Replicated& replicated(const State& s) { return replicated(const_cast<State&>(s)); }
// Unit u's part of bucket b (b is one of the unit's buckets).
inline const UnitBucket& unit_bucket(const Units& units, int64_t u, std::size_t b) {
  for (const auto& ub : units.list[static_cast<std::size_t>(u)].buckets)
    if (ub.bucket == b) return ub;
  throw LogicError("accel::DataParallel: bucket " + std::to_string(b) + " is not unit " + std::to_string(u) + "'s");
}

// The common layout: `params` (each tensor once, in the order backward
// produces their gradients) put in buckets by DDP's assignment (dp/buckets.hpp;
// size_limits: the first bucket's, then every other's; a unit's parameters
// in buckets of their own), each with room for its used-flags after the
// gradients. Returns each bucket's unit (-1: none).
inline std::vector<int64_t> lay_out(State& s, const std::vector<at::Tensor>& params,
                                    const std::vector<int64_t>& unit_of, const std::vector<int64_t>& size_limits) {
  std::vector<BucketInput> inputs;
  for (std::size_t k = 0; k < params.size(); ++k)
    inputs.push_back(
        {params[k].scalar_type(), params[k].device(), params[k].numel() * params[k].element_size(), unit_of[k]});
  std::vector<int64_t> bucket_unit;
  for (const auto& indices : compute_bucket_assignment_by_size(inputs, size_limits).buckets) {
    const at::Tensor& first = params[indices.front()];
    Bucket bucket{.dtype = first.scalar_type(), .device = first.device(), .packing = Packing(first.scalar_type())};
    bucket_unit.push_back(unit_of[indices.front()]);
    for (std::size_t k : indices) {
      bucket.params.push_back(params[k]);
      bucket.used.push_back(0);
      bucket.seen.push_back(0);
      bucket.packing.add(params[k]);
    }
    bucket.packing.add({static_cast<int64_t>(bucket.params.size())}, bucket.dtype);  // the used-flags
    s.buckets.push_back(std::move(bucket));
  }
  return bucket_unit;
}

// Proof that a State's mutex is held, and the way to the State for the
// engine's functions: made (locking) by DataParallel's public methods, the
// handles it returns (FullParameters, UnitByUnit), unit_forward and the
// autograd hooks, and passed down. No engine function locks: one that
// needs the state takes a `const Locked&`, so none can be called without
// the lock, nor lock it again (the mutex is not recursive: a second lock
// would deadlock).
class Locked {
 public:
  explicit Locked(State& state) : state_(state), lock_(state.mutex) {}
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
  State& state() const { return state_; }

 private:
  State& state_;
  std::lock_guard<std::mutex> lock_;
};

// What a hook gets for bucket b laid out in `buffer`. The parameters and
// the gradients' views only for a registered hook: the default needs the
// buffer alone, and this runs for every bucket of every step.
inline GradBucket grad_bucket(const Locked& held, std::size_t b, const at::Tensor& buffer) {
  const State& s = held.state();
  const Bucket& bucket = s.buckets[b];
  GradBucket out{.buffer = buffer, .index = b, .is_last = b + 1 == s.buckets.size()};
  if (replicated(s).hooked) {
    out.parameters = bucket.params;
    for (std::size_t i = 0; i < bucket.params.size(); ++i) out.gradients.push_back(bucket.packing.view(buffer, i));
  }
  return out;
}

// On Gloo with CPU tensors the engine's all-gathers and reduce-scatters
// run point to point (dp/unit_params.hpp, dp/scatter.hpp), with a tag no caller
// is likely to pick for sends of its own. A bucket whose pieces are large,
// kPieceBytes per parameter and rank on average, moves each parameter's
// chunk as a message of its own, straight between the parameters (or
// gradients) and the shards; a smaller one moves one message per peer
// through a buffer laid out rank after rank, copied in or out: a Gloo
// message costs about what copying kPieceBytes does, and a model of many
// small parameters would pay it per parameter.
inline constexpr int kGatherTag = 0x61636365;
inline constexpr int64_t kPieceBytes = int64_t{256} << 10;
inline bool large_pieces(const ShardedBucket& bucket, int64_t element_size) {
  return bucket.owned.numel() * element_size >= kPieceBytes * static_cast<int64_t>(bucket.shards.size());
}
// How far a fully sharded model's collectives run ahead of its compute
// where units are small: the reduce-scatters in flight together
// (dp/scatter.hpp's room_in_flight) and the units gathered ahead of the one
// computing (dp/units.hpp's prefetch_ahead) hold at most this many bytes,
// beyond the one that is always allowed. A large unit (at least this size)
// thus keeps one of each, as FSDP2 does; small units, whose collectives
// each cost a round trip to every peer whatever their size, do not wait
// for one another. 4 MiB: measured with run_llama_bench.sh's `small` set
// (units of about 200 KiB) and run_sharding_bench.sh (16 MiB units, which
// it leaves as they were); docs/benchmarks.md has the figures.
inline constexpr int64_t kAheadBytes = int64_t{4} << 20;
// The dtype bucket b's gradients are reduce-scattered in.
inline c10::ScalarType reduce_dtype(const State& s, std::size_t b) {
  return sharded(s).reduce_dtype.value_or(s.buckets[b].dtype);
}

}  // namespace detail::dp

ACCEL_NAMESPACE_END
