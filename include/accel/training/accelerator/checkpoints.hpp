// accel/training/accelerator/checkpoints.hpp: the Accelerator's checkpoints (save_state, load_state) and exported weights (save_model, load_model).
//
// The checkpoint functions (checkpoint/state.hpp) do the work on the
// PreparedSet; this part says where this process stands and runs them on
// every process. Under a pipeline a process's prepared models are its
// stages of one model: save_state writes them in pieces under the model's
// names (checkpoint/shards.hpp), save_model gathers them into one file set
// (checkpoint/pipeline_weights.hpp).
#pragma once

#include "accel/training/accelerator/accelerator.hpp"
#include "accel/training/checkpoint/pipeline_weights.hpp"
#include "accel/training/checkpoint/state.hpp"

ACCEL_NAMESPACE_BEGIN

inline std::filesystem::path Accelerator::save_state(const std::filesystem::path& path) {
  return detail::every_process_calls("accel::Accelerator::save_state", [&] {
    return detail::save_checkpoint_state(prepared_, checkpoint_context(), step_, project_configuration(), path);
  });
}

inline void Accelerator::load_state(const std::filesystem::path& path) {
  step_ = detail::every_process_calls("accel::Accelerator::load_state", [&] {
    return detail::load_checkpoint_state(prepared_, checkpoint_context(), project_configuration(), path);
  });
}

template <class ModuleHolder>
void Accelerator::save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options) {
  detail::every_process_calls("accel::Accelerator::save_model", [&] {
    if (const GroupPtr pipeline = setup_.pipeline_group()) {
      pipeline_stages_of(model.ptr().get(), "save_model");
      std::deque<detail::dp::UnitByUnit> units;  // (one per stage: each gathers its own units, one at a time)
      std::vector<detail::StageWeights> stages;
      for (auto& m : prepared_.models) {
        detail::dp::UnitByUnit& held = units.emplace_back(m.data_parallel->unit_by_unit());
        stages.push_back({m.module.get(), [&held](const at::Tensor& t) { return held.whole(t); }});
      }
      return detail::save_weights(detail::pipeline_weights(stages, options.adapter, pipeline, device()),
                                  detail::checkpoint_path(dir, "save_model"), options);
    }
    const detail::PreparedModel* prepared = prepared_.find(model.ptr().get());
    DataParallel* dp = prepared ? prepared->data_parallel.get() : nullptr;
    if (!dp || dp->unit_count() == 0) return accel::save_model(model, dir, options);
    auto units = dp->unit_by_unit();
    detail::save_weights(
        detail::module_weights(*model.ptr(), options.adapter, [&](const at::Tensor& t) { return units.whole(t); }),
        detail::checkpoint_path(dir, "save_model"), options);
  });
}
template <class ModuleHolder>
void Accelerator::save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes) {
  save_model(model, dir, SaveModelOptions{.max_shard_bytes = max_shard_bytes});
}
template <class ModuleHolder>
void Accelerator::load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options) {
  detail::every_process_calls("accel::Accelerator::load_model", [&] {
    if (const GroupPtr pipeline = setup_.pipeline_group()) {
      pipeline_stages_of(model.ptr().get(), "load_model");
      std::vector<torch::nn::Module*> stages;
      for (auto& m : prepared_.models) stages.push_back(m.module.get());
      const auto full = prepared_.full_parameters(nullptr, /*writeback=*/true);
      return detail::load_weights(stages, detail::checkpoint_path(dir, "load_model"), options,
                                  detail::every_stage_entries(pipeline));
    }
    const auto full = prepared_.full_parameters(model.ptr().get(), /*writeback=*/true);
    accel::load_model(model, dir, options);
  });
}

// Under a pipeline, save_model and load_model take the whole model: every
// stage prepared on every process. `model` must be one of this process's
// (a process that passes another model is refused on every process, before
// any collective of the save).
inline void Accelerator::pipeline_stages_of(const torch::nn::Module* model, const char* op) {
  std::string error;
  if (!prepared_.find(model))
    error = "under pp_size " + std::to_string(setup_.world().strategy().pp_size()) + ", " + op +
            " takes the whole model, every stage prepared on every process; pass one of this process's prepared "
            "stages (this model was not prepared)";
  detail::fail_together<InvalidArgument>(error, std::string("accel::Accelerator::") + op);
}

inline detail::CheckpointContext Accelerator::checkpoint_context() const {
  return {.process_index = process_index(),
          .num_processes = num_processes(),
          .shards = prepared_.sharded->empty() ? 1 : setup_.world().get_world_size(Dim::MP_SHARD),
          .tp = setup_.world().strategy().tp_size(),
          .pp = setup_.world().strategy().pp_size(),
          .device = device()};
}

ACCEL_NAMESPACE_END
