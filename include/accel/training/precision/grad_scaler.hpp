// accel/training/precision/grad_scaler.hpp: GradScaler: dynamic loss scaling for fp16 training, as torch.amp.GradScaler.
//
// fp16 holds numbers down to about 6e-8; small gradients underflow to zero
// in it. Loss scaling multiplies the loss by a large factor before the
// backward (so the gradients are large enough for fp16), divides the
// gradients by it again before the optimizer sees them, skips the step when
// any gradient overflowed to inf or NaN (and halves the factor), and grows
// the factor after a run of good steps. LibTorch's C++ API has the kernels
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_) but no
// GradScaler; this is Python's, with its defaults and its order of calls.
// The Accelerator makes one for mixed_precision "fp16" (Accelerate does the
// same), and it can be used alone.
#pragma once

#include "accel/distributed/collectives.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

// Accelerate's GradScalerKwargs: the loss scaler's settings, with
// torch.amp.GradScaler's defaults (AcceleratorConfig::grad_scaler).
struct GradScalerKwargs {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // the scale is multiplied by this after growth_interval good steps in a row
  double backoff_factor = 0.5;  // ... and by this after a step with an inf or NaN gradient (which is skipped)
  int64_t growth_interval = 2000;
  bool enabled = true;  // false: scale() and unscale_() do nothing, step() always steps
};

class GradScaler {
 public:
  // device: where the scale lives (the gradients' device); group: when
  // given, a step is skipped on every process if any process saw an inf or
  // NaN (needed where processes hold different gradients, as under
  // sharding: FSDP's ShardedGradScaler does the same).
  explicit GradScaler(GradScalerKwargs kwargs = {}, c10::Device device = c10::kCPU, GroupPtr group = {})
      : kwargs_(kwargs), group_(std::move(group)) {
    if (!(kwargs.init_scale > 0) || !(kwargs.growth_factor > 1) || !(kwargs.backoff_factor > 0) ||
        !(kwargs.backoff_factor < 1) || kwargs.growth_interval < 1)
      throw InvalidArgument(
          "accel::GradScaler: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= "
          "1 (torch.amp.GradScaler's rules)");
#if !ACCEL_TORCH_AT_LEAST(2, 4)
    // LibTorch 1.13 has the two _amp_ kernels for CUDA only (2.6 and 2.15
    // have CPU ones too; 2.4 is the oldest this is allowed on, unchecked).
    if (kwargs.enabled && device.is_cpu())
      throw InvalidArgument("accel::GradScaler: on the CPU it needs LibTorch 2.4 or newer; this is " +
                            std::string(TORCH_VERSION));
#endif
    const auto options = at::TensorOptions().device(device);
    scale_ = at::full({1}, kwargs.init_scale, options.dtype(at::kFloat));
    growth_tracker_ = at::zeros({1}, options.dtype(at::kInt));
  }

  bool is_enabled() const { return kwargs_.enabled; }
  // The loss times the current scale (the loss itself when disabled).
  at::Tensor scale(const at::Tensor& loss) const {
    if (!kwargs_.enabled) return loss;
    return loss * scale_.to(loss.device(), /*non_blocking=*/true).reshape({});
  }
  // Divides the gradients of `optimizer`'s parameters by the scale, in
  // place, and notes whether any is inf or NaN. At most once per optimizer
  // between two update() calls (call it before clipping gradients).
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!kwargs_.enabled) return;
    auto& state = states_[&optimizer];
    if (state.unscaled)
      throw LogicError("accel::GradScaler::unscale_: already called on this optimizer since the last update()");
    at::NoGradGuard no_grad;
    const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    state.found_inf = at::zeros({1}, scale_.options().dtype(at::kFloat));
    // The kernel takes gradients of one device and dtype at a time (Python groups them the same way).
    std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (p.grad().is_sparse())
          throw InvalidArgument("accel::GradScaler::unscale_: sparse gradients are not supported");
        if (p.grad().scalar_type() == at::kHalf)
          throw InvalidArgument(
              "accel::GradScaler::unscale_: a gradient is fp16 (Python: \"Attempting to unscale FP16 gradients\"); "
              "keep the parameters in fp32 and let autocast compute in fp16");
        groups[{p.grad().device().str(), static_cast<int>(p.grad().scalar_type())}].push_back(p.grad());
      }
    for (auto& [key, grads] : groups) {
      at::Tensor found = at::zeros({1}, grads.front().options().dtype(at::kFloat));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(grads.front().device()));
      state.found_inf.add_(found.to(state.found_inf.device()));
    }
    if (group_) accel::all_reduce(state.found_inf, ReduceOp::MAX, group_);
    state.unscaled = true;
  }
  // Unscales (unless unscale_ was called) and steps the optimizer unless a
  // gradient was inf or NaN. Returns whether it stepped. Reads one number
  // from the device, as Python's does.
  bool step(torch::optim::Optimizer& optimizer) {
    if (!kwargs_.enabled) {
      optimizer.step();
      return true;
    }
    auto& state = states_[&optimizer];
    if (state.stepped)
      throw LogicError("accel::GradScaler::step: already called on this optimizer since the last update()");
    if (!state.unscaled) unscale_(optimizer);
    state.stepped = true;
    if (state.found_inf.item<float>() != 0) return false;
    optimizer.step();
    return true;
  }
  // After the steps of an iteration: halves (backoff_factor) the scale if
  // any stepped optimizer saw an inf or NaN, else counts a good step and
  // grows the scale after growth_interval of them in a row.
  void update() {
    if (!kwargs_.enabled) return;
    at::Tensor found_inf = at::zeros({1}, scale_.options());
    bool any = false;
    for (auto& [optimizer, state] : states_)
      if (state.unscaled) {
        found_inf.add_(state.found_inf.to(scale_.device()));
        any = true;
      }
    states_.clear();
    if (!any) return;  // nothing was unscaled since the last update: nothing to learn from (Python asserts)
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf, kwargs_.growth_factor, kwargs_.backoff_factor,
                           kwargs_.growth_interval);
  }

  double get_scale() const { return kwargs_.enabled ? scale_.item<double>() : 1.0; }
  // The good steps in a row since the scale last changed.
  int64_t growth_tracker() const { return growth_tracker_.item<int64_t>(); }
  // For checkpoints (Accelerate saves the scaler's state_dict: scale and
  // growth tracker).
  void load_state(double scale, int64_t growth_tracker) {
    scale_.fill_(scale);
    growth_tracker_.fill_(growth_tracker);
    states_.clear();
  }

 private:
  struct OptimizerState {
    bool unscaled = false, stepped = false;
    at::Tensor found_inf;  // > 0: some gradient was inf or NaN
  };
  GradScalerKwargs kwargs_;
  GroupPtr group_;
  at::Tensor scale_, growth_tracker_;
  std::map<const torch::optim::Optimizer*, OptimizerState> states_;
};

ACCEL_NAMESPACE_END
