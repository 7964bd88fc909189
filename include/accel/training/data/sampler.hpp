// accel/training/data/sampler.hpp: data loading: ShardSampler, which deals out each process's share of a dataset.
//
// A prepared loader gives each process of the data-parallel group its share
// of a dataset, in one of two layouts:
//   BATCHES (default, Accelerate's BatchSamplerShard): the one-process batch
//     sequence (the dataset in order, or permuted with randperm under a
//     generator seeded with seed + epoch, cut into batches) is dealt out
//     whole: process p gets batches p, p + P, p + 2P, ... (with
//     split_batches, every process gets its 1/P slice of every batch). So
//     without shuffle a gathered pass is the dataset in order. even_batches
//     completes the last round by cycling from the start of the sequence;
//     without it the last round may leave some processes a batch short.
//   SAMPLES (torch's DistributedSampler, for the same seed and epoch):
//     process p gets samples p, p + P, ... of the permutation, batched
//     locally; even_batches repeats samples from the start so that every
//     process gets as many.
// drop_last drops the incomplete last batch (BATCHES: of the sequence, and
// then any round that is not complete; SAMPLES: of each process).
// Every slot knows whether it repeats a sample (even_batches padding), so
// gather_for_metrics counts each sample exactly once.
//
// Why not LibTorch's DistributedRandomSampler? It shuffles with std::shuffle,
// whose output differs between standard libraries (ranks built against
// libstdc++ and libc++ would read overlapping shards), and it scatters the
// repeated samples through the shards, so they could not be told apart.
#pragma once

#include "accel/core/enums.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

enum class ShardLayout { BATCHES, SAMPLES };
namespace detail {
template <>
struct enum_names<ShardLayout> {
  static constexpr std::string_view type = "ShardLayout";
  static constexpr std::array<std::string_view, 2> names{"BATCHES", "SAMPLES"};
};
}  // namespace detail

// The one-process batch sequence of an epoch, as lists of sample indices:
// a custom sampler or batch sampler for prepare_data_loader.
using BatchSamplerFn = std::function<std::vector<std::vector<size_t>>(size_t epoch)>;

namespace detail {
struct Slot {
  size_t index;
  bool real;  // false: a repeat that fills the last batches (even_batches)
};
using SlotBatch = std::vector<Slot>;

// v += v: v followed by itself, as Python's list doubling (a vector
// cannot insert its own range).
template <class T>
void append_self(std::vector<T>& v) {
  const std::vector<T> copy = v;
  v.insert(v.end(), copy.begin(), copy.end());
}

inline SlotBatch slots(const std::vector<size_t>& indices, bool real, size_t from = 0, size_t to = SIZE_MAX) {
  SlotBatch out;
  for (size_t i = from; i < std::min(to, indices.size()); ++i) out.push_back({indices[i], real});
  return out;
}

// Accelerate's BatchSamplerShard, line by line (src/accelerate/data_loader.py),
// over the one-process batch sequence `batches`: this process's batches.
// batch_size is the sampler's (nullopt: batches of varying size).
inline std::vector<SlotBatch> shard_batches(const std::vector<std::vector<size_t>>& batches,
                                            std::optional<size_t> batch_size, size_t processes, size_t process,
                                            bool split_batches, bool even_batches, bool drop_last) {
  std::vector<SlotBatch> out;
  if (processes == 1) {  // Accelerate does not shard for one process: the plain batches
    for (const auto& batch : batches) out.push_back(slots(batch, true));
    return out;
  }
  if (batches.empty()) return out;
  if (split_batches) {  // _iter_with_split
    const size_t size = *batch_size, part = size / processes;
    for (const auto& batch : batches)
      if (batch.size() == size) out.push_back(slots(batch, true, part * process, part * (process + 1)));
    const std::vector<size_t>& last = batches.back();
    if (drop_last || last.size() >= size) return out;
    if (!even_batches) {
      if (last.size() > part * process) out.push_back(slots(last, true, part * process, part * (process + 1)));
      return out;
    }
    std::vector<size_t> initial = batches.front();
    while (initial.size() < size) append_self(initial);
    SlotBatch full = slots(last, true);
    for (size_t i : initial) full.push_back({i, false});
    out.emplace_back(full.begin() + static_cast<std::ptrdiff_t>(part * process),
                     full.begin() + static_cast<std::ptrdiff_t>(std::min(full.size(), part * (process + 1))));
    return out;
  }
  // _iter_with_no_split
  auto full = [&](const std::vector<size_t>& batch) { return !batch_size || batch.size() == *batch_size; };
  std::vector<std::vector<size_t>> initial;  // the first `processes` batches, to cycle through at the end
  std::optional<std::vector<size_t>> to_yield;
  for (size_t idx = 0; idx < batches.size(); ++idx) {
    if (!drop_last && idx < processes) initial.push_back(batches[idx]);
    if (idx % processes == process) to_yield = batches[idx];
    if (idx % processes == processes - 1 && full(batches[idx])) {
      out.push_back(slots(*to_yield, true));
      to_yield.reset();
    }
  }
  if (drop_last) return out;
  if (!even_batches) {
    if (to_yield && !to_yield->empty()) out.push_back(slots(*to_yield, true));
    return out;
  }
  if (to_yield && !to_yield->empty() && full(*to_yield)) out.push_back(slots(*to_yield, true));
  size_t idx = batches.size() - 1;
  SlotBatch batch = slots(batches.back(), true);
  if (full(batches.back())) {
    batch.clear();
    ++idx;
  }
  if (!batch_size) {  // cycle through whole batches
    while (initial.size() < processes) append_self(initial);
    for (size_t cycle = 0; idx % processes != 0 || !batch.empty(); ++cycle, ++idx) {
      batch = slots(initial[cycle], false);
      if (idx % processes == process) out.push_back(batch);
      batch.clear();
    }
    return out;
  }
  std::vector<size_t> flat;
  for (const auto& b : initial) flat.insert(flat.end(), b.begin(), b.end());
  while (flat.size() < processes * *batch_size) append_self(flat);
  for (size_t cycle = 0; idx % processes != 0 || !batch.empty(); ++idx) {
    const size_t end = cycle + *batch_size - batch.size();
    for (size_t i = cycle; i < end; ++i) batch.push_back({flat[i], false});
    if (idx % processes == process) out.push_back(batch);
    cycle = end;
    batch.clear();
  }
  return out;
}
}  // namespace detail

// A batch sampler for LibTorch's data loader that yields this process's
// batches (in the layouts at the top of this part); it ignores the loader's batch size.
class ShardSampler : public torch::data::samplers::Sampler<> {
 public:
  struct Options {
    size_t size = 0;  // of the dataset
    size_t num_replicas = 1, rank = 0;
    size_t batch_size = 1;  // the one-process batch (BATCHES with split_batches: the global batch)
    bool shuffle = false;
    uint64_t seed = 0;
    bool even_batches = true, drop_last = false, split_batches = false;
    ShardLayout layout = ShardLayout::BATCHES;
    BatchSamplerFn batch_sampler{};  // BATCHES only: replaces shuffle and batch_size
    // The batch size the custom batch sampler states (Python's
    // batch_sampler.batch_size): every batch but the last holds this many,
    // the last at most as many, and even_batches fills a short last batch up
    // to it (as Accelerate fills a BatchSampler's). Unset: its batches may
    // vary, and the last round is completed with whole batches.
    std::optional<size_t> batch_sampler_batch_size{};
  };
  // What the loader learns at the start of each pass: the number of real
  // (non-repeated) samples of each of this process's batches, in order.
  struct Record {
    std::vector<size_t> real_per_batch;
    size_t epoch = 0;
    size_t skip = 0;  // the next reset() starts after this many batches (then 0)
    // Replaces Options::even_batches from the next reset() on, while set
    // (Accelerator::join_uneven_inputs' even_batches).
    std::optional<bool> even_batches{};
  };

  explicit ShardSampler(Options options, std::shared_ptr<Record> record = std::make_shared<Record>())
      : options_(std::move(options)), record_(std::move(record)) {
    const Options& o = options_;
    auto fail = [](const std::string& why) { throw InvalidArgument("accel::ShardSampler: " + why); };
    if (o.num_replicas == 0 || o.rank >= o.num_replicas)
      fail("rank " + std::to_string(o.rank) + " of " + std::to_string(o.num_replicas) + " replicas");
    if (o.batch_size == 0) fail("batch_size must be at least 1");
    if (o.batch_sampler && o.layout != ShardLayout::BATCHES)
      fail("a custom batch sampler needs ShardLayout::BATCHES (SAMPLES deals out single samples)");
    if (o.batch_sampler_batch_size && !o.batch_sampler)
      fail("batch_sampler_batch_size states the size of a custom batch sampler's batches; there is none");
    if (o.batch_sampler_batch_size == size_t{0}) fail("batch_sampler_batch_size must be at least 1");
    if (o.batch_sampler && o.split_batches && !o.batch_sampler_batch_size)
      fail(
          "split_batches needs a fixed batch size; a custom batch sampler's batches may vary (state its size in "
          "batch_sampler_batch_size)");
    const size_t batch = o.batch_sampler ? o.batch_sampler_batch_size.value_or(0) : o.batch_size;
    if (o.split_batches && o.layout == ShardLayout::BATCHES && batch % o.num_replicas != 0)
      fail("with split_batches the batch size (" + std::to_string(batch) + ") must be a multiple of the " +
           std::to_string(o.num_replicas) + " processes");
    reset();
  }

  void reset(torch::optional<size_t> new_size = torch::nullopt) override {
    if (new_size) options_.size = *new_size;
    const Options& o = options_;
    const bool even_batches = record_->even_batches.value_or(o.even_batches);
    epoch_ = record_->epoch;
    next_ = 0;
    std::vector<size_t> order;  // the dataset's order for this epoch (not needed with a batch sampler)
    if (!o.batch_sampler) {
      order.resize(o.size);
      std::iota(order.begin(), order.end(), size_t{0});
    }
    if (o.shuffle && o.size > 0 && !o.batch_sampler) {  // torch's RandomSampler / DistributedSampler permutation
      at::Generator generator = at::detail::createCPUGenerator(o.seed + epoch_);
      const at::Tensor permutation = at::randperm(static_cast<int64_t>(o.size), generator, at::kLong).contiguous();
      std::copy_n(permutation.data_ptr<int64_t>(), o.size, order.begin());
    }
    batches_.clear();
    if (o.layout == ShardLayout::SAMPLES) {
      const size_t total =
          even_batches && o.size > 0 ? (o.size + o.num_replicas - 1) / o.num_replicas * o.num_replicas : o.size;
      const size_t local = o.split_batches ? o.batch_size / o.num_replicas : o.batch_size;
      detail::SlotBatch mine;
      for (size_t position = o.rank; position < total; position += o.num_replicas)
        mine.push_back({order[position % o.size], position < o.size});
      for (size_t i = 0; i < mine.size(); i += std::max<size_t>(local, 1))
        batches_.emplace_back(mine.begin() + static_cast<std::ptrdiff_t>(i),
                              mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), i + local)));
      if (o.drop_last && !batches_.empty() && batches_.back().size() < local) batches_.pop_back();
    } else {
      std::vector<std::vector<size_t>> sequence;
      if (o.batch_sampler) {
        sequence = o.batch_sampler(epoch_);
        for (size_t b = 0; b < sequence.size(); ++b) {
          for (size_t i : sequence[b])
            if (i >= o.size)
              throw OutOfRange("accel::ShardSampler: the batch sampler's batch " + std::to_string(b) + " holds index " +
                               std::to_string(i) + ", past the dataset's " + std::to_string(o.size) + " samples");
          const std::optional<size_t> stated = o.batch_sampler_batch_size;
          const bool last = b + 1 == sequence.size();
          if (stated && (sequence[b].size() > *stated || (!last && sequence[b].size() != *stated)))
            throw InvalidArgument("accel::ShardSampler: the batch sampler's batch " + std::to_string(b) + " holds " +
                                  std::to_string(sequence[b].size()) + " indices, but it states batches of " +
                                  std::to_string(*stated) + " (only the last may hold fewer)");
        }
      } else {
        for (size_t i = 0; i < order.size(); i += o.batch_size)
          if (i + o.batch_size <= order.size() || !o.drop_last)
            sequence.emplace_back(
                order.begin() + static_cast<std::ptrdiff_t>(i),
                order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), i + o.batch_size)));
      }
      batches_ = detail::shard_batches(sequence, o.batch_sampler ? o.batch_sampler_batch_size : o.batch_size,
                                       o.num_replicas, o.rank, o.split_batches, even_batches, o.drop_last);
    }
    record_->real_per_batch.clear();
    for (const auto& batch : batches_)
      record_->real_per_batch.push_back(
          static_cast<size_t>(std::count_if(batch.begin(), batch.end(), [](const detail::Slot& s) { return s.real; })));
    next_ = std::min(std::exchange(record_->skip, 0), batches_.size());
  }

  torch::optional<std::vector<size_t>> next(size_t) override {
    if (next_ >= batches_.size()) return torch::nullopt;
    std::vector<size_t> indices;
    for (const auto& slot : batches_[next_]) indices.push_back(slot.index);
    ++next_;
    return indices;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("epoch", at::tensor(static_cast<int64_t>(epoch_)), true);
    archive.write("next", at::tensor(static_cast<int64_t>(next_)), true);
  }
  void load(torch::serialize::InputArchive& archive) override {
    at::Tensor epoch, next;
    archive.read("epoch", epoch, true);
    archive.read("next", next, true);
    record_->epoch = static_cast<size_t>(epoch.item<int64_t>());
    reset();
    next_ = std::min(batches_.size(), static_cast<size_t>(next.item<int64_t>()));
  }

  // This process's batches for the current epoch, in order (repeats included).
  std::vector<std::vector<size_t>> batches() const {
    std::vector<std::vector<size_t>> out;
    for (const auto& batch : batches_) {
      out.emplace_back();
      for (const auto& slot : batch) out.back().push_back(slot.index);
    }
    return out;
  }
  // The same, as one list.
  std::vector<size_t> indices() const {
    std::vector<size_t> out;
    for (const auto& batch : batches_)
      for (const auto& slot : batch) out.push_back(slot.index);
    return out;
  }
  size_t batch_count() const { return batches_.size(); }
  // How many samples this process reads per pass (repeats included).
  size_t local_count() const {
    size_t n = 0;
    for (const auto& batch : batches_) n += batch.size();
    return n;
  }
  // How many of them are real samples, not repeats.
  size_t real_count() const {
    return std::accumulate(record_->real_per_batch.begin(), record_->real_per_batch.end(), size_t{0});
  }

 private:
  Options options_;
  std::shared_ptr<Record> record_;
  std::vector<detail::SlotBatch> batches_;
  size_t epoch_ = 0, next_ = 0;
};

ACCEL_NAMESPACE_END
