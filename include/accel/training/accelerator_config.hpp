// accel/training/accelerator_config.hpp: AcceleratorConfig, AcceleratedOptimizer, AcceleratedScheduler.
#pragma once

#include "accel/core/strategy.hpp"
#include "accel/training/precision/grad_scaler.hpp"
#include "accel/training/precision/policy.hpp"
#include "accel/training/data/loader_state.hpp"

ACCEL_NAMESPACE_BEGIN

enum class DistributedType { NO, MULTI_CPU, MULTI_GPU };

// Accelerate's ProjectConfiguration: where save_state() without a path puts
// checkpoints, and the experiment log its files (accelerator/trackers.hpp). With
// automatic_checkpoint_naming, each save_state() writes
// project_dir/checkpoints/checkpoint_<iteration> and then counts iteration
// up; total_limit keeps the newest that many (the oldest are removed once
// the new one is whole); load_state() without a path loads the newest.
struct ProjectConfiguration {
  std::filesystem::path project_dir{};
  std::filesystem::path logging_dir{};  // where log_with's files go; empty: project_dir (as Accelerate)
  bool automatic_checkpoint_naming = false;
  std::optional<int> total_limit{};  // automatic naming only; at least 1
  int iteration = 0;                 // the number the next save_state() takes
};

// FSDP's sharding strategies, along the model mesh (Dim::MP_SHARD; see
// DataParallel). NO_SHARD: every rank holds everything (DDP). SHARD_GRAD_OP
// (ZeRO-2): gradients reduce-scattered, optimizer state and the update
// sharded, parameters all-gathered after the step; with mp_replicate_size > 1
// the shards are averaged along Dim::MP_REPLICATE too (FSDP's
// _HYBRID_SHARD_ZERO2). FULL_SHARD (ZeRO-3): the parameters of each unit
// (auto_wrap_policy) are sharded at rest too and gathered only while the unit
// runs (accel::unit_forward) and for its backward; on a model mesh that
// replicates (mp_replicate_size > 1) the shards are averaged along
// Dim::MP_REPLICATE too, as FSDP2's fully_shard on a 2-D mesh: the mesh
// decides. HYBRID_SHARD: another name for that (FSDP1's HSDP). With
// mp_shard_size == 1 every strategy is NO_SHARD.
enum class ShardingStrategy { NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD };

// Accelerate's DDPCommunicationHookType (DistributedDataParallelKwargs'
// comm_hook): the built-in communication hook of every prepared model (see
// accel::comm_hooks; POWER_SGD with PowerSGDState's defaults, as Accelerate
// with an empty comm_state_option: plain all-reduces for the first 1000
// steps).
enum class DDPCommunicationHookType { NO, FP16, BF16, POWER_SGD };

// Their string forms, as Accelerate and FSDP spell them: to_string,
// from_string and operator<< (core/enums.hpp) take every public enum.
namespace detail {
template <>
struct enum_names<DistributedType> {
  static constexpr std::string_view type = "DistributedType";
  static constexpr std::array<std::string_view, 3> names{"NO", "MULTI_CPU", "MULTI_GPU"};
};
template <>
struct enum_names<ShardingStrategy> {
  static constexpr std::string_view type = "ShardingStrategy";
  static constexpr std::array<std::string_view, 4> names{"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"};
};
template <>
struct enum_names<DDPCommunicationHookType> {
  static constexpr std::string_view type = "DDPCommunicationHookType";
  static constexpr std::array<std::string_view, 4> names{"no", "fp16", "bf16", "power_sgd"};
};
}  // namespace detail

// Accelerate's ParallelismConfig: the sizes of DistributedConfig in
// Accelerate's terms, its mesh (dp_replicate, dp_shard, cp, tp). The
// Accelerator maps it field by field when it starts (ParallelismConfig::
// distributed_config): mp_replicate = dp_replicate; mp_shard = dp_shard * cp
// (Accelerate's FSDP shards over dp_shard and cp flattened, "dp_shard_cp");
// dp = dp_replicate * dp_shard; cp and tp as they are. The layouts are the
// same groups as Accelerate's (docs/differences.md). dp_shard_size unset:
// what the world leaves, world / (dp_replicate * cp * tp).
struct ParallelismConfig {
  int dp_replicate_size = 1;
  std::optional<int> dp_shard_size{};
  int tp_size = 1;
  int cp_size = 1;
  bool operator==(const ParallelismConfig&) const = default;

  // The same sizes as a DistributedConfig (timeout and device left at their
  // defaults), checked against `world` (the number of processes) with
  // Accelerate's messages.
  DistributedConfig distributed_config(int world) const {
    check_signs();
    const int64_t rest = int64_t{dp_replicate_size} * tp_size * cp_size;
    int64_t shard = dp_shard_size.value_or(0);
    if (!dp_shard_size && world % rest != 0)
      throw InvalidArgument("accel::ParallelismConfig: dp_replicate_size * tp_size * cp_size (" + std::to_string(rest) +
                            ") does not divide num_processes (" + std::to_string(world) +
                            "), so no dp_shard_size fits; please adjust dp_replicate_size/tp_size/cp_size");
    if (!dp_shard_size) shard = world / rest;
    if (rest * shard != world)
      throw InvalidArgument("accel::ParallelismConfig: total_size (" + std::to_string(rest * shard) +
                            ") does not match num_processes (" + std::to_string(world) +
                            "). Please adjust dp_replicate_size/dp_shard_size/tp_size/cp_size.");
    DistributedConfig out;
    out.mp_replicate_size = dp_replicate_size;
    out.mp_shard_size = static_cast<int>(shard) * cp_size;
    out.dp_size = dp_replicate_size * static_cast<int>(shard);
    out.cp_size = cp_size;
    out.tp_size = tp_size;
    return out;
  }
  // Each size at least 1 (Accelerate's message), whatever the world.
  void check_signs() const {
    const std::pair<const char*, int> sizes[] = {{"dp_replicate_size", dp_replicate_size},
                                                 {"dp_shard_size", dp_shard_size.value_or(1)},
                                                 {"tp_size", tp_size},
                                                 {"cp_size", cp_size}};
    for (const auto& [name, size] : sizes)
      if (size < 1)
        throw InvalidArgument(std::string("accel::ParallelismConfig: ") + name + " must be at least 1, but got " +
                              std::to_string(size));
  }
};

struct AcceleratorConfig {
  int gradient_accumulation_steps = 1;
  std::string mixed_precision = "no";  // "no", "bf16", or "fp16" (CUDA only, with loss scaling: grad_scaler)
  GradScalerKwargs grad_scaler{};      // "fp16": the loss scaler's settings (Accelerate's GradScalerKwargs)
  bool cpu = false;                    // train on the CPU even where an accelerator exists (distributed.device)
  bool split_batches = false;          // prepare_data_loader: batch_size is the global batch, split among ranks
  // Accelerate's GradientAccumulationPlugin: the end of a prepared loader's
  // pass is a sync step (and restarts the count); sync_each_batch all-reduces
  // gradients on every micro-step (the optimizer still steps every k-th).
  bool sync_with_dataloader = true;
  bool sync_each_batch = false;
  int64_t bucket_cap_mb = 25;
  DDPCommunicationHookType comm_hook = DDPCommunicationHookType::NO;  // NO_SHARD only
  bool gradient_as_bucket_view = false;                               // DDP's (see DataParallel); NO_SHARD only
  ShardingStrategy sharding_strategy = ShardingStrategy::NO_SHARD;
  // FULL_SHARD and HYBRID_SHARD: which submodules are units (FSDP's
  // auto_wrap_policy), asked of each submodule by its dotted name, parents
  // first (a unit's own submodules are not asked). Empty: every submodule
  // with parameters of its own (Linear, Conv, Embedding, LayerNorm, ...).
  std::function<bool(const std::string& name, const torch::nn::Module& module)> auto_wrap_policy{};
  // FULL_SHARD and HYBRID_SHARD: FSDP2's MixedPrecisionPolicy (Accelerate's
  // FullyShardedDataParallelPlugin.mixed_precision_policy): units gathered
  // and computed in param_dtype, gradients reduced in reduce_dtype, the
  // parameters, shards and optimizer state kept in their own dtype (see
  // precision/policy.hpp). Empty: everything in the parameters' dtype.
  MixedPrecisionPolicy mixed_precision_policy{};
  // FULL_SHARD and HYBRID_SHARD: whether a unit's all-gather is issued
  // early, while the unit before it computes: in the forward the unit that
  // came next in the last forward (FSDP's forward_prefetch; FSDP2 prefetches
  // one unit ahead as well), in the backward the unit before (FSDP's
  // BACKWARD_PRE); small units further ahead, up to 4 MiB of them, and with
  // backward_prefetch the last 4 MiB of units of a forward stay gathered
  // for their backward (dp/state.hpp's kAheadBytes). Off: each unit is
  // gathered when it runs (less memory: one unit's parameters at a time).
  bool forward_prefetch = true;
  bool backward_prefetch = true;
  DistributedConfig distributed{};
  // Accelerate's spelling of distributed's sizes (ParallelismConfig above);
  // given, distributed's sizes must be left at their defaults.
  std::optional<ParallelismConfig> parallelism_config{};
  ProjectConfiguration project_config{};
  // Accelerate's log_with: the trackers Accelerator::log writes to, "jsonl",
  // "csv" or "all" (files under project_config's logging_dir; accelerator/trackers.hpp).
  std::vector<std::string> log_with{};
};

// A prepared optimizer, as Accelerate's AcceleratedOptimizer: step() and
// zero_grad() do nothing on the micro-steps of gradient accumulation that do
// not sync (so loops written for Accelerate call them unconditionally
// inside accumulate()). Under fp16 mixed precision step() goes through the
// Accelerator's GradScaler: the gradients are unscaled (unless
// clip_grad_norm_ did it), the step is skipped when one is inf or NaN
// (step_was_skipped()), and the scale is updated. A handle: copies share the
// optimizer.
class AcceleratedOptimizer {
 public:
  // after_step: run after each real step (under sharding: the parameters
  // gathered from the shards the optimizer stepped); scaler: fp16's.
  AcceleratedOptimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<const detail::GradientState> state,
                       std::function<void()> after_step = {}, std::shared_ptr<GradScaler> scaler = {})
      : optimizer_(&optimizer),
        state_(std::move(state)),
        after_step_(std::move(after_step)),
        scaler_(std::move(scaler)),
        skipped_(std::make_shared<bool>(false)) {}

  void step() {
    if (!state_->sync_gradients) return;
    if (scaler_) {
      *skipped_ = !scaler_->step(*optimizer_);
      scaler_->update();
    } else {
      optimizer_->step();
    }
    if (after_step_ && !*skipped_) after_step_();
  }
  // Whether the last step() was skipped because fp16's loss scaler found an
  // inf or NaN gradient (Accelerate's step_was_skipped).
  bool step_was_skipped() const { return *skipped_; }
  // set_to_none: the optimizer's own default when not given (LibTorch 1.x
  // zeroes the gradients, 2.x resets them, as Python's).
  void zero_grad(std::optional<bool> set_to_none = std::nullopt) {
    if (!state_->sync_gradients) return;
    if (!set_to_none) return optimizer_->zero_grad();
    for (auto& group : optimizer_->param_groups())
      for (auto& p : group.params()) {
        if (*set_to_none) {
          p.mutable_grad().reset();
        } else if (p.grad().defined()) {
          p.mutable_grad().detach_();
          p.mutable_grad().zero_();
        }
      }
  }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  std::vector<torch::optim::OptimizerParamGroup>& param_groups() { return optimizer_->param_groups(); }

 private:
  torch::optim::Optimizer* optimizer_;
  std::shared_ptr<const detail::GradientState> state_;
  std::function<void()> after_step_;
  std::shared_ptr<GradScaler> scaler_;
  std::shared_ptr<bool> skipped_;
};

// A prepared learning-rate scheduler, as Accelerate's AcceleratedScheduler:
// step() does nothing on micro-steps that do not sync, and otherwise steps
// the scheduler once per data-parallel process (the schedule was written in
// one-process batches; each step consumed one batch on every process),
// once with split_batches. Any scheduler with step() (torch::optim::StepLR,
// LRScheduler subclasses, your own). A handle: copies share the scheduler,
// and the count of its steps, which checkpoints keep.
class AcceleratedScheduler {
 public:
  template <class Scheduler>
    requires requires(Scheduler& s) { s.step(); }
  AcceleratedScheduler(Scheduler& scheduler, std::shared_ptr<const detail::GradientState> state, int steps_per_call,
                       std::shared_ptr<int64_t> steps = std::make_shared<int64_t>(0))
      : step_([&scheduler] { scheduler.step(); }),
        state_(std::move(state)),
        steps_per_call_(steps_per_call),
        steps_(std::move(steps)) {}

  void step() {
    if (!state_->sync_gradients) return;
    for (int i = 0; i < steps_per_call_; ++i) {
      step_();
      ++*steps_;
    }
  }

 private:
  std::function<void()> step_;
  std::shared_ptr<const detail::GradientState> state_;
  int steps_per_call_;
  std::shared_ptr<int64_t> steps_;  // the scheduler's own step() calls
};

ACCEL_NAMESPACE_END
