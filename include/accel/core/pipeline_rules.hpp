// accel/core/pipeline_rules.hpp: the rules every pipeline order keeps (each stage's forward before its backward, what a stage needs from its neighbours), which rank holds a stage, and an order placed at the steps it can run.
//
// A schedule's order (core/pipeline_actions.hpp) is right when every
// stage runs each micro-batch's forward and backward once, in that order,
// on the rank that holds it, and when the ranks' lists, each run in order,
// never all wait on each other: a forward needs the stage before's forward
// of its micro-batch (its activation is sent on), a backward the stage
// after's backward (its gradient is sent back). order_error checks an
// order (one of core/pipeline_orders.hpp's, or a user's from a CSV);
// aligned places lists at the earliest steps they can run.
#pragma once

#include "accel/core/pipeline_actions.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// Which rank holds a stage: in a loop (stage s on rank s mod p: every
// schedule but ZBV) or in a V (stages 0..p-1 on ranks 0..p-1, then p..2p-1
// back on ranks p-1..0, and so on), as torch's
// generate_stage_to_rank_mapping.
enum class StageStyle { loop, v };
inline int stage_rank(int stage, int ranks, StageStyle style) {
  const int at = stage % ranks;
  return style == StageStyle::loop || (stage / ranks) % 2 == 0 ? at : ranks - 1 - at;
}

// Places each rank's actions (in their order, without empty slots) at the
// earliest steps the rules below (order_error) allow: each action one step
// after the one before it on its rank and after what it needs from the
// neighbouring stages (the forward before, the backward after). An action
// that never can run (the ranks wait on each other) is an error naming it.
inline PipelineOrder aligned(const PipelineOrder& sequences, int stages_per_rank, int microbatches) {
  const int ranks = static_cast<int>(sequences.size()), stages = ranks * stages_per_rank;
  std::map<std::tuple<int, int, char>, int> done;  // (stage, micro-batch, F / B / W) -> step
  auto ran = [&](int stage, int mb, char kind, int before) {
    const auto it = done.find({stage, mb, kind});
    return it != done.end() && it->second < before;
  };
  PipelineOrder order(sequences.size());
  std::vector<std::size_t> next(sequences.size(), 0);
  std::size_t left = 0;
  for (const auto& row : sequences)
    left +=
        static_cast<std::size_t>(std::count_if(row.begin(), row.end(), [](const auto& a) { return a.has_value(); }));
  for (int step = 0; left > 0; ++step) {
    bool moved = false;
    for (int r = 0; r < ranks; ++r) {
      auto& row = sequences[static_cast<std::size_t>(r)];
      std::size_t& k = next[static_cast<std::size_t>(r)];
      while (k < row.size() && !row[k]) ++k;
      if (k == row.size()) continue;
      const Action& a = *row[k];
      const int stage = a.stage_index, mb = a.microbatch_index.value_or(0);
      // F needs the stage before's F; B and I (the input's gradient, 'B' below) this stage's F and the stage
      // after's B or I; W this stage's I.
      const char kind = a.computation_type == ComputationType::FORWARD           ? 'F'
                        : a.computation_type == ComputationType::BACKWARD_WEIGHT ? 'W'
                                                                                 : 'B';
      const bool ready = kind == 'F' ? (stage == 0 || ran(stage - 1, mb, 'F', step))
                         : kind == 'W'
                             ? ran(stage, mb, 'B', step)
                             : ran(stage, mb, 'F', step) && (stage + 1 == stages || ran(stage + 1, mb, 'B', step));
      auto& out = order[static_cast<std::size_t>(r)];
      if (!ready) {
        out.push_back(std::nullopt);
        continue;
      }
      out.push_back(a);
      done[{stage, mb, kind}] = step;
      ++k;
      --left;
      moved = true;
    }
    if (!moved) {
      std::string waiting;
      for (int r = 0; r < ranks; ++r)
        if (next[static_cast<std::size_t>(r)] < sequences[static_cast<std::size_t>(r)].size()) {
          if (!waiting.empty()) waiting += ", ";
          waiting += "rank " + std::to_string(r) + " at " +
                     to_string(sequences[static_cast<std::size_t>(r)][next[static_cast<std::size_t>(r)]]);
        }
      throw InvalidArgument("accel::pp: the schedule cannot go on (" + std::to_string(microbatches) +
                            " micro-batches): every rank waits for another: " + waiting);
    }
  }
  for (auto& row : order)  // (the steps after a rank's last action)
    while (!row.empty() && !row.back()) row.pop_back();
  return order;
}

// The rules every compute-only order keeps, returned as the first one
// broken, or nothing (what torch's _validate_schedule checks, and that it
// can run): every stage of the `ranks x stages_per_rank` lives on its rank
// (stage_rank); each stage runs each micro-batch's forward once and its
// backward once (B, or I then W), the forward first; and the ranks' lists,
// run in order with what each action needs from the neighbouring stages
// (aligned), never all wait on each other. Not checked: the empty slots'
// timing, which is only a picture (torch's own orders put some actions at
// the step of what they need when micro-batches are fewer than ranks). A
// compound action (OVERLAP_F_B) counts as its sub-actions in their order,
// the steps named those of the order so expanded.
inline std::optional<std::string> order_error(const PipelineOrder& given, int stages_per_rank, int microbatches,
                                              StageStyle style = StageStyle::loop) {
  const PipelineOrder order = expand_overlaps(given);
  const int ranks = static_cast<int>(order.size()), stages = ranks * stages_per_rank;
  enum Kind { F, B, I, W, kinds };
  std::vector<int> at(static_cast<std::size_t>(stages * microbatches * kinds), -1);
  auto slot = [&](int stage, int mb, Kind k) -> int& {
    return at[static_cast<std::size_t>((stage * microbatches + mb) * kinds + k)];
  };
  for (int r = 0; r < ranks; ++r)
    for (std::size_t t = 0; t < order[static_cast<std::size_t>(r)].size(); ++t) {
      const std::optional<Action>& a = order[static_cast<std::size_t>(r)][t];
      if (!a) continue;
      const std::string where = "rank " + std::to_string(r) + ", step " + std::to_string(t) + ": " + to_string(*a);
      if (a->stage_index < 0 || a->stage_index >= stages || stage_rank(a->stage_index, ranks, style) != r)
        return where + ": stage " + std::to_string(a->stage_index) + " is not one of this rank's";
      Kind k;
      switch (a->computation_type) {
        case ComputationType::FORWARD: k = F; break;
        case ComputationType::FULL_BACKWARD: k = B; break;
        case ComputationType::BACKWARD_INPUT: k = I; break;
        case ComputationType::BACKWARD_WEIGHT: k = W; break;
        default: return where + ": not a computation (a compute-only order has F, B, I and W)";
      }
      if (!a->microbatch_index || *a->microbatch_index < 0 || *a->microbatch_index >= microbatches)
        return where + ": no micro-batch of the " + std::to_string(microbatches);
      int& seen = slot(a->stage_index, *a->microbatch_index, k);
      if (seen >= 0) return where + ": runs twice (first at step " + std::to_string(seen) + ")";
      seen = static_cast<int>(t);
    }
  for (int s = 0; s < stages; ++s)
    for (int mb = 0; mb < microbatches; ++mb) {
      const std::string what = "stage " + std::to_string(s) + ", micro-batch " + std::to_string(mb);
      const int f = slot(s, mb, F), b = slot(s, mb, B), i = slot(s, mb, I), w = slot(s, mb, W);
      if (f < 0) return what + ": no forward";
      if ((b >= 0) == (i >= 0)) return what + (b >= 0 ? ": both B and I" : ": no backward (B, or I and W)");
      if ((i >= 0) != (w >= 0)) return what + (i >= 0 ? ": I without W" : ": W without I");
      if ((b >= 0 ? b : i) <= f) return what + ": backward before its forward";
      if (w >= 0 && w <= i) return what + ": W before I";
    }
  try {
    (void)aligned(order, stages_per_rank, microbatches);
  } catch (const InvalidArgument& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END
