// accel/training/checkpoint/weights.hpp: save_model and load_model: a module's weights as Hugging Face's safetensors.
//
// Usable without an Accelerator: every process calls them (each is a
// collective over the world when distributed), global rank 0 writes, and
// an error on any process is thrown on every process.
#pragma once

#include "accel/training/checkpoint/files.hpp"
#include "accel/training/checkpoint/sharded_weights.hpp"
#include "accel/training/io/safetensors.hpp"
#include "accel/training/tp/pieces.hpp"

ACCEL_NAMESPACE_BEGIN

// A tensor and its name (one state_dict entry).
using NamedTensor = std::pair<std::string, at::Tensor>;

// A state-dict adapter (torchtitan's StateDictAdapter, to_hf / from_hf),
// tensor by tensor: how save_model writes the model's tensors in another
// layout, such as a Hugging Face model's (other names; GPT-2's Conv1D
// weights, [in, out] where a Linear holds [out, in]), and how load_model
// reads them back. An empty function takes each tensor as it is.
struct StateDictAdapter {
  // save_model: one of the model's state_dict entries (its name, its whole
  // values) as the file holds it, or nullopt to leave it out (a tied copy
  // Hugging Face does not store). The name and the result's dtype and shape
  // must follow from the name, dtype and shape alone: save_model learns
  // them by calling it on a meta tensor before any values are gathered.
  std::function<std::optional<NamedTensor>(const std::string& name, const at::Tensor& value)> to_file{};
  // load_model: one of the file's tensors as the model holds it (the
  // inverse), or nullopt for a tensor the model has no place for.
  std::function<std::optional<NamedTensor>(const std::string& name, const at::Tensor& value)> from_file{};
};

struct SaveModelOptions {
  // Above this many bytes, several files and an index (Accelerate's default, 10 GB).
  uint64_t max_shard_bytes = 10'000'000'000;
  StateDictAdapter adapter{};
};
struct LoadModelOptions {
  StateDictAdapter adapter{};
};

namespace detail {
// A tensor with `t`'s dtype and shape (or `sizes`) and no storage (the device "meta").
inline at::Tensor meta_like(const at::Tensor& t, c10::IntArrayRef sizes) {
  return at::empty(sizes, at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
}
inline at::Tensor meta_like(const at::Tensor& t) { return meta_like(t, t.sizes()); }

// What save_model writes for each of the model's state_dict entries: the
// file's name and a meta tensor of the file's dtype and shape, with the
// model's entry the values come from. A tensor-parallel piece (`split`) is
// written whole: the file's shape is the whole tensor's.
struct PlannedTensor {
  NamedTensor file;
  NamedTensor model;
};
inline std::vector<PlannedTensor> planned_tensors(const torch::nn::Module& module, const StateDictAdapter& adapter,
                                                  const tp::SplitTensors& split) {
  std::vector<PlannedTensor> out;
  std::map<std::string, std::string> from;  // a file name -> the model's name it came from
  for (auto& named : state_dict(module)) {
    const at::Tensor meta = meta_like(named.second, split.whole_sizes(named.second));
    std::optional<NamedTensor> file;
    if (!adapter.to_file) {
      file = NamedTensor(named.first, meta);
    } else {
      try {
        file = adapter.to_file(named.first, meta);
      } catch (const std::exception& e) {
        throw InvalidArgument("accel::save_model: the adapter's to_file failed for '" + named.first +
                              "' on a meta tensor (it is called on one first, to learn the file's names, dtypes and "
                              "shapes before any values are gathered; it must not read values): " +
                              e.what());
      }
      if (!file) continue;
      if (file->first.empty())
        throw InvalidArgument("accel::save_model: the adapter's to_file gave '" + named.first +
                              "' an empty name (nullopt leaves a tensor out)");
    }
    if (const auto [at, fresh] = from.emplace(file->first, named.first); !fresh)
      throw InvalidArgument("accel::save_model: the adapter's to_file gives '" + at->second + "' and '" + named.first +
                            "' the same name, '" + file->first + "'");
    out.push_back({std::move(*file), std::move(named)});
  }
  return out;
}

// Where save_weights' tensors come from: each one's name, dtype and shape
// in the file with the model's entry it comes from (in the order written),
// and values(i), which gives the i-th's whole values on the writing
// process: a collective, which every process calls for every i in order
// (a sharded model gathers there, a tensor-parallel piece is gathered over
// its group, a pipeline's stage sends it to the writer).
struct WeightSource {
  std::vector<PlannedTensor> planned;
  std::function<at::Tensor(std::size_t i)> values;
  std::vector<at::Tensor> value_metas;  // values(i)'s dtype and shape (meta tensors; the adapter's input)
};
// One module's tensors, in its state_dict's order. local(t) gives a
// tensor's values on this process when its turn comes (an Accelerator's
// FULL_SHARD model gathers them unit by unit there); a tensor-parallel
// piece is then gathered whole over its group.
inline WeightSource module_weights(const torch::nn::Module& module, const StateDictAdapter& adapter,
                                   std::function<at::Tensor(const at::Tensor&)> local) {
  auto split = std::make_shared<tp::SplitTensors>(tp::split_tensors(module));
  WeightSource source{planned_tensors(module, adapter, *split), {}, {}};
  std::vector<at::Tensor> tensors;
  for (const auto& planned : source.planned) {
    tensors.push_back(planned.model.second);
    source.value_metas.push_back(meta_like(planned.model.second, split->whole_sizes(planned.model.second)));
  }
  source.values = [split, local = std::move(local), tensors = std::move(tensors)](std::size_t i) {
    return split->whole(tensors[i], local(tensors[i]));
  };
  return source;
}

// save_weights' files: the tensors of each (names, dtypes and shapes:
// meta tensors), the index in the WeightSource each comes from, and their
// bytes in all. A file takes tensors until the next would pass
// max_shard_bytes.
struct WeightFiles {
  std::vector<std::vector<NamedTensor>> files = std::vector<std::vector<NamedTensor>>(1);  // (one file, to start)
  std::vector<std::vector<std::size_t>> sources = std::vector<std::vector<std::size_t>>(1);
  uint64_t total = 0;
};
inline WeightFiles plan_weight_files(const std::vector<PlannedTensor>& planned, uint64_t max_shard_bytes) {
  WeightFiles plan;
  uint64_t in_file = 0;
  for (std::size_t i = 0; i < planned.size(); ++i) {
    const at::Tensor& t = planned[i].file.second;
    const uint64_t bytes = t.numel() * t.element_size();
    if (in_file > 0 && in_file + bytes > max_shard_bytes) {
      plan.files.emplace_back();
      plan.sources.emplace_back();
      in_file = 0;
    }
    plan.files.back().push_back(planned[i].file);
    plan.sources.back().push_back(i);
    in_file += bytes;
    plan.total += bytes;
  }
  return plan;
}
// The values a file holds for the model's tensor `name` (values: its whole
// values), through the adapter, checked against the planned name, dtype
// and shape.
inline at::Tensor adapted_values(const SaveModelOptions& options, const std::string& name, const at::Tensor& values,
                                 const NamedTensor& planned) {
  if (!options.adapter.to_file) return values;
  const std::optional<NamedTensor> file = options.adapter.to_file(name, values);
  if (!file || file->first != planned.first || file->second.scalar_type() != planned.second.scalar_type() ||
      file->second.sizes() != planned.second.sizes())
    throw RuntimeError(
        "the adapter's to_file gave '" + name + "' " +  // (fail_together names save_model)
        (file ? "'" + file->first + "', " + c10::toString(file->second.scalar_type()) + c10::str(file->second.sizes())
              : std::string("nullopt")) +
        " on its values, and '" + planned.first + "', " + c10::toString(planned.second.scalar_type()) +
        c10::str(planned.second.sizes()) +
        " on a meta tensor of its dtype and shape: name, dtype and shape must follow from those alone");
  return file->second;
}
// After the files: Hugging Face's index where there are several (sorted by
// tensor name), an earlier save's other weight files removed, the directory
// synced.
inline void finish_weights_dir(const std::filesystem::path& path, const WeightFiles& plan,
                               const std::map<std::string, std::string>& weight_map, std::set<std::string> written) {
  namespace fs = std::filesystem;
  if (plan.files.size() > 1) {
    std::string index =
        "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(plan.total) + "\n  },\n  \"weight_map\": {";
    for (const auto& [tensor, file] : weight_map)
      index += std::string(index.back() == '{' ? "\n" : ",\n") + "    " + json_quote(tensor) + ": " + json_quote(file);
    index += "\n  }\n}\n";
    write_file_atomically(path / file_names::weights_index, [&](CheckedFile& out) { out.write(index); });
    written.insert(file_names::weights_index);
  }
  for (const auto& entry : fs::directory_iterator(path)) {
    const std::string file = entry.path().filename().string();
    if (file_names::is_weights_file(file) && !written.count(file)) fs::remove(entry.path());
  }
  fsync_path(path);
}

// save_model's work: the source's tensors into Hugging Face's files. Every
// process calls source.values for every tensor in the same order, the main
// process writes, and an error there (a full disk) still lets the others
// finish their calls before every process throws it.
inline void save_weights(const WeightSource& source, const std::filesystem::path& path,
                         const SaveModelOptions& options) {
  namespace fs = std::filesystem;
  if (options.max_shard_bytes == 0) throw InvalidArgument("accel::save_model: max_shard_bytes must be positive");
  const WeightFiles plan = plan_weight_files(source.planned, options.max_shard_bytes);
  const std::size_t count = plan.files.size();
  const bool writes = accel::get_rank() == 0;
  std::string error;
  if (writes)
    error = error_of([&] {
      fs::create_directories(path);
      if (count == 1) fs::remove(path / file_names::weights_index);  // it would be read first
    });
  std::set<std::string> written;
  std::map<std::string, std::string> weight_map;  // sorted by name, as Hugging Face writes it
  for (std::size_t k = 0; k < count; ++k) {
    const std::string name = file_names::weights_shard(k, count);
    std::size_t next = 0;  // the file's tensors whose values were asked for
    auto values = [&](std::size_t i) {
      next = i + 1;
      const std::size_t from = plan.sources[k][i];
      return adapted_values(options, source.planned[from].model.first, source.values(from), plan.files[k][i]);
    };
    if (writes && error.empty())
      error = error_of([&] {
        write_safetensors(path / name, plan.files[k], {}, values);
        written.insert(name);
        for (const auto& named : plan.files[k]) weight_map[named.first] = name;
      });
    // The other processes, and the main one after an error: the collectives only (the adapter is the writer's).
    for (; next < plan.files[k].size(); ++next) source.values(plan.sources[k][next]);
  }
  if (writes && error.empty()) error = error_of([&] { finish_weights_dir(path, plan, weight_map, written); });
  fail_together(error, "accel::save_model");
}
}  // namespace detail

// Writes the model's weights as Hugging Face does, for Python (and
// load_model) to read: dir/model.safetensors with the state_dict's names as
// keys ("body.0.weight"; parameters and buffers; a tied tensor under each of
// its names, as Python's state_dict), or, above options.max_shard_bytes
// (Accelerate's default, 10 GB), dir/model-0000k-of-0000n.safetensors plus
// dir/model.safetensors.index.json. options.adapter renames, transforms or
// leaves out tensors on the way (a Hugging Face layout). The main process
// writes; every process calls it (and gets any error). Each file is written
// whole under a temporary name, then renamed; the other layout's files of
// an earlier save in dir are removed. It writes the parameters as they
// are: a model sharded by an Accelerator goes through
// Accelerator::save_model, which gathers them unit by unit (or hold a
// DataParallel::summon_full_params() around this).
template <class ModuleHolder>
void save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options = {}) {
  detail::save_weights(detail::module_weights(*model.ptr(), options.adapter, [](const at::Tensor& t) { return t; }),
                       detail::checkpoint_path(dir, "save_model"), options);
}
// (the same, options.max_shard_bytes given alone)
template <class ModuleHolder>
void save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes) {
  save_model(model, dir, SaveModelOptions{.max_shard_bytes = max_shard_bytes});
}

namespace detail {
// The whole tensors of a directory Python's dcp.save wrote through
// HuggingFaceStorageWriter without consolidating: each rank's pieces in a
// safetensors file of its own (shard-<rank>-model-<k>-of-<n>.safetensors),
// each piece placed in its whole tensor by the header's DCP_SHARDING_INFO,
// and no model.safetensors or index. Read as accel's own sharded
// checkpoints are (ShardedWeights: the pieces must tile every tensor);
// nullopt where the directory has no safetensors files or one lacks
// DCP_SHARDING_INFO (then it is not such a directory).
inline std::optional<std::map<std::string, at::Tensor>> read_dcp_pieces(const std::filesystem::path& dir) {
  if (!holds_dcp_pieces(dir)) return std::nullopt;
  CheckpointManifest unrecorded;  // (Python records no digests: the files are read unchecked)
  unrecorded.format = 1;
  CheckpointFiles unchecked(dir, unrecorded);
  return ShardedWeights(dir, unchecked).read_all();
}

// Every tensor of a safetensors model directory (one file, or shards and an
// index, as save_model and Hugging Face write it; or the pieces of Python's
// dcp.save, read_dcp_pieces), by name; `where` gets the file that names
// them, for errors.
inline std::map<std::string, at::Tensor> read_all_weights(const std::filesystem::path& path, std::string& where) {
  namespace fs = std::filesystem;
  std::map<std::string, at::Tensor> loaded;
  auto take = [&](const fs::path& file, const std::map<std::string, std::string>* weight_map) {
    for (auto& [name, tensor] : read_safetensors(file)) {
      if (weight_map) {
        const auto mapped = weight_map->find(name);
        if (mapped == weight_map->end() || mapped->second != file.filename().string())
          throw RuntimeError(file.string() + " holds " + name + ", which the index does not place there");
      }
      if (!loaded.emplace(name, std::move(tensor)).second)
        throw RuntimeError(file.string() + ": " + name + " is in two files");
    }
  };
  const fs::path index_file = path / file_names::weights_index;
  where = (path / file_names::weights).string();
  if (!fs::exists(index_file)) {
    if (!fs::exists(path / file_names::weights))
      if (auto pieces = read_dcp_pieces(path)) {
        // (their whole shapes are where the pieces reach: a rank's file missing can leave a tensor short)
        where = path.string() +
                " (the pieces Python's dcp.save wrote; a tensor smaller there than in the model may "
                "be a file missing)";
        return std::move(*pieces);
      }
    take(path / file_names::weights, nullptr);
    return loaded;
  }
  where = index_file.string();
  std::ifstream in(index_file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Json doc = JsonReader(text, where).document();
  const Json* map = doc.find("weight_map");
  if (!map || map->kind != Json::Kind::Object) throw RuntimeError(where + " has no weight_map object");
  std::map<std::string, std::string> weight_map;
  for (std::size_t field = 0; field < map->keys.size(); ++field) {
    const std::string& name = map->keys[field];
    const Json& file = map->values[field];
    if (file.kind != Json::Kind::String || file.text.find('/') != std::string::npos || file.text == "..")
      throw RuntimeError(where + ": the file of " + name + " is not a file name in " + path.string());
    weight_map[name] = file.text;
  }
  std::set<std::string> files;
  for (const auto& entry : weight_map) files.insert(entry.second);
  for (const std::string& file : files) take(path / file, &weight_map);
  for (const auto& entry : weight_map)
    if (!loaded.count(entry.first))
      throw RuntimeError(where + " places " + entry.first + " in " + entry.second + ", which lacks it");
  return loaded;
}
// ... but an optimizer's state (which Python's dcp.save keeps beside the
// model, under optimizer.state.: checkpoint/from_python.hpp): the model's.
inline std::map<std::string, at::Tensor> read_weights_dir(const std::filesystem::path& path, std::string& where) {
  std::map<std::string, at::Tensor> loaded = read_all_weights(path, where);
  std::erase_if(loaded, [](const auto& named) { return optimizer_state_name(named.first); });
  return loaded;
}

// The file's tensors under the model's names, through the adapter's from_file.
inline std::map<std::string, at::Tensor> adapted_from_file(std::map<std::string, at::Tensor> file,
                                                           const StateDictAdapter& adapter) {
  if (!adapter.from_file) return file;
  std::map<std::string, at::Tensor> out;
  std::map<std::string, std::string> from;  // a model name -> the file's name it came from
  for (auto& [name, tensor] : file) {
    std::optional<NamedTensor> model = adapter.from_file(name, tensor);
    if (!model) continue;
    if (const auto [at, fresh] = from.emplace(model->first, name); !fresh)
      throw RuntimeError("the adapter's from_file gives '" + at->second + "' and '" + name + "' the same name, '" +
                         model->first + "'");
    out.emplace(std::move(model->first), std::move(model->second));
  }
  return out;
}

// The model's state_dict entries that `loaded` must fill: a tied tensor
// (one tensor under several names, GPT-2's wte and lm_head) needs one of
// its names there, as Hugging Face stores it once; where it has several,
// their values must agree.
inline std::vector<NamedTensor> entries_to_fill(const torch::nn::Module& module,
                                                const std::map<std::string, at::Tensor>& loaded,
                                                const std::string& where) {
  std::vector<NamedTensor> out;
  std::map<const c10::TensorImpl*, std::string> filled;  // a tied tensor -> the name that fills it
  std::set<const c10::TensorImpl*> tied;
  {
    std::set<const c10::TensorImpl*> seen;
    for (const auto& [name, t] : state_dict(module))
      if (!seen.insert(t.unsafeGetTensorImpl()).second) tied.insert(t.unsafeGetTensorImpl());
  }
  for (auto& [name, t] : state_dict(module)) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    const auto found = loaded.find(name);
    if (!tied.count(impl)) {
      out.emplace_back(name, t);
    } else if (found != loaded.end()) {
      if (const auto [first, fresh] = filled.emplace(impl, name); !fresh) {
        const at::Tensor& other = loaded.at(first->second);
        if (other.sizes() == found->second.sizes() && other.scalar_type() == found->second.scalar_type() &&
            !at::equal(other, found->second))
          throw RuntimeError(where + ": " + first->second + " and " + name +
                             " are one tensor in the model (tied), and differ there");
      }
      out.emplace_back(name, t);
    }
  }
  for (auto& [name, t] : state_dict(module))  // a tied tensor with none of its names there: each is missing
    if (tied.count(t.unsafeGetTensorImpl()) && !filled.count(t.unsafeGetTensorImpl())) out.emplace_back(name, t);
  return out;
}

// What every stage of a pipeline holds (names, dtypes, whole shapes: meta
// tensors), from this process's stages' (checkpoint/pipeline_weights.hpp):
// a collective over the pipeline group. nullopt passed (this process
// failed) or returned: some process failed, and says why itself.
using EveryStage =
    std::function<std::optional<std::vector<NamedTensor>>(const std::optional<std::vector<NamedTensor>>& mine)>;

// load_model's work on `modules` (one model, or this process's stages of a
// pipeline). The file must hold each module's entries and nothing else, or,
// with every_stage, the entries of every stage on every process (it is
// called once on every process, after an error here too, so that no process
// is left waiting in it). A tensor-parallel piece's whole tensor is in the
// file.
inline void load_weights(const std::vector<torch::nn::Module*>& modules, const std::filesystem::path& path,
                         const LoadModelOptions& options, const EveryStage& every_stage = {}) {
  std::vector<std::pair<NamedTensor, const tp::SplitTensors*>> expected;  // (and the split each is a piece of)
  std::vector<tp::SplitTensors> splits(modules.size());
  std::vector<NamedTensor> whole;  // (the file holds a piece's whole tensor)
  std::map<std::string, at::Tensor> loaded;
  std::string where;
  std::string error = error_of([&] {
    loaded = adapted_from_file(read_weights_dir(path, where), options.adapter);
    for (std::size_t m = 0; m < modules.size(); ++m) {
      splits[m] = tp::split_tensors(*modules[m]);
      for (auto& [name, tensor] : entries_to_fill(*modules[m], loaded, where)) {
        whole.emplace_back(name, meta_like(tensor, splits[m].whole_sizes(tensor)));
        expected.push_back({{std::move(name), tensor}, &splits[m]});
      }
    }
  });
  bool check = error.empty();
  if (every_stage) {
    const auto all = every_stage(check ? std::optional(whole) : std::nullopt);
    check = check && all.has_value();  // (else a stage's process failed, and its error is the one given)
    if (all) whole = *all;
  }
  if (check)
    error = error_of([&] {
      std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> held;
      for (const auto& [name, tensor] : loaded) held[name] = {tensor.scalar_type(), tensor.sizes().vec()};
      if (const std::string why = misfit(whole, held); !why.empty())
        throw RuntimeError(where + " does not fit the model" + (every_stage ? "'s stages" : "") + ":" + why);
    });
  fail_together(error, "accel::load_model");
  torch::NoGradGuard no_grad;
  for (const auto& [entry, split] : expected) entry.second.copy_(split->piece(entry.second, loaded.at(entry.first)));
}
}  // namespace detail

// Reads weights written by save_model or by Python (safetensors' save_file,
// save_pretrained / save_model, sharded or not; dcp.save through
// HuggingFaceStorageWriter, consolidated or not, by any number of
// processes) into the model, on every process. options.adapter's from_file
// renames and transforms the file's tensors first (the inverse of
// save_model's to_file). Everything is read and checked before anything is
// copied: each of the model's parameters and buffers must be there with its
// dtype and shape (a tied one under one of its names at least), and nothing
// else; otherwise every process throws, naming the file and the tensors. A tensor-parallel piece
// (accel::tp layers, a plan) takes its piece of the whole tensor the file
// holds. A sharded model: Accelerator::load_model.
template <class ModuleHolder>
void load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options = {}) {
  detail::load_weights({model.ptr().get()}, detail::checkpoint_path(dir, "load_model"), options);
}

ACCEL_NAMESPACE_END
