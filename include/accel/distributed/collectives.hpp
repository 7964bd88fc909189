// accel/distributed/collectives.hpp: all_reduce, broadcast, all_gather and their _async forms.
#pragma once

#include "accel/distributed/debug_check.hpp"
#include "accel/distributed/start_broadcast.hpp"
#include "accel/distributed/start_reduce.hpp"
#include "accel/distributed/work.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Keeps `owner` (a boxed copy of the caller's data that c10d reads in place)
// until the operation lands.
template <class Land, class Owner>
auto keep_until_landed(Pending<Land> pending, Owner owner) {
  return then(std::move(pending), [owner = std::move(owner)](auto&&... result) { return (std::move(result), ...); });
}
template <class T>
auto copy_for_async(const T& data) {
  return std::make_unique<T>(data);
}

// The start of an in-place operation (`start`, on a tensor) on any
// TensorLike: a tensor as it is; a std::vector as a view of its elements
// (memory_view), moved into the Pending (moving a std::vector keeps its elements
// where c10d reads and writes them); a scalar as a std::vector of one.
template <TensorLike T, class Start>
auto start_in_place(T data, Start start) {
  if constexpr (std::same_as<T, at::Tensor>) {
    return start(std::move(data));
  } else if constexpr (Scalar<T>) {
    return then(start_in_place(std::vector<T>{data}, std::move(start)), [](std::vector<T> v) { return v[0]; });
  } else {
    auto pending = start(memory_view(data));
    return then(std::move(pending), [data = std::move(data)](const at::Tensor&) mutable { return std::move(data); });
  }
}
// Reductions of element types no backend reduces (see fold) gather and fold.
template <TensorLike T>
constexpr bool folded() {
  if constexpr (std::same_as<T, at::Tensor>) return false;
  else return !travels_natively<element_t<T>>();
}
template <TensorLike T>
auto start_fold_data(c10d::ProcessGroup& group, T data, ReduceOp op, const char* name) {
  if constexpr (Scalar<T>)
    return then(start_fold(group, std::vector<T>{data}, op, name), [](std::vector<T> v) { return v[0]; });
  else return start_fold(group, std::move(data), op, name);
}

template <TensorLike T>
auto start_all_reduce_data(c10d::ProcessGroup& group, T data, ReduceOp op) {
  if constexpr (folded<T>()) return start_fold_data(group, std::move(data), op, "all_reduce");
  else return start_in_place(std::move(data), [&](at::Tensor t) { return start_all_reduce(group, std::move(t), op); });
}
template <TensorLike T>
auto start_broadcast_data(c10d::ProcessGroup& group, T data, int src) {
  return start_in_place(std::move(data), [&](at::Tensor t) { return start_broadcast(group, std::move(t), src); });
}

// Reads `data` in place until it lands (the async form boxes a copy).
template <TensorLike T>
auto start_all_gather(c10d::ProcessGroup& group, const T& data) {
  if constexpr (std::same_as<T, at::Tensor>) {
    at::Tensor stacked =
        at::empty(stacked_shape(group.getSize(), data), data.options().memory_format(c10::MemoryFormat::Contiguous));
    auto pending = start_all_gather_rows(group, data, stacked);
    return then(std::move(pending), [stacked = std::move(stacked), input = data] { return stacked; });
  } else {
    std::vector<T> result(static_cast<std::size_t>(group.getSize()), data);  // slots of the right size
    std::vector<at::Tensor> outputs;
    for (auto& slot : result) outputs.push_back(memory_view(slot));
    // c10d only reads an allgather's input: a view of the caller's memory.
    auto pending = start_all_gather_into(group, memory_view(const_cast<T&>(data)), std::move(outputs));
    return then(std::move(pending), [result = std::move(result)]() mutable { return std::move(result); });
  }
}

inline auto start_send(c10d::ProcessGroup& group, const at::Tensor& tensor, int peer, int tag) {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor staged;
  if (tensor.numel() != 0) {
    const auto device = staging_device(group, tensor);
    staged = device ? tensor.to(*device).contiguous() : tensor.contiguous();
    std::vector<at::Tensor> tensors{backend_view(group, staged)};
    work = issue("send", group, [&] { return group.send(tensors, peer, tag); });
  }
  return Pending{&group, "send", std::move(work), [staged = std::move(staged)] {}};
}
inline auto start_recv(c10d::ProcessGroup& group, at::Tensor tensor, int peer, int tag) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) {
    s = stage(group, tensor);
    std::vector<at::Tensor> tensors{s.c10d_tensor};
    work = issue("recv", group, [&] { return group.recv(tensors, peer, tag); });
  }
  return Pending{&group, "recv", std::move(work), [tensor = std::move(tensor), staged = std::move(s.staged)]() mutable {
                   land_in_place(tensor, staged, 1);
                   return std::move(tensor);
                 }};
}
// Reads `data` in place until it lands (the async form boxes a copy).
template <TensorLike T>
auto start_send_data(c10d::ProcessGroup& group, const T& data, int peer, int tag) {
  if constexpr (std::same_as<T, at::Tensor>) return start_send(group, data, peer, tag);
  else return start_send(group, memory_view(const_cast<T&>(data)), peer, tag);  // c10d only reads a send's tensor
}
template <TensorLike T>
auto start_recv_data(c10d::ProcessGroup& group, T data, int peer, int tag) {
  return start_in_place(std::move(data), [&](at::Tensor t) { return start_recv(group, std::move(t), peer, tag); });
}

// The checks every form of an operation makes before anything moves,
// ending with debug mode's; they return the group, or null where the
// operation is the identity (the process is not distributed).
template <TensorLike T>
c10d::ProcessGroup* enter_all_reduce(const T& data, ReduceOp op, const GroupPtr& group) {
  check_writable(data, "all_reduce");
  if constexpr (std::same_as<T, at::Tensor>) check_reduction(data.scalar_type(), op, "all_reduce");
  else if (op == ReduceOp::MEAN && std::is_integral_v<element_t<T>>) reject_integral_mean(value_dtype<element_t<T>>());
  c10d::ProcessGroup* g = resolve(group, "all_reduce");
  if (g) check_same_call(*g, [&] { return call_text("all_reduce", {describe_tensorlike(data), to_string(op)}); });
  return g;
}
template <TensorLike T>
c10d::ProcessGroup* enter_broadcast(const T& data, int src, const GroupPtr& group) {
  check_writable(data, "broadcast");
  c10d::ProcessGroup* g = resolve(group, "broadcast");
  check_source(g, src, "broadcast", "src");
  if (g)
    check_same_call(*g,
                    [&] { return call_text("broadcast", {describe_tensorlike(data), "src=" + std::to_string(src)}); });
  return g;
}
template <TensorLike T>
c10d::ProcessGroup* enter_all_gather(const T& data, const GroupPtr& group) {
  c10d::ProcessGroup* g = resolve(group, "all_gather");
  if (g) check_same_call(*g, [&] { return call_text("all_gather", {describe_tensorlike(data)}); });
  return g;
}
// Point-to-point: debug mode cannot compare the two sides (no collective runs).
inline c10d::ProcessGroup* enter_point_to_point(const GroupPtr& group, int peer, const char* op, const char* name) {
  c10d::ProcessGroup* g = resolve(group, op);
  if (!g)
    throw InvalidArgument(std::string("accel::") + op + ": the process is not distributed (there is no other rank)");
  check_peer(g, peer, op, name);
  return g;
}
}  // namespace detail

// Reduces data over the group. A tensor is reduced in place and returned; a
// std::vector travels as one collective. MEAN is SUM divided by the group size
// and is rejected for integral types.
template <TensorLike T>
T all_reduce(T data, ReduceOp op = ReduceOp::MEAN, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_reduce(data, op, group);
  if (!g) return data;
  if constexpr (std::same_as<T, at::Tensor>) {
    detail::all_reduce_tensor(*g, data, op);
  } else if constexpr (!detail::folded<T>()) {
    // A view of the caller's own elements, reduced where they are. It is
    // contiguous, on the CPU and in a dtype every backend reduces, so it never
    // needs the tensor path's staging (a file that calls all_reduce on a
    // number compiles none of it), except the visit to the GPU that NCCL needs.
    at::Tensor view = detail::memory_view(data);
    if (view.numel() == 0) return data;
#if ACCEL_WITH_NCCL
    if (const auto device = detail::staging_device(*g, view)) {
      at::Tensor staged = view.to(*device);
      detail::all_reduce_direct(*g, staged, op);
      view.copy_(staged);
      return data;
    }
#endif
    detail::all_reduce_direct(*g, view, op);
  } else {
    return detail::start_all_reduce_data(*g, std::move(data), op).wait();
  }
  return data;
}
template <TensorLike T>
Work<T> all_reduce_async(T data, ReduceOp op = ReduceOp::MEAN, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_reduce(data, op, group);
  if (!g) return Work<T>(detail::ready(g, "all_reduce", std::move(data)));
  return Work<T>(detail::start_all_reduce_data(*g, std::move(data), op));
}

// Copies data from rank `src` of the group (a rank within the group) to all.
template <TensorLike T>
T broadcast(T data, int src = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_broadcast(data, src, group);
  if (!g) return data;
  return detail::start_broadcast_data(*g, std::move(data), src).wait();
}
template <TensorLike T>
Work<T> broadcast_async(T data, int src = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_broadcast(data, src, group);
  if (!g) return Work<T>(detail::ready(g, "broadcast", std::move(data)));
  return Work<T>(detail::start_broadcast_data(*g, std::move(data), src));
}

// Gathers data from every rank of the group, stacked in rank order:
// a tensor of shape s gives (group_size, *s); a scalar gives std::vector<T>;
// a std::vector<T> gives std::vector<std::vector<T>>. Every rank passes the
// same shape.
template <TensorLike T>
auto all_gather(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_gather(data, group);
  if constexpr (std::same_as<T, at::Tensor>) {
    if (!g) return data.unsqueeze(0).clone();
  } else {
    if (!g) return std::vector<T>{data};
  }
  return detail::start_all_gather(*g, data).wait();
}
template <TensorLike T>
auto all_gather_async(const T& data, const GroupPtr& group = {}) {
  using R = decltype(all_gather(data, group));
  c10d::ProcessGroup* g = detail::enter_all_gather(data, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>)
      return Work<R>(detail::ready(g, "all_gather", data.unsqueeze(0).clone()));
    else return Work<R>(detail::ready(g, "all_gather", std::vector<T>{data}));
  }
  if constexpr (std::same_as<T, at::Tensor>) {
    return Work<R>(detail::start_all_gather(*g, data));
  } else {
    auto box = detail::copy_for_async(data);
    auto pending = detail::start_all_gather(*g, *box);
    return Work<R>(detail::keep_until_landed(std::move(pending), std::move(box)));
  }
}
// all_gather into a tensor the caller owns, of shape (group_size, *input's
// shape) with input's dtype and device: no allocation per call, for large
// tensors gathered again and again. Returns output.
inline at::Tensor& all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_gather_into_tensor");
  const auto expected = detail::stacked_shape(g ? g->getSize() : 1, input);
  if (output.sizes() != c10::IntArrayRef(expected) || output.scalar_type() != input.scalar_type() ||
      output.device() != input.device()) {
    std::ostringstream message;
    message << "accel::all_gather_into_tensor: output must have shape " << c10::IntArrayRef(expected) << ", dtype "
            << input.scalar_type() << " and device " << input.device() << "; got " << output.sizes() << ", "
            << output.scalar_type() << ", " << output.device();
    throw InvalidArgument(message.str());
  }
  if (!g) {
    at::NoGradGuard no_grad;
    output.select(0, 0).copy_(input);
  } else {
    detail::check_same_call(*g, [&] { return "all_gather_into_tensor(" + detail::describe_tensor(input) + ")"; });
    detail::start_all_gather_rows(*g, input, output, "all_gather_into_tensor").wait();
  }
  return output;
}

ACCEL_NAMESPACE_END
