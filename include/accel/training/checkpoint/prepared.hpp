// accel/training/checkpoint/prepared.hpp: what an Accelerator has prepared (models, optimizers, schedulers, loaders, objects).
//
// The Accelerator adds to a PreparedSet as it prepares things and
// registers objects; the checkpoint functions (checkpoint/state.hpp) save
// and restore what it lists. Plain data, a few lookups, and SyncGuard, the
// RAII switch of a prepared model's gradient sync.
#pragma once

#include "accel/training/dp/data_parallel.hpp"
#include "accel/training/precision/grad_scaler.hpp"
#include "accel/training/data/loader_state.hpp"
#include "accel/training/tp/pieces.hpp"
#include "accel/training/parameters.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
struct PreparedModel {
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<DataParallel> data_parallel;  // (its requires_gradient_sync: whether backward() reduces)
  tp::SplitTensors split{};                     // its tensor-parallel pieces, found once at prepare
};

// A prepared scheduler in checkpoints: its step count, and its own
// save/load where it has them. LibTorch's LRScheduler has neither (its
// step count is protected): load_state replays the missing steps on it,
// before the optimizers' learning rates are restored.
struct PreparedScheduler {
  const void* address;
  std::shared_ptr<int64_t> steps;
  std::function<void()> step;
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

// An object registered for checkpointing (Accelerate's
// register_for_checkpointing): how to save and load it.
struct CheckpointedObject {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

struct PreparedSet {
  std::deque<PreparedModel> models;  // (a deque: references to its elements stay valid as it grows)
  // The sharded models' DataParallels (shared with the optimizers' handles,
  // which gather after a step).
  std::shared_ptr<std::vector<DataParallel*>> sharded = std::make_shared<std::vector<DataParallel*>>();
  std::vector<torch::optim::Optimizer*> optimizers;
  std::vector<PreparedScheduler> schedulers;
  std::vector<std::shared_ptr<LoaderPosition>> loaders;  // prepared loaders' places, in prepare order
  std::vector<CheckpointedObject> objects;               // in the order registered
  std::shared_ptr<GradScaler> scaler;                    // mixed_precision "fp16"'s (scaler.pt in checkpoints)
  GroupPtr pipeline_group;                               // pp_size > 1: the stages' gradients make one model's

  PreparedModel* find(const torch::nn::Module* module) {
    for (auto& m : models)
      if (m.module.get() == module) return &m;
    return nullptr;
  }
  // The fully sharded parameters of every prepared model (or of `module`)
  // gathered for as long as the result lives (a collective: every process).
  std::vector<DataParallel::FullParameters> full_parameters(const torch::nn::Module* module = nullptr,
                                                            bool writeback = false) {
    std::vector<DataParallel::FullParameters> out;
    for (auto& m : models)
      if (!module || m.module.get() == module) out.push_back(m.data_parallel->summon_full_params(writeback));
    return out;
  }
  // The gradients of `parameters` by what each is a piece of: a sharded
  // parameter's gradient is its shard's (a chunk along the shard group), a
  // tensor-parallel piece's (an accel::tp layer's or a plan's split
  // parameter) a piece along the tp group, and under FSDP + TP both.
  // Parameters without a gradient are left out.
  struct Gradients {
    std::vector<at::Tensor> sharded_pieces, sharded, pieces, whole;
    GroupPtr shard_group, tp_group;  // null where nothing is sharded, or split
    GroupPtr pp_group;               // null without a pipeline
  };
  Gradients gradients_of(const std::vector<at::Tensor>& parameters) const {
    Gradients out;
    out.pp_group = pipeline_group;
    if (!sharded->empty()) out.shard_group = sharded->front()->shard_group();
    const PreparedModel* split = nullptr;
    for (const auto& m : models) {
      if (!m.split.group) continue;
      if (split && m.split.group != split->split.group)
        throw InvalidArgument(
            "accel::Accelerator: the prepared models' accel::tp layers are split over different "
            "groups ('" +
            split->split.layers.front() + "' and '" + m.split.layers.front() + "')");
      split = &m;
    }
    if (split) out.tp_group = split->split.group;
    for (const auto& p : parameters) {
      const at::Tensor stand_in = StandIns::instance().of(p);  // (a sharded wrapper's shard of p, else p)
      const bool shard = !stand_in.is_same(p);
      const at::Tensor& grad = stand_in.grad();
      if (!grad.defined()) continue;
      const bool piece =
          split && std::any_of(models.begin(), models.end(), [&](const auto& m) { return m.split.contains(p); });
      (shard ? (piece ? out.sharded_pieces : out.sharded) : (piece ? out.pieces : out.whole)).push_back(grad);
    }
    return out;
  }
};

// An optimizer's groups with each parameter once, for prepare(optimizer):
// an optimizer made from LibTorch's model->parameters() holds a tied weight
// twice (Python's parameters() would have given it once) and would step it
// twice. A tensor in two groups is an error, as in Python's optimizers
// ("some parameters appear in more than one parameter group"), named by the
// prepared models' names for it.
inline void take_parameters_once(torch::optim::Optimizer& optimizer, const PreparedSet& set) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& group : optimizer.param_groups()) {
    std::vector<at::Tensor> kept;
    std::unordered_set<const c10::TensorImpl*> in_group;
    for (const auto& p : group.params()) {
      if (!in_group.insert(p.unsafeGetTensorImpl()).second) continue;
      if (!seen.insert(p.unsafeGetTensorImpl()).second) {
        std::string name = "of shape " + c10::str(p.sizes());
        for (const auto& m : set.models)
          if (const std::string n = ParameterNames(*m.module).first(p); !n.empty()) name = "'" + n + "'";
        throw InvalidArgument("accel::Accelerator::prepare: the parameter " + name +
                              " is in more than one of the optimizer's parameter groups (as in Python, a parameter "
                              "belongs to one group)");
      }
      kept.push_back(p);
    }
    if (kept.size() != group.params().size()) group.params() = std::move(kept);
  }
}

// Accelerator::clip_grad_norm_ and clip_grad_value_: torch's on unsharded
// models. After the all-reduce every rank holds the same averaged
// gradients, so the norm computed here is the global one, identical on
// every rank. A gradient that is a piece of a larger one counts over the
// ranks holding the other pieces: a shard's over the shard group, a
// tensor-parallel piece's over the tp group, a shard of a tp piece (FSDP +
// TP) over both; every other gradient once. With a pipeline, the sum (or
// the largest) over the pp group as well: each rank passes its own stages'
// parameters, and the norm is the whole model's. Then every gradient is
// scaled.
inline double clip_grad_norm(const PreparedSet& set, const std::vector<at::Tensor>& listed, double max_norm,
                             double norm_type) {
  const std::vector<at::Tensor> parameters = unique_tensors(listed);  // (a tied weight counts once, as in Python)
  PreparedSet::Gradients g = set.gradients_of(parameters);
  if (!g.shard_group && !g.tp_group && !g.pp_group)
    return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
  at::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  const ReduceOp op = inf ? ReduceOp::MAX : ReduceOp::SUM;
  // The p-th powers of the norms (or the largest element for inf) of each kind, summed here in one stacked
  // tensor read once (on a GPU each read makes the host wait for the device), then over the groups: two
  // scalar all-reduces at most.
  at::TensorOptions options = at::TensorOptions(at::kDouble);
  for (const auto* grads : {&g.sharded_pieces, &g.sharded, &g.pieces, &g.whole})
    if (!grads->empty()) {
      options = options.device(grads->front().device());
      break;
    }
  auto part = [&](const std::vector<at::Tensor>& grads) {
    if (grads.empty()) return at::zeros({}, options);
    std::vector<at::Tensor> norms;
    for (const auto& grad : grads) norms.push_back(grad.norm(norm_type).to(options));
    const at::Tensor all = at::stack(norms);
    return inf ? all.max() : all.pow(norm_type).sum();
  };
  const at::Tensor parts = at::stack({part(g.sharded_pieces), part(g.sharded), part(g.pieces), part(g.whole)}).cpu();
  const auto combine = [&](double a, double b) { return inf ? std::max(a, b) : a + b; };
  // Over the shard group: the shards of pieces, and the shards of whole tensors; then over tp: the pieces.
  at::Tensor sharded = parts.slice(0, 0, 2).clone();
  if (g.shard_group) sharded = accel::all_reduce(sharded, op, g.shard_group);
  const auto summed = sharded.accessor<double, 1>();
  const auto local = parts.accessor<double, 1>();
  double from_pieces = combine(summed[0], local[2]);
  if (g.tp_group) from_pieces = accel::all_reduce(from_pieces, op, g.tp_group);
  double total = combine(combine(from_pieces, summed[1]), local[3]);
  // Over the pipeline: each rank's stages are part of one model (torchtitan clips so, over pp too).
  if (g.pp_group) total = accel::all_reduce(total, op, g.pp_group);
  const double norm = inf ? total : std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1)
    for (const auto* grads : {&g.sharded_pieces, &g.sharded, &g.pieces, &g.whole})
      for (const auto& grad : *grads) grad.mul_(coefficient);
  return norm;
}
inline void clip_grad_value(const PreparedSet& set, const std::vector<at::Tensor>& listed, double clip_value) {
  const std::vector<at::Tensor> parameters = unique_tensors(listed);
  if (set.sharded->empty()) return torch::nn::utils::clip_grad_value_(parameters, clip_value);
  const PreparedSet::Gradients g = set.gradients_of(parameters);  // (element by element: pieces as any gradient)
  at::NoGradGuard no_grad;
  for (const auto* grads : {&g.sharded_pieces, &g.sharded, &g.pieces, &g.whole})
    for (const auto& grad : *grads) grad.clamp_(-clip_value, clip_value);
}

// RAII: restores the models' gradient sync (DataParallel's
// requires_gradient_sync) as it was when the guard goes out of scope
// (Accelerator::no_sync, trigger_sync_in_backward and accumulate return one).
class SyncGuard {
 public:
  SyncGuard() = default;
  SyncGuard(SyncGuard&& other) noexcept : saved_(std::exchange(other.saved_, {})) {}
  SyncGuard(const SyncGuard&) = delete;
  SyncGuard& operator=(const SyncGuard&) = delete;
  SyncGuard& operator=(SyncGuard&&) = delete;
  ~SyncGuard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->first->set_requires_gradient_sync(it->second);
  }

  // Sets the model's gradient sync to `on` now, and back when the guard goes.
  void set(DataParallel& model, bool on) {
    saved_.emplace_back(&model, model.requires_gradient_sync());
    model.set_requires_gradient_sync(on);
  }

 private:
  std::vector<std::pair<DataParallel*, bool>> saved_;
};
}  // namespace detail

ACCEL_NAMESPACE_END
