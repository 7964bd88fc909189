// accel/training/data/loaders.hpp: PreparedDataLoader and PreparedIterableDataLoader.
#pragma once

#include "accel/training/data/dispatch.hpp"

ACCEL_NAMESPACE_BEGIN

// A LibTorch data loader over this process's share. Iterating it starts a
// new epoch each pass (a different shuffle, the same on every rank, as
// Accelerate's prepared loaders do) and tells the Accelerator where the pass
// is (end_of_dataloader) and which rows of each batch are repeats, so that
// gather_for_metrics drops them. A pass left early (break) ends with its
// iterator. With dispatch_batches only the main process reads (accel/training/data/dispatch.hpp).
template <class Dataset>
class PreparedDataLoader {
 public:
  using Loader = torch::data::StatelessDataLoader<Dataset, ShardSampler>;
  using Batch = typename Dataset::BatchType;
  using Iterator = detail::PassIterator<PreparedDataLoader, Batch>;

  // `group`: the data-parallel group (null: one process).
  PreparedDataLoader(Dataset dataset, const DataLoaderConfig& config, GroupPtr group, bool split_batches,
                     std::shared_ptr<detail::GradientState> gradient_state,
                     std::shared_ptr<detail::LoaderPosition> position = std::make_shared<detail::LoaderPosition>())
      : record_(std::make_shared<ShardSampler::Record>()),
        state_(std::make_shared<detail::LoaderState>()),
        gradient_state_(std::move(gradient_state)),
        position_(std::move(position)) {
    const torch::optional<size_t> size = dataset.size();
    if (!size) throw InvalidArgument("accel::prepare_data_loader: the dataset must have a size()");
    const size_t processes = group ? static_cast<size_t>(group->getSize()) : 1;
    const size_t rank = group ? static_cast<size_t>(group->getRank()) : 0;
    GroupPtr dispatch = detail::dispatch_group<Batch>(config, false, group);
    // Dispatching, the main process reads the unsharded one-process batches
    // (global ones with split_batches); every process plans the pass from them.
    ShardSampler::Options options{*size,
                                  dispatch ? 1 : processes,
                                  dispatch ? 0 : rank,
                                  config.batch_size,
                                  config.shuffle,
                                  config.seed,
                                  config.even_batches,
                                  config.drop_last,
                                  dispatch ? false : split_batches,
                                  config.layout,
                                  config.batch_sampler,
                                  config.batch_sampler_batch_size};
    ShardSampler sampler(std::move(options), record_);
    if (!dispatch) {
      batches_ = sampler.batch_count();
    } else {
      if constexpr (detail::Dispatchable<Batch>) {
        const size_t per_step = split_batches ? 1 : processes;
        batches_ =
            config.drop_last ? sampler.batch_count() / per_step : (sampler.batch_count() + per_step - 1) / per_step;
        dispatcher_ = std::make_unique<detail::Dispatcher<Batch>>(dispatch);
        per_step_ = per_step;
        drop_last_ = config.drop_last;
        if (!dispatcher_->main()) return;  // the others never read
      }
    }
    // The sampler makes the batches (and drops what drop_last drops).
    loader_ = torch::data::make_data_loader(std::move(dataset), std::move(sampler),
                                            torch::data::DataLoaderOptions(1).workers(config.workers));
  }

  // Starts a pass: epoch 0, 1, 2, ... unless set_epoch says otherwise.
  Iterator begin() {
    const size_t skip = position_->begin();
    record_->epoch = position_->epoch;
    index_ = 0;
    started_ = exhausted_ = false;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) {
        if (loader_) it_.emplace(loader_->begin());  // the main process reads
        dispatcher_->begin([this] { return global_batch(); });
        for (size_t i = 0; i < skip && next(); ++i) {
        }  // every process reads and drops the same batches
        return Iterator(this, detail::Pass(gradient_state_, state_, this));
      }
    // The sampler starts after the skipped batches: none is read. It plans
    // the pass when LibTorch's loader begins (with the even_batches of
    // join_uneven_inputs, where one is set), which gives the pass's length.
    record_->skip = skip;
    record_->even_batches = position_->even_batches;
    it_.emplace(loader_->begin());
    batches_ = record_->real_per_batch.size();
    index_ = std::min(skip, batches_);
    position_->handed_out = index_;
    return Iterator(this, detail::Pass(gradient_state_, state_, this));
  }
  Iterator end() { return Iterator(); }

  // The epoch the next pass uses (to resume a run mid-way).
  void set_epoch(size_t epoch) { position_->next_epoch = epoch; }
  size_t next_epoch() const { return position_->next_epoch; }
  size_t epoch() const { return record_->epoch; }
  // The next pass starts after its first n batches, without reading them
  // where the sampler can skip (Accelerate's skip_first_batches).
  void skip_first_batches(size_t n) { position_->skip = n; }
  // Batches per pass on this process (the same on every process with
  // even_batches or dispatch_batches); during a pass, that pass's.
  size_t batches() const { return batches_; }
  // Where the loader stands, as torchdata's StatefulDataLoader (Accelerate's
  // use_stateful_dataloader): {"epoch", "batches_handed_out"} (inside a
  // pass: that pass and the batches handed out so far; after it: the next
  // pass and the batches it is to skip, 0 unless a load or
  // skip_first_batches set them), a c10::Dict that torch::pickle_save stores.
  // load_state_dict makes the next pass resume right after those batches.
  c10::Dict<std::string, int64_t> state_dict() const { return position_->state_dict(); }
  void load_state_dict(const c10::Dict<std::string, int64_t>& state) { position_->load_state_dict(state); }

 private:
  friend Iterator;
  // The next one-process batch from LibTorch's loader, and how many of its rows are real.
  std::optional<std::pair<Batch, size_t>> local_batch() {
    if (exhausted_) return std::nullopt;
    if (std::exchange(started_, true)) ++*it_;
    if (*it_ == loader_->end()) {
      exhausted_ = true;
      return std::nullopt;
    }
    const size_t real = record_->real_per_batch.at(index_++);
    return std::pair<Batch, size_t>(std::move(**it_), real);
  }
  // Dispatching: the next global batch (on the main process).
  std::optional<Batch> global_batch() {
    if constexpr (detail::Dispatchable<Batch>) {
      std::vector<Batch> parts;
      while (parts.size() < per_step_)
        if (auto batch = local_batch()) parts.push_back(std::move(batch->first));
        else break;
      if (parts.empty() || (drop_last_ && parts.size() < per_step_)) return std::nullopt;
      return detail::batch_cat(std::move(parts));
    } else {
      return std::nullopt;
    }
  }
  std::optional<detail::RankBatch<Batch>> next() {
    std::optional<detail::RankBatch<Batch>> share;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) share = dispatcher_->read();
    if (!dispatcher_)
      if (auto batch = local_batch())
        share = detail::RankBatch<Batch>{std::move(batch->first), batch->second, index_ == batches_};
    position_->count(share);
    return share;
  }

  std::shared_ptr<ShardSampler::Record> record_;
  std::shared_ptr<detail::LoaderState> state_;
  std::shared_ptr<detail::GradientState> gradient_state_;
  std::unique_ptr<Loader> loader_;  // null on the processes a dispatcher sends to
  std::optional<torch::data::Iterator<Batch>> it_;
  std::unique_ptr<detail::Dispatcher<Batch>> dispatcher_;
  std::shared_ptr<detail::LoaderPosition> position_;
  size_t batches_ = 0, index_ = 0, per_step_ = 1;  // index_: the next batch's, in this process's pass
  bool drop_last_ = false, exhausted_ = false, started_ = false;
};

// A prepared loader over an iterable dataset: a LibTorch StatefulDataset
// (e.g. ChunkDataset) whose get_batch(n) yields up to n elements, nullopt at
// the end of the stream. Batches are std::vector of the elements; each pass
// resets the dataset; read on the calling thread (LibTorch's loader workers
// are not used). Of each global batch (batch_size elements per process, or
// batch_size in all with split_batches) a process gets its slice:
//   - dispatch_batches (the default for iterable datasets, as Accelerate):
//     the main process reads the stream and sends every process its rows
//     (accel/training/data/dispatch.hpp);
//   - otherwise every process reads the whole stream and keeps its slice,
//     as Accelerate's IterableDatasetShard: unless drop_last the last global
//     batch is completed to full size from the first one.
// Either way the repeats are dropped by gather_for_metrics.
template <class Dataset>
class PreparedIterableDataLoader {
 public:
  using Element = typename std::remove_cvref_t<decltype(*std::declval<typename Dataset::BatchType>())>::value_type;
  using Batch = std::vector<Element>;
  using Iterator = detail::PassIterator<PreparedIterableDataLoader, Batch>;

  PreparedIterableDataLoader(
      Dataset dataset, const DataLoaderConfig& config, GroupPtr group, bool split_batches,
      std::shared_ptr<detail::GradientState> gradient_state,
      std::shared_ptr<detail::LoaderPosition> position = std::make_shared<detail::LoaderPosition>())
      : dataset_(std::move(dataset)),
        processes_(group ? static_cast<size_t>(group->getSize()) : 1),
        rank_(group ? static_cast<size_t>(group->getRank()) : 0),
        global_(split_batches ? config.batch_size : config.batch_size * processes_),
        local_(split_batches ? config.batch_size / processes_ : config.batch_size),
        drop_last_(config.drop_last),
        state_(std::make_shared<detail::LoaderState>()),
        gradient_state_(std::move(gradient_state)),
        position_(std::move(position)) {
    if (config.shuffle || config.batch_sampler || config.layout != ShardLayout::BATCHES)
      throw InvalidArgument(
          "accel::prepare_data_loader: an iterable dataset is read in its own order (no shuffle, batch_sampler or "
          "SAMPLES layout)");
    if (GroupPtr dispatch = detail::dispatch_group<Batch>(config, true, group))
      if constexpr (detail::Dispatchable<Batch>)
        dispatcher_ = std::make_unique<detail::Dispatcher<Batch>>(std::move(dispatch));
  }

  // Starts a pass. A stream cannot seek: skipped batches are read and dropped.
  Iterator begin() {
    const size_t skip = position_->begin();
    first_.clear();
    done_ = false;
    ahead_.reset();
    bool dispatching = false;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) {
        dispatching = true;
        if (dispatcher_->main()) dataset_.reset();
        dispatcher_->begin([this] { return global_batch(); });
      }
    if (!dispatching) {
      dataset_.reset();
      ahead_ = slice();
    }
    for (size_t i = 0; i < skip && next(); ++i) {
    }
    return Iterator(this, detail::Pass(gradient_state_, state_, this));
  }
  Iterator end() { return Iterator(); }
  // The next pass starts after its first n batches (Accelerate's
  // skip_first_batches; they are read and dropped).
  void skip_first_batches(size_t n) { position_->skip = n; }
  size_t next_epoch() const { return position_->next_epoch; }
  // As PreparedDataLoader's (a resumed stream reads and drops the batches already handed out).
  c10::Dict<std::string, int64_t> state_dict() const { return position_->state_dict(); }
  void load_state_dict(const c10::Dict<std::string, int64_t>& state) { position_->load_state_dict(state); }

 private:
  friend Iterator;
  std::optional<detail::RankBatch<Batch>> next() {
    std::optional<detail::RankBatch<Batch>> current;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) current = dispatcher_->read();
    if (!dispatcher_) {
      current = std::move(ahead_);  // one ahead: end_of_dataloader is known
      ahead_ = current ? slice() : std::nullopt;
      if (current) current->last = !ahead_;
    }
    position_->count(current);
    return current;
  }

  // The next global batch of the stream: global_ elements, fewer at its end
  // (nullopt when nothing is left, or with drop_last when it is incomplete).
  std::optional<Batch> global_batch() {
    if (done_) return std::nullopt;
    Batch global;
    while (global.size() < global_) {
      auto more = dataset_.get_batch(global_ - global.size());
      if (!more) break;
      for (auto& element : *more) global.push_back(std::move(element));
    }
    if (global.size() > global_) global.resize(global_);  // a dataset that returned more than asked
    if (global.size() < global_) {
      done_ = true;
      if (drop_last_ || global.empty()) return std::nullopt;
    }
    return global;
  }

  // This process's slice of the next global batch (IterableDatasetShard.__iter__).
  std::optional<detail::RankBatch<Batch>> slice() {
    std::optional<Batch> global = global_batch();
    if (!global) return std::nullopt;
    const size_t real_size = global->size();
    if (processes_ == 1)
      return detail::RankBatch<Batch>{std::move(*global), real_size, false};  // not sharded, as Accelerate
    if (first_.empty()) first_ = *global;
    while (global->size() < global_) global->insert(global->end(), first_.begin(), first_.end());
    const size_t begin = rank_ * local_;
    return detail::RankBatch<Batch>{Batch(global->begin() + static_cast<std::ptrdiff_t>(begin),
                                          global->begin() + static_cast<std::ptrdiff_t>(begin + local_)),
                                    real_size > begin ? std::min(local_, real_size - begin) : 0, false};
  }

  Dataset dataset_;
  size_t processes_, rank_, global_, local_;
  bool drop_last_;
  Batch first_;
  bool done_ = false;
  std::optional<detail::RankBatch<Batch>> ahead_;
  std::unique_ptr<detail::Dispatcher<Batch>> dispatcher_;
  std::shared_ptr<detail::LoaderState> state_;
  std::shared_ptr<detail::GradientState> gradient_state_;
  std::shared_ptr<detail::LoaderPosition> position_;
};

namespace detail {
// torch::optional<std::vector<T>> (c10::optional before LibTorch 2.4, std::optional since).
template <class B>
concept optional_vector = requires(B& b) {
  { b.has_value() } -> std::convertible_to<bool>;
  *b;
} && is_vector<std::remove_cvref_t<decltype(*std::declval<B&>())>>::value;
}  // namespace detail

// An iterable dataset as LibTorch has them: a StatefulDataset whose batches
// are optional vectors of elements (nullopt: the stream ended).
template <class D>
concept IterableDataset = requires(D& d) {
  d.reset();
  { d.get_batch(std::size_t{1}) } -> std::same_as<typename D::BatchType>;
} && detail::optional_vector<typename D::BatchType>;

ACCEL_NAMESPACE_END
