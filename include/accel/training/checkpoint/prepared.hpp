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
  // The gradients of `parameters`: a sharded one's shard's (into `shards`),
  // the others' own (into `whole`); parameters without one are left out.
  void split_sharded(const std::vector<at::Tensor>& parameters, std::vector<at::Tensor>& shards,
                     std::vector<at::Tensor>& whole) const {
    for (const auto& p : parameters) {
      at::Tensor shard;
      for (const DataParallel* dp : *sharded)
        if ((shard = dp->shard_of(p)).defined()) break;
      const at::Tensor& holder = shard.defined() ? shard : p;
      if (holder.grad().defined()) (shard.defined() ? shards : whole).push_back(holder.grad());
    }
  }
  // The gradients of `parameters`: a tensor-parallel piece's (an accel::tp
  // layer's split parameter, into `pieces`), the others' (into `whole`);
  // parameters without one are left out. Returns the pieces' group, null
  // where no prepared model holds a split layer.
  GroupPtr split_tensor_parallel(const std::vector<at::Tensor>& parameters, std::vector<at::Tensor>& pieces,
                                 std::vector<at::Tensor>& whole) const {
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
    if (!split) return {};
    for (const auto& p : parameters) {
      if (!p.grad().defined()) continue;
      const bool piece = std::any_of(models.begin(), models.end(), [&](const auto& m) { return m.split.contains(p); });
      (piece ? pieces : whole).push_back(p.grad());
    }
    return split->split.group;
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
// every rank. Under sharding a sharded parameter's gradient is its shard's:
// the norm adds up every rank's shards (one all_reduce), and the shards are
// scaled; beside tensor parallelism the same for the tp pieces over the tp
// group.
inline double clip_grad_norm(const PreparedSet& set, const std::vector<at::Tensor>& listed, double max_norm,
                             double norm_type) {
  const std::vector<at::Tensor> parameters = unique_tensors(listed);  // (a tied weight counts once, as in Python)
  // Pieces of larger tensors (shards along mp_shard, or tensor-parallel
  // pieces along tp: not both, the Accelerator refuses sharding beside tp)
  // count over their group; the other gradients once.
  std::vector<at::Tensor> shards, whole;
  GroupPtr over;
  if (!set.sharded->empty()) {
    set.split_sharded(parameters, shards, whole);
    over = set.sharded->front()->shard_group();
  } else if (!(over = set.split_tensor_parallel(parameters, shards, whole))) {
    return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
  }
  at::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  // The p-th powers of the norms (or the largest element for inf), summed here, then over the shard group;
  // read back once (on a GPU each read makes the host wait for the device).
  auto part = [&](const std::vector<at::Tensor>& grads) {
    if (grads.empty()) return 0.0;
    std::vector<at::Tensor> norms;
    for (const auto& g : grads) norms.push_back(g.norm(norm_type).to(at::kDouble));
    const at::Tensor all = at::stack(norms);
    return (inf ? all.max() : all.pow(norm_type).sum()).item<double>();
  };
  const double from_shards = accel::all_reduce(part(shards), inf ? ReduceOp::MAX : ReduceOp::SUM, over);
  const double from_whole = part(whole);
  const double norm = inf ? std::max(from_shards, from_whole) : std::pow(from_shards + from_whole, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1) {
    for (auto& g : shards) g.mul_(coefficient);
    for (auto& g : whole) g.mul_(coefficient);
  }
  return norm;
}
inline void clip_grad_value(const PreparedSet& set, const std::vector<at::Tensor>& listed, double clip_value) {
  const std::vector<at::Tensor> parameters = unique_tensors(listed);
  if (set.sharded->empty()) return torch::nn::utils::clip_grad_value_(parameters, clip_value);
  std::vector<at::Tensor> shards, whole;
  set.split_sharded(parameters, shards, whole);
  at::NoGradGuard no_grad;
  for (auto& g : shards) g.clamp_(-clip_value, clip_value);
  for (auto& g : whole) g.clamp_(-clip_value, clip_value);
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
