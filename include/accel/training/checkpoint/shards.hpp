// accel/training/checkpoint/shards.hpp: a sharded model in a checkpoint: each process writes its own pieces, as Python's DCP reads them (checkpoint/sharded_weights.hpp reads them back).
//
// Under SHARD_GRAD_OP, FULL_SHARD and HYBRID_SHARD no process gathers the
// model to save it. Process k of a shard group of S holds elements
// [k*c, (k+1)*c) of every parameter flattened (c = ceil(n/S);
// dp/shards.hpp) and writes them; under HSDP the first replica writes.
// Process 0 writes what is not sharded (buffers, frozen parameters) whole.
// Under tensor parallelism a process holds pieces of the split parameters
// (tp rank t: the t-th slice along the split dimension) and writes its
// piece, or its shard of it, placed in the whole tensor: tensor-parallel
// pieces are not gathered either. Under a pipeline each process holds some
// stages of one model, under the model's own names: it writes its stages'
// tensors (their shards, or their pieces), and the files of all hold the
// whole model as one.
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
#pragma once

#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/prepared.hpp"
#include "accel/training/checkpoint/context.hpp"
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
// The prefix of model i's names in the piece files: model_prefix, but none
// for a pipeline's stages, which together are one model under its own
// names (a stage module keeps the whole model's names for what it holds,
// as llama::Stage does).
inline std::string saved_model_prefix(const PreparedSet& set, std::size_t i) {
  return set.pipeline_group ? std::string() : model_prefix(i);
}
inline std::string optimizer_prefix(std::size_t i) {
  return (i == 0 ? std::string("optimizer") : "optimizer_" + std::to_string(i)) + ".state.";
}
// Whether a name starting with `stem` goes on with digits and a dot (model_1., optimizer_2.).
inline bool numbered(const std::string& name, const char* stem) {
  if (!name.starts_with(stem)) return false;
  const std::size_t digits = std::strlen(stem), dot = name.find('.', digits);
  return dot != std::string::npos && dot > digits &&
         std::all_of(name.begin() + static_cast<std::ptrdiff_t>(digits),
                     name.begin() + static_cast<std::ptrdiff_t>(dot), [](char c) { return c >= '0' && c <= '9'; });
}
// Whether a saved name is an optimizer's state (optimizer_prefix's names).
inline bool optimizer_state_name(const std::string& name) {
  return name.starts_with("optimizer.state.") ||
         (numbered(name, "optimizer_") && name.find(".state.") == name.find('.'));
}
// Whether a saved name is in the namespace of `prefix` (model 0's: every
// name not in another's).
inline bool in_namespace(const std::string& name, const std::string& prefix) {
  if (!prefix.empty()) return name.starts_with(prefix);
  return !name.starts_with("optimizer.state.") && !numbered(name, "model_") && !numbered(name, "optimizer_");
}

// What one process writes: box j of each of its pieces goes into its file
// j, with the place DCP_SHARDING_INFO gives it.
class PieceFiles {
 public:
  // Elements [begin, begin + values.numel()) of a tensor of `shape`,
  // flattened (`values`: a flat view); that tensor is itself the box at
  // `origin` of the whole (a tensor-parallel piece), or the whole (`origin`
  // empty).
  void add_piece(const std::string& name, at::IntArrayRef shape, const at::Tensor& values, int64_t begin,
                 const std::vector<int64_t>& origin = {}) {
    std::size_t j = 0;
    for (TensorBox box : boxes_of_range(shape, begin, begin + values.numel())) {
      for (std::size_t d = 0; d < origin.size(); ++d) box.offsets[d] += origin[d];
      add(j++, name, values.narrow(0, box.begin - begin, box.numel()).view(box.sizes), box.offsets);
    }
  }
  void add_whole(const std::string& name, const at::Tensor& tensor, const std::vector<int64_t>& origin = {}) {
    add(0, name, tensor, origin.empty() ? std::vector<int64_t>(tensor.dim(), 0) : origin);
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

// Where the tensor a process holds sits in the whole: a tensor-parallel
// piece split along `dim` at this rank's place, else at the origin (empty:
// the tensor is whole).
inline std::vector<int64_t> place_in_whole(const tp::SplitTensors& split, const at::Tensor& tensor) {
  const auto dim = split.dim_of(tensor);
  if (!dim) return {};
  std::vector<int64_t> origin(static_cast<std::size_t>(tensor.dim()), 0);
  origin[static_cast<std::size_t>(*dim)] = tp::rank_in(split.group) * tensor.size(*dim);
  return origin;
}

// Writes this process's pieces into dir (see the top): of every model saved
// in pieces, and of its optimizers' state where Python's optimizer of the
// same kind has it (python_state); each file into `log`. Each tensor is
// written once in all: a shard of a piece by its shard group's first
// replica, a shard of a whole tensor by that replica at tp rank 0 (every tp
// rank holds the same shards of it); a tensor-parallel piece that is not
// sharded by the first process of its data-parallel group (its replicas
// hold the same); the rest whole, by process 0 (under a pipeline, by the
// first process holding that stage).
inline void write_pieces(PreparedSet& set, const CheckpointContext& ctx, const fs::path& dir, const std::string& id,
                         FileLog& log) {
  PieceFiles files;
  // What each tensor an optimizer steps (a shard, else the parameter) is of the whole: its name, the shape of
  // what this process holds of it, that tensor's place in the whole, and which of its flattened elements.
  struct Place {
    std::string name;
    std::vector<int64_t> shape, origin;  // (origin empty: the tensor is whole)
    int64_t begin = 0, length = 0;
    bool writes = false;
  };
  std::unordered_map<const c10::TensorImpl*, Place> places;
  for (std::size_t i = 0; i < set.models.size(); ++i) {
    if (!saved_in_pieces(set, i)) continue;
    const PreparedModel& m = set.models[i];
    const DataParallel* dp = m.data_parallel.get();
    const bool sharded = dp && dp->sharded();
    const bool writes_shards = sharded && dp->sharded_state_dict().writes_pieces();
    const bool first_replica = !dp || !dp->group() || dp->group()->getRank() == 0;
    const bool first_tp = tp::rank_in(m.split.group) == 0;  // (the shards of whole tensors: alike over tp)
    const std::string prefix = saved_model_prefix(set, i);
    for (const auto& [name, tensor] : state_dict(*m.module)) {
      if (!in_namespace(prefix + name, prefix))
        throw InvalidArgument("accel::Accelerator::save_state: model " + std::to_string(i) + "'s tensor " + name +
                              " would be read as another model's or an optimizer's in a sharded checkpoint; rename "
                              "its module");
      const std::vector<int64_t> origin = place_in_whole(m.split, tensor);
      auto piece = sharded ? dp->sharded_state_dict().piece_of(tensor) : std::nullopt;
      Place place{name, tensor.sizes().vec(), origin, 0, tensor.numel(), false};
      if (piece) {
        place.writes = writes_shards && (!origin.empty() || first_tp);
        place.begin = piece->begin;
        place.length = piece->values.numel();
        if (place.writes) files.add_piece(prefix + name, tensor.sizes(), piece->values, piece->begin, origin);
        places[dp->shard_of(tensor).unsafeGetTensorImpl()] = std::move(place);
        continue;
      }
      place.writes = origin.empty() ? ctx.first_of_its_stages() : first_replica;
      if (place.writes) files.add_whole(prefix + name, tensor, origin);
      places[tensor.unsafeGetTensorImpl()] = std::move(place);
    }
  }
  for (std::size_t k = 0; k < set.optimizers.size(); ++k)
    for (const auto& group : set.optimizers[k]->param_groups())
      for (const auto& p : group.params()) {
        const auto found = places.find(p.unsafeGetTensorImpl());
        if (found == places.end() || !found->second.writes) continue;
        const Place& place = found->second;
        const bool holds_first =
            place.begin == 0 && std::all_of(place.origin.begin(), place.origin.end(), [](int64_t o) { return o == 0; });
        for (const auto& [key, value] : python_state(state_for(*set.optimizers[k], p))) {
          const std::string name = optimizer_prefix(k) + place.name + "." + key;
          if (value.dim() == 0) {
            if (holds_first) files.add_whole(name, value);  // (once: by the process of the whole's first element)
          } else {
            files.add_piece(name, place.shape, value.reshape({-1}).narrow(0, 0, place.length), place.begin,
                            place.origin);
          }
        }
      }
  files.write(dir, ctx.process_index, id, log);
}

}  // namespace detail

ACCEL_NAMESPACE_END
