// accel/training/accelerator/preparing.hpp: the Accelerator's prepare() in all its forms, and letting go of what it prepared.
//
// Each prepared thing is listed in the PreparedSet, which the training step
// reads and checkpoints save and load; the optimizers, schedulers and
// loaders share the GradientState.
#pragma once

#include "accel/training/accelerator/accelerator.hpp"

ACCEL_NAMESPACE_BEGIN

template <class ModuleHolder>
  requires detail::module_holder<ModuleHolder>
ModuleHolder& Accelerator::prepare(ModuleHolder& model) {
  auto module = std::static_pointer_cast<torch::nn::Module>(model.ptr());
  if (prepared_.find(module.get()))
    throw InvalidArgument("accel::Accelerator::prepare: this model is already prepared");
  model->to(device());
  // Beside tp the whole tensors first agree across each tp group (before a FULL_SHARD wrapper takes the
  // parameters' memory); the wrapper then starts every dp_cp group from its first rank.
  detail::tp::SplitTensors split = detail::tp::split_tensors(*module);
  detail::tp::broadcast_whole_tensors(*module, split);
  prepared_.models.push_back(detail::PreparedModel{module, setup_.data_parallel_for(module), std::move(split)});
  if (setup_.sharded()) {
    prepared_.sharded->push_back(prepared_.models.back().data_parallel.get());
    for (auto* optimizer : prepared_.optimizers) prepared_.sharded->back()->shard_optimizer(*optimizer);
  }
  return model;
}

inline AcceleratedOptimizer Accelerator::prepare(torch::optim::Optimizer& optimizer) {
  detail::take_parameters_once(optimizer, prepared_);
  if (std::find(prepared_.optimizers.begin(), prepared_.optimizers.end(), &optimizer) == prepared_.optimizers.end())
    prepared_.optimizers.push_back(&optimizer);
  if (!setup_.sharded()) return AcceleratedOptimizer(optimizer, state_, {}, prepared_.scaler);
  for (DataParallel* dp : *prepared_.sharded) dp->shard_optimizer(optimizer);
  return AcceleratedOptimizer(
      optimizer, state_,
      [sharded = prepared_.sharded, &optimizer] {
        for (DataParallel* dp : *sharded)
          if (dp->steps_with(optimizer)) dp->gather_shards();
      },
      prepared_.scaler);
}

template <detail::scheduler_like Scheduler>
AcceleratedScheduler Accelerator::prepare(Scheduler& scheduler) {
  auto found = std::find_if(prepared_.schedulers.begin(), prepared_.schedulers.end(),
                            [&](const detail::PreparedScheduler& p) { return p.address == &scheduler; });
  if (found == prepared_.schedulers.end()) {
    detail::PreparedScheduler p{&scheduler, std::make_shared<int64_t>(0), [&scheduler] { scheduler.step(); }, {}, {}};
    if constexpr (detail::checkpointable<Scheduler>) {
      p.save = [&scheduler](torch::serialize::OutputArchive& out) { scheduler.save(out); };
      p.load = [&scheduler](torch::serialize::InputArchive& in) { scheduler.load(in); };
    }
    prepared_.schedulers.push_back(std::move(p));
    found = std::prev(prepared_.schedulers.end());
  }
  return AcceleratedScheduler(scheduler, state_,
                              setup_.config().split_batches ? 1 : setup_.world().get_world_size(Dim::DP), found->steps);
}

template <class First, class Second, class... Rest>
auto Accelerator::prepare(First& first, Second& second, Rest&... rest) {
  return std::tuple<decltype(prepare(first)), decltype(prepare(second)), decltype(prepare(rest))...>{
      prepare(first), prepare(second), prepare(rest)...};  // braces: prepared left to right
}

template <class ModuleHolder>
  requires detail::module_holder<ModuleHolder>
ModuleHolder& Accelerator::prepare_model(ModuleHolder& model) {
  return prepare(model);
}
inline AcceleratedOptimizer Accelerator::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  return prepare(optimizer);
}
template <detail::scheduler_like Scheduler>
AcceleratedScheduler Accelerator::prepare_scheduler(Scheduler& scheduler) {
  return prepare(scheduler);
}

template <class Dataset>
auto Accelerator::prepare_data_loader(Dataset dataset, DataLoaderConfig config) {
  const int replicas = setup_.world().get_world_size(Dim::DP);
  const bool split_batches = setup_.config().split_batches;
  if (config.batch_size == 0) throw InvalidArgument("accel::prepare_data_loader: batch_size must be at least 1");
  if (split_batches && config.batch_size % static_cast<size_t>(replicas) != 0)
    throw InvalidArgument("accel::prepare_data_loader: with split_batches the batch size (" +
                          std::to_string(config.batch_size) + ") must be a multiple of the " +
                          std::to_string(replicas) + " data-parallel processes");
  using Loader =
      std::conditional_t<IterableDataset<Dataset>, PreparedIterableDataLoader<Dataset>, PreparedDataLoader<Dataset>>;
  auto position = std::make_shared<detail::LoaderPosition>();  // its place in its passes goes into checkpoints
  const size_t batch = config.batch_sampler ? config.batch_sampler_batch_size.value_or(0) : config.batch_size;
  position->samples_per_batch = split_batches ? batch : batch * static_cast<size_t>(replicas);
  prepared_.loaders.push_back(position);
  return Loader(std::move(dataset), config, setup_.world().get_group(Dim::DP), split_batches, state_,
                prepared_.loaders.back());
}

template <detail::skips_batches Loader>
Loader& Accelerator::skip_first_batches(Loader& loader, size_t n) {
  loader.skip_first_batches(n);
  return loader;
}

template <detail::checkpointable T>
void Accelerator::register_for_checkpointing(T& object) {
  prepared_.objects.push_back({[&object](torch::serialize::OutputArchive& out) { object.save(out); },
                               [&object](torch::serialize::InputArchive& in) { object.load(in); }});
}

inline DataParallel* Accelerator::data_parallel() {
  return prepared_.models.empty() ? nullptr : prepared_.models.front().data_parallel.get();
}
template <class ModuleHolder>
DataParallel* Accelerator::data_parallel(ModuleHolder& model) {
  detail::PreparedModel* p = prepared_.find(model.ptr().get());
  return p ? p->data_parallel.get() : nullptr;
}
template <class ModuleHolder>
ModuleHolder& Accelerator::unwrap_model(ModuleHolder& model) const {
  return model;
}

inline void Accelerator::free_memory() {
  if (join_) throw LogicError("accel::Accelerator::free_memory: inside join_uneven_inputs");
  detail::every_process_calls("accel::Accelerator::free_memory", [&] {
    for (auto& m : prepared_.models) m.data_parallel->release_module();
  });
  let_go_of_prepared();
  step_ = 0;
  state_->sync_gradients = true;
}
inline void Accelerator::clear() { free_memory(); }

template <class ModuleHolder>
detail::PreparedModel* Accelerator::find_prepared(ModuleHolder& model, const char* op) {
  if (detail::PreparedModel* p = prepared_.find(model.ptr().get())) return p;
  throw InvalidArgument(std::string("accel::Accelerator::") + op + ": the model was not prepared");
}
inline void Accelerator::let_go_of_prepared() {
  prepared_.sharded->clear();                 // the optimizers' handles stop gathering
  auto scaler = std::move(prepared_.scaler);  // (the scaler is the Accelerator's, as Accelerate's)
  prepared_ = {};
  prepared_.scaler = std::move(scaler);
}

ACCEL_NAMESPACE_END
