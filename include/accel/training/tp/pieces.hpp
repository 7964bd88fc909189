// accel/training/tp/pieces.hpp: what of a module is split over a tensor-parallel group (by accel::tp's layers or by a plan), and what whole-model operations do with it.
#pragma once

#include "accel/training/tp/layer.hpp"
#include "accel/training/tp/registry.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// What one module holds split over its group, and which of its parameters'
// gradients leave a backward partial (this rank's part of a sum over the
// group): an accel::tp layer says so itself, a module a plan styled through
// the registry. None for a module of neither kind.
struct Pieces {
  GroupPtr group;
  std::vector<at::Tensor> split, partial;
};
inline std::optional<Pieces> pieces_of(const torch::nn::Module& module) {
  if (const auto* layer = dynamic_cast<const ParallelLayer*>(&module)) {
    if (layer->tp_size() == 1) return std::nullopt;
    return Pieces{layer->group(), layer->split_parameters(), layer->partial_parameters()};
  }
  if (const auto styled = StyledRegistry::instance().find(&module))
    return Pieces{styled->group, styled_split_parameters(*styled, module), styled_partial_parameters(*styled, module)};
  return std::nullopt;
}

// What of a module is split over a group of more than one rank (by
// accel::tp's layers or a plan): the group, the split parameters (each a piece of a larger tensor;
// everything else of the module is whole on every rank), and the layers by
// qualified name ("" for the module itself), for errors. Empty (no group)
// without such layers. Layers split over different groups are an error.
struct SplitTensors {
  GroupPtr group;
  std::unordered_set<const c10::TensorImpl*> parameters;
  std::vector<std::string> layers;
  bool contains(const at::Tensor& t) const { return parameters.count(t.unsafeGetTensorImpl()) > 0; }
};
inline SplitTensors split_tensors(const torch::nn::Module& module) {
  SplitTensors split;
  const auto visit = [&](const std::string& name, const torch::nn::Module& m) {
    const auto pieces = pieces_of(m);
    if (!pieces || pieces->split.empty()) return;
    if (split.group && pieces->group != split.group)
      throw InvalidArgument("accel::tp: the layer '" + name + "' is split over another group than '" +
                            split.layers.front() + "'");
    split.group = pieces->group;
    split.layers.push_back(name);
    for (const auto& p : pieces->split) split.parameters.insert(p.unsafeGetTensorImpl());
  };
  visit("", module);
  for (const auto& named : module.named_modules("", /*include_self=*/false)) visit(named.key(), *named.value());
  return split;
}
// Copies tp rank 0's values of the tensors of `module` that `split` does not
// hold (norms, a row layer's bias, buffers: whole on every rank) to the other
// ranks of its tp group, in one broadcast. Data parallelism starts each
// dp_cp group from its own first rank; without this, ranks of one tp group
// could start with different copies of a tensor that must be the same on all
// of them, and stay so. Nothing without split layers.
inline void broadcast_whole_tensors(const torch::nn::Module& module, const SplitTensors& split) {
  if (!split.group) return;
  std::vector<at::Tensor> whole;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto keep = [&](const at::Tensor& t) {
    if (t.defined() && !split.contains(t) && seen.insert(t.unsafeGetTensorImpl()).second) whole.push_back(t);
  };
  for (const auto& p : module.parameters()) keep(p);
  for (const auto& b : module.buffers()) keep(b);
  if (!whole.empty()) accel::broadcast(std::move(whole), 0, split.group);
}
// Refuses a module holding split layers where `what` would take
// each process's parameters for whole ones (writing rank 0's pieces as the
// model, or loading whole tensors into pieces): the error names one layer.
inline void refuse_split_layers(const torch::nn::Module& module, const std::string& what) {
  const SplitTensors split = split_tensors(module);
  if (!split.group) return;
  throw InvalidArgument(what + ": the model holds tensor-parallel layers split over " +
                        std::to_string(split.group->getSize()) + " ranks ('" + split.layers.front() + "' and " +
                        std::to_string(split.layers.size() - 1) +
                        " more); their pieces are not gathered or scattered by it yet");
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END
