// accel/training/pp/stage.hpp: accel::pp::PipelineStage, this rank's part of a model in a pipeline: its forward and backward one micro-batch at a time, the backward whole or split into the input's gradient and the weights'.
//
// torch.distributed.pipelining's PipelineStage(submodule, stage_index,
// num_stages, device, group): a schedule (training/pp/schedules.hpp) runs
// it, micro-batch by micro-batch, and moves what passes between stages. One
// tensor passes from a stage to the next (hidden states; the first stage
// takes the batch's inputs, the last one's output goes to the loss), as in
// torchtitan's models. A stage keeps, per micro-batch in flight, its input
// (a leaf that collects the gradient sent back) and its output with the
// autograd graph, until that micro-batch's backward.
//
// The zero-bubble schedules split a backward in two: I computes only the
// input's gradient (sent back at once, so the stage before can go on) and
// keeps the graph; W, later, the weights' gradients (torch's
// stage_backward_input and stage_backward_weight). As torch's, I keeps the
// gradients reaching the weights' branches and W runs from them to the
// weights only (training/pp/split_backward.hpp), so the activations'
// gradients are computed once; where that does not apply (a sharded stage,
// whose units gather and reduce as a whole backward's do) W runs the graph
// again from the output, computing them a second time. A micro-batch whose
// forward made a checkpointed region (accel::checkpoint) runs its backward
// whole in I's place, and its W does nothing: the region's backward gives
// the weights inside it their gradients during I, where W from the output
// cannot reach them.
//
// Data parallelism composes as torch's does when the submodule is wrapped in
// DDP or FSDP: given the stage module's DataParallel (set_data_parallel), the
// micro-batches' gradients add up locally (no sync) and the last backward of
// the step that makes weight gradients (B, or W under zero bubble) reduces
// their sum over the data-parallel group once: all-reduced, or
// reduce-scattered into the shards (ZeRO-2/3). A fully sharded (ZeRO-3)
// unit is gathered again for each micro-batch's forward and backward, as
// FSDP2's reshard_after_forward does: a stage holds at rest only its shards,
// whatever the micro-batches in flight.
// The reducing backward also sums over tp the gradients sequence parallelism
// leaves partial (tp::all_reduce_sequence_parallel_gradients); without a
// DataParallel the caller sums them after the step.
#pragma once

#include "accel/training/pp/messages.hpp"
#include "accel/training/pp/split_backward.hpp"
#include "accel/distributed/interface.hpp"
#include "accel/training/dp/data_parallel.hpp"
#include "accel/training/parameters.hpp"
#include "accel/training/recompute.hpp"
#include "accel/training/tp/sequence_parallel.hpp"

ACCEL_NAMESPACE_BEGIN

namespace pp {
class PipelineStage {
 public:
  // The computation: this stage's input to its output.
  using Forward = std::function<at::Tensor(const at::Tensor&)>;

  // A module with a forward of one tensor (torch::nn::Sequential, a
  // TORCH_MODULE of one's own).
  template <class M>
  PipelineStage(torch::nn::ModuleHolder<M> module, int stage_index, int num_stages,
                c10::Device device = c10::Device(c10::kCPU), GroupPtr group = {})
      : PipelineStage(
            module.ptr(), [m = module.ptr()](const at::Tensor& x) -> at::Tensor { return m->forward(x); }, stage_index,
            num_stages, device, std::move(group)) {}
  // Any module, with the call that runs it. `group`: the pipeline group
  // (null: the DistributedInterface's Dim::PP group; none in one process).
  PipelineStage(std::shared_ptr<torch::nn::Module> module, Forward forward, int stage_index, int num_stages,
                c10::Device device = c10::Device(c10::kCPU), GroupPtr group = {})
      : module_(std::move(module)),
        forward_(std::move(forward)),
        stage_index_(stage_index),
        num_stages_(num_stages),
        device_(device),
        group_(std::move(group)) {
    if (!module_ || !forward_) throw InvalidArgument("accel::pp::PipelineStage: no module or no forward");
    if (num_stages < 1 || stage_index < 0 || stage_index >= num_stages)
      throw InvalidArgument("accel::pp::PipelineStage: stage_index " + std::to_string(stage_index) +
                            " is not one of num_stages " + std::to_string(num_stages) + " (0.." +
                            std::to_string(num_stages - 1) + ")");
    // The pipeline group: `group`, else the live interface's Dim::PP group (as
    // tp's layers take Dim::TP's). torch's default is the world group, which is
    // the pp group only when pp is the whole world.
    if (!group_ && DistributedInterface::is_initialized()) group_ = DistributedInterface::instance().get_group(Dim::PP);
    if (!group_ && is_distributed())
      throw LogicError(
          "accel::pp::PipelineStage: no group given and no DistributedInterface to take Dim::PP's "
          "from; create it first (accel::DistributedInterface::instance({.pp_size = N}), or pass the "
          "group)");
  }

  int stage_index() const { return stage_index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_index_ == 0; }
  bool is_last() const { return stage_index_ == num_stages_ - 1; }
  torch::nn::Module& submodule() const { return *module_; }  // torch's submod
  c10::Device device() const { return device_; }
  // The pipeline group (null: one process, every stage here).
  c10d::ProcessGroup* group() const { return group_.get(); }

  // The stage's data parallelism: `dp` keeps this stage's module in sync over
  // its data-parallel (or shard) group, and the stage drives its reduction,
  // once per step (see the top). `dp` must outlive the stage's schedule; with
  // it sharded, step the optimizer on the shards (dp.shard_optimizer) and
  // gather them after (dp.gather_shards), as without a pipeline. A step run
  // with dp.set_requires_gradient_sync(false) reduces nothing (gradient
  // accumulation over steps).
  void set_data_parallel(DataParallel& dp) {
    if (dp.module() != module_)
      throw InvalidArgument("accel::pp::PipelineStage::set_data_parallel: stage " + std::to_string(stage_index_) +
                            " was given the DataParallel of another module; give the one made for this stage's "
                            "submodule");
    dp_ = &dp;
  }
  DataParallel* data_parallel() const { return dp_; }

  // --- a step's bounds (the schedule calls them around its actions) ---

  // A step of `microbatches` begins: gradient sync off until the last
  // weight backward; the peak of micro-batches held counts anew. With
  // `scale_grads`, the last stage's backward starts from each micro-batch's
  // loss divided by their number (see grads()).
  void begin_step(int microbatches, bool scale_grads = true) {
    peak_ = chunks_.size();
    step_microbatches_ = microbatches;
    loss_scale_ = scale_grads ? 1.0 / microbatches : 1.0;
    weight_passes_ = 0;
    if (!dp_) return;
    wants_sync_ = dp_->requires_gradient_sync();
    dp_->set_requires_gradient_sync(false);
  }
  // The step ended (or failed): the caller's gradient sync setting back.
  void end_step() {
    if (dp_) dp_->set_requires_gradient_sync(wants_sync_);
  }

  // --- what a schedule calls, one micro-batch at a time (torch's
  // forward_one_chunk, backward_one_chunk, backward_weight_one_chunk) ---

  // The stage's forward on `input` leaving no trace: no autograd, the
  // buffers (a BatchNorm's running statistics) and the random generators
  // (dropout) put back after, so the step that follows is what it would
  // have been without it. A schedule's first step runs it once per stage
  // (training/pp/shape_check.hpp) to refuse stages that do not fit.
  at::Tensor probe_forward(const at::Tensor& input) {
    at::NoGradGuard no_grad;
    std::vector<std::pair<at::Tensor, at::Tensor>> buffers;
    for (const auto& b : module_->buffers()) buffers.emplace_back(b, b.clone());
    detail::Recompute now;  // torch's fork_rng: the generators' states now, put back after
    now.capture({input});
    const auto put_back = [&] {
      for (auto& [buffer, saved] : buffers) buffer.copy_(saved);
    };
    at::Tensor output;
    try {
      const detail::ReplayRandomness fork(now);
      output = forward_(input.to(device_));
    } catch (...) {
      put_back();
      throw;
    }
    put_back();
    return output;
  }

  // Runs the forward of micro-batch `mb` on `input` (the batch's piece on the
  // first stage; the activation received, or handed over by the stage before
  // on this rank); returns the output.
  at::Tensor forward_one_chunk(int mb, const at::Tensor& input) {
    Chunk& c = fresh_chunk(mb);
    peak_ = std::max(peak_, chunks_.size());
    c.input = input.to(device_);
    if (!is_first()) {
      if (!c10::isFloatingType(c.input.scalar_type()))
        throw InvalidArgument("accel::pp: stage " + std::to_string(stage_index_) + " receives a " +
                              std::string(c10::toString(c.input.scalar_type())) +
                              " tensor; what passes between stages must be floating point (its gradient goes back)");
      c.input = c.input.detach().requires_grad_(true);
    }
    const uint64_t regions = detail::checkpointed_regions();
    c.output = forward_(c.input);
    c.checkpointed = detail::checkpointed_regions() != regions;
    if (!c.output.defined())
      throw InvalidArgument("accel::pp: stage " + std::to_string(stage_index_) + "'s forward returned no tensor");
    return c.output;
  }
  // The backward of micro-batch `mb` from `loss` (the last stage) or from the
  // gradient of the output (`grad_output`, the others). Whole (B: every
  // gradient, the graph freed) or its first half (I: only the input's, the
  // graph kept for backward_weight_one_chunk). Returns the input's gradient
  // to send back (undefined on the first stage).
  //
  // A micro-batch whose forward made a checkpointed region (accel::checkpoint)
  // runs whole in I's place: the region's backward gives the weights inside
  // it their gradients as the input's gradient passes through it, outside a
  // weight pass (no data-parallel reduction would count them), and W, run
  // from the output to the weights, never reaches them (on the first stage,
  // where I computes nothing, they got none). Its W then does nothing.
  at::Tensor backward_one_chunk(int mb, const at::Tensor& loss, const at::Tensor& grad_output, bool full) {
    Chunk& c = chunk(mb, "backward");
    c.root = is_last() ? loss : c.output;
    c.grad_output = is_last() ? at::Tensor() : grad_output;
    if (!c.root.defined()) throw LogicError("accel::pp: a backward with no loss");
    const at::Tensor input = c.input;
    at::Tensor input_grad;
    if (full || c.checkpointed) {
      weight_pass([&] { torch::autograd::backward({c.root}, grads(c)); });
      if (!is_first()) input_grad = input.grad();
      if (full) {
        chunks_.erase(mb);
      } else {  // (the graph and activations go now; W finds nothing to do)
        c = Chunk();
        c.whole = true;
      }
    } else if (!is_first()) {
      // (a sharded stage's W runs the graph again: its units gather and reduce as a whole backward's do)
      if (!dp_ || !dp_->sharded()) c.split = std::make_unique<detail::pp::SplitBackward>(c.root, input, weights());
      input_grad = torch::autograd::grad({c.root}, {input}, grads(c), /*retain_graph=*/true,
                                         /*create_graph=*/false, /*allow_unused=*/true)[0];
      if (c.split) c.split->input_done();
      c.input = at::Tensor();
    }
    // (an input the output does not depend on: its gradient is zeros, still sent)
    if (!is_first() && !input_grad.defined()) input_grad = at::zeros_like(input);
    return input_grad;
  }
  // W: the weights' gradients of a micro-batch whose I has run.
  void backward_weight_one_chunk(int mb) {
    Chunk& c = chunk(mb, "weight backward");
    if (c.whole) {
      chunks_.erase(mb);
      return;
    }
    weight_pass([&] {
      if (c.split && c.split->usable()) return c.split->weights();  // (from what I kept: split_backward.hpp)
      if (const std::vector<at::Tensor> params = weights(); !params.empty())
        torch::autograd::backward({c.root}, grads(c), /*retain_graph=*/false, /*create_graph=*/false, params);
    });
    chunks_.erase(mb);
  }
  // Drops every micro-batch kept (after a step, or a failed one).
  void clear() { chunks_.clear(); }
  // The micro-batches whose activations the stage holds now, and the most it
  // held at once in the last step (what a schedule costs in memory: GPipe all
  // m, 1F1B at most the stages from this one to the last).
  std::size_t microbatches_in_flight() const { return chunks_.size(); }
  std::size_t peak_microbatches_in_flight() const { return peak_; }

 private:
  // A backward that adds to the weights' gradients (B, or W): under data
  // parallelism the step's last one reduces them (if the caller's setting
  // syncs), the others accumulate locally.
  template <class Fn>
  void weight_pass(Fn&& fn) {
    if (!dp_) return fn();
    const bool reduce = ++weight_passes_ == step_microbatches_ && wants_sync_;
    dp_->set_requires_gradient_sync(reduce);
    if (dp_->sharded()) dp_->check_shards();
    dp_->prepare_for_backward();  // (nothing while sync is off)
    fn();
    dp_->finish();  // (the reduction, or, without sync, only the end of the units' pass)
    dp_->set_requires_gradient_sync(false);
    // Sequence parallelism's partial gradients (the stage's accel::tp layers
    // name them) summed over tp once reduced, as Accelerator::backward does
    // on the steps that sync (nothing without such layers).
    if (reduce) tp::all_reduce_sequence_parallel_gradients(*module_);
  }

  struct Chunk {
    at::Tensor input, output, root, grad_output;
    bool checkpointed = false;                         // its forward made a checkpointed region (accel::checkpoint)
    bool whole = false;                                // its backward ran whole in I's place: W has nothing left to do
    std::unique_ptr<detail::pp::SplitBackward> split;  // after I: what W starts from
  };
  // The weights W gives gradients: each tensor once (LibTorch lists a tied one under each of its names).
  std::vector<at::Tensor> weights() const {
    std::vector<at::Tensor> out;
    for (const auto& p : detail::unique_tensors(module_->parameters()))
      if (p.requires_grad()) out.push_back(p);
    return out;
  }
  Chunk& fresh_chunk(int mb) {
    auto [it, added] = chunks_.try_emplace(mb);
    if (!added)
      throw LogicError("accel::pp: stage " + std::to_string(stage_index_) + " runs micro-batch " + std::to_string(mb) +
                       "'s forward twice");
    return it->second;
  }
  Chunk& chunk(int mb, const char* what) {
    const auto it = chunks_.find(mb);
    if (it == chunks_.end())
      throw LogicError("accel::pp: stage " + std::to_string(stage_index_) + " runs micro-batch " + std::to_string(mb) +
                       "'s " + what + " before its forward");
    return it->second;
  }
  // What a backward starts from: the gradient received for the output, or on
  // the last stage the loss's, 1 / m under scale_grads. torch divides the
  // gradients by m after the step instead; that also divides what an earlier
  // step left in them (gradient accumulation over steps) and would make it
  // wrong, so here each micro-batch's part is divided as it is made, as
  // Accelerate divides a loss by the accumulation steps.
  std::vector<at::Tensor> grads(const Chunk& c) const {
    if (c.grad_output.defined()) return {c.grad_output};
    if (loss_scale_ == 1.0) return {};
    return {at::full_like(c.root, loss_scale_)};
  }

  std::shared_ptr<torch::nn::Module> module_;
  Forward forward_;
  int stage_index_, num_stages_;
  c10::Device device_;
  GroupPtr group_;
  std::map<int, Chunk> chunks_;
  std::size_t peak_ = 0;
  DataParallel* dp_ = nullptr;
  // This step's: its micro-batches, the weight backwards run, what the last
  // stage's backward starts from; the caller's gradient sync setting.
  int step_microbatches_ = 0, weight_passes_ = 0;
  double loss_scale_ = 1.0;
  bool wants_sync_ = true;
};
}  // namespace pp

ACCEL_NAMESPACE_END
