// accel/training/checkpoint_shards.hpp: a sharded model in a checkpoint: each process writes its own pieces, as Python's DCP reads them.
//
// Under SHARD_GRAD_OP, FULL_SHARD and HYBRID_SHARD no process gathers the
// model to save it. Process k of a shard group of S holds elements
// [k*c, (k+1)*c) of every parameter flattened (c = ceil(n/S);
// dp_shards.hpp) and writes them; under HSDP the first replica writes.
// Process 0 writes what is not sharded (buffers, frozen parameters) whole.
// The files are safetensors, in the directory model/ of the checkpoint
// (model_1/, ... for more models), and each one's "__metadata__" has
// "DCP_SHARDING_INFO": {name: {"saved_offsets": [...]}} as JSON text, the
// place of each of its tensors in the whole. That is the layout of
// torch.distributed.checkpoint's HuggingFaceStorageReader (torch
// distributed/checkpoint/hf_storage.py; read with torch 2.15 in CTest
// checkpoint_resize), so Python loads it at any number of processes:
//
//     dcp.load(state_dict, storage_reader=HuggingFaceStorageReader("ckpt/model"))
//
// A piece of a flattened tensor need not be a box of the whole (it can
// start and end inside rows): it is written as the fewest boxes that tile
// it, at most 2d-1 for d dimensions. A file holds each name once, so box j
// of each of a process's pieces goes into that process's file j:
// rank-<process>-part-<j>.safetensors.
//
// Loading (ShardedWeights) reads every file's header, checks that each
// name's boxes tile its whole tensor exactly (nothing missing, nothing
// twice) and that the model has the same names, dtypes and shapes, then
// reads for each tensor only what the process keeps (its piece, or the
// whole), and of each saved box that overlaps it only the bytes spanning
// the overlap.
#pragma once

#include "accel/training/data_parallel.hpp"
#include "accel/training/safetensors.hpp"

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

inline std::string model_shards_dir(std::size_t i) { return i == 0 ? "model" : "model_" + std::to_string(i); }

// Writes this process's part of a sharded model into dir (see the top).
inline void write_model_shards(const torch::nn::Module& module, const DataParallel& dp, int process,
                               const fs::path& dir) {
  // parts[j]: the j-th box of each piece, with its place for DCP_SHARDING_INFO.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> parts;
  std::vector<std::string> places;
  auto add = [&](std::size_t j, const std::string& name, const at::Tensor& values, const std::vector<int64_t>& at) {
    if (parts.size() <= j) {
      parts.resize(j + 1);
      places.resize(j + 1);
    }
    parts[j].emplace_back(name, values);
    // (appended piece by piece: GCC 12's -Wrestrict misfires on "" or "," + std::to_string(o))
    std::string& place = places[j];
    if (!place.empty()) place += ',';
    place += json_quote(name);
    place += ":{\"saved_offsets\":[";
    for (std::size_t d = 0; d < at.size(); ++d) {
      if (d) place += ',';
      place += std::to_string(at[d]);
    }
    place += "]}";
  };
  for (const auto& [name, tensor] : state_dict(module)) {
    const auto piece = dp.piece_of(tensor);
    if (!piece) {
      if (process == 0) add(0, name, tensor, std::vector<int64_t>(tensor.dim(), 0));
      continue;
    }
    if (!dp.writes_pieces()) continue;
    const int64_t length = piece->values.numel();
    std::size_t j = 0;
    for (const TensorBox& box : boxes_of_range(tensor.sizes(), piece->begin, piece->begin + length))
      add(j++, name, piece->values.narrow(0, box.begin - piece->begin, box.numel()).view(box.sizes), box.offsets);
  }
  fs::create_directories(dir);
  for (std::size_t j = 0; j < parts.size(); ++j) {
    char file[64];
    std::snprintf(file, sizeof file, "rank-%05d-part-%zu.safetensors", process, j);
    write_safetensors(dir / file, parts[j], {{"DCP_SHARDING_INFO", "{" + places[j] + "}"}});
  }
}

// A sharded model's files in a checkpoint, read and checked (see the top).
class ShardedWeights {
 public:
  explicit ShardedWeights(const fs::path& dir) : dir_(dir) {
    if (!fs::is_directory(dir)) throw RuntimeError("missing " + dir.string());
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.path().extension() == ".safetensors") files_.push_back(entry.path());
    std::sort(files_.begin(), files_.end());
    for (std::size_t f = 0; f < files_.size(); ++f) read_header(f);
    for (auto& [name, whole] : tensors_) check_tiling(name, whole);
  }

  // The model's parameters and buffers (state_dict's names) against the
  // files: the same names, dtypes and shapes, or an error naming them.
  void check_fits(const std::vector<std::pair<std::string, at::Tensor>>& expected) const {
    std::string missing, wrong, unexpected;
    std::set<std::string> names;
    for (const auto& [name, tensor] : expected) {
      names.insert(name);
      const auto found = tensors_.find(name);
      if (found == tensors_.end()) missing += (missing.empty() ? "" : ", ") + name;
      else if (found->second.dtype != tensor.scalar_type() || found->second.shape != tensor.sizes().vec())
        wrong += (wrong.empty() ? "" : "; ") + name + " is " + c10::toString(found->second.dtype) +
                 c10::str(at::IntArrayRef(found->second.shape)) + " there, " + c10::toString(tensor.scalar_type()) +
                 c10::str(tensor.sizes()) + " in the model";
    }
    for (const auto& entry : tensors_)
      if (!names.count(entry.first)) unexpected += (unexpected.empty() ? "" : ", ") + entry.first;
    if (!missing.empty() || !wrong.empty() || !unexpected.empty())
      throw RuntimeError(dir_.string() +
                         " does not fit the model:" + (missing.empty() ? "" : " missing " + missing + ".") +
                         (unexpected.empty() ? "" : " not in the model: " + unexpected + ".") +
                         (wrong.empty() ? "" : " " + wrong + "."));
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
    std::ifstream in(path, std::ios::binary);
    const auto element = static_cast<int64_t>(into.element_size());
    in.seekg(static_cast<std::streamoff>(saved.at + first * element));
    if (!in || !in.read(static_cast<char*>(into.data_ptr()), static_cast<std::streamsize>(into.numel() * element)))
      throw RuntimeError("cannot read " + path.string());
  }

  fs::path dir_;
  std::vector<fs::path> files_;
  std::map<std::string, Whole> tensors_;
};

// A model saved in pieces, for load_state's read step: the files checked
// against the model, and what this process keeps of each parameter and
// buffer read (dp's load_range under sharding, else everything whole).
inline std::map<std::string, at::Tensor> read_model_pieces(const torch::nn::Module& module, DataParallel* dp,
                                                           const fs::path& dir) {
  const ShardedWeights weights(dir);
  const auto expected = state_dict(module);
  weights.check_fits(expected);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : expected) {
    const auto [begin, length] = dp && dp->sharded() ? dp->load_range(tensor) : std::pair{int64_t{0}, tensor.numel()};
    out[name] = weights.read(name, begin, length).to(tensor.device());
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
  if (sharded) dp->load_values([&](const at::Tensor& p) { return *by_tensor.at(p.unsafeGetTensorImpl()); });
}
}  // namespace detail

ACCEL_NAMESPACE_END
