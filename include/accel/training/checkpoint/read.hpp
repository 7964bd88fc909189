// accel/training/checkpoint/read.hpp: load_state's first step: every file of a checkpoint read and checked against this run, nothing changed.
//
// read_checkpoint recovers a half-done save, checks the manifest against
// what this run prepared, reads every file (each checked against its
// digest) and every value it will load, and returns them as a
// LoadedCheckpoint; an error on any process is thrown on every process,
// naming the file. checkpoint/state.hpp then applies and commits it.
#pragma once

#include "accel/training/checkpoint/context.hpp"
#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/reshard.hpp"
#include "accel/training/checkpoint/sharded_weights.hpp"
#include "accel/training/checkpoint/world.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
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

// Reads one checkpoint's files for read_checkpoint: each file checked
// against its digest (by `files`, in the background: files.wait() says),
// and each value checked against this run, into `loaded`. One method per
// artifact; each throws an error naming the file.
class CheckpointReader {
 public:
  CheckpointReader(const PreparedSet& set, const CheckpointContext& ctx, const std::filesystem::path& dir,
                   const SavedLayout& saved, CheckpointFiles& files, LoadedCheckpoint& loaded)
      : set_(set), ctx_(ctx), dir_(dir), saved_(saved), files_(files), loaded_(loaded) {}

  // Each model whole (model_<i>.pt), or this process's part of its pieces (checkpoint/shards.hpp).
  void models() {
    namespace fs = std::filesystem;
    loaded_.models.resize(set_.models.size());
    loaded_.pieces.resize(set_.models.size());
    std::optional<ShardedWeights> pieces;  // (read once, where a model was saved in pieces)
    for (std::size_t i = 0; i < set_.models.size(); ++i) {
      const fs::path whole = dir_ / file_names::model(i);
      if (fs::exists(whole)) {
        loaded_.models[i] = read(file_names::model(i));
        check_module_archive(*set_.models[i].module, *loaded_.models[i], "", whole.string());
        continue;
      }
      if (!pieces) {
        const auto found = fs::directory_iterator(dir_);
        if (std::none_of(fs::begin(found), fs::end(found),
                         [](const auto& entry) { return entry.path().extension() == ".safetensors"; }))
          throw RuntimeError("missing " + whole.string() +
                             " (and no sharded model's pieces, *.safetensors, beside it)");
        pieces.emplace(dir_, files_);
      }
      loaded_.pieces[i] =
          read_model_pieces(*set_.models[i].module, set_.models[i].data_parallel.get(), *pieces, model_prefix(i));
    }
  }
  // Each optimizer's state as saved where this run shards it the same way
  // (or keeps it whole), else cut again from the saved pieces
  // (checkpoint/reshard.hpp); piece k is in the file of process k.
  void optimizers() {
    const bool as_saved =
        saved_.shards == ctx_.shards && (saved_.shards == 1 || saved_.processes == ctx_.num_processes);
    for (std::size_t i = 0; i < set_.optimizers.size(); ++i)
      loaded_.optimizers.push_back(as_saved ? read(optimizer_file(set_, ctx_, i))
                                            : resharded_optimizer(set_, i, saved_.shards, ctx_.device, [&](int64_t k) {
                                                const std::string name = file_names::optimizer(
                                                    i, saved_.shards == 1 ? -1 : static_cast<int>(k));
                                                return OpenedArchive{(dir_ / name).string(), std::move(*read(name))};
                                              }));
  }
  void objects() {
    for (std::size_t i = 0; i < set_.objects.size(); ++i) loaded_.objects.push_back(read(file_names::custom_object(i)));
  }
  // Each scheduler's step count, and its own state where it has a save() of its own.
  void schedulers() {
    for (std::size_t i = 0; i < set_.schedulers.size(); ++i) {
      loaded_.schedulers.push_back(read(file_names::scheduler(i)));
      const std::string file = (dir_ / file_names::scheduler(i)).string();
      const int64_t steps = tensor(*loaded_.schedulers[i], "steps", at::kLong, {}, file).item<int64_t>();
      loaded_.scheduler_steps.push_back(steps);
      torch::serialize::InputArchive own;
      if (set_.schedulers[i].load && !loaded_.schedulers[i]->try_read("own", own))
        throw RuntimeError(file + " has no state of the scheduler's own save()");
      if (!set_.schedulers[i].load && steps < *set_.schedulers[i].steps)
        throw RuntimeError(file + ": the scheduler took " + std::to_string(steps) +
                           " steps; this one has already taken " + std::to_string(*set_.schedulers[i].steps) +
                           " (load the checkpoint before stepping it)");
    }
  }
  // The loaders' places, each converted to this run's batches (checkpoint/world.hpp).
  void loaders() {
    if (set_.loaders.empty()) return;
    const std::string file = (dir_ / file_names::loaders).string();
    auto archive = read(file_names::loaders);
    const auto n = static_cast<int64_t>(set_.loaders.size());
    at::Tensor& points = loaded_.points;
    points = tensor(*archive, "resume_points", at::kLong, {n, 2}, file);
    at::Tensor saved_per_batch;
    if (archive->try_read("samples_per_batch", saved_per_batch))
      saved_per_batch = tensor(*archive, "samples_per_batch", at::kLong, {n}, file);
    else if (saved_.processes != ctx_.num_processes)
      throw RuntimeError(file +
                         " does not say how many samples its loaders read per batch (an older accel.hpp saved it): "
                         "load it with as many processes as saved it (" +
                         std::to_string(saved_.processes) + ")");
    for (int64_t i = 0; saved_per_batch.defined() && i < n; ++i) {
      ResumedBatches resumed = resumed_batches(
          static_cast<std::size_t>(i), static_cast<size_t>(points[i][1].item<int64_t>()),
          saved_per_batch[i].item<int64_t>(), set_.loaders[static_cast<std::size_t>(i)]->samples_per_batch,
          saved_.processes == ctx_.num_processes);
      points[i][1].fill_(static_cast<int64_t>(resumed.batches));
      if (!resumed.warning.empty()) loaded_.warnings.push_back(std::move(resumed.warning));
    }
  }
  void scaler() {
    if (!set_.scaler) return;
    const std::string file = (dir_ / file_names::scaler).string();
    if (!std::filesystem::exists(dir_ / file_names::scaler))
      throw RuntimeError("missing " + file + " (this run has fp16's loss scaler; the saving run had none)");
    auto archive = read(file_names::scaler);
    loaded_.scaler = {tensor(*archive, "scale", at::kDouble, {}, file).item<double>(),
                      tensor(*archive, "growth_tracker", at::kLong, {}, file).item<int64_t>()};
  }
  // This process's RNG states and step, or where the saving run had fewer
  // processes, one to seed from (checkpoint/world.hpp).
  void random_states() {
    const int saved_process = saved_process_for(ctx_.process_index, saved_.processes);
    loaded_.derived_rng = saved_process != ctx_.process_index;
    const std::string name = file_names::random_states(saved_process), file = (dir_ / name).string();
    if (!std::filesystem::exists(dir_ / name)) throw RuntimeError("missing " + file);
    auto archive = read(name);
    const at::Tensor current = at::detail::getDefaultCPUGenerator().get_state();
    loaded_.rng = tensor(*archive, "cpu", current.scalar_type(), current.sizes(), file);
    loaded_.step = tensor(*archive, "step", at::kLong, {}, file).item<int64_t>();
    at::Tensor saved_device_rng;
    if (ctx_.device.is_cuda() && archive->try_read("cuda", saved_device_rng)) {
      const at::Tensor now = at::globalContext().defaultGenerator(ctx_.device).get_state();
      loaded_.device_rng = tensor(*archive, "cuda", now.scalar_type(), now.sizes(), file);
    }
  }

 private:
  // The archive `name`, checked against the manifest's record.
  std::unique_ptr<torch::serialize::InputArchive> read(const std::string& name) {
    const std::filesystem::path file = files_.check(name);
    auto archive = std::make_unique<torch::serialize::InputArchive>();
    try {
      archive->load_from(file.string(), ctx_.device);
    } catch (const std::exception& e) {
      throw RuntimeError("cannot read " + file.string() + ": " + error_text(e));
    }
    return archive;
  }
  // A tensor of the given dtype and shape under `key`, or an error naming the file.
  static at::Tensor tensor(torch::serialize::InputArchive& archive, const char* key, at::ScalarType dtype,
                           at::IntArrayRef sizes, const std::string& file) {
    at::Tensor value;
    if (!archive.try_read(key, value) || value.scalar_type() != dtype || value.sizes() != sizes)
      throw RuntimeError(file + " has no " + key + " of " + c10::toString(dtype) + c10::str(sizes));
    return value;
  }

  const PreparedSet& set_;
  const CheckpointContext& ctx_;
  const std::filesystem::path& dir_;
  const SavedLayout& saved_;
  CheckpointFiles& files_;
  LoadedCheckpoint& loaded_;
};

// 1. Recovers a half-done save of dir, then reads and checks every file
// against the prepared set; nothing changes. An error on any process is
// thrown on every process, naming the file.
inline LoadedCheckpoint read_checkpoint(const PreparedSet& set, const CheckpointContext& ctx,
                                        const std::filesystem::path& dir) {
  {
    std::string error;
    if (ctx.process_index == 0) error = error_of([&] { recover_checkpoint(dir); });
    fail_together(error, "accel::Accelerator::load_state");
  }
  if (!std::filesystem::is_directory(dir))
    throw InvalidArgument("accel::Accelerator::load_state: no checkpoint directory " + dir.string());
  LoadedCheckpoint loaded;
  const std::string error = error_of([&] {
    const SavedLayout saved = check_manifest(dir, set);
    CheckpointFiles files(dir, saved.manifest);  // (each file checked against its digest: files.wait() below)
    CheckpointReader reader(set, ctx, dir, saved, files, loaded);
    // Everything read, then every file's check awaited; a failed check is
    // the error, before any other (a damaged file's parse may fail first).
    try {
      reader.models();
      reader.optimizers();
      reader.objects();
      reader.schedulers();
      reader.loaders();
      reader.scaler();
      reader.random_states();
    } catch (...) {
      files.wait();
      throw;
    }
    files.wait();
  });
  fail_together(error, "accel::Accelerator::load_state");
  return loaded;
}
}  // namespace detail

ACCEL_NAMESPACE_END
