// accel/training/checkpoint/model_items.hpp: the models in a checkpoint: each model whole (model_<i>.pt), or the sharded models' pieces every process writes.
#pragma once

#include "accel/training/checkpoint/item.hpp"
#include "accel/training/checkpoint/shards.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Prepared model i. Written whole by process 0 unless it is saved in
// pieces (ShardedPiecesItem writes those); read back from whichever the
// checkpoint holds, so that a model saved sharded loads unsharded and the
// other way round (checkpoint/sharded_weights.hpp).
class ModelItem final : public CheckpointItem {
 public:
  ModelItem(PreparedSet& set, std::size_t i)
      : model_(set.models[i]), i_(i), in_pieces_(saved_in_pieces(set, i)), prefix_(saved_model_prefix(set, i)) {}

  void write_shared(const ItemWriter& out) override {
    if (in_pieces_) return;
    torch::serialize::OutputArchive archive;
    model_.module->save(archive);
    out.save(archive, file_names::model(i_));
  }
  void read(ItemReader& in) override {
    const std::filesystem::path whole = in.dir / file_names::model(i_);
    if (std::filesystem::exists(whole)) {
      if (in.pipeline_model)
        throw RuntimeError(whole.string() +
                           " holds the model whole (saved without a pipeline, sharding or tp): a pipeline's stages "
                           "load a checkpoint saved in pieces. Load it without pp and save_model it, then load_model "
                           "the stages from that");
      archive_ = in.read(file_names::model(i_));
      check_module_archive(*model_.module, *archive_, "", whole.string());
    } else {
      pieces_ = read_model_pieces(*model_.module, model_.data_parallel.get(), model_.split, in.pieces(whole.string()),
                                  prefix_, in.pipeline_model);
    }
  }
  void commit() override {
    DataParallel* dp = model_.data_parallel.get();
    if (!archive_) return commit_model_pieces(*model_.module, dp, pieces_);
    const bool sharded = dp && dp->sharded();
    if (sharded) dp->sharded_state_dict().open_for_load();
    model_.module->load(*archive_);
    if (sharded) dp->sharded_state_dict().reshard();
  }

 private:
  PreparedModel& model_;
  std::size_t i_;
  bool in_pieces_;
  std::string prefix_;                                       // of its names in the piece files
  std::unique_ptr<torch::serialize::InputArchive> archive_;  // read whole,
  std::map<std::string, at::Tensor> pieces_;                 // else what this process keeps of each piece
};

// The pieces of the models saved in pieces (sharded, or holding
// tensor-parallel pieces) and their optimizers' state, as Python's DCP
// reads them (checkpoint/shards.hpp): every process writes its own. C++
// reads them back through ModelItem (the models) and OptimizerItem (its
// own archives, which hold the optimizer state too).
class ShardedPiecesItem final : public CheckpointItem {
 public:
  explicit ShardedPiecesItem(PreparedSet& set) : set_(set) {}
  void write_own(const ItemWriter& out) override {
    for (std::size_t i = 0; i < set_.models.size(); ++i)
      if (saved_in_pieces(set_, i)) return write_pieces(set_, out.ctx, out.dir, out.id, out.log);
  }

 private:
  PreparedSet& set_;
};
}  // namespace detail

ACCEL_NAMESPACE_END
