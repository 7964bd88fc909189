// accel/training/weights.hpp: save_model and load_model: a module's weights as Hugging Face's safetensors.
//
// Usable without an Accelerator: every process calls them (each is a
// collective over the world when distributed), global rank 0 writes, and
// an error on any process is thrown on every process.
#pragma once

#include "accel/training/checkpoint_files.hpp"
#include "accel/training/safetensors.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// save_model's work on `module`'s state_dict. whole(t) gives a tensor's
// values when its turn comes (an Accelerator's FULL_SHARD model gathers
// them unit by unit there, a collective); every process calls it for every
// tensor in the same order, the main process writes, and an error there
// (a full disk) still lets the others finish their calls before every
// process throws it.
inline void save_weights(const torch::nn::Module& module, const std::filesystem::path& path, uint64_t max_shard_bytes,
                         const std::function<at::Tensor(const at::Tensor&)>& whole) {
  namespace fs = std::filesystem;
  if (max_shard_bytes == 0) throw InvalidArgument("accel::save_model: max_shard_bytes must be positive");
  using Named = std::vector<std::pair<std::string, at::Tensor>>;
  std::vector<Named> shards(1);  // the files' tensors (names, dtypes and shapes; values come from whole())
  uint64_t in_shard = 0, total = 0;
  for (auto& named : state_dict(module)) {
    const uint64_t bytes = named.second.numel() * named.second.element_size();
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(std::move(named));
    in_shard += bytes;
    total += bytes;
  }
  const bool writes = accel::get_rank() == 0;
  std::string error;
  if (writes)
    error = error_of([&] {
      fs::create_directories(path);
      if (shards.size() == 1) fs::remove(path / "model.safetensors.index.json");  // it would be read first
    });
  std::set<std::string> written;
  std::map<std::string, std::string> weight_map;  // sorted by name, as Hugging Face writes it
  for (std::size_t k = 0; k < shards.size(); ++k) {
    char name[64];
    if (shards.size() == 1) std::snprintf(name, sizeof name, "model.safetensors");
    else std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    std::size_t next = 0;  // the file's tensors whose values were asked for
    auto values = [&](std::size_t i) {
      next = i + 1;
      return whole(shards[k][i].second);
    };
    if (writes && error.empty())
      error = error_of([&] {
        write_safetensors(path / name, shards[k], {}, values);
        written.insert(name);
        for (const auto& named : shards[k]) weight_map[named.first] = name;
      });
    while (next < shards[k].size()) values(next);  // the other processes, and the main one after an error
  }
  if (writes && error.empty())
    error = error_of([&] {
      if (shards.size() > 1) {
        std::string index =
            "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total) + "\n  },\n  \"weight_map\": {";
        for (const auto& [tensor, file] : weight_map)
          index +=
              std::string(index.back() == '{' ? "\n" : ",\n") + "    " + json_quote(tensor) + ": " + json_quote(file);
        index += "\n  }\n}\n";
        write_file_atomically(path / "model.safetensors.index.json", [&](CheckedFile& out) { out.write(index); });
        written.insert("model.safetensors.index.json");
      }
      for (const auto& entry : fs::directory_iterator(path)) {  // an earlier save's other files
        const std::string file = entry.path().filename().string();
        const bool ours = file == "model.safetensors" || file == "model.safetensors.index.json" ||
                          (file.starts_with("model-") && file.ends_with(".safetensors"));
        if (ours && !written.count(file)) fs::remove(entry.path());
      }
      fsync_path(path);
    });
  fail_together(error, "accel::save_model");
}
}  // namespace detail

// Writes the model's weights as Hugging Face does, for Python (and
// load_model) to read: dir/model.safetensors with the state_dict's names as
// keys ("body.0.weight"; parameters and buffers), or, above max_shard_bytes
// (Accelerate's default, 10 GB), dir/model-0000k-of-0000n.safetensors plus
// dir/model.safetensors.index.json. The main process writes; every process
// calls it (and gets any error). Each file is written whole under a
// temporary name, then renamed; the other layout's files of an earlier save
// in dir are removed. It writes the parameters as they are: a model sharded
// by an Accelerator goes through Accelerator::save_model, which gathers
// them unit by unit (or hold a DataParallel::summon_full_params() around
// this).
template <class ModuleHolder>
void save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes = 10'000'000'000) {
  detail::save_weights(*model.ptr(), detail::checkpoint_path(dir, "save_model"), max_shard_bytes,
                       [](const at::Tensor& t) { return t; });
}

// Reads weights written by save_model or by Python (safetensors' save_file,
// save_pretrained / save_model, sharded or not) into the model, on every
// process. Everything is read and checked before anything is copied: each
// of the model's parameters and buffers must be there with its dtype and
// shape, and nothing else; otherwise every process throws, naming the
// file and the tensors. A sharded model: Accelerator::load_model.
template <class ModuleHolder>
void load_model(ModuleHolder& model, const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path path = detail::checkpoint_path(dir, "load_model");
  const auto expected = detail::state_dict(*model.ptr());
  std::map<std::string, at::Tensor> loaded;
  const std::string error = detail::error_of([&] {
    auto take = [&](const fs::path& file, const std::map<std::string, std::string>* weight_map) {
      for (auto& [name, tensor] : detail::read_safetensors(file)) {
        if (weight_map) {
          const auto mapped = weight_map->find(name);
          if (mapped == weight_map->end() || mapped->second != file.filename().string())
            throw RuntimeError(file.string() + " holds " + name + ", which the index does not place there");
        }
        if (!loaded.emplace(name, std::move(tensor)).second)
          throw RuntimeError(file.string() + ": " + name + " is in two files");
      }
    };
    const fs::path index_file = path / "model.safetensors.index.json";
    std::string where = (path / "model.safetensors").string();
    if (fs::exists(index_file)) {
      where = index_file.string();
      std::ifstream in(index_file);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const detail::Json doc = detail::JsonReader(text, where).document();
      const detail::Json* map = doc.find("weight_map");
      if (!map || map->kind != detail::Json::Kind::Object) throw RuntimeError(where + " has no weight_map object");
      std::map<std::string, std::string> weight_map;
      for (std::size_t field = 0; field < map->keys.size(); ++field) {
        const std::string& name = map->keys[field];
        const detail::Json& file = map->values[field];
        if (file.kind != detail::Json::Kind::String || file.text.find('/') != std::string::npos || file.text == "..")
          throw RuntimeError(where + ": the file of " + name + " is not a file name in " + path.string());
        weight_map[name] = file.text;
      }
      std::set<std::string> files;
      for (const auto& entry : weight_map) files.insert(entry.second);
      for (const std::string& file : files) take(path / file, &weight_map);
      for (const auto& entry : weight_map)
        if (!loaded.count(entry.first))
          throw RuntimeError(where + " places " + entry.first + " in " + entry.second + ", which lacks it");
    } else {
      take(path / "model.safetensors", nullptr);
    }
    std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> held;
    for (const auto& [name, tensor] : loaded) held[name] = {tensor.scalar_type(), tensor.sizes().vec()};
    if (const std::string why = detail::misfit(expected, held); !why.empty())
      throw RuntimeError(where + " does not fit the model:" + why);
  });
  detail::fail_together(error, "accel::load_model");
  torch::NoGradGuard no_grad;
  for (const auto& [name, tensor] : expected) tensor.copy_(loaded.at(name));
}

ACCEL_NAMESPACE_END
