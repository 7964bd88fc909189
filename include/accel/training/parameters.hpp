// accel/training/parameters.hpp: a module's parameters as Python counts them: each tensor once, known by all its names.
//
// LibTorch's Module::parameters() lists a tensor registered in two modules
// (tied weights: GPT-2's token embedding and head) twice, where Python's
// parameters() removes the repeats. Stepped, reduced or counted twice, such
// a weight trains wrongly without a word, so the training helpers take each
// tensor once, by identity (its TensorImpl), in the order of its first
// appearance; and an error about a parameter names it by every name it has.
// Under sharding a parameter has a stand-in, the tensor an optimizer steps
// in its place (StandIns).
#pragma once

#include "accel/training/weak_keyed_map.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// `tensors` with each tensor once (by identity, in first-appearance order).
inline std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  out.reserve(tensors.size());
  for (const auto& t : tensors)
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  return out;
}

// Each parameter of `module` by its qualified names (state_dict's:
// "transformer.wte.weight"), all of them for a tied one, in order.
class ParameterNames {
 public:
  ParameterNames() = default;
  explicit ParameterNames(const torch::nn::Module& module) {
    for (const auto& named : module.named_parameters())
      names_[named.value().unsafeGetTensorImpl()].push_back(named.key());
  }
  // "'transformer.wte.weight'", or for a tied one
  // "'transformer.wte.weight' (tied: also 'lm_head.weight')"; a tensor
  // that is no parameter of the module by its shape.
  std::string describe(const at::Tensor& p) const {
    const auto found = names_.find(p.unsafeGetTensorImpl());
    if (found == names_.end() || found->second.empty()) return "of shape " + c10::str(p.sizes());
    std::string text = "'" + found->second.front() + "'";
    for (std::size_t i = 1; i < found->second.size(); ++i)
      text += (i == 1 ? " (tied: also '" : ", '") + found->second[i] + "'";
    if (found->second.size() > 1) text += ")";
    return text;
  }
  // Every name (none for a tensor that is no parameter of the module).
  std::vector<std::string> all(const at::Tensor& p) const {
    const auto found = names_.find(p.unsafeGetTensorImpl());
    return found == names_.end() ? std::vector<std::string>{} : found->second;
  }
  // The first name (empty for a tensor that is no parameter of the module).
  std::string first(const at::Tensor& p) const {
    const auto found = names_.find(p.unsafeGetTensorImpl());
    return found == names_.end() || found->second.empty() ? std::string() : found->second.front();
  }

 private:
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names_;
};

// The tensor standing in for a parameter: a sharded wrapper's shard of it
// (ZeRO-2/3, dp/shards.hpp), which the optimizer steps instead, and whose
// gradient, after the data-parallel reduction, is this rank's chunk of the
// parameter's averaged gradient. Registered here by the wrapper, so that
// what works on reduced gradients without knowing the wrapper (tensor
// parallelism's partial sums, tp/sequence_parallel.hpp) finds them; kept
// weakly (a stand-in that has gone is not found).
class StandIns {
 public:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  static StandIns& instance() {
    static StandIns stand_ins;
    return stand_ins;
  }
  void add(const at::Tensor& parameter, const at::Tensor& stand_in) {
    stand_ins_.insert(weak_tensor(parameter), Weak(stand_in.getIntrusivePtr()));
  }
  // The tensor standing in for `parameter`, else `parameter` itself.
  at::Tensor of(const at::Tensor& parameter) const {
    if (const auto found = stand_ins_.find(parameter.unsafeGetTensorImpl()))
      if (auto alive = found->lock(); alive.defined()) return at::Tensor(std::move(alive));
    return parameter;
  }

 private:
  TensorKeyedMap<Weak> stand_ins_;
};
}  // namespace detail

ACCEL_NAMESPACE_END
