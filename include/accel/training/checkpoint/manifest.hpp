// accel/training/checkpoint/manifest.hpp: a checkpoint's manifest (every file with its size and XXH64, the checkpoint's id) and the checks a load makes against it.
//
// The manifest, accel_checkpoint.txt, is written last: its presence (whole:
// it ends with "end") marks a checkpoint complete. It carries a serial, one
// more than the checkpoint it replaces, the checkpoint's id (random, its
// own: every piece file carries it too), and every other file of the
// checkpoint with its size and XXH64 hash (io/file_digest.hpp), which a
// load checks for each file it reads before anything changes
// (CheckpointFiles): a damaged file, one cut short, one of another
// checkpoint or one the manifest does not list is refused, naming it. The
// manifest ends with a hash of its own lines. A manifest of the first
// format (before digests) is read, its files unchecked.
#pragma once

#include "accel/training/io/checked_file.hpp"
#include "accel/training/io/file_digest.hpp"
#include "accel/training/checkpoint/file_names.hpp"

#include <future>
#include <random>

ACCEL_NAMESPACE_BEGIN

namespace detail {
namespace fs = std::filesystem;

inline constexpr const char* checkpoint_format = "accel.hpp checkpoint 2";
inline constexpr const char* checkpoint_format_1 = "accel.hpp checkpoint 1";  // (no id, no digests)

// The files one process wrote into a checkpoint, by name, with their digests.
using FileLog = std::vector<std::pair<std::string, FileDigest>>;

struct CheckpointManifest {
  int format = 2;
  int64_t serial = 0;
  int64_t processes = 0;
  int64_t models = 0;
  int64_t optimizers = 0;
  int64_t loaders = 0;
  int64_t objects = 0;
  int64_t schedulers = 0;
  int64_t shards = 1;  // the ways optimizer state is sharded (one file per process when more than 1)
  int64_t tp = 1;      // the tensor-parallel size (one optimizer file per process when more than 1)
  int64_t pp = 1;      // the pipeline-parallel size (each process saved its stages, in pieces, when more than 1)
  std::string id{};    // 32 hexadecimal digits, this save's own
  std::map<std::string, FileDigest> files{};  // every file of the checkpoint but the manifest
};

// The manifest's text: its lines, then `check` with the XXH64 of all the
// bytes before that line, then `end`.
inline std::string manifest_text(const CheckpointManifest& m) {
  std::ostringstream out;
  out << checkpoint_format << "\nserial " << m.serial << "\nprocesses " << m.processes << "\nmodels " << m.models
      << "\noptimizers " << m.optimizers << "\nloaders " << m.loaders << "\nobjects " << m.objects << "\nschedulers "
      << m.schedulers << "\nshards " << m.shards << "\n";
  if (m.tp > 1) out << "tp " << m.tp << "\n";  // (absent at 1: the manifests of runs without tp stay as they were)
  if (m.pp > 1) out << "pp " << m.pp << "\n";  // (likewise)
  out << "id " << m.id << "\n";
  for (const auto& [name, digest] : m.files)
    out << "file " << name << ' ' << digest.bytes << ' ' << hex64(digest.xxh64) << '\n';
  std::string text = std::move(out).str();
  return text + "check " + hex64(xxh64(text.data(), text.size())) + "\nend\n";
}

// A complete manifest, or none (missing, cut short, or its own hash wrong).
inline std::optional<CheckpointManifest> read_manifest(const fs::path& dir) {
  std::ifstream file(dir / file_names::manifest, std::ios::binary);
  if (!file) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::istringstream in(text);
  std::string line;
  CheckpointManifest m;
  if (!std::getline(in, line)) return std::nullopt;
  if (line == checkpoint_format_1) m.format = 1;
  else if (line != checkpoint_format) return std::nullopt;
  bool checked = false;
  std::string key;
  while (in >> key) {
    if (key == "end") return m.format == 1 || checked ? std::optional(m) : std::nullopt;
    if (key == "check") {
      const auto at = static_cast<std::size_t>(in.tellg()) - key.size();
      std::string hash;
      in >> hash;
      checked = from_hex64(hash) == xxh64(text.data(), at);
      if (!checked) return std::nullopt;
      continue;
    }
    if (key == "id") {
      in >> m.id;
      continue;
    }
    if (key == "file") {
      std::string name, hash;
      FileDigest digest;
      if (!(in >> name >> digest.bytes >> hash) || !from_hex64(hash)) return std::nullopt;
      digest.xxh64 = *from_hex64(hash);
      m.files[name] = digest;
      continue;
    }
    int64_t value = 0;
    if (!(in >> value)) return std::nullopt;
    if (key == "serial") m.serial = value;
    else if (key == "processes") m.processes = value;
    else if (key == "models") m.models = value;
    else if (key == "optimizers") m.optimizers = value;
    else if (key == "loaders") m.loaders = value;
    else if (key == "objects") m.objects = value;
    else if (key == "schedulers") m.schedulers = value;
    else if (key == "shards") m.shards = value;
    else if (key == "tp") m.tp = value;
    else if (key == "pp") m.pp = value;  // other keys: a newer writer's, ignored
  }
  return std::nullopt;  // cut short
}

inline void write_manifest(const fs::path& dir, const CheckpointManifest& m) {
  write_file_atomically(dir / file_names::manifest, [&](CheckedFile& file) { file.write(manifest_text(m)); });
}

// A new checkpoint's id: 128 random bits, as hexadecimal digits.
inline std::string new_checkpoint_id() {
  std::random_device random;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    char part[9];
    std::snprintf(part, sizeof part, "%08x", static_cast<unsigned>(random()));
    id += part;
  }
  return id;
}

// A checkpoint's files as a load reads them, each checked against the
// manifest's record (size and XXH64): check(name) refuses at once a file
// that is missing or not listed, and starts reading and hashing it on a
// thread of its own (one file at a time, in order), beside the caller's own
// reading of it (both from the page cache: with a core to spare, the check
// costs nothing); wait() returns once every check begun is done, throwing
// the first that failed, naming the file. The load applies nothing before
// wait() (read_checkpoint), and a check's error comes before any other (a
// damaged file's parse may fail first). Only the files a process reads are
// checked by it; every file is read by some process, and load_state fails
// on every process when one refuses. A manifest of the first format has no
// records: its files are read unchecked.
class CheckpointFiles {
 public:
  CheckpointFiles(fs::path dir, CheckpointManifest manifest) : dir_(std::move(dir)), manifest_(std::move(manifest)) {}
  CheckpointFiles(const CheckpointFiles&) = delete;
  CheckpointFiles& operator=(const CheckpointFiles&) = delete;
  ~CheckpointFiles() { wait_quietly(); }

  // The file's path; its check begun.
  fs::path check(const std::string& name) {
    const fs::path path = dir_ / name;
    if (!fs::exists(path)) throw RuntimeError("missing " + path.string());
    if (manifest_.format < 2 || !file_digests_on() || !begun_.insert(name).second) return path;
    const auto recorded = manifest_.files.find(name);
    if (recorded == manifest_.files.end())
      throw RuntimeError(path.string() + " is not one of this checkpoint's files (" +
                         (dir_ / file_names::manifest).string() + " does not list it)");
    std::shared_future<void> before = checks_.empty() ? std::shared_future<void>() : checks_.back();
    checks_.push_back(std::async(std::launch::async, [path, expected = recorded->second, before] {
                        if (before.valid()) before.wait();  // (one at a time)
                        const FileDigest found = digest_of_file(path);
                        if (found != expected)
                          throw RuntimeError(path.string() + " is damaged or is not this checkpoint's: " +
                                             std::to_string(found.bytes) + " bytes of XXH64 " + hex64(found.xxh64) +
                                             ", where the checkpoint recorded " + std::to_string(expected.bytes) +
                                             " bytes of " + hex64(expected.xxh64));
                      }).share());
    return path;
  }
  // Every check begun, done; the first that failed, thrown.
  void wait() {
    wait_quietly();
    for (const auto& check : checks_) check.get();
  }
  // Whether the manifest records the files (and an id), so that they are checked.
  bool recorded() const { return manifest_.format >= 2; }
  const std::string& id() const { return manifest_.id; }
  // The listed files whose names end with `suffix`, in order.
  std::vector<fs::path> listed(std::string_view suffix) const {
    std::vector<fs::path> out;
    for (const auto& entry : manifest_.files)
      if (entry.first.ends_with(suffix)) out.push_back(dir_ / entry.first);
    return out;
  }

 private:
  void wait_quietly() const noexcept {
    for (const auto& check : checks_) check.wait();
  }

  fs::path dir_;
  CheckpointManifest manifest_;
  std::set<std::string> begun_;
  std::vector<std::shared_future<void>> checks_;
};

}  // namespace detail

ACCEL_NAMESPACE_END
