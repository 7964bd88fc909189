// accel/training/checkpoint/write.hpp: save_state's work: every process's files, then process 0's, then the manifest, installed at once.
//
// Every process writes its RNG states and, under sharding, its pieces of
// the models and its optimizer state; process 0 writes what is whole (the
// models not sharded, the optimizers unless sharded, the loaders' places,
// the schedulers, the registered objects, the loss scaler) and, last, the
// manifest listing every file with its digest (checkpoint/files.hpp). All
// of it goes into DIR.tmp, installed as DIR at once.
#pragma once

#include "accel/training/checkpoint/context.hpp"
#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/shards.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
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

// The manifest's counts for this run (its serial, id and files come later).
inline CheckpointManifest manifest_for(const PreparedSet& set, const CheckpointContext& ctx) {
  return {.serial = 0,
          .processes = ctx.num_processes,
          .models = static_cast<int64_t>(set.models.size()),
          .optimizers = static_cast<int64_t>(set.optimizers.size()),
          .loaders = static_cast<int64_t>(set.loaders.size()),
          .objects = static_cast<int64_t>(set.objects.size()),
          .schedulers = static_cast<int64_t>(set.schedulers.size()),
          .shards = ctx.shards};
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

// Writes the checkpoint into dir (through dir.tmp and an atomic install);
// every process calls it, and an error anywhere is thrown everywhere.
inline void write_checkpoint(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                             const std::filesystem::path& dir) {
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
  fail_on_every_process(error_of([&] { write_process_files(set, ctx, step, tmp, manifest.id, log); }));
  add_every_process_files(log, manifest);
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
}  // namespace detail

ACCEL_NAMESPACE_END
