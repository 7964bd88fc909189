// accel/training/accelerator/properties.hpp: the Accelerator's constructor and properties: what it runs on, read off its setup.
#pragma once

#include "accel/training/accelerator/accelerator.hpp"

ACCEL_NAMESPACE_BEGIN

inline Accelerator::Accelerator(AcceleratorConfig config)
    : setup_(std::move(config)), log_(setup_.config(), is_main_process()) {
  // Whether a gradient overflowed is agreed over the world where processes
  // hold different gradients (shards, or tensor-parallel pieces): else one
  // would skip a step its peers take.
  const bool pieces = setup_.sharded() || setup_.world().strategy().tp_size() > 1;
  prepared_.pipeline_group = setup_.pipeline_group();  // (clipping's norm: over every stage)
  if (mixed_precision() == "fp16" && setup_.config().grad_scaler.enabled)
    prepared_.scaler = std::make_shared<GradScaler>(setup_.config().grad_scaler, device(),
                                                    pieces ? setup_.world().world_group() : GroupPtr{});
}

inline c10::Device Accelerator::device() const { return setup_.device(); }
inline bool Accelerator::is_main_process() const { return setup_.world().get_rank() == 0; }
inline bool Accelerator::is_local_main_process() const { return setup_.world().get_local_rank() == 0; }
inline bool Accelerator::is_last_process() const { return process_index() == num_processes() - 1; }
inline int Accelerator::process_index() const { return setup_.world().get_rank(); }
inline int Accelerator::local_process_index() const { return setup_.world().get_local_rank(); }
inline int Accelerator::num_processes() const { return setup_.world().get_world_size(); }
inline DistributedType Accelerator::distributed_type() const {
  if (!setup_.world().distributed() || num_processes() == 1) return DistributedType::NO;
  return device().is_cuda() ? DistributedType::MULTI_GPU : DistributedType::MULTI_CPU;
}
inline const std::string& Accelerator::mixed_precision() const { return setup_.config().mixed_precision; }
inline int Accelerator::gradient_accumulation_steps() const { return setup_.config().gradient_accumulation_steps; }
inline ShardingStrategy Accelerator::sharding_strategy() const {
  return setup_.sharded() ? setup_.config().sharding_strategy : ShardingStrategy::NO_SHARD;
}
inline bool Accelerator::use_distributed() const { return distributed_type() != DistributedType::NO; }
inline bool Accelerator::is_fsdp2() const {
  const ShardingStrategy s = sharding_strategy();
  return s == ShardingStrategy::FULL_SHARD || s == ShardingStrategy::HYBRID_SHARD;
}
inline bool Accelerator::should_save_model() const { return true; }
inline int Accelerator::data_parallel_rank() const { return setup_.world().get_rank(Dim::DP); }
inline int Accelerator::context_parallel_rank() const { return setup_.world().get_rank(Dim::CP); }
inline int Accelerator::tensor_parallel_rank() const { return setup_.world().get_rank(Dim::TP); }
inline int Accelerator::pipeline_parallel_rank() const { return setup_.world().get_rank(Dim::PP); }
inline const DistributedInterface& Accelerator::state() const { return setup_.world(); }
inline std::optional<std::string> Accelerator::fp8_backend() const { return std::nullopt; }
template <class ModuleHolder>
bool Accelerator::verify_device_map(const ModuleHolder&) const {
  return false;
}
inline const std::filesystem::path& Accelerator::project_dir() const {
  return setup_.config().project_config.project_dir;
}
inline ProjectConfiguration& Accelerator::project_configuration() { return setup_.project(); }
inline int Accelerator::save_iteration() const { return setup_.config().project_config.iteration; }

ACCEL_NAMESPACE_END
