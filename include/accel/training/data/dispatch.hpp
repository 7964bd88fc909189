// accel/training/data/dispatch.hpp: dispatch_batches: one rank reads, the others receive their slices.
//
// With dispatch_batches the main process of the data-parallel group reads
// every global batch (P one-process batches concatenated, or one batch of
// the global size with split_batches) and sends each process its rows, as
// Accelerate's DataLoaderDispatcher: of a global batch of R rows, process p
// gets rows [p n, (p + 1) n) with n = R / P. When R does not divide by P (the
// last batch, or any batch of a batch sampler's varying sizes) every process
// gets n + 1 rows, completed from the first global batch (cycled if that one
// is short); those repeats are marked, so gather_for_metrics drops them. The
// other processes never read the dataset. Accelerate broadcasts the whole
// batch and every process slices it; here each process receives only its
// own rows (detail::scatter_bytes), pickled as gather_object's objects.
// A batch that can be dispatched is either
//   - a std::vector of samples (what LibTorch's datasets return without a
//     Stack transform, and an iterable loader's batches): rows are elements;
//     a sample is a torch::data::Example or any Picklable value; or
//   - batched tensors: a torch::data::Example (e.g. after Stack<>) whose data
//     and target are nested tensors, or nested tensors (TensorTree): rows
//     along dim 0, the same number in every tensor.
#pragma once

#include "accel/distributed/objects.hpp"
#include "accel/training/data/loader_state.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
template <class T>
struct is_example : std::false_type {};
template <class D, class T>
struct is_example<torch::data::Example<D, T>> : std::true_type {};
template <class T>
constexpr bool no_target = std::is_same_v<T, torch::data::example::NoTarget>;

template <class T>
struct sample_travels : std::bool_constant<Picklable<T>> {};
template <class D, class T>
struct sample_travels<torch::data::Example<D, T>> : std::bool_constant<Picklable<D> && (Picklable<T> || no_target<T>)> {
};

template <class B>
struct batched_tensors : std::bool_constant<TensorTree<B> && !is_vector<B>::value> {};
template <class D, class T>
struct batched_tensors<torch::data::Example<D, T>>
    : std::bool_constant<TensorTree<D> && (TensorTree<T> || no_target<T>)> {};

template <class B>
concept SampleList = is_vector<B>::value && sample_travels<typename B::value_type>::value;
template <class B>
concept TensorBatch = batched_tensors<B>::value;
template <class B>
concept Dispatchable = SampleList<B> || TensorBatch<B>;

template <class B, class Fn>
void for_each_batch_tensor(B& batch, Fn& fn) {
  if constexpr (is_example<std::remove_const_t<B>>::value) {
    for_each_tensor(batch.data, fn);
    if constexpr (!no_target<decltype(batch.target)>) for_each_tensor(batch.target, fn);
  } else {
    for_each_tensor(batch, fn);
  }
}

template <Dispatchable B>
size_t batch_rows(const B& batch) {
  if constexpr (SampleList<B>) {
    return batch.size();
  } else {
    std::optional<int64_t> rows;
    size_t leaf = 0;
    auto check = [&](const at::Tensor& t) {
      auto fail = [&](const std::string& what) {
        throw InvalidArgument("accel::prepare_data_loader (dispatch_batches): tensor " + std::to_string(leaf) +
                              " of the batch is " + what +
                              "; every tensor of a dispatched batch holds the batch along dim 0");
      };
      if (!t.defined() || t.dim() == 0) fail("undefined or 0-d");
      if (!rows) rows = t.size(0);
      if (t.size(0) != *rows)
        fail("of " + std::to_string(t.size(0)) + " rows where the first has " + std::to_string(*rows));
      ++leaf;
    };
    for_each_batch_tensor(batch, check);
    if (!rows) throw InvalidArgument("accel::prepare_data_loader (dispatch_batches): the batch holds no tensor");
    return static_cast<size_t>(*rows);
  }
}

// Rows [from, to) of a batch.
template <Dispatchable B>
B batch_slice(const B& batch, size_t from, size_t to) {
  if constexpr (SampleList<B>) {
    return B(batch.begin() + static_cast<std::ptrdiff_t>(from), batch.begin() + static_cast<std::ptrdiff_t>(to));
  } else {
    B out = batch;
    auto cut = [&](at::Tensor& t) { t = t.slice(0, static_cast<int64_t>(from), static_cast<int64_t>(to)); };
    for_each_batch_tensor(out, cut);
    return out;
  }
}

// The batches' rows one after another.
template <Dispatchable B>
B batch_cat(std::vector<B>&& parts) {
  if (parts.size() == 1) return std::move(parts.front());
  if constexpr (SampleList<B>) {
    B out;
    for (auto& part : parts)
      out.insert(out.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    return out;
  } else if constexpr (is_example<B>::value) {
    using Data = decltype(B::data);
    using Target = decltype(B::target);
    std::vector<Data> data;
    std::vector<Target> targets;
    for (auto& part : parts) {
      data.push_back(std::move(part.data));
      targets.push_back(std::move(part.target));
    }
    if constexpr (no_target<Target>) return B{accel::concatenate(data), {}};
    else return B{accel::concatenate(data), accel::concatenate(targets)};
  } else {
    return accel::concatenate(parts);
  }
}

inline c10::IValue tuple_of(std::vector<c10::IValue> elements) {
  return c10::ivalue::Tuple::create(std::move(elements));
}

template <class S>
c10::IValue sample_to_ivalue(const S& sample) {
  if constexpr (is_example<S>::value) {
    c10::IValue target;  // None for NoTarget
    if constexpr (!no_target<decltype(sample.target)>) target = to_ivalue(sample.target);
    return tuple_of({to_ivalue(sample.data), std::move(target)});
  } else {
    return to_ivalue(sample);
  }
}
template <class S>
S sample_from_ivalue(const c10::IValue& v) {
  if constexpr (is_example<S>::value) {
    if (!v.isTuple() || v.toTupleRef().elements().size() != 2) wrong_object("(data, target) tuple", v);
    const c10::ArrayRef<c10::IValue> elements = v.toTupleRef().elements().asArrayRef();
    S sample;
    sample.data = from_ivalue<decltype(sample.data)>(elements[0]);
    if constexpr (!no_target<decltype(sample.target)>)
      sample.target = from_ivalue<decltype(sample.target)>(elements[1]);
    return sample;
  } else {
    return from_ivalue<S>(v);
  }
}
template <Dispatchable B>
c10::IValue batch_to_ivalue(const B& batch) {
  if constexpr (SampleList<B>) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(batch.size());
    for (const auto& sample : batch) list.push_back(sample_to_ivalue(sample));
    return list;
  } else {
    return sample_to_ivalue(batch);
  }
}
template <Dispatchable B>
B batch_from_ivalue(const c10::IValue& v) {
  if constexpr (SampleList<B>) {
    if (!v.isList()) wrong_object("list", v);
    B out;
    for (const c10::IValue& element : v.toListRef()) out.push_back(sample_from_ivalue<typename B::value_type>(element));
    return out;
  } else {
    return sample_from_ivalue<B>(v);
  }
}

// One batch of a pass, as a prepared loader hands it out.
template <class Batch>
struct RankBatch {
  Batch batch;
  size_t real;  // rows that are not repeats
  bool last;    // the pass's last batch
};

// The dispatching side of a prepared loader (see the top of this part). read() is a
// collective over the group: every process calls it once per batch; the
// main process (rank 0 of the group) reads one global batch ahead, so every
// share knows whether it is the pass's last.
template <class Batch>  // Dispatchable (named unconstrained by loaders of other batches, never made)
class Dispatcher {
 public:
  using Source = std::function<std::optional<Batch>()>;  // the next global batch; nullopt: the pass is over

  explicit Dispatcher(GroupPtr group) : group_(std::move(group)) {}
  bool main() const { return group_->getRank() == 0; }

  // A new pass; `source` is called on the main process only, from read()
  // (whose failures the others hear of).
  void begin(Source source) {
    source_ = std::move(source);
    first_.reset();
    ahead_.reset();
    starting_ = true;
  }

  std::optional<RankBatch<Batch>> read() {
    enum : int64_t { END = 0, BATCH = 1, LAST = 2, FAILED = 3 };
    c10d::ProcessGroup& group = *group_;
    const int processes = group.getSize();
    if (!main()) {
      const std::vector<char> bytes = scatter_bytes(group, 0, {}, "dispatch_batches");
      const c10::IValue message = load_object(bytes.data(), bytes.size());
      const c10::ArrayRef<c10::IValue> fields = message.toTupleRef().elements().asArrayRef();
      const int64_t status = fields[0].toInt();
      if (status == FAILED)
        throw DistributedError("accel: the main process could not make this process's batch (dispatch_batches): " +
                               fields[1].toStringRef());
      if (status == END) return std::nullopt;
      return RankBatch<Batch>{batch_from_ivalue<Batch>(fields[2]), static_cast<size_t>(fields[1].toInt()),
                              status == LAST};
    }
    std::vector<std::vector<char>> pieces(static_cast<std::size_t>(processes));
    auto to_all = [&](const c10::IValue& message) {
      const std::vector<char> bytes = save_object(message);
      for (int p = 1; p < processes; ++p) pieces[p] = bytes;
    };
    std::optional<RankBatch<Batch>> mine;
    try {
      if (std::exchange(starting_, false)) ahead_ = source_();
      if (!ahead_) {
        to_all(tuple_of({c10::IValue(int64_t{END})}));
      } else {
        Batch global = std::move(*ahead_);
        ahead_ = source_();
        const bool last = !ahead_;
        const size_t observed = batch_rows(global);
        if (observed == 0) throw InvalidArgument("accel::prepare_data_loader (dispatch_batches): a batch of 0 rows");
        if (!first_) first_ = global;
        const auto P = static_cast<size_t>(processes);
        const size_t rows = (observed + P - 1) / P;  // per process
        if (rows * P > observed) {                   // completed from the first global batch, cycled if it is short
          std::vector<Batch> parts{std::move(global)};
          const size_t first_rows = batch_rows(*first_);
          for (size_t have = observed; have < rows * P; have += std::min(first_rows, rows * P - have))
            parts.push_back(batch_slice(*first_, 0, std::min(first_rows, rows * P - have)));
          global = batch_cat(std::move(parts));
        }
        for (size_t p = 0; p < P; ++p) {
          Batch piece = batch_slice(global, p * rows, (p + 1) * rows);
          const size_t real = observed > p * rows ? std::min(rows, observed - p * rows) : 0;
          if (p == 0) {
            mine = RankBatch<Batch>{std::move(piece), real, last};
          } else {
            pieces[p] = save_object(tuple_of({c10::IValue(int64_t{last ? LAST : BATCH}),
                                              c10::IValue(static_cast<int64_t>(real)), batch_to_ivalue(piece)}));
          }
        }
      }
    } catch (const std::exception& e) {  // the others are waiting for their rows: tell them, then throw here
      to_all(tuple_of({c10::IValue(int64_t{FAILED}), c10::IValue(error_text(e))}));
      scatter_bytes(group, 0, pieces, "dispatch_batches");
      throw;
    }
    scatter_bytes(group, 0, pieces, "dispatch_batches");
    return mine;
  }

 private:
  GroupPtr group_;
  Source source_;
  std::optional<Batch> ahead_, first_;
  bool starting_ = false;
};

// The iterator of a prepared loader: an input iterator over the shares its
// loader's next() hands out; it tells the GradientState where the pass is.
// After the pass's last batch it reads nothing more.
template <class Loader, class Batch>
class PassIterator {
 public:
  Batch& operator*() {
    pass_.at(current_->real, current_->last);
    return current_->batch;
  }
  Batch* operator->() { return &**this; }
  PassIterator& operator++() {
    if (current_->last) current_.reset();
    else current_ = loader_->next();
    return *this;
  }
  bool operator==(const PassIterator& other) const {
    const bool equal = !current_ && !other.current_;
    if (equal) {  // the pass is over
      pass_.end();
      other.pass_.end();
    }
    return equal;
  }

 private:
  friend Loader;
  PassIterator() = default;  // end()
  PassIterator(Loader* loader, Pass pass) : loader_(loader), pass_(std::move(pass)) { current_ = loader_->next(); }
  Loader* loader_ = nullptr;
  std::optional<RankBatch<Batch>> current_;
  Pass pass_;
};

// The group a prepared loader dispatches over; null when it does not
// (dispatch_batches off, or one process). Unset, dispatch_batches is on for
// iterable datasets whose elements can travel.
template <class Batch>
GroupPtr dispatch_group(const DataLoaderConfig& config, bool iterable, const GroupPtr& group) {
  if (!config.dispatch_batches.value_or(iterable && Dispatchable<Batch>)) return {};
  if (!Dispatchable<Batch>)
    throw InvalidArgument(
        "accel::prepare_data_loader: dispatch_batches sends batches with LibTorch's pickler: a std::vector of "
        "samples (Examples or Picklable values) or batched tensors (an Example or nested tensors); this loader's "
        "batches are neither");
  if (config.layout != ShardLayout::BATCHES)
    throw InvalidArgument(
        "accel::prepare_data_loader: dispatch_batches deals out rows of global batches; ShardLayout::SAMPLES does "
        "not apply");
  if (!group || group->getSize() == 1) return {};
  return group;
}
}  // namespace detail

ACCEL_NAMESPACE_END
