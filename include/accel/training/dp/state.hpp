// accel/training/dp/state.hpp: DataParallel's state: its buckets, units and flags, shared with its autograd hooks.
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
#include "accel/training/dp/comm_hooks.hpp"
#include "accel/training/dp/buffers.hpp"
#include "accel/training/precision/policy.hpp"
#include "accel/training/parameters.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
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
  // Not sharded: the bucket being reduced (`persistent`, or what the communication hook returned).
  at::Tensor flat{};
  // Sharded: the reduce-scatter's pooled buffers: its laid-out input, what its all-to-all received, and
  // where the chunks fold when they cannot fold straight into the shards' gradients.
  Lease laid_out{}, received{}, folded{};
  // Not sharded: the bucket, kept across steps (under gradient_as_bucket_view the gradients' storage too).
  at::Tensor persistent{};
  at::Tensor divisor{};  // not sharded, no registered hook: the group's size, the gradients' divisor (dp/reducer.hpp)
  Work<at::Tensor> work{};
  // Sharded: a rank's segment holds its chunk of each parameter
  // (chunks[i] elements at offsets[i]), then the used-flags; `segment`
  // elements in all.
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
  // FULL_SHARD: the unit whose parameters these are (-1: none), whether
  // they hold their values now, and a prefetch in flight.
  int64_t unit = -1;
  bool resident = true;
  Lease full{};  // from the unit's fetch on: the pooled buffer its gather lands in, the parameters' memory
  // Under a MixedPrecisionPolicy's param_dtype (State::param_dtype): whether
  // `full` holds the parameters in that dtype (gathered for compute), the
  // shards cast to it while their gather is in flight (`cast`, pooled), each
  // parameter as it is at rest (`rest`: its own dtype and storage, which it
  // takes back when released), and as it computes (`compute`: that dtype,
  // on a storage of its own that points into `full` while the unit holds
  // its values and at nothing otherwise; dp/unit_params.hpp says why).
  bool low = false;
  Lease cast{};
  std::vector<at::Tensor> rest{}, compute{};
  std::vector<std::string> at_rest{};  // per parameter: what a kernel that reads it at rest throws
  Work<at::Tensor> gathering{};
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

struct Unit {
  const torch::nn::Module* module = nullptr;
  std::vector<std::size_t> buckets{};
};
struct State {
  // The sharded steps' working buffers, reused (dp/buffers.hpp). First, so
  // that it is destroyed last: a bucket's Work still in flight when the
  // state goes lands into the pool as it is destroyed.
  BufferPool pool;
  std::mutex mutex;
  ParameterNames names;  // the module's parameters by name, for errors that name one
  GroupPtr group;
  GroupPtr shard, replicate;  // sharded: along shard, averaged along replicate too (HSDP)
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
  bool prefetch_forward = true, prefetch_backward = true;  // (see AcceleratorConfig::forward_prefetch)
  int held = 0;
  // Sharded: where each parameter's shard is, and the optimizers stepping them.
  std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> shard_index;  // (bucket, i)
  std::vector<torch::optim::Optimizer*> optimizers;
  // FULL_SHARD under a MixedPrecisionPolicy (see DataParallel): the dtype
  // units compute in (gathered in) and the one gradients are reduced in;
  // none: the parameters' own. cast_inputs: a unit's floating-point inputs
  // are cast to the dtype its parameters hold.
  std::optional<c10::ScalarType> param_dtype, reduce_dtype, output_dtype;
  bool cast_inputs = true;
};

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
  if (s.hooked) {
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
inline bool large_pieces(const Bucket& bucket, int64_t element_size) {
  return bucket.owned.numel() * element_size >= kPieceBytes * static_cast<int64_t>(bucket.params.size());
}
// The dtype bucket b's gradients are reduce-scattered in.
inline c10::ScalarType reduce_dtype(const State& s, const Bucket& bucket) {
  return s.reduce_dtype.value_or(bucket.dtype);
}

// The chunk layout: t flattened and zero-padded to S chunks of c, chunk r
// being row r. read_rows copies t's rows into columns [off, off + c) of
// rows, zeros where t ends before them (so rows need not start zeroed: a
// pass over the whole buffer saved); write_rows copies them back into t;
// read_chunk copies row r alone into `out`.
inline void read_rows(const at::Tensor& t, const at::Tensor& rows, int64_t off, int64_t c) {
  const at::Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel(), full = c ? n / c : 0, rest = n - full * c;
  const at::Tensor columns = rows.narrow(1, off, c);
  if (full) columns.narrow(0, 0, full).copy_(flat.narrow(0, 0, full * c).view({full, c}));
  if (rest) {
    columns[full].narrow(0, 0, rest).copy_(flat.narrow(0, full * c, rest));
    columns[full].narrow(0, rest, c - rest).zero_();
  }
  const int64_t filled = full + (rest ? 1 : 0);
  if (filled < rows.size(0)) columns.narrow(0, filled, rows.size(0) - filled).zero_();
}
inline void write_rows(const at::Tensor& rows, int64_t off, int64_t c, at::Tensor& t) {
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
// Rank r's chunk of a tensor of n elements cut in chunks of c: (begin,
// length), the last chunks short or empty.
inline std::pair<int64_t, int64_t> chunk_range(int64_t r, int64_t c, int64_t n) {
  const int64_t begin = std::min(r * c, n);
  return {begin, std::min(c, n - begin)};
}
inline void read_chunk(const at::Tensor& t, int64_t r, int64_t c, const at::Tensor& out) {
  const at::Tensor flat = t.reshape({-1});
  const auto [begin, length] = chunk_range(r, c, flat.numel());
  if (length) out.narrow(0, 0, length).copy_(flat.narrow(0, begin, length));
  if (length < c) out.narrow(0, length, c - length).zero_();
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
