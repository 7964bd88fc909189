// accel/training/pp/shape_check.hpp: a schedule's first step begins by running micro-batch 0 through every stage without autograd, so that stages that do not fit together are refused on every rank at once, naming the shapes, before anything trains.
//
// torch's PipelineStage infers what passes between stages the same way on
// its first step: a forward through the stages in order, each passing its
// output's shape on. The steps here need no inference (each step's first
// activation carries its shape, training/pp/messages.hpp); the pass is there
// for the errors. Without it, a stage whose forward cannot take the stage
// before's output (or a loss that cannot take the last stage's output with
// the target) fails on its own rank in the middle of a step, while its peers
// wait for messages that never come, until the group's timeout (30 minutes
// by default). With it, every rank of the pipeline throws the same
// InvalidArgument at once, naming the stage and the shapes, and the group
// stays usable: each rank passes a shape or a failure on, whatever happens,
// so every message is received, and the ranks then agree
// (detail::fail_together over the pipeline group). A batch that does not
// cut into the micro-batches joins the same agreement on the first step.
// The cost: one micro-batch's forward per stage, once.
#pragma once

#include "accel/distributed/objects.hpp"
#include "accel/training/pp/runtime.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// What a rank sends on instead of a shape when its stage failed (or a stage
// before it did): a header whose number of dimensions is -1.
inline at::Tensor failed_header(c10::Device device) {
  std::vector<int64_t> fields(kHeaderLength, 0);
  fields[0] = -1;
  return at::tensor(fields, at::kLong).to(device);
}
inline bool header_failed(const at::Tensor& header) { return header.cpu().data_ptr<int64_t>()[0] < 0; }

// One stage's part: its forward on micro-batch 0's input (the first stage)
// or on zeros of the shape the stage before gives (the others), and on the
// last stage the loss of micro-batch 0. Returns the output's shape; throws
// naming the shapes.
inline TensorMeta probe_stage(accel::pp::PipelineStage& stage, const std::optional<TensorMeta>& in,
                              const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                              const accel::pp::LossFn& loss_fn) {
  const std::string name = "stage " + std::to_string(stage.stage_index());
  const at::Tensor input =
      stage.is_first() ? inputs.at(0) : at::zeros(in->sizes, at::TensorOptions(in->dtype).device(stage.device()));
  const std::string given = stage.is_first()
                                ? "micro-batch 0 of the inputs, " + to_string(meta_of(input))
                                : "stage " + std::to_string(stage.stage_index() - 1) + "'s output, " + to_string(*in);
  at::Tensor output;
  try {
    output = stage.probe_forward(input);
  } catch (const std::exception& e) {
    throw InvalidArgument(name + "'s forward cannot take " + given + ": " + error_text(e));
  }
  if (!output.defined()) throw InvalidArgument(name + "'s forward returned no tensor for " + given);
  const TensorMeta out = meta_of(output);
  if (!stage.is_last()) {
    if (!c10::isFloatingType(out.dtype))
      throw InvalidArgument(name + " gives a " + to_string(out) +
                            " output; what passes between stages must be floating point (its gradient goes back)");
    (void)header_of(out, c10::Device(c10::kCPU));  // (throws if it has too many dimensions to pass)
    return out;
  }
  const at::Tensor& target = targets.at(0);
  at::Tensor loss;
  try {
    at::NoGradGuard no_grad;
    loss = loss_fn(output, target);
  } catch (const std::exception& e) {
    throw InvalidArgument("loss_fn cannot take the last stage's output, " + to_string(out) +
                          ", with micro-batch 0 of the target, " + to_string(meta_of(target)) + ": " + error_text(e));
  }
  if (!loss.defined() || loss.numel() != 1)
    throw InvalidArgument("loss_fn returned " + (loss.defined() ? to_string(meta_of(loss)) : std::string("no tensor")) +
                          " for micro-batch 0; a loss is one number");
  return out;
}

// The pass over this rank's stages, in order, and the agreement. `error`:
// this rank's error so far (a batch that does not cut); then it runs
// nothing, but still passes the failure on. `who` names the schedule.
inline void check_stages_fit(const RankPlan& plan, const std::vector<at::Tensor>& inputs,
                             const std::vector<at::Tensor>& targets, const accel::pp::LossFn& loss_fn,
                             std::string error, const std::string& who) {
  accel::pp::PipelineStage& any = *plan.stages.begin()->second;
  std::optional<Mailbox> box;  // (none without a group: every stage here)
  if (any.group()) box.emplace(*any.group(), any.device(), plan.num_stages);
  std::optional<TensorMeta> handed;  // the output's shape of the stage before, on this rank (none: it failed)
  for (auto& [s, stage] : plan.stages) {
    std::optional<TensorMeta> in;
    if (!stage->is_first()) {
      if (plan.stages.contains(s - 1)) {
        in = handed;
      } else {
        box->receive_header(s, plan.rank_of(s - 1));
        const at::Tensor header = box->take(Message::header, s, 0);
        if (!header_failed(header)) in = meta_of_header(header);
      }
    }
    std::optional<TensorMeta> out;
    if (error.empty() && (stage->is_first() || in))
      error = error_of([&] { out = probe_stage(*stage, in, inputs, targets, loss_fn); });
    if (stage->is_last()) continue;
    if (plan.stages.contains(s + 1)) handed = out;
    else
      box->send(Message::header, out ? header_of(*out, any.device()) : failed_header(any.device()), plan.rank_of(s + 1),
                s + 1, 0);
  }
  if (box) box->finish();
  const std::string what = who + ": the stages were checked before the first step (micro-batch 0 through each)";
  if (!any.group()) {
    if (!error.empty()) throw InvalidArgument(what + ": " + error);
    return;
  }
  fail_together<InvalidArgument>(error, what, c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(any.group()));
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END
