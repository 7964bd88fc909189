// accel/training/dp/units.hpp: ZeRO-3's units: parameters gathered from their shards for a unit's forward and backward, freed after.
//
// FULL_SHARD's units hold no parameter memory at rest. accel::unit_forward
// calls unit_call, which gathers a unit's parameters (waiting for a prefetch
// where one was issued, prefetching the unit that came next in the last
// forward), runs the forward and frees them; hooks on the unit's output and
// inputs gather them again for its backward and free them after it.
// FullParameters (summon_full_params) keeps every unit gathered.
#pragma once

#include "accel/training/dp/unit_params.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
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
    const Locked held(*state_);
    Sharded& z = sharded(*state_);
    if (--z.units.held > 0) return;
    at::NoGradGuard no_grad;
    for (std::size_t u = 0; u < z.units.list.size(); ++u) {
      if (writeback_)
        for (const UnitBucket& ub : z.units.list[u].buckets) {
          const Bucket& layout = state_->buckets[ub.bucket];
          ShardedBucket& bucket = z.buckets[ub.bucket];
          for (std::size_t i = 0; i < layout.params.size(); ++i)
            read_chunk(layout.params[i], z.shard->getRank(), bucket.chunks[i], bucket.shards[i]);
        }
      release(held, u);
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
// tensor in no unit comes back as it is (every tensor, where nothing is
// sharded). Units gathered for other reasons (a prefetch, a forward left
// half done) are released first.
class UnitByUnit {
 public:
  // state: a fully sharded model's (one with units); null otherwise.
  explicit UnitByUnit(std::shared_ptr<State> state) : state_(std::move(state)) {
    if (!state_) return;
    const Locked held(*state_);
    if (sharded(*state_).units.held == 0) end_unit_pass(held);
  }
  UnitByUnit(const UnitByUnit&) = delete;
  UnitByUnit& operator=(const UnitByUnit&) = delete;
  // (movable, so that each of a pipeline's stages on a process can hold one: checkpoint/pipeline_weights.hpp)
  UnitByUnit(UnitByUnit&& other) noexcept
      : state_(std::move(other.state_)), current_(std::exchange(other.current_, std::nullopt)) {}
  ~UnitByUnit() {
    if (!state_) return;
    const Locked held(*state_);
    if (current_) release(held, *current_);
  }
  const at::Tensor& whole(const at::Tensor& p) {
    if (!state_) return p;
    const Locked held(*state_);
    const Sharded& z = sharded(*state_);
    const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
    if (found == z.shard_index.end() || z.buckets[found->second.first].unit < 0) return p;
    const auto u = static_cast<std::size_t>(z.buckets[found->second.first].unit);
    if (current_ != u) {
      if (current_) release(held, *current_);
      current_ = u;
      materialize(held, u, Use::full);
    }
    return p;
  }

 private:
  std::shared_ptr<State> state_;
  std::optional<std::size_t> current_;
};

// True on a thread while accel::checkpoint (recompute.hpp) runs a forward
// again inside the backward. A unit called then keeps its parameters
// gathered after its forward, because the backward of that forward follows
// at once (its input hook frees them after it), and prefetches nothing: the
// next unit of the forward has had its backward already.
inline bool& recomputing() {
  static thread_local bool on = false;
  return on;
}

// The bytes unit u's buckets hold, gathered (what running ahead counts).
inline int64_t unit_bytes(const State& s, std::size_t u) {
  int64_t bytes = 0;
  for (const UnitBucket& ub : sharded(s).units.list[u].buckets) bytes += s.buckets[ub.bucket].packing.bytes();
  return bytes;
}

// Prefetching: the units in [from, to) (the ones after this in the last
// forward, or before it in this one for the backward) gathered ahead, at
// least the first, and more while those gathered ahead hold less than
// kAheadBytes (dp/state.hpp: small units do not wait for each other's
// gathers; a large one keeps one prefetch, as FSDP2's). The same on every
// rank: it reads only the order and the units' sizes.
template <class It>
inline void prefetch_ahead(const Locked& held, It from, It to) {
  const State& s = held.state();
  int64_t ahead = 0;
  for (It it = from; it != to && ahead < kAheadBytes; ++it) {
    fetch(held, *it, Use::compute);
    ahead += unit_bytes(s, *it);
  }
}

// A unit's forward begins: the forward's order recorded (the first unit of
// a forward starts a new one; the last guides prefetching), the unit's
// parameters gathered, and the units after it in the last forward
// prefetched (prefetch_ahead). Returns the dtype its floating-point inputs are cast to (a
// policy's cast_forward_inputs) and the one its output is (output_dtype).
struct UnitDtypes {
  std::optional<c10::ScalarType> inputs, output;
  bool keep = false;  // the parameters stay gathered after the forward (keeps_for_backward)
};
// Whether unit u keeps its parameters gathered from its forward to its
// backward instead of being gathered again: where it and the units after
// it in the last forward (whose backwards come before its own) together
// hold at most kAheadBytes (dp/state.hpp). The last units of a forward are
// the first of the backward, so regathering them right after freeing them
// only costs a collective per unit (FSDP2 likewise keeps the root's
// parameters after the forward); small units are latency-bound, and a
// model's last few MiB are cheap to hold. Only where a backward follows
// (grad mode on), never while a recomputation runs, nor with
// backward_prefetch off (which asks for one unit's parameters at a time),
// and the same on every rank (the order and the sizes).
inline bool keeps_for_backward(const Locked& held, std::size_t u) {
  const State& s = held.state();
  const Units& units = sharded(s).units;
  if (!at::GradMode::is_enabled() || recomputing() || !units.prefetch_backward) return false;
  const auto at = std::find(units.last_order.begin(), units.last_order.end(), u);
  if (at == units.last_order.end()) return false;  // (the first forward: no order yet)
  int64_t bytes = 0;
  for (auto it = at; it != units.last_order.end(); ++it) bytes += unit_bytes(s, *it);
  return bytes <= kAheadBytes;
}
inline UnitDtypes begin_unit_forward(const Locked& held, std::size_t u) {
  Units& units = sharded(held.state()).units;
  if (units.new_pass) {
    if (!units.order.empty()) units.last_order = std::move(units.order);
    units.order.clear();
    units.new_pass = false;
  }
  if (std::find(units.order.begin(), units.order.end(), u) == units.order.end()) units.order.push_back(u);
  materialize(held, u, Use::compute);
  const auto at = std::find(units.last_order.begin(), units.last_order.end(), u);
  if (units.prefetch_forward && !recomputing() && at != units.last_order.end())
    prefetch_ahead(held, at + 1, units.last_order.end());
  return {units.cast_inputs ? computes_in(held, u) : std::nullopt, units.output_dtype, keeps_for_backward(held, u)};
}
// One tensor input of unit u, cast where the policy says, and, where it
// needs a gradient, a node of our own whose gradient means the unit's
// backward is done: its hook frees the parameters.
inline at::Tensor unit_input(const at::Tensor& a, std::optional<c10::ScalarType> cast, const std::weak_ptr<State>& weak,
                             std::size_t u) {
  const bool casts = cast && a.is_floating_point() && a.scalar_type() != *cast;
  if (!a.requires_grad() || !at::GradMode::is_enabled()) return casts ? a.to(*cast) : a;
  at::Tensor in = casts ? a.to(*cast) : a.view_as(a);
  in.register_hook([weak, u](const at::Tensor&) {
    if (const auto s = weak.lock()) {
      const Locked held(*s);
      if (s->alive) release(held, u);
    }
  });
  return in;
}
// Before unit u's backward (a hook on its output): its parameters gathered
// again, and the units before it in this forward prefetched (prefetch_ahead).
inline void gather_before_backward(at::Tensor& out, const std::weak_ptr<State>& weak, std::size_t u) {
  out.register_hook([weak, u](const at::Tensor&) {
    if (const auto s = weak.lock()) {
      const Locked held(*s);
      if (!s->alive) return;
      materialize(held, u, Use::compute);
      const Units& units = sharded(*s).units;
      const auto at = std::find(units.order.begin(), units.order.end(), u);
      if (units.prefetch_backward && at != units.order.end())
        prefetch_ahead(held, std::make_reverse_iterator(at), units.order.rend());
    }
  });
}

// accel::unit_forward's machinery: fn(args...) with the parameters of the
// unit `module` gathered (plainly fn(args...) when it is not a unit).
template <class Fn, class... Args>
inline auto unit_call(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
  auto found = find_unit(module);  // (no structured binding: lambdas below capture these; clang 14)
  const std::shared_ptr<State> state = std::move(found.first);
  const std::size_t u = found.second;
  if (!state) return std::forward<Fn>(fn)(std::forward<Args>(args)...);
  const UnitDtypes dtypes = begin_unit_forward(Locked(*state), u);
  struct Release {  // after the forward, also when it throws
    State& state;
    std::size_t unit;
    bool now;
    ~Release() {
      if (!now) return;
      const Locked held(state);
      release(held, unit);
    }
  } release_after{*state, u, !recomputing() && !dtypes.keep};
  const std::weak_ptr<State> weak = state;
  auto enter = [&]<class A>(A&& a) -> decltype(auto) {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) return unit_input(a, dtypes.inputs, weak, u);
    else return std::forward<A>(a);
  };
  auto out = std::forward<Fn>(fn)(enter(std::forward<Args>(args))...);
  if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
    if (out.requires_grad() && at::GradMode::is_enabled()) gather_before_backward(out, weak, u);
    if (dtypes.output && out.is_floating_point() && out.scalar_type() != *dtypes.output) return out.to(*dtypes.output);
  } else {
    static_assert(std::is_same_v<decltype(out), at::Tensor>,
                  "accel::unit_forward: a fully sharded unit's forward returns one at::Tensor");
  }
  return out;
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
