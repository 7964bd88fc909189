// accel/core/pipeline_orders.hpp: the compute-only orders of torch's pipeline schedules (GPipe, 1F1B, Looped BFS, Interleaved 1F1B, the zero-bubble two, DualPipeV).
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
// reduction) is not part of it. The rules every order keeps are
// core/pipeline_rules.hpp's.
#pragma once

#include "accel/core/pipeline_rules.hpp"

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

// DualPipeV (DeepSeek's DualPipe, arXiv 2412.19437, folded into a V): ZBV's
// two stages per rank, at least as many micro-batches as stages. Rank r
// fills with forwards on both stages, then its main phase pairs a forward
// on one stage with a whole backward on the other (OVERLAP_F_B, a compound
// action), and it drains with backwards, the second half split into I and
// W, each W run when a slot has room (the oldest pending first). No empty
// slots: torch's order has none (torch's
// ScheduleDualPipeV._calculate_single_rank_operations, step for step).
inline PipelineOrder dualpipev_order(int ranks, int microbatches) {
  check_order_sizes("ScheduleDualPipeV", ranks, 2, microbatches);
  if (microbatches < 2 * ranks)
    throw InvalidArgument("accel::pp::ScheduleDualPipeV: " + std::to_string(microbatches) + " micro-batches for " +
                          std::to_string(2 * ranks) +
                          " stages: DualPipeV needs at least as many micro-batches as stages (as torch's)");
  using enum ComputationType;
  PipelineOrder order;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::optional<Action>> row;
    const std::array<int, 2> stage{r, 2 * ranks - 1 - r};  // (this rank's two, by local index 0 and 1)
    std::array<int, 2> forwards{}, backwards{};            // per local stage: the next micro-batch
    std::deque<Action> weights;                            // the W of each I run, oldest first
    auto action = [&](int local, ComputationType type) {
      const int mb = (type == FORWARD ? forwards : backwards)[static_cast<std::size_t>(local)]++;
      const Action a{stage[static_cast<std::size_t>(local)], type, mb};
      if (type == BACKWARD_INPUT) weights.push_back({a.stage_index, BACKWARD_WEIGHT, mb});
      return a;
    };
    auto add = [&](int local, ComputationType type) { row.push_back(action(local, type)); };
    auto overlap = [&](int forward_local, int backward_local) {
      Action compound{-1, OVERLAP_F_B};
      compound.sub_actions = {action(forward_local, FORWARD), action(backward_local, FULL_BACKWARD)};
      row.push_back(std::move(compound));
    };
    auto weight_if_pending = [&] {
      if (weights.empty()) return;
      row.push_back(weights.front());
      weights.pop_front();
    };
    for (int i = 0; i < 2 * (ranks - r - 1); ++i) add(0, FORWARD);
    for (int i = 0; i < r + 1; ++i) {
      add(0, FORWARD);
      add(1, FORWARD);
    }
    for (int i = 0; i < ranks - r - 1; ++i) {
      add(1, BACKWARD_INPUT);
      weight_if_pending();
      add(1, FORWARD);
    }
    for (int i = 0; i < microbatches - 2 * ranks + r + 1; ++i) {
      if (i == 0 && r == ranks - 1) {  // (not overlapped: a smaller bubble, as torch's)
        add(0, FORWARD);
        add(1, FULL_BACKWARD);
      } else {
        overlap(0, 1);
      }
      overlap(1, 0);
    }
    for (int i = 0; i < ranks - r - 1; ++i) {
      add(1, FULL_BACKWARD);
      overlap(1, 0);
    }
    // The drain: the second half of the backwards split into I and W (from the middle one on; odd ranks switch
    // before stage 1's backward there, even ranks after it).
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      add(1, split ? BACKWARD_INPUT : FULL_BACKWARD);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      add(0, split ? BACKWARD_INPUT : FULL_BACKWARD);
    }
    for (int i = 0; i < ranks - r - 1; ++i) {
      weight_if_pending();
      add(0, split ? BACKWARD_INPUT : FULL_BACKWARD);
    }
    for (int i = 0; i < r + 1; ++i) weight_if_pending();
    order.push_back(std::move(row));
  }
  return order;
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END
