// accel/training/checkpoint/sharded_weights.hpp: a sharded model's pieces read back: every file's boxes checked to tile each tensor, this process's part read.
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

#include "accel/training/checkpoint/shards.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Whether dir holds safetensors files and each places its tensors with
// DCP_SHARDING_INFO: pieces, as accel's sharded checkpoints and Python's
// dcp.save through HuggingFaceStorageWriter write them. A file that is not
// safetensors throws, naming it.
inline bool holds_dcp_pieces(const fs::path& dir) {
  bool any = false;
  if (!fs::is_directory(dir)) return false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    if (!in) return false;
    const auto metadata = read_safetensors_header(in, entry.path()).metadata;
    if (!metadata.count("DCP_SHARDING_INFO")) return false;
    any = true;
  }
  return any;
}

// A sharded model's files in a checkpoint, read and checked (see checkpoint/shards.hpp's top):
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

  // Whether the files hold tensor `name` (model or optimizer state).
  bool holds(const std::string& name) const { return tensors_.count(name) > 0; }

  // Every tensor's name, in order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& named : tensors_) out.push_back(named.first);
    return out;
  }

  // Every tensor whole, on the CPU, by name.
  std::map<std::string, at::Tensor> read_all() const {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, whole] : tensors_) {
      const int64_t n = std::accumulate(whole.shape.begin(), whole.shape.end(), int64_t{1}, std::multiplies<>());
      out.emplace(name, read(name, 0, n).view(whole.shape));
    }
    return out;
  }

  // Elements [begin, begin + length) of tensor `name` flattened, on the
  // CPU; or, given `origin`, of the box of `sizes` there in it (a
  // tensor-parallel piece).
  at::Tensor read(const std::string& name, int64_t begin, int64_t length, const std::vector<int64_t>& sizes = {},
                  const std::vector<int64_t>& origin = {}) const {
    const Whole& whole = tensors_.at(name);
    at::Tensor out = at::empty({length}, at::TensorOptions(whole.dtype));
    for (TensorBox want : boxes_of_range(origin.empty() ? whole.shape : sizes, begin, begin + length)) {
      at::Tensor into = out.narrow(0, want.begin - begin, want.numel()).view(want.sizes);
      for (std::size_t d = 0; d < origin.size(); ++d) want.offsets[d] += origin[d];
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

// A model's parameters and buffers as the piece files hold them: state_dict's
// names, a tensor-parallel piece with its whole shape (a meta tensor, of no
// memory).
inline std::vector<std::pair<std::string, at::Tensor>> whole_entries(const torch::nn::Module& module,
                                                                     const tp::SplitTensors& split) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, tensor] : state_dict(module))
    out.emplace_back(name, split.contains(tensor)
                               ? at::empty(split.whole_sizes(tensor), tensor.options().device(at::kMeta))
                               : tensor);
  return out;
}

// A model saved in pieces, for load_state's read step: the files checked
// against the model (its names under `prefix`; a tensor-parallel piece
// against its whole shape), or, for a pipeline's stage, against every
// stage's tensors (`whole_model`: the stages together are the model), and
// what this process keeps of each parameter and buffer read (dp's
// load_range under sharding, else everything this process holds: a
// tensor-parallel piece's box of the whole, or the whole).
inline std::map<std::string, at::Tensor> read_model_pieces(
    const torch::nn::Module& module, DataParallel* dp, const tp::SplitTensors& split, const ShardedWeights& weights,
    const std::string& prefix, const std::vector<std::pair<std::string, at::Tensor>>* whole_model = nullptr) {
  weights.check_fits(whole_model ? *whole_model : whole_entries(module, split), prefix);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : state_dict(module)) {
    const auto [begin, length] =
        dp ? dp->sharded_state_dict().load_range(tensor) : std::pair{int64_t{0}, tensor.numel()};
    out[name] = weights.read(prefix + name, begin, length, tensor.sizes().vec(), place_in_whole(split, tensor))
                    .to(tensor.device());
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
