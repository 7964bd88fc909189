// accel/distributed/start_broadcast.hpp: the broadcast family started: a tensor from one rank, its pieces scattered from one rank, the ranks checked.
#pragma once

#include "accel/distributed/pending.hpp"
#include "accel/distributed/staging.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The source of a broadcast is a rank within the group (`name` is how the
// operation's parameter is called); without a group only rank 0 exists.
inline void check_source(const c10d::ProcessGroup* group, int src, const char* op, const char* name) {
  if (!group && src != 0)
    throw InvalidArgument(std::string("accel::") + op + ": " + name + "=" + std::to_string(src) +
                          " but the process is not distributed (only rank 0 exists)");
  if (group && (src < 0 || src >= group->getSize()))
    throw InvalidArgument(std::string("accel::") + op + ": " + name + "=" + std::to_string(src) + " is not a rank of " +
                          describe(*group) + " (" + name + " is a rank within the group)");
}

inline void check_peer(const c10d::ProcessGroup* group, int peer, const char* op, const char* name) {
  check_source(group, peer, op, name);
  if (group && peer == group->getRank())
    throw InvalidArgument(std::string("accel::") + op + ": " + name + "=" + std::to_string(peer) +
                          " is this rank itself");
}

// `src` was checked by the caller (check_source).
inline auto start_broadcast(c10d::ProcessGroup& group, at::Tensor tensor, int src) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) {
    s = stage(group, tensor);
    std::vector<at::Tensor> tensors{s.c10d_tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    work = issue("broadcast", group, [&] { return group.broadcast(tensors, opts); });
  }
  return Pending{&group, "broadcast", std::move(work),
                 [tensor = std::move(tensor), staged = std::move(s.staged)]() mutable {
                   land_in_place(tensor, staged, 1);
                   return std::move(tensor);
                 }};
}
inline void broadcast_tensor(c10d::ProcessGroup& group, const at::Tensor& tensor, int src) {
  start_broadcast(group, tensor, src).wait();
}

// Rank `src` sends pieces[r] to rank r of the group; every rank returns its
// own (the source: an empty vector; it keeps its piece). One broadcast of the
// lengths, one scatter of the pieces padded to the longest: each rank
// receives only its own bytes. `pieces` matters on the source only.
inline std::vector<char> scatter_bytes(c10d::ProcessGroup& group, int src, const std::vector<std::vector<char>>& pieces,
                                       const char* op) {
  const int size = group.getSize(), rank = group.getRank();
  std::vector<int64_t> lengths(static_cast<std::size_t>(size), 0);
  if (rank == src)
    for (int r = 0; r < size; ++r)
      if (r != src) lengths[r] = static_cast<int64_t>(pieces.at(static_cast<std::size_t>(r)).size());
  at::Tensor length_view = at::from_blob(lengths.data(), {size}, cpu_options(c10::kLong));
  broadcast_tensor(group, length_view, src);
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  at::Tensor output = at::empty({longest}, cpu_options(c10::kByte));
  const std::optional<c10::Device> device = staging_device(group, output);
  std::vector<std::vector<at::Tensor>> inputs;
  if (rank == src) {
    inputs.emplace_back();
    for (int r = 0; r < size; ++r) {
      at::Tensor padded = at::zeros({longest}, cpu_options(c10::kByte));
      if (lengths[r] > 0) std::memcpy(padded.data_ptr(), pieces[r].data(), static_cast<std::size_t>(lengths[r]));
      inputs.back().push_back(device ? padded.to(*device) : padded);
    }
  }
  std::vector<at::Tensor> outputs{device ? output.to(*device) : output};
  c10d::ScatterOptions opts;
  opts.rootRank = src;
  run(op, group, [&] { return group.scatter(outputs, inputs, opts); });
  const at::Tensor received = outputs.front().to(c10::kCPU);
  const auto* bytes = static_cast<const char*>(received.data_ptr());
  return std::vector<char>(bytes, bytes + lengths[static_cast<std::size_t>(rank)]);
}
}  // namespace detail

ACCEL_NAMESPACE_END
