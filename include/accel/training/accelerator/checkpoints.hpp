// accel/training/accelerator/checkpoints.hpp: the Accelerator's checkpoints (save_state, load_state) and exported weights (save_model, load_model).
//
// The checkpoint functions (checkpoint/state.hpp) do the work on the
// PreparedSet; this part says where this process stands and runs them on
// every process.
#pragma once

#include "accel/training/accelerator/accelerator.hpp"
#include "accel/training/checkpoint/state.hpp"

ACCEL_NAMESPACE_BEGIN

// Each stage's module has its own names (a stage's "0.weight" is not the
// whole model's), and every stage's ranks would write the same files: a
// pipeline's checkpoints need the whole model's names first (issue 62).
inline constexpr const char* kPipelineCheckpoints =
    "each stage would write its own module's names into the same files; save each stage's parameters yourself "
    "(accel::save_model on a one-stage-per-file path) until checkpoints take the whole model's names";

inline std::filesystem::path Accelerator::save_state(const std::filesystem::path& path) {
  setup_.refuse_under_pipeline("save_state", kPipelineCheckpoints);
  return detail::every_process_calls("accel::Accelerator::save_state", [&] {
    return detail::save_checkpoint_state(prepared_, checkpoint_context(), step_, project_configuration(), path);
  });
}

inline void Accelerator::load_state(const std::filesystem::path& path) {
  setup_.refuse_under_pipeline("load_state", kPipelineCheckpoints);
  step_ = detail::every_process_calls("accel::Accelerator::load_state", [&] {
    return detail::load_checkpoint_state(prepared_, checkpoint_context(), project_configuration(), path);
  });
}

template <class ModuleHolder>
void Accelerator::save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options) {
  setup_.refuse_under_pipeline("save_model", kPipelineCheckpoints);
  detail::every_process_calls("accel::Accelerator::save_model", [&] {
    const detail::PreparedModel* prepared = prepared_.find(model.ptr().get());
    DataParallel* dp = prepared ? prepared->data_parallel.get() : nullptr;
    if (!dp || dp->unit_count() == 0) return accel::save_model(model, dir, options);
    auto units = dp->unit_by_unit();
    detail::save_weights(*model.ptr(), detail::checkpoint_path(dir, "save_model"), options,
                         [&](const at::Tensor& t) { return units.whole(t); });
  });
}
template <class ModuleHolder>
void Accelerator::save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes) {
  save_model(model, dir, SaveModelOptions{.max_shard_bytes = max_shard_bytes});
}
template <class ModuleHolder>
void Accelerator::load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options) {
  setup_.refuse_under_pipeline("load_model", kPipelineCheckpoints);
  detail::every_process_calls("accel::Accelerator::load_model", [&] {
    const auto full = prepared_.full_parameters(model.ptr().get(), /*writeback=*/true);
    accel::load_model(model, dir, options);
  });
}

inline detail::CheckpointContext Accelerator::checkpoint_context() const {
  return {.process_index = process_index(),
          .num_processes = num_processes(),
          .shards = prepared_.sharded->empty() ? 1 : setup_.world().get_world_size(Dim::MP_SHARD),
          .tp = setup_.world().strategy().tp_size(),
          .device = device()};
}

ACCEL_NAMESPACE_END
