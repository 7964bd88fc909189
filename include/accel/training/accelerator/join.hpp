// accel/training/accelerator/join.hpp: Join: training on uneven inputs, as DDP's Join (Accelerator::join_uneven_inputs), and the block's even_batches.
//
// A rank whose loop ends first stands in for the others' gradient
// all-reduces (with zeros: gradients are still divided by the whole group)
// until every rank's loop has ended; then every rank takes the weights of a
// rank that ran the most steps (DDP's final model sync). Every backward
// inside the loop first sends one small all_reduce, matched on the joined
// ranks, that says which models to shadow.
#pragma once

#include "accel/training/checkpoint/prepared.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
class Join {
 public:
  // models: the prepared models joined ranks stand in for (at least one).
  explicit Join(std::vector<PreparedModel*> models)
      : models_(std::move(models)), group_(models_.front()->data_parallel->group()) {}

  // The group the models average over; null when not distributed.
  const GroupPtr& group() const { return group_; }
  bool includes(const PreparedModel* m) const { return std::find(models_.begin(), models_.end(), m) != models_.end(); }
  // On a rank still training, before its backward.
  void before_backward() { signal(1); }
  // This rank's loop has ended: shadows the others' backwards until every
  // loop has ended, then takes the weights of a rank that ran the most steps.
  void finish() {
    for (;;) {
      const std::vector<int64_t> counts = signal(0);
      if (counts[0] == 0) break;  // every rank has joined
      for (std::size_t i = 0; i < models_.size(); ++i)
        if (counts[i + 1] > 0) models_[i]->data_parallel->shadow_backward();
    }
    const std::vector<int64_t> steps = all_gather(steps_, group_);
    const int src = static_cast<int>(std::max_element(steps.begin(), steps.end()) - steps.begin());
    for (PreparedModel* m : models_) m->data_parallel->sync_module_states(src);
  }

 private:
  // The all_reduce of [ranks still training, then per model the ranks
  // syncing it].
  std::vector<int64_t> signal(int64_t active) {
    std::vector<int64_t> out{active};
    for (const PreparedModel* m : models_) out.push_back(active && m->data_parallel->requires_gradient_sync() ? 1 : 0);
    steps_ += active;
    return all_reduce(std::move(out), ReduceOp::SUM, group_);
  }

  std::vector<PreparedModel*> models_;
  GroupPtr group_;
  int64_t steps_ = 0;  // backwards this rank ran
};

// Runs body (the training loop) joined: `current` holds the Join while body
// runs (the Accelerator's backward reads it), and every rank finishes it
// after body, also when it ran out of batches first. Not distributed: body
// alone.
template <class Body>
void run_joined(std::optional<Join>& current, Join join, Body&& body) {
  if (!join.group()) return static_cast<void>(std::invoke(body));
  current.emplace(std::move(join));
  try {
    std::invoke(body);
    current->finish();
  } catch (...) {
    current.reset();
    throw;
  }
  current.reset();
}

// RAII: every prepared loader's even_batches set for the passes that start
// while it lives (join_uneven_inputs' even_batches), then put back.
class EvenBatchesOverride {
 public:
  EvenBatchesOverride(const std::vector<std::shared_ptr<LoaderPosition>>& loaders, bool even_batches) {
    for (const auto& loader : loaders) saved_.emplace_back(loader, std::exchange(loader->even_batches, even_batches));
  }
  EvenBatchesOverride(const EvenBatchesOverride&) = delete;
  EvenBatchesOverride& operator=(const EvenBatchesOverride&) = delete;
  ~EvenBatchesOverride() {
    for (auto& [loader, value] : saved_) loader->even_batches = value;
  }

 private:
  std::vector<std::pair<std::shared_ptr<LoaderPosition>, std::optional<bool>>> saved_;
};
}  // namespace detail

ACCEL_NAMESPACE_END
