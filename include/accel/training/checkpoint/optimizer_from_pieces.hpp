// accel/training/checkpoint/optimizer_from_pieces.hpp: an optimizer's state across pipeline layouts, built from the piece files alone.
//
// Under a pipeline each process's optimizer steps its own stages'
// parameters, so a saved optimizer file's parameter list is the saving
// process's: in another pipeline layout (another pp, pp on one side only,
// the stages sharded another way) its positions are not this process's,
// and reshard.hpp's cut, which goes by position, cannot be used. The
// tensors of the state are also in the piece files, placed in the whole
// tensors under Python's names (Adam's, AdamW's and SGD's:
// checkpoint/shards.hpp's python_state), by parameter name: this part
// builds, for each of this process's parameters, the state its optimizer
// keeps from them (its box of the whole, and of that its range where
// sharded), and gives it to Optimizer::load as the archive it would have
// saved. The groups' options (learning rate, betas, ...) come from the
// saving run's first optimizer file, group by group: every process of a
// pipeline builds its optimizer with the same groups.
#pragma once

#include "accel/training/checkpoint/reshard.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The parameters an optimizer steps, by name, in its order: what a
// pipeline's optimizer file records (under kParameterNamesKey), since
// another schedule over as many processes may give a process other stages,
// whose optimizer has as many parameters, in other places.
inline constexpr const char* kParameterNamesKey = "accel_parameter_names";
inline std::string parameter_names_text(const PreparedSet& set, torch::optim::Optimizer& optimizer) {
  std::string text;
  for (const OptimizerSlot& slot : optimizer_slots(set, optimizer))
    text += (slot.names.empty() ? "(unnamed " + c10::str(slot.whole.sizes()) + ")" : slot.names.front()) + "\n";
  return text;
}
// Whether a saved optimizer file stepped the parameters this optimizer
// steps, by name (false where it does not say).
inline bool steps_these_parameters(torch::serialize::InputArchive& saved, const PreparedSet& set,
                                   torch::optim::Optimizer& optimizer) {
  c10::IValue names;
  return saved.try_read(kParameterNamesKey, names) && names.isString() &&
         names.toStringRef() == parameter_names_text(set, optimizer);
}

// One parameter's state (`slot`) from the piece files, serialized as its
// optimizer's own state type into `own`; false where they hold none (the
// parameter had no state yet).
inline bool placed_state(torch::optim::Optimizer& optimizer, const PlacedState& placed, const OptimizerSlot& slot,
                         const std::string& file, torch::serialize::OutputArchive& own) {
  const auto saved = [&](const char* field) -> std::optional<std::string> {
    for (const std::string& parameter : slot.names)
      if (placed.pieces && placed.pieces->holds(placed.name(parameter, field))) return placed.name(parameter, field);
    return std::nullopt;
  };
  const auto cut = [&](const char* field) { return placed.cut(slot, field, slot.whole, file); };
  const auto step = [&]() -> int64_t {
    const auto name = saved("step");
    if (!name)
      throw RuntimeError(file + ": the piece files hold no step of '" + slot.names.front() + "' beside its moments");
    return std::llround(placed.pieces->read(*name, 0, 1).item<double>());
  };
  auto adam_like = [&](auto state) {
    if (!saved("exp_avg")) return false;
    state.step(step());
    state.exp_avg(cut("exp_avg"));
    state.exp_avg_sq(cut("exp_avg_sq"));
    if (saved("max_exp_avg_sq")) state.max_exp_avg_sq(cut("max_exp_avg_sq"));
    state.serialize(own);
    return true;
  };
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return adam_like(torch::optim::AdamParamState());
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return adam_like(torch::optim::AdamWParamState());
  if (!saved("momentum_buffer")) return false;  // (SGD: plain SGD keeps none)
  torch::optim::SGDParamState state;
  state.momentum_buffer(cut("momentum_buffer"));
  state.serialize(own);
  return true;
}

// The state of optimizer `index` for this process's parameters, from the
// piece files (`pieces`) and the groups' options of `first` (the saving
// run's first file of this optimizer): an archive for Optimizer::load and
// load_group_options. Another kind of optimizer than Adam, AdamW and SGD
// is refused, naming `first`: the piece files do not hold its state.
inline std::unique_ptr<torch::serialize::InputArchive> optimizer_from_pieces(const PreparedSet& set, std::size_t index,
                                                                             const ShardedWeights* pieces,
                                                                             OpenedArchive first, c10::Device device) {
  torch::optim::Optimizer& optimizer = *set.optimizers[index];
  if (!dynamic_cast<torch::optim::Adam*>(&optimizer) && !dynamic_cast<torch::optim::AdamW*>(&optimizer) &&
      !dynamic_cast<torch::optim::SGD*>(&optimizer))
    throw RuntimeError(first.file +
                       ": this optimizer's state cannot move to another pipeline layout (the piece files place "
                       "Adam's, AdamW's and SGD's in the whole tensors, by name); resume in the saving layout");
  const std::vector<OptimizerSlot> slots = optimizer_slots(set, optimizer);
  const PlacedState placed{pieces, index};
  torch::serialize::OutputArchive out, state(out.compilation_unit()), groups(out.compilation_unit());
  torch::serialize::InputArchive saved_groups = saved_param_groups(optimizer, first.archive, first.file, out, groups);
  std::size_t position = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    torch::serialize::InputArchive saved_group;
    saved_groups.read("param_groups/" + std::to_string(g), saved_group);
    torch::serialize::OutputArchive group(out.compilation_unit());
    const auto count = static_cast<int64_t>(optimizer.param_groups()[g].params().size());
    group.write("params/size", at::scalar_tensor(count, at::kLong));
    for (int64_t j = 0; j < count; ++j, ++position) {
      // (a key of this archive's own: Optimizer::load pairs the groups' keys with the state's, then each position
      // with this optimizer's parameter there; LibTorch writes them as decimal numbers)
      const std::string key = std::to_string(position + 1);
      group.write("params/" + std::to_string(j), c10::IValue(key));
      torch::serialize::OutputArchive own(out.compilation_unit());
      if (placed_state(optimizer, placed, slots[position], first.file, own)) state.write(key, own);
    }
    torch::serialize::OutputArchive options = saved_group_options(optimizer, g, saved_group, out.compilation_unit());
    group.write("options", options);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  return loadable(out, state, groups, device);
}
}  // namespace detail

ACCEL_NAMESPACE_END
