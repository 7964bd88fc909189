// accel/distributed/start_gather.hpp: the all-gather family started: into given outputs, into rows, of CPU elements.
#pragma once

#include "accel/distributed/pending.hpp"
#include "accel/distributed/staging.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Gathers `input` from every rank into `outputs[r]` (same shape, any
// memory); outputs c10d cannot write into directly are staged and copied
// back when it lands.
inline auto start_all_gather_into(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<at::Tensor> outputs,
                                  const char* op = "all_gather") {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> staged;  // empty: c10d writes into outputs
  if (input.numel() != 0) {
    const auto device = staging_device(group, input);
    std::vector<at::Tensor> inputs{backend_view(group, device ? input.to(*device).contiguous() : input.contiguous())};
    const bool direct =
        !device && std::all_of(outputs.begin(), outputs.end(), [](const at::Tensor& t) { return t.is_contiguous(); });
    if (!direct)
      for (const auto& t : outputs)
        staged.push_back(at::empty(t.sizes(), t.options().device(device.value_or(t.device()))));
    std::vector<std::vector<at::Tensor>> output_lists(1);
    for (const auto& t : direct ? outputs : staged) output_lists[0].push_back(backend_view(group, t));
    work = issue(op, group, [&] { return group.allgather(output_lists, inputs); });
  }
  return Pending{&group, op, std::move(work), [outputs = std::move(outputs), staged = std::move(staged)] {
                   at::NoGradGuard no_grad;
                   for (std::size_t r = 0; r < staged.size(); ++r) outputs[r].copy_(staged[r]);
                 }};
}
inline void all_gather_into(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<at::Tensor> outputs,
                            const char* op = "all_gather") {
  start_all_gather_into(group, input, std::move(outputs), op).wait();
}

// Every rank's `count` elements at `mine` (CPU memory), rank-major into
// `all`, which holds group size * count elements.
template <class T>
auto start_all_gather_cpu(c10d::ProcessGroup& group, const T* mine, int64_t count, T* all, const char* op) {
  constexpr c10::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < group.getSize(); ++r)
    outputs.push_back(at::from_blob(all + r * count, {count}, cpu_options(dtype)));
  // c10d only reads an allgather's input.
  return start_all_gather_into(group, at::from_blob(const_cast<T*>(mine), {count}, cpu_options(dtype)),
                               std::move(outputs), op);
}
template <class T>
void all_gather_cpu(c10d::ProcessGroup& group, const T* mine, int64_t count, T* all, const char* op) {
  start_all_gather_cpu(group, mine, count, all, op).wait();
}

inline std::vector<int64_t> stacked_shape(int size, const at::Tensor& input) {
  std::vector<int64_t> shape{size};
  shape.insert(shape.end(), input.sizes().begin(), input.sizes().end());
  return shape;
}

// Gathers into the rows of `stacked`, of shape (group size, *input's shape).
inline auto start_all_gather_rows(c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& stacked,
                                  const char* op = "all_gather") {
  std::vector<at::Tensor> rows;
  rows.reserve(group.getSize());
  for (int r = 0; r < group.getSize(); ++r) rows.push_back(stacked.select(0, r));
  return start_all_gather_into(group, input, std::move(rows), op);
}
}  // namespace detail

ACCEL_NAMESPACE_END
