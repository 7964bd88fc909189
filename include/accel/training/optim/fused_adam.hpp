// accel/training/optim/fused_adam.hpp: Adam and AdamW stepped by LibTorch's fused kernels.
//
// torch::optim::Adam and AdamW step a parameter with about six tensor
// operations, each a pass over its memory, and a temporary the size of the
// parameter (the denominator); Python's Adam(fused=True) steps a group's
// parameters with one kernel (at::_fused_adam_, at::_fused_adamw_): one pass
// over each parameter, its gradient and its two moments, no temporary. The
// kernels run on CPUs since LibTorch 2.4 (on CUDA before). accel::FusedAdam
// and accel::FusedAdamW are LibTorch's optimizers with that step: the same
// options, the same state per parameter (AdamParamState, AdamWParamState:
// prepare(), sharding, checkpoints and torch::save see the originals), and the
// arithmetic of Python's fused=True, which rounds in another order than
// torch::optim::Adam (its parameters agree with Adam's to rounding, not bit
// for bit). Dense gradients of the parameter's own floating dtype. On
// LibTorch before 2.4 the constructor refuses, as Python's fused=True does on
// a CPU tensor there.
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline constexpr bool has_fused_adam = TORCH_VERSION_MAJOR > 2 ||
                                       (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);

// A fused optimizer's first member: on a LibTorch without the kernels its
// construction fails, so no such optimizer exists to step.
struct FusedAdamSupport {
  explicit FusedAdamSupport(const char* name) {
    if (!has_fused_adam)
      throw RuntimeError(std::string(name) + " needs LibTorch 2.4 or newer (its fused Adam kernels); this is " +
                         std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                         ": use torch::optim::" + (std::string_view(name).ends_with('W') ? "AdamW" : "Adam"));
  }
};

// One step of a fused Adam (decoupled: AdamW) over every group of
// `optimizer`, creating each parameter's state as LibTorch's own step does.
// Parameters are stepped in one kernel call per device, dtype and step count
// (a parameter that joined later has its own count); the kernel reads the
// count from a tensor on the parameter's device, kept in `steps` (one per
// device, refilled before each call: nothing is allocated per step).
template <bool decoupled, class Options, class ParamState>
void fused_adam_step(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>& steps, const char* name) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  struct Call {
    c10::Device device;
    at::ScalarType dtype;
    int64_t step;
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  };
  auto step_tensor = [&](c10::Device device) -> at::Tensor& {
    for (auto& t : steps)
      if (t.device() == device) return t;
    return steps.emplace_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device)));
  };
  // Every gradient of every group checked before anything steps: a refused step leaves it all as it was.
  for (const auto& group : optimizer.param_groups())
    for (std::size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (grad.is_sparse()) throw InvalidArgument(std::string(name) + " does not support sparse gradients");
      if (!p.is_floating_point() || grad.scalar_type() != p.scalar_type() || grad.device() != p.device())
        throw InvalidArgument(std::string(name) + ": parameter " + std::to_string(i) + " of its group is " +
                              std::string(c10::toString(p.scalar_type())) + " on " + p.device().str() +
                              " with a gradient of " + std::string(c10::toString(grad.scalar_type())) + " on " +
                              grad.device().str() +
                              " (the fused kernel takes floating parameters with gradients of their dtype and device)");
    }
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    std::vector<Call> calls;
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      auto found = state.find(p.unsafeGetTensorImpl());
      if (found == state.end()) {  // as LibTorch's Adam::step makes it
        auto fresh = std::make_unique<ParamState>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        found = state.emplace(p.unsafeGetTensorImpl(), std::move(fresh)).first;
      }
      auto& s = static_cast<ParamState&>(*found->second);
      s.step(s.step() + 1);
      auto call = std::find_if(calls.begin(), calls.end(), [&](const Call& c) {
        return c.device == p.device() && c.dtype == p.scalar_type() && c.step == s.step();
      });
      if (call == calls.end())
        call = calls.insert(calls.end(), Call{p.device(), p.scalar_type(), s.step(), {}, {}, {}, {}, {}});
      call->params.push_back(p);
      call->grads.push_back(grad);
      call->exp_avgs.push_back(s.exp_avg());
      call->exp_avg_sqs.push_back(s.exp_avg_sq());
      if (options.amsgrad()) call->max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
    }
    const auto [beta1, beta2] = options.betas();
    for (auto& call : calls) {
      at::Tensor& step = step_tensor(call.device);
      step.fill_(static_cast<double>(call.step));
      const std::vector<at::Tensor> counts(call.params.size(), step);
      if constexpr (decoupled)
        at::_fused_adamw_(call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.max_exp_avg_sqs, counts,
                          options.lr(), beta1, beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                          /*maximize=*/false);
      else
        at::_fused_adam_(call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.max_exp_avg_sqs, counts,
                         options.lr(), beta1, beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                         /*maximize=*/false);
    }
  }
#else
  (void)optimizer, (void)steps, (void)name;  // (the constructor has refused)
#endif
}

// LibTorch's optimizer Base (Adam; AdamW: decoupled) with the fused step.
template <class Base, bool decoupled>
class FusedAdamOf : public Base {
 public:
  using Base::Base;
  torch::Tensor step(typename Base::LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    using Options = std::conditional_t<decoupled, torch::optim::AdamWOptions, torch::optim::AdamOptions>;
    using ParamState = std::conditional_t<decoupled, torch::optim::AdamWParamState, torch::optim::AdamParamState>;
    fused_adam_step<decoupled, Options, ParamState>(*this, steps_, name);
    return loss;
  }

 private:
  static constexpr const char* name = decoupled ? "accel::FusedAdamW" : "accel::FusedAdam";
  FusedAdamSupport support_{name};
  std::vector<at::Tensor> steps_;  // the step count the kernel reads, one tensor per device
};
}  // namespace detail

// torch::optim::Adam with Python's fused step (above), constructed as Adam:
// accel::FusedAdam adam(model->parameters(), torch::optim::AdamOptions(1e-3)).
class FusedAdam : public detail::FusedAdamOf<torch::optim::Adam, false> {
 public:
  using FusedAdamOf::FusedAdamOf;
};
// torch::optim::AdamW (decoupled weight decay) with Python's fused step.
class FusedAdamW : public detail::FusedAdamOf<torch::optim::AdamW, true> {
 public:
  using FusedAdamOf::FusedAdamOf;
};

ACCEL_NAMESPACE_END
