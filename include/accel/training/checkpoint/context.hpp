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
  int64_t tp = 1;      // the tensor-parallel size (above 1: each process's optimizers step their own pieces)
  int64_t pp = 1;      // the pipeline-parallel size (above 1: each process holds some stages of the model)
  c10::Device device{c10::kCPU};

  // Whether this process is the first of those holding its stages: the
  // pipeline is the meshes' outermost dimension, so pipeline rank r's
  // processes are the r-th run of num_processes / pp (all of them without
  // a pipeline: process 0 is the first).
  bool first_of_its_stages() const { return process_index % (num_processes / pp) == 0; }
};

// Whether each process writes its own optimizer state: under sharding (its
// shards), tensor parallelism (its pieces) and a pipeline (its stages'
// parameters); else process 0 writes the whole state, the same on every
// process.
inline bool optimizers_per_process(const PreparedSet& set, const CheckpointContext& ctx) {
  return !set.sharded->empty() || ctx.tp > 1 || ctx.pp > 1;
}
// Optimizer i's checkpoint file: this process's own, or the whole one.
inline std::string optimizer_file(const PreparedSet& set, const CheckpointContext& ctx, std::size_t i) {
  return file_names::optimizer(i, optimizers_per_process(set, ctx) ? ctx.process_index : -1);
}

// Whether model i is saved in pieces, every process its own
// (checkpoint/shards.hpp), rather than whole in model.pt by process 0:
// a sharded model, one holding tensor-parallel pieces, and a pipeline's
// stages (each process holds some of the model).
inline bool saved_in_pieces(const PreparedSet& set, std::size_t i) {
  const PreparedModel& m = set.models[i];
  return (m.data_parallel && m.data_parallel->sharded()) || m.split.group || set.pipeline_group;
}

}  // namespace detail

ACCEL_NAMESPACE_END
