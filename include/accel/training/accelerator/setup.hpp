// accel/training/accelerator/setup.hpp: what an Accelerator runs on: its checked configuration, the world, the device, and what follows from them.
//
// The Accelerator (accelerator/accelerator.hpp) is built on two parts that hold no
// training state: AcceleratorSetup (this part), which checks the
// configuration before the rendezvous, joins the world, answers the
// properties Accelerate reads off an accelerator, and decides how a model
// is wrapped (the DataParallel the strategy calls for); and
// ProcessOperations (accelerator/process_operations.hpp), Accelerate's operations over
// every process. The Accelerator adds what it prepares and the training
// step on top.
#pragma once

#include "accel/distributed/interface.hpp"
#include "accel/training/checkpoint/files.hpp"  // check_project
#include "accel/training/accelerator_config.hpp"
#include "accel/training/dp/data_parallel.hpp"
#include "accel/training/accelerator/trackers.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The Accelerator's first base: its settings, checked; the world and the
// device; Accelerate's properties; the DataParallel a model gets.
class AcceleratorSetup {
 public:
  c10::Device device() const { return device_; }
  bool is_main_process() const { return interface_->get_rank() == 0; }
  bool is_local_main_process() const { return interface_->get_local_rank() == 0; }
  bool is_last_process() const { return interface_->get_rank() == interface_->get_world_size() - 1; }
  int process_index() const { return interface_->get_rank(); }
  int local_process_index() const { return interface_->get_local_rank(); }
  int num_processes() const { return interface_->get_world_size(); }
  DistributedType distributed_type() const {
    if (!interface_->distributed() || num_processes() == 1) return DistributedType::NO;
    return device_.is_cuda() ? DistributedType::MULTI_GPU : DistributedType::MULTI_CPU;
  }
  const std::string& mixed_precision() const { return config_.mixed_precision; }
  int gradient_accumulation_steps() const { return config_.gradient_accumulation_steps; }
  // The strategy in effect: NO_SHARD when the configured one has nothing to
  // shard along (mp_shard_size == 1, or one process).
  ShardingStrategy sharding_strategy() const {
    return sharded() ? config_.sharding_strategy : ShardingStrategy::NO_SHARD;
  }
  // Accelerate's use_distributed: more than one process.
  bool use_distributed() const { return distributed_type() != DistributedType::NO; }
  // Accelerate's is_fsdp2: whether parameters are sharded at rest
  // (FULL_SHARD or HYBRID_SHARD with something to shard along).
  bool is_fsdp2() const {
    const ShardingStrategy s = sharding_strategy();
    return s == ShardingStrategy::FULL_SHARD || s == ShardingStrategy::HYBRID_SHARD;
  }
  // Accelerate's should_save_model: true on every process, which all call
  // save_model (a collective; the main process writes).
  bool should_save_model() const { return true; }
  // This process's rank along each kind of parallelism, as Accelerate names
  // them: data along Dim::DP, context along Dim::CP; there is no tensor or
  // pipeline parallelism here (0, as Accelerate for a dimension not enabled).
  int data_parallel_rank() const { return interface_->get_rank(Dim::DP); }
  int context_parallel_rank() const { return interface_->get_rank(Dim::CP); }
  int tensor_parallel_rank() const { return 0; }
  int pipeline_parallel_rank() const { return 0; }
  // Accelerate's verify_device_map: whether the model is spread over devices
  // by a device map (big-model inference). accel.hpp places whole models: false.
  template <class ModuleHolder>
  bool verify_device_map(const ModuleHolder&) const {
    return false;
  }
  // Accelerate's project_dir, project_configuration and save_iteration (the
  // number the next automatically named checkpoint takes; set it through
  // project_configuration().iteration).
  const std::filesystem::path& project_dir() const { return config_.project_config.project_dir; }
  ProjectConfiguration& project_configuration() { return config_.project_config; }
  int save_iteration() const { return config_.project_config.iteration; }

 protected:
  // Every setting is checked before the rendezvous: a configuration one rank
  // refuses, every rank refuses, and none leaves while its peers connect.
  explicit AcceleratorSetup(AcceleratorConfig config) : config_(checked(std::move(config))) {
    interface_ = &DistributedInterface::instance(config_.distributed);
    device_ = interface_->current_device();
  }

  const AcceleratorConfig& settings() const { return config_; }
  const DistributedInterface& world() const { return *interface_; }
  // Whether the configured strategy has something to shard along.
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
    auto dp = std::make_unique<DataParallel>(
        module, interface_->world_group(), bucket_bytes, interface_->get_group(Dim::MP_SHARD),
        interface_->get_group(Dim::MP_REPLICATE), units, config_.mixed_precision_policy);
    dp->set_prefetch(config_.forward_prefetch, config_.backward_prefetch);
    return dp;
  }

 private:
  // Gradients are averaged over the whole data mesh (dp x cp), which spans
  // the world: context-parallel peers see different parts of the same
  // sequences and must stay identical (LLaMA-Factory's trainers do so).
  GroupPtr gradient_group() const {
    return interface_->strategy().cp_size() > 1 ? interface_->world_group() : interface_->get_group(Dim::DP);
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
    // What instance() will choose, known without it: the mesh sizes and the device.
    const DistributedStrategy strategy(config.distributed);
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
