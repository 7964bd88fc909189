// accel/training/accelerator/setup.hpp: what an Accelerator runs on: its checked configuration, the world, the device, and the DataParallel a model gets.
//
// The Accelerator (accelerator/accelerator.hpp) holds one AcceleratorSetup,
// which holds no training state: it checks the configuration before the
// rendezvous, joins the world, and decides how a model is wrapped (the
// DataParallel the strategy calls for). The Accelerator's properties
// (accelerator/properties.hpp) are read off it.
#pragma once

#include "accel/distributed/interface.hpp"
#include "accel/training/checkpoint/files.hpp"  // check_project
#include "accel/training/accelerator_config.hpp"
#include "accel/training/dp/data_parallel.hpp"
#include "accel/training/accelerator/trackers.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The Accelerator's settings, checked; the world and the device; the
// DataParallel a model gets.
class AcceleratorSetup {
 public:
  // Every setting is checked before the rendezvous: a configuration one rank
  // refuses, every rank refuses, and none leaves while its peers connect.
  explicit AcceleratorSetup(AcceleratorConfig config) : config_(checked(std::move(config))) {
    interface_ = &DistributedInterface::instance(config_.distributed);
    device_ = interface_->current_device();
  }

  const AcceleratorConfig& config() const { return config_; }
  ProjectConfiguration& project() { return config_.project_config; }  // (its iteration counts the saves)
  const DistributedInterface& world() const { return *interface_; }
  c10::Device device() const { return device_; }
  // What a pipeline (pp_size > 1) does not do yet, refused by name: `op`
  // (checkpoints, Accelerator::backward), and what to do instead.
  void refuse_under_pipeline(const std::string& op, const std::string& instead) const {
    if (interface_->strategy().pp_size() > 1)
      throw InvalidArgument("accel::Accelerator::" + op + ": not built for pp_size " +
                            std::to_string(interface_->strategy().pp_size()) + " yet; " + instead);
  }
  // The pipeline group where there is one (pp_size > 1), else null.
  GroupPtr pipeline_group() const {
    return interface_->strategy().pp_size() > 1 ? interface_->get_group(Dim::PP) : GroupPtr();
  }
  // Whether the configured strategy has something to shard along (else it is NO_SHARD).
  bool sharded() const { return shards(config_.sharding_strategy, interface_->strategy(), interface_->distributed()); }

  // The DataParallel that wraps `module` (already on the device) under the
  // configured strategy: sharded along the model mesh, with FULL_SHARD's
  // units; else over the data mesh, with the configured communication hook.
  std::unique_ptr<DataParallel> data_parallel_for(const std::shared_ptr<torch::nn::Module>& module) const {
    const int64_t bucket_bytes = config_.bucket_cap_mb * 1024 * 1024;
    if (!sharded()) {
      auto dp = std::make_unique<DataParallel>(module, gradient_group(), bucket_bytes);
      if (config_.comm_hook == DDPCommunicationHookType::FP16) dp->register_comm_hook(comm_hooks::fp16_compress_hook());
      if (config_.comm_hook == DDPCommunicationHookType::BF16) dp->register_comm_hook(comm_hooks::bf16_compress_hook());
      if (config_.comm_hook == DDPCommunicationHookType::POWER_SGD)
        dp->register_comm_hook(comm_hooks::powerSGD_hook(std::make_shared<PowerSGDState>()));
      if (config_.gradient_as_bucket_view) dp->gradient_as_bucket_view(true);
      return dp;
    }
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    if (config_.sharding_strategy == ShardingStrategy::FULL_SHARD ||
        config_.sharding_strategy == ShardingStrategy::HYBRID_SHARD) {
      choose_units(*module, "", units);
      if (units.empty())
        throw InvalidArgument(
            "accel::Accelerator::prepare: " + std::string(to_string(config_.sharding_strategy)) +
            " found no unit in the model (" +
            (config_.auto_wrap_policy ? "auto_wrap_policy chose none" : "no submodule holds parameters of its own") +
            "); use SHARD_GRAD_OP, or register the layers as submodules");
    }
    // (the parameters broadcast over the ranks holding the same pieces: beside tp, dp_cp)
    const DistributedStrategy& s = interface_->strategy();
    auto dp = std::make_unique<DataParallel>(
        module, s.tp_size() > 1 || s.pp_size() > 1 ? gradient_group() : interface_->world_group(), bucket_bytes,
        interface_->get_group(Dim::MP_SHARD), interface_->get_group(Dim::MP_REPLICATE), units,
        config_.mixed_precision_policy);
    dp->set_prefetch(config_.forward_prefetch, config_.backward_prefetch);
    return dp;
  }

 private:
  // Gradients are averaged over the whole data mesh (dp x cp): context-
  // parallel peers see different parts of the same sequences and must stay
  // identical (LLaMA-Factory's trainers do so). Without tp that spans the
  // world; with it, the ranks of one tp coordinate (dp_cp), which hold the
  // same pieces of the model. (Sharded, the same ranks: the model mesh's
  // mp_replicate x mp_shard at one tp coordinate, tp being innermost in
  // both meshes.) With tensor parallelism clipping sums the pieces' norms
  // over tp as well. (pp, outermost, likewise: a stage's ranks, dp_cp.)
  GroupPtr gradient_group() const {
    const DistributedStrategy& s = interface_->strategy();
    if (s.tp_size() > 1 || s.pp_size() > 1) return interface_->data_mesh()->slice("dp_cp").get_group();
    return s.cp_size() > 1 ? interface_->world_group() : interface_->get_group(Dim::DP);
  }
  static AcceleratorConfig checked(AcceleratorConfig config) {
    if (config.gradient_accumulation_steps < 1)
      throw InvalidArgument("accel::Accelerator: gradient_accumulation_steps must be at least 1, got " +
                            std::to_string(config.gradient_accumulation_steps));
    if (config.bucket_cap_mb < 1)
      throw InvalidArgument("accel::Accelerator: bucket_cap_mb must be at least 1, got " +
                            std::to_string(config.bucket_cap_mb));
    const auto& mp = config.mixed_precision;
    if (mp != "no" && mp != "bf16" && mp != "fp16")
      throw InvalidArgument("accel::Accelerator: mixed_precision '" + mp + "' (expected no, bf16 or fp16)");
    detail::check_project(config.project_config, "accel::Accelerator");
    detail::check_trackers(config);
    if (config.cpu) {
      if (config.distributed.device && *config.distributed.device != DeviceType::CPU)
        throw InvalidArgument("accel::Accelerator: cpu = true, but distributed.device is " +
                              std::string(to_string(*config.distributed.device)));
      config.distributed.device = DeviceType::CPU;  // the interface's device and backend (gloo)
    }
    if (config.parallelism_config) config.distributed = from_parallelism_config(config);
    // What instance() will choose, known without it: the mesh sizes and the device.
    const DistributedStrategy strategy(config.distributed);
    // Pipeline parallelism: each rank prepares its stages' modules, which
    // are kept in sync over the stage's data-parallel ranks (dp_cp, one pp
    // coordinate) and driven by the schedule (pp::PipelineStage::
    // set_data_parallel); a stage's accel::tp layers split over its tp
    // group, and its context-parallel layers exchange over its cp group, as
    // without a pipeline (each rank's micro-batches are its slice of the
    // sequences; the point-to-point sends go between ranks of the same dp,
    // cp and tp coordinates). What is not built yet is refused here or
    // where it is called.
    if (strategy.pp_size() > 1 && config.gradient_accumulation_steps > 1)
      throw InvalidArgument("accel::Accelerator: pp_size " + std::to_string(strategy.pp_size()) +
                            " with gradient_accumulation_steps " + std::to_string(config.gradient_accumulation_steps) +
                            ": backward divides the loss by the steps, and a pipeline's schedule runs the backward "
                            "without it; give the schedule more micro-batches instead (they accumulate within its "
                            "step)");
    if (strategy.pp_size() > 1 && config.mixed_precision == "fp16")
      throw InvalidArgument("accel::Accelerator: pp_size " + std::to_string(strategy.pp_size()) +
                            " with mixed_precision \"fp16\": the loss scale would have to go into the schedule's "
                            "loss_fn, which is not built; use \"bf16\"");
    if ((config.comm_hook != DDPCommunicationHookType::NO || config.gradient_as_bucket_view) &&
        shards(config.sharding_strategy, strategy, is_distributed()))
      throw InvalidArgument(std::string("accel::Accelerator: ") +
                            (config.gradient_as_bucket_view ? "gradient_as_bucket_view" : "comm_hook") +
                            " is about the all-reduce of NO_SHARD's buckets; under " +
                            std::string(to_string(config.sharding_strategy)) + " they are reduce-scattered");
    if (config.mixed_precision_policy.active() && config.sharding_strategy != ShardingStrategy::FULL_SHARD &&
        config.sharding_strategy != ShardingStrategy::HYBRID_SHARD)
      throw InvalidArgument(
          "accel::Accelerator: mixed_precision_policy is FSDP2's, for parameters sharded at rest (FULL_SHARD or "
          "HYBRID_SHARD); under " +
          std::string(to_string(config.sharding_strategy)) + " use mixed_precision = \"bf16\" (autocast)");
    for (const auto& dtype : {config.mixed_precision_policy.param_dtype, config.mixed_precision_policy.reduce_dtype,
                              config.mixed_precision_policy.output_dtype})
      if (dtype && !c10::isFloatingType(*dtype))
        throw InvalidArgument(
            std::string("accel::Accelerator: mixed_precision_policy's dtypes are floating-point; got ") +
            c10::toString(*dtype));
    if (mp == "fp16" &&
        (config.distributed.device ? *config.distributed.device : detail::from_c10(get_current_accelerator().type())) !=
            DeviceType::CUDA)
      throw InvalidArgument("accel::Accelerator: mixed_precision 'fp16' needs CUDA; use 'bf16' on the CPU");
    return config;
  }
  // distributed with the sizes parallelism_config gives (its timeout and
  // device kept). In one process every size is 1 whatever is given, as for
  // DistributedConfig's own sizes (a program runs unchanged as one process).
  static DistributedConfig from_parallelism_config(const AcceleratorConfig& config) {
    DistributedConfig sizes = config.distributed;
    sizes.timeout = {};
    sizes.device.reset();
    if (sizes != DistributedConfig{})
      throw InvalidArgument(
          "accel::Accelerator: parallelism_config and distributed's sizes both given; give the sizes once (distributed "
          "keeps its timeout and device)");
    const ParallelismConfig& p = *config.parallelism_config;
    p.check_signs();  // (one process: every size is 1, the defaults)
    DistributedConfig out = is_distributed() ? p.distributed_config(accel::get_world_size()) : DistributedConfig{};
    out.timeout = config.distributed.timeout;
    out.device = config.distributed.device;
    return out;
  }
  // Whether the strategy has something to shard along (else it is NO_SHARD).
  static bool shards(ShardingStrategy s, const DistributedStrategy& mesh, bool distributed) {
    return s != ShardingStrategy::NO_SHARD && distributed && mesh.mp_shard_size() > 1;
  }
  // FULL_SHARD's units under `module` (see auto_wrap_policy).
  void choose_units(torch::nn::Module& module, const std::string& prefix,
                    std::vector<std::shared_ptr<torch::nn::Module>>& units) const {
    for (const auto& child : module.named_children()) {
      const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
      const bool unit = config_.auto_wrap_policy ? config_.auto_wrap_policy(name, *child.value())
                                                 : !child.value()->parameters(/*recurse=*/false).empty();
      if (unit) units.push_back(child.value());
      else choose_units(*child.value(), name, units);
    }
  }

  AcceleratorConfig config_;
  DistributedInterface* interface_ = nullptr;
  c10::Device device_{c10::kCPU};
};
}  // namespace detail

ACCEL_NAMESPACE_END
