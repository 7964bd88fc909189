// accel/distributed/start_reduce.hpp: the all-reduce family started: in place, onto one rank, and folded locally for types no backend reduces.
#pragma once

#include "accel/distributed/pending.hpp"
#include "accel/distributed/staging.hpp"
#include "accel/distributed/start_gather.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Collectives are not differentiable: our own in-place copies and the MEAN
// division must not trip autograd's checks (in Python, c10d ops bypass
// autograd too), so they run under NoGradGuard. A tensor with no elements
// moves nothing (Gloo divides by the element count).
//
// The blocking all_reduce of a tensor c10d can reduce where it is (direct)
// is the hot path (callgrind_overhead guards it): it runs without a Pending,
// whose moves, captures and destructors cost 200 instructions per call
// (+2.5%); every other case takes start_all_reduce.
inline void all_reduce_direct(c10d::ProcessGroup& group, at::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors(1, tensor);
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  run("all_reduce", group, [&] { return group.allreduce(tensors, opts); });
  if (op == ReduceOp::MEAN) {
    at::NoGradGuard no_grad;
    tensor.div_(group.getSize());
  }
}
// The c10d call of an all_reduce of what stage() made.
inline c10::intrusive_ptr<c10d::Work> issue_all_reduce(c10d::ProcessGroup& group, const InPlace& s) {
  std::vector<at::Tensor> tensors{s.c10d_tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(s.op);
  return issue("all_reduce", group, [&] { return group.allreduce(tensors, opts); });
}
inline auto start_all_reduce(c10d::ProcessGroup& group, at::Tensor tensor, ReduceOp op) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) [[likely]] {
    s = stage(group, tensor, op);
    work = issue_all_reduce(group, s);
  }
  const int64_t divisor = op == ReduceOp::MEAN ? group.getSize() : 1;
  return Pending{&group, "all_reduce", std::move(work),
                 [tensor = std::move(tensor), staged = std::move(s.staged), divisor]() mutable {
                   if (divisor > 1 || staged.defined()) [[unlikely]]
                     land_in_place(tensor, staged, divisor);
                   return std::move(tensor);
                 }};
}
// Onto rank `dst` of the group: only there is the result defined (and
// divided for MEAN).
inline auto start_reduce(c10d::ProcessGroup& group, at::Tensor tensor, ReduceOp op, int dst) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) {
    s = stage(group, tensor, op);
    std::vector<at::Tensor> tensors{s.c10d_tensor};
    c10d::ReduceOptions opts;
    opts.reduceOp = to_c10d(s.op);
    opts.rootRank = dst;
    work = issue("reduce_to", group, [&] { return group.reduce(tensors, opts); });
  }
  const int64_t divisor = op == ReduceOp::MEAN && dst == group.getRank() ? group.getSize() : 1;
  return Pending{&group, "reduce_to", std::move(work),
                 [tensor = std::move(tensor), staged = std::move(s.staged), divisor]() mutable {
                   land_in_place(tensor, staged, divisor);
                   return std::move(tensor);
                 }};
}
// The blocking all_reduce of a tensor. A tensor that must be staged first
// takes the steps of start_all_reduce without its Pending: a file that calls
// all_reduce compiles this path whether it runs or not, and the Pending's
// captures and moves cost a sixth of what the compiler spends on a raw c10d
// allreduce call (counted in its instructions).
inline void all_reduce_tensor(c10d::ProcessGroup& group, at::Tensor& tensor, ReduceOp op) {
  if (tensor.numel() == 0) return;
  if (direct(group, tensor)) [[likely]]
    return all_reduce_direct(group, tensor, op);
  const InPlace s = stage(group, tensor, op);
  await("all_reduce", group, *issue_all_reduce(group, s));
  land_in_place(tensor, s.staged, op == ReduceOp::MEAN ? group.getSize() : 1);
}

// Types no backend reduces natively travel as bytes; all_reduce then gathers
// every rank's bytes and folds them locally in T, which stays exact.
template <Scalar T>
T fold(ReduceOp op, const T* values, int count, int stride) {
  T acc = values[0];
  for (int r = 1; r < count; ++r) {
    T x = values[static_cast<std::size_t>(r) * stride];
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::MEAN: acc = static_cast<T>(acc + x); break;
      case ReduceOp::MAX: acc = std::max(acc, x); break;
      case ReduceOp::MIN: acc = std::min(acc, x); break;
    }
  }
  if (op == ReduceOp::MEAN) acc = static_cast<T>(acc / count);
  return acc;
}

template <Scalar T>
auto start_fold(c10d::ProcessGroup& group, std::vector<T> data, ReduceOp op, const char* name) {
  const int size = group.getSize();
  std::vector<T> gathered(data.size() * static_cast<std::size_t>(size));
  auto pending = start_all_gather_cpu(group, reinterpret_cast<const uint8_t*>(data.data()),
                                      static_cast<int64_t>(data.size() * sizeof(T)),
                                      reinterpret_cast<uint8_t*>(gathered.data()), name);
  // (Moving a std::vector keeps its elements where c10d reads and writes them.)
  return then(std::move(pending), [data = std::move(data), gathered = std::move(gathered), op, size]() mutable {
    for (std::size_t i = 0; i < data.size(); ++i)
      data[i] = fold<T>(op, gathered.data() + i, size, static_cast<int>(data.size()));
    return std::move(data);
  });
}
}  // namespace detail

ACCEL_NAMESPACE_END
