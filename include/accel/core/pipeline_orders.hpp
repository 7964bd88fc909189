// accel/core/pipeline_orders.hpp: the compute-only orders of torch's pipeline schedules (GPipe, 1F1B, Looped BFS, Interleaved 1F1B, the zero-bubble two), and the rules every order must keep.
//
// A compute-only order says, per pipeline rank and time step, which stage
// runs the forward (F) or backward (B; zero bubble: I then W) of which
// micro-batch, an empty slot where the rank waits for a neighbour: one time
// step per action, the model torch's schedules are written in
// (pipeline_order). Stages are spread over the ranks in a loop: with p ranks
// and v stages per rank, rank r holds stages r, r + p, ..., r + (v - 1) p
// (ZBV's V: r and 2p - 1 - r). Each function here makes the order
// torch.distributed.pipelining makes for the same arguments (torch 2.15's
// schedules.py; tests: "pipeline orders", and python_pp_orders live); the
// communication a running schedule adds (sends, receives, the gradients'
// reduction) is not part of it.
#pragma once

#include "accel/core/pipeline_actions.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
inline void check_order_sizes(std::string_view schedule, int ranks, int stages_per_rank, int microbatches) {
  if (ranks < 1 || stages_per_rank < 1 || microbatches < 1)
    throw InvalidArgument("accel::pp::" + std::string(schedule) + ": " + std::to_string(ranks) + " ranks, " +
                          std::to_string(stages_per_rank) + " stages per rank and " + std::to_string(microbatches) +
                          " micro-batches: each must be at least 1");
}
inline Action forward(int stage, int microbatch) { return {stage, ComputationType::FORWARD, microbatch}; }
inline Action backward(int stage, int microbatch) { return {stage, ComputationType::FULL_BACKWARD, microbatch}; }
inline void wait_steps(std::vector<std::optional<Action>>& row, int steps) {
  row.insert(row.end(), static_cast<std::size_t>(std::max(steps, 0)), std::nullopt);
}

// GPipe: every forward, then every backward. Rank r starts r steps late; its
// first backward waits 3 (p - 1 - r) steps, for the backward to come back
// from the last rank (torch's ScheduleGPipe._get_pipeline_order, before it
// drops the empty slots and adds the reduction).
inline PipelineOrder gpipe_order(int ranks, int microbatches) {
  check_order_sizes("ScheduleGPipe", ranks, 1, microbatches);
  PipelineOrder order(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& row = order[static_cast<std::size_t>(r)];
    wait_steps(row, r);
    for (int mb = 0; mb < microbatches; ++mb) row.push_back(forward(r, mb));
    wait_steps(row, 3 * (ranks - 1 - r));
    for (int mb = 0; mb < microbatches; ++mb) row.push_back(backward(r, mb));
  }
  return order;
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

// 1F1B: p - 1 - r forwards to fill the pipeline, then one forward and one
// backward in turn, then the backwards left (torch's Schedule1F1B), each at
// the earliest step it can run (aligned). torch's own order of it
// (_get_pipeline_order, which only its tools read) differs in two ways: it
// names the last rank's forwards 1..m where its step runs 0..m-1, and its
// empty slots put some forwards at the step of the stage before them; here
// the micro-batches are those the step runs and every step is one it can
// run (docs/differences.md).
inline PipelineOrder one_f_one_b_order(int ranks, int microbatches) {
  check_order_sizes("Schedule1F1B", ranks, 1, microbatches);
  if (microbatches < ranks)
    throw InvalidArgument("accel::pp::Schedule1F1B: " + std::to_string(microbatches) + " micro-batches for " +
                          std::to_string(ranks) +
                          " stages: 1F1B needs at least one micro-batch per stage (as torch's)");
  PipelineOrder sequences(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& row = sequences[static_cast<std::size_t>(r)];
    const int warmup = ranks - 1 - r;
    for (int mb = 0; mb < warmup; ++mb) row.push_back(forward(r, mb));
    int next_backward = 0;
    for (int mb = warmup; mb < microbatches; ++mb) {
      row.push_back(forward(r, mb));
      row.push_back(backward(r, next_backward++));
    }
    while (next_backward < microbatches) row.push_back(backward(r, next_backward++));
  }
  return aligned(sequences, 1, microbatches);
}

// Looped BFS (breadth first, arXiv 2211.05953): each rank runs every
// micro-batch's forward on its first stage, then on its next, ...; then the
// backwards, last stage first and last micro-batch first (torch's
// ScheduleLoopedBFS._calculate_single_rank_operations).
inline PipelineOrder looped_bfs_order(int ranks, int stages_per_rank, int microbatches) {
  check_order_sizes("ScheduleLoopedBFS", ranks, stages_per_rank, microbatches);
  PipelineOrder order(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& row = order[static_cast<std::size_t>(r)];
    wait_steps(row, r);
    for (int local = 0; local < stages_per_rank; ++local)
      for (int mb = 0; mb < microbatches; ++mb) row.push_back(forward(r + local * ranks, mb));
    wait_steps(row, 2 * (ranks - 1 - r));
    for (int local = stages_per_rank - 1; local >= 0; --local)
      for (int mb = microbatches - 1; mb >= 0; --mb) row.push_back(backward(r + local * ranks, mb));
  }
  return order;
}

// The micro-batches' rounds of the interleaved schedules: m / max(1, m / p)
// micro-batches each, m a multiple of their number (torch's rule).
inline int microbatches_per_round(std::string_view schedule, int ranks, int microbatches) {
  const int rounds = std::max(1, microbatches / ranks);
  if (microbatches % rounds != 0)
    throw InvalidArgument("accel::pp::" + std::string(schedule) + ": " + std::to_string(microbatches) +
                          " micro-batches are not a multiple of the number of rounds, " + std::to_string(rounds) +
                          " (max(1, micro-batches / " + std::to_string(ranks) + " ranks)), as torch requires");
  return microbatches / rounds;
}

// One rank's list of an interleaved schedule (torch's _get_1f1b_rank_ops):
// `warmup` forwards, round by round over the rank's stages, then a forward
// and a backward in turn, then the backwards left, the backwards going over
// the stages in reverse. Interleaved 1F1B waits for the first backward after
// the warm-up and before each backward of the cool-down; zero bubble splits
// each backward into I and, from the (`first_weights` + 1)-th backward on,
// the W of the oldest backward whose weights are pending, and the W left at
// the end, with no waits of its own (_add_bubbles adds them).
inline std::vector<std::optional<Action>> interleaved_rank_ops(int ranks, int v, int per_round, int microbatches, int r,
                                                               int warmup, bool zero_bubble, int first_weights) {
  const int ops = v * microbatches;
  auto forward_stage = [&](int step) { return (step / per_round) % v * ranks + r; };
  auto backward_stage = [&](int step) { return (v - 1 - ((step - warmup) / per_round) % v) * ranks + r; };
  const ComputationType backward_type = zero_bubble ? ComputationType::BACKWARD_INPUT : ComputationType::FULL_BACKWARD;
  std::map<int, int> forwards, backwards, weights;  // per stage: the next micro-batch
  std::vector<int> backward_steps;                  // the steps whose backward ran, in order
  std::size_t weighed = 0;
  std::vector<std::optional<Action>> row;
  auto weight = [&] {
    const int stage = backward_stage(backward_steps[weighed++]);
    row.push_back(Action{stage, ComputationType::BACKWARD_WEIGHT, weights[stage]++});
  };
  wait_steps(row, r);
  for (int step = 0; step < ops + warmup; ++step) {
    // (warmup forwards, then ops - warmup steps of a forward and a backward, then warmup backwards)
    if (step < warmup) {
      const int stage = forward_stage(step);
      row.push_back(forward(stage, forwards[stage]++));
      if (step == warmup - 1)
        wait_steps(row, zero_bubble ? ranks - r - 1 : v * ranks + 2 * (ranks - 1 - r) - (warmup + r));
      continue;
    }
    if (step < ops) {
      const int f = forward_stage(step);
      row.push_back(forward(f, forwards[f]++));
    } else if (!zero_bubble) {
      row.push_back(std::nullopt);
    }
    const int b = backward_stage(step);
    row.push_back(Action{b, backward_type, backwards[b]++});
    backward_steps.push_back(step);
    if (zero_bubble && step - warmup >= first_weights) weight();
  }
  while (zero_bubble && weighed < backward_steps.size()) weight();
  return row;
}

// Interleaved 1F1B (Megatron's virtual pipeline): a rank warms up with
// (v - 1) rounds' forwards plus 2 (p - 1 - r), at most v m (torch's
// ScheduleInterleaved1F1B).
inline PipelineOrder interleaved_1f1b_order(int ranks, int stages_per_rank, int microbatches) {
  check_order_sizes("ScheduleInterleaved1F1B", ranks, stages_per_rank, microbatches);
  const int per_round = microbatches_per_round("ScheduleInterleaved1F1B", ranks, microbatches);
  PipelineOrder order;
  for (int r = 0; r < ranks; ++r) {
    const int warmup =
        std::min((stages_per_rank - 1) * per_round + 2 * (ranks - 1 - r), stages_per_rank * microbatches);
    order.push_back(interleaved_rank_ops(ranks, stages_per_rank, per_round, microbatches, r, warmup, false, 0));
  }
  return order;
}

// Zero bubble interleaved (arXiv 2401.10241): as Interleaved 1F1B with a
// warm-up of (v - 1) rounds plus p - 1 - r and the backward split, rank r
// deferring its first r backwards' weights; then each rank's slots walked in
// step with the others', an empty slot put before a forward whose stage
// before has not run it yet (torch's ScheduleInterleavedZeroBubble and its
// _add_bubbles_to_actions, which waits for nothing else: an I may run at the
// step of the stage after's).
inline PipelineOrder interleaved_zero_bubble_order(int ranks, int stages_per_rank, int microbatches) {
  check_order_sizes("ScheduleInterleavedZeroBubble", ranks, stages_per_rank, microbatches);
  const int per_round = microbatches_per_round("ScheduleInterleavedZeroBubble", ranks, microbatches);
  PipelineOrder lists;
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min((stages_per_rank - 1) * per_round + (ranks - 1 - r), stages_per_rank * microbatches);
    lists.push_back(interleaved_rank_ops(ranks, stages_per_rank, per_round, microbatches, r, warmup, true, r));
  }
  // (stage, micro-batch) whose forward ran at an earlier step
  std::vector<char> forwarded(static_cast<std::size_t>(ranks * stages_per_rank * microbatches), 0);
  auto ran = [&](int stage, int mb) -> char& { return forwarded[static_cast<std::size_t>(stage * microbatches + mb)]; };
  PipelineOrder order(lists.size());
  std::vector<std::size_t> next(lists.size(), 0);
  for (bool going = true; going;) {
    going = false;
    std::vector<std::pair<int, int>> now;
    for (std::size_t r = 0; r < lists.size(); ++r) {
      if (next[r] == lists[r].size()) continue;
      going = true;
      const std::optional<Action>& a = lists[r][next[r]];
      const bool waits = a && a->computation_type == ComputationType::FORWARD && a->stage_index > 0 &&
                         !ran(a->stage_index - 1, *a->microbatch_index);
      if (waits) {
        order[r].push_back(std::nullopt);
        continue;
      }
      order[r].push_back(a);
      if (a && a->computation_type == ComputationType::FORWARD) now.emplace_back(a->stage_index, *a->microbatch_index);
      ++next[r];
    }
    for (const auto& [stage, mb] : now) ran(stage, mb) = 1;
  }
  return order;
}

// ZBV zero bubble (arXiv 2401.10241's V schedule): two stages per rank in a
// V, rank r holding stages r and 2p - 1 - r, the backward split into I and W
// (torch's ScheduleZBVZeroBubble: its phases run as if there were at least
// 2p - 1 micro-batches, the actions of those past m left as empty slots).
inline PipelineOrder zbv_zero_bubble_order(int ranks, int microbatches) {
  check_order_sizes("ScheduleZBVZeroBubble", ranks, 2, microbatches);
  const int planned = std::max(2 * ranks - 1, microbatches), last_stage = 2 * ranks - 1;
  PipelineOrder order;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::optional<Action>> row;
    wait_steps(row, r);
    const int first = r, second = last_stage - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto add = [&](int stage, ComputationType type, int mb) {
      row.push_back(mb < microbatches ? std::optional<Action>(Action{stage, type, mb}) : std::nullopt);
    };
    using enum ComputationType;
    for (int i = 0; i < 2 * (ranks - r) - 1; ++i) add(first, FORWARD, f0++);
    for (int i = 0; i < r; ++i) {
      add(second, FORWARD, f1++);
      add(first, FORWARD, f0++);
    }
    for (int i = 0; i < ranks - r; ++i) {
      add(second, FORWARD, f1++);
      add(second, BACKWARD_INPUT, b1);
      add(second, BACKWARD_WEIGHT, b1++);
    }
    while (f1 < f0 || f0 < planned) {
      if (f0 < planned) add(first, FORWARD, f0++);
      add(first, BACKWARD_INPUT, b0);
      add(first, BACKWARD_WEIGHT, b0++);
      add(second, FORWARD, f1++);
      add(second, BACKWARD_INPUT, b1);
      add(second, BACKWARD_WEIGHT, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int i = 0; i < r; ++i) {
      add(first, BACKWARD_INPUT, b0++);
      add(second, BACKWARD_INPUT, b1++);
    }
    for (int i = 0; i < ranks - r; ++i) {
      add(first, BACKWARD_INPUT, b0++);
      add(first, BACKWARD_WEIGHT, w0++);
    }
    while (w1 < b1) add(second, BACKWARD_WEIGHT, w1++);
    while (w0 < b0) add(first, BACKWARD_WEIGHT, w0++);
    order.push_back(std::move(row));
  }
  return order;
}

// Which rank holds a stage: in a loop (stage s on rank s mod p: every
// schedule but ZBV) or in a V (stages 0..p-1 on ranks 0..p-1, then p..2p-1
// back on ranks p-1..0, and so on), as torch's
// generate_stage_to_rank_mapping.
enum class StageStyle { loop, v };
inline int stage_rank(int stage, int ranks, StageStyle style) {
  const int at = stage % ranks;
  return style == StageStyle::loop || (stage / ranks) % 2 == 0 ? at : ranks - 1 - at;
}

// The rules every compute-only order keeps, returned as the first one
// broken, or nothing (what torch's _validate_schedule checks, and that it
// can run): every stage of the `ranks x stages_per_rank` lives on its rank
// (stage_rank); each stage runs each micro-batch's forward once and its
// backward once (B, or I then W), the forward first; and the ranks' lists,
// run in order with what each action needs from the neighbouring stages
// (aligned), never all wait on each other. Not checked: the empty slots'
// timing, which is only a picture (torch's own orders put some actions at
// the step of what they need when micro-batches are fewer than ranks).
inline std::optional<std::string> order_error(const PipelineOrder& order, int stages_per_rank, int microbatches,
                                              StageStyle style = StageStyle::loop) {
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
