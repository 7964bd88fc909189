// accel/training/io/safetensors.hpp: safetensors: Hugging Face's weight format, written and read.
//
// Hugging Face's weight format (huggingface.co/docs/safetensors), so that
// weights trained here load in Python and the reverse: an 8-byte
// little-endian header length, a JSON header {"__metadata__": {...},
// "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// ...} padded with spaces to a multiple of 8, then the tensors' bytes,
// little-endian and row-major, offsets counted from the end of the header.
// LibTorch reads and writes neither the format nor JSON in its public
// headers, so the few lines here are ours: a writer, and a reader
// (its JSON header through io/json.hpp), which checks everything it is given.
#pragma once

#include "accel/training/io/checked_file.hpp"
#include "accel/training/io/json.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
namespace fs = std::filesystem;

inline constexpr std::array<std::pair<at::ScalarType, std::string_view>, 10> safetensors_dtypes{{
    {at::kDouble, "F64"},
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
}};

// The header of a safetensors file of `tensors` (from their names, dtypes
// and shapes alone), with `metadata`'s (key, text) pairs in its
// "__metadata__" beside "format", padded with spaces to a multiple of 8.
inline std::string safetensors_header(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                      const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string header = R"({"__metadata__":{"format":"pt")";
  for (const auto& [key, text] : metadata) {  // (appended piece by piece: GCC 12's -Wrestrict misfires on "," + ...)
    header += ',';
    header += json_quote(key);
    header += ':';
    header += json_quote(text);
  }
  header += "}";
  uint64_t offset = 0;
  for (const auto& named : tensors) {  // (not a structured binding: clang 14 cannot capture one)
    const std::string& name = named.first;
    const at::Tensor& tensor = named.second;
    const auto dtype = std::find_if(safetensors_dtypes.begin(), safetensors_dtypes.end(),
                                    [&](const auto& d) { return d.first == tensor.scalar_type(); });
    if (dtype == safetensors_dtypes.end())
      throw InvalidArgument("accel: safetensors has no dtype for " + name + " (" + c10::toString(tensor.scalar_type()) +
                            ")");
    std::string shape;
    for (const int64_t d : tensor.sizes()) {
      if (!shape.empty()) shape += ',';  // (not "" or "," + to_string(d): GCC 12's -Wrestrict misfires on it)
      shape += std::to_string(d);
    }
    const uint64_t bytes = tensor.numel() * tensor.element_size();
    header += ',';  // (then the rest: GCC 12's -Wrestrict misfires on "," + ...)
    header += json_quote(name) + R"(:{"dtype":")" + std::string(dtype->second) + R"(","shape":[)" + shape +
              R"(],"data_offsets":[)" + std::to_string(offset) + ',' + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  return header;
}

// One safetensors file of the named tensors (CPU copies, contiguous), with
// `metadata` as above. Where `values` is given, values(i) gives tensor i's
// values as the file reaches it, in order (an export that gathers them one
// at a time); `tensors` then only gives names, dtypes and shapes.
inline FileDigest write_safetensors(const fs::path& path,
                                    const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                    const std::vector<std::pair<std::string, std::string>>& metadata = {},
                                    const std::function<at::Tensor(std::size_t)>& values = {}) {
  static_assert(std::endian::native == std::endian::little,
                "safetensors is little-endian; so is every host LibTorch runs on");
  const std::string header = safetensors_header(tensors, metadata);
  return write_file_atomically(path, [&](CheckedFile& out) {
    const uint64_t length = header.size();
    out.write(&length, 8);
    out.write(header);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor t = (values ? values(i) : tensors[i].second).detach().to(at::kCPU).contiguous();
      TORCH_INTERNAL_ASSERT(
          t.sizes() == tensors[i].second.sizes() && t.scalar_type() == tensors[i].second.scalar_type(),
          "write_safetensors: values of ", tensors[i].first, " unlike its header's");
      out.write(t.data_ptr(), t.numel() * t.element_size());
    }
  });
}

// A safetensors file's header, checked: each tensor's dtype, shape and
// byte range (inside the file, matching the size, no two overlapping), and
// the "__metadata__" texts. `data_start`: where the tensors' bytes begin.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // bytes, from data_start
};
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  int64_t data_start = 0;
};
inline SafetensorsHeader read_safetensors_header(std::istream& in, const fs::path& path) {
  const std::string where = path.string();
  const uint64_t file_size = fs::file_size(path);
  uint64_t length = 0;
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(&length), 8))
    throw RuntimeError(where + " is not a safetensors file (shorter than its 8-byte header length)");
  if (length > file_size - 8 || length > (uint64_t{100} << 20))
    throw RuntimeError(where + " is not a safetensors file (a header of " + std::to_string(length) +
                       " bytes in a file of " + std::to_string(file_size) + ")");
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  const Json doc = JsonReader(text, where).document();
  if (doc.kind != Json::Kind::Object) throw RuntimeError(where + ": the header is not a JSON object");
  const uint64_t data_size = file_size - 8 - length;
  SafetensorsHeader header;
  header.data_start = static_cast<int64_t>(8 + length);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (std::size_t field = 0; field < doc.keys.size(); ++field) {
    const std::string& name = doc.keys[field];
    const Json& entry = doc.values[field];
    if (name == "__metadata__") {
      if (entry.kind != Json::Kind::Object) throw RuntimeError(where + ": __metadata__ is not a JSON object");
      for (std::size_t k = 0; k < entry.keys.size(); ++k) {
        if (entry.values[k].kind != Json::Kind::String)
          throw RuntimeError(where + ": __metadata__'s " + entry.keys[k] + " is not a string");
        header.metadata[entry.keys[k]] = entry.values[k].text;
      }
      continue;
    }
    const std::string what = where + ": tensor " + name;
    const Json* dtype = entry.find("dtype");
    const Json* shape = entry.find("shape");
    const Json* offsets = entry.find("data_offsets");
    if (!dtype || !shape || !offsets || dtype->kind != Json::Kind::String || shape->kind != Json::Kind::Array ||
        offsets->kind != Json::Kind::Array || offsets->items.size() != 2)
      throw RuntimeError(what + " lacks dtype, shape or data_offsets");
    const auto known = std::find_if(safetensors_dtypes.begin(), safetensors_dtypes.end(),
                                    [&](const auto& d) { return d.second == dtype->text; });
    if (known == safetensors_dtypes.end())
      throw RuntimeError(what + " has dtype " + dtype->text + ", which accel.hpp does not read");
    SafetensorsEntry e{.name = name, .dtype = known->first, .shape = {}};
    int64_t numel = 1;
    for (const Json& d : shape->items) {
      e.shape.push_back(json_uint(d, what + "'s shape"));
      numel *= e.shape.back();
    }
    e.begin = json_uint(offsets->items[0], what + "'s data_offsets");
    e.end = json_uint(offsets->items[1], what + "'s data_offsets");
    const auto bytes = static_cast<int64_t>(numel * c10::elementSize(e.dtype));
    if (e.end < e.begin || static_cast<uint64_t>(e.end) > data_size || e.end - e.begin != bytes)
      throw RuntimeError(what + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                         ") do not hold its " + std::to_string(bytes) + " bytes within the file's " +
                         std::to_string(data_size));
    ranges.emplace_back(e.begin, e.end);
    header.entries.push_back(std::move(e));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) throw RuntimeError(where + ": two tensors' data overlap");
  return header;
}

// The tensors a safetensors file holds, checked as above, read whole.
inline std::vector<std::pair<std::string, at::Tensor>> read_safetensors(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RuntimeError("missing " + path.string());
  const SafetensorsHeader header = read_safetensors_header(in, path);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const SafetensorsEntry& e : header.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(header.data_start + e.begin));
    if (!in.read(static_cast<char*>(t.data_ptr()), e.end - e.begin))
      throw RuntimeError("cannot read " + path.string() + ": tensor " + e.name);
    out.emplace_back(e.name, std::move(t));
  }
  return out;
}

// What keeps a model's tensors (`expected`, state_dict's names, looked up
// as prefix + name) from fitting those a file holds (`held`: name -> dtype
// and shape, only names that are the model's to consider): "" when they
// fit, else " missing a, b. not in the model: c. w is Float[16, 4] there,
// Float[8, 4] in the model." (load_model and sharded checkpoints).
inline std::string misfit(const std::vector<std::pair<std::string, at::Tensor>>& expected,
                          const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>>& held,
                          const std::string& prefix = "") {
  std::string missing, wrong, unexpected;
  std::set<std::string> names;
  for (const auto& [unprefixed, tensor] : expected) {
    const std::string name = prefix + unprefixed;
    names.insert(name);
    const auto found = held.find(name);
    if (found == held.end()) missing += (missing.empty() ? "" : ", ") + name;
    else if (found->second.first != tensor.scalar_type() || found->second.second != tensor.sizes().vec())
      wrong += (wrong.empty() ? "" : "; ") + name + " is " + c10::toString(found->second.first) +
               c10::str(at::IntArrayRef(found->second.second)) + " there, " + c10::toString(tensor.scalar_type()) +
               c10::str(tensor.sizes()) + " in the model";
  }
  for (const auto& entry : held)
    if (!names.count(entry.first)) unexpected += (unexpected.empty() ? "" : ", ") + entry.first;
  return (missing.empty() ? "" : " missing " + missing + ".") +
         (unexpected.empty() ? "" : " not in the model: " + unexpected + ".") +
         (wrong.empty() ? "" : " " + wrong + ".");
}

// A model's state_dict as Python makes it: dotted names, in its order (each
// module's parameters, then its buffers, then its children's).
inline std::vector<std::pair<std::string, at::Tensor>> state_dict(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& m : module.named_modules()) {
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) out.emplace_back(prefix + p.key(), p.value());
    for (const auto& b : m.value()->named_buffers(/*recurse=*/false)) out.emplace_back(prefix + b.key(), b.value());
  }
  return out;
}
}  // namespace detail

ACCEL_NAMESPACE_END
