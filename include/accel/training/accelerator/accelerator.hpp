// accel/training/accelerator/accelerator.hpp: the Accelerator: the training step, gradient sync, uneven inputs, checkpoints and weights.
//
// Its configuration, world, device and properties come from
// AcceleratorSetup (accelerator/setup.hpp), what it prepares from
// AcceleratorPreparing (accelerator/preparing.hpp: the models, optimizers,
// schedulers and loaders, kept in a PreparedSet that the checkpoint
// functions of checkpoint/state.hpp save and load), and Accelerate's
// operations over every process from ProcessOperations
// (accelerator/process_operations.hpp), experiment logging from ExperimentLog
// (accelerator/trackers.hpp). This part adds the training step, gradient sync
// and accumulation, uneven inputs, checkpoints and weights.
#pragma once

#include "accel/training/accelerator/preparing.hpp"
#include "accel/training/precision/autocast.hpp"
#include "accel/training/checkpoint/state.hpp"
#include "accel/training/accelerator/join.hpp"
#include "accel/training/data/loaders.hpp"
#include "accel/training/accelerator/process_operations.hpp"
#include "accel/training/accelerator/trackers.hpp"
#include "accel/training/checkpoint/weights.hpp"

ACCEL_NAMESPACE_BEGIN

class Accelerator : public detail::AcceleratorPreparing,
                    public detail::ProcessOperations,
                    public detail::ExperimentLog {
 public:
  // Every setting is checked before the rendezvous (AcceleratorSetup).
  explicit Accelerator(AcceleratorConfig config = {})
      : AcceleratorPreparing(std::move(config)), ExperimentLog(settings(), is_main_process()) {}

  // -- the training step --------------------------------------------------------

  // loss.backward(), scaled by 1/gradient_accumulation_steps (and under
  // fp16 by the loss scaler's scale), with the
  // gradient all-reduce armed on every prepared model that syncs now (not
  // inside no_sync or a non-sync accumulate step). A model none of whose
  // parameters gets a gradient from this loss is left alone.
  void backward(const at::Tensor& loss) {
    auto step = [&] {
      const int steps = gradient_accumulation_steps();
      at::Tensor scaled = prepared_.scaler ? prepared_.scaler->scale(loss) : loss;
      if (steps > 1) scaled = scaled / steps;
      if (join_) join_->before_backward();
      for (DataParallel* dp : *prepared_.sharded) dp->check_shards();
      for (auto& m : prepared_.models) m.data_parallel->prepare_for_backward();  // (a model not syncing now: nothing)
      scaled.backward();
      for (auto& m : prepared_.models) m.data_parallel->finish(/*always=*/join_ && join_->includes(&m));
    };
    if (join_) step();  // (a joined process stands in for it without calling it)
    else detail::every_process_calls("accel::Accelerator::backward", step);
  }

  // Accelerate's lomo_backward runs the fused backward-and-step of a
  // prepared LOMO optimizer (lomo-optim's Lomo, AdaLomo). LibTorch has none,
  // so no prepared optimizer can be one: Accelerate's error for that case.
  void lomo_backward(const at::Tensor&, double) {
    throw InvalidArgument(
        "accel::Accelerator::lomo_backward: Backward pass not properly called on LOMO optimizers. Are you sure you "
        "passed a LOMO optimizer in accelerator.prepare()? (LibTorch has no LOMO optimizer: call backward(loss) and "
        "step the optimizer)");
  }

  // Training on uneven inputs (even_batches = false), as Accelerate's
  // join_uneven_inputs over DDP's Join: runs body (the training loop); a
  // rank whose loop ends first stands in for the others' gradient
  // all-reduces (with zeros: gradients are still divided by the whole group)
  // until every rank's loop has ended, and then every rank takes the
  // weights of a rank that ran the most steps (DDP's final model sync).
  // Inside body, each backward() first tells the joined ranks what to shadow
  // (one small all_reduce), and every listed model that syncs is reduced on
  // every backward; other collectives inside body would have no partner on a
  // joined rank (as with DDP's Join).
  template <class Body, class... ModuleHolders>
    requires(detail::module_holder<ModuleHolders> && ...)
  void join_uneven_inputs(Body&& body, ModuleHolders&... models) {
    static_assert(sizeof...(ModuleHolders) > 0, "accel::Accelerator::join_uneven_inputs: name the prepared models");
    if (join_) throw LogicError("accel::Accelerator::join_uneven_inputs: already inside one");
    if (!prepared_.sharded->empty())
      throw InvalidArgument(
          "accel::Accelerator::join_uneven_inputs: not under sharding yet (a joined process would "
          "have to step its shard too); use NO_SHARD, or even batches");
    detail::run_joined(join_, detail::Join({find_prepared(models, "join_uneven_inputs")...}), std::forward<Body>(body));
  }
  // The same, with the prepared loaders' even_batches set to even_batches
  // for the block (Accelerate's join_uneven_inputs(..., even_batches)): it
  // applies to each pass that starts inside the block. Loaders that
  // dispatch batches, and iterable ones, have no even_batches (Accelerate
  // warns about them, and also leaves them as they are).
  template <class Body, class... ModuleHolders>
    requires(detail::module_holder<ModuleHolders> && ...)
  void join_uneven_inputs(Body&& body, bool even_batches, ModuleHolders&... models) {
    const detail::EvenBatchesOverride for_the_block(prepared_.loaders, even_batches);
    join_uneven_inputs(std::forward<Body>(body), models...);
  }

  // RAII: restores the models' gradient sync when it goes out of scope.
  using SyncGuard = detail::SyncGuard;
  // While the guard lives, backward() accumulates these models' gradients
  // locally (DDP's no_sync). A model that was never prepared never syncs.
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard no_sync(ModuleHolders&... models) {
    return with_sync(false, models...);
  }
  // While the guard lives, backward() syncs these models' gradients, also
  // inside no_sync (Accelerate's trigger_sync_in_backward).
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard trigger_sync_in_backward(ModuleHolders&... models) {
    return with_sync(true, models...);
  }
  // One micro-step of gradient accumulation, as Accelerate's accumulate():
  // counts the step and sets sync_gradients(), true on every
  // gradient_accumulation_steps-th call and on the last batch of a prepared
  // loader's pass (which also restarts the count, so no accumulated gradient
  // is carried into the next pass). On the other steps the given models
  // accumulate locally while the guard lives (unless sync_each_batch).
  // sync_gradients() keeps its value after the guard, for the loop to read.
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard accumulate(ModuleHolders&... models) {
    if (settings().sync_with_dataloader && state_->end_of_dataloader()) {
      step_ = 0;
      state_->sync_gradients = true;
    } else {
      ++step_;
      state_->sync_gradients = step_ % gradient_accumulation_steps() == 0;
    }
    return with_sync(state_->sync_gradients || settings().sync_each_batch, models...);
  }
  // Whether the current step syncs gradients (and prepared optimizers step).
  bool sync_gradients() const { return state_->sync_gradients; }
  // Whether the batch being processed is the last of the innermost prepared
  // loader's pass.
  bool end_of_dataloader() const { return state_->end_of_dataloader(); }
  // The innermost prepared loader whose pass is under way, as Accelerate's
  // gradient_state.active_dataloader: its address (compare with &loader),
  // nullptr outside every pass.
  const void* active_dataloader() const { return state_->active_dataloader(); }

  // torch's clip_grad_norm_ and clip_grad_value_, over every rank's shards
  // under sharding (detail::clip_grad_norm). Under fp16 the gradients are
  // unscaled first (unscale_gradients), as Accelerate does: call them once
  // per optimizer step, on the steps that sync.
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0) {
    unscale_gradients();
    return detail::clip_grad_norm(prepared_, parameters, max_norm, norm_type);
  }
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) {
    unscale_gradients();
    detail::clip_grad_value(prepared_, parameters, clip_value);
  }
  // Under fp16: divides the prepared optimizers' gradients (or `optimizer`'s)
  // by the loss scale, once per step (GradScaler::unscale_); else nothing.
  void unscale_gradients() {
    if (prepared_.scaler)
      for (auto* optimizer : prepared_.optimizers) prepared_.scaler->unscale_(*optimizer);
  }
  void unscale_gradients(AcceleratedOptimizer& optimizer) {
    if (prepared_.scaler) prepared_.scaler->unscale_(optimizer.optimizer());
  }
  // The loss scaler of mixed_precision "fp16" (AcceleratorConfig::grad_scaler),
  // as Accelerate's accelerator.scaler; nullptr otherwise.
  GradScaler* scaler() const { return prepared_.scaler.get(); }

  // RAII autocast for the configured mixed precision: bf16 on the CPU
  // through LibTorch's autocast; a no-op for "no".
  using AutocastGuard = detail::AutocastGuard;
  [[nodiscard]] AutocastGuard autocast() const { return AutocastGuard(mixed_precision(), device()); }

  // The model itself: accel.hpp does not wrap modules.
  template <class ModuleHolder>
  ModuleHolder& unwrap_model(ModuleHolder& model) const {
    return model;
  }

  // Accelerate's free_memory, for a second training run in the same
  // process: the Accelerator lets go of every model, optimizer, scheduler
  // and loader it prepared and every object registered for checkpointing
  // (Accelerate keeps those; here they are references that may not outlive
  // the run), and its step count restarts. Each prepared model is a plain
  // module again: under FULL_SHARD its whole parameters gathered back into
  // it, and an optimizer that stepped shards steps the parameters again,
  // with its state started afresh (see DataParallel::release_module).
  // Every process calls it. Loaders keep working on their own.
  void free_memory() {
    if (join_) throw LogicError("accel::Accelerator::free_memory: inside join_uneven_inputs");
    detail::every_process_calls("accel::Accelerator::free_memory", [&] {
      for (auto& m : prepared_.models) m.data_parallel->release_module();
    });
    let_go_of_prepared();
    step_ = 0;
    state_->sync_gradients = true;
  }
  // Accelerate's other name for free_memory.
  void clear() { free_memory(); }

  // -- metrics across processes (the other operations: ProcessOperations) ----------

  // Every rank's tensors concatenated along dim 0 in rank order (uneven sizes
  // welcome), over the data-parallel group. Inside a pass over a prepared
  // loader, the rows that repeat samples (even_batches padding) are dropped
  // first, so every sample of the dataset is counted exactly once.
  // num_samples instead keeps the first num_samples rows of the result (for
  // data that did not come from a prepared loader).
  template <TensorTree T>
  T gather_for_metrics(const T& data, std::optional<int64_t> num_samples = std::nullopt) {
    return detail::every_process_calls("accel::Accelerator::gather_for_metrics", [&]() -> T {
      const GroupPtr group = world().get_group(Dim::DP);
      auto first_rows = [](int64_t rows) {
        return [rows](const at::Tensor& t) { return t.dim() ? t.narrow(0, 0, std::min(rows, t.size(0))) : t; };
      };
      if (num_samples) return recursively_apply(first_rows(*num_samples), accel::gather(data, group));
      const detail::LoaderState* loader = state_->loader();
      if (loader && loader->real_rows)
        return accel::gather(recursively_apply(first_rows(static_cast<int64_t>(*loader->real_rows)), data), group);
      return accel::gather(data, group);
    });
  }

  // -- checkpoints ----------------------------------------------------------------

  // Saves every prepared model and optimizer (model.pt, model_1.pt, ...,
  // optimizer.pt, optimizer_1.pt, ...), every rank's RNG state and the
  // accumulation step, where each prepared loader is in its pass, and the
  // registered objects under `path`, atomically: it is always the previous or the whole new
  // checkpoint, even when a process dies halfway (see "Checkpoint files").
  // Every process calls it; the path must be on a filesystem they all see. An
  // error on any process (a full disk) is thrown on every process. With
  // project_config.automatic_checkpoint_naming, call it without a path: it
  // writes project_dir/checkpoints/checkpoint_<iteration> (an error if that
  // exists), counts iteration up, and with total_limit then removes the
  // oldest beyond the limit. Returns the checkpoint's directory.
  std::filesystem::path save_state(const std::filesystem::path& path = {}) {
    return detail::every_process_calls("accel::Accelerator::save_state", [&] {
      return detail::save_checkpoint_state(prepared_, checkpoint_context(), step_, project_configuration(), path);
    });
  }

  // Loads what save_state saved into the prepared models, optimizers,
  // registered objects and this rank's RNG and step, after a half-done save
  // is recovered. Each prepared loader's next pass resumes where the saved
  // one was: its epoch, after the batches already handed out (a save after
  // a pass's last batch resumes with the next epoch); loop over epochs from
  // loader.next_epoch(). Transactional:
  // every file is read and checked first (parameter and buffer names, shapes
  // and dtypes against the models), on every process; another number of
  // processes or another sharding strategy is fine (checkpoint/world.hpp,
  // checkpoint/reshard.hpp); on any error
  // nothing is modified anywhere and every process throws, naming the file.
  // With project_config.automatic_checkpoint_naming, no path loads the
  // newest numbered checkpoint, and any load sets iteration past the newest
  // (Accelerate leaves it, and the next save_state() finds its number taken).
  void load_state(const std::filesystem::path& path = {}) {
    step_ = detail::every_process_calls("accel::Accelerator::load_state", [&] {
      return detail::load_checkpoint_state(prepared_, checkpoint_context(), project_configuration(), path);
    });
  }

  // -- weights that leave C++ --------------------------------------------------------

  // accel::save_model and accel::load_model (accel/training/checkpoint/weights.hpp) on a
  // prepared model. Under FULL_SHARD save_model gathers the parameters one
  // unit at a time as the files reach them (beside its shards no process
  // holds more than one unit's whole parameters and the rows its
  // all-gather lands in); load_model gathers them all for the call and
  // writes them back into the shards.
  template <class ModuleHolder>
  void save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options = {}) {
    detail::every_process_calls("accel::Accelerator::save_model", [&] {
      const detail::PreparedModel* prepared = prepared_.find(model.ptr().get());
      DataParallel* dp = prepared ? prepared->data_parallel.get() : nullptr;
      if (!dp || dp->unit_count() == 0) return accel::save_model(model, dir, options);
      auto units = dp->unit_by_unit();
      detail::save_weights(*model.ptr(), detail::checkpoint_path(dir, "save_model"), options,
                           [&](const at::Tensor& t) { return units.whole(t); });
    });
  }
  // (the same, options.max_shard_bytes given alone)
  template <class ModuleHolder>
  void save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes) {
    save_model(model, dir, SaveModelOptions{.max_shard_bytes = max_shard_bytes});
  }
  template <class ModuleHolder>
  void load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options = {}) {
    detail::every_process_calls("accel::Accelerator::load_model", [&] {
      const auto full = prepared_.full_parameters(model.ptr().get(), /*writeback=*/true);
      accel::load_model(model, dir, options);
    });
  }

 private:
  detail::CheckpointContext checkpoint_context() const {
    return {.process_index = process_index(),
            .num_processes = num_processes(),
            .shards = prepared_.sharded->empty() ? 1 : world().get_world_size(Dim::MP_SHARD),
            .device = device()};
  }
  template <class... ModuleHolders>
  SyncGuard with_sync([[maybe_unused]] bool sync, ModuleHolders&... models) {  // (no models: sync unused)
    SyncGuard guard;
    (
        [&] {
          if (detail::PreparedModel* p = prepared_.find(models.ptr().get())) guard.set(*p->data_parallel, sync);
        }(),
        ...);
    return guard;
  }
  int64_t step_ = 0;  // accumulate()'s count of micro-steps
  std::optional<detail::Join> join_;
};

ACCEL_NAMESPACE_END
