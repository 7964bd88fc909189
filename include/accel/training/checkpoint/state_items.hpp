// accel/training/checkpoint/state_items.hpp: the training state in a checkpoint, an item each: optimizers, schedulers, registered objects, the loaders' places, the loss scaler, this process's RNG states.
#pragma once

#include "accel/training/checkpoint/item.hpp"
#include "accel/training/checkpoint/optimizer_from_pieces.hpp"
#include "accel/training/checkpoint/world.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Prepared optimizer i: written whole by process 0, or under sharding or
// tensor parallelism each process its own state; read as saved where this
// run shards it the same way (or keeps it whole), else cut again from the
// saved pieces, piece k in process k's file; across tensor-parallel
// layouts from the state the piece files place in the whole tensors
// (checkpoint/reshard.hpp), and across pipeline layouts from those alone,
// by name (checkpoint/optimizer_from_pieces.hpp). It can refuse as it loads, and is put back if
// any process refuses anything.
class OptimizerItem final : public CheckpointItem {
 public:
  OptimizerItem(PreparedSet& set, const CheckpointContext& ctx, std::size_t i)
      : set_(set), optimizer_(*set.optimizers[i]), i_(i), name_(optimizer_file(set, ctx, i)) {}

  void write_own(const ItemWriter& out) override {
    if (optimizers_per_process(set_, out.ctx)) save(out);
  }
  void write_shared(const ItemWriter& out) override {
    if (!optimizers_per_process(set_, out.ctx)) save(out);
  }
  void read(ItemReader& in) override {
    const SavedLayout& saved = in.saved;
    file_ = (in.dir / name_).string();
    const bool same_processes = saved.processes == in.ctx.num_processes;
    const bool tp = saved.manifest.tp > 1 || in.ctx.tp > 1;
    const bool pipeline = saved.manifest.pp > 1 || in.ctx.pp > 1;
    const bool as_saved = saved.shards == in.ctx.shards && saved.manifest.tp == in.ctx.tp &&
                          saved.manifest.pp == in.ctx.pp && ((saved.shards == 1 && !tp && !pipeline) || same_processes);
    if (as_saved) {
      archive_ = in.read(name_);
      // (under a pipeline, if this process has the saving process's stages: another schedule may give it others)
      if (!pipeline || steps_these_parameters(*archive_, set_, optimizer_)) return;
    }
    const bool per_process = saved.shards > 1 || saved.manifest.tp > 1 || saved.manifest.pp > 1;  // (its files)
    if (pipeline) {  // (the saving processes' parameter lists are not this process's: by name, from the pieces)
      const std::string first = file_names::optimizer(i_, per_process ? 0 : -1);
      archive_ =
          optimizer_from_pieces(set_, i_, in.pieces_if_any(),
                                OpenedArchive{(in.dir / first).string(), std::move(*in.read(first))}, in.ctx.device);
      return;
    }
    const PlacedState placed{tp ? in.pieces_if_any() : nullptr, i_};
    archive_ = resharded_optimizer(
        set_, i_, tp ? 1 : saved.shards, in.ctx.device,
        [&](int64_t k) {
          const std::string name = file_names::optimizer(i_, per_process ? static_cast<int>(k) : -1);
          return OpenedArchive{(in.dir / name).string(), std::move(*in.read(name))};
        },
        tp ? &placed : nullptr);
  }
  void keep() override { snapshot_ = optimizer_snapshot(optimizer_); }
  void apply() override {
    apply_or_name_file(file_, "optimizer", [&] {
      optimizer_.load(*archive_);
      load_group_options(optimizer_, *archive_);
    });
  }
  void roll_back() override {
    if (snapshot_) restore_optimizer(optimizer_, *snapshot_);
  }

 private:
  void save(const ItemWriter& out) {
    torch::serialize::OutputArchive archive;
    optimizer_.save(archive);
    if (out.ctx.pp > 1) archive.write(kParameterNamesKey, c10::IValue(parameter_names_text(set_, optimizer_)));
    out.save(archive, name_);
  }

  PreparedSet& set_;
  torch::optim::Optimizer& optimizer_;
  std::size_t i_;
  std::string name_, file_;  // the file's name, and its path once read
  std::unique_ptr<torch::serialize::InputArchive> archive_;
  std::optional<std::string> snapshot_;  // what it had before the load
};

// Prepared scheduler i: its step count, and its own state where it has a
// save() of its own. A scheduler with a load() of its own checks what it
// loads as it loads it; the others replay their missing steps, which sets
// the optimizers' learning rates the way the saved run did (the
// optimizers' own state comes after). Neither can be put back.
class SchedulerItem final : public CheckpointItem {
 public:
  SchedulerItem(PreparedScheduler& scheduler, std::size_t i) : scheduler_(scheduler), name_(file_names::scheduler(i)) {}

  void write_shared(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    archive.write("steps", at::scalar_tensor(*scheduler_.steps, at::kLong));
    if (scheduler_.save) {
      torch::serialize::OutputArchive own;
      scheduler_.save(own);
      archive.write("own", own);
    }
    out.save(archive, name_);
  }
  void read(ItemReader& in) override {
    archive_ = in.read(name_);
    file_ = (in.dir / name_).string();
    steps_ = ItemReader::tensor(*archive_, "steps", at::kLong, {}, file_).item<int64_t>();
    torch::serialize::InputArchive own;
    if (scheduler_.load && !archive_->try_read("own", own))
      throw RuntimeError(file_ + " has no state of the scheduler's own save()");
    if (!scheduler_.load && steps_ < *scheduler_.steps)
      throw RuntimeError(file_ + ": the scheduler took " + std::to_string(steps_) +
                         " steps; this one has already taken " + std::to_string(*scheduler_.steps) +
                         " (load the checkpoint before stepping it)");
  }
  void apply() override {
    apply_or_name_file(file_, "scheduler", [&] {
      if (scheduler_.load) {
        torch::serialize::InputArchive own;
        archive_->read("own", own);
        scheduler_.load(own);
      } else {
        for (int64_t k = *scheduler_.steps; k < steps_; ++k) scheduler_.step();
      }
      *scheduler_.steps = steps_;
    });
  }

 private:
  PreparedScheduler& scheduler_;
  std::string name_, file_;
  std::unique_ptr<torch::serialize::InputArchive> archive_;
  int64_t steps_ = 0;
};

// Registered object i (register_for_checkpointing): its own save and load,
// which checks what it loads as it loads it.
class ObjectItem final : public CheckpointItem {
 public:
  ObjectItem(CheckpointedObject& object, std::size_t i) : object_(object), name_(file_names::custom_object(i)) {}

  void write_shared(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    object_.save(archive);
    out.save(archive, name_);
  }
  void read(ItemReader& in) override {
    archive_ = in.read(name_);
    file_ = (in.dir / name_).string();
  }
  void apply() override {
    apply_or_name_file(file_, "registered object", [&] { object_.load(*archive_); });
  }

 private:
  CheckpointedObject& object_;
  std::string name_, file_;
  std::unique_ptr<torch::serialize::InputArchive> archive_;
};

// Every prepared loader's resume point (epoch, batches to skip) and samples
// per batch, one file for all; read back converted to this run's batches
// (checkpoint/world.hpp).
class LoadersItem final : public CheckpointItem {
 public:
  explicit LoadersItem(std::vector<std::shared_ptr<LoaderPosition>>& loaders) : loaders_(loaders) {}

  void write_shared(const ItemWriter& out) override {
    if (loaders_.empty()) return;
    std::vector<int64_t> points, per_batch;
    for (const auto& loader : loaders_) {
      const auto [epoch, skip] = loader->resume_point();
      points.insert(points.end(), {static_cast<int64_t>(epoch), static_cast<int64_t>(skip)});
      per_batch.push_back(static_cast<int64_t>(loader->samples_per_batch));
    }
    torch::serialize::OutputArchive archive;
    archive.write("resume_points", at::tensor(points).reshape({static_cast<int64_t>(loaders_.size()), 2}));
    archive.write("samples_per_batch", at::tensor(per_batch));  // (0: not known) by which a place carries over
    out.save(archive, file_names::loaders);
  }
  void read(ItemReader& in) override;
  void commit() override {
    for (std::size_t i = 0; i < loaders_.size(); ++i) {
      const auto row = static_cast<int64_t>(i);  // (the place in this run's batches: read converted it)
      loaders_[i]->resume_at(static_cast<size_t>(points_[row][0].item<int64_t>()),
                             static_cast<size_t>(points_[row][1].item<int64_t>()));
    }
  }

 private:
  std::vector<std::shared_ptr<LoaderPosition>>& loaders_;
  at::Tensor points_;
};

inline void LoadersItem::read(ItemReader& in) {
  if (loaders_.empty()) return;
  const std::string file = (in.dir / file_names::loaders).string();
  auto archive = in.read(file_names::loaders);
  const auto n = static_cast<int64_t>(loaders_.size());
  points_ = ItemReader::tensor(*archive, "resume_points", at::kLong, {n, 2}, file);
  at::Tensor saved_per_batch;
  const bool same_processes = in.saved.processes == in.ctx.num_processes;
  if (archive->try_read("samples_per_batch", saved_per_batch))
    saved_per_batch = ItemReader::tensor(*archive, "samples_per_batch", at::kLong, {n}, file);
  else if (!same_processes)
    throw RuntimeError(file +
                       " does not say how many samples its loaders read per batch (an older accel.hpp saved it): "
                       "load it with as many processes as saved it (" +
                       std::to_string(in.saved.processes) + ")");
  for (int64_t i = 0; saved_per_batch.defined() && i < n; ++i) {
    ResumedBatches resumed = resumed_batches(
        static_cast<std::size_t>(i), static_cast<size_t>(points_[i][1].item<int64_t>()),
        saved_per_batch[i].item<int64_t>(), loaders_[static_cast<std::size_t>(i)]->samples_per_batch, same_processes);
    points_[i][1].fill_(static_cast<int64_t>(resumed.batches));
    if (!resumed.warning.empty()) in.warnings.push_back(std::move(resumed.warning));
  }
}

// mixed_precision "fp16"'s loss scaler: the scale and growth tracker, the
// same on every process (each step's overflow check is agreed).
class ScalerItem final : public CheckpointItem {
 public:
  explicit ScalerItem(std::shared_ptr<GradScaler> scaler) : scaler_(std::move(scaler)) {}

  void write_shared(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    archive.write("scale", at::scalar_tensor(scaler_->get_scale(), at::kDouble));
    archive.write("growth_tracker", at::scalar_tensor(scaler_->growth_tracker(), at::kLong));
    out.save(archive, file_names::scaler);
  }
  void read(ItemReader& in) override {
    const std::string file = (in.dir / file_names::scaler).string();
    if (!std::filesystem::exists(in.dir / file_names::scaler))
      throw RuntimeError("missing " + file + " (this run has fp16's loss scaler; the saving run had none)");
    auto archive = in.read(file_names::scaler);
    scale_ = ItemReader::tensor(*archive, "scale", at::kDouble, {}, file).item<double>();
    growth_tracker_ = ItemReader::tensor(*archive, "growth_tracker", at::kLong, {}, file).item<int64_t>();
  }
  void commit() override { scaler_->load_state(scale_, growth_tracker_); }

 private:
  std::shared_ptr<GradScaler> scaler_;
  double scale_ = 0;
  int64_t growth_tracker_ = 0;
};

// This process's RNG states and the accumulation step (Accelerate's
// random_states_<i>), or where the saving run had fewer processes, one to
// seed a stream of its own from (checkpoint/world.hpp).
class RandomStatesItem final : public CheckpointItem {
 public:
  explicit RandomStatesItem(int64_t step) : step_(step) {}
  // The accumulation step: the one saved, once read.
  int64_t step() const { return step_; }

  void write_own(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    archive.write("cpu", at::detail::getDefaultCPUGenerator().get_state());
    if (out.ctx.device.is_cuda())
      archive.write("cuda", at::globalContext().defaultGenerator(out.ctx.device).get_state());
    archive.write("step", at::scalar_tensor(step_, at::kLong));
    out.save(archive, file_names::random_states(out.ctx.process_index));
  }
  void read(ItemReader& in) override;
  void commit() override;

 private:
  int64_t step_;
  c10::Device device_{c10::kCPU};
  int process_index_ = 0;
  at::Tensor rng_, device_rng_;  // device_rng_: the CUDA generator's, where both runs had one
  bool derived_ = false;         // the saving run had no process of this index: seed from rng_
};

inline void RandomStatesItem::read(ItemReader& in) {
  device_ = in.ctx.device;
  process_index_ = in.ctx.process_index;
  const int saved_process = saved_process_for(process_index_, in.saved.processes);
  derived_ = saved_process != process_index_;
  const std::string name = file_names::random_states(saved_process), file = (in.dir / name).string();
  if (!std::filesystem::exists(in.dir / name)) throw RuntimeError("missing " + file);
  auto archive = in.read(name);
  const at::Tensor current = at::detail::getDefaultCPUGenerator().get_state();
  rng_ = ItemReader::tensor(*archive, "cpu", current.scalar_type(), current.sizes(), file);
  step_ = ItemReader::tensor(*archive, "step", at::kLong, {}, file).item<int64_t>();
  at::Tensor saved_device_rng;
  if (device_.is_cuda() && archive->try_read("cuda", saved_device_rng)) {
    const at::Tensor now = at::globalContext().defaultGenerator(device_).get_state();
    device_rng_ = ItemReader::tensor(*archive, "cuda", now.scalar_type(), now.sizes(), file);
  }
}

// A generator's state is a CPU byte tensor, the CUDA generator's too; the
// archives were read onto the training device, so it comes back first.
inline void RandomStatesItem::commit() {
  auto set_state = [](at::Generator generator, const at::Tensor& state) {
    std::lock_guard lock(generator.mutex());
    generator.set_state(state.cpu());
  };
  if (!derived_) {
    set_state(at::detail::getDefaultCPUGenerator(), rng_);
    if (device_rng_.defined()) set_state(at::globalContext().defaultGenerator(device_), device_rng_);
    return;
  }
  const uint64_t seed = derived_seed(rng_, process_index_);
  auto reseed = [seed](at::Generator generator) {
    std::lock_guard lock(generator.mutex());
    generator.set_current_seed(seed);
  };
  reseed(at::detail::getDefaultCPUGenerator());
  if (device_.is_cuda()) reseed(at::globalContext().defaultGenerator(device_));
}
}  // namespace detail

ACCEL_NAMESPACE_END
