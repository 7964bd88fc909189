// accel/training/checkpoint/state.hpp: save_state's and load_state's driver: write; read and check; apply or roll back; commit.
//
// What goes into a checkpoint is what a PreparedSet lists, plus each
// process's RNG state and accumulation step (checkpoint/write.hpp writes
// it). Loading is transactional in three steps, each a collective:
// read_checkpoint (checkpoint/read.hpp) reads and checks every file and
// changes nothing; apply_checkpoint loads what can refuse as it loads
// (schedulers, registered objects, optimizers) and puts the optimizers
// back on every process if any refuses; commit_checkpoint then loads what
// was checked and cannot fail. The files themselves (manifest, atomic
// install, recovery) are checkpoint/files.hpp's.
#pragma once

#include "accel/training/checkpoint/read.hpp"
#include "accel/training/checkpoint/sharded_weights.hpp"
#include "accel/training/checkpoint/write.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// 2. Schedulers and registered objects with a load() of their own check
// what they load as they load it (and cannot be put back); the other
// schedulers replay their missing steps (which sets the optimizers'
// learning rates the way the saved run did; the optimizers' own come
// next). The optimizers check their groups: what they had is kept, to be
// put back on every process if any one of them refuses.
inline void apply_checkpoint(PreparedSet& set, const CheckpointContext& ctx, LoadedCheckpoint& loaded,
                             const std::filesystem::path& dir) {
  auto& optimizers = loaded.optimizers;
  auto& objects = loaded.objects;
  auto& schedulers = loaded.schedulers;
  const auto& scheduler_steps = loaded.scheduler_steps;
  std::vector<std::string> snapshots;  // taken before a replayed scheduler sets learning rates
  const std::string error = error_of([&] {
    for (auto* optimizer : set.optimizers) snapshots.push_back(optimizer_snapshot(*optimizer));
    for (std::size_t i = 0; i < set.schedulers.size(); ++i) {
      try {
        if (set.schedulers[i].load) {
          torch::serialize::InputArchive own;
          schedulers[i]->read("own", own);
          set.schedulers[i].load(own);
        } else {
          for (int64_t k = *set.schedulers[i].steps; k < scheduler_steps[i]; ++k) set.schedulers[i].step();
        }
        *set.schedulers[i].steps = scheduler_steps[i];
      } catch (const std::exception& e) {
        throw RuntimeError((dir / file_names::scheduler(i)).string() + " does not fit the scheduler: " + error_text(e));
      }
    }
    for (std::size_t i = 0; i < set.objects.size(); ++i) {
      try {
        set.objects[i].load(*objects[i]);
      } catch (const std::exception& e) {
        throw RuntimeError((dir / file_names::custom_object(i)).string() +
                           " does not fit the registered object: " + error_text(e));
      }
    }
    for (std::size_t i = 0; i < set.optimizers.size(); ++i) {
      try {
        set.optimizers[i]->load(*optimizers[i]);
        load_group_options(*set.optimizers[i], *optimizers[i]);
      } catch (const std::exception& e) {
        throw RuntimeError((dir / optimizer_file(set, ctx, i)).string() +
                           " does not fit the optimizer: " + error_text(e));
      }
    }
  });
  try {
    fail_together(error, "accel::Accelerator::load_state");
  } catch (...) {
    for (std::size_t i = 0; i < snapshots.size(); ++i) restore_optimizer(*set.optimizers[i], snapshots[i]);
    throw;
  }
}

// 3. What was read and checked cannot fail to load: the models (and their
// shards), the loaders' places, this process's RNG. Returns the saved
// accumulation step.
inline int64_t commit_checkpoint(PreparedSet& set, const CheckpointContext& ctx, const LoadedCheckpoint& loaded) {
  const auto& models = loaded.models;
  const auto& points = loaded.points;
  for (std::size_t i = 0; i < set.models.size(); ++i) {
    DataParallel* dp = set.models[i].data_parallel.get();
    const bool sharded = dp && dp->sharded();
    if (models[i]) {
      if (sharded) dp->sharded_state_dict().open_for_load();
      set.models[i].module->load(*models[i]);
      if (sharded) dp->sharded_state_dict().reshard();
    } else {
      commit_model_pieces(*set.models[i].module, dp, loaded.pieces[i]);
    }
  }
  for (std::size_t i = 0; i < set.loaders.size(); ++i) {
    const auto row = static_cast<int64_t>(i);  // (the place in this run's batches: read_checkpoint converted it)
    set.loaders[i]->resume_at(static_cast<size_t>(points[row][0].item<int64_t>()),
                              static_cast<size_t>(points[row][1].item<int64_t>()));
  }
  // A generator's state is a CPU byte tensor, the CUDA generator's too; the
  // archives were read onto the training device, so it comes back first.
  auto set_state = [](at::Generator generator, const at::Tensor& state) {
    std::lock_guard lock(generator.mutex());
    generator.set_state(state.cpu());
  };
  if (!loaded.derived_rng) {
    set_state(at::detail::getDefaultCPUGenerator(), loaded.rng);
    if (loaded.device_rng.defined()) set_state(at::globalContext().defaultGenerator(ctx.device), loaded.device_rng);
  } else {  // a process the saving run did not have: a stream of its own (checkpoint/world.hpp)
    const uint64_t seed = derived_seed(loaded.rng, ctx.process_index);
    auto reseed = [seed](at::Generator generator) {
      std::lock_guard lock(generator.mutex());
      generator.set_current_seed(seed);
    };
    reseed(at::detail::getDefaultCPUGenerator());
    if (ctx.device.is_cuda()) reseed(at::globalContext().defaultGenerator(ctx.device));
  }
  if (loaded.scaler) set.scaler->load_state(loaded.scaler->first, loaded.scaler->second);
  if (ctx.process_index == 0)
    for (const auto& warning : loaded.warnings) TORCH_WARN(warning);
  return loaded.step;
}

// read_checkpoint, apply_checkpoint and commit_checkpoint in turn. Returns
// the saved accumulation step.
inline int64_t load_checkpoint(PreparedSet& set, const CheckpointContext& ctx, const std::filesystem::path& dir) {
  LoadedCheckpoint loaded = read_checkpoint(set, ctx, dir);
  apply_checkpoint(set, ctx, loaded, dir);
  return commit_checkpoint(set, ctx, loaded);
}

// Accelerator::save_state: into `path`, or with automatic_checkpoint_naming
// into project_dir/checkpoints/checkpoint_<iteration> (counting iteration
// up, and rotating under total_limit). Returns the checkpoint's directory.
inline std::filesystem::path save_checkpoint_state(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                                                   ProjectConfiguration& config, const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const ProjectConfiguration& project = config;
  check_project(project, "accel::Accelerator::save_state");
  if (!project.automatic_checkpoint_naming) {
    if (path.empty())
      throw InvalidArgument(
          "accel::Accelerator::save_state: no checkpoint path (pass one, or turn on "
          "project_config.automatic_checkpoint_naming)");
    const fs::path dir = checkpoint_path(path, "save_state");
    write_checkpoint(set, ctx, step, dir);
    return dir;
  }
  if (!path.empty())
    throw InvalidArgument(
        "accel::Accelerator::save_state: automatic_checkpoint_naming names the checkpoint "
        "(project_dir/checkpoints/checkpoint_<iteration>); call save_state() without " +
        path.string());
  const fs::path root = checkpoint_path(project.project_dir / "checkpoints", "save_state");
  const int number = project.iteration;
  const fs::path dir = root / ("checkpoint_" + std::to_string(number));
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      fs::create_directories(root);
      if (recover_checkpoint(dir) || fs::exists(dir))
        throw RuntimeError(dir.string() + " (iteration " + std::to_string(number) +
                           ") already exists: set project_configuration().iteration to the number to go on with, "
                           "or load_state() first (which sets it past the newest)");
    });
  fail_together(error, "accel::Accelerator::save_state");
  write_checkpoint(set, ctx, step, dir);
  ++config.iteration;
  if (project.total_limit) {
    if (ctx.process_index == 0) error = error_of([&] { rotate_checkpoints(root, *project.total_limit, number); });
    fail_together(error, "accel::Accelerator::save_state");
  }
  return dir;
}

// Accelerator::load_state: from `path`, or with automatic_checkpoint_naming
// the newest numbered checkpoint (and iteration set past it). Returns the
// saved accumulation step.
inline int64_t load_checkpoint_state(PreparedSet& set, const CheckpointContext& ctx, ProjectConfiguration& config,
                                     const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const ProjectConfiguration& project = config;
  check_project(project, "accel::Accelerator::load_state");
  if (!project.automatic_checkpoint_naming) {
    if (path.empty())
      throw InvalidArgument(
          "accel::Accelerator::load_state: no checkpoint path (pass one, or turn on "
          "project_config.automatic_checkpoint_naming to load the newest)");
    return load_checkpoint(set, ctx, checkpoint_path(path, "load_state"));
  }
  const fs::path root = checkpoint_path(project.project_dir / "checkpoints", "load_state");
  int64_t newest = -1;  // none
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      const std::map<int, fs::path> complete = numbered_checkpoints(root);
      if (!complete.empty()) newest = complete.rbegin()->first;
    });
  fail_together(error, "accel::Accelerator::load_state");
  newest = accel::broadcast(newest, 0);
  if (path.empty() && newest < 0)
    throw InvalidArgument("accel::Accelerator::load_state: no checkpoint under " + root.string());
  const fs::path dir =
      path.empty() ? root / ("checkpoint_" + std::to_string(newest)) : checkpoint_path(path, "load_state");
  const int64_t step = load_checkpoint(set, ctx, dir);
  config.iteration = std::max<int>(project.iteration, static_cast<int>(newest + 1));
  return step;
}
}  // namespace detail

ACCEL_NAMESPACE_END
