// accel/training/checkpoint/file_names.hpp: the name of every file save_state and save_model write, in one place.
//
// A checkpoint directory (save_state) holds model.pt, model_1.pt, ... (a
// sharded model: each process's pieces instead), optimizer.pt, ... (sharded:
// each process's optimizer_rank<r>.pt, ...), scheduler.pt, ..., random_states_<rank>.pt,
// loaders.pt, scaler.pt, custom_checkpoint_<i>.pt and last the manifest. A
// weights directory (save_model) holds model.safetensors, or Hugging Face's
// model-<k>-of-<n>.safetensors with model.safetensors.index.json. The names
// are Accelerate's and Hugging Face's where they have one, so that their
// tools find the files.
#pragma once

#include "accel/training/torch_nn.hpp"

#include <cstdio>

ACCEL_NAMESPACE_BEGIN

namespace detail::file_names {
// The manifest: its presence marks a checkpoint complete (checkpoint/files.hpp).
inline constexpr const char* manifest = "accel_checkpoint.txt";
// stem.pt, stem_1.pt, ... for the i-th of its kind.
inline std::string numbered(const std::string& stem, std::size_t i) {
  return i == 0 ? stem + ".pt" : stem + "_" + std::to_string(i) + ".pt";
}
inline std::string model(std::size_t i) { return numbered("model", i); }
inline std::string scheduler(std::size_t i) { return numbered("scheduler", i); }
// Optimizer i's: optimizer.pt, optimizer_1.pt, ...; under sharding each
// process's own, optimizer_rank<r>.pt, optimizer_1_rank<r>.pt, ... (rank -1:
// the whole one).
inline std::string optimizer(std::size_t i, int rank) {
  const std::string name = numbered("optimizer", i);
  if (rank < 0) return name;
  return name.substr(0, name.size() - 3) + "_rank" + std::to_string(rank) + ".pt";
}
// A process's RNG states and accumulation step, as Accelerate's.
inline std::string random_states(int64_t process) { return "random_states_" + std::to_string(process) + ".pt"; }
inline constexpr const char* loaders = "loaders.pt";
inline constexpr const char* scaler = "scaler.pt";
// The i-th object of register_for_checkpointing, as Accelerate's.
inline std::string custom_object(std::size_t i) { return "custom_checkpoint_" + std::to_string(i) + ".pt"; }
// A sharded model's piece j written by process `process` (checkpoint/shards.hpp).
inline std::string piece(int process, std::size_t j) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-part-%zu.safetensors", process, j);
  return name;
}

// save_model's: one file, or Hugging Face's shards and their index.
inline constexpr const char* weights = "model.safetensors";
inline constexpr const char* weights_index = "model.safetensors.index.json";
inline std::string weights_shard(std::size_t k, std::size_t count) {
  if (count == 1) return weights;
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, count);
  return name;
}
// Whether `file` is one save_model writes (an earlier save's are removed).
inline bool is_weights_file(const std::string& file) {
  return file == weights || file == weights_index || (file.starts_with("model-") && file.ends_with(".safetensors"));
}
}  // namespace detail::file_names

ACCEL_NAMESPACE_END
