// Shared by the tensor-parallel tests (test_training_tp.cpp: Megatron's layers; test_training_tp_plan.cpp: a plan
// over plain modules): the model's sizes, where its parameters are split, and the runs against
// tests/python_ref/tp_ref.py (the files it writes and reads, and the training loop both sides run).
#pragma once

#include "training_fixtures.hpp"

namespace tp_fixtures {
constexpr int64_t kVocab = 48, kHidden = 10, kFfn = 36, kBatch = 3, kSeq = 12, kBlocks = 2;

// The dimension both models split a parameter along (none: whole on every rank). The head is tied to the
// embedding: its weight is the embedding's rows.
inline std::optional<int64_t> split_dim(const std::string& name) {
  if (name == "embed.weight" || name == "head.weight" || name.ends_with("up.weight") || name.ends_with("up.bias"))
    return 0;
  if (name.ends_with("down.weight")) return 1;
  return std::nullopt;
}
// The piece of a whole parameter rank r of P holds under the name `name`, for comparison.
inline at::Tensor piece(const std::string& name, const at::Tensor& whole, int P, int r) {
  const auto dim = split_dim(name);
  return dim ? whole.chunk(P, *dim)[r] : whole;
}
// The whole parameter gathered from the group's pieces of it.
inline at::Tensor whole_of(const std::string& name, const at::Tensor& p, const accel::GroupPtr& group) {
  const auto dim = split_dim(name);
  return dim ? at::cat(accel::all_gather(p.detach().contiguous(), group).unbind(0), *dim) : p.detach().clone();
}
// The parameters by name; the tied head's weight (LibTorch lists a tensor under each of its names, and a plain
// Linear's own registered weight is left unused) left to the embedding's, as the one-process model has it once.
inline std::map<std::string, at::Tensor> by_name(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters())
    if (p.key() != "head.weight") out[p.key()] = p.value();
  return out;
}

// The gradient the optimizer steps for parameter p of `wrapper`'s model, and what it should be, given the piece's
// whole expected gradient: under sharding the shard's, this rank's chunk of it (the chunk layout: ceil(n / S)
// elements each, the last short); else p's own, all of it.
inline std::pair<at::Tensor, at::Tensor> stepped_gradient(const accel::DataParallel& wrapper, const at::Tensor& p,
                                                          const at::Tensor& expected) {
  const at::Tensor shard = wrapper.shard_of(p);
  if (!shard.defined()) return {p.grad(), expected};
  const int64_t S = wrapper.shard_group()->getSize(), s = wrapper.shard_group()->getRank();
  const int64_t n = expected.numel(), chunk = (n + S - 1) / S;
  const int64_t begin = std::min(s * chunk, n), length = std::min(chunk, n - begin);
  return {shard.grad().narrow(0, 0, length), expected.reshape({-1}).narrow(0, begin, length)};
}

// A run against tests/python_ref/tp_ref.py (CTest python_tp_*, through tests/python_ref/run_tp.sh): the same start
// (DIR/init.safetensors, whole tensors under Python's names), the same batches (DIR/batches.safetensors: ids and
// targets, [steps, batch, sequence]), AdamW with the same settings. Each step's loss and the trained whole
// parameters go to DIR/cpp_MODE_WORLD.safetensors, and the collectives the first step issues on the tp group (its
// sequence number) to DIR/cpp_MODE_WORLD_counts.safetensors, for tp_ref.py to compare.
struct PythonRun {
  std::map<std::string, at::Tensor> start, batches;

  explicit PythonRun(const std::string& dir) : dir_(dir) {
    for (auto& named : accel::detail::read_safetensors(dir + "/init.safetensors")) start.insert(named);
    for (auto& named : accel::detail::read_safetensors(dir + "/batches.safetensors")) batches.insert(named);
  }
  // Every batch through `loss_and_backward(ids, targets)` (the forward, backward and any gradient sums; returns
  // the loss), then the optimizer's step (a torch::optim::Optimizer, or the Accelerator's AcceleratedOptimizer):
  // the losses, and the first step's collectives on `group`.
  template <class Optimizer, class Step>
  void train(Optimizer& optimizer, const accel::GroupPtr& group, Step loss_and_backward) {
    for (int64_t step = 0; step < batches.at("ids").size(0); ++step) {
      if (step == 0) start_sequence(group);
      const int64_t before = group->getSequenceNumberForGroup();
      const at::Tensor loss = loss_and_backward(batches.at("ids")[step], batches.at("targets")[step]);
      optimizer.step();
      optimizer.zero_grad();
      if (step == 0) first_step_collectives_ = static_cast<int64_t>(group->getSequenceNumberForGroup()) - before;
      losses_.push_back(loss.item<double>());
    }
  }
  // Rank 0 writes the files for `mode`: the trained parameters (by_name) gathered whole, the losses, the count.
  void write(const std::string& mode, torch::nn::Module& model, const accel::GroupPtr& group) const {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& [name, p] : by_name(model)) out.emplace_back(name, whole_of(name, p, group));
    out.emplace_back("losses", at::tensor(losses_, at::TensorOptions(at::kDouble)));
    const int P = accel::get_world_size();
    const std::string base = dir_ + "/cpp_" + mode + "_" + std::to_string(P);
    if (accel::get_rank() == 0) {
      accel::detail::write_safetensors(base + ".safetensors", out);
      accel::detail::write_safetensors(base + "_counts.safetensors",
                                       {{"collectives", at::tensor({first_step_collectives_}, at::kLong)}});
      std::printf("accel.hpp %s on %d: one step's collectives on the tp group: %lld\n", mode.c_str(), P,
                  static_cast<long long>(first_step_collectives_));
    }
  }

 private:
  std::string dir_;
  std::vector<double> losses_;
  int64_t first_step_collectives_ = 0;
};
}  // namespace tp_fixtures
