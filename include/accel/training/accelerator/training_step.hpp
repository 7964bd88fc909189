// accel/training/accelerator/training_step.hpp: the Accelerator's training step: backward, gradient sync and accumulation, uneven inputs, clipping, the loss scale.
#pragma once

#include "accel/training/accelerator/accelerator.hpp"
#include "accel/training/tp/sequence_parallel.hpp"

ACCEL_NAMESPACE_BEGIN

inline void Accelerator::backward(const at::Tensor& loss) {
  setup_.refuse_under_pipeline("backward",
                               "with a pipeline the schedule runs each micro-batch's backward (schedule.step), and a "
                               "stage given its model's DataParallel (stage.set_data_parallel(*data_parallel(model))) "
                               "reduces the gradients once per step");
  auto step = [&] {
    const int steps = gradient_accumulation_steps();
    at::Tensor scaled = prepared_.scaler ? prepared_.scaler->scale(loss) : loss;
    if (steps > 1) scaled = scaled / steps;
    if (join_) join_->before_backward();
    for (DataParallel* dp : *prepared_.sharded) dp->check_shards();
    for (auto& m : prepared_.models) m.data_parallel->prepare_for_backward();  // (a model not syncing now: nothing)
    scaled.backward();
    for (auto& m : prepared_.models) m.data_parallel->finish(/*always=*/join_ && join_->includes(&m));
    // Sequence parallelism's partial gradients (those accel::tp layers and a plan know of) summed over tp, on
    // the steps that sync: the accumulated parts once (summing on the others would count earlier parts again).
    // (under sharding, the shards' gradients: FSDP + TP)
    if (sync_gradients())
      for (auto& m : prepared_.models)
        if (m.split.group) tp::all_reduce_sequence_parallel_gradients(*m.module);
  };
  if (join_) step();  // (a joined process stands in for it without calling it)
  else detail::every_process_calls("accel::Accelerator::backward", step);
}

inline void Accelerator::lomo_backward(const at::Tensor&, double) {
  throw InvalidArgument(
      "accel::Accelerator::lomo_backward: Backward pass not properly called on LOMO optimizers. Are you sure you "
      "passed a LOMO optimizer in accelerator.prepare()? (LibTorch has no LOMO optimizer: call backward(loss) and "
      "step the optimizer)");
}

template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::no_sync(ModuleHolders&... models) {
  return with_sync(false, models...);
}
template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::trigger_sync_in_backward(ModuleHolders&... models) {
  return with_sync(true, models...);
}
template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::accumulate(ModuleHolders&... models) {
  if (setup_.config().sync_with_dataloader && state_->end_of_dataloader()) {
    step_ = 0;
    state_->sync_gradients = true;
  } else {
    ++step_;
    state_->sync_gradients = step_ % gradient_accumulation_steps() == 0;
  }
  return with_sync(state_->sync_gradients || setup_.config().sync_each_batch, models...);
}
inline bool Accelerator::sync_gradients() const { return state_->sync_gradients; }
inline bool Accelerator::end_of_dataloader() const { return state_->end_of_dataloader(); }
inline const void* Accelerator::active_dataloader() const { return state_->active_dataloader(); }

template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::with_sync([[maybe_unused]] bool sync, ModuleHolders&... models) {
  SyncGuard guard;  // (no models: sync unused)
  (
      [&] {
        if (detail::PreparedModel* p = prepared_.find(models.ptr().get())) guard.set(*p->data_parallel, sync);
      }(),
      ...);
  return guard;
}

template <class Body, class... ModuleHolders>
  requires(detail::module_holder<ModuleHolders> && ...)
void Accelerator::join_uneven_inputs(Body&& body, ModuleHolders&... models) {
  static_assert(sizeof...(ModuleHolders) > 0, "accel::Accelerator::join_uneven_inputs: name the prepared models");
  if (join_) throw LogicError("accel::Accelerator::join_uneven_inputs: already inside one");
  if (const int tp = setup_.world().strategy().tp_size(); tp > 1)
    throw InvalidArgument("accel::Accelerator::join_uneven_inputs: tp_size " + std::to_string(tp) +
                          ": a joined process would leave its tensor-parallel peers waiting in the model's own "
                          "collectives; use even batches");
  if (!prepared_.sharded->empty())
    throw InvalidArgument(
        "accel::Accelerator::join_uneven_inputs: not under sharding yet (a joined process would "
        "have to step its shard too); use NO_SHARD, or even batches");
  detail::run_joined(join_, detail::Join({find_prepared(models, "join_uneven_inputs")...}), std::forward<Body>(body));
}
template <class Body, class... ModuleHolders>
  requires(detail::module_holder<ModuleHolders> && ...)
void Accelerator::join_uneven_inputs(Body&& body, bool even_batches, ModuleHolders&... models) {
  const detail::EvenBatchesOverride for_the_block(prepared_.loaders, even_batches);
  join_uneven_inputs(std::forward<Body>(body), models...);
}

inline double Accelerator::clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                                           double norm_type) {
  unscale_gradients();
  return detail::clip_grad_norm(prepared_, parameters, max_norm, norm_type);
}
inline void Accelerator::clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) {
  unscale_gradients();
  detail::clip_grad_value(prepared_, parameters, clip_value);
}
inline void Accelerator::unscale_gradients() {
  if (prepared_.scaler)
    for (auto* optimizer : prepared_.optimizers) prepared_.scaler->unscale_(*optimizer);
}
inline void Accelerator::unscale_gradients(AcceleratedOptimizer& optimizer) {
  if (prepared_.scaler) prepared_.scaler->unscale_(optimizer.optimizer());
}
inline GradScaler* Accelerator::scaler() const { return prepared_.scaler.get(); }

inline Accelerator::AutocastGuard Accelerator::autocast() const { return AutocastGuard(mixed_precision(), device()); }

ACCEL_NAMESPACE_END
