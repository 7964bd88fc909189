// accel/training/accelerator/accelerator.hpp: the Accelerator, declared: every public method in one place, and the state it holds.
//
// The class is declared here whole and defined after, part by part, as
// c10d declares a ProcessGroup in one header: a reader finds every method
// below with what it does, and the part that defines each family is named
// above it. Include accel.hpp or accel/training.hpp, which hold them all.
//
// The state is held in members, each a small type of its own: the checked
// configuration with the world and the device (AcceleratorSetup), what was
// prepared (PreparedSet, which checkpoints save and load), the accumulation
// count and the join of uneven inputs (the step's sync control), and the
// experiment log.
#pragma once

#include "accel/training/accelerator/setup.hpp"
#include "accel/training/accelerator/join.hpp"
#include "accel/training/accelerator/trackers.hpp"
#include "accel/training/checkpoint/context.hpp"
#include "accel/training/checkpoint/prepared.hpp"
#include "accel/training/checkpoint/weights.hpp"
#include "accel/training/data/loaders.hpp"
#include "accel/training/precision/autocast.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What prepare() takes for a scheduler: anything that steps and is not an
// optimizer (LibTorch's LRScheduler, or a scheduler of yours).
template <class S>
concept scheduler_like = !std::derived_from<S, torch::optim::Optimizer> && requires(S& s) { s.step(); };
// What register_for_checkpointing takes: an object with LibTorch's save and load.
template <class T>
concept checkpointable =
    requires(T& t, const T& c, torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
      c.save(out);
      t.load(in);
    };
// What skip_first_batches takes: a prepared loader.
template <class L>
concept skips_batches = requires(L& l) { l.skip_first_batches(size_t{1}); };
}  // namespace detail

class Accelerator {
 public:
  // Every setting is checked before the rendezvous (AcceleratorSetup); under
  // mixed_precision "fp16" the Accelerator holds a loss scaler (as
  // Accelerate's), whose overflow check under sharding is agreed over the
  // world, since each process then holds other gradients.
  explicit Accelerator(AcceleratorConfig config = {});

  // -- what it runs on (accelerator/properties.hpp) ------------------------------

  c10::Device device() const;
  bool is_main_process() const;
  bool is_local_main_process() const;
  bool is_last_process() const;
  int process_index() const;
  int local_process_index() const;
  int num_processes() const;
  DistributedType distributed_type() const;
  const std::string& mixed_precision() const;
  int gradient_accumulation_steps() const;
  // The strategy in effect: NO_SHARD when the configured one has nothing to
  // shard along (mp_shard_size == 1, or one process).
  ShardingStrategy sharding_strategy() const;
  // Accelerate's use_distributed: more than one process.
  bool use_distributed() const;
  // Accelerate's is_fsdp2: whether parameters are sharded at rest
  // (FULL_SHARD or HYBRID_SHARD with something to shard along).
  bool is_fsdp2() const;
  // Accelerate's should_save_model: true on every process, which all call
  // save_model (a collective; the main process writes).
  bool should_save_model() const;
  // This process's rank along each kind of parallelism, as Accelerate names
  // them: data along Dim::DP, context along Dim::CP, tensor along Dim::TP,
  // pipeline along Dim::PP (0 for a dimension of size 1, as Accelerate for
  // one not enabled).
  int data_parallel_rank() const;
  int context_parallel_rank() const;
  int tensor_parallel_rank() const;
  int pipeline_parallel_rank() const;
  // Accelerate's state (PartialState): the facts of this process that every
  // Accelerator in it shares: the distributed interface (rank, world size,
  // device, meshes).
  const DistributedInterface& state() const;
  // Accelerate's fp8_backend: the FP8 backend in use; none here
  // (mixed_precision takes no "fp8"), so nullopt, Accelerate's None.
  std::optional<std::string> fp8_backend() const;
  // Accelerate's verify_device_map: whether the model is spread over devices
  // by a device map (big-model inference). accel.hpp places whole models: false.
  template <class ModuleHolder>
  bool verify_device_map(const ModuleHolder&) const;
  // Accelerate's project_dir, project_configuration and save_iteration (the
  // number the next automatically named checkpoint takes; set it through
  // project_configuration().iteration).
  const std::filesystem::path& project_dir() const;
  ProjectConfiguration& project_configuration();
  int save_iteration() const;

  // -- prepare (accelerator/preparing.hpp) ---------------------------------------

  // A model: moved to the device, its parameters and buffers broadcast from
  // rank 0, and bucketed gradient all-reduce armed over the data mesh (see
  // DataParallel). Any number of models may be prepared; each keeps its own
  // gradient sync. Returns the model itself (accel.hpp does not wrap).
  template <class ModuleHolder>
    requires detail::module_holder<ModuleHolder>
  ModuleHolder& prepare(ModuleHolder& model);
  // An optimizer (any torch::optim::Optimizer): see AcceleratedOptimizer.
  // Under sharding its groups then hold the shards of the prepared models'
  // parameters (prepare it before it steps), and step it through the handle
  // returned, whose step() gathers the parameters from the updated shards.
  // A tensor listed twice in it (LibTorch's model->parameters() lists a
  // tied weight under each of its names) is stepped once.
  AcceleratedOptimizer prepare(torch::optim::Optimizer& optimizer);
  // A learning-rate scheduler: see AcceleratedScheduler.
  template <detail::scheduler_like Scheduler>
  AcceleratedScheduler prepare(Scheduler& scheduler);
  // Several at once, as Accelerate's prepare(model, optimizer, scheduler):
  //   auto [model, optimizer, scheduler] = accelerator.prepare(net, adam, step_lr);
  template <class First, class Second, class... Rest>
  auto prepare(First& first, Second& second, Rest&... rest);
  // Accelerate's single-object forms of prepare.
  template <class ModuleHolder>
    requires detail::module_holder<ModuleHolder>
  ModuleHolder& prepare_model(ModuleHolder& model);
  AcceleratedOptimizer prepare_optimizer(torch::optim::Optimizer& optimizer);
  template <detail::scheduler_like Scheduler>
  AcceleratedScheduler prepare_scheduler(Scheduler& scheduler);

  // A data loader over this process's share of `dataset` on the data-parallel
  // group (see ShardSampler for the layouts). With split_batches,
  // config.batch_size is the global batch and must divide evenly among the
  // processes. config.dispatch_batches: the main process reads and sends.
  // An IterableDataset (a LibTorch StatefulDataset) gives a
  // PreparedIterableDataLoader instead.
  template <class Dataset>
  auto prepare_data_loader(Dataset dataset, DataLoaderConfig config = {});
  // The loader's next pass starts after its first n batches (Accelerate's
  // skip_first_batches, for a run resumed by hand; load_state does it for
  // prepared loaders). Returns the loader.
  template <detail::skips_batches Loader>
  Loader& skip_first_batches(Loader& loader, size_t n);

  // Anything with save(torch::serialize::OutputArchive&) and
  // load(torch::serialize::InputArchive&) (a LibTorch scheduler or sampler
  // of yours, a step counter) joins every checkpoint, as Accelerate's
  // register_for_checkpointing: custom_checkpoint_<i>.pt, in the order
  // registered, written by the main process. The object must outlive the
  // Accelerator's checkpoints.
  template <detail::checkpointable T>
  void register_for_checkpointing(T& object);

  // The DataParallel of the first prepared model, or of `model`; nullptr
  // when it was not prepared.
  DataParallel* data_parallel();
  template <class ModuleHolder>
  DataParallel* data_parallel(ModuleHolder& model);
  // The model itself: accel.hpp does not wrap modules.
  template <class ModuleHolder>
  ModuleHolder& unwrap_model(ModuleHolder& model) const;

  // Accelerate's free_memory, for a second training run in the same
  // process: the Accelerator lets go of every model, optimizer, scheduler
  // and loader it prepared and every object registered for checkpointing
  // (Accelerate keeps those; here they are references that may not outlive
  // the run), and its step count restarts. Each prepared model is a plain
  // module again: under FULL_SHARD its whole parameters gathered back into
  // it, and an optimizer that stepped shards steps the parameters again,
  // with its state started afresh (see DataParallel::release_module).
  // Every process calls it. Loaders keep working on their own.
  void free_memory();
  // Accelerate's other name for free_memory.
  void clear();

  // -- the training step (accelerator/training_step.hpp) -------------------------

  // loss.backward(), scaled by 1/gradient_accumulation_steps (and under
  // fp16 by the loss scaler's scale), with the
  // gradient all-reduce armed on every prepared model that syncs now (not
  // inside no_sync or a non-sync accumulate step). A model none of whose
  // parameters gets a gradient from this loss is left alone.
  void backward(const at::Tensor& loss);
  // Accelerate's lomo_backward runs the fused backward-and-step of a
  // prepared LOMO optimizer (lomo-optim's Lomo, AdaLomo). LibTorch has none,
  // so no prepared optimizer can be one: Accelerate's error for that case.
  void lomo_backward(const at::Tensor& loss, double learning_rate);

  // RAII: restores the models' gradient sync when it goes out of scope.
  using SyncGuard = detail::SyncGuard;
  // While the guard lives, backward() accumulates these models' gradients
  // locally (DDP's no_sync). A model that was never prepared never syncs.
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard no_sync(ModuleHolders&... models);
  // While the guard lives, backward() syncs these models' gradients, also
  // inside no_sync (Accelerate's trigger_sync_in_backward).
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard trigger_sync_in_backward(ModuleHolders&... models);
  // One micro-step of gradient accumulation, as Accelerate's accumulate():
  // counts the step and sets sync_gradients(), true on every
  // gradient_accumulation_steps-th call and on the last batch of a prepared
  // loader's pass (which also restarts the count, so no accumulated gradient
  // is carried into the next pass). On the other steps the given models
  // accumulate locally while the guard lives (unless sync_each_batch).
  // sync_gradients() keeps its value after the guard, for the loop to read.
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard accumulate(ModuleHolders&... models);
  // Whether the current step syncs gradients (and prepared optimizers step).
  bool sync_gradients() const;
  // Whether the batch being processed is the last of the innermost prepared
  // loader's pass.
  bool end_of_dataloader() const;
  // The innermost prepared loader whose pass is under way, as Accelerate's
  // gradient_state.active_dataloader: its address (compare with &loader),
  // nullptr outside every pass.
  const void* active_dataloader() const;

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
  void join_uneven_inputs(Body&& body, ModuleHolders&... models);
  // The same, with the prepared loaders' even_batches set to even_batches
  // for the block (Accelerate's join_uneven_inputs(..., even_batches)): it
  // applies to each pass that starts inside the block. Loaders that
  // dispatch batches, and iterable ones, have no even_batches (Accelerate
  // warns about them, and also leaves them as they are).
  template <class Body, class... ModuleHolders>
    requires(detail::module_holder<ModuleHolders> && ...)
  void join_uneven_inputs(Body&& body, bool even_batches, ModuleHolders&... models);

  // torch's clip_grad_norm_ and clip_grad_value_, over every rank's shards
  // under sharding, and over every stage with a pipeline (each rank passes
  // its stages' parameters; detail::clip_grad_norm). Under fp16 the gradients are
  // unscaled first (unscale_gradients), as Accelerate does: call them once
  // per optimizer step, on the steps that sync.
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0);
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value);
  // Under fp16: divides the prepared optimizers' gradients (or `optimizer`'s)
  // by the loss scale, once per step (GradScaler::unscale_); else nothing.
  void unscale_gradients();
  void unscale_gradients(AcceleratedOptimizer& optimizer);
  // The loss scaler of mixed_precision "fp16" (AcceleratorConfig::grad_scaler),
  // as Accelerate's accelerator.scaler; nullptr otherwise.
  GradScaler* scaler() const;

  // RAII autocast for the configured mixed precision: bf16 on the CPU
  // through LibTorch's autocast; a no-op for "no".
  using AutocastGuard = detail::AutocastGuard;
  [[nodiscard]] AutocastGuard autocast() const;

  // -- over every process (accelerator/process_operations.hpp) -------------------

  // Accelerate's operations as methods (accelerator.gather(x),
  // accelerator.print(...)): each calls the free function of the same name
  // over the world (accel/distributed/operations.hpp, process_control.hpp).
  template <TensorTree T>
  T gather(const T& data) const;
  template <TensorTree T>
  T reduce(const T& data, ReduceOp reduction = ReduceOp::SUM) const;  // Accelerate's default: sum
  template <TensorTree T>
  T reduce(const T& data, std::string_view reduction) const;  // "sum", "mean", "max", "min", as accel::reduce
  template <TensorTree T>
  T pad_across_processes(const T& data, int64_t dim = 0, const at::Scalar& pad_index = 0, bool pad_first = false) const;
  template <class T>
  T split_between_processes(const T& inputs, bool apply_padding = false) const;
  template <class... Args>
  void print(const Args&... args) const;
  void wait_for_everyone() const;
  template <class Body>
  std::invoke_result_t<Body&> main_process_first(Body&& body) const;
  template <class Body>
  std::invoke_result_t<Body&> local_main_process_first(Body&& body) const;
  template <class Fn>
  auto on_main_process(Fn fn) const;
  template <class Fn>
  auto on_local_main_process(Fn fn) const;
  template <class Fn>
  auto on_last_process(Fn fn) const;
  template <class Fn>
  auto on_process(Fn fn, int process_index) const;

  // Any process can ask every process to stop at the same step: set_trigger()
  // on one, then check_trigger() on all (one all_reduce) is true on all, and
  // resets the trigger.
  void set_trigger();
  bool check_trigger();

  // Every rank's tensors concatenated along dim 0 in rank order (uneven sizes
  // welcome), over the data-parallel group. Inside a pass over a prepared
  // loader, the rows that repeat samples (even_batches padding) are dropped
  // first, so every sample of the dataset is counted exactly once.
  // num_samples instead keeps the first num_samples rows of the result (for
  // data that did not come from a prepared loader).
  template <TensorTree T>
  T gather_for_metrics(const T& data, std::optional<int64_t> num_samples = std::nullopt);

  // -- the experiment log (accelerator/process_operations.hpp; files: trackers.hpp)

  // Accelerate's init_trackers: the files go to logging_dir/<project_name>,
  // and `config` (the run's hyperparameters, as text) to config.json there.
  // Every process calls it; the main process writes.
  void init_trackers(const std::string& project_name, const std::map<std::string, std::string>& config = {});
  // Accelerate's log: `values` at `step` to every tracker (main process only).
  void log(const std::map<std::string, double>& values, std::optional<int64_t> step = {});
  // Accelerate's end_training: the trackers finish (these files are
  // complete after every log call already); log() after it is an error.
  void end_training();
  // Where this run's files go (logging_dir, or project_dir, / project name).
  std::filesystem::path logging_dir() const;

  // -- checkpoints and weights (accelerator/checkpoints.hpp) ---------------------

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
  std::filesystem::path save_state(const std::filesystem::path& path = {});
  // Loads what save_state saved into the prepared models, optimizers,
  // registered objects and this rank's RNG and step, after a half-done save
  // is recovered. Each prepared loader's next pass resumes where the saved
  // one was: its epoch, after the batches already handed out (a save after
  // a pass's last batch resumes with the next epoch); loop over epochs from
  // loader.next_epoch(). Transactional:
  // every file is read and checked first (parameter and buffer names, shapes
  // and dtypes against the models), on every process; another number of
  // processes or another sharding strategy is fine (checkpoint/world.hpp,
  // checkpoint/reshard.hpp; across tensor-parallel layouts the optimizer
  // state of Adam, AdamW and SGD only); on any error
  // nothing is modified anywhere and every process throws, naming the file.
  // With project_config.automatic_checkpoint_naming, no path loads the
  // newest numbered checkpoint, and any load sets iteration past the newest
  // (Accelerate leaves it, and the next save_state() finds its number taken).
  void load_state(const std::filesystem::path& path = {});

  // accel::save_model and accel::load_model (accel/training/checkpoint/weights.hpp) on a
  // prepared model. Under FULL_SHARD save_model gathers the parameters one
  // unit at a time as the files reach them (beside its shards no process
  // holds more than one unit's whole parameters and the rows its
  // all-gather lands in); load_model gathers them all for the call and
  // writes them back into the shards. Under a pipeline (pp_size > 1) both
  // take the whole model: every stage prepared on every process, under the
  // stages' own names, which must be the whole model's (as torchtitan's
  // stages and llama::Stage keep them); `model` is any of this process's
  // stages, and each call saves or loads them all (each tensor sent to the
  // main process by a process of its stage; a name on two stages refused).
  template <class ModuleHolder>
  void save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options = {});
  // (the same, options.max_shard_bytes given alone)
  template <class ModuleHolder>
  void save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes);
  template <class ModuleHolder>
  void load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options = {});

 private:
  template <class ModuleHolder>
  detail::PreparedModel* find_prepared(ModuleHolder& model, const char* op);
  // Forgets everything prepared (free_memory, once the models are plain modules again).
  void let_go_of_prepared();
  template <class... ModuleHolders>
  SyncGuard with_sync(bool sync, ModuleHolders&... models);
  detail::CheckpointContext checkpoint_context() const;
  void pipeline_stages_of(const torch::nn::Module* model, const char* op);  // (checkpoints.hpp)

  // The checked configuration, the world and the device.
  detail::AcceleratorSetup setup_;
  // What was prepared, and what the prepared optimizers, schedulers and
  // loaders share (Accelerate's GradientState).
  detail::PreparedSet prepared_;
  std::shared_ptr<detail::GradientState> state_ = std::make_shared<detail::GradientState>();
  // The step's sync control: accumulate()'s count of micro-steps, and the
  // join of uneven inputs while join_uneven_inputs runs its body.
  int64_t step_ = 0;
  std::optional<detail::Join> join_;
  // check_trigger()'s flag, and the experiment log's files.
  int64_t trigger_ = 0;
  detail::ExperimentLog log_;
};

ACCEL_NAMESPACE_END
