// accel/training/checkpoint/pipeline_weights.hpp: a pipeline's stages as one model for save_model and load_model, gathered over the pipeline group.
//
// Under pipeline parallelism each process holds some stages of one model.
// A stage's module keeps the whole model's names for what it holds, as
// torchtitan's stages do (llama::Stage registers "model.layers.5" on the
// stage that holds layer 5), so the stages' state_dicts together are the
// whole model's. save_model writes that one model: the main process writes
// every tensor, each sent to it by a process of the stage that holds it;
// load_model gives each stage its own tensors, after checking the file
// against every stage's (what is missing, what no stage holds).
#pragma once

#include "accel/training/checkpoint/weights.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Planned tensors as text for gather_object, one per line: the file's name,
// dtype and shape, then the model's name with the dtype and shape its
// values travel in (tab-separated: a module's dotted names hold no tab or
// newline). In the model's entry, a meta tensor of the values' dtype and
// shape stands for the tensor.
inline void meta_text(std::ostream& out, const at::Tensor& meta) {
  out << static_cast<int>(meta.scalar_type()) << '\t';
  for (const int64_t size : meta.sizes()) out << size << ',';
}
inline at::Tensor meta_of_text(std::istream& fields) {
  std::string dtype, sizes;
  std::getline(fields, dtype, '\t');
  std::getline(fields, sizes, '\t');
  std::vector<int64_t> shape;
  std::istringstream dims(sizes);
  for (std::string dim; std::getline(dims, dim, ',');) shape.push_back(std::stoll(dim));
  return at::empty(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(std::stoi(dtype))).device(at::kMeta));
}
inline std::string planned_text(const std::vector<PlannedTensor>& planned) {
  std::ostringstream out;
  for (const auto& [file, model] : planned) {
    out << file.first << '\t';
    meta_text(out, file.second);
    out << '\t' << model.first << '\t';
    meta_text(out, model.second);
    out << '\n';
  }
  return out.str();
}
inline std::vector<PlannedTensor> planned_of_text(const std::string& text) {
  std::vector<PlannedTensor> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line + '\t');
    std::string name, model;
    std::getline(fields, name, '\t');
    const at::Tensor file = meta_of_text(fields);
    std::getline(fields, model, '\t');
    out.push_back({{name, file}, {model, meta_of_text(fields)}});
  }
  return out;
}
// Every process's planned tensors over the pipeline group, by its rank
// there (a collective). A failed process sends "!": nullopt on every process.
inline std::optional<std::vector<std::vector<PlannedTensor>>> every_stage_planned(
    const std::optional<std::vector<PlannedTensor>>& mine, const GroupPtr& pipeline) {
  const std::vector<std::string> texts = accel::gather_object(mine ? planned_text(*mine) : std::string("!"), pipeline);
  std::vector<std::vector<PlannedTensor>> out;
  for (const std::string& text : texts) {
    if (text == "!") return std::nullopt;
    out.push_back(planned_of_text(text));
  }
  return out;
}

// The first name two stages hold (a weight tied across stages), in every
// stage's planned tensors by pipeline rank (every_stage_planned's lists), as
// save_model and save_state refuse it: which stage's values would the files
// keep? Empty where every name has one holder; else the message, with the
// two pipeline ranks and `remedy`, what to do. Names are unique within a
// stage (state_dict's keys), so a name seen twice on one pipeline rank is
// two stages there. Every process finds the same verdict in the same lists:
// no further agreement is needed before throwing it.
inline std::string first_name_held_twice(const std::vector<std::vector<PlannedTensor>>& every,
                                         const std::string& remedy) {
  std::map<std::string, int> held_by;
  for (std::size_t r = 0; r < every.size(); ++r)
    for (const auto& entry : every[r]) {
      const int rank = static_cast<int>(r);
      const auto [at, fresh] = held_by.emplace(entry.file.first, rank);
      if (fresh) continue;
      const int first = at->second;
      return "'" + entry.file.first + "' is held by " +
             (first == rank
                  ? "two stages on pipeline rank " + std::to_string(rank)
                  : "the stages on pipeline ranks " + std::to_string(first) + " and " + std::to_string(rank)) +
             " (a weight tied across stages: " + remedy + ")";
    }
  return {};
}

// A stage on this process, for save_model: its module, and local(t), a
// tensor's values here when its turn comes (a FULL_SHARD stage gathers its
// units one by one there).
struct StageWeights {
  const torch::nn::Module* module;
  std::function<at::Tensor(const at::Tensor&)> local;
};
// What save_weights writes for a pipeline: every stage's tensors, by the
// pipeline rank that holds them, then in each stage's state_dict order;
// values(i) is then a broadcast over the pipeline group from the holder. A
// name held by two stages is refused on every process (which one would the
// file keep?), as is an adapter's failure on any stage.
inline WeightSource pipeline_weights(const std::vector<StageWeights>& stages, const StateDictAdapter& adapter,
                                     const GroupPtr& pipeline, c10::Device device) {
  std::vector<WeightSource> mine;
  std::vector<PlannedTensor> planned, sent;  // (sent: the model's entry a meta tensor of the values that travel)
  const std::string error = error_of([&] {
    for (const auto& stage : stages) {
      mine.push_back(module_weights(*stage.module, adapter, stage.local));
      for (std::size_t j = 0; j < mine.back().planned.size(); ++j) {
        const PlannedTensor& entry = mine.back().planned[j];
        planned.push_back(entry);
        sent.push_back({entry.file, {entry.model.first, mine.back().value_metas[j]}});
      }
    }
  });
  fail_together<InvalidArgument>(error, "accel::save_model");  // (over the world: every process saves)
  const auto every = every_stage_planned(sent, pipeline);
  const std::string twice = first_name_held_twice(*every, "give it to one stage, or leave one out through the adapter");
  if (!twice.empty()) throw InvalidArgument("accel::save_model: " + twice);
  c10d::ProcessGroup* group = resolve(pipeline, "accel::save_model");
  const int here = group ? group->getRank() : 0;
  // The whole model's tensors, and for each the pipeline rank that holds it and its place among that rank's.
  WeightSource source;
  std::vector<std::pair<int, std::size_t>> holder;
  for (std::size_t r = 0; r < every->size(); ++r)
    for (std::size_t i = 0; i < (*every)[r].size(); ++i) {
      PlannedTensor entry = (*every)[r][i];
      source.value_metas.push_back(entry.model.second);
      if (static_cast<int>(r) == here) entry = planned[i];  // (with the model's tensor)
      source.planned.push_back(std::move(entry));
      holder.emplace_back(static_cast<int>(r), i);
    }
  // this process's tensor i: stage s's tensor j
  std::vector<std::pair<std::size_t, std::size_t>> local;
  for (std::size_t s = 0; s < mine.size(); ++s)
    for (std::size_t j = 0; j < mine[s].planned.size(); ++j) local.emplace_back(s, j);
  source.values = [mine = std::move(mine), local = std::move(local), holder = std::move(holder), here, pipeline, device,
                   metas = source.value_metas](std::size_t i) {
    const auto [r, k] = holder[i];
    const at::Tensor values =
        r == here ? mine[local[k].first].values(local[k].second).contiguous()
                  : at::empty(metas[i].sizes(), at::TensorOptions().dtype(metas[i].scalar_type()).device(device));
    return accel::broadcast(values, r, pipeline);
  };
  return source;
}

// load_weights' check under a pipeline: every stage's entries, from every
// process of the pipeline group (what load_weights checks the file against).
inline EveryStage every_stage_entries(const GroupPtr& pipeline) {
  return [pipeline](const std::optional<std::vector<NamedTensor>>& mine) -> std::optional<std::vector<NamedTensor>> {
    std::optional<std::vector<PlannedTensor>> planned;
    if (mine) {
      planned.emplace();
      for (const auto& entry : *mine) planned->push_back({entry, entry});
    }
    const auto every = every_stage_planned(planned, pipeline);
    if (!every) return std::nullopt;
    std::vector<NamedTensor> out;
    for (const auto& stage : *every)
      for (const auto& entry : stage) out.push_back(entry.file);
    return out;
  };
}
}  // namespace detail

ACCEL_NAMESPACE_END
