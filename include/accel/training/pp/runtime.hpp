// accel/training/pp/runtime.hpp: one pipeline step on this rank: its lowered list of actions run in order, the stages' forwards and backwards between the messages.
//
// A schedule (training/pp/schedules.hpp) gives each rank its list: the
// compute-only order lowered with its sends and receives
// (core/pipeline_lowering.hpp), torch's _PipelineScheduleRuntime's input.
// Run in order, a receive is posted when listed and waited for by the
// computation that needs it; a send is issued when listed and waited for at
// the step's end (torch's runtime waits for its sends later too), so a rank
// never waits on a send while its peer waits on it. Adjacent stages on this
// rank (ZBV's V) hand their tensors over directly. The last stage computes
// each micro-batch's loss right after its forward, keeps it for the
// backward, and the step returns the losses and the outputs.
#pragma once

#include "accel/core/pipeline_lowering.hpp"
#include "accel/training/pp/microbatches.hpp"
#include "accel/training/pp/stage.hpp"

ACCEL_NAMESPACE_BEGIN

namespace pp {
// A schedule's loss: the last stage's output of a micro-batch and that
// micro-batch's target, to a scalar.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
}  // namespace pp

namespace detail::pp {
// What a step runs on this rank.
struct RankPlan {
  std::map<int, accel::pp::PipelineStage*> stages;  // this rank's, by stage index
  std::vector<Action> actions;                      // its lowered list
  std::function<int(int)> rank_of;                  // the rank holding a stage
  int rank = 0, num_stages = 1;
};
struct StepResult {
  std::vector<at::Tensor> outputs, losses;  // the last stage's, per micro-batch (else empty)
  double compute_seconds = 0;               // in F, B, I and W (the rest of the step: waiting, messages)
};

class StepRun {
 public:
  StepRun(const RankPlan& plan, std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets,
          const accel::pp::LossFn& loss_fn, int microbatches)
      : plan_(plan), inputs_(std::move(inputs)), targets_(std::move(targets)), loss_fn_(loss_fn) {
    result_.outputs.resize(static_cast<std::size_t>(microbatches));
    result_.losses.resize(static_cast<std::size_t>(microbatches));
    auto* any = plan.stages.begin()->second;
    if (any->group()) mailbox_.emplace(*any->group(), any->device(), plan.num_stages);
  }

  StepResult run() {
    for (const Action& a : plan_.actions) {
      const int s = a.stage_index, mb = a.microbatch_index.value_or(0);
      switch (a.computation_type) {
        case ComputationType::FORWARD: forward(s, mb); break;
        case ComputationType::FULL_BACKWARD: backward(s, mb, true); break;
        case ComputationType::BACKWARD_INPUT: backward(s, mb, false); break;
        case ComputationType::BACKWARD_WEIGHT: timed([&] { stage(s).backward_weight_one_chunk(mb); }); break;
        case ComputationType::SEND_F: send_activation(s, mb); break;
        case ComputationType::RECV_F: receive_activation(s, mb); break;
        case ComputationType::SEND_B:
          box().send(Message::gradient, take(sent_grads_, s, mb), plan_.rank_of(s - 1), s - 1, mb);
          break;
        case ComputationType::RECV_B: box().receive_gradient(s, mb, plan_.rank_of(s + 1), output_meta_.at(s)); break;
        default: throw LogicError("accel::pp: the runtime has no action " + to_string(a));
      }
    }
    if (mailbox_) mailbox_->finish();
    return std::move(result_);
  }

 private:
  // A stage's computation, its time counted (not the waits for its messages, before it).
  template <class Fn>
  auto timed(Fn&& fn) -> decltype(fn()) {
    struct Count {
      double& total;
      std::chrono::steady_clock::time_point began = std::chrono::steady_clock::now();
      ~Count() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(); }
    } count{result_.compute_seconds};
    return fn();
  }
  accel::pp::PipelineStage& stage(int s) { return *plan_.stages.at(s); }
  bool here(int s) const { return plan_.stages.contains(s); }
  Mailbox& box() { return *mailbox_; }
  static at::Tensor take(std::map<std::pair<int, int>, at::Tensor>& kept, int s, int mb) {
    auto node = kept.extract({s, mb});
    if (node.empty())
      throw LogicError("accel::pp: stage " + std::to_string(s) + " has nothing for micro-batch " + std::to_string(mb));
    return std::move(node.mapped());
  }

  void forward(int s, int mb) {
    accel::pp::PipelineStage& st = stage(s);
    const at::Tensor input = st.is_first() ? inputs_.at(static_cast<std::size_t>(mb))
                             : here(s - 1) ? take(handed_inputs_, s, mb)
                                           : box().take(Message::activation, s, mb);
    const at::Tensor output = timed([&] { return st.forward_one_chunk(mb, input); });
    if (st.is_last()) {
      result_.outputs[static_cast<std::size_t>(mb)] = output.detach();
      const at::Tensor loss = timed([&] { return loss_fn_(output, targets_.at(static_cast<std::size_t>(mb))); });
      if (!loss.defined() || loss.numel() != 1)
        throw InvalidArgument("accel::pp: loss_fn returned " +
                              (loss.defined() ? to_string(meta_of(loss)) : std::string("no tensor")) +
                              " for micro-batch " + std::to_string(mb) + "; a loss is one number");
      result_.losses[static_cast<std::size_t>(mb)] = loss;
      return;
    }
    check_output_shape(s, mb, output);
    if (here(s + 1)) handed_inputs_[{s + 1, mb}] = output.detach();
    else sent_outputs_[{s, mb}] = output.detach();
  }
  // Every output of a stage in a step has the shape of its first: the next
  // stage receives them into buffers of that shape.
  void check_output_shape(int s, int mb, const at::Tensor& output) {
    const TensorMeta meta = meta_of(output);
    const auto [it, first] = output_meta_.try_emplace(s, meta);
    if (!first && it->second != meta)
      throw InvalidArgument("accel::pp: stage " + std::to_string(s) + "'s output for micro-batch " +
                            std::to_string(mb) + " is " + to_string(meta) + ", its first this step " +
                            to_string(it->second) + ": every micro-batch of a step must give one shape");
  }
  void send_activation(int s, int mb) {
    const int to = plan_.rank_of(s + 1);
    if (headers_sent_.insert(s).second)
      box().send(Message::header, header_of(output_meta_.at(s), stage(s).device()), to, s + 1, 0);
    box().send(Message::activation, take(sent_outputs_, s, mb), to, s + 1, mb);
  }
  void receive_activation(int s, int mb) {
    if (headers_listed_.insert(s).second) box().receive_header(s, plan_.rank_of(s - 1));
    box().receive_activation(s, mb, plan_.rank_of(s - 1));
  }
  void backward(int s, int mb, bool full) {
    accel::pp::PipelineStage& st = stage(s);
    const at::Tensor grad_output = st.is_last()  ? at::Tensor()
                                   : here(s + 1) ? take(handed_grads_, s, mb)
                                                 : box().take(Message::gradient, s, mb);
    const at::Tensor loss = st.is_last() ? result_.losses[static_cast<std::size_t>(mb)] : at::Tensor();
    const at::Tensor input_grad = timed([&] { return st.backward_one_chunk(mb, loss, grad_output, full); });
    if (st.is_first()) return;
    (here(s - 1) ? handed_grads_[{s - 1, mb}] : sent_grads_[{s, mb}]) = input_grad;
  }

  const RankPlan& plan_;
  std::vector<at::Tensor> inputs_, targets_;
  const accel::pp::LossFn& loss_fn_;
  std::optional<Mailbox> mailbox_;  // (none without a group: every stage here)
  StepResult result_;
  std::map<int, TensorMeta> output_meta_;  // each stage's outputs' shape this step
  std::set<int> headers_sent_, headers_listed_;
  // Activations and gradients between a computation and its send, or handed
  // to the adjacent stage on this rank; by (stage, micro-batch).
  std::map<std::pair<int, int>, at::Tensor> sent_outputs_, sent_grads_, handed_inputs_, handed_grads_;
};
}  // namespace detail::pp

ACCEL_NAMESPACE_END
