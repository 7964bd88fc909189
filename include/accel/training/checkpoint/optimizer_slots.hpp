// accel/training/checkpoint/optimizer_slots.hpp: what each position of an optimizer's parameter list is in this run (a shard, a tensor-parallel piece, its names), and its state read from the piece files across tensor-parallel layouts.
//
// Loading an optimizer's state saved in another layout
// (checkpoint/reshard.hpp) cuts each tensor of the state to what this
// process keeps of the parameter at that position: OptimizerSlot says
// what that is. Across tensor-parallel layouts the tensors come from the
// piece files, where the saving processes placed them in the whole tensors
// under Python's names (checkpoint/shards.hpp): PlacedState reads them.
#pragma once

#include "accel/training/checkpoint/prepared.hpp"
#include "accel/training/checkpoint/sharded_weights.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A position of an optimizer's parameter list (group after group), as this
// run holds it: the parameter (whole, or this process's tensor-parallel
// piece of it) and, where sharded, which piece of how many elements this
// process keeps of that (piece -1: all of it); its names in its model, and
// a tensor-parallel piece's place in the whole tensor (empty: whole).
struct OptimizerSlot {
  at::Tensor whole;
  int64_t piece = -1, length = 0;
  std::vector<std::string> names{};
  std::vector<int64_t> origin{};
  // The elements [begin, end) of the flattened parameter this process keeps.
  int64_t begin() const { return piece < 0 ? 0 : std::min(whole.numel(), piece * length); }
  int64_t end() const { return piece < 0 ? whole.numel() : std::min(whole.numel(), begin() + length); }
};

inline std::vector<OptimizerSlot> optimizer_slots(const PreparedSet& set, torch::optim::Optimizer& optimizer) {
  std::map<const c10::TensorImpl*, OptimizerSlot> known;  // by what the optimizer steps: a shard, or the parameter
  for (const auto& m : set.models) {
    const ParameterNames names(*m.module);
    const bool sharded = m.data_parallel && m.data_parallel->sharded();
    for (const auto& p : m.module->parameters()) {
      OptimizerSlot slot{p, -1, p.numel(), names.all(p), place_in_whole(m.split, p)};
      const at::Tensor shard = sharded ? m.data_parallel->shard_of(p) : at::Tensor();
      if (!shard.defined()) {
        known.emplace(p.unsafeGetTensorImpl(), std::move(slot));
        continue;
      }
      slot.piece = m.data_parallel->shard_group()->getRank();
      slot.length = shard.numel();
      known[shard.unsafeGetTensorImpl()] = std::move(slot);
    }
  }
  std::vector<OptimizerSlot> slots;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      const auto found = known.find(p.unsafeGetTensorImpl());
      slots.push_back(found != known.end() ? found->second : OptimizerSlot{p, -1, p.numel()});
    }
  return slots;
}

// Where a load across tensor-parallel layouts reads optimizer `index`'s
// tensor state (see the top): the piece files (null: the checkpoint has
// none).
struct PlacedState {
  const ShardedWeights* pieces = nullptr;
  std::size_t index = 0;

  // The saved name of field `field` of the parameter named `parameter`.
  std::string name(const std::string& parameter, const std::string& field) const {
    return optimizer_prefix(index) + parameter + "." + field;
  }
  // Field `field` of the slot's parameter as this process keeps it (like
  // `first`, the first file's: its dtype and device), or an error naming
  // `file` where the piece files do not hold it.
  at::Tensor cut(const OptimizerSlot& slot, const std::string& field, const at::Tensor& first,
                 const std::string& file) const {
    const int64_t begin = slot.begin(), length = slot.end() - slot.begin();
    at::Tensor values;
    for (const std::string& parameter : slot.names)
      if (const std::string saved = name(parameter, field); pieces && pieces->holds(saved)) {
        values = pieces->read(saved, begin, length, slot.whole.sizes().vec(), slot.origin).to(first.options());
        break;
      }
    if (!values.defined())
      throw RuntimeError(
          file + ": the optimizer's " + field + " of " +
          (slot.names.empty() ? "parameter of shape " + c10::str(slot.whole.sizes()) : "'" + slot.names.front() + "'") +
          " cannot move to another tensor-parallel layout: the piece files do not place it in the "
          "whole tensor (they do for Adam, AdamW and SGD); resume in the saving layout");
    if (slot.piece < 0) return values.view(slot.whole.sizes());
    at::Tensor padded = at::zeros({slot.length}, first.options());  // (a shard: the last one padded, as saved)
    padded.narrow(0, 0, length).copy_(values);
    return padded;
  }
};

}  // namespace detail

ACCEL_NAMESPACE_END
