// accel/training/recompute.hpp: accel::checkpoint, activation checkpointing as torch.utils.checkpoint.
//
// accel::checkpoint(fn, args...) returns fn(args...) without keeping the
// activations inside fn: the forward runs under no_grad, only the inputs
// are saved, and the backward runs fn again (with the random-number state
// and the autocast state the forward had, so dropout draws the same mask
// and the same kernels run in the same precision), then back-propagates
// through that recomputation. Memory for a stack of blocks falls from every
// block's activations to the blocks' inputs plus one block's activations,
// for a second forward of each block in the backward.
//
// This is torch.utils.checkpoint's reentrant form (use_reentrant=True): a
// custom autograd Function whose backward runs a backward of its own. The
// non-reentrant form rests on saved-tensor hooks, which LibTorch's C++ API
// does not offer. One difference on purpose: torch's reentrant form gives
// the parameters inside fn no gradient when no input requires one (it
// warns); here an empty leaf that requires grad joins the inputs in that
// case, so the parameters get theirs, as with use_reentrant=False.
//
// It composes with unit_forward: under FULL_SHARD
//     x = accel::checkpoint([block](const at::Tensor& h) { return accel::unit_forward(block, h); }, x);
// gathers the block's parameters for the forward and frees them at once;
// the recomputation in the backward gathers them again and keeps them
// through the block's backward (detail::dp::recomputing()).
#pragma once

#include "accel/training/precision/autocast.hpp"
#include "accel/training/dp/units.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What the forward saw and the recomputation needs back: fn with its
// non-tensor arguments bound, the random-number states of the CPU and of
// each CUDA device the inputs are on, and the autocast state.
struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const std::vector<at::Tensor>&)> fn;
  std::vector<std::pair<at::Generator, at::Tensor>> rng;      // each generator and its state before the forward
  std::array<std::pair<bool, at::ScalarType>, 2> autocast{};  // CPU's and CUDA's (enabled, dtype)

  void capture(const std::vector<at::Tensor>& inputs) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto& x : inputs)
      if (x.defined() && x.is_cuda() && std::find(devices.begin(), devices.end(), x.device()) == devices.end())
        devices.push_back(x.device());
    for (const auto& device : devices) {
      at::Generator generator = at::globalContext().defaultGenerator(device);
      std::lock_guard lock(generator.mutex());
      rng.emplace_back(generator, generator.get_state());
    }
    for (std::size_t i = 0; i < 2; ++i) autocast[i] = {autocast_enabled(types[i]), autocast_dtype(types[i])};
  }
  static constexpr std::array<c10::DeviceType, 2> types{c10::DeviceType::CPU, c10::DeviceType::CUDA};
};

// The random-number states of a forward put in place for its
// recomputation, and the states of now put back after it (torch's
// fork_rng), so that the recomputation draws what the forward drew and the
// rest of the program draws on as if it had not run.
class ReplayRandomness {
 public:
  explicit ReplayRandomness(const Recompute& run) {
    for (const auto& [generator, state] : run.rng) {
      at::Generator g = generator;
      std::lock_guard lock(g.mutex());
      now_.emplace_back(g, g.get_state());
      g.set_state(state);
    }
  }
  ReplayRandomness(const ReplayRandomness&) = delete;
  ReplayRandomness& operator=(const ReplayRandomness&) = delete;
  ~ReplayRandomness() {
    for (auto& [generator, state] : now_) {
      std::lock_guard lock(generator.mutex());
      generator.set_state(state);
    }
  }

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> now_;
};

// How many checkpointed regions this thread's forwards have made. A
// pipeline stage compares it around a micro-batch's forward: a region's
// backward runs a backward of its own, which gives the weights inside it
// their gradients at once, so a stage holding one cannot split its
// backward into the input's gradient and the weights' (training/pp/stage.hpp).
inline uint64_t& checkpointed_regions() {
  static thread_local uint64_t count = 0;
  return count;
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // (Function::apply runs this under no_grad: nothing inside fn is kept.)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<Recompute>& run,
                            at::TensorList inputs) {
    ++checkpointed_regions();
    run->capture(inputs.vec());
    at::Tensor out = run->fn(inputs.vec());
    ctx->save_for_backward(inputs.vec());  // (version-checked: an input changed in place since is an error)
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::intrusive_ptr<torch::CustomClassHolder> holder = ctx->saved_data["run"].toCapsule();
    const auto run = c10::intrusive_ptr<Recompute>::reclaim(static_cast<Recompute*>(holder.release()));
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables())
      inputs.push_back(saved.defined() ? saved.detach().requires_grad_(saved.requires_grad()) : saved);
    at::Tensor out;
    {
      const ReplayRandomness replay(*run);
      const AutocastScope cpu(c10::DeviceType::CPU, run->autocast[0].first, run->autocast[0].second);
      const AutocastScope cuda(c10::DeviceType::CUDA, run->autocast[1].first, run->autocast[1].second);
      const at::AutoGradMode grad(true);
      dp::recomputing() = true;
      struct Done {
        ~Done() { dp::recomputing() = false; }
      } done;
      out = run->fn(inputs);
    }
    // (Nothing in fn requires grad, or the output was not used: no gradients.)
    if (out.requires_grad() && grads[0].defined()) torch::autograd::backward({out}, {grads[0]});
    torch::autograd::variable_list result{at::Tensor()};  // (none for the Recompute)
    for (const auto& x : inputs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    return result;
  }
};

// Which of Args are tensors, and the index among the tensors of each.
template <class... Args>
inline constexpr std::array<bool, sizeof...(Args)> is_tensor_arg{
    std::is_same_v<std::remove_cvref_t<Args>, at::Tensor>...};
template <class... Args>
inline constexpr std::size_t tensor_index(std::size_t position) {
  std::size_t k = 0;
  for (std::size_t i = 0; i < position; ++i) k += is_tensor_arg<Args...>[i] ? 1 : 0;
  return k;
}
}  // namespace detail

// fn(args...) with its activations recomputed in the backward instead of
// kept (see above). fn returns one at::Tensor; the at::Tensor arguments are
// its differentiable inputs, any other argument is copied and passed again
// as it was. fn runs again in the backward, after the caller's forward has
// returned: what it captures must live that long (capture locals by value).
// Under no_grad (evaluation) it is fn(args...).
template <class Fn, class... Args>
at::Tensor checkpoint(Fn&& fn, Args&&... args) {
  static_assert(std::is_same_v<std::invoke_result_t<Fn&, Args&...>, at::Tensor>,
                "accel::checkpoint: fn returns one at::Tensor");
  if (!at::GradMode::is_enabled()) return std::invoke(fn, args...);
  std::vector<at::Tensor> inputs;
  bool any_requires_grad = false;
  auto collect = [&]<class A>(const A& a) {
    if constexpr (std::is_same_v<A, at::Tensor>) {
      inputs.push_back(a);
      any_requires_grad = any_requires_grad || (a.defined() && a.requires_grad());
    }
  };
  (collect(args), ...);
  // The inputs travel through `inputs` (saved, version-checked); the other
  // arguments are kept here. A tensor's place holds an empty tensor, so
  // that the Recompute does not keep a second reference to it.
  auto kept = std::make_tuple([]<class A>(A&& a) {
    if constexpr (std::is_same_v<std::remove_cvref_t<A>, at::Tensor>) return at::Tensor();
    else return std::decay_t<A>(std::forward<A>(a));
  }(args)...);
  auto run = c10::make_intrusive<detail::Recompute>();
  run->fn = [fn = std::decay_t<Fn>(std::forward<Fn>(fn)),
             kept = std::move(kept)](const std::vector<at::Tensor>& in) mutable {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      auto pick = [&]<std::size_t Position>(std::integral_constant<std::size_t, Position>) -> decltype(auto) {
        if constexpr (detail::is_tensor_arg<Args...>[Position])
          return static_cast<const at::Tensor&>(in[detail::tensor_index<Args...>(Position)]);
        else return std::get<Position>(kept);
      };
      return std::invoke(fn, pick(std::integral_constant<std::size_t, I>{})...);
    }(std::index_sequence_for<Args...>{});
  };
  // torch's reentrant form would leave the parameters inside fn without
  // gradients here; an empty leaf that requires grad makes the output
  // require grad, so the backward (and the recomputation) runs.
  if (!any_requires_grad) inputs.push_back(at::empty({0}).requires_grad_());
  return detail::CheckpointFunction::apply(run, at::TensorList(inputs));
}

ACCEL_NAMESPACE_END
