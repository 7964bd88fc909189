// accel/training/checkpoint/world.hpp: a checkpoint loaded by another number of processes: loader positions in samples, RNG states for new processes.
//
// A checkpoint loads at any number of processes: a job moved from 4
// processes to 2, or an elastic restart with fewer, goes on (a sharded
// optimizer state is cut again for the new pieces: checkpoint/reshard.hpp).
// Two more things in it belong to the saving run's layout, and these are
// the rules for them:
// - A prepared loader's place is kept in samples: the saving run read
//   `batches` batches of the pass, each of `samples_per_batch` samples over
//   all its processes (the batch size times the data-parallel processes,
//   or the global batch with split_batches). This run skips as many of its
//   own batches as cover them; where they do not come out whole, it skips
//   the whole ones only (the rest is read again) and warns, naming how many
//   samples. Where either run's batch size is not known (a custom batch
//   sampler without batch_sampler_batch_size), a place mid-pass carries
//   over to as many processes only, in batches as saved, and is an error
//   at another number.
// - RNG states: process p loads the saving run's process p's. A process the
//   saving run did not have seeds its generators from the state of process
//   p mod N (N saving processes) and p, so that each new process draws a
//   stream of its own, the same at every such resume.
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The saving run's process whose RNG state (and accumulation step) process
// p loads: its own where the saving run had it.
inline int saved_process_for(int p, int saved_processes) { return p % saved_processes; }

// The seed of a process the saving run did not have (see above): the
// saved state's bytes and p, through FNV-1a and splitmix64's finaliser.
inline uint64_t derived_seed(const at::Tensor& saved_state, int p) {
  const at::Tensor bytes = saved_state.cpu().contiguous();
  const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < bytes.numel() * static_cast<int64_t>(bytes.element_size()); ++i)
    h = (h ^ data[i]) * 1099511628211ULL;
  uint64_t z = h ^ (static_cast<uint64_t>(p) + 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// How many of this run's batches loader `index` skips to resume a pass of
// which the saving run read `batches` batches of `saved_per_batch` samples
// (0: not known), this run's batches being of `per_batch` (0: not known)
// and its processes as many as the saving run's or not; and, where the
// samples do not come out in whole batches, the warning that says so
// (empty otherwise; load_state gives it once the load is committed).
struct ResumedBatches {
  size_t batches = 0;
  std::string warning{};
};
inline ResumedBatches resumed_batches(std::size_t index, size_t batches, int64_t saved_per_batch, size_t per_batch,
                                      bool same_processes) {
  if (batches == 0) return {};
  if (saved_per_batch <= 0 || per_batch == 0) {
    if (same_processes) return {batches};  // as saved (the batch size is the program's to keep)
    throw RuntimeError("prepared loader " + std::to_string(index) + " stopped after " + std::to_string(batches) +
                       " batches of its pass, and the samples per batch of " +
                       (saved_per_batch <= 0 ? std::string("the saving run") : std::string("this run")) +
                       " are not known (a custom batch sampler: set batch_sampler_batch_size), so its place "
                       "cannot be carried over to another number of processes");
  }
  if (saved_per_batch == static_cast<int64_t>(per_batch)) return {batches};
  const auto samples = static_cast<size_t>(saved_per_batch) * batches;
  const size_t whole = samples / per_batch, again = samples % per_batch;
  if (again == 0) return {whole};
  return {whole, c10::str("accel::Accelerator::load_state: prepared loader ", index, " read ", samples,
                          " samples of its pass in the saving run (", batches, " batches of ", saved_per_batch,
                          "); this run reads ", per_batch, " per batch, so it skips ", whole,
                          " batches and reads the last ", again, " of those samples again")};
}
}  // namespace detail

ACCEL_NAMESPACE_END
