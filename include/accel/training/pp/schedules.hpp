// accel/training/pp/schedules.hpp: torch.distributed.pipelining's schedules (ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV): step() over this rank's stages, and the order as torch's CSV.
//
// Each rank of the pipeline group makes the same schedule over its own
// stages (one for GPipe and 1F1B, several for the others) and calls step()
// with the whole batch: the first stage's rank passes the inputs, the last
// stage's the target (and gets the merged output and, through `losses`,
// each micro-batch's loss); a rank with neither passes nothing. The batch
// is cut into n_microbatches along dimension 0; every stage runs each
// micro-batch's forward and backward in the schedule's order, the
// gradients adding up in the parameters' .grad over the micro-batches and,
// with scale_grads (torch's default), each micro-batch's divided by their
// number: the gradient of the micro-batches' mean loss, what one process
// gets for the whole batch with a loss that averages over it. (torch
// divides the sum after the step, which also divides what an earlier step
// left in .grad; here a step adds its mean to it, so gradients accumulate
// over steps as over backwards: PipelineStage::grads.)
//
// The order is made once, from the arguments alone (core/pipeline_orders.hpp),
// checked (core/pipeline_rules.hpp) and lowered with its messages
// (core/pipeline_lowering.hpp); load_csv replaces it with a user's, in
// torch's compute-only CSV, checked by the same rules; dump_csv writes it.
// The first step begins by checking that the stages fit together
// (training/pp/shape_check.hpp).
#pragma once

#include "accel/core/pipeline_orders.hpp"
#include "accel/training/pp/shape_check.hpp"

ACCEL_NAMESPACE_BEGIN

namespace pp {
// What every schedule shares (torch's _PipelineSchedule).
class PipelineSchedule {
 public:
  virtual ~PipelineSchedule() = default;
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  // One step: every micro-batch's forward and backward. `inputs` on the
  // first stage's rank, `target` on the last's; returns the last stage's
  // outputs merged along dimension 0 there (undefined elsewhere) and fills
  // `losses` (when given) with each micro-batch's loss, detached.
  at::Tensor step(const at::Tensor& inputs = {}, const at::Tensor& target = {},
                  std::vector<at::Tensor>* losses = nullptr) {
    std::vector<at::Tensor> input_mbs, target_mbs;
    const auto split = [&] {
      if (plan_.stages.contains(0)) input_mbs = detail::pp::split_microbatches(inputs, n_microbatches_, "inputs");
      if (plan_.stages.contains(plan_.num_stages - 1))
        target_mbs = detail::pp::split_microbatches(target, n_microbatches_, "target");
    };
    if (checked_) {
      split();
    } else {  // the first step: the stages checked together first (training/pp/shape_check.hpp)
      detail::pp::check_stages_fit(plan_, input_mbs, target_mbs, loss_fn_, detail::error_of(split),
                                   "accel::pp::" + name_);
      checked_ = true;
    }
    for (auto& [index, stage] : plan_.stages) stage->begin_step(n_microbatches_, scale_grads_);
    detail::pp::StepResult result;
    try {
      result = detail::pp::StepRun(plan_, std::move(input_mbs), std::move(target_mbs), loss_fn_, n_microbatches_).run();
    } catch (...) {
      for (auto& [index, stage] : plan_.stages) {
        stage->clear();
        stage->end_step();
      }
      throw;
    }
    for (auto& [index, stage] : plan_.stages) stage->end_step();
    compute_seconds_ = result.compute_seconds;
    if (!plan_.stages.contains(plan_.num_stages - 1)) return {};
    if (losses) {
      losses->clear();
      for (const auto& loss : result.losses) losses->push_back(loss.detach());
    }
    return at::cat(result.outputs, 0);
  }

  int n_microbatches() const { return n_microbatches_; }
  // The time this rank spent in its stages' forwards, backwards and losses
  // in the last step; the rest of the step it waited (the bubble) or moved
  // messages.
  double compute_seconds() const { return compute_seconds_; }
  // The compute-only order, a row per rank (torch's pipeline_order).
  const detail::pp::PipelineOrder& pipeline_order() const { return order_; }
  // torch's _dump_csv(format="compute_only") and _load_csv: the order as a
  // CSV row per rank; a loaded one must keep the rules for this schedule's
  // stages and micro-batches (every rank loads the same file).
  void dump_csv(const std::string& path) const {
    std::ofstream out(path, std::ios::binary);
    detail::pp::write_csv(out, order_);
    if (!out.flush()) throw RuntimeError("accel::pp::" + name_ + "::dump_csv: cannot write " + path);
  }
  void load_csv(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InvalidArgument("accel::pp::" + name_ + "::load_csv: cannot read " + path);
    set_order(detail::pp::read_csv(in), path);
  }

 protected:
  PipelineSchedule(std::string name, std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn,
                   bool scale_grads, detail::pp::StageStyle style)
      : name_(std::move(name)),
        n_microbatches_(n_microbatches),
        loss_fn_(std::move(loss_fn)),
        scale_grads_(scale_grads),
        style_(style) {
    const std::string who = "accel::pp::" + name_ + ": ";
    if (stages.empty()) throw InvalidArgument(who + "no stage");
    const PipelineStage& first = *stages.front();
    ranks_ = first.group() ? first.group()->getSize() : 1;
    plan_.rank = first.group() ? first.group()->getRank() : 0;
    plan_.num_stages = first.num_stages();
    stages_per_rank_ = static_cast<int>(stages.size());
    if (n_microbatches < 1)
      throw InvalidArgument(who + "n_microbatches " + std::to_string(n_microbatches) + " (at least 1)");
    for (PipelineStage* s : stages)
      if (s->num_stages() != plan_.num_stages || s->group() != first.group() || s->device() != first.device())
        throw InvalidArgument(who + "stages " + std::to_string(first.stage_index()) + " and " +
                              std::to_string(s->stage_index()) +
                              " differ in num_stages, group or device; a rank's stages share all three");
    if (plan_.num_stages != ranks_ * stages_per_rank_)
      throw InvalidArgument(who + std::to_string(plan_.num_stages) + " stages over a pipeline group of " +
                            std::to_string(ranks_) + " ranks with " + std::to_string(stages_per_rank_) +
                            " stage(s) on each: num_stages must be " + std::to_string(ranks_ * stages_per_rank_));
    for (PipelineStage* s : stages) {
      const int holder = detail::pp::stage_rank(s->stage_index(), ranks_, style_);
      if (holder != plan_.rank)
        throw InvalidArgument(who + "stage " + std::to_string(s->stage_index()) + " belongs on rank " +
                              std::to_string(holder) + " of the pipeline group (" +
                              (style_ == detail::pp::StageStyle::v ? "a V" : "a loop") + " of " +
                              std::to_string(plan_.num_stages) + " stages over " + std::to_string(ranks_) +
                              " ranks), not on rank " + std::to_string(plan_.rank));
      if (!plan_.stages.emplace(s->stage_index(), s).second)
        throw InvalidArgument(who + "stage " + std::to_string(s->stage_index()) + " given twice");
    }
    if (plan_.stages.contains(plan_.num_stages - 1) && !loss_fn_)
      throw InvalidArgument(who +
                            "this rank holds the last stage and no loss_fn was given (step() trains: "
                            "its backward starts from each micro-batch's loss)");
    plan_.rank_of = [ranks = ranks_, style](int stage) { return detail::pp::stage_rank(stage, ranks, style); };
  }
  // The order made, checked and lowered (`source`: where it came from, for errors).
  void set_order(detail::pp::PipelineOrder order, const std::string& source = {}) {
    const std::string who = "accel::pp::" + name_ + ": ";
    if (static_cast<int>(order.size()) != ranks_)
      throw InvalidArgument(who + "the order " + (source.empty() ? "" : "in " + source + " ") + "has " +
                            std::to_string(order.size()) + " rows; the pipeline group has " + std::to_string(ranks_) +
                            " ranks (a row per rank)");
    if (auto error = detail::pp::order_error(order, stages_per_rank_, n_microbatches_, style_))
      throw InvalidArgument(who + "the order " + (source.empty() ? "" : "in " + source + " ") +
                            "breaks a rule: " + *error);
    plan_.actions = detail::pp::add_send_recv(order, stages_per_rank_, style_)[static_cast<std::size_t>(plan_.rank)];
    order_ = std::move(order);
  }
  static std::vector<PipelineStage*> pointers(const std::vector<std::reference_wrapper<PipelineStage>>& stages) {
    std::vector<PipelineStage*> out;
    for (auto& s : stages) out.push_back(&s.get());
    return out;
  }
  int ranks() const { return ranks_; }
  int stages_per_rank() const { return stages_per_rank_; }

 private:
  std::string name_;
  int n_microbatches_;
  LossFn loss_fn_;
  bool scale_grads_;
  detail::pp::StageStyle style_;
  int ranks_ = 1, stages_per_rank_ = 1;
  detail::pp::RankPlan plan_;
  detail::pp::PipelineOrder order_;
  double compute_seconds_ = 0;
  bool checked_ = false;  // whether a step checked the stages (once, as torch infers their shapes once)
};

// One stage per rank (torch's PipelineScheduleSingle family).
class ScheduleGPipe : public PipelineSchedule {
 public:
  ScheduleGPipe(PipelineStage& stage, int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleGPipe", {&stage}, n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::gpipe_order(ranks(), n_microbatches));
  }
};
class Schedule1F1B : public PipelineSchedule {
 public:
  Schedule1F1B(PipelineStage& stage, int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("Schedule1F1B", {&stage}, n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::one_f_one_b_order(ranks(), n_microbatches));
  }
};

// Several stages per rank, in a loop (torch's PipelineScheduleMulti family).
class ScheduleLoopedBFS : public PipelineSchedule {
 public:
  ScheduleLoopedBFS(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches, LossFn loss_fn = {},
                    bool scale_grads = true)
      : PipelineSchedule("ScheduleLoopedBFS", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::looped_bfs_order(ranks(), stages_per_rank(), n_microbatches));
  }
};
class ScheduleInterleaved1F1B : public PipelineSchedule {
 public:
  ScheduleInterleaved1F1B(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches,
                          LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleInterleaved1F1B", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::interleaved_1f1b_order(ranks(), stages_per_rank(), n_microbatches));
  }
};
class ScheduleInterleavedZeroBubble : public PipelineSchedule {
 public:
  ScheduleInterleavedZeroBubble(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches,
                                LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleInterleavedZeroBubble", pointers(stages), n_microbatches, std::move(loss_fn),
                         scale_grads, detail::pp::StageStyle::loop) {
    set_order(detail::pp::interleaved_zero_bubble_order(ranks(), stages_per_rank(), n_microbatches));
  }
};
// Two stages per rank in a V: rank r holds stages r and 2p - 1 - r.
class ScheduleZBVZeroBubble : public PipelineSchedule {
 public:
  ScheduleZBVZeroBubble(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches,
                        LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleZBVZeroBubble", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::v) {
    if (stages_per_rank() != 2)
      throw InvalidArgument("accel::pp::ScheduleZBVZeroBubble: " + std::to_string(stages_per_rank()) +
                            " stages on this rank; ZBV runs two per rank (stages r and 2p - 1 - r)");
    set_order(detail::pp::zbv_zero_bubble_order(ranks(), n_microbatches));
  }
};
// DualPipeV: ZBV's V with a forward and a backward paired in its main phase
// (OVERLAP_F_B, run one after the other), n_microbatches at least 2p.
class ScheduleDualPipeV : public PipelineSchedule {
 public:
  ScheduleDualPipeV(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches, LossFn loss_fn = {},
                    bool scale_grads = true)
      : PipelineSchedule("ScheduleDualPipeV", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::v) {
    if (stages_per_rank() != 2)
      throw InvalidArgument("accel::pp::ScheduleDualPipeV: " + std::to_string(stages_per_rank()) +
                            " stages on this rank; DualPipeV runs two per rank (stages r and 2p - 1 - r)");
    set_order(detail::pp::dualpipev_order(ranks(), n_microbatches));
  }
};
}  // namespace pp

ACCEL_NAMESPACE_END
