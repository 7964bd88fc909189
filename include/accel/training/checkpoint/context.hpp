// accel/training/checkpoint/context.hpp: where this process stands, as a checkpoint records and checks it, and which files are its own.
#pragma once

#include "accel/training/checkpoint/prepared.hpp"
#include "accel/training/checkpoint/file_names.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Where this process stands, as the checkpoint records and checks it.
struct CheckpointContext {
  int process_index = 0;
  int num_processes = 1;
  int64_t shards = 1;  // ways the optimizer state is sharded (1: not sharded)
  c10::Device device{c10::kCPU};
};

// Optimizer i's checkpoint file: this process's own under sharding, else the whole one.
inline std::string optimizer_file(const PreparedSet& set, const CheckpointContext& ctx, std::size_t i) {
  return file_names::optimizer(i, set.sharded->empty() ? -1 : ctx.process_index);
}

// Whether model i is saved in pieces, every process its own
// (checkpoint/shards.hpp), rather than whole in model.pt by process 0.
inline bool saved_in_pieces(const PreparedSet& set, std::size_t i) {
  return set.models[i].data_parallel && set.models[i].data_parallel->sharded();
}

}  // namespace detail

ACCEL_NAMESPACE_END
