// accel/training/tp/registry.hpp: the modules a plan styled (tp::parallelize_module), found by address when they run, and the watch that refuses a styled module called around its style.
//
// torch applies a style through forward hooks; LibTorch modules have none,
// so a styled module runs through accel::unit_forward, which finds its
// style here (tp/styled_forward.hpp). The registry keeps each styled module
// by address with a weak reference (detail::ModuleKeyedMap).
#pragma once

#include "accel/training/tp/layer.hpp"
#include "accel/training/tp/styles.hpp"
#include "accel/training/weak_keyed_map.hpp"

#include <mutex>

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// A module called directly (up->forward(x), up(x)) skips its style: a
// column layer's input gradient would stay this rank's part, a row layer's
// output would miss the sum. LibTorch gives no hook on the call, so the
// watch notices in the backward, where it matters for training: a styled
// call marks the module's split parameters on its output's gradient, which
// autograd computes before the gradient reaches the parameters; the
// parameters' own hooks then find a mark, or refuse the gradient.
class CallWatch {
 public:
  void watch(const at::Tensor& parameter, std::string who) {
    const std::lock_guard lock(mutex_);
    owners_.emplace(parameter.unsafeGetTensorImpl(), std::move(who));
  }
  void mark(const std::vector<at::Tensor>& parameters) {
    const std::lock_guard lock(mutex_);
    for (const auto& p : parameters) ++marks_[p.unsafeGetTensorImpl()];
  }
  // Called with each gradient of a watched parameter: passes when a styled
  // call produced it (the marks of this backward are used up), else throws.
  void take(const c10::TensorImpl* parameter) {
    const std::lock_guard lock(mutex_);
    int64_t& marks = marks_[parameter];
    if (marks > 0) {
      marks = 0;
      return;
    }
    throw LogicError("accel::tp: " + owners_[parameter] +
                     " was called directly (module->forward(x) or module(x)), around its parallel style: its "
                     "gradient would be wrong. Call it as accel::unit_forward(module, x): LibTorch modules have no "
                     "forward hooks to apply the style");
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, std::string> owners_;
  std::unordered_map<const c10::TensorImpl*, int64_t> marks_;
};

// A module a plan styled, over a group of more than one rank.
struct Styled {
  std::string name;  // its qualified name in the model the plan was applied to
  accel::tp::ParallelStyle style;
  GroupPtr group;
  std::weak_ptr<const torch::nn::Module> module;
  std::shared_ptr<CallWatch> watch;
  int64_t whole_features = 0;  // a Linear's whole in_features, an Embedding's whole num_embeddings
  int64_t vocab_start = 0;     // a rowwise Embedding: the first row this rank holds

  std::string who() const { return "'" + name + "' (" + style_name(style) + ")"; }
  bool colwise() const { return std::holds_alternative<accel::tp::ColwiseParallel>(style); }
  bool rowwise() const { return std::holds_alternative<accel::tp::RowwiseParallel>(style); }
};

// The styled modules, by address (ModuleKeyedMap: a module that has gone is
// never found, even when a new one takes its address).
class StyledRegistry {
 public:
  static StyledRegistry& instance() {
    static StyledRegistry registry;
    return registry;
  }
  void add(std::shared_ptr<const Styled> styled) { styled_.insert(styled->module, styled); }
  // The style of `module`, or null.
  std::shared_ptr<const Styled> find(const torch::nn::Module* module) const {
    return styled_.find(module).value_or(nullptr);
  }

 private:
  ModuleKeyedMap<std::shared_ptr<const Styled>> styled_;
};

// The tensors a styled module holds split (pieces of a larger tensor) and
// those whose gradient it leaves partial; read from the module itself, so
// a weight tied elsewhere is the one its forward uses.
inline std::vector<SplitParameter> styled_split_parameters(const Styled& s, const torch::nn::Module& module) {
  std::vector<SplitParameter> out;
  if (!s.colwise() && !s.rowwise()) return out;
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module)) {  // [out, in]: rows or columns
    out.push_back({linear->weight, s.colwise() ? 0 : 1});
    if (s.colwise() && linear->bias.defined()) out.push_back({linear->bias, 0});
  } else if (const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&module)) {
    out.push_back({embedding->weight, s.colwise() ? 1 : 0});  // [vocabulary, features]
  }
  return out;
}
inline std::vector<at::Tensor> styled_partial_parameters(const Styled& s, const torch::nn::Module& module) {
  if (std::holds_alternative<accel::tp::SequenceParallel>(s.style)) return module.parameters();
  const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module);
  const auto* row = std::get_if<accel::tp::RowwiseParallel>(&s.style);
  // A row layer's bias added to this rank's piece of the sequence only.
  if (linear && row && linear->bias.defined() && std::holds_alternative<accel::tp::Shard>(row->output_layouts))
    return {linear->bias};
  return {};
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END
