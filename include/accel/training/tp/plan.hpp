// accel/training/tp/plan.hpp: tp::parallelize_module, torch's plan of parallel styles applied to a plain model's Linear and Embedding layers, norms and blocks.
//
//     accel::tp::parallelize_module(*model, {
//         {"embed", accel::tp::RowwiseParallel{.input_layouts = accel::tp::Replicate{},
//                                              .output_layouts = accel::tp::Shard{1}}},
//         {"layers.*.attention_norm", accel::tp::SequenceParallel{}},
//         {"layers.*.attention", accel::tp::PrepareModuleInput{{accel::tp::Shard{1}}, {accel::tp::Replicate{}}}},
//         {"layers.*.attention.wq", accel::tp::ColwiseParallel{}},
//         {"layers.*.attention.wo", accel::tp::RowwiseParallel{.output_layouts = accel::tp::Shard{1}}},
//     });
//
// Each key names submodules as torch's do (dotted names; `*` within a part
// matches any characters of that part); each matched module takes its style:
// a column or row style narrows a torch::nn::Linear's or Embedding's
// parameters to this rank's piece, in place (the same tensors, so tied
// weights stay tied: narrow them the same way), and a SequenceParallel
// module's parameters are listed for the partial-gradient sum. The model's
// forward then calls each styled module through accel::unit_forward (the
// call FULL_SHARD's units already take), which applies its style.
// Everything is checked before anything changes; every mistake is an
// InvalidArgument naming the plan's key or the module.
#pragma once

#include "accel/training/tp/styled_forward.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// torch's plan keys: the same number of dotted parts, each matched with `*`
// standing for any characters.
inline bool part_matches(std::string_view pattern, std::string_view part) {
  if (pattern.empty()) return part.empty();
  if (pattern.front() == '*')
    for (std::size_t skip = 0; skip <= part.size(); ++skip)
      if (part_matches(pattern.substr(1), part.substr(skip))) return true;
  return !part.empty() && pattern.front() == part.front() && pattern.front() != '*' &&
         part_matches(pattern.substr(1), part.substr(1));
}
inline bool name_matches(const std::string& pattern, const std::string& name) {
  const auto split = [](const std::string& s) {
    std::vector<std::string_view> parts;
    std::size_t from = 0;
    for (std::size_t dot; (dot = s.find('.', from)) != std::string::npos; from = dot + 1)
      parts.emplace_back(s.data() + from, dot - from);
    parts.emplace_back(s.data() + from, s.size() - from);
    return parts;
  };
  const auto p = split(pattern), n = split(name);
  if (p.size() != n.size()) return false;
  for (std::size_t i = 0; i < p.size(); ++i)
    if (!part_matches(p[i], n[i])) return false;
  return true;
}

enum class ModuleKind { linear, embedding, other };

// One matched module and its style, checked; the tensors it narrows with their dimensions.
struct PlannedModule {
  std::string key, name;
  std::shared_ptr<torch::nn::Module> module;
  accel::tp::ParallelStyle style;
  ModuleKind kind = ModuleKind::other;
  std::vector<std::pair<at::Tensor, int64_t>> narrowed;
  int64_t whole_features = 0;
};

inline void check_plan_entry(PlannedModule& m, int parts) {
  const std::string who =
      "accel::tp::parallelize_module: '" + m.name + "' (" + style_name(m.style) + ", key '" + m.key + "')";
  if (dynamic_cast<const ParallelLayer*>(m.module.get()))
    throw InvalidArgument(who + " is an accel::tp layer, already split over its group");
  if (StyledRegistry::instance().find(m.module.get()))
    throw InvalidArgument(who + " already has a parallel style (parallelize_module was applied to it before)");
  if (const auto* prepare = std::get_if<accel::tp::PrepareModuleInput>(&m.style)) {
    if (prepare->input_layouts.size() != prepare->desired_input_layouts.size())
      throw InvalidArgument(who + ": input_layouts has " + std::to_string(prepare->input_layouts.size()) +
                            " entries and desired_input_layouts " +
                            std::to_string(prepare->desired_input_layouts.size()) + "; give both for each input");
    return;
  }
  if (std::holds_alternative<accel::tp::SequenceParallel>(m.style)) return;
  const bool col = std::holds_alternative<accel::tp::ColwiseParallel>(m.style);
  // The layout that meets the split dimension: Colwise's output, Rowwise's input.
  const accel::tp::Layout& last = col ? std::get<accel::tp::ColwiseParallel>(m.style).output_layouts
                                      : std::get<accel::tp::RowwiseParallel>(m.style).input_layouts;
  if (const auto* shard = std::get_if<accel::tp::Shard>(&last); shard && shard->dim != -1)
    throw InvalidArgument(who + ": its " + (col ? "output_layouts " : "input_layouts ") + describe(last) +
                          " must be Shard(-1) (the last dimension, split by the layer) or Replicate()");
  const auto piece = [&](int64_t whole, const char* what) {
    if (whole % parts != 0)
      throw InvalidArgument(who + ": " + what + " " + std::to_string(whole) + " does not split into " +
                            std::to_string(parts) + " equal pieces (the tensor-parallel group's size)");
  };
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(m.module.get())) {
    m.kind = ModuleKind::linear;
    const int64_t out = linear->weight.size(0), in = linear->weight.size(1);
    m.whole_features = in;
    if (col) {
      piece(out, "out_features");
      m.narrowed.emplace_back(linear->weight, 0);
      if (linear->bias.defined()) m.narrowed.emplace_back(linear->bias, 0);
    } else {
      piece(in, "in_features");
      m.narrowed.emplace_back(linear->weight, 1);
    }
  } else if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(m.module.get())) {
    m.kind = ModuleKind::embedding;
    if (embedding->options.max_norm())
      throw InvalidArgument(who + ": max_norm renormalizes whole rows in place; a split table cannot");
    m.whole_features = embedding->weight.size(0);
    if (col) {
      piece(embedding->weight.size(1), "embedding_dim");
      m.narrowed.emplace_back(embedding->weight, 1);
    } else {
      if (embedding->options.scale_grad_by_freq())
        throw InvalidArgument(who + ": scale_grad_by_freq counts the ids a rank's rows do not hold");
      piece(embedding->weight.size(0), "num_embeddings");
      m.narrowed.emplace_back(embedding->weight, 0);
    }
  } else {
    throw InvalidArgument(who + " applies to a torch::nn::Linear or Embedding; this module is " + m.module->name());
  }
  // Whatever already holds a tensor's gradient slot holds it with the whole shape: a graph kept from an
  // earlier forward (its backward would fail), a data-parallel wrapper (its buckets and its view of which
  // tensors are split would be wrong: Accelerator::prepare or DataParallel made before the plan).
  for (const auto& [tensor, dim] : m.narrowed)
    if (torch::autograd::impl::try_get_grad_accumulator(tensor))
      throw InvalidArgument(who +
                            ": its weight's gradient is already wired: an autograd graph of an earlier "
                            "forward still alive, or a data-parallel wrapper (Accelerator::prepare, "
                            "DataParallel) made before the plan; apply the plan first");
}
}  // namespace detail::tp

namespace tp {
// Applies `plan` to `model` over `group` (null: the process's Dim::TP
// group): see this part's opening comment. Call it before making the
// optimizer (the narrowed parameters change shape), and with the same
// random state on every rank of the group where the layers' initial values
// matter (each keeps its piece of the same whole tensor). On a group of one
// the plan is checked and nothing else changes.
inline void parallelize_module(torch::nn::Module& model, const std::map<std::string, ParallelStyle>& plan,
                               const GroupPtr& group = {}) {
  const GroupPtr g = detail::tp::group_or_default(group, "parallelize_module");
  const int parts = detail::tp::size_of(g), rank = detail::tp::rank_in(g);
  const auto named = model.named_modules("", /*include_self=*/false);
  std::vector<detail::tp::PlannedModule> planned;
  std::unordered_map<const torch::nn::Module*, std::string> styled_by;  // module -> the key that styled it
  for (const auto& [key, style] : plan) {
    bool matched = false;
    for (const auto& item : named) {
      if (!detail::tp::name_matches(key, item.key())) continue;
      matched = true;
      const auto [at, fresh] = styled_by.emplace(item.value().get(), key);
      if (!fresh)
        throw InvalidArgument("accel::tp::parallelize_module: '" + item.key() + "' is matched by the keys '" +
                              at->second + "' and '" + key + "'; give each module one style");
      planned.push_back({key, item.key(), item.value(), style, detail::tp::ModuleKind::other, {}, 0});
    }
    if (!matched) {
      std::string names;
      for (std::size_t i = 0; i < named.size() && i < 8; ++i) names += (i ? ", '" : "'") + named[i].key() + "'";
      throw InvalidArgument("accel::tp::parallelize_module: the plan's key '" + key +
                            "' matches no submodule of the model (" +
                            (named.is_empty() ? std::string("it has none")
                                              : "its submodules: " + names + (named.size() > 8 ? ", ..." : "")) +
                            ")");
    }
  }
  for (auto& m : planned) detail::tp::check_plan_entry(m, parts);
  // A tensor two styles narrow (a tied embedding and head) must be split the same way by both.
  std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, std::string>> split_dim_of;
  for (const auto& m : planned)
    for (const auto& [tensor, dim] : m.narrowed) {
      const auto [at, fresh] = split_dim_of.emplace(tensor.unsafeGetTensorImpl(), std::pair{dim, m.name});
      if (!fresh && at->second.first != dim)
        throw InvalidArgument("accel::tp::parallelize_module: '" + m.name + "' and '" + at->second.second +
                              "' share a weight and split it along different dimensions (" + std::to_string(dim) +
                              " and " + std::to_string(at->second.first) + ")");
    }
  if (parts == 1) return;

  const auto watch = std::make_shared<detail::tp::CallWatch>();
  std::unordered_set<const c10::TensorImpl*> narrowed, watched;
  for (auto& m : planned) {
    {
      const at::NoGradGuard no_grad;
      for (auto& [tensor, dim] : m.narrowed) {
        if (!narrowed.insert(tensor.unsafeGetTensorImpl()).second) continue;  // tied: narrowed once
        const int64_t length = tensor.size(dim) / parts;
        tensor.set_data(tensor.detach().narrow(dim, rank * length, length).clone());
      }
    }
    auto styled = std::make_shared<detail::tp::Styled>();
    styled->name = m.name;
    styled->style = m.style;
    styled->group = g;
    styled->module = m.module;
    styled->watch = watch;
    styled->whole_features = m.whole_features;
    if (m.kind == detail::tp::ModuleKind::embedding && std::holds_alternative<RowwiseParallel>(m.style))
      styled->vocab_start = rank * (m.whole_features / parts);
    for (auto [p, dim] : detail::tp::styled_split_parameters(*styled, *m.module)) {
      if (!p.requires_grad() || !watched.insert(p.unsafeGetTensorImpl()).second) continue;  // (tied: once)
      watch->watch(p, styled->who());
      p.register_hook([watch, impl = p.unsafeGetTensorImpl()](const at::Tensor&) { watch->take(impl); });
    }
    detail::tp::StyledRegistry::instance().add(std::move(styled));
  }
}
}  // namespace tp

ACCEL_NAMESPACE_END
