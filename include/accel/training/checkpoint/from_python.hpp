// accel/training/checkpoint/from_python.hpp: load_state of a checkpoint Python's dcp.save wrote through HuggingFaceStorageWriter: the models, and the optimizers' state under Python's names.
//
// A run started in Python (FSDP2, DTensor tensor parallelism, at any
// number of processes) goes on in C++ from what Python saves with
//
//     dcp.save({**get_model_state_dict(model),
//               "optimizer": {"state": get_optimizer_state_dict(model, optimizer)["state"]}},
//              storage_writer=HuggingFaceStorageWriter(DIR, save_distributed=True))
//
// consolidated or not (but torch 2.15's consolidation writes every 0-d
// tensor as zero, Adam's step counts among them: a step of 0 is refused,
// naming the pieces it consolidated). DCP flattens those names as our own
// piece files name their tensors (checkpoint/shards.hpp): the model's
// under its state_dict names, then "optimizer.state.<parameter>.<field>" in
// Python's fields (Adam's and AdamW's exp_avg, exp_avg_sq, max_exp_avg_sq
// and step; SGD's momentum_buffer). So the files are read through the same
// ShardedWeights, each tensor cut to what this process keeps (its shard,
// its tensor-parallel piece), into LibTorch's state types.
//
// What such a directory cannot hold is not loaded: HuggingFaceStorageWriter
// stores tensors only (anything else, such as the optimizer's param_groups,
// it pickles into a file it still names .safetensors, which Python's own
// reader cannot read back either: torch 2.15), so the optimizers' options
// (learning rate, ...) stay this run's, and the schedulers, the loaders'
// places, registered objects, the loss scaler and the RNG states are not
// in it: they stay as they are, and process 0 warns, naming them.
#pragma once

#include "accel/training/checkpoint/model_items.hpp"
#include "accel/training/checkpoint/optimizer_slots.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Whether dir is a checkpoint written outside accel.hpp: no manifest, and
// safetensors files none of which is accel's (Python's dcp.save, or a
// model's weights as Hugging Face and save_model write them). A file named
// .safetensors that is a zip archive throws: what the writer pickles.
inline bool written_outside_accel(const fs::path& dir) {
  if (!fs::is_directory(dir) || fs::exists(dir / file_names::manifest)) return false;
  bool any = false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    char magic[4] = {};
    if (!in.read(magic, 4)) return false;
    if (std::string_view(magic, 4) == std::string_view("PK\x03\x04", 4))
      throw RuntimeError(entry.path().string() +
                         " is a zip archive (torch.save's), not safetensors: Python's HuggingFaceStorageWriter "
                         "pickles what is not a tensor (an optimizer's param_groups, ...) into such a file, which "
                         "neither Python's reader nor accel.hpp reads back. Save the tensors alone: "
                         "{\"optimizer\": {\"state\": get_optimizer_state_dict(model, optimizer)[\"state\"]}}");
    in.seekg(0);
    try {
      if (read_safetensors_header(in, entry.path()).metadata.count(PieceFiles::kCheckpointIdKey)) return false;
    } catch (const std::exception&) {  // (damaged: the plain error of a missing manifest)
      return false;
    }
    any = true;
  }
  return any;
}

// What a load from such a directory reads it as: no digests recorded (the
// files are read unchecked), this run's layout.
inline SavedLayout outside_layout(const CheckpointContext& ctx) {
  CheckpointManifest unrecorded;
  unrecorded.format = 1;
  unrecorded.processes = ctx.num_processes;
  return {ctx.num_processes, 1, unrecorded};
}

// The per-parameter state Python's optimizer of the same kind keeps, read
// into LibTorch's: one state per tensor the optimizer steps (none where the
// files hold no state of that parameter: Python's optimizer had not stepped
// it), each tensor cut to what this process keeps.
class PythonOptimizerState {
 public:
  using States = std::vector<std::pair<c10::TensorImpl*, std::unique_ptr<torch::optim::OptimizerParamState>>>;

  PythonOptimizerState(const PreparedSet& set, std::size_t index, const ShardedWeights& pieces, std::string dir)
      : optimizer_(*set.optimizers[index]), pieces_(pieces), placed_{&pieces, index}, dir_(std::move(dir)) {
    const std::string prefix = optimizer_prefix(index);
    for (const std::string& name : pieces.names())
      if (name.starts_with(prefix)) unread_.insert(name);
    if (unread_.empty())
      throw RuntimeError(dir_ + " holds no state of optimizer " + std::to_string(index) + " (no tensor under " +
                         prefix +
                         "): a model's weights alone, which load_model loads (Accelerator::load_model for a "
                         "prepared model); to go on with Python's optimizer, save " +
                         "get_optimizer_state_dict(model, optimizer)[\"state\"] under \"" +
                         prefix.substr(0, prefix.size() - 7) + "\" beside the model");
    const std::vector<OptimizerSlot> slots = optimizer_slots(set, optimizer_);
    std::size_t position = 0;
    for (const auto& group : optimizer_.param_groups())
      for (const auto& p : group.params()) {
        auto state = read(slots[position++], p, group);
        if (state) states_.emplace_back(p.unsafeGetTensorImpl(), std::move(state));
      }
    if (!unread_.empty())
      throw RuntimeError(dir_ + " holds " + *unread_.begin() + ", which this run's optimizer (" + kind() +
                         ") does not keep for any of its parameters: saved from another kind of optimizer, or "
                         "another model?");
  }

  // The states, taken once (they move into the optimizer).
  States take() { return std::move(states_); }

 private:
  std::unique_ptr<torch::optim::OptimizerParamState> read(const OptimizerSlot& slot, const at::Tensor& p,
                                                          const torch::optim::OptimizerParamGroup& group) {
    const auto& options = group.has_options() ? group.options() : optimizer_.defaults();
    if (dynamic_cast<torch::optim::Adam*>(&optimizer_))
      return adam_like<torch::optim::AdamParamState>(slot, p,
                                                     static_cast<const torch::optim::AdamOptions&>(options).amsgrad());
    if (dynamic_cast<torch::optim::AdamW*>(&optimizer_))
      return adam_like<torch::optim::AdamWParamState>(
          slot, p, static_cast<const torch::optim::AdamWOptions&>(options).amsgrad());
    if (dynamic_cast<torch::optim::SGD*>(&optimizer_)) {
      const std::optional<std::string> buffer = saved(slot, "momentum_buffer");
      if (!buffer) return nullptr;  // (Python's SGD without momentum keeps none)
      auto state = std::make_unique<torch::optim::SGDParamState>();
      state->momentum_buffer(cut(slot, "momentum_buffer", p));
      return state;
    }
    throw RuntimeError(dir_ +
                       ": load_state reads the state of Adam, AdamW and SGD from Python's checkpoints (the "
                       "fields Python's optimizers of those kinds keep); this run's optimizer is " +
                       kind());
  }

  template <class State>
  std::unique_ptr<torch::optim::OptimizerParamState> adam_like(const OptimizerSlot& slot, const at::Tensor& p,
                                                               bool amsgrad) {
    std::vector<const char*> fields{"step", "exp_avg", "exp_avg_sq"};
    if (amsgrad) fields.push_back("max_exp_avg_sq");
    std::size_t found = 0;
    for (const char* field : fields) found += saved(slot, field).has_value();
    if (found == 0) return nullptr;  // never stepped
    for (const char* field : fields)
      if (!saved(slot, field))
        throw RuntimeError(
            dir_ + " holds part of the state of '" + slot.names.front() + "' and not its " + field +
            (std::string_view(field) == "max_exp_avg_sq" ? " (this run's optimizer has amsgrad on)" : ""));
    const std::string step = *saved(slot, "step");
    const double count = pieces_.read(step, 0, 1).item<double>();
    if (count < 0 || count != std::floor(count))
      throw RuntimeError(dir_ + ": " + step + " is " + std::to_string(count) + ", not a count of steps");
    if (count == 0)  // (Python makes the state as it takes the first step: 1 at least)
      throw RuntimeError(dir_ + ": " + step +
                         " is 0 beside its moments: torch's consolidation (HuggingFaceStorageWriter's "
                         "enable_consolidation, torch 2.15) writes every 0-d tensor as zero. Load the pieces it "
                         "consolidated instead (" +
                         dir_ + "/sharded where the save gave no consolidation_output_path)");
    auto state = std::make_unique<State>();
    state->step(static_cast<int64_t>(count));
    state->exp_avg(cut(slot, "exp_avg", p));
    state->exp_avg_sq(cut(slot, "exp_avg_sq", p));
    if (amsgrad) state->max_exp_avg_sq(cut(slot, "max_exp_avg_sq", p));
    return state;
  }

  // The saved name of the slot's field (under any of its parameter's names),
  // marked read; none if the files lack it.
  std::optional<std::string> saved(const OptimizerSlot& slot, const std::string& field) {
    for (const std::string& name : slot.names)
      if (const std::string full = placed_.name(name, field); pieces_.holds(full)) {
        unread_.erase(full);
        return full;
      }
    return std::nullopt;
  }
  at::Tensor cut(const OptimizerSlot& slot, const std::string& field, const at::Tensor& stepped) const {
    return placed_.cut(slot, field, stepped, dir_);
  }
  std::string kind() const { return c10::demangle(typeid(optimizer_).name()); }

  torch::optim::Optimizer& optimizer_;
  const ShardedWeights& pieces_;
  PlacedState placed_;
  std::string dir_;
  std::set<std::string> unread_;  // the files' names of this optimizer not yet read
  States states_;
};

// Prepared optimizer i, from a directory Python's dcp.save wrote: read and
// checked in the read phase, put in place at commit (which cannot fail).
class PythonOptimizerItem final : public CheckpointItem {
 public:
  PythonOptimizerItem(PreparedSet& set, std::size_t i) : set_(set), i_(i) {}
  void read(ItemReader& in) override {
    states_ = PythonOptimizerState(set_, i_, in.pieces(in.dir.string()), in.dir.string()).take();
  }
  void commit() override {
    auto& state = set_.optimizers[i_]->state();
    state.clear();  // (a parameter without saved state has none, as in Python's)
    for (auto& [parameter, saved] : states_) state[dp::state_key(state, parameter)] = std::move(saved);
    states_.clear();
  }

 private:
  PreparedSet& set_;
  std::size_t i_;
  PythonOptimizerState::States states_;
};

// Every tensor of such a directory is taken by something this run
// prepared (a model, by its namespace; an optimizer, by its index), or the
// load is refused: nothing in it is left out without a word.
class PythonNamesItem final : public CheckpointItem {
 public:
  explicit PythonNamesItem(const PreparedSet& set) : set_(set) {}
  void read(ItemReader& in) override {
    for (const std::string& name : in.pieces(in.dir.string()).names()) {
      bool taken = false;
      if (optimizer_state_name(name))
        for (std::size_t i = 0; i < set_.optimizers.size() && !taken; ++i)
          taken = name.starts_with(optimizer_prefix(i));
      else
        for (std::size_t i = 0; i < set_.models.size() && !taken; ++i) taken = in_namespace(name, model_prefix(i));
      if (!taken)
        throw RuntimeError(in.dir.string() + " holds " + name + ", which nothing this run prepared takes (" +
                           std::to_string(set_.models.size()) + " model(s), " + std::to_string(set_.optimizers.size()) +
                           " optimizer(s))");
    }
  }

 private:
  const PreparedSet& set_;
};

// The items of a load from such a directory: the models and optimizers.
inline CheckpointItems python_checkpoint_items(PreparedSet& set) {
  CheckpointItems items;
  items.push_back(std::make_unique<PythonNamesItem>(set));
  for (std::size_t i = 0; i < set.models.size(); ++i) items.push_back(std::make_unique<ModelItem>(set, i));
  for (std::size_t i = 0; i < set.optimizers.size(); ++i)
    items.push_back(std::make_unique<PythonOptimizerItem>(set, i));
  return items;
}

// What such a load leaves as it was (see the top), for process 0's warning.
inline std::string left_by_python_checkpoint(const PreparedSet& set, const fs::path& dir) {
  std::vector<std::string> left;
  auto count = [&](std::size_t n, const char* what) {
    if (n) left.push_back(std::to_string(n) + " " + what);
  };
  count(set.schedulers.size(), "scheduler(s)");
  count(set.loaders.size(), "data loader(s)' place");
  count(set.objects.size(), "registered object(s)");
  if (set.scaler) left.push_back("the loss scaler");
  left.push_back("the RNG states");
  std::string list;
  for (std::size_t k = 0; k < left.size(); ++k) list += (k == 0 ? "" : k + 1 == left.size() ? " and " : ", ") + left[k];
  return "accel::Accelerator::load_state: " + dir.string() +
         " is Python's dcp.save checkpoint: the model(s) and the optimizer(s)' state loaded; its files hold tensors "
         "only, so the optimizers' options (learning rate, ...) are this run's, and " +
         list + " stay as they were" + (set.schedulers.empty() ? "" : " (step a scheduler to Python's step yourself)");
}
}  // namespace detail

ACCEL_NAMESPACE_END
