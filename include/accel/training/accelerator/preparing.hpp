// accel/training/accelerator/preparing.hpp: what an Accelerator prepares: models, optimizers, schedulers, data loaders, objects for checkpoints.
//
// The Accelerator's second layer, over AcceleratorSetup: prepare() in all
// its forms, and the PreparedSet of what was prepared and the GradientState
// that the prepared optimizers, schedulers and loaders share. The
// Accelerator (accelerator/accelerator.hpp) reads both to run the training step and to
// save and load checkpoints.
#pragma once

#include "accel/training/accelerator/setup.hpp"
#include "accel/training/data/loaders.hpp"
#include "accel/training/checkpoint/prepared.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
class AcceleratorPreparing : public AcceleratorSetup {
 public:
  // mixed_precision "fp16" comes with a loss scaler (as Accelerate's);
  // under sharding its overflow check is agreed over the world, since each
  // process then holds other gradients.
  explicit AcceleratorPreparing(AcceleratorConfig config) : AcceleratorSetup(std::move(config)) {
    if (mixed_precision() == "fp16" && settings().grad_scaler.enabled)
      prepared_.scaler = std::make_shared<GradScaler>(settings().grad_scaler, device(),
                                                      sharded() ? world().world_group() : GroupPtr{});
  }

  // -- prepare ----------------------------------------------------------------

  // A model: moved to the device, its parameters and buffers broadcast from
  // rank 0, and bucketed gradient all-reduce armed over the data mesh (see
  // DataParallel). Any number of models may be prepared; each keeps its own
  // gradient sync. Returns the model itself (accel.hpp does not wrap).
  template <class ModuleHolder>
    requires detail::module_holder<ModuleHolder>
  ModuleHolder& prepare(ModuleHolder& model) {
    auto module = std::static_pointer_cast<torch::nn::Module>(model.ptr());
    if (prepared_.find(module.get()))
      throw InvalidArgument("accel::Accelerator::prepare: this model is already prepared");
    model->to(device());
    prepared_.models.push_back(detail::PreparedModel{module, data_parallel_for(module)});
    if (sharded()) {
      prepared_.sharded->push_back(prepared_.models.back().data_parallel.get());
      for (auto* optimizer : prepared_.optimizers) prepared_.sharded->back()->shard_optimizer(*optimizer);
    }
    return model;
  }
  // An optimizer (any torch::optim::Optimizer): see AcceleratedOptimizer.
  // Under sharding its groups then hold the shards of the prepared models'
  // parameters (prepare it before it steps), and step it through the handle
  // returned, whose step() gathers the parameters from the updated shards.
  // A tensor listed twice in it (LibTorch's model->parameters() lists a
  // tied weight under each of its names) is stepped once.
  AcceleratedOptimizer prepare(torch::optim::Optimizer& optimizer) {
    detail::take_parameters_once(optimizer, prepared_);
    if (std::find(prepared_.optimizers.begin(), prepared_.optimizers.end(), &optimizer) == prepared_.optimizers.end())
      prepared_.optimizers.push_back(&optimizer);
    if (!sharded()) return AcceleratedOptimizer(optimizer, state_, {}, prepared_.scaler);
    for (DataParallel* dp : *prepared_.sharded) dp->shard_optimizer(optimizer);
    return AcceleratedOptimizer(
        optimizer, state_,
        [sharded = prepared_.sharded, &optimizer] {
          for (DataParallel* dp : *sharded)
            if (dp->steps_with(optimizer)) dp->gather_shards();
        },
        prepared_.scaler);
  }
  // Accelerate's single-object forms of prepare.
  template <class ModuleHolder>
    requires detail::module_holder<ModuleHolder>
  ModuleHolder& prepare_model(ModuleHolder& model) {
    return prepare(model);
  }
  AcceleratedOptimizer prepare_optimizer(torch::optim::Optimizer& optimizer) { return prepare(optimizer); }
  template <class Scheduler>
    requires(!std::derived_from<Scheduler, torch::optim::Optimizer> && requires(Scheduler& s) { s.step(); })
  AcceleratedScheduler prepare_scheduler(Scheduler& scheduler) {
    return prepare(scheduler);
  }
  // A learning-rate scheduler: see AcceleratedScheduler.
  template <class Scheduler>
    requires(!std::derived_from<Scheduler, torch::optim::Optimizer> && requires(Scheduler& s) { s.step(); })
  AcceleratedScheduler prepare(Scheduler& scheduler) {
    auto found = std::find_if(prepared_.schedulers.begin(), prepared_.schedulers.end(),
                              [&](const detail::PreparedScheduler& p) { return p.address == &scheduler; });
    if (found == prepared_.schedulers.end()) {
      detail::PreparedScheduler p{&scheduler, std::make_shared<int64_t>(0), [&scheduler] { scheduler.step(); }, {}, {}};
      if constexpr (requires(const Scheduler& c, Scheduler& m, torch::serialize::OutputArchive& out,
                             torch::serialize::InputArchive& in) {
                      c.save(out);
                      m.load(in);
                    }) {
        p.save = [&scheduler](torch::serialize::OutputArchive& out) { scheduler.save(out); };
        p.load = [&scheduler](torch::serialize::InputArchive& in) { scheduler.load(in); };
      }
      prepared_.schedulers.push_back(std::move(p));
      found = std::prev(prepared_.schedulers.end());
    }
    return AcceleratedScheduler(scheduler, state_, settings().split_batches ? 1 : world().get_world_size(Dim::DP),
                                found->steps);
  }
  // Several at once, as Accelerate's prepare(model, optimizer, scheduler):
  //   auto [model, optimizer, scheduler] = accelerator.prepare(net, adam, step_lr);
  template <class First, class Second, class... Rest>
  auto prepare(First& first, Second& second, Rest&... rest) {
    return std::tuple<decltype(prepare(first)), decltype(prepare(second)), decltype(prepare(rest))...>{
        prepare(first), prepare(second), prepare(rest)...};  // braces: prepared left to right
  }

  // A data loader over this process's share of `dataset` on the data-parallel
  // group (see ShardSampler for the layouts). With split_batches,
  // config.batch_size is the global batch and must divide evenly among the
  // processes. config.dispatch_batches: the main process reads and sends.
  // An IterableDataset (a LibTorch StatefulDataset) gives a
  // PreparedIterableDataLoader instead.
  template <class Dataset>
  auto prepare_data_loader(Dataset dataset, DataLoaderConfig config = {}) {
    const int replicas = world().get_world_size(Dim::DP);
    if (config.batch_size == 0) throw InvalidArgument("accel::prepare_data_loader: batch_size must be at least 1");
    if (settings().split_batches && config.batch_size % static_cast<size_t>(replicas) != 0)
      throw InvalidArgument("accel::prepare_data_loader: with split_batches the batch size (" +
                            std::to_string(config.batch_size) + ") must be a multiple of the " +
                            std::to_string(replicas) + " data-parallel processes");
    using Loader =
        std::conditional_t<IterableDataset<Dataset>, PreparedIterableDataLoader<Dataset>, PreparedDataLoader<Dataset>>;
    auto position = std::make_shared<detail::LoaderPosition>();  // its place in its passes goes into checkpoints
    const size_t batch = config.batch_sampler ? config.batch_sampler_batch_size.value_or(0) : config.batch_size;
    position->samples_per_batch = settings().split_batches ? batch : batch * static_cast<size_t>(replicas);
    prepared_.loaders.push_back(position);
    return Loader(std::move(dataset), config, world().get_group(Dim::DP), settings().split_batches, state_,
                  prepared_.loaders.back());
  }
  // The loader's next pass starts after its first n batches (Accelerate's
  // skip_first_batches, for a run resumed by hand; load_state does it for
  // prepared loaders). Returns the loader.
  template <class Loader>
    requires requires(Loader& l) { l.skip_first_batches(size_t{1}); }
  Loader& skip_first_batches(Loader& loader, size_t n) {
    loader.skip_first_batches(n);
    return loader;
  }

  // Anything with save(torch::serialize::OutputArchive&) and
  // load(torch::serialize::InputArchive&) (a LibTorch scheduler or sampler
  // of yours, a step counter) joins every checkpoint, as Accelerate's
  // register_for_checkpointing: custom_checkpoint_<i>.pt, in the order
  // registered, written by the main process. The object must outlive the
  // Accelerator's checkpoints.
  template <class T>
    requires requires(T& t, const T& c, torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
      c.save(out);
      t.load(in);
    }
  void register_for_checkpointing(T& object) {
    prepared_.objects.push_back({[&object](torch::serialize::OutputArchive& out) { object.save(out); },
                                 [&object](torch::serialize::InputArchive& in) { object.load(in); }});
  }

  // -- the prepared models' DataParallels ------------------------------------------------

  // The DataParallel of the first prepared model, or of `model`; nullptr
  // when it was not prepared.
  DataParallel* data_parallel() {
    return prepared_.models.empty() ? nullptr : prepared_.models.front().data_parallel.get();
  }
  template <class ModuleHolder>
  DataParallel* data_parallel(ModuleHolder& model) {
    detail::PreparedModel* p = prepared_.find(model.ptr().get());
    return p ? p->data_parallel.get() : nullptr;
  }

 protected:
  template <class ModuleHolder>
  detail::PreparedModel* find_prepared(ModuleHolder& model, const char* op) {
    if (detail::PreparedModel* p = prepared_.find(model.ptr().get())) return p;
    throw InvalidArgument(std::string("accel::Accelerator::") + op + ": the model was not prepared");
  }
  // Forgets everything prepared (free_memory, once the models are plain modules again).
  void let_go_of_prepared() {
    prepared_.sharded->clear();                 // the optimizers' handles stop gathering
    auto scaler = std::move(prepared_.scaler);  // (the scaler is the Accelerator's, as Accelerate's)
    prepared_ = {};
    prepared_.scaler = std::move(scaler);
  }

  detail::PreparedSet prepared_;
  std::shared_ptr<detail::GradientState> state_ = std::make_shared<detail::GradientState>();
};
}  // namespace detail

ACCEL_NAMESPACE_END
