// accel/training/dp/chunks.hpp: the chunk layout sharding cuts every parameter into: S equal chunks, the last padded.
//
// Under sharding (dp/shards.hpp) a parameter of n elements is cut into S
// chunks of c = ceil(n / S) elements of it flattened, rank r keeping chunk
// r; a bucket's gradients travel laid out rank after rank, chunk r of each
// gradient in row r. These functions move tensors in and out of that
// layout; they know nothing of buckets or groups.
#pragma once

#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// The chunk layout: t flattened and zero-padded to S chunks of c, chunk r
// being row r. read_rows copies t's rows into columns [off, off + c) of
// rows, zeros where t ends before them (so rows need not start zeroed: a
// pass over the whole buffer saved); write_rows copies them back into t;
// read_chunk copies row r alone into `out`.
inline void read_rows(const at::Tensor& t, const at::Tensor& rows, int64_t off, int64_t c) {
  const at::Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel(), full = c ? n / c : 0, rest = n - full * c;
  const at::Tensor columns = rows.narrow(1, off, c);
  if (full) columns.narrow(0, 0, full).copy_(flat.narrow(0, 0, full * c).view({full, c}));
  if (rest) {
    columns[full].narrow(0, 0, rest).copy_(flat.narrow(0, full * c, rest));
    columns[full].narrow(0, rest, c - rest).zero_();
  }
  const int64_t filled = full + (rest ? 1 : 0);
  if (filled < rows.size(0)) columns.narrow(0, filled, rows.size(0) - filled).zero_();
}
inline void write_rows(const at::Tensor& rows, int64_t off, int64_t c, at::Tensor& t) {
  const int64_t n = t.numel(), full = c ? n / c : 0, rest = n - full * c;
  const at::Tensor columns = rows.narrow(1, off, c);
  if (!t.is_contiguous()) {
    t.copy_(columns.reshape({-1}).narrow(0, 0, n).view(t.sizes()));
    return;
  }
  const at::Tensor flat = t.view({-1});
  if (full) flat.narrow(0, 0, full * c).view({full, c}).copy_(columns.narrow(0, 0, full));
  if (rest) flat.narrow(0, full * c, rest).copy_(columns[full].narrow(0, 0, rest));
}
// Rank r's chunk of a tensor of n elements cut in chunks of c: (begin,
// length), the last chunks short or empty.
inline std::pair<int64_t, int64_t> chunk_range(int64_t r, int64_t c, int64_t n) {
  const int64_t begin = std::min(r * c, n);
  return {begin, std::min(c, n - begin)};
}
inline void read_chunk(const at::Tensor& t, int64_t r, int64_t c, const at::Tensor& out) {
  const at::Tensor flat = t.reshape({-1});
  const auto [begin, length] = chunk_range(r, c, flat.numel());
  if (length) out.narrow(0, 0, length).copy_(flat.narrow(0, begin, length));
  if (length < c) out.narrow(0, length, c - length).zero_();
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END
