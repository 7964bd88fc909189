// accel/core/pipeline_lowering.hpp: a compute-only pipeline order lowered for running: each rank's sends and receives of activations and gradients put in its list, as torch's _add_send_recv puts them.
//
// A compute-only order (core/pipeline_orders.hpp) says what each rank
// computes; running it needs the messages between ranks too. After a
// forward whose next stage lives on another rank, that rank sends the
// activation on (SEND_F) and the next stage's rank posts its receive
// (RECV_F); after a backward (B or I) whose stage before lives elsewhere, the
// input's gradient goes back (SEND_B, RECV_B). A receive is put in the
// receiver's list when its sender's computation is, never earlier, and a
// computation that needs a receive waits in its list until that receive is
// in it: so on every pair of ranks the sends and receives appear in the
// same order on both sides, and no rank waits on a message nobody is yet
// to send. Adjacent stages on one rank (ZBV's V) pass their tensors without
// a message. This is torch 2.15's _add_send_recv, step for step (tests:
// "pipeline lowering", and python_pp_orders against torch's live); the
// gather and free of sharded parameters and the gradients' reduction that
// torch also adds are the runtime's business here (training/pp/), not
// actions.
#pragma once

#include "accel/core/pipeline_rules.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// Per rank, its actions in the order it runs them: computations, sends and
// receives, no empty slots.
using LoweredOrder = std::vector<std::vector<Action>>;

// A compound action (DualPipeV's OVERLAP_F_B) is lowered as its sub-actions
// one after the other, which is how the runtime runs it.
inline LoweredOrder add_send_recv(const PipelineOrder& given, int stages_per_rank, StageStyle style) {
  const PipelineOrder compute = expand_overlaps(given);
  const int ranks = static_cast<int>(compute.size()), stages = ranks * stages_per_rank;
  auto rank_of = [&](int stage) { return stage_rank(stage, ranks, style); };
  using T = ComputationType;
  // Whether an action sends to another rank: a forward to the next stage, a
  // backward (B or I: the input's gradient) to the stage before.
  auto has_comms = [&](const Action& a) {
    if (a.computation_type == T::FORWARD)
      return a.stage_index != stages - 1 && rank_of(a.stage_index + 1) != rank_of(a.stage_index);
    if (a.computation_type == T::FULL_BACKWARD || a.computation_type == T::BACKWARD_INPUT)
      return a.stage_index != 0 && rank_of(a.stage_index - 1) != rank_of(a.stage_index);
    return false;
  };
  LoweredOrder lowered(static_cast<std::size_t>(ranks));
  // What each rank's list holds so far, as (stage, type, micro-batch) keys.
  std::vector<std::set<std::tuple<int, T, int>>> done(static_cast<std::size_t>(ranks));
  auto key = [](int stage, T type, int mb) { return std::tuple{stage, type, mb}; };
  auto append = [&](int rank, const Action& a) {
    lowered[static_cast<std::size_t>(rank)].push_back(a);
    done[static_cast<std::size_t>(rank)].insert(
        key(a.stage_index, a.computation_type, a.microbatch_index.value_or(-1)));
  };
  // A computation can join its rank's list once what it consumes from another
  // stage is there: its receive, or (the neighbouring stage on this rank)
  // that stage's computation.
  auto ready = [&](const std::optional<Action>& a, int rank) {
    if (!a) return true;
    const auto& seen = done[static_cast<std::size_t>(rank)];
    const int s = a->stage_index, mb = a->microbatch_index.value_or(-1);
    if (a->computation_type == T::FORWARD && s != 0)
      return seen.contains(key(s, T::RECV_F, mb)) || seen.contains(key(s - 1, T::FORWARD, mb));
    if ((a->computation_type == T::BACKWARD_INPUT || a->computation_type == T::FULL_BACKWARD) && s != stages - 1)
      return seen.contains(key(s, T::RECV_B, mb)) || seen.contains(key(s + 1, T::BACKWARD_INPUT, mb)) ||
             seen.contains(key(s + 1, T::FULL_BACKWARD, mb));
    return true;
  };
  std::vector<std::size_t> next(static_cast<std::size_t>(ranks), 0);
  for (;;) {
    bool left = false, progress = false;
    for (int r = 0; r < ranks; ++r) {  // (in rank order, as torch's sweep)
      const auto& row = compute[static_cast<std::size_t>(r)];
      std::size_t& at = next[static_cast<std::size_t>(r)];
      if (at == row.size()) continue;
      left = true;
      const std::optional<Action>& a = row[at];
      if (!ready(a, r)) continue;
      if (a) {
        append(r, *a);
        if (has_comms(*a)) {
          const bool fwd = a->computation_type == T::FORWARD;
          const int to = fwd ? a->stage_index + 1 : a->stage_index - 1;
          append(r, {a->stage_index, fwd ? T::SEND_F : T::SEND_B, a->microbatch_index});
          append(rank_of(to), {to, fwd ? T::RECV_F : T::RECV_B, a->microbatch_index});
        }
      }
      ++at;
      progress = true;
    }
    if (!left) return lowered;
    if (!progress) {
      std::string waiting;
      for (int r = 0; r < ranks; ++r)
        if (next[static_cast<std::size_t>(r)] < compute[static_cast<std::size_t>(r)].size())
          waiting += (waiting.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " at " +
                     to_string(compute[static_cast<std::size_t>(r)][next[static_cast<std::size_t>(r)]]);
      throw InvalidArgument(
          "accel::pp: the order cannot be lowered to sends and receives: every rank waits for a "
          "message no rank is yet to send (" +
          waiting + ")");
    }
  }
}

// torch's CSV of a lowered order (_dump_csv(format="compute_comms")): the
// same form as a compute-only one, without empty slots.
inline PipelineOrder as_order(const LoweredOrder& lowered) {
  PipelineOrder order;
  for (const auto& row : lowered) order.emplace_back(row.begin(), row.end());
  return order;
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END
