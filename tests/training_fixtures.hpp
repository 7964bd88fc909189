// What the training test files share: the models, datasets and checks they
// use, after test_helpers.hpp with the training helpers (ACCEL_TRAINING).
// Precompiled for them (tests/CMakeLists.txt): <torch/torch.h> is parsed
// once, not once per file.
#pragma once

#include "counting_allocator.hpp"
#include "test_helpers.hpp"

#include "gpt_model.hpp"  // (Gpt: after accel, which it needs)

#include <random>
#include <sys/wait.h>
#include <unistd.h>

namespace training_fixtures {
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t layers, int64_t out = 1) {
    int64_t width = in;
    for (int64_t i = 0; i < layers; ++i) {
      body->push_back(torch::nn::Linear(width, hidden));
      body->push_back(torch::nn::Tanh());
      width = hidden;
    }
    body->push_back(torch::nn::Linear(width, out));
    register_module("body", body);
  }
  // Each Linear through unit_forward: a unit of its own under FULL_SHARD, a plain call otherwise.
  at::Tensor forward(const at::Tensor& x) { return accel::unit_forward(body, x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(Mlp);

// A layer whose weight may be another's (tied weights).
struct TiedImpl : torch::nn::Module {
  explicit TiedImpl(const at::Tensor& weight) { w = register_parameter("w", weight); }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(w); }
  at::Tensor w;
};

// Gpt's weights as Hugging Face's GPT2LMHeadModel stores them: Conv1D's
// weights [in, out] (the transpose of a Linear's), the tied head left out
// (from_pretrained ties it again); and back, leaving out the causal-mask
// buffers older files hold (attn.bias, attn.masked_bias).
inline bool gpt2_conv1d(const std::string& name) {
  for (const char* conv : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"})
    if (name.ends_with(conv)) return true;
  return false;
}
inline accel::StateDictAdapter gpt2_adapter(bool tied) {
  accel::StateDictAdapter adapter;
  adapter.to_file = [tied](const std::string& name, const at::Tensor& v) -> std::optional<accel::NamedTensor> {
    if (tied && name == "lm_head.weight") return std::nullopt;
    return accel::NamedTensor(name, gpt2_conv1d(name) ? v.t() : v);
  };
  adapter.from_file = [](const std::string& name, const at::Tensor& v) -> std::optional<accel::NamedTensor> {
    if (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")) return std::nullopt;
    return accel::NamedTensor(name, gpt2_conv1d(name) ? v.t() : v);
  };
  return adapter;
}
// The same weights in a fresh Gpt (for the one-process reference).
inline Gpt copy_of(Gpt& source) {
  Gpt copy(source->options);
  torch::NoGradGuard no_grad;
  auto to = copy->named_parameters();
  for (const auto& p : source->named_parameters()) to[p.key()].copy_(p.value());
  return copy;
}

inline at::Tensor flat_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return at::cat(parts);
}

// A single-process model with the same weights as `source`.
inline Mlp copy_of(Mlp& source, int64_t in, int64_t hidden, int64_t layers, int64_t out = 1) {
  Mlp copy(in, hidden, layers, out);
  torch::NoGradGuard no_grad;
  auto to = copy->parameters();
  auto from = source->parameters();
  for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
  return copy;
}

// The names of the entries of a directory, sorted.
inline std::vector<std::string> sorted_names(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A module's parameters, each once (LibTorch's parameters() lists a tensor
// registered under two names twice; Python's removes the repeats).
inline std::vector<at::Tensor> unique_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : m.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

// Every rank's parameters are bit-identical to rank 0's.
inline bool identical_across_ranks(torch::nn::Module& m, const accel::GroupPtr& group) {
  at::Tensor all = accel::all_gather(flat_parameters(m), group);
  for (int64_t i = 1; i < all.size(0); ++i)
    if (!at::equal(all[i], all[0])) return false;
  return true;
}

inline accel::AcceleratorConfig config(int accumulation = 1) {
  accel::AcceleratorConfig c;
  c.gradient_accumulation_steps = accumulation;
  c.distributed = test_config();
  return c;
}

// A fixed regression set, the same on every rank.
inline std::pair<at::Tensor, at::Tensor> dataset(int64_t n, int64_t in) {
  auto generator = at::detail::createCPUGenerator(7);
  at::Tensor x = at::randn({n, in}, generator);
  return {x, x.sum(1, true).sin() + 0.1 * at::randn({n, 1}, generator)};
}
// Sample i is the tensor [i] (data) with target i.
// `reads` counts the samples read (shared by the copies a loader makes);
// reading sample `fail_at` throws.
struct Indexed : torch::data::datasets::Dataset<Indexed> {
  explicit Indexed(std::size_t n, std::size_t fail_at = SIZE_MAX) : n(n), fail_at(fail_at) {}
  torch::data::Example<> get(std::size_t i) override {
    if (i == fail_at) throw std::runtime_error("sample " + std::to_string(i) + " is unreadable");
    ++*reads;
    const auto value = static_cast<int64_t>(i);
    return {at::full({1}, value, at::kLong), at::full({}, value, at::kLong)};
  }
  torch::optional<std::size_t> size() const override { return n; }
  std::size_t n, fail_at;
  std::shared_ptr<std::size_t> reads = std::make_shared<std::size_t>(0);
};

// Accelerate's RegressionDataset: y = 2x + 3 + noise, the same on every rank.
struct Regression : torch::data::datasets::Dataset<Regression> {
  explicit Regression(int64_t n) {
    auto generator = at::detail::createCPUGenerator(42);
    x = at::randn({n, 1}, generator);
    y = 2 * x + 3 + 0.1 * at::randn({n, 1}, generator);
  }
  torch::data::Example<> get(std::size_t i) override {
    const auto k = static_cast<int64_t>(i);
    return {x[k], y[k]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(x.size(0)); }
  at::Tensor x, y;
};

// An iterable dataset (a LibTorch StatefulDataset): the numbers 0..n-1,
// handed out in chunks of 1-3 elements whatever was asked (streams do that).
struct Stream : torch::data::datasets::StatefulDataset<Stream, std::vector<int64_t>> {
  explicit Stream(int64_t n) : n(n) {}
  torch::optional<std::vector<int64_t>> get_batch(std::size_t wanted) override {
    if (next >= n) return torch::nullopt;
    std::vector<int64_t> out;
    const int64_t chunk = std::min<int64_t>({static_cast<int64_t>(wanted), next % 3 + 1, n - next});
    for (int64_t i = 0; i < chunk; ++i) out.push_back(next++);
    *reads += static_cast<std::size_t>(chunk);
    return out;
  }
  torch::optional<std::size_t> size() const override { return torch::nullopt; }
  void reset() override { next = 0; }
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}
  int64_t n, next = 0;
  std::shared_ptr<std::size_t> reads = std::make_shared<std::size_t>(0);  // elements handed out
};

// A fresh directory name under the temp directory, the same on every rank.
inline std::filesystem::path shared_temp_path(accel::Accelerator& accelerator, const std::string& stem) {
  std::vector<std::string> where{accelerator.is_main_process()
                                     ? (std::filesystem::temp_directory_path() / (stem + std::to_string(getpid())))
                                           .string()
                                     : ""};
  accel::broadcast_object_list(where);
  return where[0];
}

// The momentum buffers of an SGD optimizer, as sorted sums (the state map's
// order is not fixed).
inline std::vector<double> momentum_sums(torch::optim::Optimizer& optimizer) {
  std::vector<double> sums;
  for (const auto& entry : optimizer.state())
    sums.push_back(
        static_cast<torch::optim::SGDParamState&>(*entry.second).momentum_buffer().sum().item<double>());
  std::sort(sums.begin(), sums.end());
  return sums;
}

// A step counter of the user's, for register_for_checkpointing.
struct Counter {
  int64_t value = 0;
  void save(torch::serialize::OutputArchive& archive) const { archive.write("value", at::tensor(value)); }
  void load(torch::serialize::InputArchive& archive) {
    at::Tensor t;
    archive.read("value", t);
    value = t.item<int64_t>();
  }
};

// The first element of each batch of one pass over a map-style loader
// (Indexed: sample i is [i]), from the `from`-th batch on.
template <class Loader>
inline std::vector<int64_t> pass_firsts(Loader& loader) {
  std::vector<int64_t> firsts;
  for (auto& batch : loader) firsts.push_back(batch.data[0][0].template item<int64_t>());
  return firsts;
}

// Net: a Linear, a BatchNorm (buffers, one of them int64), a Tanh and a
// Linear; tests/python_ref/safetensors_check.py builds the same in Python.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : body(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8), torch::nn::Tanh(), torch::nn::Linear(8, 1)) {
    register_module("body", body);
  }
  at::Tensor forward(const at::Tensor& x) { return body->forward(x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(Net);

// A Net with running statistics that matter, from `seed`.
inline Net seeded_net(uint64_t seed) {
  torch::manual_seed(seed);
  Net net;
  torch::NoGradGuard no_grad;
  auto& bn = *net->body->ptr(1)->as<torch::nn::BatchNorm1d>();
  bn.running_mean.uniform_(-1, 1);
  bn.running_var.uniform_(0.5, 2);
  bn.num_batches_tracked.fill_(static_cast<int64_t>(seed));
  net->eval();
  return net;
}

// Every parameter and buffer equal, by name.
inline bool same_state(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  auto ba = a.named_buffers(), bb = b.named_buffers();
  if (pa.size() != pb.size() || ba.size() != bb.size()) return false;
  for (const auto& p : pa)
    if (!pb.contains(p.key()) || !at::equal(p.value(), pb[p.key()])) return false;
  for (const auto& x : ba)
    if (!bb.contains(x.key()) || !at::equal(x.value(), bb[x.key()])) return false;
  return true;
}

// What `script` prints (stdout and stderr) under the leg's own Python
// (ACCEL_TEST_PYTHON, else Debian's python3), for live comparisons with torch;
// a failing script fails the test case, showing its output.
inline std::string python_output(const char* script, const std::string& stem) {
  const auto path = std::filesystem::temp_directory_path() / ("accel_" + stem + "_" + std::to_string(getpid()) + ".py");
  std::ofstream(path) << script;
  const std::string python_exe = accel::detail::getenv_str("ACCEL_TEST_PYTHON").value_or("/usr/bin/python3");
  FILE* pipe = popen((python_exe + " " + path.string() + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::string out;
  char buffer[4096];
  while (std::size_t got = fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, got);
  const int status = pclose(pipe);
  std::filesystem::remove(path);
  INFO(out);
  REQUIRE(status == 0);
  return out;
}

inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// One parameter "w", for the format's bytes.
struct OneImpl : torch::nn::Module {
  explicit OneImpl(at::Tensor value) { w = register_parameter("w", std::move(value)); }
  at::Tensor w;
};
TORCH_MODULE(One);

// Gradients of two models agree (allclose), parameter by parameter.
inline bool same_grads(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (!at::allclose(pa[i].grad(), pb[i].grad())) return false;
  return true;
}

// A model on a prepared accelerator and its single-process twin, as
// Accelerate's test_sync.py get_training_setup: the twin trains on the
// batch gathered from every process.
struct Twins {
  explicit Twins(accel::Accelerator& accelerator) {
    torch::manual_seed(42);
    model = Mlp(1, 8, 1);
    reference = copy_of(model, 1, 8, 1);
    accelerator.prepare(model);
  }
  Mlp model{nullptr}, reference{nullptr};
};

// One pass over a prepared loader: every batch's data as gather_for_metrics
// returns it, concatenated; and the number of batches this rank saw.
template <class Loader>
inline std::pair<at::Tensor, int64_t> gathered_pass(accel::Accelerator& accelerator, Loader& loader) {
  std::vector<at::Tensor> parts;
  int64_t batches = 0;
  for (auto& batch : loader) {
    parts.push_back(accelerator.gather_for_metrics(batch.data).reshape({-1}));
    ++batches;
  }
  return {parts.empty() ? at::empty({0}, at::kLong) : at::cat(parts), batches};
}
}  // namespace training_fixtures
using namespace training_fixtures;
