// accel/training/dp/comm_hooks.hpp: communication hooks: GradBucket, CommHook, PowerSGD.
#pragma once

#include "accel/training/parallel/autograd.hpp"

ACCEL_NAMESPACE_BEGIN

// Communication hooks (DDP's register_comm_hook, Accelerate's comm_hook): a
// hook replaces the all-reduce of each gradient bucket of a DataParallel.
// It gets the bucket flattened (torch's GradBucket: this process's
// gradients in the bucket's order, then one used-flag per parameter; not yet
// divided) and returns the operation whose result is the bucket averaged
// over the group, in any floating dtype: the result is cast back to the
// bucket's, so a compressing hook need not decompress.
struct GradBucket {
  at::Tensor buffer{};
  std::size_t index = 0;
  bool is_last = false;  // the last bucket of this backward
  std::vector<at::Tensor> parameters{};
  std::vector<at::Tensor> gradients{};  // views of buffer, shaped as the parameters (the flags follow them)
};
using CommHook = std::function<Work<at::Tensor>(const GroupPtr& group, GradBucket& bucket)>;

// torch.distributed.algorithms.ddp_comm_hooks.default_hooks'.
namespace comm_hooks {
// The default: divided first (as DDP), then all-reduced in place.
inline CommHook allreduce_hook() {
  return [](const GroupPtr& group, GradBucket& bucket) {
    bucket.buffer.div_(group->getSize());
    return all_reduce_async(bucket.buffer, ReduceOp::SUM, group);
  };
}
// Cast to float16 (bfloat16), divided, all-reduced: half the bytes on the
// wire. Gloo reduces float16 natively; bfloat16 it does not know, so
// accel.hpp reduces it in float32 there (the rounding stays bfloat16's, the
// bytes do not halve: use it with NCCL).
inline CommHook fp16_compress_hook() {
  return [](const GroupPtr& group, GradBucket& bucket) {
    return all_reduce_async(bucket.buffer.to(at::kHalf).div_(group->getSize()), ReduceOp::SUM, group);
  };
}
inline CommHook bf16_compress_hook() {
  return [](const GroupPtr& group, GradBucket& bucket) {
    return all_reduce_async(bucket.buffer.to(at::kBFloat16).div_(group->getSize()), ReduceOp::SUM, group);
  };
}
}  // namespace comm_hooks

// torch's PowerSGDState: the options of powerSGD_hook, and its memory.
struct PowerSGDState {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;  // plain all-reduces until this many steps
  int64_t min_compression_rate = 2;    // compress a matrix only when it shrinks more than this
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0;
  uint64_t random_seed = 0;
  // The hook's memory (per bucket), and the steps taken.
  int64_t iter = 0;
  std::map<std::size_t, at::Tensor> error_dict{}, p_memory_dict{}, q_memory_dict{};
  std::optional<std::mt19937_64> rng{};  // seeds of Q's random starts, from random_seed
};

namespace detail {
// PowerSGD's Gram-Schmidt over the columns (torch 1.13's _orthogonalize).
inline void orthogonalize(const at::Tensor& matrix, double epsilon) {
  const int64_t columns = matrix.size(1);
  for (int64_t i = 0; i < columns; ++i) {
    const at::Tensor column = matrix.narrow(1, i, 1);
    column.div_(epsilon == 0 ? column.norm() : column.norm() + epsilon);
    if (i + 1 < columns) {
      const at::Tensor rest = matrix.narrow(1, i + 1, columns - i - 1);
      rest.sub_((column * rest).sum(0) * column);
    }
  }
}

// Which of a bucket's gradients PowerSGD compresses: the matrices (each
// gradient viewed as n x m) whose rank-r factors, r = min(n, m,
// matrix_approximation_rank), are smaller than the matrix by
// min_compression_rate; the rest, and the used-flags after the gradients'
// `length` elements, travel uncompressed.
struct PowerSGDSplit {
  std::vector<at::Tensor> matrices, plain;
};
inline PowerSGDSplit split_for_powerSGD(const GradBucket& bucket, const at::Tensor& input, int64_t length,
                                        const PowerSGDState& state) {
  PowerSGDSplit split;
  for (const auto& g : bucket.gradients) {
    if (g.dim() >= 2) {
      const at::Tensor m = g.view({g.size(0), -1});
      const int64_t n = m.size(0), k = m.size(1), r = std::min({n, k, state.matrix_approximation_rank});
      if ((n + k) * r * state.min_compression_rate < n * k) {
        split.matrices.push_back(m);
        continue;
      }
    }
    split.plain.push_back(g);
  }
  split.plain.push_back(input.narrow(0, length, input.numel() - length));
  return split;
}
// The factors P (n x r) and Q (m x r) of each matrix: views into bucket b's
// P and Q memory (one tensor each, so that each is all-reduced at once). Q is
// drawn at random where there is no memory to start from (the first step, or
// always without warm_start), then orthogonalised.
inline std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> powerSGD_factors(
    PowerSGDState& state, std::size_t b, const std::vector<at::Tensor>& matrices, const at::TensorOptions& options) {
  auto rank_of = [&](const at::Tensor& m) { return std::min({m.size(0), m.size(1), state.matrix_approximation_rank}); };
  const bool randomize = !state.warm_start || !state.p_memory_dict.count(b);
  if (randomize) {
    int64_t ps = 0, qs = 0;
    for (const auto& m : matrices) {
      ps += m.size(0) * rank_of(m);
      qs += m.size(1) * rank_of(m);
    }
    state.p_memory_dict[b] = at::empty({ps}, options);
    state.q_memory_dict[b] = at::empty({qs}, options);
  }
  std::vector<at::Tensor> p, q;
  for (int64_t i = 0, pi = 0, qi = 0; i < static_cast<int64_t>(matrices.size()); ++i) {
    const at::Tensor& m = matrices[static_cast<std::size_t>(i)];
    const int64_t n = m.size(0), k = m.size(1), r = rank_of(m);
    p.push_back(state.p_memory_dict[b].narrow(0, pi, n * r).view({n, r}));
    q.push_back(state.q_memory_dict[b].narrow(0, qi, k * r).view({k, r}));
    pi += n * r;
    qi += k * r;
  }
  if (randomize) {
    at::Generator generator = at::detail::createCPUGenerator((*state.rng)() % 1'000'000'000);
    for (auto& qm : q) qm.copy_(at::randn(qm.sizes(), generator, at::TensorOptions(at::kFloat)));
  }
  for (auto& qm : q) orthogonalize(qm, state.orthogonalization_epsilon);
  return {std::move(p), std::move(q)};
}
// With error feedback: adds to bucket b's gradients what compression lost
// at this process's last step, and returns them as they then are (what the
// compressed result will be subtracted from); else an undefined tensor.
inline at::Tensor add_error_feedback(PowerSGDState& state, std::size_t b, const at::Tensor& body) {
  if (!state.use_error_feedback) return {};
  at::Tensor& error = state.error_dict[b];
  if (error.defined()) body.add_(error);
  else error = at::zeros_like(body);
  return body.clone();
}
}  // namespace detail

namespace comm_hooks {
// torch's powerSGD_hook (Vogels et al., 2019): each gradient matrix M (n x m,
// a parameter viewed as rows x the rest) of rank-r compression worth it,
// (n + m) r * min_compression_rate < n m, travels as two thin matrices:
// P = M Q all-reduced and orthogonalised, Q = M^T P all-reduced, and M
// becomes P Q^T / world size; vectors and small matrices are all-reduced as
// they are, in one buffer. With error feedback each process adds what
// compression lost at its last step; with warm start Q is kept from step to
// step (the first Q is random, the same on every process: std::mt19937_64
// seeded with random_seed draws a seed per start, where torch draws it from
// NumPy). The first start_powerSGD_iter steps all-reduce plainly. The
// uncompressed all-reduce is issued at once; P's and Q's run when the
// bucket is waited for (at the end of backward).
inline CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  if (!state) throw InvalidArgument("accel::comm_hooks::powerSGD_hook: no state");
  if (state->matrix_approximation_rank < 1 || state->min_compression_rate < 1 || state->start_powerSGD_iter < 0)
    throw InvalidArgument(
        "accel::comm_hooks::powerSGD_hook: matrix_approximation_rank and min_compression_rate "
        "must be at least 1, start_powerSGD_iter at least 0");
  if (!state->rng) state->rng.emplace(state->random_seed);
  return [state](const GroupPtr& group, GradBucket& bucket) -> Work<at::Tensor> {
    const bool last = bucket.is_last;
    if (state->iter < state->start_powerSGD_iter) {
      if (last) ++state->iter;
      return allreduce_hook()(group, bucket);
    }
    const std::size_t b = bucket.index;
    const int64_t world = group->getSize();
    at::Tensor input = bucket.buffer;
    int64_t length = 0;  // of the gradients (the used-flags follow: never compressed, no error feedback)
    for (const auto& g : bucket.gradients) length += g.numel();
    const at::Tensor body = input.narrow(0, 0, length);
    const at::Tensor before = detail::add_error_feedback(*state, b, body);
    detail::PowerSGDSplit split = detail::split_for_powerSGD(bucket, input, length, *state);
    std::vector<at::Tensor> matrices = std::move(split.matrices), plain = std::move(split.plain);
    std::vector<at::Tensor> flat;
    for (const auto& t : plain) flat.push_back(t.reshape({-1}));
    const at::Tensor uncompressed = at::cat(flat);
    auto factors = detail::powerSGD_factors(*state, b, matrices, input.options());
    std::vector<at::Tensor> p = std::move(factors.first), q = std::move(factors.second);
    for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(p[i], matrices[i], q[i]);
    c10d::ProcessGroup* g = detail::enter_all_reduce(uncompressed, ReduceOp::SUM, group);
    return Work<at::Tensor>(detail::then(
        detail::start_all_reduce_data(*g, uncompressed, ReduceOp::SUM),
        [state, group, b, world, last, input, body, before, matrices, plain, p, q](at::Tensor reduced) mutable {
          reduced.div_(world);
          int64_t at = 0;
          for (const auto& t : plain) {
            t.copy_(reduced.narrow(0, at, t.numel()).view(t.sizes()));
            at += t.numel();
          }
          if (!matrices.empty()) {
            accel::all_reduce(state->p_memory_dict[b], ReduceOp::SUM, group);  // no division: P is orthogonalised
            for (const auto& pm : p) detail::orthogonalize(pm, state->orthogonalization_epsilon);
            for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(q[i], matrices[i].t(), p[i]);
            accel::all_reduce(state->q_memory_dict[b], ReduceOp::SUM, group);  // in place
            state->q_memory_dict[b].div_(world);
            for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(matrices[i], p[i], q[i].t());
          }
          if (state->use_error_feedback) state->error_dict[b] = before - body;
          if (!state->warm_start) {
            state->p_memory_dict.clear();
            state->q_memory_dict.clear();
          }
          if (last) ++state->iter;
          return input;
        }));
  };
}
}  // namespace comm_hooks

ACCEL_NAMESPACE_END
