// accel/training/accelerator/process_operations.hpp: Accelerate's operations as Accelerator methods, over every process.
//
// Accelerate's Accelerator offers its operations as methods too
// (accelerator.gather(x), accelerator.print(...)); the Accelerator takes
// them from this part. Each calls the free function of the same name over
// the world (accel/distributed/operations.hpp, process_control.hpp); the
// trigger is the only state. gather_for_metrics, which needs the prepared
// loaders, is the Accelerator's own.
#pragma once

#include "accel/distributed/operations.hpp"
#include "accel/distributed/process_control.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The Accelerator's second base: Accelerate's operations over every
// process, as methods (accelerator.gather(x), accelerator.print(...)).
class ProcessOperations {
 public:
  template <TensorTree T>
  T gather(const T& data) const {
    return accel::gather(data);
  }
  template <TensorTree T>
  T reduce(const T& data, ReduceOp reduction = ReduceOp::SUM) const {  // Accelerate's default: sum
    return accel::reduce(data, reduction);
  }
  template <TensorTree T>
  T reduce(const T& data, std::string_view reduction) const {  // "sum", "mean", "max", "min", as accel::reduce
    return accel::reduce(data, reduction);
  }
  template <TensorTree T>
  T pad_across_processes(const T& data, int64_t dim = 0, const at::Scalar& pad_index = 0,
                         bool pad_first = false) const {
    return accel::pad_across_processes(data, dim, pad_index, pad_first);
  }
  template <class T>
  T split_between_processes(const T& inputs, bool apply_padding = false) const {
    return accel::split_between_processes(inputs, apply_padding);
  }
  template <class... Args>
  void print(const Args&... args) const {
    accel::print(args...);
  }
  void wait_for_everyone() const {
    detail::every_process_calls("accel::Accelerator::wait_for_everyone", [] { accel::wait_for_everyone(); });
  }
  template <class Body>
  std::invoke_result_t<Body&> main_process_first(Body&& body) const {
    return accel::main_process_first(std::forward<Body>(body), /*local_only=*/false);
  }
  template <class Body>
  std::invoke_result_t<Body&> local_main_process_first(Body&& body) const {
    return accel::main_process_first(std::forward<Body>(body), /*local_only=*/true);
  }
  template <class Fn>
  auto on_main_process(Fn fn) const {
    return accel::on_main_process(std::move(fn));
  }
  template <class Fn>
  auto on_local_main_process(Fn fn) const {
    return accel::on_local_main_process(std::move(fn));
  }
  template <class Fn>
  auto on_last_process(Fn fn) const {
    return accel::on_last_process(std::move(fn));
  }
  template <class Fn>
  auto on_process(Fn fn, int process_index) const {
    return accel::on_process(std::move(fn), process_index);
  }

  // Any process can ask every process to stop at the same step: set_trigger()
  // on one, then check_trigger() on all (one all_reduce) is true on all, and
  // resets the trigger.
  void set_trigger() { trigger_ = 1; }
  bool check_trigger() {
    if (accel::all_reduce(trigger_, ReduceOp::SUM) == 0) return false;
    trigger_ = 0;
    return true;
  }

 private:
  int64_t trigger_ = 0;
};
}  // namespace detail

ACCEL_NAMESPACE_END
