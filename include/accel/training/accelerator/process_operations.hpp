// accel/training/accelerator/process_operations.hpp: the Accelerator's work over every process: Accelerate's operations as methods, metrics, the trigger, the experiment log.
//
// Each operation calls the free function of the same name over the world
// (accel/distributed/operations.hpp, process_control.hpp);
// gather_for_metrics also reads the prepared loaders' passes, and the log
// methods hand over to the ExperimentLog (accelerator/trackers.hpp).
#pragma once

#include "accel/distributed/operations.hpp"
#include "accel/distributed/process_control.hpp"
#include "accel/training/accelerator/accelerator.hpp"

ACCEL_NAMESPACE_BEGIN

template <TensorTree T>
T Accelerator::gather(const T& data) const {
  return accel::gather(data);
}
template <TensorTree T>
T Accelerator::reduce(const T& data, ReduceOp reduction) const {
  return accel::reduce(data, reduction);
}
template <TensorTree T>
T Accelerator::reduce(const T& data, std::string_view reduction) const {
  return accel::reduce(data, reduction);
}
template <TensorTree T>
T Accelerator::pad_across_processes(const T& data, int64_t dim, const at::Scalar& pad_index, bool pad_first) const {
  return accel::pad_across_processes(data, dim, pad_index, pad_first);
}
template <class T>
T Accelerator::split_between_processes(const T& inputs, bool apply_padding) const {
  return accel::split_between_processes(inputs, apply_padding);
}
template <class... Args>
void Accelerator::print(const Args&... args) const {
  accel::print(args...);
}
inline void Accelerator::wait_for_everyone() const {
  detail::every_process_calls("accel::Accelerator::wait_for_everyone", [] { accel::wait_for_everyone(); });
}
template <class Body>
std::invoke_result_t<Body&> Accelerator::main_process_first(Body&& body) const {
  return accel::main_process_first(std::forward<Body>(body), /*local_only=*/false);
}
template <class Body>
std::invoke_result_t<Body&> Accelerator::local_main_process_first(Body&& body) const {
  return accel::main_process_first(std::forward<Body>(body), /*local_only=*/true);
}
template <class Fn>
auto Accelerator::on_main_process(Fn fn) const {
  return accel::on_main_process(std::move(fn));
}
template <class Fn>
auto Accelerator::on_local_main_process(Fn fn) const {
  return accel::on_local_main_process(std::move(fn));
}
template <class Fn>
auto Accelerator::on_last_process(Fn fn) const {
  return accel::on_last_process(std::move(fn));
}
template <class Fn>
auto Accelerator::on_process(Fn fn, int process_index) const {
  return accel::on_process(std::move(fn), process_index);
}

inline void Accelerator::set_trigger() { trigger_ = 1; }
inline bool Accelerator::check_trigger() {
  if (accel::all_reduce(trigger_, ReduceOp::SUM) == 0) return false;
  trigger_ = 0;
  return true;
}

template <TensorTree T>
T Accelerator::gather_for_metrics(const T& data, std::optional<int64_t> num_samples) {
  return detail::every_process_calls("accel::Accelerator::gather_for_metrics", [&]() -> T {
    const GroupPtr group = setup_.world().get_group(Dim::DP);
    auto first_rows = [](int64_t rows) {
      return [rows](const at::Tensor& t) { return t.dim() ? t.narrow(0, 0, std::min(rows, t.size(0))) : t; };
    };
    if (num_samples) return recursively_apply(first_rows(*num_samples), accel::gather(data, group));
    const detail::LoaderState* loader = state_->loader();
    if (loader && loader->real_rows)
      return accel::gather(recursively_apply(first_rows(static_cast<int64_t>(*loader->real_rows)), data), group);
    return accel::gather(data, group);
  });
}

inline void Accelerator::init_trackers(const std::string& project_name,
                                       const std::map<std::string, std::string>& config) {
  log_.init_trackers(project_name, config);
}
inline void Accelerator::log(const std::map<std::string, double>& values, std::optional<int64_t> step) {
  log_.log(values, step);
}
inline void Accelerator::end_training() { log_.end_training(); }
inline std::filesystem::path Accelerator::logging_dir() const { return log_.logging_dir(); }

ACCEL_NAMESPACE_END
