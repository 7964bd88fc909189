// accel/distributed/pieces.hpp: a Gloo group's exchange of pieces point to point: the all-gather and reduce-scatter the sharding engine runs without staging.
#pragma once

#include "accel/distributed/pending.hpp"
#include "accel/distributed/staging.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The all-gather of a Gloo group's CPU tensors without c10d's staging.
// Gloo's allgather gathers into a flat buffer of its own, allocated per call,
// and copies the rows out (LibTorch 2.15: through two such buffers). Here
// each rank sends its pieces to every other rank and receives theirs straight
// where they belong, `into(from, i)` for piece i of rank `from` (a
// contiguous CPU tensor of that piece's length, the same on every rank; an
// empty one is neither sent nor received), and copies its own pieces in: no
// allocation, one local copy, and the same bytes on the wire as Gloo's ring
// (each rank sends and receives size - 1 rows). Gloo moves a
// point-to-point message as bytes, whatever the dtype. Messages between two
// ranks with one tag match in the order they were issued, and every rank
// issues the same gathers in the same order; `tag` keeps them apart from
// the caller's own sends. The Pending waits on the last operation issued,
// and its landing on every other one. A piece is a message, so many small
// pieces cost more than one row copied out after (see dp/unit_params.hpp).
inline constexpr const char* kDirectGather = "all_gather (point to point)";
inline bool direct_gather_fits(const c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& rows) {
  return group.getBackendName() == "gloo" && input.device().is_cpu() && rows.device().is_cpu() &&
         input.is_contiguous() && rows.is_contiguous() && input.numel() > 0;
}
// The exchange under it (and under the sharding engine's point-to-point
// reduce-scatter, dp/scatter.hpp, named kDirectScatter): to every other
// rank `to`, `count` pieces sent(to, i); from every other rank `from`,
// count pieces received into into(from, i). Both sides must agree on each
// piece's length (an empty one is neither sent nor received).
inline constexpr const char* kDirectScatter = "reduce_scatter (point to point)";
// ... and under the all-reduce of small tensors (distributed/direct_all_reduce.hpp).
inline constexpr const char* kDirectAllReduce = "all_reduce (point to point)";
// The messages of an exchange not waited for yet. await_all() waits for
// them in order and throws the first failure; whatever it left (after a
// failure, or when the exchange's own last message failed first and its
// landing never ran) is waited for when this is dropped, failures ignored:
// an exchange ends with every message of it ended, so no buffer it reads
// or writes goes back to its owner (the sharding engine's pool) while a
// message still uses it. A message of a dead peer fails at once; one of a
// live peer that never sends ends by the group's timeout.
class Outstanding {
 public:
  Outstanding(c10d::ProcessGroup* group, const char* op, std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : group_(group), op_(op), works_(std::move(works)) {}
  Outstanding(Outstanding&& other) noexcept
      : group_(other.group_), op_(other.op_), works_(std::move(other.works_)), next_(std::exchange(other.next_, 0)) {
    other.works_.clear();
  }
  Outstanding(const Outstanding&) = delete;
  Outstanding& operator=(const Outstanding&) = delete;
  Outstanding& operator=(Outstanding&&) = delete;
  ~Outstanding() {
    for (; next_ < works_.size(); ++next_) {
      try {
        wait_bounded(op_, *group_, *works_[next_]);
      } catch (const std::exception&) {  // (the exchange has reported its failure, or is being dropped)
      }
    }
  }
  void await_all() {
    while (next_ < works_.size()) await(op_, *group_, *works_[next_++]);
  }

 private:
  c10d::ProcessGroup* group_;
  const char* op_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::size_t next_ = 0;
};
template <class Sent, class Into>
inline auto start_exchange_pieces(c10d::ProcessGroup& group, std::size_t count, Sent sent, Into into, int tag,
                                  const char* op = kDirectGather) {
  const int size = group.getSize(), rank = group.getRank();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(2 * static_cast<std::size_t>(size - 1) * count);
  for (int step = 1; step < size; ++step) {  // (peers in a ring order: rank + 1 first, so no rank is everyone's first)
    const int to = (rank + step) % size, from = (rank - step + size) % size;
    for (std::size_t i = 0; i < count; ++i) {
      std::vector<at::Tensor> out{sent(to, i)}, in{into(from, i)};
      if (out[0].numel() > 0) works.push_back(issue(op, group, [&] { return group.send(out, to, tag); }));
      if (in[0].numel() > 0) works.push_back(issue(op, group, [&] { return group.recv(in, from, tag); }));
    }
  }
  c10::intrusive_ptr<c10d::Work> last;
  if (!works.empty()) {
    last = works.back();
    works.pop_back();
  }
  return Pending{&group, op, std::move(last),
                 [outstanding = Outstanding{&group, op, std::move(works)}]() mutable { outstanding.await_all(); }};
}
template <class Into>
inline auto start_all_gather_pieces(c10d::ProcessGroup& group, const std::vector<at::Tensor>& pieces, Into into,
                                    int tag) {
  auto pending = start_exchange_pieces(group, pieces.size(), [&](int, std::size_t i) { return pieces[i]; }, into, tag);
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].numel() > 0) into(group.getRank(), i).copy_(pieces[i]);
  return pending;
}
// ... of one piece per rank, into `rows` (group size rows, in rank order).
inline auto start_all_gather_direct(c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& rows,
                                    int tag) {
  return then(start_all_gather_pieces(
                  group, {input}, [rows](int from, std::size_t) { return rows.select(0, from); }, tag),
              [rows] {});
}
}  // namespace detail

ACCEL_NAMESPACE_END
