// accel/training/data/loader_state.hpp: what a prepared loader is configured with and shares: DataLoaderConfig, its place in its passes, Accelerate's GradientState.
//
// A prepared loader (data/loaders.hpp) reads its DataLoaderConfig; its
// LoaderPosition is shared with the Accelerator, whose checkpoints save and
// restore it; and the GradientState is shared by the Accelerator and every
// prepared optimizer, scheduler and loader, so that each knows whether this
// step syncs and which pass is under way.
#pragma once

#include "accel/training/data/sampler.hpp"

ACCEL_NAMESPACE_BEGIN

struct DataLoaderConfig {
  size_t batch_size = 1;  // per process, or global with AcceleratorConfig::split_batches
  bool shuffle = false;
  uint64_t seed = 0;         // shuffled order: randperm under seed + epoch
  bool even_batches = true;  // complete the last round from the start, so every process gets as many batches
  bool drop_last = false;    // drop the incomplete last batch (and, BATCHES, an incomplete last round)
  size_t workers = 0;        // LibTorch's loader threads
  ShardLayout layout = ShardLayout::BATCHES;
  BatchSamplerFn batch_sampler{};  // a custom one-process batch sequence (BATCHES)
  // The size of the custom batch sampler's batches, where it has one (see
  // ShardSampler::Options); split_batches needs it unless dispatching.
  std::optional<size_t> batch_sampler_batch_size{};
  // The main process reads every global batch and sends each process its
  // rows (accel/training/data/dispatch.hpp); unset: on for iterable datasets only,
  // as Accelerate. even_batches does not apply (every process gets rows of
  // every global batch).
  std::optional<bool> dispatch_batches{};
};

namespace detail {
// Where a prepared loader's pass stands.
struct LoaderState {
  const void* loader = nullptr;       // the loader whose pass this is (Accelerator::active_dataloader)
  std::optional<size_t> real_rows{};  // real samples of the current batch
  bool end_of_dataloader = false;     // the current batch is the pass's last
};
// Where a prepared loader is in its passes, shared with the Accelerator for
// save_state / load_state: the epoch the next pass uses, the pass under way
// and how many of its batches were handed out, and how many batches the
// next pass skips (load_state, skip_first_batches); and the even_batches
// that join_uneven_inputs sets for its block.
struct LoaderPosition {
  size_t next_epoch = 0, epoch = 0, handed_out = 0, skip = 0;
  bool in_pass = false;
  // Samples per batch over all the data-parallel processes (0: not known),
  // by which a checkpoint's place carries over to another number of
  // processes or batch size (checkpoint/world.hpp).
  size_t samples_per_batch = 0;
  std::optional<bool> even_batches{};
  // The point a resumed run starts from: (epoch, batches to skip). Between
  // passes, the next one and the batches it is to skip (a place that
  // load_state or skip_first_batches set, kept by a save before the pass).
  std::pair<size_t, size_t> resume_point() const {
    return in_pass ? std::pair{epoch, handed_out} : std::pair{next_epoch, skip};
  }
  // The next pass resumes from there (load_state, load_state_dict).
  void resume_at(size_t resume_epoch, size_t batches) {
    next_epoch = resume_epoch;
    skip = batches;
    in_pass = false;
  }
  // A prepared loader's state_dict: {"epoch": the pass to resume,
  // "batches_handed_out": how many of its batches were handed out}, inside
  // a pass that pass and its batches so far, after it the next pass and the
  // batches it is to skip (what save_state keeps). A c10::Dict, so that torch::pickle_save or an
  // OutputArchive (as a c10::IValue) stores it.
  c10::Dict<std::string, int64_t> state_dict() const {
    const auto [resume_epoch, batches] = resume_point();
    c10::Dict<std::string, int64_t> out;
    out.insert("epoch", static_cast<int64_t>(resume_epoch));
    out.insert("batches_handed_out", static_cast<int64_t>(batches));
    return out;
  }
  // The next pass resumes where state_dict() was taken (the loader's own or
  // another prepared loader's over the same data and processes).
  void load_state_dict(const c10::Dict<std::string, int64_t>& state) {
    auto field = [&](const char* key) {
      const auto found = state.find(key);
      if (found == state.end() || found->value() < 0 || state.size() != 2)
        throw InvalidArgument(
            "accel: a prepared loader's load_state_dict takes what its state_dict() returns: {\"epoch\": n, "
            "\"batches_handed_out\": k}, both at least 0");
      return static_cast<size_t>(found->value());
    };
    resume_at(field("epoch"), field("batches_handed_out"));
  }
  // After each read: a batch was handed out; after the last one (or none)
  // the pass is over, and a resumed run starts with the next epoch.
  template <class Portion>  // a detail::RankBatch
  void count(const std::optional<Portion>& share) {
    if (share) ++handed_out;
    if (!share || share->last) in_pass = false;
  }
  // Starts a pass; returns the batches it skips.
  size_t begin() {
    epoch = next_epoch++;
    in_pass = true;
    handed_out = 0;
    return std::exchange(skip, 0);
  }
};
// What an Accelerator shares with its prepared optimizers, schedulers and
// loaders (Accelerate's GradientState): whether this step syncs gradients,
// and the loaders whose passes are under way, innermost last.
struct GradientState {
  bool sync_gradients = true;
  std::vector<const LoaderState*> active;
  const LoaderState* loader() const { return active.empty() ? nullptr : active.back(); }
  const void* active_dataloader() const { return loader() ? loader()->loader : nullptr; }
  bool end_of_dataloader() const { return loader() && loader()->end_of_dataloader; }
  void remove(const LoaderState* state) { std::erase(active, state); }
};

// A pass over a prepared loader as the GradientState sees it: the innermost
// pass from its start until end() or destruction (a loop left with break).
class Pass {
 public:
  Pass() = default;
  Pass(std::shared_ptr<GradientState> gradient_state, std::shared_ptr<LoaderState> state, const void* loader)
      : gradient_state_(std::move(gradient_state)), state_(std::move(state)) {
    gradient_state_->remove(state_.get());
    gradient_state_->active.push_back(state_.get());
    *state_ = {.loader = loader};
  }
  Pass(Pass&& other) noexcept : gradient_state_(std::move(other.gradient_state_)), state_(std::move(other.state_)) {}
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;
  Pass& operator=(Pass&&) = delete;
  ~Pass() { end(); }

  // The batch being handed out: its real (non-repeated) rows, and whether it is the pass's last.
  void at(size_t real_rows, bool last) const {
    if (!state_) return;
    state_->real_rows = real_rows;
    state_->end_of_dataloader = last;
  }
  void end() const {
    if (!state_) return;
    *state_ = {};
    gradient_state_->remove(state_.get());
    state_.reset();
  }

 private:
  std::shared_ptr<GradientState> gradient_state_;
  mutable std::shared_ptr<LoaderState> state_;
};
}  // namespace detail

ACCEL_NAMESPACE_END
