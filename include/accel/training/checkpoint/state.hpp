// accel/training/checkpoint/state.hpp: save_state's and load_state's driver: the phases of a checkpoint's items, with the collectives between them.
//
// A checkpoint is a list of items, one per artifact (checkpoint/item.hpp
// says what each phase does; the items are in model_items.hpp and
// state_items.hpp). Saving: every process writes its own files, then
// process 0 the files of all and, last, the manifest listing every file
// with its digest; all of it goes into DIR.tmp, installed as DIR at once
// (checkpoint/files.hpp). Loading is transactional, each step a
// collective: every item reads and checks its files, changing nothing;
// then the items that can refuse as they load apply, and all are put back
// on every process if any refuses; then every item commits what was
// checked and cannot fail. An error on any process is thrown on every
// process, naming the file.
#pragma once

#include "accel/training/checkpoint/from_python.hpp"
#include "accel/training/checkpoint/model_items.hpp"
#include "accel/training/checkpoint/pipeline_weights.hpp"
#include "accel/training/checkpoint/state_items.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The items of a checkpoint of `set`, in the order of every phase: the
// schedulers and registered objects apply before the optimizers (a
// replayed scheduler sets learning rates, which the optimizers' own state
// then overrides). The RNG states' comes last.
inline CheckpointItems checkpoint_items(PreparedSet& set, const CheckpointContext& ctx, int64_t step = 0) {
  CheckpointItems items;
  for (std::size_t i = 0; i < set.models.size(); ++i) items.push_back(std::make_unique<ModelItem>(set, i));
  items.push_back(std::make_unique<ShardedPiecesItem>(set));
  for (std::size_t i = 0; i < set.schedulers.size(); ++i)
    items.push_back(std::make_unique<SchedulerItem>(set.schedulers[i], i));
  for (std::size_t i = 0; i < set.objects.size(); ++i) items.push_back(std::make_unique<ObjectItem>(set.objects[i], i));
  for (std::size_t i = 0; i < set.optimizers.size(); ++i) items.push_back(std::make_unique<OptimizerItem>(set, ctx, i));
  items.push_back(std::make_unique<LoadersItem>(set.loaders));
  if (set.scaler) items.push_back(std::make_unique<ScalerItem>(set.scaler));
  items.push_back(std::make_unique<RandomStatesItem>(step));
  return items;
}
inline const RandomStatesItem& random_states_of(const CheckpointItems& items) {
  for (const auto& item : items)  // (found by type, so that reordering the list cannot pick another item)
    if (const auto* states = dynamic_cast<const RandomStatesItem*>(item.get())) return *states;
  throw LogicError("accel::Accelerator::load_state: no RNG states among the checkpoint's items");
}

// The manifest's counts for this run (its serial, id and files come later).
inline CheckpointManifest manifest_for(const PreparedSet& set, const CheckpointContext& ctx) {
  return {.serial = 0,
          .processes = ctx.num_processes,
          .models = static_cast<int64_t>(set.models.size()),
          .optimizers = static_cast<int64_t>(set.optimizers.size()),
          .loaders = static_cast<int64_t>(set.loaders.size()),
          .objects = static_cast<int64_t>(set.objects.size()),
          .schedulers = static_cast<int64_t>(set.schedulers.size()),
          .shards = ctx.shards,
          .tp = ctx.tp,
          .pp = ctx.pp};
}
// Every process's files and digests, into the manifest process 0 writes
// (a collective: every process calls it with its own log).
inline void add_every_process_files(const FileLog& log, CheckpointManifest& manifest) {
  std::ostringstream mine;
  for (const auto& [name, digest] : log) mine << name << ' ' << digest.bytes << ' ' << digest.xxh64 << '\n';
  for (const std::string& theirs : accel::gather_object(mine.str())) {
    std::istringstream in(theirs);
    std::string name;
    FileDigest digest;
    while (in >> name >> digest.bytes >> digest.xxh64) manifest.files[name] = digest;
  }
}

// Under a pipeline every name must be held by one stage: a weight tied
// across stages would be written by both, and load_state would find its
// pieces overlapping and refuse the checkpoint, long after the save. So
// save_state refuses it at once, on every process, before anything is
// written (as save_model does), from every stage's names gathered over the
// pipeline group.
inline void refuse_names_held_twice(const PreparedSet& set) {
  if (!set.pipeline_group) return;
  std::vector<PlannedTensor> mine;
  for (const auto& m : set.models)
    for (const auto& entry : whole_entries(*m.module, m.split)) mine.push_back({entry, entry});
  const auto every = every_stage_planned(mine, set.pipeline_group);  // (never nullopt: no process sends a failure)
  const std::string twice = first_name_held_twice(*every, "give it to one stage");
  if (!twice.empty()) throw InvalidArgument("accel::Accelerator::save_state: " + twice);
}

// Writes the checkpoint into dir (through dir.tmp and an atomic install);
// every process calls it, and an error anywhere is thrown everywhere.
inline void write_checkpoint(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                             const std::filesystem::path& dir) {
  refuse_names_held_twice(set);
  const CheckpointItems items = checkpoint_items(set, ctx, step);
  const std::filesystem::path tmp = sibling(dir, ".tmp");
  CheckpointManifest manifest = manifest_for(set, ctx);
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
  fail_on_every_process(error_of([&] {
    for (const auto& item : items) item->write_own({ctx, tmp, manifest.id, log});
  }));
  add_every_process_files(log, manifest);
  if (ctx.process_index == 0)
    error = error_of([&] {
      FileLog shared;
      for (const auto& item : items) item->write_shared({ctx, tmp, manifest.id, shared});
      for (const auto& [name, digest] : shared) manifest.files[name] = digest;
      checkpoint_hook()("files written");
      write_manifest(tmp, manifest);
      fsync_path(tmp);
      checkpoint_hook()("manifest written");
      install_checkpoint(tmp, dir);
    });
  fail_on_every_process(error);
}
// The manifest against this run: as many models, optimizers, schedulers,
// loaders and registered objects. Returns the saving run's layout.
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
  // (a pipeline's stages are one model, however many a process holds: the
  // piece files are checked against every stage's tensors instead)
  const bool pipeline = manifest->pp > 1 || set.pipeline_group;
  for (const auto& count : counts)
    if (count.second.first != static_cast<int64_t>(count.second.second) &&
        !(pipeline && count.first == std::string_view("model(s)")))
      throw RuntimeError("it holds " + std::to_string(count.second.first) + " " + count.first + "; this run has " +
                         std::to_string(count.second.second));
  if (manifest->shards < 1 || manifest->processes < 1 || manifest->shards > manifest->processes)
    throw RuntimeError((dir / file_names::manifest).string() + " says " + std::to_string(manifest->processes) +
                       " processes and " + std::to_string(manifest->shards) + " shards");
  if (manifest->pp < 1 || manifest->processes % manifest->pp != 0)
    throw RuntimeError((dir / file_names::manifest).string() + " says " + std::to_string(manifest->processes) +
                       " processes and pp " + std::to_string(manifest->pp));
  if (manifest->tp < 1 || manifest->processes % manifest->tp != 0)
    throw RuntimeError((dir / file_names::manifest).string() + " says " + std::to_string(manifest->processes) +
                       " processes and tp " + std::to_string(manifest->tp));
  return {static_cast<int>(manifest->processes), manifest->shards, *manifest};
}

// Recovers a half-done save of dir; then whether dir is a checkpoint
// Python's dcp.save wrote (checkpoint/from_python.hpp), as process 0 sees
// it.
inline bool recover_or_find_python(const CheckpointContext& ctx, const std::filesystem::path& dir) {
  int64_t python = 0;
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      recover_checkpoint(dir);
      python = written_outside_accel(dir);
    });
  fail_together(error, "accel::Accelerator::load_state");
  if (!std::filesystem::is_directory(dir))
    throw InvalidArgument("accel::Accelerator::load_state: no checkpoint directory " + dir.string());
  return accel::broadcast(python, 0) != 0;
}

// Under a pipeline, every stage's parameters and buffers (their whole
// shapes), gathered over the pipeline group before the read step (which
// makes no collective): what the piece files must hold. None without a
// pipeline.
inline std::optional<std::vector<NamedTensor>> every_stage_tensors(const PreparedSet& set) {
  if (!set.pipeline_group) return std::nullopt;
  std::vector<NamedTensor> mine;
  for (const auto& m : set.models)
    for (auto& entry : whole_entries(*m.module, m.split)) mine.push_back(std::move(entry));
  auto every = every_stage_entries(set.pipeline_group)(mine);
  if (!every) throw LogicError("accel::Accelerator::load_state: no stage's tensors from a pipeline rank");
  return every;
}

// 1. Every item reads and checks its files against the prepared set;
// nothing changes. Each file is checked against its digest in the
// background; a failed check is the error, before any other (a damaged
// file's parse may fail first). Returns the warnings to give once the load
// is committed.
inline std::vector<std::string> read_checkpoint(const CheckpointItems& items, const PreparedSet& set,
                                                const CheckpointContext& ctx, const std::filesystem::path& dir,
                                                bool python, const std::vector<NamedTensor>* pipeline_model) {
  std::vector<std::string> warnings;
  const std::string error = error_of([&] {
    const SavedLayout saved = python ? outside_layout(ctx) : check_manifest(dir, set);
    CheckpointFiles files(dir, saved.manifest);
    ItemReader reader(ctx, dir, saved, files);
    reader.pipeline_model = pipeline_model;
    try {
      for (const auto& item : items) item->read(reader);
    } catch (...) {
      files.wait();
      throw;
    }
    files.wait();
    warnings = std::move(reader.warnings);
  });
  fail_together(error, "accel::Accelerator::load_state");
  return warnings;
}

// 2. The items that can refuse as they load apply (each first keeps what
// it would put back), and every item is put back on every process if any
// one refuses. 3. Then every item commits. Returns the saved accumulation
// step (0 from Python's checkpoint, which has none).
inline int64_t load_checkpoint(PreparedSet& set, const CheckpointContext& ctx, const std::filesystem::path& dir) {
  const bool python = recover_or_find_python(ctx, dir);
  if (python && set.pipeline_group)
    throw InvalidArgument("accel::Accelerator::load_state: " + dir.string() +
                          " was written by Python's dcp.save; a pipeline's stages load the checkpoints save_state "
                          "writes (load this one without pp, save_state it, and load that)");
  const CheckpointItems items = python ? python_checkpoint_items(set) : checkpoint_items(set, ctx);
  const std::optional<std::vector<NamedTensor>> pipeline_model = every_stage_tensors(set);
  std::vector<std::string> warnings =
      read_checkpoint(items, set, ctx, dir, python, pipeline_model ? &*pipeline_model : nullptr);
  if (python) warnings.push_back(left_by_python_checkpoint(set, dir));
  const std::string error = error_of([&] {
    for (const auto& item : items) item->keep();
    for (const auto& item : items) item->apply();
  });
  try {
    fail_together(error, "accel::Accelerator::load_state");
  } catch (...) {
    for (const auto& item : items) item->roll_back();
    throw;
  }
  for (const auto& item : items) item->commit();
  if (ctx.process_index == 0)
    for (const auto& warning : warnings) TORCH_WARN(warning);
  return python ? 0 : random_states_of(items).step();
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
