// accel/training/checkpoint/state.hpp: save_state's and load_state's work: write; read and check; apply or roll back; commit.
//
// What goes into a checkpoint is what a PreparedSet lists, plus each
// process's RNG state and accumulation step. Loading is transactional in
// three steps, each a collective: read_checkpoint reads and checks every
// file and changes nothing; apply_checkpoint loads what can refuse as it
// loads (schedulers, registered objects, optimizers) and puts the
// optimizers back on every process if any refuses; commit_checkpoint then
// loads what was checked and cannot fail. The files themselves (manifest,
// atomic install, recovery) are checkpoint/files.hpp's.
#pragma once

#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/reshard.hpp"
#include "accel/training/checkpoint/shards.hpp"
#include "accel/training/checkpoint/world.hpp"
#include "accel/training/checkpoint/prepared.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Where this process stands, as the checkpoint records and checks it.
struct CheckpointContext {
  int process_index = 0;
  int num_processes = 1;
  int64_t shards = 1;  // ways the optimizer state is sharded (1: not sharded)
  c10::Device device{c10::kCPU};
};

// Optimizer i's checkpoint file: this process's own under sharding, else the whole one.
inline std::string optimizer_file(const PreparedSet& set, const CheckpointContext& ctx, std::size_t i) {
  return file_names::optimizer(i, set.sharded->empty() ? -1 : ctx.process_index);
}

// Whether model i is saved in pieces, every process its own
// (checkpoint/shards.hpp), rather than whole in model.pt by process 0.
inline bool saved_in_pieces(const PreparedSet& set, std::size_t i) {
  return set.models[i].data_parallel && set.models[i].data_parallel->sharded();
}

// An archive written into the checkpoint directory `tmp` and logged with its digest.
inline void save_logged(torch::serialize::OutputArchive& archive, const std::filesystem::path& tmp,
                        const std::string& name, FileLog& log) {
  log.emplace_back(name, save_archive(archive, tmp / name));
}

// What every process writes: its RNG states and step (as Accelerate's
// random_states_<i>), and under sharding its own pieces of the models and
// its own optimizer state; each file into `log`.
inline void write_process_files(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                                const std::filesystem::path& tmp, const std::string& id, FileLog& log) {
  torch::serialize::OutputArchive archive;
  archive.write("cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (ctx.device.is_cuda()) archive.write("cuda", at::globalContext().defaultGenerator(ctx.device).get_state());
  archive.write("step", at::scalar_tensor(step, at::kLong));
  save_logged(archive, tmp, file_names::random_states(ctx.process_index), log);
  if (!set.sharded->empty()) write_pieces(set, ctx.process_index, tmp, id, log);
  if (!set.sharded->empty())
    for (std::size_t i = 0; i < set.optimizers.size(); ++i) {
      torch::serialize::OutputArchive state;
      set.optimizers[i]->save(state);
      save_logged(state, tmp, optimizer_file(set, ctx, i), log);
    }
}

// What process 0 writes for all: the models not sharded (whole
// parameters), the optimizers unless sharded, each prepared loader's resume point (epoch,
// batches to skip), the schedulers' step counts (and own state) and the
// registered objects; each file into `log`.
inline void write_shared_files(PreparedSet& set, const CheckpointContext& ctx, const std::filesystem::path& tmp,
                               FileLog& log) {
  auto write = [&](const std::string& name, auto& object) {
    torch::serialize::OutputArchive archive;
    object.save(archive);
    save_logged(archive, tmp, name, log);
  };
  for (std::size_t i = 0; i < set.models.size(); ++i)
    if (!saved_in_pieces(set, i)) write(file_names::model(i), *set.models[i].module);
  if (set.sharded->empty())
    for (std::size_t i = 0; i < set.optimizers.size(); ++i) write(optimizer_file(set, ctx, i), *set.optimizers[i]);
  if (!set.loaders.empty()) {
    std::vector<int64_t> points, per_batch;
    for (const auto& loader : set.loaders) {
      const auto [epoch, skip] = loader->resume_point();
      points.insert(points.end(), {static_cast<int64_t>(epoch), static_cast<int64_t>(skip)});
      per_batch.push_back(static_cast<int64_t>(loader->samples_per_batch));
    }
    torch::serialize::OutputArchive archive;
    archive.write("resume_points", at::tensor(points).reshape({static_cast<int64_t>(set.loaders.size()), 2}));
    archive.write("samples_per_batch", at::tensor(per_batch));  // (0: not known) by which a place carries over
    save_logged(archive, tmp, file_names::loaders, log);
  }
  for (std::size_t i = 0; i < set.schedulers.size(); ++i) {
    torch::serialize::OutputArchive archive;
    archive.write("steps", at::scalar_tensor(*set.schedulers[i].steps, at::kLong));
    if (set.schedulers[i].save) {
      torch::serialize::OutputArchive own;
      set.schedulers[i].save(own);
      archive.write("own", own);
    }
    save_logged(archive, tmp, file_names::scheduler(i), log);
  }
  for (std::size_t i = 0; i < set.objects.size(); ++i) {
    torch::serialize::OutputArchive archive;
    set.objects[i].save(archive);
    save_logged(archive, tmp, file_names::custom_object(i), log);
  }
  if (set.scaler) {  // (the same on every process: each step's overflow check is agreed)
    torch::serialize::OutputArchive archive;
    archive.write("scale", at::scalar_tensor(set.scaler->get_scale(), at::kDouble));
    archive.write("growth_tracker", at::scalar_tensor(set.scaler->growth_tracker(), at::kLong));
    save_logged(archive, tmp, file_names::scaler, log);
  }
}

// Writes the checkpoint into dir (through dir.tmp and an atomic install);
// every process calls it, and an error anywhere is thrown everywhere.
inline void write_checkpoint(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                             const std::filesystem::path& dir) {
  const std::filesystem::path tmp = sibling(dir, ".tmp");
  CheckpointManifest manifest{.serial = 0,
                              .processes = ctx.num_processes,
                              .models = static_cast<int64_t>(set.models.size()),
                              .optimizers = static_cast<int64_t>(set.optimizers.size()),
                              .loaders = static_cast<int64_t>(set.loaders.size()),
                              .objects = static_cast<int64_t>(set.objects.size()),
                              .schedulers = static_cast<int64_t>(set.schedulers.size()),
                              .shards = ctx.shards};
  // An error anywhere is thrown everywhere. The last checkpoint stays as it
  // was, and an incomplete DIR.tmp is removed (a full disk gets its space
  // back): once fail_together returns, no process writes into it any more.
  auto fail_on_every_process = [&](const std::string& error) {
    try {
      fail_together(error, "accel::Accelerator::save_state");
    } catch (...) {
      std::error_code ignored;
      if (ctx.process_index == 0 && !read_manifest(tmp)) std::filesystem::remove_all(tmp, ignored);
      throw;
    }
  };
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      manifest.serial = recover_checkpoint(dir).value_or(0) + 1;
      manifest.id = new_checkpoint_id();
      std::filesystem::create_directories(tmp);
    });
  fail_on_every_process(error);
  {  // (every piece carries the id)
    std::vector<std::string> id{manifest.id};
    accel::broadcast_object_list(id);
    manifest.id = id[0];
  }
  FileLog log;
  fail_on_every_process(error_of([&] { write_process_files(set, ctx, step, tmp, manifest.id, log); }));
  {  // every process's files and digests, for the manifest (process 0 writes it)
    std::ostringstream mine;
    for (const auto& [name, digest] : log) mine << name << ' ' << digest.bytes << ' ' << digest.xxh64 << '\n';
    for (const std::string& theirs : accel::gather_object(mine.str())) {
      std::istringstream in(theirs);
      std::string name;
      FileDigest digest;
      while (in >> name >> digest.bytes >> digest.xxh64) manifest.files[name] = digest;
    }
  }
  if (ctx.process_index == 0)
    error = error_of([&] {
      FileLog shared;
      write_shared_files(set, ctx, tmp, shared);
      for (const auto& [name, digest] : shared) manifest.files[name] = digest;
      checkpoint_hook()("files written");
      write_manifest(tmp, manifest);
      fsync_path(tmp);
      checkpoint_hook()("manifest written");
      install_checkpoint(tmp, dir);
    });
  fail_on_every_process(error);
}

// What read_checkpoint read and checked, before anything changed.
struct LoadedCheckpoint {
  std::vector<std::unique_ptr<torch::serialize::InputArchive>> models, optimizers, objects, schedulers;
  // A model saved in pieces (models[i] null): what this process keeps of each parameter and buffer, by name.
  std::vector<std::map<std::string, at::Tensor>> pieces;
  std::vector<int64_t> scheduler_steps;
  at::Tensor rng, device_rng, points;  // device_rng: the CUDA generator's, where both runs had one
  std::vector<std::string> warnings;   // given once the load is committed (a loader's place, checkpoint_world)
  bool derived_rng = false;            // the saving run had no process of this index: seed from rng (checkpoint_world)
  int64_t step = 0;
  std::optional<std::pair<double, int64_t>> scaler;  // the loss scale and growth tracker, where this run has a scaler
};

// The manifest against this run: as many models, optimizers, schedulers,
// loaders and registered objects. The number of processes and the ways
// the optimizer state is sharded may differ (checkpoint/world.hpp,
// checkpoint/reshard.hpp). Returns the saving run's layout.
struct SavedLayout {
  int processes = 1;
  int64_t shards = 1;  // ways its optimizer state is sharded (1: whole, in optimizer.pt)
  CheckpointManifest manifest;
};
inline SavedLayout check_manifest(const std::filesystem::path& dir, const PreparedSet& set) {
  const auto manifest = read_manifest(dir);
  if (!manifest)
    throw RuntimeError("no complete checkpoint: " + (dir / file_names::manifest).string() +
                       ", which save_state writes last, is missing, cut short or damaged");
  const std::array<std::pair<const char*, std::pair<int64_t, std::size_t>>, 5> counts{
      {{"model(s)", {manifest->models, set.models.size()}},
       {"optimizer(s)", {manifest->optimizers, set.optimizers.size()}},
       {"scheduler(s)", {manifest->schedulers, set.schedulers.size()}},
       {"data loader(s)", {manifest->loaders, set.loaders.size()}},
       {"registered object(s)", {manifest->objects, set.objects.size()}}}};
  for (const auto& count : counts)
    if (count.second.first != static_cast<int64_t>(count.second.second))
      throw RuntimeError("it holds " + std::to_string(count.second.first) + " " + count.first + "; this run has " +
                         std::to_string(count.second.second));
  if (manifest->shards < 1 || manifest->processes < 1 || manifest->shards > manifest->processes)
    throw RuntimeError((dir / file_names::manifest).string() + " says " + std::to_string(manifest->processes) +
                       " processes and " + std::to_string(manifest->shards) + " shards");
  return {static_cast<int>(manifest->processes), manifest->shards, *manifest};
}

// 1. Recovers a half-done save of dir, then reads and checks every file
// against the prepared set; nothing changes. An error on any process is
// thrown on every process, naming the file.
inline LoadedCheckpoint read_checkpoint(const PreparedSet& set, const CheckpointContext& ctx,
                                        const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  {
    std::string error;
    if (ctx.process_index == 0) error = error_of([&] { recover_checkpoint(dir); });
    fail_together(error, "accel::Accelerator::load_state");
  }
  if (!fs::is_directory(dir))
    throw InvalidArgument("accel::Accelerator::load_state: no checkpoint directory " + dir.string());
  LoadedCheckpoint loaded;
  auto& models = loaded.models;  // (names for the members, as the checks below read them)
  auto& optimizers = loaded.optimizers;
  auto& objects = loaded.objects;
  auto& schedulers = loaded.schedulers;
  auto& scheduler_steps = loaded.scheduler_steps;
  auto& rng = loaded.rng;
  auto& device_rng = loaded.device_rng;
  auto& points = loaded.points;
  auto& step = loaded.step;
  models.resize(set.models.size());
  optimizers.resize(set.optimizers.size());
  const std::string error = error_of([&] {
    const SavedLayout saved = check_manifest(dir, set);
    const int saved_processes = saved.processes;
    CheckpointFiles files(dir, saved.manifest);  // (each file checked against its digest: files.wait() below)
    auto read = [&](const std::string& name) {
      const fs::path file = files.check(name);
      auto archive = std::make_unique<torch::serialize::InputArchive>();
      try {
        archive->load_from(file.string(), ctx.device);
      } catch (const std::exception& e) {
        throw RuntimeError("cannot read " + file.string() + ": " + error_text(e));
      }
      return archive;
    };
    // Everything read, then every file's check awaited; a failed check is the error, before any other (a damaged
    // file's parse may fail first).
    try {
      loaded.pieces.resize(set.models.size());
      std::optional<ShardedWeights> pieces;  // (read once, where a model was saved in pieces)
      for (std::size_t i = 0; i < set.models.size(); ++i) {
        if (!fs::exists(dir / file_names::model(i))) {
          if (!pieces) {
            const auto found = fs::directory_iterator(dir);
            if (std::none_of(fs::begin(found), fs::end(found),
                             [](const auto& entry) { return entry.path().extension() == ".safetensors"; }))
              throw RuntimeError("missing " + (dir / file_names::model(i)).string() +
                                 " (and no sharded model's pieces, *.safetensors, beside it)");
            pieces.emplace(dir, files);
          }
          loaded.pieces[i] =
              read_model_pieces(*set.models[i].module, set.models[i].data_parallel.get(), *pieces, model_prefix(i));
          continue;
        }
        models[i] = read(file_names::model(i));
        check_module_archive(*set.models[i].module, *models[i], "", (dir / file_names::model(i)).string());
      }
      // Each optimizer's state as saved where this run shards it the same way (or keeps it whole), else cut
      // again from the saved pieces (checkpoint/reshard.hpp); piece k is in the file of process k.
      const bool as_saved = saved.shards == ctx.shards && (saved.shards == 1 || saved.processes == ctx.num_processes);
      for (std::size_t i = 0; i < set.optimizers.size(); ++i)
        optimizers[i] = as_saved ? read(optimizer_file(set, ctx, i))
                                 : resharded_optimizer(set, i, saved.shards, ctx.device, [&](int64_t k) {
                                     const std::string name =
                                         file_names::optimizer(i, saved.shards == 1 ? -1 : static_cast<int>(k));
                                     return OpenedArchive{(dir / name).string(), std::move(*read(name))};
                                   });
      for (std::size_t i = 0; i < set.objects.size(); ++i) objects.push_back(read(file_names::custom_object(i)));
      for (std::size_t i = 0; i < set.schedulers.size(); ++i) schedulers.push_back(read(file_names::scheduler(i)));
      // A tensor of the given dtype and shape under `key`, or an error naming the file.
      auto tensor = [&](torch::serialize::InputArchive& archive, const char* key, at::ScalarType dtype,
                        at::IntArrayRef sizes, const std::string& file) {
        at::Tensor value;
        if (!archive.try_read(key, value) || value.scalar_type() != dtype || value.sizes() != sizes)
          throw RuntimeError(file + " has no " + key + " of " + c10::toString(dtype) + c10::str(sizes));
        return value;
      };
      for (std::size_t i = 0; i < set.schedulers.size(); ++i) {
        const std::string file = (dir / file_names::scheduler(i)).string();
        scheduler_steps.push_back(tensor(*schedulers[i], "steps", at::kLong, {}, file).item<int64_t>());
        torch::serialize::InputArchive own;
        if (set.schedulers[i].load && !schedulers[i]->try_read("own", own))
          throw RuntimeError(file + " has no state of the scheduler's own save()");
        if (!set.schedulers[i].load && scheduler_steps[i] < *set.schedulers[i].steps)
          throw RuntimeError(file + ": the scheduler took " + std::to_string(scheduler_steps[i]) +
                             " steps; this one has already taken " + std::to_string(*set.schedulers[i].steps) +
                             " (load the checkpoint before stepping it)");
      }
      if (!set.loaders.empty()) {
        const std::string file = (dir / file_names::loaders).string();
        auto archive = read(file_names::loaders);
        const auto n = static_cast<int64_t>(set.loaders.size());
        points = tensor(*archive, "resume_points", at::kLong, {n, 2}, file);
        // Each place in this run's batches (checkpoint/world.hpp): converted here, so that nothing can fail later.
        at::Tensor saved_per_batch;
        if (archive->try_read("samples_per_batch", saved_per_batch))
          saved_per_batch = tensor(*archive, "samples_per_batch", at::kLong, {n}, file);
        else if (saved_processes != ctx.num_processes)
          throw RuntimeError(file +
                             " does not say how many samples its loaders read per batch (an older "
                             "accel.hpp saved it): load it with as many processes as saved it (" +
                             std::to_string(saved_processes) + ")");
        for (int64_t i = 0; saved_per_batch.defined() && i < n; ++i) {
          ResumedBatches resumed = resumed_batches(
              static_cast<std::size_t>(i), static_cast<size_t>(points[i][1].item<int64_t>()),
              saved_per_batch[i].item<int64_t>(), set.loaders[static_cast<std::size_t>(i)]->samples_per_batch,
              saved_processes == ctx.num_processes);
          points[i][1].fill_(static_cast<int64_t>(resumed.batches));
          if (!resumed.warning.empty()) loaded.warnings.push_back(std::move(resumed.warning));
        }
      }
      if (set.scaler) {
        const std::string file = (dir / file_names::scaler).string();
        if (!fs::exists(dir / file_names::scaler))
          throw RuntimeError("missing " + file + " (this run has fp16's loss scaler; the saving run had none)");
        auto archive = read(file_names::scaler);
        loaded.scaler = {tensor(*archive, "scale", at::kDouble, {}, file).item<double>(),
                         tensor(*archive, "growth_tracker", at::kLong, {}, file).item<int64_t>()};
      }
      // This process's own, or where the saving run had fewer, one to seed from (checkpoint/world.hpp).
      const int saved_process = saved_process_for(ctx.process_index, saved_processes);
      loaded.derived_rng = saved_process != ctx.process_index;
      const std::string rng_name = file_names::random_states(saved_process);
      if (!fs::exists(dir / rng_name)) throw RuntimeError("missing " + (dir / rng_name).string());
      auto rng_archive = read(rng_name);
      const at::Tensor current = at::detail::getDefaultCPUGenerator().get_state();
      rng = tensor(*rng_archive, "cpu", current.scalar_type(), current.sizes(), (dir / rng_name).string());
      step = tensor(*rng_archive, "step", at::kLong, {}, (dir / rng_name).string()).item<int64_t>();
      at::Tensor saved_device_rng;
      if (ctx.device.is_cuda() && rng_archive->try_read("cuda", saved_device_rng)) {
        const at::Tensor now = at::globalContext().defaultGenerator(ctx.device).get_state();
        device_rng = tensor(*rng_archive, "cuda", now.scalar_type(), now.sizes(), (dir / rng_name).string());
      }
    } catch (...) {
      files.wait();
      throw;
    }
    files.wait();
  });
  fail_together(error, "accel::Accelerator::load_state");
  return loaded;
}

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
