// accel/training/checkpoint/files.hpp: a checkpoint's directory: atomic install, recovery, rotation, and the checks every load shares.
//
// (Every file's name is checkpoint/file_names.hpp's; the manifest that
// lists them is checkpoint/manifest.hpp's.)
// A checkpoint is a directory: model.pt, model_1.pt, ... (sharded models:
// each process's pieces, rank-<k>-part-<j>.safetensors;
// checkpoint/shards.hpp), optimizer.pt, ... (sharded:
// optimizer_rank<k>.pt, ...),
// random_states_<rank>.pt (that rank's CPU RNG, its CUDA device's on a GPU,
// and the accumulation step, as Accelerate's), loaders.pt (each prepared loader's epoch and batches handed
// out), custom_checkpoint_<i>.pt (register_for_checkpointing), and last the
// manifest accel_checkpoint.txt, whose presence (whole: it ends with "end")
// marks the directory complete.
//
// save_state writes DIR.tmp, fsyncs every file, writes the manifest, fsyncs
// the directory, then swaps DIR.tmp and DIR in one step (renameat2's
// RENAME_EXCHANGE) and removes the old one. Where the filesystem cannot
// exchange, two renames with the old one at DIR.old between them. Whatever
// moment a process dies at, one of DIR, DIR.tmp and DIR.old is complete, and
// the next save_state or load_state first recovers: the complete one with the
// highest serial becomes DIR and the others are removed. A save never removes
// the newest complete checkpoint before its own is complete.
#pragma once

#include "accel/distributed/objects.hpp"
#include "accel/training/parallel/autograd.hpp"
#include "accel/training/io/checked_file.hpp"
#include "accel/training/accelerator_config.hpp"
#include "accel/training/io/file_digest.hpp"
#include "accel/training/checkpoint/manifest.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
namespace fs = std::filesystem;

// Called at each step of the save protocol (tests kill the process there);
// a no-op otherwise. Steps: "files written", "manifest written", "exchanged",
// "between renames", "renamed".
inline std::function<void(const char*)>& checkpoint_hook() {
  static std::function<void(const char*)> hook = [](const char*) {};
  return hook;
}
// Tests turn RENAME_EXCHANGE off to run the two-rename path.
inline bool& checkpoint_use_exchange() {
  static bool use = true;
  return use;
}

// The manifest goes first, so a removal cut short never leaves a directory
// that looks complete.
inline void discard_checkpoint(const fs::path& dir) {
  if (!fs::exists(dir)) return;
  fs::remove(dir / file_names::manifest);
  fs::remove_all(dir);
}

// A checkpoint's serial, from its manifest; none for anything incomplete.
inline std::optional<int64_t> checkpoint_serial(const fs::path& dir) {
  if (auto m = read_manifest(dir)) return m->serial;
  return std::nullopt;
}

// Makes the complete directory `from` the directory `to` (whose content, if
// any, is older or incomplete); `from` is gone afterwards.
inline void install_checkpoint(const fs::path& from, const fs::path& to) {
  const fs::path parent = to.parent_path();
  if (!fs::exists(to)) {
    fs::rename(from, to);
    fsync_path(parent);
    return;
  }
#ifdef RENAME_EXCHANGE
  if (checkpoint_use_exchange()) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_path(parent);
      checkpoint_hook()("exchanged");
      discard_checkpoint(from);  // now the older one
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) throw_errno("cannot exchange with", to);
  }
#endif
  const fs::path old = sibling(to, ".old");
  if (from == old) {  // recovering DIR.old: what is under DIR is incomplete
    fs::remove_all(to);
    fs::rename(from, to);
    fsync_path(parent);
    return;
  }
  discard_checkpoint(old);
  fs::rename(to, old);
  fsync_path(parent);
  checkpoint_hook()("between renames");
  fs::rename(from, to);
  fsync_path(parent);
  checkpoint_hook()("renamed");
  discard_checkpoint(old);
}

// The newest complete checkpoint among DIR, DIR.tmp and DIR.old becomes DIR;
// the others are removed. Returns DIR's serial (none: no checkpoint).
inline std::optional<int64_t> recover_checkpoint(const fs::path& dir) {
  const fs::path tmp = sibling(dir, ".tmp"), old = sibling(dir, ".old");
  const std::optional<int64_t> at_dir = checkpoint_serial(dir), at_tmp = checkpoint_serial(tmp),
                               at_old = checkpoint_serial(old);
  std::optional<int64_t> newest = at_dir;
  if (at_tmp && (!newest || *at_tmp > *newest) && (!at_old || *at_tmp >= *at_old)) {
    install_checkpoint(tmp, dir);
    newest = at_tmp;
  } else if (at_old && (!newest || *at_old > *newest)) {
    install_checkpoint(old, dir);
    newest = at_old;
  }
  discard_checkpoint(tmp);
  discard_checkpoint(old);
  return newest;
}

// "dir/", "./dir" and "dir" are one checkpoint.
inline fs::path checkpoint_path(const fs::path& dir, const char* op) {
  if (dir.empty()) throw InvalidArgument(std::string("accel::Accelerator::") + op + ": an empty checkpoint path");
  fs::path path = fs::absolute(dir).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();
  if (path == path.root_path())
    throw InvalidArgument(std::string("accel::Accelerator::") + op + ": " + dir.string() + " is not a checkpoint path");
  return path;
}

// Accelerate's ProjectConfiguration, checked where it is used (the
// Accelerator hands it out to change).
inline void check_project(const ProjectConfiguration& project, const std::string& where) {
  if (project.automatic_checkpoint_naming && project.project_dir.empty())
    throw InvalidArgument(where + ": automatic_checkpoint_naming needs a project_config.project_dir");
  if (project.total_limit && !project.automatic_checkpoint_naming)
    throw InvalidArgument(where + ": project_config.total_limit applies to automatic_checkpoint_naming, which is off");
  if (project.total_limit && *project.total_limit < 1)
    throw InvalidArgument(where + ": project_config.total_limit must be at least 1, got " +
                          std::to_string(*project.total_limit));
  if (project.iteration < 0)
    throw InvalidArgument(where + ": project_config.iteration must not be negative, got " +
                          std::to_string(project.iteration));
}

// Automatic naming's directories are ROOT/checkpoint_<n>. The number of
// `name` when it is one of them, or one's .tmp/.old leftover, written as
// save_state writes it; other names are not ours and are left alone.
inline std::optional<int> checkpoint_number(std::string name) {
  for (const std::string_view suffix : {".tmp", ".old"})
    if (name.ends_with(suffix)) {
      name.resize(name.size() - suffix.size());
      break;
    }
  constexpr std::string_view prefix = "checkpoint_";
  if (!name.starts_with(prefix)) return std::nullopt;
  const std::string digits = name.substr(prefix.size());
  const bool canonical = !digits.empty() && digits.size() <= 9 && (digits.size() == 1 || digits[0] != '0') &&
                         std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); });
  if (!canonical) return std::nullopt;
  return std::stoi(digits);
}

// The complete numbered checkpoints under root, by number, each first
// recovered from a half-done save.
inline std::map<int, fs::path> numbered_checkpoints(const fs::path& root) {
  std::set<int> numbers;
  if (fs::is_directory(root))
    for (const auto& entry : fs::directory_iterator(root))
      if (const auto n = checkpoint_number(entry.path().filename().string())) numbers.insert(*n);
  std::map<int, fs::path> complete;
  for (const int n : numbers) {
    const fs::path dir = root / ("checkpoint_" + std::to_string(n));
    if (recover_checkpoint(dir)) complete.emplace(n, dir);
  }
  return complete;
}

// total_limit: removes the lowest-numbered checkpoints, never `keep` (the one
// just saved), until `limit` are left.
inline void rotate_checkpoints(const fs::path& root, int limit, int keep) {
  std::map<int, fs::path> others = numbered_checkpoints(root);
  others.erase(keep);
  while (!others.empty() && others.size() + 1 > static_cast<std::size_t>(limit)) {
    discard_checkpoint(others.begin()->second);
    others.erase(others.begin());
  }
}

// A model's checkpoint archive against the model, before anything is loaded:
// every parameter and buffer Module::load will read is there with the
// model's shape and dtype, and the archive holds nothing the model lacks.
inline void check_module_archive(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                                 const std::string& prefix, const std::string& file) {
  std::set<std::string> expected{"training"};  // every TorchScript module has it
  auto check = [&](const std::string& name, const at::Tensor& value, bool buffer) {
    expected.insert(name);
    at::Tensor saved;
    if (!archive.try_read(name, saved, buffer))
      throw RuntimeError(file + " has no " + (buffer ? "buffer " : "parameter ") + prefix + name +
                         " (saved from another model?)");
    if (saved.sizes() != value.sizes() || saved.scalar_type() != value.scalar_type())
      throw RuntimeError(file + ": " + prefix + name + " is " + c10::toString(saved.scalar_type()) +
                         c10::str(saved.sizes()) + " there, " + c10::toString(value.scalar_type()) +
                         c10::str(value.sizes()) + " in the model");
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    expected.insert(child.key());
    torch::serialize::InputArchive nested;
    if (!archive.try_read(child.key(), nested))
      throw RuntimeError(file + " has no submodule " + prefix + child.key() + " (saved from another model?)");
    check_module_archive(*child.value(), nested, prefix + child.key() + ".", file);
  }
  for (const std::string& key : archive.keys())
    if (!expected.count(key))
      throw RuntimeError(file + " has " + prefix + key + ", which the model lacks (saved from another model?)");
}

// LibTorch's Optimizer::load restores the per-parameter state but not the
// groups' options (learning rate, momentum, ...), which Python's
// load_state_dict restores: a resumed run would silently go on with the
// learning rate it started with. They are in the same archive
// (param_groups/<i>/options, torch/optim/serialize.h's layout): read into a
// clone of each group's options, which has the optimizer's own options type.
inline void load_group_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive groups;
  archive.read("param_groups", groups);
  for (std::size_t i = 0; i < optimizer.param_groups().size(); ++i) {
    auto& group = optimizer.param_groups()[i];
    if (!group.has_options()) continue;
    torch::serialize::InputArchive saved_group, saved;
    groups.read("param_groups/" + std::to_string(i), saved_group);
    saved_group.read("options", saved);
    std::unique_ptr<torch::optim::OptimizerOptions> options = group.options().clone();
    options->serialize(saved);
    group.set_options(std::move(options));
  }
}

// An optimizer's state as bytes, to put it back if a load fails.
inline std::string optimizer_snapshot(torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return std::move(bytes).str();
}
inline void restore_optimizer(torch::optim::Optimizer& optimizer, const std::string& snapshot) {
  torch::serialize::InputArchive archive;
  archive.load_from(snapshot.data(), snapshot.size());
  optimizer.state().clear();  // load() only sets the entries it finds
  optimizer.load(archive);
  load_group_options(optimizer, archive);
}
}  // namespace detail

ACCEL_NAMESPACE_END
