// accel/training/checkpoint/shards.hpp: a sharded model in a checkpoint: each process writes its own pieces, as Python's DCP reads them.
//
// Under SHARD_GRAD_OP, FULL_SHARD and HYBRID_SHARD no process gathers the
// model to save it. Process k of a shard group of S holds elements
// [k*c, (k+1)*c) of every parameter flattened (c = ceil(n/S);
// dp/shards.hpp) and writes them; under HSDP the first replica writes.
// Process 0 writes what is not sharded (buffers, frozen parameters) whole.
// Beside them go the optimizers' state for those pieces where Python's
// optimizer of the same kind keeps it (Adam's and AdamW's moments and step,
// SGD's momentum buffer: python_state), under Python's names. The files are
// safetensors in the checkpoint's directory, and each one's "__metadata__"
// has "DCP_SHARDING_INFO": {name: {"saved_offsets": [...]}} as JSON text,
// the place of each of its tensors in the whole. That is what
// torch.distributed.checkpoint's HuggingFaceStorageReader reads (torch's
// distributed/checkpoint/hf_storage.py; read with torch 2.15 in CTest
// checkpoint_resize), so Python loads them at any number of processes:
//
//     dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader("ckpt"))
//     dcp.load({"optimizer": {"state": ...}}, storage_reader=HuggingFaceStorageReader("ckpt"))
//
// (names: model_prefix and optimizer_prefix below). The optimizers' state
// is also in LibTorch's archives, optimizer_rank<k>.pt, which is what C++
// loads (any optimizer; checkpoint/reshard.hpp): those tensors are on disk
// twice.
//
// A piece of a flattened tensor need not be a box of the whole (it can
// start and end inside rows): it is written as the fewest boxes that tile
// it, at most 2d-1 for d dimensions. A file holds each name once, so box j
// of each of a process's pieces goes into that process's file j:
// rank-<process>-part-<j>.safetensors.
//
// Each file's metadata also carries the checkpoint's id
// ("accel_checkpoint_id"; Python's reader takes only DCP_SHARDING_INFO).
//
// Loading (ShardedWeights) reads the header of every file the manifest
// lists, refuses a file of another checkpoint (its id), checks that each
// name's boxes tile its whole tensor exactly (nothing missing, nothing
// twice) and that the model has the same names, dtypes and shapes, then
// reads for each tensor only what the process keeps (its piece, or the
// whole), and of each saved box that overlaps it only the bytes spanning
// the overlap; a file it reads from is first checked whole against the
// manifest's digest (CheckpointFiles), so a process reads each of those
// files once more in full: where the layout is the saving run's, its own
// files and the first process's first one (the buffers).
#pragma once

#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/prepared.hpp"
#include "accel/training/io/safetensors.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A box of a tensor: offsets and sizes per dimension. Boxes made by
// boxes_of_range cover a contiguous run of the row-major elements, the
// first at flat index `begin`.
struct TensorBox {
  std::vector<int64_t> offsets, sizes;
  int64_t begin = 0;
  int64_t numel() const { return std::accumulate(sizes.begin(), sizes.end(), int64_t{1}, std::multiplies<>()); }
};

// Elements [begin, end) of the part of a tensor of `shape` from dimension
// `dim` on, whose outer indices are `at` (its first element at flat index
// `base`), as boxes in order: a partial first row, the whole rows, a
// partial last row, partial rows cut the same way one dimension down.
inline void add_boxes(const std::vector<int64_t>& shape, std::size_t dim, int64_t begin, int64_t end,
                      std::vector<int64_t>& at, int64_t base, std::vector<TensorBox>& out) {
  if (begin >= end) return;
  const auto ones = [&] { return std::vector<int64_t>(at.size(), 1); };
  if (dim == shape.size()) {  // a 0-d tensor: its one element
    out.push_back({at, ones(), base});
    return;
  }
  const int64_t inner = std::accumulate(shape.begin() + static_cast<std::ptrdiff_t>(dim) + 1, shape.end(), int64_t{1},
                                        std::multiplies<>());
  const int64_t first_whole = (begin + inner - 1) / inner, last_whole = end / inner;  // whole rows [first, last)
  auto within_row = [&](int64_t row, int64_t from, int64_t to) {
    at.push_back(row);
    add_boxes(shape, dim + 1, from, to, at, base + row * inner, out);
    at.pop_back();
  };
  if (first_whole > last_whole) return within_row(begin / inner, begin % inner, end % inner);  // one row, no edge
  if (begin % inner) within_row(begin / inner, begin % inner, inner);
  if (last_whole > first_whole) {
    TensorBox box{at, ones(), base + first_whole * inner};
    box.offsets.push_back(first_whole);
    box.sizes.push_back(last_whole - first_whole);
    for (std::size_t d = dim + 1; d < shape.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(box));
  }
  if (end % inner) within_row(last_whole, 0, end % inner);
}
inline std::vector<TensorBox> boxes_of_range(at::IntArrayRef shape, int64_t begin, int64_t end) {
  std::vector<TensorBox> out;
  std::vector<int64_t> at;
  add_boxes(shape.vec(), 0, begin, end, at, 0, out);
  return out;
}

// The names in a checkpoint's safetensors: model 0's tensors under their
// state_dict names (as Hugging Face's files), model i's under "model_<i>.",
// optimizer i's state under "optimizer.state." ("optimizer_<i>.state.")
// then the parameter's name and the state's, as Python's
// get_optimizer_state_dict() nests them.
inline std::string model_prefix(std::size_t i) { return i == 0 ? "" : "model_" + std::to_string(i) + "."; }
inline std::string optimizer_prefix(std::size_t i) {
  return (i == 0 ? std::string("optimizer") : "optimizer_" + std::to_string(i)) + ".state.";
}
// Whether a saved name is in the namespace of `prefix` (model 0's: every
// name not in another's).
inline bool in_namespace(const std::string& name, const std::string& prefix) {
  if (!prefix.empty()) return name.starts_with(prefix);
  if (name.starts_with("optimizer.state.")) return false;
  for (const char* other : {"model_", "optimizer_"}) {
    if (!name.starts_with(other)) continue;
    const std::size_t digits = std::strlen(other), dot = name.find('.', digits);
    if (dot != std::string::npos && dot > digits &&
        std::all_of(name.begin() + static_cast<std::ptrdiff_t>(digits), name.begin() + static_cast<std::ptrdiff_t>(dot),
                    [](char c) { return c >= '0' && c <= '9'; }))
      return false;
  }
  return true;
}

// What one process writes: box j of each of its pieces goes into its file
// j, with the place DCP_SHARDING_INFO gives it.
class PieceFiles {
 public:
  // Elements [begin, begin + values.numel()) of a tensor of `shape`,
  // flattened (`values`: a flat view).
  void add_piece(const std::string& name, at::IntArrayRef shape, const at::Tensor& values, int64_t begin) {
    std::size_t j = 0;
    for (const TensorBox& box : boxes_of_range(shape, begin, begin + values.numel()))
      add(j++, name, values.narrow(0, box.begin - begin, box.numel()).view(box.sizes), box.offsets);
  }
  void add_whole(const std::string& name, const at::Tensor& tensor) {
    add(0, name, tensor, std::vector<int64_t>(tensor.dim(), 0));
  }
  // Into dir, with the checkpoint's id; each file and its digest into `log`.
  void write(const fs::path& dir, int process, const std::string& id, FileLog& log) const {
    for (std::size_t j = 0; j < parts_.size(); ++j) {
      const std::string file = file_names::piece(process, j);
      log.emplace_back(file,
                       write_safetensors(dir / file, parts_[j],
                                         {{"DCP_SHARDING_INFO", "{" + places_[j] + "}"}, {kCheckpointIdKey, id}}));
    }
  }
  static constexpr const char* kCheckpointIdKey = "accel_checkpoint_id";

 private:
  void add(std::size_t j, const std::string& name, const at::Tensor& values, const std::vector<int64_t>& at) {
    if (parts_.size() <= j) {
      parts_.resize(j + 1);
      places_.resize(j + 1);
    }
    parts_[j].emplace_back(name, values);
    // (appended piece by piece: GCC 12's -Wrestrict misfires on "" or "," + std::to_string(o))
    std::string& place = places_[j];
    if (!place.empty()) place += ',';
    place += json_quote(name);
    place += ":{\"saved_offsets\":[";
    for (std::size_t d = 0; d < at.size(); ++d) {
      if (d) place += ',';
      place += std::to_string(at[d]);
    }
    place += "]}";
  }
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> parts_;
  std::vector<std::string> places_;
};

// The state Python's optimizer of the same kind keeps per parameter, under
// its names: Adam's and AdamW's moments (and amsgrad's maximum) and step
// (a float32 scalar, as Python's), SGD's momentum buffer. Nothing for other
// optimizers (their state is in LibTorch's archives only).
inline std::vector<std::pair<std::string, at::Tensor>> python_state(const torch::optim::OptimizerParamState* state) {
  auto step = [](int64_t n) { return at::scalar_tensor(static_cast<double>(n), at::kFloat); };
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto adam_like = [&](const auto& s) {
    out = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
    if (s.max_exp_avg_sq().defined()) out.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
    out.emplace_back("step", step(s.step()));
  };
  if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state)) adam_like(*adam);
  else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) adam_like(*adamw);
  else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state))
    if (sgd->momentum_buffer().defined()) out = {{"momentum_buffer", sgd->momentum_buffer()}};
  return out;
}
// An optimizer's state for one parameter; null if none.
inline const torch::optim::OptimizerParamState* state_for(torch::optim::Optimizer& optimizer,
                                                          const at::Tensor& parameter) {
  auto& state = optimizer.state();
  const auto found = state.find(dp::state_key(state, parameter.unsafeGetTensorImpl()));
  return found == state.end() ? nullptr : found->second.get();
}

// Writes this process's pieces into dir (see the top): of every sharded
// model, and of its optimizers' state where Python's optimizer of the same
// kind has it (python_state); each file into `log`.
inline void write_pieces(PreparedSet& set, int process, const fs::path& dir, const std::string& id, FileLog& log) {
  PieceFiles files;
  // Each sharded parameter's shard (what the optimizers step), to its name, shape and piece.
  struct Place {
    std::string name;
    at::Tensor parameter;
    std::optional<dp::Piece> piece;
    bool writes;
  };
  std::unordered_map<const c10::TensorImpl*, Place> places;
  for (std::size_t i = 0; i < set.models.size(); ++i) {
    const DataParallel* dp = set.models[i].data_parallel.get();
    if (!dp || !dp->sharded()) continue;
    const bool writes = dp->sharded_state_dict().writes_pieces();
    for (const auto& [name, tensor] : state_dict(*set.models[i].module)) {
      if (!in_namespace(model_prefix(i) + name, model_prefix(i)))
        throw InvalidArgument("accel::Accelerator::save_state: model " + std::to_string(i) + "'s tensor " + name +
                              " would be read as another model's or an optimizer's in a sharded checkpoint; rename "
                              "its module");
      auto piece = dp->sharded_state_dict().piece_of(tensor);
      const at::Tensor shard = dp->shard_of(tensor);
      if (!piece) {
        if (process == 0) files.add_whole(model_prefix(i) + name, tensor);
        continue;
      }
      if (writes) files.add_piece(model_prefix(i) + name, tensor.sizes(), piece->values, piece->begin);
      places[shard.unsafeGetTensorImpl()] = {name, tensor, std::move(piece), writes};
    }
  }
  for (std::size_t k = 0; k < set.optimizers.size(); ++k)
    for (const auto& group : set.optimizers[k]->param_groups())
      for (const auto& p : group.params()) {
        const auto found = places.find(p.unsafeGetTensorImpl());
        if (found == places.end() || !found->second.writes) continue;
        const Place& place = found->second;
        const int64_t length = place.piece->values.numel();
        for (const auto& [key, value] : python_state(state_for(*set.optimizers[k], p))) {
          const std::string name = optimizer_prefix(k) + place.name + "." + key;
          if (value.dim() == 0) {
            if (place.piece->begin == 0) files.add_whole(name, value);  // (once: by the process of the first piece)
          } else {
            files.add_piece(name, place.parameter.sizes(), value.narrow(0, 0, length), place.piece->begin);
          }
        }
      }
  files.write(dir, process, id, log);
}

// A sharded model's files in a checkpoint, read and checked (see the top):
// those its manifest lists (`checked`), each checked against its digest
// before its data is read; without records (a checkpoint of the first
// format), every *.safetensors in dir, unchecked.
class ShardedWeights {
 public:
  ShardedWeights(const fs::path& dir, CheckpointFiles& checked) : dir_(dir), checked_(&checked) {
    if (!fs::is_directory(dir)) throw RuntimeError("missing " + dir.string());
    if (checked.recorded()) {
      files_ = checked.listed(".safetensors");
    } else {
      for (const auto& entry : fs::directory_iterator(dir))
        if (entry.path().extension() == ".safetensors") files_.push_back(entry.path());
      std::sort(files_.begin(), files_.end());
    }
    for (std::size_t f = 0; f < files_.size(); ++f) read_header(f);
    for (auto& [name, whole] : tensors_) check_tiling(name, whole);
  }

  // The model's parameters and buffers (state_dict's names) against the
  // files: the same names, dtypes and shapes, or an error naming them.
  void check_fits(const std::vector<std::pair<std::string, at::Tensor>>& expected,
                  const std::string& prefix = "") const {
    std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> held;
    for (const auto& [name, whole] : tensors_)  // (another model's names and the optimizers' are theirs)
      if (in_namespace(name, prefix)) held[name] = {whole.dtype, whole.shape};
    if (const std::string why = misfit(expected, held, prefix); !why.empty())
      throw RuntimeError(dir_.string() + ": its pieces do not fit the model:" + why);
  }

  // Elements [begin, begin + length) of tensor `name` flattened, on the CPU.
  at::Tensor read(const std::string& name, int64_t begin, int64_t length) const {
    const Whole& whole = tensors_.at(name);
    at::Tensor out = at::empty({length}, at::TensorOptions(whole.dtype));
    for (const TensorBox& want : boxes_of_range(whole.shape, begin, begin + length)) {
      at::Tensor into = out.narrow(0, want.begin - begin, want.numel()).view(want.sizes);
      for (const Saved& saved : whole.boxes) {
        // The overlap, and the span of the saved box's bytes that holds it.
        std::vector<int64_t> low(want.sizes.size()), size(want.sizes.size()), stride(want.sizes.size());
        int64_t first = 0, last = 0, step = 1;
        bool empty = false;
        for (std::size_t d = want.sizes.size(); d-- > 0;) {
          low[d] = std::max(want.offsets[d], saved.box.offsets[d]);
          const int64_t high = std::min(want.offsets[d] + want.sizes[d], saved.box.offsets[d] + saved.box.sizes[d]);
          size[d] = high - low[d];
          empty = empty || size[d] <= 0;
          stride[d] = step;
          first += (low[d] - saved.box.offsets[d]) * step;
          last += (high - 1 - saved.box.offsets[d]) * step;
          step *= saved.box.sizes[d];
        }
        if (empty) continue;
        at::Tensor span = at::empty({last - first + 1}, at::TensorOptions(whole.dtype));
        read_bytes(saved, first, span);
        at::Tensor target = into;
        for (std::size_t d = 0; d < size.size(); ++d)
          target = target.narrow(static_cast<int64_t>(d), low[d] - want.offsets[d], size[d]);
        target.copy_(span.as_strided(size, stride));
      }
    }
    return out;
  }

 private:
  struct Saved {
    std::size_t file;
    TensorBox box;
    int64_t at = 0;  // its bytes' place in the file
  };
  struct Whole {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    std::vector<Saved> boxes;
  };

  void read_header(std::size_t f) {
    const fs::path& path = files_[f];
    std::ifstream in(path, std::ios::binary);
    if (!in) throw RuntimeError("cannot read " + path.string());
    const SafetensorsHeader header = read_safetensors_header(in, path);
    if (checked_->recorded()) {
      const auto id = header.metadata.find(PieceFiles::kCheckpointIdKey);
      if (id == header.metadata.end() || id->second != checked_->id())
        throw RuntimeError(path.string() + " is a piece of another checkpoint (its id " +
                           (id == header.metadata.end() ? std::string("none") : id->second) + ", this one's " +
                           checked_->id() + ")");
    }
    const auto info = header.metadata.find("DCP_SHARDING_INFO");
    const Json places = info == header.metadata.end()
                            ? Json{}
                            : JsonReader(info->second, path.string() + "'s DCP_SHARDING_INFO").document();
    for (const SafetensorsEntry& e : header.entries) {
      std::vector<int64_t> offsets(e.shape.size(), 0);
      if (info != header.metadata.end()) {
        const Json* place = places.find(e.name);
        const Json* saved = place ? place->find("saved_offsets") : nullptr;
        if (!saved || saved->kind != Json::Kind::Array || saved->items.size() != e.shape.size())
          throw RuntimeError(path.string() + ": DCP_SHARDING_INFO gives " + e.name + " no saved_offsets of " +
                             std::to_string(e.shape.size()) + " dimensions");
        for (std::size_t d = 0; d < offsets.size(); ++d)
          offsets[d] = json_uint(saved->items[d], path.string() + ": " + e.name + "'s saved_offsets");
      }
      auto [it, added] = tensors_.try_emplace(e.name, Whole{e.dtype, {}, {}});
      Whole& whole = it->second;
      if (whole.dtype != e.dtype || (!added && whole.shape.size() != e.shape.size()))
        throw RuntimeError(path.string() + ": " + e.name + " is " + c10::toString(e.dtype) +
                           c10::str(at::IntArrayRef(e.shape)) + " here, of another dtype or rank in another file");
      whole.shape.resize(e.shape.size(), 0);
      for (std::size_t d = 0; d < e.shape.size(); ++d)
        whole.shape[d] = std::max(whole.shape[d], offsets[d] + e.shape[d]);
      whole.boxes.push_back({f, TensorBox{offsets, e.shape, 0}, header.data_start + e.begin});
    }
  }

  // Each name's boxes tile its whole: as many elements, and no two overlap.
  void check_tiling(const std::string& name, const Whole& whole) const {
    const int64_t total = std::accumulate(whole.shape.begin(), whole.shape.end(), int64_t{1}, std::multiplies<>());
    int64_t covered = 0;
    for (std::size_t a = 0; a < whole.boxes.size(); ++a) {
      covered += whole.boxes[a].box.numel();
      for (std::size_t b = 0; b < a; ++b) {
        bool overlap = whole.boxes[a].box.numel() > 0 && whole.boxes[b].box.numel() > 0;
        for (std::size_t d = 0; overlap && d < whole.shape.size(); ++d) {
          const TensorBox &x = whole.boxes[a].box, &y = whole.boxes[b].box;
          overlap = x.offsets[d] < y.offsets[d] + y.sizes[d] && y.offsets[d] < x.offsets[d] + x.sizes[d];
        }
        if (overlap)
          throw RuntimeError(dir_.string() + ": " + name + " has overlapping pieces in " +
                             files_[whole.boxes[a].file].filename().string() + " and " +
                             files_[whole.boxes[b].file].filename().string());
      }
    }
    if (covered != total)
      throw RuntimeError(dir_.string() + ": the pieces of " + name + " hold " + std::to_string(covered) + " of its " +
                         std::to_string(total) + " elements (a file missing?)");
  }

  // Elements [first, first + into.numel()) of a saved box, into `into`.
  void read_bytes(const Saved& saved, int64_t first, const at::Tensor& into) const {
    const fs::path& path = files_[saved.file];
    checked_->check(path.filename().string());
    std::ifstream in(path, std::ios::binary);
    const auto element = static_cast<int64_t>(into.element_size());
    in.seekg(static_cast<std::streamoff>(saved.at + first * element));
    if (!in || !in.read(static_cast<char*>(into.data_ptr()), static_cast<std::streamsize>(into.numel() * element)))
      throw RuntimeError("cannot read " + path.string());
  }

  fs::path dir_;
  CheckpointFiles* checked_;
  std::vector<fs::path> files_;
  std::map<std::string, Whole> tensors_;
};

// A model saved in pieces, for load_state's read step: the files checked
// against the model (its names under `prefix`), and what this process keeps
// of each parameter and buffer read (dp's load_range under sharding, else
// everything whole).
inline std::map<std::string, at::Tensor> read_model_pieces(const torch::nn::Module& module, DataParallel* dp,
                                                           const ShardedWeights& weights, const std::string& prefix) {
  const auto expected = state_dict(module);
  weights.check_fits(expected, prefix);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : expected) {
    const auto [begin, length] =
        dp ? dp->sharded_state_dict().load_range(tensor) : std::pair{int64_t{0}, tensor.numel()};
    out[name] = weights.read(prefix + name, begin, length).to(tensor.device());
  }
  return out;
}
// ... and for its commit step, which cannot fail: the sharded parameters
// through dp (their shards, and the parameters where they are whole), the
// rest copied in.
inline void commit_model_pieces(const torch::nn::Module& module, DataParallel* dp,
                                const std::map<std::string, at::Tensor>& pieces) {
  const bool sharded = dp && dp->sharded();
  std::unordered_map<const c10::TensorImpl*, const at::Tensor*> by_tensor;
  at::NoGradGuard no_grad;
  for (const auto& [name, tensor] : state_dict(module)) {
    const at::Tensor& values = pieces.at(name);
    if (sharded && dp->shard_of(tensor).defined()) by_tensor[tensor.unsafeGetTensorImpl()] = &values;
    else tensor.detach().copy_(values.view(tensor.sizes()));
  }
  if (sharded)
    dp->sharded_state_dict().load_values([&](const at::Tensor& p) { return *by_tensor.at(p.unsafeGetTensorImpl()); });
}
}  // namespace detail

ACCEL_NAMESPACE_END
