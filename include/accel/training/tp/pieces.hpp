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
  std::vector<SplitParameter> split;
  std::vector<at::Tensor> partial;
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
// accel::tp's layers or a plan): the group, the split parameters with the
// dimension each was split along (each a piece of a larger tensor;
// everything else of the module is whole on every rank), and the layers by
// qualified name ("" for the module itself), for errors. Empty (no group)
// without such layers. Layers split over different groups are an error.
struct SplitTensors {
  GroupPtr group;
  std::unordered_map<const c10::TensorImpl*, int64_t> dims;
  std::vector<std::string> layers;
  bool contains(const at::Tensor& t) const { return dims.count(t.unsafeGetTensorImpl()) > 0; }
  std::optional<int64_t> dim_of(const at::Tensor& t) const {
    const auto found = dims.find(t.unsafeGetTensorImpl());
    return found == dims.end() ? std::nullopt : std::optional<int64_t>(found->second);
  }
  // The whole tensor's shape, of a piece `t` (t's own where it is whole).
  std::vector<int64_t> whole_sizes(const at::Tensor& t) const {
    std::vector<int64_t> sizes = t.sizes().vec();
    if (const auto dim = dim_of(t)) sizes[*dim] *= size_of(group);
    return sizes;
  }
  // This rank's piece of `whole` where `t` is a piece (whole itself where t is whole).
  at::Tensor piece(const at::Tensor& t, const at::Tensor& whole) const {
    const auto dim = dim_of(t);
    if (!dim) return whole;
    const int64_t length = t.size(*dim);
    return whole.narrow(*dim, rank_in(group) * length, length);
  }
  // The whole tensor of which `values` are this rank's piece of `t`, gathered
  // from the group's pieces (`values` where t is whole): a collective on the
  // group where t is a piece.
  at::Tensor whole(const at::Tensor& t, const at::Tensor& values) const {
    const auto dim = dim_of(t);
    if (!dim) return values;
    return at::cat(accel::all_gather(values.detach().contiguous(), group).unbind(0), *dim);
  }
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
    for (const auto& [p, dim] : pieces->split) split.dims.emplace(p.unsafeGetTensorImpl(), dim);
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
}  // namespace detail::tp

ACCEL_NAMESPACE_END
