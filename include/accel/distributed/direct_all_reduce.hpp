// accel/distributed/direct_all_reduce.hpp: a Gloo group's all-reduce point to point, for small tensors: a reduce-scatter then an all-gather, each one round of messages.
//
// Gloo's allreduce of a CPU tensor runs a ring: 2 (size - 1) steps, each
// waiting for a message from the rank before. For a large tensor the bytes
// are the cost and the ring moves the fewest; for a small one each step's
// latency is, and 6 steps at 4 ranks cost more than moving the bytes. Here
// the same bytes move in two rounds, every peer at once: a reduce-scatter
// (rank r receives chunk r of every rank's tensor and folds it) and an
// all-gather of the folded chunks. Each chunk is summed once, by the rank
// that owns it, in rank order (fold_rows_into), so every rank ends with the
// same bits; at 2 ranks the same bits as Gloo's (one addition, which
// commutes). The data-parallel engine takes it for its small buckets
// (dp/reducer.hpp says where the sizes cross over, measured).
#pragma once

#include "accel/distributed/all_to_all.hpp"
#include "accel/distributed/pieces.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The sum of `flat` (a contiguous 1-d CPU tensor, the same length on every
// rank) over a Gloo group, in place, in two phases. The first, the
// reduce-scatter, is issued here: chunk r (ceil(numel / size) elements,
// the last ones shorter or empty) goes to rank r, and this rank's chunk of
// every peer lands in its row of `rows` (size x ceil(numel / size), the
// caller's, reused across calls). Its Pending's wait() folds this rank's
// chunk into `flat` and issues the second phase, the all-gather, whose
// Pending it returns: that one's wait() gives `flat`, summed. Two phases
// so that a caller with several tensors in flight issues every second phase
// before waiting for any. `tag` as start_exchange_pieces' (every rank must
// issue the same exchanges in the same order under it).
inline auto start_all_reduce_direct(c10d::ProcessGroup& group, const at::Tensor& flat, const at::Tensor& rows,
                                    int tag) {
  const int size = group.getSize(), me = group.getRank();
  const int64_t n = flat.numel(), c = (n + size - 1) / size;
  auto chunk = [flat, n, c](int r) {
    const int64_t begin = std::min(r * c, n);
    return flat.narrow(0, begin, std::min(c, n - begin));
  };
  const int64_t mine = chunk(me).numel();
  auto scatter = start_exchange_pieces(
      group, 1, [&](int to, std::size_t) { return chunk(to); },
      [&](int from, std::size_t) { return rows[from].narrow(0, 0, mine); }, tag, kDirectAllReduce);
  return then(std::move(scatter), [g = &group, flat, rows, chunk, me, mine, tag] {
    at::Tensor own = chunk(me);
    if (mine > 0) {
      at::NoGradGuard no_grad;
      rows[me].narrow(0, 0, mine).copy_(own);
      fold_rows_into(rows.narrow(1, 0, mine), own, ReduceOp::SUM);
    }
    return then(start_exchange_pieces(
                    *g, 1, [&](int, std::size_t) { return own; }, [&](int from, std::size_t) { return chunk(from); },
                    tag, kDirectAllReduce),
                [flat] { return flat; });
  });
}
}  // namespace detail

ACCEL_NAMESPACE_END
