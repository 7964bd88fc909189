// accel/training/checkpoint/reshard.hpp: an optimizer's saved state cut again for this run's shards (4 -> 2, ZeRO <-> NO_SHARD).
//
// Under sharding each process saves its own optimizer state
// (optimizer_rank<k>.pt): for every sharded parameter of n elements, piece
// k of its flattened values, ceil(n / S) elements (S: the shard group's
// size; the last piece padded with zeros), as DataParallel shards it. With
// the model mesh row-major (mp_replicate, mp_shard), process k holds piece
// k mod S, so processes 0 .. S-1 hold every piece once. A run that shards
// another way (another S, another number of processes, NO_SHARD or one
// process, whose optimizer.pt is whole) needs other pieces: this part
// builds this process's from the saved ones, reading only the first file
// and those whose pieces overlap its own, and gives it to Optimizer::load as the archive it
// would have saved (torch/optim/serialize.h's layout).
//
// The rule for a tensor of a parameter's state (Adam's exp_avg, SGD's
// momentum_buffer, ...): one of the saved piece's size is a piece, one of
// the parameter's shape is whole; anything else (a step count, a scalar)
// is the same on every process and is taken from the first file as saved.
// Where this run does not shard a parameter, its state comes back whole, in
// the parameter's shape.
//
// Across tensor-parallel layouts (another tp, or tp on one side only) a
// process's optimizer file holds the state of its own pieces, which this
// cut cannot place; there each tensor of the state comes instead from the
// piece files, where every process wrote it placed in the whole tensor
// under Python's names (Adam's, AdamW's and SGD's: checkpoint/shards.hpp):
// this process reads its box of the whole (a tensor-parallel piece, or the
// whole) and of that its range. The rest (step counts, the groups' options)
// comes from the first file as saved.
#pragma once

#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/optimizer_slots.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A checkpoint file read as an archive (checked and parsed by the caller),
// with its path for errors.
struct OpenedArchive {
  std::string file;
  torch::serialize::InputArchive archive;
};

// One saved optimizer file, read: its archive, and for each position its
// state's archive (none where the parameter had no state yet).
struct SavedOptimizer {
  std::string file;
  torch::serialize::InputArchive archive;
  std::vector<std::optional<torch::serialize::InputArchive>> states;
};

inline SavedOptimizer read_saved_optimizer(OpenedArchive opened, std::size_t slots) {
  SavedOptimizer saved{.file = std::move(opened.file), .archive = std::move(opened.archive), .states = {}};
  try {
    torch::serialize::InputArchive state, groups;
    saved.archive.read("state", state);
    saved.archive.read("param_groups", groups);
    at::Tensor count;
    groups.read("param_groups/size", count);
    for (int64_t g = 0; g < count.item<int64_t>(); ++g) {
      torch::serialize::InputArchive group;
      groups.read("param_groups/" + std::to_string(g), group);
      at::Tensor size;
      group.read("params/size", size);
      for (int64_t j = 0; j < size.item<int64_t>(); ++j) {
        c10::IValue key;
        group.read("params/" + std::to_string(j), key);
        torch::serialize::InputArchive own;
        saved.states.push_back(state.try_read(key.toStringRef(), own) ? std::optional(std::move(own)) : std::nullopt);
      }
    }
  } catch (const std::exception& e) {
    throw RuntimeError("cannot read " + saved.file + " as an optimizer's state: " + error_text(e));
  }
  if (saved.states.size() != slots)
    throw RuntimeError(saved.file + " holds the state of " + std::to_string(saved.states.size()) +
                       " parameters; this run's optimizer has " + std::to_string(slots));
  return saved;
}

// Elements [begin, end) of a parameter's flattened values into `out` (from
// its offset 0), out of the saved pieces (each `stride` elements: piece k
// starts at k * stride; undefined: not read, as not overlapping) or one
// whole tensor (stride n).
inline void copy_range(const std::vector<at::Tensor>& pieces, int64_t stride, int64_t begin, int64_t end,
                       at::Tensor& out) {
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (!pieces[k].defined()) continue;
    const int64_t from = std::max(begin, static_cast<int64_t>(k) * stride),
                  to = std::min(end, (static_cast<int64_t>(k) + 1) * stride);
    if (from < to)
      out.narrow(0, from - begin, to - from)
          .copy_(pieces[k].reshape({-1}).narrow(0, from - static_cast<int64_t>(k) * stride, to - from));
  }
}

// The saved pieces this process needs: those overlapping its own, and the
// first (the layout, step counts).
inline std::set<int64_t> pieces_needed(const std::vector<OptimizerSlot>& slots, int64_t saved_shards) {
  std::set<int64_t> needed{0};
  for (const auto& slot : slots) {
    const int64_t stride = (slot.whole.numel() + saved_shards - 1) / saved_shards;
    for (int64_t k = stride ? slot.begin() / stride : 0; stride && k * stride < slot.end() && k < saved_shards; ++k)
      needed.insert(k);
  }
  return needed;
}

using SavedFiles = std::vector<std::optional<SavedOptimizer>>;  // (by saved piece; empty: not needed)

// The state of parameter `position` as this process keeps it, into `own`:
// each field the size of the whole parameter, or of a saved piece, cut to
// this process's range out of the saved files that hold it; any other field
// (a step count) as the first file has it.
inline void reshard_state(SavedFiles& files, std::size_t position, const OptimizerSlot& slot, int64_t saved_shards,
                          torch::serialize::OutputArchive& own, const PlacedState* placed) {
  SavedOptimizer& first = *files[0];
  const int64_t n = slot.whole.numel(), stride = (n + saved_shards - 1) / saved_shards;
  torch::serialize::InputArchive& saved_state = *first.states[position];
  for (const std::string& field : saved_state.keys()) {
    c10::IValue value;
    saved_state.read(field, value);
    const at::Tensor t = value.isTensor() ? value.toTensor() : at::Tensor();
    if (placed && t.defined() && t.dim() > 0) {  // (across tensor-parallel layouts: placed in the whole)
      own.write(field, placed->cut(slot, field, t, first.file));
      continue;
    }
    const bool whole = t.defined() && t.sizes() == slot.whole.sizes();
    const bool piece = t.defined() && saved_shards > 1 && t.dim() == 1 && t.numel() == stride && !whole;
    if (!whole && !piece) {  // the same on every process: as saved
      own.write(field, value);
      continue;
    }
    std::vector<at::Tensor> sources(piece ? files.size() : 1);
    for (std::size_t k = 0; k < sources.size(); ++k) {
      if (!files[k]) continue;
      c10::IValue other;
      if (k == 0) other = value;
      else if (!files[k]->states[position] || !files[k]->states[position]->try_read(field, other) ||
               !other.isTensor() || other.toTensor().numel() != stride)
        throw RuntimeError(files[k]->file + " has no " + field + " of " + std::to_string(stride) +
                           " elements for parameter " + std::to_string(position) + " (as " + first.file + " has)");
      sources[k] = other.toTensor();
    }
    at::Tensor mine = at::zeros({slot.piece < 0 ? n : slot.length}, t.options());
    copy_range(sources, piece ? stride : n, slot.begin(), slot.end(), mine);
    own.write(field, slot.piece < 0 ? mine.view(slot.whole.sizes()) : mine);
  }
}

// The saving run's version and parameter groups from its first optimizer
// file (`saved`, at `file`), the version and the groups' count written
// into `out` and `groups`; a count unlike this optimizer's is refused,
// naming the file. Returns the saved groups.
inline torch::serialize::InputArchive saved_param_groups(torch::optim::Optimizer& optimizer,
                                                         torch::serialize::InputArchive& saved, const std::string& file,
                                                         torch::serialize::OutputArchive& out,
                                                         torch::serialize::OutputArchive& groups) {
  torch::serialize::InputArchive saved_groups;
  at::Tensor count;
  try {
    c10::IValue version;
    saved.read("pytorch_version", version);
    out.write("pytorch_version", version);
    saved.read("param_groups", saved_groups);
    saved_groups.read("param_groups/size", count);
  } catch (const std::exception& e) {
    throw RuntimeError(file + " is not an optimizer's archive: " + error_text(e));
  }
  if (count.item<int64_t>() != static_cast<int64_t>(optimizer.param_groups().size()))
    throw RuntimeError(file + " holds " + std::to_string(count.item<int64_t>()) +
                       " parameter groups; this run's optimizer has " +
                       std::to_string(optimizer.param_groups().size()));
  groups.write("param_groups/size", count);
  return saved_groups;
}
// The archive made (`out`, with `state` and `groups` written into it) as
// Optimizer::load reads it, on `device`.
inline std::unique_ptr<torch::serialize::InputArchive> loadable(torch::serialize::OutputArchive& out,
                                                                torch::serialize::OutputArchive& state,
                                                                torch::serialize::OutputArchive& groups,
                                                                c10::Device device) {
  out.write("state", state);
  out.write("param_groups", groups);
  std::ostringstream bytes;
  out.save_to(bytes);
  const std::string held = std::move(bytes).str();
  auto archive = std::make_unique<torch::serialize::InputArchive>();
  archive->load_from(held.data(), held.size(), device);
  return archive;
}

// The options of parameter group g as saved (`saved_group`), read through
// the optimizer's own options type (what they are is the optimizer's
// business), for Optimizer::load's archive.
inline torch::serialize::OutputArchive saved_group_options(torch::optim::Optimizer& optimizer, std::size_t g,
                                                           torch::serialize::InputArchive& saved_group,
                                                           const std::shared_ptr<torch::jit::CompilationUnit>& unit) {
  torch::serialize::InputArchive saved_options;
  saved_group.read("options", saved_options);
  const auto& current = optimizer.param_groups()[g];
  std::unique_ptr<torch::optim::OptimizerOptions> copy =
      (current.has_options() ? current.options() : optimizer.defaults()).clone();
  copy->serialize(saved_options);
  torch::serialize::OutputArchive options(unit);
  copy->serialize(options);
  return options;
}

// Parameter group g as the first file has it (its keys name the states,
// written into `state`), its options through the optimizer's own options
// type (what they are is the optimizer's business). `position` counts the
// parameters of the groups before it.
inline torch::serialize::OutputArchive reshard_group(torch::optim::Optimizer& optimizer, std::size_t g,
                                                     torch::serialize::InputArchive& saved_groups, SavedFiles& files,
                                                     const std::vector<OptimizerSlot>& slots, int64_t saved_shards,
                                                     std::size_t& position, torch::serialize::OutputArchive& state,
                                                     const PlacedState* placed) {
  const SavedOptimizer& first = *files[0];
  torch::serialize::InputArchive saved_group;
  saved_groups.read("param_groups/" + std::to_string(g), saved_group);
  torch::serialize::OutputArchive group(state.compilation_unit());
  at::Tensor size;
  saved_group.read("params/size", size);
  if (size.item<int64_t>() != static_cast<int64_t>(optimizer.param_groups()[g].params().size()))
    throw RuntimeError(first.file + ": parameter group " + std::to_string(g) + " holds " +
                       std::to_string(size.item<int64_t>()) + " parameters; this run's has " +
                       std::to_string(optimizer.param_groups()[g].params().size()));
  group.write("params/size", size);
  for (int64_t j = 0; j < size.item<int64_t>(); ++j, ++position) {
    c10::IValue key;
    saved_group.read("params/" + std::to_string(j), key);
    group.write("params/" + std::to_string(j), key);
    if (!first.states[position]) continue;  // no state yet (never stepped)
    torch::serialize::OutputArchive own(state.compilation_unit());
    reshard_state(files, position, slots[position], saved_shards, own, placed);
    state.write(key.toStringRef(), own);
  }
  torch::serialize::OutputArchive options = saved_group_options(optimizer, g, saved_group, state.compilation_unit());
  group.write("options", options);
  return group;
}

// The saved state of optimizer `index` as this process's optimizer takes it
// (an archive for Optimizer::load and load_group_options). `saved_shards`:
// how many pieces the saving run cut each parameter into (1: whole, in
// `open(0)`); `open(k)`: the file of the process that held piece k. With
// `placed` (across tensor-parallel layouts) only the first file is read,
// the tensors of the state from the piece files.
inline std::unique_ptr<torch::serialize::InputArchive> resharded_optimizer(
    const PreparedSet& set, std::size_t index, int64_t saved_shards, c10::Device device,
    const std::function<OpenedArchive(int64_t)>& open, const PlacedState* placed = nullptr) {
  torch::optim::Optimizer& optimizer = *set.optimizers[index];
  const std::vector<OptimizerSlot> slots = optimizer_slots(set, optimizer);
  SavedFiles files(static_cast<std::size_t>(saved_shards));
  for (const int64_t k : placed ? std::set<int64_t>{0} : pieces_needed(slots, saved_shards))
    files[static_cast<std::size_t>(k)] = read_saved_optimizer(open(k), slots.size());
  SavedOptimizer& first = *files[0];

  torch::serialize::OutputArchive out, state(out.compilation_unit()), groups(out.compilation_unit());
  torch::serialize::InputArchive saved_groups = saved_param_groups(optimizer, first.archive, first.file, out, groups);
  std::size_t position = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    torch::serialize::OutputArchive group =
        reshard_group(optimizer, g, saved_groups, files, slots, saved_shards, position, state, placed);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  if (position != slots.size())
    throw RuntimeError(first.file + " holds the state of " + std::to_string(position) +
                       " parameters; this run's optimizer has " + std::to_string(slots.size()));
  return loadable(out, state, groups, device);
}
}  // namespace detail

ACCEL_NAMESPACE_END
