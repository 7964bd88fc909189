// accel/training/checkpoint/item.hpp: what one artifact of a checkpoint does in each phase of a save and a load, and what each phase hands it.
//
// A checkpoint is a list of items, one per artifact (a model, the sharded
// pieces, each optimizer, scheduler and registered object, the loaders'
// places, the loss scaler, this process's RNG states); the driver
// (checkpoint/state.hpp) runs each phase over the whole list, with the
// collectives between phases, and writes the manifest last. An item does
// its own artifact only, and every phase but write_* is optional:
//
//   write_own     every process: files of its own (RNG states, its pieces)
//   write_shared  process 0: the files of all (whole models, ...)
//   read          read and check what it will load; changes nothing
//   keep          before any item applies: what roll_back puts back
//   apply         load what can refuse as it loads
//   roll_back     some process refused: put back what keep kept
//   commit        load what read checked, and cannot fail
#pragma once

#include "accel/training/checkpoint/context.hpp"
#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/sharded_weights.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What a write phase hands an item: where it writes (the checkpoint's DIR.tmp)
// and the log of files written, which goes into the manifest.
struct ItemWriter {
  const CheckpointContext& ctx;
  const std::filesystem::path& dir;
  const std::string& id;  // the checkpoint's, which every piece file carries
  FileLog& log;

  void save(torch::serialize::OutputArchive& archive, const std::string& name) const {
    log.emplace_back(name, save_archive(archive, dir / name));
  }
};

// The saving run's layout, read off the manifest: the number of processes
// and the ways the optimizer state was sharded may differ from this run's
// (checkpoint/world.hpp, checkpoint/reshard.hpp).
struct SavedLayout {
  int processes = 1;
  int64_t shards = 1;  // ways its optimizer state is sharded (1: whole, in optimizer.pt)
  CheckpointManifest manifest;
};

// What the read phase hands an item: the files (each checked against its
// digest, in the background, by `files`), the saving run's layout, and
// where to leave warnings that are given once the load is committed.
class ItemReader {
 public:
  ItemReader(const CheckpointContext& context, const std::filesystem::path& directory, const SavedLayout& layout,
             CheckpointFiles& files)
      : ctx(context), dir(directory), saved(layout), files_(files) {}

  const CheckpointContext& ctx;
  const std::filesystem::path& dir;
  const SavedLayout& saved;
  std::vector<std::string> warnings;  // (a loader's place, checkpoint_world)
  // Under a pipeline, every stage's parameters and buffers (whole shapes),
  // from every pipeline rank: the model the piece files must hold.
  const std::vector<std::pair<std::string, at::Tensor>>* pipeline_model = nullptr;

  // The archive `name`, checked against the manifest's record.
  std::unique_ptr<torch::serialize::InputArchive> read(const std::string& name) {
    const std::filesystem::path file = files_.check(name);
    auto archive = std::make_unique<torch::serialize::InputArchive>();
    try {
      archive->load_from(file.string(), ctx.device);
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
  // The sharded models' pieces (*.safetensors), indexed once for every model read from them.
  const ShardedWeights& pieces(const std::string& missing_whole) {
    if (const ShardedWeights* found = pieces_if_any()) return *found;
    throw RuntimeError("missing " + missing_whole + " (and no sharded model's pieces, *.safetensors, beside it)");
  }
  // ... or none where the checkpoint has no piece files.
  const ShardedWeights* pieces_if_any() {
    namespace fs = std::filesystem;
    if (!pieces_) {
      const auto found = fs::directory_iterator(dir);
      if (std::none_of(fs::begin(found), fs::end(found),
                       [](const auto& entry) { return entry.path().extension() == ".safetensors"; }))
        return nullptr;
      pieces_.emplace(dir, files_);
    }
    return &*pieces_;
  }

 private:
  CheckpointFiles& files_;
  std::optional<ShardedWeights> pieces_;
};

// One artifact of a checkpoint (the phases at the top of this part).
class CheckpointItem {
 public:
  virtual ~CheckpointItem() = default;
  virtual void write_own(const ItemWriter&) {}
  virtual void write_shared(const ItemWriter&) {}
  virtual void read(ItemReader&) {}
  virtual void keep() {}
  virtual void apply() {}
  virtual void roll_back() {}
  virtual void commit() {}
};
using CheckpointItems = std::vector<std::unique_ptr<CheckpointItem>>;

// An item's apply step: where the artifact itself refuses what was read (a
// file saved from another optimizer, scheduler or object), the error names
// the file and what it was meant for.
template <class Apply>
void apply_or_name_file(const std::string& file, const char* artifact, Apply&& apply) {
  try {
    apply();
  } catch (const std::exception& e) {
    throw RuntimeError(file + " does not fit the " + artifact + ": " + error_text(e));
  }
}
}  // namespace detail

ACCEL_NAMESPACE_END
