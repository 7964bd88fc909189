// The training helpers (Accelerator, DataParallel, prepared data loaders): the
// only test translation unit that includes <torch/torch.h> (ACCEL_TRAINING).

#define ACCEL_TRAINING
#include "counting_allocator.hpp"
#include "test_helpers.hpp"

#include <random>
#include <sys/wait.h>
#include <unistd.h>

namespace {
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

at::Tensor flat_parameters(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape({-1}));
  return at::cat(parts);
}

// A single-process model with the same weights as `source`.
Mlp copy_of(Mlp& source, int64_t in, int64_t hidden, int64_t layers) {
  Mlp copy(in, hidden, layers);
  torch::NoGradGuard no_grad;
  auto to = copy->parameters();
  auto from = source->parameters();
  for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
  return copy;
}

// The names of the entries of a directory, sorted.
std::vector<std::string> sorted_names(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Every rank's parameters are bit-identical to rank 0's.
bool identical_across_ranks(torch::nn::Module& m, const accel::GroupPtr& group) {
  at::Tensor all = accel::all_gather(flat_parameters(m), group);
  for (int64_t i = 1; i < all.size(0); ++i)
    if (!at::equal(all[i], all[0])) return false;
  return true;
}

accel::AcceleratorConfig config(int accumulation = 1) {
  accel::AcceleratorConfig c;
  c.gradient_accumulation_steps = accumulation;
  c.distributed = test_config();
  return c;
}

// A fixed regression set, the same on every rank.
std::pair<at::Tensor, at::Tensor> dataset(int64_t n, int64_t in) {
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
std::filesystem::path shared_temp_path(accel::Accelerator& accelerator, const std::string& stem) {
  std::vector<std::string> where{accelerator.is_main_process()
                                     ? (std::filesystem::temp_directory_path() / (stem + std::to_string(getpid())))
                                           .string()
                                     : ""};
  accel::broadcast_object_list(where);
  return where[0];
}

// The momentum buffers of an SGD optimizer, as sorted sums (the state map's
// order is not fixed).
std::vector<double> momentum_sums(torch::optim::Optimizer& optimizer) {
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
std::vector<int64_t> pass_firsts(Loader& loader) {
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
Net seeded_net(uint64_t seed) {
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
bool same_state(torch::nn::Module& a, torch::nn::Module& b) {
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
std::string python_output(const char* script, const std::string& stem) {
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

std::string file_bytes(const std::filesystem::path& path) {
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
bool same_grads(torch::nn::Module& a, torch::nn::Module& b) {
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
std::pair<at::Tensor, int64_t> gathered_pass(accel::Accelerator& accelerator, Loader& loader) {
  std::vector<at::Tensor> parts;
  int64_t batches = 0;
  for (auto& batch : loader) {
    parts.push_back(accelerator.gather_for_metrics(batch.data).reshape({-1}));
    ++batches;
  }
  return {parts.empty() ? at::empty({0}, at::kLong) : at::cat(parts), batches};
}
}  // namespace

TEST_SUITE("ranks") {
  TEST_CASE("data: a prepared loader's pass, gathered for metrics, holds every sample exactly once") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes();
    REQUIRE(P >= 1);
    for (std::size_t n : {std::size_t(1), std::size_t(2 * P + 1), std::size_t(16)}) {
      for (bool shuffle : {false, true}) {
        CAPTURE(n);
        CAPTURE(shuffle);
        auto loader = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()),
                                                      {.batch_size = 2, .shuffle = shuffle, .seed = 5});
        auto [first, batches] = gathered_pass(accelerator, loader);
        CHECK(at::equal(std::get<0>(first.sort()), at::arange(static_cast<int64_t>(n), at::kLong)));
        CHECK_FALSE(accelerator.end_of_dataloader());  // the pass is over
        // even_batches: every rank saw the same number of batches
        at::Tensor counts = accelerator.gather_for_metrics(at::full({1}, batches, at::kLong));
        CHECK(counts.min().item<int64_t>() == counts.max().item<int64_t>());
        CHECK(batches == static_cast<int64_t>(loader.batches()));
        auto [second, unused] = gathered_pass(accelerator, loader);  // epoch 1
        CHECK(loader.epoch() == 1);
        CHECK(at::equal(std::get<0>(second.sort()), at::arange(static_cast<int64_t>(n), at::kLong)));
        if (n == 16) CHECK(at::equal(first, second) == !shuffle);  // a new shuffle each epoch
      }
    }
  }

  TEST_CASE("data: split_batches divides the global batch; the last batch of a pass always syncs gradients") {
    auto split = config();
    split.split_batches = true;
    split.gradient_accumulation_steps = 100;
    accel::Accelerator accelerator(split);
    const int P = accelerator.num_processes();
    Mlp model(1, 4, 1);
    accelerator.prepare(model);
    auto loader = accelerator.prepare_data_loader(Indexed(6 * P).map(torch::data::transforms::Stack<>()),
                                                  {.batch_size = static_cast<std::size_t>(2 * P)});
    std::vector<bool> syncs;
    for (auto& batch : loader) {
      CHECK(batch.data.size(0) == 2);
      auto guard = accelerator.accumulate(model);
      syncs.push_back(accelerator.sync_gradients());
    }
    CHECK(syncs == std::vector<bool>{false, false, true});
    if (P > 1)
      CHECK_THROWS_WITH_AS(accelerator.prepare_data_loader(Indexed(8), {.batch_size = static_cast<std::size_t>(P + 1)}),
                           doctest::Contains("must be a multiple of the"), std::invalid_argument);
  }

  TEST_CASE("training: data-parallel steps equal single-process full-batch steps, bit-identical on every rank") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    torch::manual_seed(100 + r);  // every rank starts different: prepare broadcasts rank 0's weights
    Mlp model(4, 16, 2);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    accelerator.prepare(model, optimizer);
    const accel::GroupPtr group = accelerator.data_parallel()->distributed() ? accelerator.data_parallel()->group()
                                                                              : accel::GroupPtr();
    if (group) CHECK(identical_across_ranks(*model, group));
    Mlp reference = copy_of(model, 4, 16, 2);
    torch::optim::SGD reference_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const auto [x, y] = dataset(24, 4);
    const int64_t n = 24 / P;
    for (int step = 0; step < 6; ++step) {
      CAPTURE(step);
      optimizer.zero_grad();
      accelerator.backward(torch::mse_loss(model(x.narrow(0, r * n, n)), y.narrow(0, r * n, n)));
      optimizer.step();
      reference_optimizer.zero_grad();
      torch::mse_loss(reference(x), y).backward();
      reference_optimizer.step();
      CHECK(at::allclose(flat_parameters(*model), flat_parameters(*reference), 1e-5, 1e-6));
      if (group) CHECK(identical_across_ranks(*model, group));
    }
    // The clipped norm is the global one: the same on every rank.
    const double norm = accelerator.clip_grad_norm_(model->parameters(), 1e9);
    const auto norms = accel::all_gather(norm);
    CHECK(std::all_of(norms.begin(), norms.end(), [&](double v) { return v == norm; }));
    CHECK(accelerator.distributed_type() == (P > 1 ? accel::DistributedType::MULTI_CPU : accel::DistributedType::NO));
  }

  TEST_CASE("training: DataParallel averages bfloat16 gradients on Gloo too (reduced in float32)") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    torch::manual_seed(7);
    torch::nn::Linear layer(3, 2);
    layer->to(at::kBFloat16);
    accel::DataParallel dp(layer.ptr(), P > 1 ? d.world_group() : accel::GroupPtr(), 1 << 20);
    dp.sync_module_states();
    dp.prepare_for_backward();
    layer((at::arange(3, at::kFloat) + r).to(at::kBFloat16).unsqueeze(0)).sum().backward();
    CHECK((dp.finish() == (P > 1)));
    // d sum(W x + b) / dW = [x; x], averaged over the ranks' x = (0, 1, 2) + r.
    const at::Tensor mean_x = at::arange(3, at::kFloat) + (P - 1) / 2.0f;
    CHECK((layer->weight.grad().scalar_type() == at::kBFloat16));
    CHECK(at::allclose(layer->weight.grad().to(at::kFloat), mean_x.unsqueeze(0).repeat({2, 1}), 0, 1e-2));
    CHECK(at::equal(layer->bias.grad().to(at::kFloat), at::ones({2})));
  }

  // DDP's communication hooks: fp16 / bf16 compression gives exactly an explicit cast, divide, all-reduce and cast
  // back of the same flat bucket (torch's fp16_compress_hook / bf16_compress_hook); a custom hook sees every bucket;
  // a hook is registered once, never under sharding, and must return the whole bucket.
  TEST_CASE("training: communication hooks reduce each bucket as the explicit reference does") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    if (P == 1) return;
    for (const auto type : {accel::DDPCommunicationHookType::FP16, accel::DDPCommunicationHookType::BF16}) {
      const bool fp16 = type == accel::DDPCommunicationHookType::FP16;
      CAPTURE(fp16);
      accel::AcceleratorConfig c = config();
      c.comm_hook = type;
      accel::Accelerator accelerator(c);
      torch::manual_seed(3);
      Mlp model(5, 33, 2);
      accelerator.prepare(model);
      Mlp local = copy_of(model, 5, 33, 2);
      accel::DataParallel& dp = *accelerator.data_parallel(model);
      REQUIRE(dp.bucket_count() == 1);
      auto generator = at::detail::createCPUGenerator(20 + r);  // each rank its own batch
      const at::Tensor x = at::randn({4, 5}, generator), y = at::randn({4, 1}, generator);
      accelerator.backward(torch::mse_loss(model(x), y));
      torch::mse_loss(local(x), y).backward();
      // The bucket: this rank's gradients in reverse parameter order, then one used-flag per parameter.
      std::vector<at::Tensor> parts;
      const auto params = local->parameters();
      for (auto it = params.rbegin(); it != params.rend(); ++it) parts.push_back(it->grad().reshape({-1}));
      parts.push_back(at::ones({static_cast<int64_t>(params.size())}));
      const at::Tensor bucket = at::cat(parts);
      const at::Tensor reference =
          accel::all_reduce(bucket.to(fp16 ? at::kHalf : at::kBFloat16).div_(P), accel::ReduceOp::SUM, dp.group())
              .to(at::kFloat);
      const at::Tensor exact = accel::all_reduce(bucket / P, accel::ReduceOp::SUM, dp.group());
      const auto hooked = model->parameters();
      std::vector<at::Tensor> got;
      for (auto it = hooked.rbegin(); it != hooked.rend(); ++it) got.push_back(it->grad().reshape({-1}));
      const at::Tensor all = at::cat(got);
      CHECK(at::equal(all, reference.narrow(0, 0, all.numel())));
      const double error = (all - exact.narrow(0, 0, all.numel())).abs().max().item<double>();
      MESSAGE(std::string(fp16 ? "fp16" : "bf16") << "_compress_hook at " << P
                                                  << " processes: largest difference to the float32 average " << error);
      CHECK(error > 0);  // compression did happen
      CHECK(error < (fp16 ? 1e-2 : 5e-2));
    }
    {  // a custom hook: called once per bucket, in order, the last marked; its result is used
      accel::AcceleratorConfig c = config();
      c.bucket_cap_mb = 1;
      accel::Accelerator accelerator(c);
      torch::nn::Sequential model(torch::nn::Linear(8, 600), torch::nn::Linear(600, 600));  // two buckets (1 MiB first)
      accelerator.prepare(model);
      accel::DataParallel& dp = *accelerator.data_parallel(model);
      REQUIRE(dp.bucket_count() == 2);
      std::vector<std::pair<std::size_t, bool>> calls;
      dp.register_comm_hook([&calls](const accel::GroupPtr& group, accel::GradBucket& bucket) {
        calls.emplace_back(bucket.index, bucket.is_last);
        return accel::all_reduce_async(bucket.buffer.mul(2.0 / group->getSize()), accel::ReduceOp::SUM, group);
      });
      CHECK_THROWS_AS(dp.register_comm_hook(accel::comm_hooks::allreduce_hook()), accel::LogicError);
      const at::Tensor x = at::full({1, 8}, static_cast<float>(r + 1));
      accelerator.backward(model->forward(x).sum());
      CHECK(calls == std::vector<std::pair<std::size_t, bool>>{{0, false}, {1, true}});
      // d(sum)/d(bias of the last layer) = 1 on every rank: averaged and doubled by the hook, 2
      CHECK(at::equal(model[1]->as<torch::nn::Linear>()->bias.grad(), at::full({600}, 2.0f)));
    }
    {  // a hook that returns part of the bucket: a named error
      torch::nn::Linear layer(3, 2);
      accel::DataParallel dp(layer.ptr(), d.world_group(), 1 << 20);
      dp.register_comm_hook([](const accel::GroupPtr& group, accel::GradBucket& bucket) {
        return accel::all_reduce_async(bucket.buffer.narrow(0, 0, 1).clone(), accel::ReduceOp::SUM, group);
      });
      dp.prepare_for_backward();
      layer(at::ones({1, 3})).sum().backward();
      CHECK_THROWS_WITH_AS(dp.finish(), doctest::Contains("the communication hook returned 1 elements for bucket 0"),
                           accel::RuntimeError);
    }
    accel::AcceleratorConfig c = config();
    c.comm_hook = accel::DDPCommunicationHookType::FP16;
    c.sharding_strategy = accel::ShardingStrategy::SHARD_GRAD_OP;
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("comm_hook is about the all-reduce of NO_SHARD"),
                         accel::InvalidArgument);
  }

  // torch's powerSGD_hook: one step against the algorithm written out (rank-2 compression of a 12 x 16 weight,
  // the bias all-reduced plainly, error feedback remembered), and the plain all-reduces before start_powerSGD_iter.
  TEST_CASE("training: the PowerSGD hook equals the reference computation for one step") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    if (P == 1) return;
    auto orthogonalize = [](at::Tensor m) {  // Gram-Schmidt over the columns, as torch 1.13's _orthogonalize
      for (int64_t i = 0; i < m.size(1); ++i) {
        at::Tensor c = m.narrow(1, i, 1);
        c.div_(c.norm());
        if (i + 1 < m.size(1)) {
          at::Tensor rest = m.narrow(1, i + 1, m.size(1) - i - 1);
          rest.sub_((c * rest).sum(0) * c);
        }
      }
      return m;
    };
    for (const int64_t start : {0, 1}) {
      CAPTURE(start);
      torch::manual_seed(9);
      torch::nn::Linear layer(16, 12), local(16, 12);
      auto state = std::make_shared<accel::PowerSGDState>();
      state->matrix_approximation_rank = 2;
      state->start_powerSGD_iter = start;
      state->random_seed = 5;
      accel::DataParallel dp(layer.ptr(), d.world_group(), 1 << 20);
      dp.register_comm_hook(accel::comm_hooks::powerSGD_hook(state));
      {
        torch::NoGradGuard no_grad;
        local->weight.copy_(layer->weight);
        local->bias.copy_(layer->bias);
      }
      auto generator = at::detail::createCPUGenerator(50 + r);
      const at::Tensor x = at::randn({5, 16}, generator);
      dp.prepare_for_backward();
      layer(x).pow(2).sum().backward();
      CHECK(dp.finish());
      local(x).pow(2).sum().backward();
      const at::Tensor gw = local->weight.grad(), gb = local->bias.grad();
      const accel::GroupPtr group = d.world_group();
      CHECK(state->iter == 1);
      if (start == 1) {  // a plain step: the bucket (bias, weight, flags) divided, then all-reduced
        const at::Tensor plain =
            accel::all_reduce(at::cat({gb, gw.reshape({-1}), at::ones({2})}) / P, accel::ReduceOp::SUM, group);
        CHECK(at::equal(layer->weight.grad(), plain.narrow(0, 12, 12 * 16).view({12, 16})));
        CHECK(state->error_dict.empty());
        continue;
      }
      std::mt19937_64 rng(5);
      at::Generator q_generator = at::detail::createCPUGenerator(rng() % 1000000000);
      const at::Tensor q = orthogonalize(at::randn({16, 2}, q_generator, at::TensorOptions(at::kFloat)));
      const at::Tensor p = orthogonalize(accel::all_reduce(gw.matmul(q), accel::ReduceOp::SUM, group));
      const at::Tensor q2 = accel::all_reduce(gw.t().matmul(p), accel::ReduceOp::SUM, group) / P;
      const at::Tensor expected = p.matmul(q2.t());
      const at::Tensor bias = accel::all_reduce(gb.clone(), accel::ReduceOp::SUM, group) / P;
      CHECK(at::allclose(layer->weight.grad(), expected, 1e-6, 1e-7));
      CHECK(at::allclose(layer->bias.grad(), bias, 1e-6, 1e-7));
      // what compression lost here, to be added back next step (the bucket: the bias, then the weight)
      const at::Tensor lost = at::cat({gb - bias, (gw - expected).reshape({-1})});
      REQUIRE(state->error_dict.count(0));
      CHECK(at::allclose(state->error_dict.at(0), lost, 1e-5, 1e-6));
      const double relative = ((layer->weight.grad() - accel::all_reduce(gw / P, accel::ReduceOp::SUM, group)).norm() /
                               layer->weight.grad().norm()).item<double>();
      MESSAGE("PowerSGD rank 2 at " << P << " processes: weight gradient off the exact average by " << relative
                                    << " (relative), as the reference");
      CHECK(relative > 1e-3);  // it did compress
    }
    accel::AcceleratorConfig c = config();
    c.comm_hook = accel::DDPCommunicationHookType::POWER_SGD;
    accel::Accelerator accelerator(c);  // torch's defaults: plain all-reduces for 1000 steps
    Mlp model(5, 33, 2);
    accelerator.prepare(model);
    accelerator.backward(model(at::ones({2, 5})).sum());
    CHECK_THROWS_AS(accel::comm_hooks::powerSGD_hook(std::make_shared<accel::PowerSGDState>(
                        accel::PowerSGDState{.matrix_approximation_rank = 0})),
                    accel::InvalidArgument);
  }

  // DDP's gradient_as_bucket_view: the gradients are views of persistent buckets. Training is bit for bit the
  // copying path's (with accumulation, and after gradients set to none), and a step allocates the bucket less
  // (allocator bytes: the gradients and their used-flags).
  TEST_CASE("training: gradient_as_bucket_view trains bit for bit as the copying path and allocates a bucket less per step") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    if (P == 1) return;
    std::vector<at::Tensor> finals;
    std::vector<int64_t> per_step;
    int64_t bucket_bytes = 0;
    for (const bool view : {false, true}) {
      CAPTURE(view);
      accel::AcceleratorConfig c = config(2);  // no_sync micro-steps accumulate into the views
      c.gradient_as_bucket_view = view;
      accel::Accelerator accelerator(c);
      torch::manual_seed(4);
      Mlp model(5, 33, 2);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      auto prepared = accelerator.prepare(model, sgd);
      accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
      REQUIRE(accelerator.data_parallel(model)->bucket_count() == 1);
      auto generator = at::detail::createCPUGenerator(30 + r);
      auto step = [&](bool set_to_none) {
        for (int k = 0; k < 2; ++k) {
          auto guard = accelerator.accumulate(model);
          const at::Tensor x = at::randn({3, 5}, generator), y = at::randn({3, 1}, generator);
          accelerator.backward(torch::mse_loss(model(x), y));
          optimizer.step();
          optimizer.zero_grad(set_to_none);
        }
      };
      for (int i = 0; i < 3; ++i) step(/*set_to_none=*/i == 1);  // once set to none: copied into the views again
      accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();
      counting.install();
      const int64_t before = counting.total();
      step(false);
      per_step.push_back(counting.total() - before);
      counting.uninstall();
      const auto params = model->parameters();
      if (view) {  // every gradient lies in the one bucket
        for (const auto& p : params) CHECK(p.grad().is_alias_of(params.front().grad()));
      } else {
        for (std::size_t i = 1; i < params.size(); ++i) CHECK_FALSE(params[i].grad().is_alias_of(params[0].grad()));
      }
      bucket_bytes = static_cast<int64_t>(params.size()) * 4;  // the used-flags
      for (const auto& p : params) bucket_bytes += p.numel() * 4;
      finals.push_back(flat_parameters(*model).clone());
    }
    CHECK(at::equal(finals[0], finals[1]));
    MESSAGE("gradient_as_bucket_view: " << per_step[1] << " allocator bytes per step, copying " << per_step[0]
                                        << "; the bucket is " << bucket_bytes);
    CHECK(per_step[0] - per_step[1] == bucket_bytes);
  }

  TEST_CASE("autograd collectives: forward values, and gradients that are the adjoint collective's") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    const double tri = P * (P - 1) / 2.0, weights = P * (P + 1) / 2.0;  // sum of r, sum of r + 1
    auto leaf = [](at::Tensor t) { return t.to(at::kDouble).requires_grad_(true); };
    // all_reduce: every rank's loss (r + 1) * sum(y) depends on every x: dx = sum of the weights.
    at::Tensor x = leaf(at::arange(3) + r);
    at::Tensor y = accel::autograd::all_reduce(x);
    CHECK(at::equal(y.detach(), at::arange(3, at::kDouble) * P + tri));
    CHECK(at::equal(x.detach(), at::arange(3, at::kDouble) + r));  // the input is left alone
    (y * (r + 1)).sum().backward();
    CHECK(at::equal(x.grad(), at::full({3}, weights, at::kDouble)));
    // MEAN: the gradient is averaged as the values are.
    x = leaf(at::arange(3) + r);
    (accel::autograd::all_reduce(x, ReduceOp::MEAN) * (r + 1)).sum().backward();
    CHECK(at::allclose(x.grad(), at::full({3}, weights / P, at::kDouble)));
    // all_gather: rank k's loss weighs row j by (k + 1)(j + 1): dx_r = (r + 1) * sum of (k + 1).
    x = leaf(at::full({2}, r));
    y = accel::autograd::all_gather(x);
    CHECK(at::equal(y.detach(), at::arange(P, at::kDouble).unsqueeze(1).repeat({1, 2})));
    (y * (at::arange(P, at::kDouble) + 1).unsqueeze(1) * (r + 1)).sum().backward();
    CHECK(at::equal(x.grad(), at::full({2}, (r + 1) * weights, at::kDouble)));
    // reduce_scatter: part k of every x goes to rank k, whose loss weighs it by k + 1.
    x = leaf(at::arange(2 * P) + 10 * r);
    y = accel::autograd::reduce_scatter(x);
    CHECK(at::equal(y.detach(), (at::arange(2, at::kDouble) + 2 * r) * P + 10 * tri));
    (y * (r + 1)).sum().backward();
    CHECK(at::equal(x.grad(), at::div(at::arange(2 * P, at::kDouble), 2, "floor") + 1));
    // all_to_all: y_r[k] = x_k[r]; rank r's loss weighs y_r[k] by (r + 1)(k + 1), so dx_r[j] = (j + 1)(r + 1).
    x = leaf(at::arange(P) + 100 * r);
    y = accel::autograd::all_to_all(x);
    CHECK(at::equal(y.detach(), at::arange(P, at::kDouble) * 100 + r));
    (y * (at::arange(P, at::kDouble) + 1) * (r + 1)).sum().backward();
    CHECK(at::equal(x.grad(), (at::arange(P, at::kDouble) + 1) * (r + 1)));
    // Uneven all_to_all: rank i sends j rows to rank j (values 10 i + j); the gradient goes back the same way.
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> parts;
    for (int j = 0; j < P; ++j) {
      in_splits.push_back(j);
      out_splits.push_back(r);
      parts.push_back(at::full({j}, 10 * r + j));
    }
    x = leaf(at::cat(parts));
    y = accel::autograd::all_to_all(x, out_splits, in_splits);
    CHECK(at::equal(y.detach(), (at::arange(P, at::kDouble) * 10 + r).repeat_interleave(r)));
    (y * y).sum().backward();  // d(y^2) = 2y, back at the row's origin: 2x
    CHECK(at::equal(x.grad(), 2 * x.detach()));
    // MAX has no collective as its gradient.
    CHECK_THROWS_WITH_AS(accel::autograd::all_reduce(x, ReduceOp::MAX), doctest::Contains("SUM and MEAN do"),
                         std::invalid_argument);
  }

  TEST_CASE("training: k accumulation steps equal one step on a k-times larger batch; no traffic until the k-th") {
    const int k = 2;
    accel::Accelerator accelerator(config(k));
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    Mlp model(4, 16, 1);
    torch::optim::SGD optimizer(model->parameters(), 0.05);
    accelerator.prepare(model, optimizer);
    Mlp reference = copy_of(model, 4, 16, 1);
    torch::optim::SGD reference_optimizer(reference->parameters(), 0.05);
    const auto [x, y] = dataset(24, 4);
    const int64_t n = 24 / P, micro = n / k;
    accel::DataParallel* dp = accelerator.data_parallel();
    if (dp->distributed()) start_sequence(dp->group());
    for (int step = 0; step < 3; ++step) {
      for (int i = 0; i < k; ++i) {
        const int64_t sequence = dp->distributed() ? dp->group()->getSequenceNumberForGroup() : 0;
        {
          auto guard = accelerator.accumulate(model);
          const int64_t first = r * n + i * micro;
          accelerator.backward(torch::mse_loss(model(x.narrow(0, first, micro)), y.narrow(0, first, micro)));
          if (accelerator.sync_gradients()) {
            optimizer.step();
            optimizer.zero_grad();
          }
        }
        if (dp->distributed()) {
          const int64_t collectives = dp->group()->getSequenceNumberForGroup() - sequence;
          if (i + 1 < k) CHECK(collectives == 0);  // accumulated locally
          else CHECK(collectives >= 1);           // the buckets' all-reduces
        }
      }
      reference_optimizer.zero_grad();
      torch::mse_loss(reference(x), y).backward();
      reference_optimizer.step();
      CHECK(at::allclose(flat_parameters(*model), flat_parameters(*reference), 1e-5, 1e-6));
    }
    // no_sync: gradients stay local (they differ between ranks).
    optimizer.zero_grad();
    {
      auto guard = accelerator.no_sync(model);
      accelerator.backward(torch::mse_loss(model(x.narrow(0, r * n, n)), y.narrow(0, r * n, n)));
    }
    if (dp->distributed() && P > 1) {
      at::Tensor grads = accel::all_gather(model->parameters()[0].grad().reshape({-1}), dp->group());
      CHECK_FALSE(at::equal(grads[0], grads[1]));
    }
  }

  TEST_CASE("training: the first bucket's all-reduce is issued during backward, before it reaches the input") {
    accel::AcceleratorConfig c = config();
    c.bucket_cap_mb = 1;
    accel::Accelerator accelerator(c);
    Mlp model(256, 512, 3);  // 1 MiB weight matrices: several buckets
    accelerator.prepare(model);
    accel::DataParallel* dp = accelerator.data_parallel();
    if (!dp->distributed()) return;  // one process: nothing to reduce
    CHECK(dp->bucket_count() >= 3);
    std::vector<std::string> events;
    dp->on_bucket_issued([&](std::size_t bucket) { events.push_back("bucket " + std::to_string(bucket)); });
    at::Tensor input = at::randn({8, 256}).requires_grad_(true);
    input.register_hook([&](const at::Tensor& grad) {
      events.push_back("input");  // the last gradient backward computes
      return grad;
    });
    accelerator.backward(model(input).pow(2).mean());
    events.push_back("backward returned");
    const auto input_at = std::find(events.begin(), events.end(), "input") - events.begin();
    CAPTURE(events.size());
    REQUIRE(events.size() == dp->bucket_count() + 2);
    CHECK(events.front().rfind("bucket", 0) == 0);  // issued while backward still had layers to go
    CHECK(input_at > 0);
    CHECK(events.back() == "backward returned");
    CHECK(identical_across_ranks(*model, dp->group()));
    at::Tensor grads = accel::all_gather(model->parameters()[0].grad().reshape({-1}), dp->group());
    CHECK(at::equal(grads[0], grads[grads.size(0) - 1]));  // averaged: the same everywhere
  }

  TEST_CASE("training: a checkpoint saved on every rank resumes with identical results") {
    accel::Accelerator accelerator(config());
    Mlp model(4, 16, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    accelerator.prepare(model, optimizer);
    const std::filesystem::path dir = shared_temp_path(accelerator, "accel_ckpt_");
    const auto data = dataset(8, 4);  // (clang 14 cannot capture structured bindings)
    const at::Tensor& x = data.first;
    const at::Tensor& y = data.second;
    auto train = [&](int steps) {
      for (int i = 0; i < steps; ++i) {
        optimizer.zero_grad();
        at::Tensor noisy = x + 0.01 * at::randn(x.sizes());  // uses the RNG state the checkpoint keeps
        accelerator.backward(torch::mse_loss(model(noisy), y));
        optimizer.step();
      }
      return flat_parameters(*model).clone();
    };
    accel::set_seed(3, /*device_specific=*/true);
    train(2);
    const at::Tensor at_save = flat_parameters(*model).clone();
    accelerator.save_state(dir);
    CHECK(std::filesystem::exists(dir / "model.pt"));
    CHECK_FALSE(std::filesystem::exists(dir.string() + ".tmp"));
    const at::Tensor straight = train(3);
    accelerator.load_state(dir);
    CHECK(at::equal(at_save, flat_parameters(*model)));
    const at::Tensor resumed = train(3);
    CHECK(at::equal(straight, resumed));
    // Module::load replaced the parameters' storage (a new gradient
    // accumulator each): the gradients are still averaged after it.
    if (accelerator.data_parallel()->distributed())
      CHECK(identical_across_ranks(*model, accelerator.data_parallel()->group()));
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
  }

  TEST_CASE("checkpoints: one that does not fit is refused on every process, before anything changes") {
    namespace fs = std::filesystem;
    accel::Accelerator accelerator(config());
    Mlp model(4, 16, 1);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    accelerator.prepare(model, optimizer);
    const auto data = dataset(8, 4);
    optimizer.zero_grad();
    accelerator.backward(torch::mse_loss(model(data.first), data.second));
    optimizer.step();  // momentum state to save
    const fs::path dir = shared_temp_path(accelerator, "accel_bad_ckpt_");
    accelerator.save_state(dir.string() + "/");  // a trailing slash names the same checkpoint
    CHECK(fs::exists(dir / "model.pt"));
    CHECK(fs::exists(dir / "accel_checkpoint.txt"));
    CHECK_FALSE(fs::exists(dir.string() + ".tmp"));
    CHECK_FALSE(fs::exists(dir / ".tmp"));
    const at::Tensor saved = flat_parameters(*model).clone();
    const std::vector<double> saved_momentum = momentum_sums(optimizer);
    const int P = accelerator.num_processes();

    // Each case damages a copy of the checkpoint (on the main process), then
    // every process loads it: every process throws, and nothing changed.
    int copies = 0;
    auto refused = [&](const std::function<void(const fs::path&)>& damage, accel::Accelerator& acc, Mlp& m,
                       torch::optim::Optimizer& opt) {
      const fs::path copy = dir.string() + "_" + std::to_string(copies++);
      if (acc.is_main_process()) {
        fs::copy(dir, copy, fs::copy_options::recursive);
        damage(copy);
      }
      acc.wait_for_everyone();
      {
        torch::NoGradGuard no_grad;
        for (auto& p : m->parameters()) p.add_(1.0);  // so that a load would show
      }
      const at::Tensor before = flat_parameters(*m).clone();
      const std::vector<double> momentum = momentum_sums(opt);
      const std::string what = what_of([&] { acc.load_state(copy); });
      CHECK(at::equal(before, flat_parameters(*m)));
      CHECK(momentum == momentum_sums(opt));
      acc.wait_for_everyone();
      if (acc.is_main_process()) fs::remove_all(copy);
      return what;
    };
    auto rank_prefix = [&](int r) { return P > 1 ? "rank " + std::to_string(r) + ": " : std::string(); };

    std::string what = refused([](const fs::path& d) { fs::resize_file(d / "optimizer.pt", fs::file_size(d / "optimizer.pt") / 2); },
                               accelerator, model, optimizer);
    CHECK(what.find("accel::Accelerator::load_state: " + rank_prefix(0) + "cannot read ") != std::string::npos);
    CHECK(what.find("optimizer.pt") != std::string::npos);
    CHECK(what.find("frame #") == std::string::npos);  // no C++ backtrace
    const std::string last_rng = "random_states_" + std::to_string(P - 1) + ".pt";
    what = refused([&](const fs::path& d) { fs::resize_file(d / last_rng, 10); }, accelerator, model, optimizer);
    CHECK(what.find(rank_prefix(P - 1) + "cannot read " + (dir.string() + "_1/") + last_rng) != std::string::npos);
    what = refused([&](const fs::path& d) { fs::remove(d / last_rng); }, accelerator, model, optimizer);
    CHECK(what.find(rank_prefix(P - 1) + "missing " + (dir.string() + "_2/") + last_rng) != std::string::npos);
    what = refused(
        [&](const fs::path& d) {
          std::ifstream in(d / "accel_checkpoint.txt");
          std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
          const std::string line = "processes " + std::to_string(P);
          text.replace(text.find(line), line.size(), "processes " + std::to_string(P + 1));
          std::ofstream(d / "accel_checkpoint.txt") << text;
        },
        accelerator, model, optimizer);
    CHECK(what.find("it was saved by " + std::to_string(P + 1) + " processes, this run has " + std::to_string(P)) !=
          std::string::npos);
    {  // a model of another width
      accel::Accelerator other(config());
      Mlp narrow(4, 8, 1);
      torch::optim::SGD narrow_optimizer(narrow->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      other.prepare(narrow, narrow_optimizer);
      what = refused([](const fs::path&) {}, other, narrow, narrow_optimizer);
      CHECK(what.find("_4/model.pt: body.0.weight is Float[16, 4] there, Float[8, 4] in the model") !=
            std::string::npos);
    }
    {  // the same model, an optimizer over some of its parameters: refused as it loads, and put back
      accel::Accelerator other(config());
      Mlp same(4, 16, 1);
      torch::optim::SGD partial(same->body->ptr(0)->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      other.prepare(same, partial);
      what = refused([](const fs::path&) {}, other, same, partial);
      CHECK(what.find("_5/optimizer.pt does not fit the optimizer: ") != std::string::npos);
    }
    // after all that, the checkpoint itself loads
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.zero_();
    }
    accelerator.load_state(dir);
    CHECK(at::equal(saved, flat_parameters(*model)));
    CHECK(saved_momentum == momentum_sums(optimizer));
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) fs::remove_all(dir);
  }

  TEST_CASE("checkpoints: prepared loaders resume on the next batch; the step and registered objects return") {
    namespace fs = std::filesystem;
    auto make_loaders = [](accel::Accelerator& acc) {
      auto indexed = acc.prepare_data_loader(Indexed(23).map(torch::data::transforms::Stack<>()),
                                             {.batch_size = 2, .shuffle = true, .seed = 5});
      auto stream = acc.prepare_data_loader(Stream(29), {.batch_size = 2});  // dispatched
      return std::make_pair(std::move(indexed), std::move(stream));
    };
    std::vector<int64_t> rest_of_epoch_1, epoch_2, stream_rest;
    std::filesystem::path dir;
    {  // the run that saves: mid-way through the indexed loader's epoch 1 and the stream's pass
      accel::Accelerator accelerator(config(3));
      auto loaders = make_loaders(accelerator);
      Counter counter{41};
      accelerator.register_for_checkpointing(counter);
      dir = shared_temp_path(accelerator, "accel_resume_");
      pass_firsts(loaders.first);  // epoch 0
      std::vector<std::vector<int64_t>> stream_batches;
      for (auto& batch : loaders.second) stream_batches.push_back(batch);  // a whole pass, for reference
      int handed = 0;
      for (auto& batch : loaders.second) {
        (void)batch;
        if (++handed == 3) break;  // 3 batches handed out
      }
      int64_t batches = 0;
      for (auto& batch : loaders.first) {
        if (++batches <= 2) {
          auto sync = accelerator.accumulate();  // two of three accumulation steps
          CHECK_FALSE(accelerator.sync_gradients());
          if (batches == 2) accelerator.save_state(dir);
          continue;
        }
        rest_of_epoch_1.push_back(batch.data[0][0].item<int64_t>());
      }
      CHECK(loaders.first.epoch() == 1);
      epoch_2 = pass_firsts(loaders.first);
      for (std::size_t b = 3; b < stream_batches.size(); ++b)
        stream_rest.insert(stream_rest.end(), stream_batches[b].begin(), stream_batches[b].end());
      REQUIRE_FALSE(rest_of_epoch_1.empty());  // 23 samples, 2 per batch: at least 3 batches per process at 1-4
    }
    accel::Accelerator accelerator(config(3));
    auto loaders = make_loaders(accelerator);
    Counter counter;
    accelerator.register_for_checkpointing(counter);
    accelerator.load_state(dir);
    CHECK(counter.value == 41);
    CHECK(loaders.first.next_epoch() == 1);
    std::vector<int64_t> resumed;
    for (auto& batch : loaders.first) {
      if (resumed.empty()) {  // the third accumulation step: the saved count goes on
        auto sync = accelerator.accumulate();
        CHECK(accelerator.sync_gradients());
      }
      resumed.push_back(batch.data[0][0].item<int64_t>());
    }
    CHECK(resumed == rest_of_epoch_1);
    CHECK(loaders.first.epoch() == 1);
    CHECK(pass_firsts(loaders.first) == epoch_2);  // and then epoch 2, whole
    std::vector<int64_t> stream_resumed;
    for (auto& batch : loaders.second) stream_resumed.insert(stream_resumed.end(), batch.begin(), batch.end());
    CHECK(stream_resumed == stream_rest);
    // skip_first_batches, by hand: the next pass only
    const std::size_t all = epoch_2.size();
    CHECK(pass_firsts(accelerator.skip_first_batches(loaders.first, all - 1)).size() == 1);
    CHECK(pass_firsts(loaders.first).size() == all);
    CHECK(pass_firsts(accelerator.skip_first_batches(loaders.first, all + 5)).empty());
    // a checkpoint with another number of loaders is refused
    {
      accel::Accelerator fewer(config(3));
      auto only = fewer.prepare_data_loader(Indexed(23).map(torch::data::transforms::Stack<>()), {.batch_size = 2});
      Counter c;
      fewer.register_for_checkpointing(c);
      CHECK(what_of([&] { fewer.load_state(dir); }).find("it holds 2 data loader(s); this run has 1") !=
            std::string::npos);
    }
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) fs::remove_all(dir);
  }

  TEST_CASE("checkpoints: the learning rate and a scheduler's steps return (LibTorch's Optimizer::load drops the first)") {
    auto lr = [](torch::optim::Optimizer& o) { return o.param_groups()[0].options().get_lr(); };
    std::vector<double> expected;
    double saved_lr = 0;
    std::filesystem::path dir;
    {
      accel::Accelerator accelerator(config());
      Mlp model(4, 8, 1);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::StepLR step_lr(sgd, /*step_size=*/3, /*gamma=*/0.5);
      auto prepared = accelerator.prepare(model, sgd, step_lr);
      dir = shared_temp_path(accelerator, "accel_sched_");
      for (int i = 0; i < 4; ++i) std::get<2>(prepared).step();  // num_processes scheduler steps each
      saved_lr = lr(sgd);
      CHECK(saved_lr < 0.1);
      accelerator.save_state(dir);
      for (int i = 0; i < 4; ++i) {
        std::get<2>(prepared).step();
        expected.push_back(lr(sgd));
      }
    }
    accel::Accelerator accelerator(config());
    Mlp model(4, 8, 1);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::StepLR step_lr(sgd, 3, 0.5);
    auto prepared = accelerator.prepare(model, sgd, step_lr);
    accelerator.load_state(dir);
    CHECK(lr(sgd) == saved_lr);
    std::vector<double> resumed;
    for (int i = 0; i < 4; ++i) {
      std::get<2>(prepared).step();
      resumed.push_back(lr(sgd));
    }
    CHECK(resumed == expected);  // the schedule goes on where it was
    {  // a scheduler already past the checkpoint cannot be replayed back
      accel::Accelerator other(config());
      Mlp m(4, 8, 1);
      torch::optim::SGD o(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::StepLR s(o, 3, 0.5);
      auto p = other.prepare(m, o, s);
      for (int i = 0; i < 5; ++i) std::get<2>(p).step();
      CHECK(what_of([&] { other.load_state(dir); }).find("load the checkpoint before stepping it") != std::string::npos);
    }
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
  }

  // Accelerate's tests/test_state_checkpointing.py, its ProjectConfiguration
  // cases with their expected values, then what a restarted run meets.
  TEST_CASE("checkpoints: automatic naming, total_limit rotation and loading the newest (Accelerate's cases)") {
    namespace fs = std::filesystem;
    fs::path project;
    {
      accel::Accelerator probe(config());
      project = shared_temp_path(probe, "accel_project_");
      if (probe.is_main_process()) fs::remove_all(project);  // a subcase that threw halfway left it
      probe.wait_for_everyone();
    }
    auto project_config = [&](std::optional<int> total_limit, int iteration = 0) {
      accel::AcceleratorConfig c = config();
      c.project_config.project_dir = project;
      c.project_config.automatic_checkpoint_naming = true;
      c.project_config.total_limit = total_limit;
      c.project_config.iteration = iteration;
      return c;
    };
    auto listing = [&] { return sorted_names(project / "checkpoints"); };  // the numbered directories
    auto clear = [&](accel::Accelerator& acc) {
      acc.wait_for_everyone();
      if (acc.is_main_process()) fs::remove_all(project);
      acc.wait_for_everyone();
    };
    auto step = [](accel::Accelerator& acc, Mlp& m, torch::optim::Optimizer& o) {
      const auto data = dataset(8, 4);
      o.zero_grad();
      acc.backward(torch::mse_loss(m(data.first), data.second));
      o.step();
      return flat_parameters(*m).clone();
    };

    SUBCASE("test_with_save_limit: total_limit=1, two saves leave one") {
      accel::Accelerator accelerator(project_config(1));
      Mlp model(4, 8, 1);
      torch::optim::Adam optimizer(model->parameters(), 1e-3);
      accelerator.prepare(model, optimizer);
      CHECK(accelerator.save_state() == project / "checkpoints" / "checkpoint_0");
      CHECK(accelerator.save_state() == project / "checkpoints" / "checkpoint_1");
      CHECK(listing() == std::vector<std::string>{"checkpoint_1"});
      CHECK(accelerator.save_iteration() == 2);
      clear(accelerator);
    }
    SUBCASE("test_checkpoint_deletion: total_limit=2, eleven saves leave checkpoint_9 and checkpoint_10") {
      accel::Accelerator accelerator(project_config(2));
      Mlp model(4, 8, 1);
      accelerator.prepare(model);
      for (int i = 0; i < 11; ++i) accelerator.save_state();
      CHECK_FALSE(fs::exists(project / "checkpoints" / "checkpoint_0"));
      CHECK(fs::exists(project / "checkpoints" / "checkpoint_9"));
      CHECK(fs::exists(project / "checkpoints" / "checkpoint_10"));
      CHECK(listing() == std::vector<std::string>{"checkpoint_10", "checkpoint_9"});
      clear(accelerator);
    }
    SUBCASE("test_automatic_loading: load_state() loads the newest") {
      accel::Accelerator accelerator(project_config(std::nullopt));
      Mlp model(4, 8, 1);
      torch::optim::Adam optimizer(model->parameters(), 1e-3);
      accelerator.prepare(model, optimizer);
      accelerator.save_state();
      step(accelerator, model, optimizer);
      const at::Tensor a2 = step(accelerator, model, optimizer);
      accelerator.save_state();
      const at::Tensor a3 = step(accelerator, model, optimizer);
      accelerator.load_state();
      CHECK_FALSE(at::equal(a3, flat_parameters(*model)));
      CHECK(at::equal(a2, flat_parameters(*model)));
      CHECK(accelerator.save_iteration() == 2);
      clear(accelerator);
    }
    SUBCASE("test_can_resume_training: iteration=1, checkpoint_0 loaded by name, the next save is checkpoint_1") {
      at::Tensor a, a1, a3;
      {
        accel::Accelerator accelerator(project_config(std::nullopt));
        Mlp model(4, 8, 1);
        torch::optim::Adam optimizer(model->parameters(), 1e-3);
        accelerator.prepare(model, optimizer);
        accelerator.save_state();
        a = flat_parameters(*model).clone();
        for (int i = 0; i < 3; ++i) a1 = step(accelerator, model, optimizer);
      }
      accel::Accelerator accelerator(project_config(std::nullopt, /*iteration=*/1));
      Mlp model(4, 8, 1);
      torch::optim::Adam optimizer(model->parameters(), 1e-3);
      accelerator.prepare(model, optimizer);
      accelerator.load_state(project / "checkpoints" / "checkpoint_0");
      CHECK(at::equal(a, flat_parameters(*model)));
      for (int i = 0; i < 2; ++i) step(accelerator, model, optimizer);
      CHECK(accelerator.save_state() == project / "checkpoints" / "checkpoint_1");
      accelerator.load_state(project / "checkpoints" / "checkpoint_1");
      a3 = step(accelerator, model, optimizer);
      CHECK(at::equal(a1, a3));
      clear(accelerator);
    }
    SUBCASE("a restarted run: its number taken is an error on every process; load_state() goes on past the newest") {
      {
        accel::Accelerator accelerator(project_config(3));
        Mlp model(4, 8, 1);
        accelerator.prepare(model);
        for (int i = 0; i < 5; ++i) accelerator.save_state();  // checkpoint_2, _3, _4 left
      }
      accel::Accelerator accelerator(project_config(3));
      Mlp model(4, 8, 1);
      accelerator.prepare(model);
      accelerator.save_state();  // checkpoint_0: a number the rotation removed is free again
      CHECK(listing() == std::vector<std::string>{"checkpoint_0", "checkpoint_3", "checkpoint_4"});
      accelerator.project_configuration().iteration = 3;
      const std::string what = what_of([&] { accelerator.save_state(); });
      CHECK(what.find("checkpoint_3 (iteration 3) already exists: set project_configuration().iteration") !=
            std::string::npos);
      CHECK(accelerator.save_iteration() == 3);
      accelerator.load_state();  // checkpoint_4, the highest number
      CHECK(accelerator.save_iteration() == 5);
      CHECK(accelerator.save_state() == project / "checkpoints" / "checkpoint_5");
      CHECK(listing() == std::vector<std::string>{"checkpoint_3", "checkpoint_4", "checkpoint_5"});
      // Directories of other names are not ours: neither counted nor removed.
      accelerator.wait_for_everyone();  // every process has looked
      if (accelerator.is_main_process()) fs::create_directories(project / "checkpoints" / "checkpoint_best");
      accelerator.wait_for_everyone();
      accelerator.save_state();
      CHECK(listing() == std::vector<std::string>{"checkpoint_4", "checkpoint_5", "checkpoint_6", "checkpoint_best"});
      // A path is not taken with automatic naming; loading one by name is.
      CHECK_THROWS_WITH_AS(accelerator.save_state(project / "elsewhere"),
                           doctest::Contains("call save_state() without"), accel::InvalidArgument);
      accelerator.load_state(project / "checkpoints" / "checkpoint_4");
      CHECK(accelerator.save_iteration() == 7);  // past the newest still
      clear(accelerator);
      const std::string none = what_of([&] { accelerator.load_state(); });
      CHECK(none == "accel::Accelerator::load_state: no checkpoint under " + (project / "checkpoints").string());
    }
  }

  TEST_CASE("training: gather_for_metrics gathers uneven batches and drops the padding duplicates") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    at::Tensor predictions = at::full({r + 1}, r, at::kLong);
    const int64_t total = P * (P + 1) / 2;
    at::Tensor all = accelerator.gather_for_metrics(predictions);
    CHECK(all.size(0) == total);
    at::Tensor kept = accelerator.gather_for_metrics(predictions, total - 1);
    CHECK(at::equal(kept, all.narrow(0, 0, total - 1)));
  }

  TEST_CASE("data: Accelerate's layout: process p reads batches p, p+P, ...; the last round is filled from the start") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    const auto n = static_cast<std::size_t>(2 * P + 1);  // 7 samples, batch 2, 3 processes: 4 batches + a fill
    auto loader = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()), {.batch_size = 2});
    std::vector<at::Tensor> gathered, metrics;
    std::vector<int64_t> sizes;
    for (auto& batch : loader) {
      sizes.push_back(batch.data.size(0));
      gathered.push_back(accelerator.gather(batch.data).reshape({-1}));
      metrics.push_back(accelerator.gather_for_metrics(batch.data).reshape({-1}));
    }
    if (P > 1) CHECK(sizes == std::vector<int64_t>(sizes.size(), 2));  // every process: full batches
    else CHECK(sizes == std::vector<int64_t>{2, 1});  // one process: not sharded, as Accelerate
    // Without shuffle a gathered pass is the dataset in order, then the fill.
    at::Tensor all = at::cat(gathered);
    CHECK(at::equal(all.narrow(0, 0, static_cast<int64_t>(n)), at::arange(static_cast<int64_t>(n), at::kLong)));
    CHECK(at::equal(at::cat(metrics), at::arange(static_cast<int64_t>(n), at::kLong)));
    // Accelerate's test_script.py dl_preparation_check: 32 P samples, batch 8, with and without split_batches.
    for (bool split : {false, true}) {
      auto c = config();
      c.split_batches = split;
      accel::Accelerator a(c);
      const int64_t length = 32 * P;
      auto dl = a.prepare_data_loader(Indexed(static_cast<std::size_t>(length)).map(torch::data::transforms::Stack<>()),
                                      {.batch_size = split ? static_cast<std::size_t>(8 * P) : 8});
      std::vector<at::Tensor> parts;
      for (auto& batch : dl) parts.push_back(a.gather(batch.data).reshape({-1}));
      CHECK(at::equal(at::cat(parts), at::arange(length, at::kLong)));
    }
    // The DistributedSampler layout stays available.
    auto samples = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()),
                                                   {.batch_size = 2, .layout = accel::ShardLayout::SAMPLES});
    auto first = (*samples.begin()).data.reshape({-1});
    CHECK(first[0].item<int64_t>() == r);
  }

  // Accelerate's test_data_loader.py check_iterable_dataset_shards, on this world.
  TEST_CASE("data: an iterable dataset is sharded as Accelerate's IterableDatasetShard") {
    static_assert(accel::IterableDataset<Stream>);
    static_assert(!accel::IterableDataset<Indexed>);
    for (bool split : {false, true})
      for (bool drop_last : {false, true})
        for (int64_t n : {2, 37, 100}) {
          CAPTURE(split);
          CAPTURE(drop_last);
          CAPTURE(n);
          auto c = config();
          c.split_batches = split;
          accel::Accelerator accelerator(c);
          const auto P = static_cast<std::size_t>(accelerator.num_processes());
          auto loader = accelerator.prepare_data_loader(
              Stream(n), {.batch_size = split ? 4 * P : 4, .drop_last = drop_last, .dispatch_batches = false});
          std::vector<int64_t> observed, metrics;
          std::vector<bool> last;
          for (int pass = 0; pass < 2; ++pass) {  // each pass starts the stream again
            observed.clear();
            metrics.clear();
            last.clear();
            for (auto& batch : loader) {
              const at::Tensor mine = at::tensor(batch, at::kLong);
              if (P > 1) CHECK(mine.size(0) == 4);
              at::Tensor all = accelerator.gather(mine), counted = accelerator.gather_for_metrics(mine);
              for (int64_t i = 0; i < all.size(0); ++i) observed.push_back(all[i].item<int64_t>());
              for (int64_t i = 0; i < counted.size(0); ++i) metrics.push_back(counted[i].item<int64_t>());
              last.push_back(accelerator.end_of_dataloader());
            }
            // Interleaved in rank order, the shards are the stream, cycled from the start at the end.
            for (std::size_t i = 0; i < observed.size(); ++i) CHECK(observed[i] == static_cast<int64_t>(i) % n);
            const auto N = static_cast<std::size_t>(n);
            if (drop_last) CHECK(observed.size() == N / (4 * P) * 4 * P);
            else if (P == 1) CHECK(observed.size() == N);  // one process: not sharded, as Accelerate
            else CHECK(observed.size() == (N + 4 * P - 1) / (4 * P) * 4 * P);
            if (!drop_last) {  // every element once
              std::vector<int64_t> expected(N);
              std::iota(expected.begin(), expected.end(), int64_t{0});
              CHECK(metrics == expected);
            }
            std::vector<bool> expected_last(last.size(), false);
            if (!expected_last.empty()) expected_last.back() = true;
            CHECK(last == expected_last);
          }
        }
    accel::Accelerator accelerator(config());
    CHECK_THROWS_WITH_AS(accelerator.prepare_data_loader(Stream(4), {.shuffle = true}),
                         doctest::Contains("read in its own order"), std::invalid_argument);
  }

  // Accelerate's test_script.py central_dl_preparation_check, with the gathered
  // order checked against the one-process loader's when shuffled too.
  TEST_CASE("data: dispatch_batches: the main process reads every batch (Accelerate's central_dl_preparation_check)") {
    for (bool split : {false, true})
      for (bool shuffle : {false, true}) {
        CAPTURE(split);
        CAPTURE(shuffle);
        auto c = config();
        c.split_batches = split;
        accel::Accelerator accelerator(c);
        const auto P = static_cast<std::size_t>(accelerator.num_processes());
        const std::size_t length = 32 * P, batch = split && 8 % P != 0 ? 4 * P : 8;
        Indexed data(length);
        const auto reads = data.reads;
        auto loader = accelerator.prepare_data_loader(
            data.map(torch::data::transforms::Stack<>()),
            {.batch_size = batch, .shuffle = shuffle, .seed = 3, .dispatch_batches = true});
        std::vector<at::Tensor> parts;
        std::size_t steps = 0;
        for (auto& b : loader) {
          CHECK(b.data.size(0) == static_cast<int64_t>(split ? batch / P : batch));
          parts.push_back(accelerator.gather(b.data).reshape({-1}));
          ++steps;
        }
        // In rank order the shares are the one-process loader's batches, in its order.
        const accel::ShardSampler one({.size = length, .batch_size = batch, .shuffle = shuffle, .seed = 3});
        const std::vector<std::size_t> order = one.indices();
        CHECK(at::equal(at::cat(parts), at::tensor(std::vector<int64_t>(order.begin(), order.end()), at::kLong)));
        CHECK(steps == loader.batches());
        CHECK(*reads == (accelerator.is_main_process() ? length : 0));  // only the main process read
      }
  }

  TEST_CASE("data: dispatch_batches: a last batch that does not divide is completed from the first (Accelerate's rule)") {
    accel::Accelerator accelerator(config());
    const auto P = static_cast<int64_t>(accelerator.num_processes());
    const int64_t r = accelerator.process_index();
    using V = std::vector<int64_t>;
    // The sample indices of a batch, stacked or not (a vector of Examples travels as well).
    auto indices = [](const auto& batch) {
      V out;
      if constexpr (std::is_same_v<std::decay_t<decltype(batch)>, torch::data::Example<>>) {
        for (int64_t i = 0; i < batch.data.size(0); ++i) out.push_back(batch.data[i][0].template item<int64_t>());
      } else {
        for (const auto& sample : batch) out.push_back(sample.data[0].template item<int64_t>());
      }
      return out;
    };
    auto pass = [&](auto&& loader) {
      std::vector<V> mine;
      std::vector<bool> last;
      std::vector<at::Tensor> metrics;
      for (auto& batch : loader) {
        const V rows = indices(batch);
        mine.push_back(rows);
        last.push_back(accelerator.end_of_dataloader());
        metrics.push_back(accelerator.gather_for_metrics(at::tensor(rows, at::kLong)));
      }
      return std::make_tuple(mine, last, at::cat(metrics), loader.batches());
    };
    for (bool stacked : {true, false}) {
      CAPTURE(stacked);
      auto run = [&](std::size_t n, std::size_t batch) {
        return stacked ? pass(accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()),
                                                              {.batch_size = batch, .dispatch_batches = true}))
                       : pass(accelerator.prepare_data_loader(Indexed(n), {.batch_size = batch, .dispatch_batches = true}));
      };
      // 2P + 1 samples in batches of 2: a global batch of 2P rows, then one row: process 0 gets it, the
      // others rows of the first global batch (repeats: gather_for_metrics counts every sample once).
      const auto [mine, last, metrics, batches] = run(static_cast<std::size_t>(2 * P + 1), 2);
      if (P == 1) CHECK(mine == std::vector<V>{{0, 1}, {2}});  // one process: the plain batches
      else CHECK(mine == std::vector<V>{{2 * r, 2 * r + 1}, {r == 0 ? 2 * P : r - 1}});
      CHECK(last == std::vector<bool>{false, true});
      CHECK(at::equal(metrics, at::arange(2 * P + 1, at::kLong)));
      CHECK(batches == 2);
      // 7 samples in batches of 2, as Accelerate's DataLoaderDispatcher deals them.
      const auto seven = std::get<0>(run(7, 2));
      if (P == 2) CHECK(seven == (r == 0 ? std::vector<V>{{0, 1}, {4, 5}} : std::vector<V>{{2, 3}, {6, 0}}));
      if (P == 3) CHECK(seven == std::vector<std::vector<V>>{{{0, 1}, {6}}, {{2, 3}, {0}}, {{4, 5}, {1}}}[r]);
      if (P == 4) CHECK(seven == std::vector<std::vector<V>>{{{0, 1}}, {{2, 3}}, {{4, 5}}, {{6, 0}}}[r]);
    }
  }

  TEST_CASE("data: an iterable dataset is dispatched by default: only the main process reads the stream") {
    for (bool split : {false, true})
      for (int64_t n : {2, 37, 100}) {
        CAPTURE(split);
        CAPTURE(n);
        auto c = config();
        c.split_batches = split;
        accel::Accelerator accelerator(c);
        const auto P = static_cast<int64_t>(accelerator.num_processes());
        Stream stream(n);
        const auto reads = stream.reads;
        auto loader = accelerator.prepare_data_loader(std::move(stream),
                                                      {.batch_size = static_cast<std::size_t>(split ? 4 * P : 4)});
        for (int pass = 0; pass < 2; ++pass) {
          std::vector<int64_t> metrics;
          int64_t steps = 0;
          for (auto& batch : loader) {
            // 4 elements per process; of the last global batch's R, ceil(R / P) each (completed from the first)
            const int64_t left = std::min(4 * P, n - 4 * P * steps);
            CHECK(static_cast<int64_t>(batch.size()) == (left + P - 1) / P);
            const at::Tensor counted = accelerator.gather_for_metrics(at::tensor(batch, at::kLong));
            for (int64_t i = 0; i < counted.size(0); ++i) metrics.push_back(counted[i].item<int64_t>());
            ++steps;
          }
          std::vector<int64_t> expected(static_cast<std::size_t>(n));
          std::iota(expected.begin(), expected.end(), int64_t{0});
          CHECK(metrics == expected);
          CHECK(steps == (n + 4 * P - 1) / (4 * P));
        }
        CHECK(*reads == static_cast<std::size_t>(accelerator.is_main_process() ? 2 * n : 0));
      }
  }

  TEST_CASE("data: dispatch_batches: a batch the main process cannot make is an error on every process, not a hang") {
    accel::Accelerator accelerator(config());
    const auto P = static_cast<std::size_t>(accelerator.num_processes());
    const bool main = accelerator.is_main_process();
    // Sample 4P + 1 cannot be read: two batches arrive, then every process throws.
    auto loader = accelerator.prepare_data_loader(Indexed(6 * P, 4 * P + 1).map(torch::data::transforms::Stack<>()),
                                                  {.batch_size = 2, .dispatch_batches = true});
    std::size_t seen = 0;
    auto drain = [&] {
      for (auto& batch : loader) seen += static_cast<std::size_t>(batch.data.size(0));
    };
    const std::string unreadable = "sample " + std::to_string(4 * P + 1) + " is unreadable";
    if (main || P == 1) CHECK_THROWS_WITH_AS(drain(), doctest::Contains(unreadable.c_str()), std::runtime_error);
    else CHECK_THROWS_WITH_AS(drain(), doctest::Contains("the main process could not make this process's batch (dispatch_batches): sample"), accel::DistributedError);
    CHECK(seen == 2 * (P == 1 ? 2 : 1));  // the batch before the bad one was read ahead
    CHECK(accel::all_reduce(int64_t{1}, accel::ReduceOp::SUM) == static_cast<int64_t>(P));  // the group still works
    // Tensors of a batch that disagree on the rows: data of one row per sample, a target of one row.
    struct Ragged : torch::data::datasets::BatchDataset<Ragged, torch::data::Example<>> {
      torch::data::Example<> get_batch(c10::ArrayRef<std::size_t> indices) override {
        return {at::zeros({static_cast<int64_t>(indices.size()), 1}), at::zeros({1})};
      }
      torch::optional<std::size_t> size() const override { return 8; }
    };
    auto odd = accelerator.prepare_data_loader(Ragged(), {.batch_size = 2, .dispatch_batches = true});
    auto first = [&] { return (*odd.begin()).data.size(0); };
    const std::string ragged =  // the target has one row per one-process batch
        "tensor 1 of the batch is of " + std::to_string(P) + " rows where the first has " + std::to_string(2 * P);
    if (P == 1) CHECK(first() == 2);  // nothing dispatched
    else CHECK_THROWS_WITH(first(), doctest::Contains(ragged.c_str()));
    CHECK_THROWS_WITH_AS(accelerator.prepare_data_loader(Indexed(4), {.layout = accel::ShardLayout::SAMPLES,
                                                                      .dispatch_batches = true}),
                         doctest::Contains("SAMPLES does not apply"), std::invalid_argument);
    // Samples LibTorch's pickler cannot carry.
    struct Opaque {
      int value;
    };
    struct Opaques : torch::data::datasets::Dataset<Opaques, Opaque> {
      Opaque get(std::size_t i) override { return {static_cast<int>(i)}; }
      torch::optional<std::size_t> size() const override { return 4; }
    };
    CHECK_THROWS_WITH_AS(accelerator.prepare_data_loader(Opaques(), {.dispatch_batches = true}),
                         doctest::Contains("this loader's batches are neither"), std::invalid_argument);
    CHECK((*accelerator.prepare_data_loader(Opaques()).begin()).size() == 1);  // without dispatch_batches: fine
  }

  TEST_CASE("data: a custom batch sampler is sharded like Accelerate's (batches of varying size)") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes();
    // Batches of sizes 1, 2, 3, 1, 2, 3, ... over 6 P + 1 samples, reversed each odd epoch.
    const auto n = static_cast<std::size_t>(6 * P + 1);
    auto batches = [n](std::size_t epoch) {
      std::vector<std::vector<std::size_t>> out;
      for (std::size_t i = 0, k = 0; i < n; ++k) {
        out.emplace_back();
        for (std::size_t j = 0; j < k % 3 + 1 && i < n; ++j, ++i) out.back().push_back(epoch % 2 ? n - 1 - i : i);
      }
      return out;
    };
    for (bool dispatch : {false, true}) {  // dispatched: global batches whose rows may not divide by P
      CAPTURE(dispatch);
      auto loader = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()),
                                                    {.batch_sampler = batches, .dispatch_batches = dispatch});
      for (int epoch = 0; epoch < 2; ++epoch) {
        std::vector<at::Tensor> metrics;
        for (auto& batch : loader) metrics.push_back(accelerator.gather_for_metrics(batch.data).reshape({-1}));
        at::Tensor expected = at::arange(static_cast<int64_t>(n), at::kLong);
        CHECK(at::equal(std::get<0>(at::cat(metrics).sort()), expected));
      }
    }
    auto bad = [n](std::size_t) { return std::vector<std::vector<std::size_t>>{{0, n}}; };
    CHECK_THROWS_WITH_AS(accelerator.prepare_data_loader(Indexed(n), {.batch_sampler = bad}),
                         doctest::Contains("past the dataset's"), std::out_of_range);
  }

  TEST_CASE("data: nested prepared loaders: end_of_dataloader follows the innermost (Accelerate's test_dataloader_break)") {
    accel::Accelerator accelerator(config());
    const auto P = static_cast<std::size_t>(accelerator.num_processes());
    auto first = accelerator.prepare_data_loader(Indexed(5 * P).map(torch::data::transforms::Stack<>()));
    auto second = accelerator.prepare_data_loader(Indexed(6 * P).map(torch::data::transforms::Stack<>()));
    CHECK_FALSE(accelerator.end_of_dataloader());
    std::size_t iteration = 0;
    for (auto& outer : first) {
      (void)outer;
      CHECK(accelerator.end_of_dataloader() == (iteration == first.batches() - 1));
      if (iteration == 1) {
        std::size_t inner = 0;
        for (auto& batch : second) {
          (void)batch;
          CHECK(accelerator.end_of_dataloader() == (inner++ == second.batches() - 1));
        }
        CHECK_FALSE(accelerator.end_of_dataloader());  // back in the outer pass, not its last batch
      }
      ++iteration;
    }
    CHECK_FALSE(accelerator.end_of_dataloader());
    for (auto& batch : first) {  // a pass left early ends with its iterator
      (void)batch;
      if (accelerator.end_of_dataloader()) break;
    }
    CHECK_FALSE(accelerator.end_of_dataloader());
  }

  TEST_CASE("accumulate: sync_gradients keeps the last step's value; the count restarts with each pass") {
    accel::Accelerator accelerator(config(2));
    Mlp model(1, 4, 1);
    accelerator.prepare(model);
    const auto P = static_cast<std::size_t>(accelerator.num_processes());
    auto loader = accelerator.prepare_data_loader(Indexed(3 * P).map(torch::data::transforms::Stack<>()));
    std::vector<bool> inside, after;
    for (int pass = 0; pass < 2; ++pass)
      for (auto& batch : loader) {
        (void)batch;
        {
          auto guard = accelerator.accumulate(model);
          inside.push_back(accelerator.sync_gradients());
        }
        after.push_back(accelerator.sync_gradients());
      }
    CHECK(inside == std::vector<bool>{false, true, true, false, true, true});  // Accelerate's [0,1,1, 0,1,1]
    CHECK(after == inside);
  }

  // Accelerate's test_sync.py test_distributed_sync and test_noop_sync.
  TEST_CASE("no_sync: gradients stay local inside, and are averaged on the next synced backward") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    Twins t(accelerator);
    Regression data(16 * P);
    at::Tensor x = data.x.narrow(0, 16 * r, 16), y = data.y.narrow(0, 16 * r, 16);
    for (int iteration = 0; iteration < 3; ++iteration) {
      CAPTURE(iteration);
      torch::mse_loss(t.reference(accelerator.gather(x)), accelerator.gather(y)).backward();
      if (iteration % 2 == 0) {
        auto guard = accelerator.no_sync(t.model);
        accelerator.backward(torch::mse_loss(t.model(x), y));
      } else {
        accelerator.backward(torch::mse_loss(t.model(x), y));
      }
      if (iteration % 2 == 1 || P == 1) CHECK(same_grads(*t.model, *t.reference));
      else CHECK_FALSE(same_grads(*t.model, *t.reference));
      at::Tensor order = at::randperm(16, at::detail::createCPUGenerator(1337 + iteration));
      x = x.index_select(0, order);
      y = y.index_select(0, order);
    }
  }

  // Accelerate's test_sync.py test_gradient_accumulation, with split_batches and sync_each_batch.
  TEST_CASE("accumulate: gradients equal the gathered batch's on sync steps only (Accelerate's test_sync)") {
    for (bool split : {false, true})
      for (bool each : {false, true})
      for (bool dispatch : {false, true}) {
        CAPTURE(split);
        CAPTURE(each);
        CAPTURE(dispatch);
        auto c = config(2);
        c.split_batches = split;
        c.sync_each_batch = each;
        accel::Accelerator accelerator(c);
        const int P = accelerator.num_processes();
        Twins t(accelerator);
        auto loader = accelerator.prepare_data_loader(
            Regression(80).map(torch::data::transforms::Stack<>()),
            {.batch_size = split ? static_cast<std::size_t>(4 * P) : 4, .dispatch_batches = dispatch});
        std::size_t iteration = 0;
        for (auto& batch : loader) {
          CAPTURE(iteration);
          at::Tensor loss = torch::mse_loss(t.reference(accelerator.gather(batch.data)), accelerator.gather(batch.target));
          (loss / 2).backward();
          {
            auto guard = accelerator.accumulate(t.model);
            accelerator.backward(torch::mse_loss(t.model(batch.data), batch.target));
          }
          const bool synced = (iteration + 1) % 2 == 0 || iteration + 1 == loader.batches() || each;
          if (synced || P == 1) CHECK(same_grads(*t.model, *t.reference));
          else CHECK_FALSE(same_grads(*t.model, *t.reference));
          ++iteration;
        }
      }
  }

  // Accelerate's test_sync.py test_gradient_accumulation_with_opt_and_scheduler:
  // prepared optimizer and scheduler are called on every micro-step.
  TEST_CASE("prepare(model, optimizer, scheduler): steps and zero_grad skipped between syncs; the scheduler steps P times") {
    accel::Accelerator accelerator(config(2));
    const int P = accelerator.num_processes();
    torch::manual_seed(42);
    Mlp net(1, 8, 1);
    Mlp reference = copy_of(net, 1, 8, 1);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
    torch::optim::StepLR step_lr(sgd, 1, 0.9);
    auto [model, optimizer, scheduler] = accelerator.prepare(net, sgd, step_lr);
    static_assert(std::is_same_v<decltype(model), Mlp&>);
    torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
    torch::optim::StepLR reference_lr(reference_sgd, 1, 0.9);
    auto loader = accelerator.prepare_data_loader(Regression(40).map(torch::data::transforms::Stack<>()),
                                                  {.batch_size = 4});
    std::size_t iteration = 0;
    for (auto& batch : loader) {
      CAPTURE(iteration);
      at::Tensor loss = torch::mse_loss(reference(accelerator.gather(batch.data)), accelerator.gather(batch.target));
      (loss / 2).backward();
      const bool did_step = (iteration + 1) % 2 == 0 || iteration + 1 == loader.batches();
      if (did_step) {
        reference_sgd.step();
        for (int i = 0; i < P; ++i) reference_lr.step();
        reference_sgd.zero_grad();
      }
      {
        auto guard = accelerator.accumulate(model);
        accelerator.backward(torch::mse_loss(model(batch.data), batch.target));
        optimizer.step();
        scheduler.step();
        optimizer.zero_grad();
      }
      CHECK(optimizer.param_groups()[0].options().get_lr() == reference_sgd.param_groups()[0].options().get_lr());
      CHECK(at::allclose(flat_parameters(*model), flat_parameters(*reference), 1e-5, 1e-6));
      ++iteration;
    }
    CHECK(iteration > 2);
  }

  TEST_CASE("two prepared models both sync; a loss from an unprepared model communicates nothing") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    torch::manual_seed(5 + r);  // different everywhere: prepare broadcasts rank 0's
    Mlp first(2, 8, 1), second(2, 8, 1), unprepared(2, 8, 1);
    torch::optim::SGD sgd_first(first->parameters(), 0.1), sgd_second(second->parameters(), 0.1);
    accelerator.prepare(first, sgd_first, second, sgd_second);
    accel::DataParallel* dp = accelerator.data_parallel(second);
    REQUIRE(dp != nullptr);
    CHECK(accelerator.data_parallel(unprepared) == nullptr);
    for (int step = 0; step < 4; ++step) {
      at::Tensor x = at::randn({4, 2});  // differs between ranks
      at::Tensor loss = first(x).pow(2).mean() + second(x + 1).pow(2).mean();
      accelerator.backward(loss);
      sgd_first.step();
      sgd_second.step();
      sgd_first.zero_grad();
      sgd_second.zero_grad();
    }
    if (dp->distributed()) {
      CHECK(identical_across_ranks(*first, dp->group()));
      CHECK(identical_across_ranks(*second, dp->group()));
    }
    // backward of a loss from a model that was never prepared: no collective, no .grad written.
    for (auto& p : first->parameters()) p.mutable_grad().reset();
    if (dp->distributed()) start_sequence(dp->group());
    const int64_t before = dp->distributed() ? dp->group()->getSequenceNumberForGroup() : 0;
    accelerator.backward(unprepared(at::randn({4, 2})).pow(2).mean());
    if (dp->distributed()) CHECK(dp->group()->getSequenceNumberForGroup() == before);
    for (auto& p : first->parameters()) CHECK_FALSE(p.grad().defined());
    CHECK(unprepared->parameters()[0].grad().defined());
    CHECK_THROWS_WITH_AS(accelerator.prepare(first), doctest::Contains("already prepared"), std::invalid_argument);
    (void)P;
  }

  TEST_CASE("unused parameters: untouched when no rank used them (as DDP), averaged when some rank did") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    torch::manual_seed(9);
    torch::nn::Linear used(3, 3), unused(3, 3), sometimes(3, 3);
    torch::nn::Sequential model(used, unused, sometimes);
    accelerator.prepare(model);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.01));
    auto optimizer = accelerator.prepare(sgd);
    const at::Tensor unused_before = unused->weight.detach().clone();
    for (int step = 0; step < 10; ++step) {
      at::Tensor x = at::randn({4, 3}), out = used(x);
      if (r == 0) out = sometimes(out);  // only rank 0 uses it
      accelerator.backward(out.pow(2).mean());
      CHECK_FALSE(unused->weight.grad().defined());
      CHECK(sometimes->weight.grad().defined());  // averaged in from rank 0 everywhere
      optimizer.step();
      optimizer.zero_grad(/*set_to_none=*/true);
    }
    CHECK(at::equal(unused->weight, unused_before));  // weight decay never touched it
    accel::DataParallel* dp = accelerator.data_parallel(model);
    if (dp->distributed()) CHECK(identical_across_ranks(*model, dp->group()));
    (void)P;
  }

  TEST_CASE("context parallelism: gradients are averaged over the whole data mesh (dp x cp)") {
    const int P = world().get_world_size();
    if (P % 2 != 0) {
      MESSAGE("cp_size 2 needs an even world");
      return;
    }
    world().destroy();
    auto c = config();
    c.distributed.cp_size = 2;
    {
      accel::Accelerator accelerator(c);
      CHECK(accelerator.data_parallel() == nullptr);
      torch::manual_seed(11);
      Mlp model(2, 8, 1);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      auto optimizer = accelerator.prepare(sgd);
      accelerator.prepare(model);
      for (int step = 0; step < 3; ++step) {
        // cp peers see different halves of the same sequence: different inputs on every rank
        at::Tensor x = at::randn({4, 2}, at::detail::createCPUGenerator(100 * step + accelerator.process_index()));
        accelerator.backward(model(x).pow(2).mean());
        optimizer.step();
        optimizer.zero_grad();
      }
      CHECK(identical_across_ranks(*model, accel::GroupPtr()));
    }
    accel::DistributedInterface::instance().destroy();
  }

  // Accelerate's test_distributed_data_loop.py (it expects 2 processes; its values there).
  TEST_CASE("data: batch sizes with and without even_batches (Accelerate's test_distributed_data_loop)") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    auto sizes = [&](std::size_t n, std::size_t batch, bool even) {
      auto loader = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()),
                                                    {.batch_size = batch, .even_batches = even});
      std::vector<int64_t> out;
      for (auto& b : loader) out.push_back(b.data.size(0));
      return out;
    };
    using V = std::vector<int64_t>;
    if (P == 2) {
      CHECK(sizes(3, 1, true) == V{1, 1});
      CHECK(sizes(7, 2, true) == V{2, 2});
      CHECK(sizes(3, 1, false) == (r == 0 ? V{1, 1} : V{1}));
      CHECK(sizes(7, 2, false) == (r == 0 ? V{2, 2} : V{2, 1}));
    }
    // Any world: with even_batches every process gets as many full batches.
    const auto even = sizes(static_cast<std::size_t>(2 * P + 1), 2, true);
    if (P > 1) CHECK(even == V(even.size(), 2));  // (one process is not sharded: 2, 1)
    const auto counts = accel::all_gather(static_cast<int64_t>(even.size()));
    CHECK(std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; }));
  }

  // Accelerate's test_can_join_uneven_inputs, with the weights checked.
  TEST_CASE("join_uneven_inputs: ranks with fewer batches shadow the others; every rank ends with the same weights") {
    auto c = config();
    accel::Accelerator accelerator(c);
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    torch::manual_seed(3);
    torch::nn::Linear net(1, 1);
    torch::nn::Linear reference(1, 1);
    {
      torch::NoGradGuard no_grad;
      reference->weight.copy_(net->weight);
      reference->bias.copy_(net->bias);
    }
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto prepared = accelerator.prepare(net, sgd);  // (clang 14 cannot capture structured bindings)
    torch::nn::Linear& model = std::get<0>(prepared);
    accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
    // P + 1 samples of batch 1 without even_batches: process 0 gets 2 batches, the others 1.
    const auto n = static_cast<std::size_t>(P + 1);
    auto loader = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()),
                                                  {.batch_size = 1, .even_batches = false});
    std::vector<int> batch_indices;
    accelerator.join_uneven_inputs(
        [&] {
          int i = 0;
          for (auto& batch : loader) {
            accelerator.backward(model(batch.data.to(at::kFloat)).sum());
            optimizer.step();
            optimizer.zero_grad();
            batch_indices.push_back(i++);
          }
        },
        model);
    if (P == 1) CHECK(batch_indices == std::vector<int>{0, 1});
    else CHECK(batch_indices == (r == 0 ? std::vector<int>{0, 1} : std::vector<int>{0}));
    // The same steps in one process: the mean over samples 0..P-1, then sample P divided by P (the
    // joined ranks contribute zeros: DDP's divide_by_initial_world_size).
    torch::optim::SGD reference_sgd(reference->parameters(), 0.1);
    at::Tensor first = at::arange(P, at::kFloat).view({P, 1});
    (reference(first).sum() / P).backward();
    reference_sgd.step();
    reference_sgd.zero_grad();
    (reference(at::full({1, 1}, static_cast<float>(P))).sum() / P).backward();
    reference_sgd.step();
    CHECK(at::allclose(flat_parameters(*model), flat_parameters(*reference), 1e-5, 1e-6));
    if (accelerator.data_parallel()->distributed())
      CHECK(identical_across_ranks(*model, accelerator.data_parallel()->group()));
    // Training goes on normally afterwards.
    accelerator.backward(model(at::ones({1, 1})).sum());
    CHECK_THROWS_WITH_AS(accelerator.join_uneven_inputs([] {}, reference), doctest::Contains("was not prepared"),
                         std::invalid_argument);
  }

  // Accelerate's test_script.py test_trigger and process_execution_check.
  TEST_CASE("set_trigger on one process stops every process; main_process_first and the on_* wrappers") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    CHECK_FALSE(accelerator.check_trigger());
    if (accelerator.is_last_process()) accelerator.set_trigger();
    CHECK(accelerator.check_trigger());
    CHECK_FALSE(accelerator.check_trigger());  // reset by the check

    std::vector<std::string> where{accelerator.is_main_process()
                                       ? (std::filesystem::temp_directory_path() /
                                          ("accel_first_" + std::to_string(getpid()) + ".txt"))
                                             .string()
                                       : ""};
    accel::broadcast_object_list(where);
    // No sleep needed to prove the order: every other process's body finds
    // the main process's line already written.
    std::string first_seen = "<none>";
    accelerator.main_process_first([&] {
      if (!accelerator.is_main_process()) std::getline(std::ifstream(where[0]), first_seen);
      std::ofstream(where[0], std::ios::app) << (accelerator.is_main_process() ? "main\n" : "other\n");
    });
    if (!accelerator.is_main_process()) CHECK(first_seen == "main");
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) {
      std::ifstream in(where[0]);
      std::vector<std::string> lines;
      for (std::string line; std::getline(in, line);) lines.push_back(line);
      REQUIRE(lines.size() == static_cast<std::size_t>(P));
      CHECK(lines.front() == "main");
      CHECK(std::count(lines.begin(), lines.end(), "other") == P - 1);
      std::filesystem::remove(where[0]);
    }
    int ran = 0;
    accelerator.on_main_process([&] { ran += 1; })();
    accelerator.on_last_process([&] { ran += 10; })();
    accelerator.on_local_main_process([&] { ran += 100; })();
    for (int k = 0; k < P; ++k) accelerator.on_process([&] { ran += 1000; }, k)();
    CHECK(ran == (r == 0 ? 1 : 0) + (r == P - 1 ? 10 : 0) + (accelerator.is_local_main_process() ? 100 : 0) + 1000);
    CHECK(accelerator.reduce(at::ones({2})).sum().item<double>() == 2.0 * P);  // Accelerate's default: sum
    CHECK(accelerator.gather(at::full({1}, r)).size(0) == P);
    CHECK(accelerator.pad_across_processes(at::ones({r + 1})).size(0) == P);
    CHECK(accelerator.split_between_processes(std::vector<int>(static_cast<std::size_t>(P), 1)).size() == 1);
  }

  // Sharded data parallel (ZeRO-2 and ZeRO-3): the training of one process
  // on the global batch, every replica identical, optimizer state and
  // gradients 1/S (and under FULL_SHARD the parameters at rest: none).
  TEST_CASE("sharding: SHARD_GRAD_OP and FULL_SHARD train as one process on the global batch, with 1/S of the state") {
    for (const int variant : {0, 1, 2, 3, 4, 5}) {  // SGD momentum, Adam, SGD momentum with 2 accumulation steps; x2
      const auto strategy = variant < 3 ? accel::ShardingStrategy::SHARD_GRAD_OP : accel::ShardingStrategy::FULL_SHARD;
      const bool adam = variant % 3 == 1;
      const int micro = variant % 3 == 2 ? 2 : 1;
      CAPTURE(variant);
      accel::AcceleratorConfig c = config(micro);
      c.sharding_strategy = strategy;
      c.bucket_cap_mb = 1;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      CHECK(accelerator.sharding_strategy() == (P > 1 ? strategy : accel::ShardingStrategy::NO_SHARD));
      // A fixed start: Adam divides by the gradients' size, so a gradient near zero would turn float32
      // summation noise into a visible step; the figures below are those of this start.
      torch::manual_seed(5);
      Mlp model(5, 33, 2);  // 33: sizes that 2, 3 and 4 do not divide (padded chunks)
      accelerator.prepare(model);
      const bool full = P > 1 && strategy == accel::ShardingStrategy::FULL_SHARD;
      CHECK(accelerator.data_parallel(model)->unit_count() == (full ? 3u : 0u));  // the three Linear layers
      auto at_rest = [&] {  // bytes the parameters hold between steps
        std::size_t bytes = 0;
        for (const auto& p : model->parameters()) bytes += p.storage().nbytes();
        return bytes;
      };
      if (full) CHECK(at_rest() == 0);
      Mlp local = [&] {
        const auto whole = accelerator.data_parallel(model)->summon_full_params();
        return copy_of(model, 5, 33, 2);
      }();
      auto make = [&](Mlp& m) -> std::unique_ptr<torch::optim::Optimizer> {
        if (adam) return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
        return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      };
      auto optimizer = make(model), local_optimizer = make(local);
      accel::AcceleratedOptimizer prepared = accelerator.prepare(*optimizer);
      auto generator = at::detail::createCPUGenerator(11);
      double worst_norm = 0;
      if (const auto& shards = accelerator.data_parallel(model)->shard_group()) start_sequence(shards);
      for (int step = 0; step < 5; ++step) {
        // `micro` micro-batches of 2 rows per process; the one process takes them all at once
        const at::Tensor x = at::randn({2 * P * micro, 5}, generator), y = at::randn({2 * P * micro, 1}, generator);
        double norm = 0;
        const accel::GroupPtr& shards = accelerator.data_parallel(model)->shard_group();
        const int64_t sequence = shards ? shards->getSequenceNumberForGroup() : 0;
        for (int k = 0; k < micro; ++k) {
          auto guard = accelerator.accumulate(model);
          const int64_t at = (k * P + r) * 2;
          accelerator.backward(torch::mse_loss(model(x.narrow(0, at, 2)), y.narrow(0, at, 2)));
          if (accelerator.sync_gradients()) norm = accelerator.clip_grad_norm_(model->parameters(), 0.5);
          prepared.step();
          if (step < 4) prepared.zero_grad();  // the last step's gradients are counted below
        }
        if (shards) {  // collectives per step on the shard group: nothing gathered twice
          // ZeRO-2: a reduce-scatter and an all-gather per bucket (one here), the norm's all-reduce.
          // FULL_SHARD: per unit and micro-step an all-gather for forward and one for backward, and per unit
          // a reduce-scatter; the norm's all-reduce.
          const int64_t collectives = shards->getSequenceNumberForGroup() - sequence;
          CHECK(collectives == (full ? 3 * 2 * micro + 3 + 1 : 1 + 1 + 1));
        }
        local_optimizer->zero_grad();
        torch::mse_loss(local(x), y).backward();
        const double local_norm = torch::nn::utils::clip_grad_norm_(local->parameters(), 0.5);
        local_optimizer->step();
        worst_norm = std::max(worst_norm, std::abs(norm - local_norm) / local_norm);
      }
      if (full) CHECK(at_rest() == 0);
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      const double difference = (flat_parameters(*model) - flat_parameters(*local)).abs().max().item<double>();
      MESSAGE(std::string(accel::to_string(strategy))
              << " at " << P << " process(es), " << std::string(adam ? "Adam" : "SGD momentum")
              << std::string(micro > 1 ? ", 2 accumulation steps" : "")
              << ": largest parameter difference to one process " << difference
              << ", gradient norm relative difference " << worst_norm);
      CHECK(difference < 1e-5);
      CHECK(worst_norm < 1e-5);
      if (P > 1) CHECK(identical_across_ranks(*model, world().world_group()));
      // Optimizer state: a chunk of ceil(numel / P) per parameter, per buffer.
      int64_t expected = 0, state = 0, gradients = 0;
      for (const auto& p : model->parameters()) expected += (p.numel() + P - 1) / P * (adam ? 2 : 1);
      for (const auto& entry : optimizer->state()) {
        if (adam) {
          const auto& s = static_cast<torch::optim::AdamParamState&>(*entry.second);
          state += s.exp_avg().numel() + s.exp_avg_sq().numel();
        } else {
          state += static_cast<torch::optim::SGDParamState&>(*entry.second).momentum_buffer().numel();
        }
      }
      for (const auto& group : optimizer->param_groups())
        for (const auto& p : group.params()) gradients += p.grad().defined() ? p.grad().numel() : 0;
      CHECK(state == expected);
      CHECK(gradients * (adam ? 2 : 1) == expected);
      if (P > 1)
        for (const auto& p : model->parameters()) CHECK_FALSE(p.grad().defined());  // released at the step
    }
  }

  TEST_CASE("sharding: an optimizer stepped directly, or not prepared, is an error; checkpoints are per process") {
    namespace fs = std::filesystem;
    accel::AcceleratorConfig c = config();
    c.sharding_strategy = accel::ShardingStrategy::SHARD_GRAD_OP;
    const auto data = dataset(8, 4);
    auto loss_of = [&](Mlp& m) { return torch::mse_loss(m(data.first), data.second); };
    {
      accel::Accelerator accelerator(c);
      if (accelerator.num_processes() == 1) return;  // nothing is sharded
      Mlp model(4, 8, 1);
      accelerator.prepare(model);
      CHECK_THROWS_WITH_AS(accelerator.backward(loss_of(model)), doctest::Contains("is in no prepared optimizer"),
                           accel::InvalidArgument);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      auto prepared = accelerator.prepare(sgd);
      accelerator.backward(loss_of(model));
      sgd.step();  // not through `prepared`
      CHECK_THROWS_WITH_AS(accelerator.backward(loss_of(model)),
                           doctest::Contains("step the optimizer through the handle accelerator.prepare() returned"),
                           accel::InvalidArgument);
      Mlp other(4, 8, 1);
      torch::optim::LBFGS lbfgs(other->parameters());
      accelerator.prepare(other);
      CHECK_THROWS_WITH_AS(accelerator.prepare(lbfgs), doctest::Contains("LBFGS cannot step shards"),
                           accel::InvalidArgument);
      CHECK_THROWS_WITH_AS(accelerator.join_uneven_inputs([] {}, model), doctest::Contains("not under sharding yet"),
                           accel::InvalidArgument);
    }
    {  // FULL_SHARD: a unit called around unit_forward finds no data (LibTorch's error, not garbage); a policy
       // that chooses no unit is refused
      c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
      accel::Accelerator accelerator(c);
      Mlp model(4, 8, 1);
      accelerator.prepare(model);
      const std::string bypass = what_of([&] { model->body->forward(data.first); });
      CAPTURE(bypass);
      // (LibTorch's words: a view of a parameter finds "storage of size 0", a direct read "data is not allocated")
      CHECK((bypass.find("storage of size 0") != std::string::npos ||
             bypass.find("data is not allocated") != std::string::npos));
      c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) { return name == "nothing"; };
      accel::Accelerator none(c);
      Mlp other(4, 8, 1);
      CHECK_THROWS_WITH_AS(none.prepare(other), doctest::Contains("FULL_SHARD found no unit in the model"),
                           accel::InvalidArgument);
      // Tied weights: in two units, or in a unit and outside it, they cannot be freed alone.
      const at::Tensor w = at::randn({4, 4});
      torch::nn::Sequential tied(std::make_shared<TiedImpl>(w), std::make_shared<TiedImpl>(w));
      accel::AcceleratorConfig d = c;
      d.auto_wrap_policy = {};
      accel::Accelerator both(d);
      CHECK_THROWS_WITH_AS(both.prepare(tied), doctest::Contains("is in two fully sharded units"), accel::InvalidArgument);
      d.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) { return name == "0"; };
      accel::Accelerator first(d);
      torch::nn::Sequential tied_again(std::make_shared<TiedImpl>(w), std::make_shared<TiedImpl>(w));
      CHECK_THROWS_WITH_AS(first.prepare(tied_again), doctest::Contains("must own its storage"), accel::InvalidArgument);
      c.auto_wrap_policy = {};
    }

    // A checkpoint: each process's optimizer shard in a file of its own; the
    // run resumed from it goes on bit for bit. FULL_SHARD's model file holds
    // whole parameters, and save_model/load_model see them too.
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::FULL_SHARD}) {
    CAPTURE(accel::to_string(strategy));
    c.sharding_strategy = strategy;
    accel::Accelerator accelerator(c);
    const int P = accelerator.num_processes();
    Mlp model(4, 16, 1);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto prepared = accelerator.prepare(model, adam);
    auto parameters = [&] {
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      return flat_parameters(*model).clone();
    };
    auto train = [&](int steps) {
      for (int i = 0; i < steps; ++i) {
        std::get<1>(prepared).zero_grad();
        accelerator.backward(loss_of(model));
        std::get<1>(prepared).step();
      }
      return parameters();
    };
    const fs::path dir = shared_temp_path(accelerator, "accel_sharded_ckpt_");
    const at::Tensor saved = train(2);
    accelerator.save_state(dir);
    for (int rank = 0; rank < P; ++rank) CHECK(fs::exists(dir / ("optimizer_rank" + std::to_string(rank) + ".pt")));
    CHECK_FALSE(fs::exists(dir / "optimizer.pt"));
    {
      torch::serialize::InputArchive archive;
      archive.load_from((dir / "model.pt").string());
      Mlp plain(4, 16, 1);
      plain->load(archive);
      CHECK(at::equal(flat_parameters(*plain), saved));  // whole parameters, under every strategy
    }
    const at::Tensor straight = train(3);
    accelerator.load_state(dir);
    CHECK(at::equal(train(3), straight));
    accelerator.save_model(model, (dir / "export").string());
    const at::Tensor exported = parameters();
    train(1);
    accelerator.load_model(model, (dir / "export").string());
    CHECK(at::equal(parameters(), exported));
    train(1);  // training goes on from the loaded weights, on every process alike
    {
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      CHECK(identical_across_ranks(*model, world().world_group()));
    }
    {  // the same checkpoint in an unsharded run: refused, nothing changed
      accel::AcceleratorConfig plain = config();
      accel::Accelerator other(plain);
      Mlp m(4, 16, 1);
      torch::optim::Adam o(m->parameters(), torch::optim::AdamOptions(1e-2));
      other.prepare(m, o);
      CHECK(what_of([&] { other.load_state(dir); })
                .find("its optimizer state is sharded " + std::to_string(P) + " way(s), this run's 1 way(s)") !=
            std::string::npos);
    }
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) fs::remove_all(dir);
    }
  }

  // ZeRO-3 against ZeRO-2, which share their numerics: bit for bit equal under bf16 autocast, with a unit that some
  // steps leave out (its prefetch is issued and dropped, its parameters keep their values), and in evaluation.
  TEST_CASE("sharding: FULL_SHARD equals SHARD_GRAD_OP bit for bit under bf16 autocast, with a unit left out") {
    struct NetImpl : torch::nn::Module {
      NetImpl()
          : fc1(register_module("fc1", torch::nn::Linear(6, 20))), fc2(register_module("fc2", torch::nn::Linear(20, 20))),
            fc3(register_module("fc3", torch::nn::Linear(20, 1))) {}
      at::Tensor forward(const at::Tensor& x, bool middle) {
        at::Tensor h = accel::unit_forward(fc1, x).tanh();
        if (middle) h = accel::unit_forward(fc2, h).tanh();
        return accel::unit_forward(fc3, h);
      }
      torch::nn::Linear fc1, fc2, fc3;
    };
    TORCH_MODULE(Net);
    std::vector<at::Tensor> finals, evaluations;
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::FULL_SHARD}) {
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      c.mixed_precision = "bf16";
      accel::Accelerator accelerator(c);
      const int r = accelerator.process_index();
      torch::manual_seed(8);
      Net model;
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
      auto prepared = accelerator.prepare(model, adam);
      auto generator = at::detail::createCPUGenerator(40 + r);
      for (int step = 0; step < 5; ++step) {
        const at::Tensor x = at::randn({4, 6}, generator), y = at::randn({4, 1}, generator);
        std::get<1>(prepared).zero_grad();
        {
          auto autocast = accelerator.autocast();
          accelerator.backward(torch::mse_loss(model->forward(x, step != 2).to(at::kFloat), y));
        }
        std::get<1>(prepared).step();
      }
      {
        torch::NoGradGuard no_grad;
        evaluations.push_back(model->forward(at::ones({2, 6}), true));
      }
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      finals.push_back(flat_parameters(*model).clone());
    }
    CHECK(at::equal(finals[0], finals[1]));
    CHECK(at::equal(evaluations[0], evaluations[1]));
  }

  // HSDP on a 2 x 2 model mesh: shards along mp_shard, averaged along
  // mp_replicate; with SHARD_GRAD_OP that is FSDP's _HYBRID_SHARD_ZERO2, with
  // HYBRID_SHARD the parameters are sharded at rest too. FULL_SHARD on a
  // mesh that replicates is refused (it would leave the replicas apart).
  TEST_CASE("sharding: SHARD_GRAD_OP and HYBRID_SHARD on a 2 x 2 model mesh (replicated shards) train as one process") {
    if (world().get_world_size() != 4) return;
    accel::AcceleratorConfig c = config();
    c.distributed = test_config({.mp_replicate_size = 2});
    world().destroy();
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::HYBRID_SHARD}) {
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      CHECK(accelerator.sharding_strategy() == strategy);
      Mlp model(5, 33, 2);
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
      auto prepared = accelerator.prepare(model, adam);
      accel::DataParallel& dp = *accelerator.data_parallel(model);
      CHECK(dp.unit_count() == (strategy == accel::ShardingStrategy::HYBRID_SHARD ? 3u : 0u));
      Mlp local = [&] {
        const auto whole = dp.summon_full_params();
        return copy_of(model, 5, 33, 2);
      }();
      torch::optim::Adam local_adam(local->parameters(), torch::optim::AdamOptions(1e-2));
      auto generator = at::detail::createCPUGenerator(12);
      for (int step = 0; step < 5; ++step) {
        const at::Tensor x = at::randn({2 * P, 5}, generator), y = at::randn({2 * P, 1}, generator);
        std::get<1>(prepared).zero_grad();
        accelerator.backward(torch::mse_loss(model(x.narrow(0, 2 * r, 2)), y.narrow(0, 2 * r, 2)));
        std::get<1>(prepared).step();
        local_adam.zero_grad();
        torch::mse_loss(local(x), y).backward();
        local_adam.step();
      }
      const auto whole = dp.summon_full_params();
      const double difference = (flat_parameters(*model) - flat_parameters(*local)).abs().max().item<double>();
      MESSAGE(std::string(accel::to_string(strategy))
              << " on a 2 x 2 model mesh, Adam: largest parameter difference to one process " << difference);
      CHECK(difference < 1e-5);
      CHECK(identical_across_ranks(*model, accel::DistributedInterface::instance().world_group()));
      int64_t expected = 0, state = 0;
      for (const auto& p : model->parameters()) expected += (p.numel() + 1) / 2 * 2;  // halves, along mp_shard
      for (const auto& entry : adam.state()) {
        const auto& s = static_cast<torch::optim::AdamParamState&>(*entry.second);
        state += s.exp_avg().numel() + s.exp_avg_sq().numel();
      }
      CHECK(state == expected);
    }
    c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("FULL_SHARD shards along mp_shard only"),
                         accel::InvalidArgument);
    accel::DistributedInterface::instance().destroy();
  }

  TEST_CASE("training cleanup") { release_world(); }
}

TEST_SUITE("single") {
  // DDP's bucket assignment (torch's ComputeBucketAssignmentTest in
  // test/distributed/test_c10d_common.py, with its expected values), then
  // FULL_SHARD's units, then 300 random cases against the leg's own torch.
  TEST_CASE("bucket assignment: DDP's compute_bucket_assignment_by_size cases, units, and Python's on random cases") {
    using accel::detail::BucketInput;
    auto f = [](int64_t n, int64_t unit = -1) { return BucketInput{at::kFloat, at::kCPU, 4 * n, unit}; };
    auto d = [](int64_t n) { return BucketInput{at::kDouble, at::kCPU, 8 * n, -1}; };
    using Buckets = std::vector<std::vector<std::size_t>>;
    using Limits = std::vector<int64_t>;
    auto assign = [](const std::vector<BucketInput>& in, const Limits& limits) {
      return accel::detail::compute_bucket_assignment_by_size(in, limits);
    };
    {  // test_single_limit_single_dtype
      const auto a = assign({f(100), f(200), f(100), f(50)}, {400});
      CHECK(a.buckets == Buckets{{0}, {1}, {2}, {3}});
      CHECK(a.size_limits == Limits{400, 400, 400, 400});
    }
    {  // test_single_limit_multi_dtype
      const auto a = assign({f(50), d(25), f(50), d(25), f(50), d(25)}, {400});
      CHECK(a.buckets == Buckets{{0, 2}, {1, 3}, {4}, {5}});
      CHECK(a.size_limits == Limits{400, 400, 400, 400});
    }
    {  // test_multi_limit_single_dtype
      const auto a = assign({f(10), f(10), f(10), f(10)}, {40, 80});
      CHECK(a.buckets == Buckets{{0}, {1, 2}, {3}});
      CHECK(a.size_limits == Limits{40, 80, 80});
    }
    {  // test_multi_limit_multi_dtype
      const auto a = assign({f(50), d(25), f(50), d(25), f(50), d(25)}, {200, 400});
      CHECK(a.buckets == Buckets{{0}, {1}, {2, 4}, {3, 5}});
      CHECK(a.size_limits == Limits{200, 200, 400, 400});
    }
    {  // units: a bucket per unit whatever its size (limit 0), the rest by size, ordered by first index
      const auto a = assign({f(100, 0), f(100, 0), f(50), f(300, 1), f(100), f(100)}, {400});
      CHECK(a.buckets == Buckets{{0, 1}, {2, 4}, {3}, {5}});  // 200 + 400 bytes close {2, 4}
      CHECK(a.size_limits == Limits{0, 400, 0, 400});
    }
    {  // a device is part of the key, as the dtype is
      const auto a = assign({f(10), BucketInput{at::kFloat, c10::Device(at::kMeta), 40, -1}, f(10)}, {80});
      CHECK(a.buckets == Buckets{{0, 2}, {1}});
    }
    CHECK(assign({}, {400}).buckets.empty());
    CHECK_THROWS_WITH_AS(assign({f(1)}, {}), doctest::Contains("needs a size limit"), accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(assign({f(1)}, {400, 0}), doctest::Contains("limit 0 is not positive"), accel::InvalidArgument);

    // Random cases: Python prints each case and torch's answer; ours must be the same.
    const char* script =
        "import random, torch, torch.distributed as dist\n"
        "random.seed(7)\n"
        "dt = {'f': torch.float, 'd': torch.double, 'h': torch.half}\n"
        "for case in range(300):\n"
        "  ts = [(random.choice([1, 10, 25, 50, 100, 200, 1000]), random.choice('fdh')) for _ in range(random.randint(1, 12))]\n"
        "  limits = random.sample([40, 100, 200, 400, 800, 4000], random.randint(1, 3))\n"
        "  r = dist._compute_bucket_assignment_by_size([torch.empty([m], dtype=dt[c]) for m, c in ts], limits)\n"
        "  print(' '.join(map(str, limits)), '|', ' '.join(f'{m}{c}' for m, c in ts), '|',\n"
        "        ' '.join(','.join(map(str, b)) for b in r[0]), '|', ' '.join(map(str, r[1])))\n";
    const std::string python = python_output(script, "buckets");
    std::istringstream lines(python);
    std::ostringstream ours;
    int cases = 0;
    for (std::string line; std::getline(lines, line); ++cases) {
      std::istringstream words(line);
      Limits limits;
      std::vector<BucketInput> inputs;
      std::string word;
      while (words >> word && word != "|") limits.push_back(std::stoll(word));
      while (words >> word && word != "|") {
        const char code = word.back();
        const auto dtype = code == 'f' ? at::kFloat : code == 'd' ? at::kDouble : at::kHalf;
        inputs.push_back({dtype, at::kCPU, std::stoll(word) * static_cast<int64_t>(c10::elementSize(dtype)), -1});
      }
      const auto a = assign(inputs, limits);
      for (std::size_t i = 0; i < limits.size(); ++i) ours << (i ? " " : "") << limits[i];
      ours << " |";
      for (std::size_t i = 0; i < inputs.size(); ++i)
        ours << ' ' << inputs[i].bytes / static_cast<int64_t>(c10::elementSize(inputs[i].dtype))
             << (inputs[i].dtype == at::kFloat ? 'f' : inputs[i].dtype == at::kDouble ? 'd' : 'h');
      ours << " |";
      for (const auto& bucket : a.buckets) {
        ours << ' ';
        for (std::size_t i = 0; i < bucket.size(); ++i) ours << (i ? "," : "") << bucket[i];
      }
      ours << " |";
      for (int64_t limit : a.size_limits) ours << ' ' << limit;
      ours << '\n';
    }
    CHECK(cases == 300);
    CHECK(ours.str() == python);
  }

  TEST_CASE("data: ShardSampler's shards are Python's DistributedSampler's, for the same seed and epoch") {
    // Python prints its shards (the leg's own torch: ACCEL_TEST_PYTHON, else
    // Debian's python3-torch); ours must be the same lists.
    const char* script =
        "import torch\n"
        "from torch.utils.data import DistributedSampler as D\n"
        "for n in (1, 3, 7, 10, 33):\n"
        "  for P in (1, 2, 3, 4):\n"
        "    for s in (0, 1):\n"
        "      for e in (0, 1):\n"
        "        for r in range(P):\n"
        "          d = D(range(n), num_replicas=P, rank=r, shuffle=bool(s), seed=3)\n"
        "          d.set_epoch(e)\n"
        "          print(n, P, s, e, r, *list(d))\n";
    const std::string python = python_output(script, "sampler");
    std::ostringstream ours;
    for (std::size_t n : {1, 3, 7, 10, 33})
      for (std::size_t P = 1; P <= 4; ++P)
        for (int s = 0; s <= 1; ++s)
          for (int e = 0; e <= 1; ++e)
            for (std::size_t r = 0; r < P; ++r) {
              auto record = std::make_shared<accel::ShardSampler::Record>();
              record->epoch = static_cast<std::size_t>(e);
              accel::ShardSampler sampler({.size = n, .num_replicas = P, .rank = r, .shuffle = s == 1, .seed = 3,
                                           .layout = accel::ShardLayout::SAMPLES},
                                          record);
              ours << n << ' ' << P << ' ' << s << ' ' << e << ' ' << r;
              for (std::size_t i : sampler.indices()) ours << ' ' << i;
              ours << '\n';
            }
    CHECK(ours.str() == python);
  }

  // Accelerate's tests/test_data_loader.py, BatchSamplerShard on 2 processes,
  // with its expected batches. Each case: dataset size, batch size, drop_last,
  // split_batches, even_batches, then process 0's and process 1's batches.
  TEST_CASE("data: Accelerate's BatchSamplerShard cases, with its expected values") {
    using Batches = std::vector<std::vector<std::size_t>>;
    struct Case {
      std::size_t n, batch;
      bool drop_last, split, even;
      Batches p0, p1;
    };
    const Batches a0{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, a1{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}};
    const Batches d0{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, d1{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}};
    const Batches s0{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, s1{{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}};
    const Batches t0{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}}, t1{{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}};
    const std::vector<Case> cases{
        // test_batch_sampler_shards_with_no_splits
        {24, 3, false, false, true, a0, a1},
        {24, 3, true, false, true, a0, a1},
        {21, 3, false, false, true, a0, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {0, 1, 2}}},
        {21, 3, true, false, true, d0, d1},
        {22, 3, false, false, true, a0, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 0, 1}}},
        {22, 3, true, false, true, d0, d1},
        {20, 3, false, false, true, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 0}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {1, 2, 3}}},
        {20, 3, true, false, true, d0, d1},
        {2, 3, false, false, true, {{0, 1, 0}}, {{1, 0, 1}}},
        {2, 3, true, false, true, {}, {}},
        // test_batch_sampler_shards_with_splits
        {24, 4, false, true, true, s0, s1},
        {24, 4, true, true, true, s0, s1},
        {22, 4, false, true, true, s0, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {0, 1}}},
        {22, 4, true, true, true, t0, t1},
        {21, 4, false, true, true, {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 0}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {1, 2}}},
        {21, 4, true, true, true, t0, t1},
        {2, 4, false, true, true, {{0, 1}}, {{0, 1}}},
        {2, 4, true, true, true, {}, {}},
        // test_batch_sampler_shards_with_no_splits_no_even
        {24, 3, false, false, false, a0, a1},
        {24, 3, true, false, false, a0, a1},
        {21, 3, false, false, false, a0, d1},
        {21, 3, true, false, false, d0, d1},
        {22, 3, false, false, false, a0, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21}}},
        {22, 3, true, false, false, d0, d1},
        {20, 3, false, false, false, {{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19}}, d1},
        {20, 3, true, false, false, d0, d1},
        {2, 3, false, false, false, {{0, 1}}, {}},
        {2, 3, true, false, false, {}, {}},
        // test_batch_sampler_shards_with_splits_no_even
        {24, 4, false, true, false, s0, s1},
        {24, 4, true, true, false, s0, s1},
        {22, 4, false, true, false, s0, t1},
        {22, 4, true, true, false, t0, t1},
        {21, 4, false, true, false, {{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20}}, t1},
        {21, 4, true, true, false, t0, t1},
        {2, 4, false, true, false, {{0, 1}}, {}},
        {2, 4, true, true, false, {}, {}},
    };
    for (const auto& c : cases) {
      CAPTURE(c.n);
      CAPTURE(c.batch);
      CAPTURE(c.drop_last);
      CAPTURE(c.split);
      CAPTURE(c.even);
      for (std::size_t r = 0; r < 2; ++r) {
        accel::ShardSampler sampler({.size = c.n, .num_replicas = 2, .rank = r, .batch_size = c.batch,
                                     .even_batches = c.even, .drop_last = c.drop_last, .split_batches = c.split});
        CHECK(sampler.batches() == (r == 0 ? c.p0 : c.p1));
      }
    }
    // test_batch_sampler_with_varying_batch_size and ..._varying_batch_size_{even_batches,many_processes}
    struct Varying {
      Batches sequence;
      std::size_t processes;
      bool even, drop_last;
      std::vector<Batches> expected;
    };
    const Batches five{{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}, {12, 13}};
    const std::vector<Varying> varying{
        {five, 2, false, false, {{{0, 1, 2}, {5, 6, 7, 8}, {12, 13}}, {{3, 4}, {9, 10, 11}}}},
        {{{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}}, 2, true, false, {{{0, 1, 2}, {5, 6, 7, 8}}, {{3, 4}, {9, 10, 11}}}},
        {five, 2, true, false, {{{0, 1, 2}, {5, 6, 7, 8}, {12, 13}}, {{3, 4}, {9, 10, 11}, {0, 1, 2}}}},
        {{{0, 1, 2}}, 2, true, false, {{{0, 1, 2}}, {{0, 1, 2}}}},
        {{{0, 1, 2}}, 3, true, false, {{{0, 1, 2}}, {{0, 1, 2}}, {{0, 1, 2}}}},
        {five, 2, true, true, {{{0, 1, 2}, {5, 6, 7, 8}}, {{3, 4}, {9, 10, 11}}}},
        {{{0}, {1, 2}, {3, 4, 5}, {6}, {7, 8}, {9, 10, 11}}, 3, true, false,
         {{{0}, {6}}, {{1, 2}, {7, 8}}, {{3, 4, 5}, {9, 10, 11}}}},
        {{{0}, {1, 2}, {3, 4, 5}, {6}, {7, 8}, {9, 10, 11}, {12, 13}}, 3, true, false,
         {{{0}, {6}, {12, 13}}, {{1, 2}, {7, 8}, {0}}, {{3, 4, 5}, {9, 10, 11}, {1, 2}}}},
    };
    for (std::size_t k = 0; k < varying.size(); ++k) {
      CAPTURE(k);
      const auto& v = varying[k];
      for (std::size_t r = 0; r < v.processes; ++r) {
        accel::ShardSampler sampler({.size = 14, .num_replicas = v.processes, .rank = r, .even_batches = v.even,
                                     .drop_last = v.drop_last,
                                     .batch_sampler = [&v](std::size_t) { return v.sequence; }});
        CHECK(sampler.batches() == v.expected[r]);
      }
    }
    // test_split_batches_validates_*: split_batches needs a batch size that divides among the processes.
    CHECK_THROWS_WITH_AS(accel::ShardSampler({.size = 20, .num_replicas = 2, .batch_size = 3, .split_batches = true}),
                         doctest::Contains("must be a multiple of the 2 processes"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        accel::ShardSampler({.size = 8, .num_replicas = 2, .split_batches = true,
                             .batch_sampler = [](std::size_t) { return Batches{{0, 1, 2, 3}, {4, 5, 6, 7}}; }}),
        doctest::Contains("split_batches needs a fixed batch size"), std::invalid_argument);
  }

  TEST_CASE("data: shards cover the dataset; repeats only with even_batches, and known as repeats") {
    for (auto layout : {accel::ShardLayout::BATCHES, accel::ShardLayout::SAMPLES})
    for (std::size_t n = 0; n <= 9; ++n)
      for (std::size_t P = 1; P <= 4; ++P)
        for (bool even : {true, false})
          for (bool shuffle : {true, false}) {
            CAPTURE(layout == accel::ShardLayout::BATCHES);
            CAPTURE(n);
            CAPTURE(P);
            CAPTURE(even);
            std::vector<int> seen(n, 0);
            std::size_t real = 0, longest = 0, shortest = SIZE_MAX;
            for (std::size_t r = 0; r < P; ++r) {
              accel::ShardSampler sampler({.size = n, .num_replicas = P, .rank = r, .shuffle = shuffle, .seed = 11,
                                           .even_batches = even, .layout = layout});
              const auto indices = sampler.indices();
              // the real samples come first; repeats only at the end of a shard
              for (std::size_t k = 0; k < sampler.real_count(); ++k) ++seen.at(indices[k]);
              real += sampler.real_count();
              longest = std::max(longest, indices.size());
              shortest = std::min(shortest, indices.size());
              if (!even) CHECK(sampler.real_count() == indices.size());
            }
            CHECK(real == n);
            CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
            if (even) CHECK(longest == shortest);
            else CHECK(longest - shortest <= 1);
          }
    CHECK_THROWS_AS(accel::ShardSampler({.size = 4, .num_replicas = 2, .rank = 2}), std::invalid_argument);
  }

  TEST_CASE("checkpoints: a process killed at any step of save_state leaves the newest complete checkpoint") {
    namespace fs = std::filesystem;
    accel::Accelerator accelerator(config());
    Mlp model(4, 8, 1);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    accelerator.prepare(model, optimizer);
    auto set_weights = [&](double value) {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(value);
    };
    auto weights = [&] { return model->parameters()[0].detach()[0][0].item<double>(); };
    const fs::path base = fs::temp_directory_path() / ("accel_crash_" + std::to_string(getpid()));
    fs::path dir;
    // A child process saves weights `value` and dies at `step` of the save.
    auto crash_saving = [&](double value, const char* step) {
      const pid_t child = fork();
      if (child == 0) {
        set_weights(value);
        accel::detail::checkpoint_hook() = [step](const char* at) {
          if (std::strcmp(at, step) == 0) std::_Exit(3);
        };
        accelerator.save_state(dir);
        std::_Exit(0);  // the step never came
      }
      int status = 0;
      REQUIRE(waitpid(child, &status, 0) == child);
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    };
    // Can this filesystem exchange two directories in one step?
    fs::create_directories(base / "a");
    fs::create_directories(base / "b");
    const bool can_exchange =
        ::renameat2(AT_FDCWD, (base / "a").c_str(), AT_FDCWD, (base / "b").c_str(), RENAME_EXCHANGE) == 0;
    fs::remove_all(base);
    if (!can_exchange) MESSAGE("no RENAME_EXCHANGE in " << fs::temp_directory_path() << ": two renames only");
    for (const bool exchange : {true, false}) {
      if (exchange && !can_exchange) continue;
      accel::detail::checkpoint_use_exchange() = exchange;
      const std::vector<const char*> steps =
          exchange ? std::vector<const char*>{"files written", "manifest written", "exchanged"}
                   : std::vector<const char*>{"files written", "manifest written", "between renames", "renamed"};
      for (const char* step : steps) {
        CAPTURE(exchange);
        CAPTURE(step);
        dir = base / "ckpt";
        set_weights(1);
        accelerator.save_state(dir);
        REQUIRE(crash_saving(2, step) == 3);
        // Not whole before its manifest is written; whole after.
        const double newest = std::strcmp(step, "files written") == 0 ? 1 : 2;
        // A later save that dies before its checkpoint is whole deletes nothing.
        REQUIRE(crash_saving(3, "files written") == 3);
        set_weights(0);
        accelerator.load_state(dir);
        CHECK(weights() == newest);
        CHECK_FALSE(fs::exists(dir.string() + ".tmp"));
        CHECK_FALSE(fs::exists(dir.string() + ".old"));
        set_weights(4);
        accelerator.save_state(dir);  // and saving goes on as usual
        set_weights(0);
        accelerator.load_state(dir);
        CHECK(weights() == 4);
        fs::remove_all(base);
      }
    }
    accel::detail::checkpoint_use_exchange() = true;
    // No checkpoint at all, and paths that name none.
    CHECK_THROWS_WITH_AS(accelerator.load_state(base / "none"), doctest::Contains("no checkpoint directory"),
                         accel::InvalidArgument);
    CHECK_THROWS_AS(accelerator.save_state(""), accel::InvalidArgument);
    CHECK_THROWS_AS(accelerator.save_state("/"), accel::InvalidArgument);
    world().destroy();
  }

  TEST_CASE("checkpoints: automatic naming keeps the newest whole checkpoint through crashes; bad settings are named") {
    namespace fs = std::filesystem;
    const fs::path project = fs::temp_directory_path() / ("accel_project_crash_" + std::to_string(getpid()));
    accel::AcceleratorConfig c = config();
    c.project_config = {.project_dir = project, .automatic_checkpoint_naming = true, .total_limit = 1};
    accel::Accelerator accelerator(c);
    Mlp model(4, 8, 1);
    accelerator.prepare(model);
    auto set_weights = [&](double value) {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(value);
    };
    auto weights = [&] { return model->parameters()[0].detach()[0][0].item<double>(); };
    auto crash_saving = [&](double value, const char* step) {  // as in the test above
      const pid_t child = fork();
      if (child == 0) {
        set_weights(value);
        accel::detail::checkpoint_hook() = [step](const char* at) {
          if (std::strcmp(at, step) == 0) std::_Exit(3);
        };
        accelerator.save_state();
        std::_Exit(0);
      }
      int status = 0;
      REQUIRE(waitpid(child, &status, 0) == child);
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    };
    auto listing = [&] { return sorted_names(project / "checkpoints"); };
    set_weights(1);
    accelerator.save_state();  // checkpoint_0
    // total_limit=1: Accelerate removes checkpoint_0 before writing
    // checkpoint_1, so a crash here would leave none; it is kept until the new one is whole.
    REQUIRE(crash_saving(2, "files written") == 3);
    set_weights(0);
    accelerator.load_state();
    CHECK(weights() == 1);
    CHECK(accelerator.save_iteration() == 1);
    // A crash once checkpoint_1 is whole (not yet in place): it is the newest.
    REQUIRE(crash_saving(2, "manifest written") == 3);
    CHECK(listing() == std::vector<std::string>{"checkpoint_0", "checkpoint_1.tmp"});
    set_weights(0);
    accelerator.load_state();
    CHECK(weights() == 2);
    CHECK(accelerator.save_iteration() == 2);
    CHECK(listing() == std::vector<std::string>{"checkpoint_0", "checkpoint_1"});
    set_weights(3);
    CHECK(accelerator.save_state() == project / "checkpoints" / "checkpoint_2");
    CHECK(listing() == std::vector<std::string>{"checkpoint_2"});
    fs::remove_all(project);

    // Settings that cannot work, before anything starts.
    auto refused = [&](const std::function<void(accel::ProjectConfiguration&)>& set) {
      accel::AcceleratorConfig bad = config();
      set(bad.project_config);
      return what_of([&] { accel::Accelerator{bad}; });
    };
    CHECK(refused([](auto& p) { p.automatic_checkpoint_naming = true; }) ==
          "accel::Accelerator: automatic_checkpoint_naming needs a project_config.project_dir");
    CHECK(refused([&](auto& p) {
            p.project_dir = project;
            p.total_limit = 2;
          }) == "accel::Accelerator: project_config.total_limit applies to automatic_checkpoint_naming, which is off");
    CHECK(refused([&](auto& p) {
            p.project_dir = project;
            p.automatic_checkpoint_naming = true;
            p.total_limit = 0;
          }) == "accel::Accelerator: project_config.total_limit must be at least 1, got 0");
    CHECK(refused([](auto& p) { p.iteration = -1; }) ==
          "accel::Accelerator: project_config.iteration must not be negative, got -1");
    // ... or changed afterwards, when it is used.
    accelerator.project_configuration().total_limit = 0;
    CHECK_THROWS_WITH_AS(accelerator.save_state(), doctest::Contains("save_state: project_config.total_limit must be"),
                         accel::InvalidArgument);
    accelerator.project_configuration().total_limit.reset();
    accelerator.project_configuration().automatic_checkpoint_naming = false;
    CHECK_THROWS_WITH_AS(accelerator.save_state(), doctest::Contains("no checkpoint path (pass one, or turn on"),
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(accelerator.load_state(), doctest::Contains("no checkpoint path (pass one, or turn on"),
                         accel::InvalidArgument);
    CHECK_FALSE(fs::exists(project));
    world().destroy();
  }

  TEST_CASE("safetensors: save_model writes the format byte for byte; load_model reads it back, sharded or not") {
    namespace fs = std::filesystem;
    accel::Accelerator accelerator(config());
    const fs::path base = fs::temp_directory_path() / ("accel_safetensors_" + std::to_string(getpid()));
    {  // the format: length, JSON header padded with spaces to 8 bytes, little-endian data
      One one(at::tensor({1.0f, 2.0f}));
      accelerator.save_model(one, (base / "one").string());
      std::string header = R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
      header.resize((header.size() + 7) / 8 * 8, ' ');
      std::string expected(8, '\0');
      for (int i = 0; i < 8; ++i) expected[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
      const float data[2] = {1.0f, 2.0f};
      expected += header + std::string(reinterpret_cast<const char*>(data), 8);
      CHECK(file_bytes(base / "one" / "model.safetensors") == expected);
      One other(at::zeros({2}));
      accelerator.load_model(other, (base / "one").string());
      CHECK(at::equal(other->w, at::tensor({1.0f, 2.0f})));
      One bf16(at::tensor({1.5f, -2.0f, 3.25f}).to(at::kBFloat16));
      accelerator.save_model(bf16, (base / "bf16").string());
      CHECK(file_bytes(base / "bf16" / "model.safetensors").find(R"("dtype":"BF16","shape":[3])") != std::string::npos);
      One bf16_back(at::zeros({3}, at::kBFloat16));
      accelerator.load_model(bf16_back, (base / "bf16").string());
      CHECK(at::equal(bf16_back->w, bf16->w));
    }
    Net saved = seeded_net(3);
    accelerator.save_model(saved, (base / "net").string());
    Net loaded = seeded_net(4);
    CHECK_FALSE(same_state(*saved, *loaded));
    accelerator.load_model(loaded, (base / "net").string());
    CHECK(same_state(*saved, *loaded));  // parameters and buffers (num_batches_tracked is int64)

    {  // the free functions, without the Accelerator: the same bytes, read back by either
      accel::save_model(saved, (base / "free").string());
      CHECK(file_bytes(base / "free" / "model.safetensors") == file_bytes(base / "net" / "model.safetensors"));
      Net free_loaded = seeded_net(6);
      accel::load_model(free_loaded, (base / "net").string());
      CHECK(same_state(*saved, *free_loaded));
      CHECK_THROWS_WITH_AS(accel::save_model(saved, (base / "free").string(), 0),
                           "accel::save_model: max_shard_bytes must be positive", accel::InvalidArgument);
    }

    // Sharded above the limit (each shard at most 256 bytes unless one tensor is larger), with an index.
    accelerator.save_model(saved, (base / "net").string(), 256);
    CHECK_FALSE(fs::exists(base / "net" / "model.safetensors"));
    const std::string index = file_bytes(base / "net" / "model.safetensors.index.json");
    CHECK(index.find(R"("weight_map")") != std::string::npos);
    CHECK(index.find(R"("body.1.running_mean": "model-00001-of-)") != std::string::npos);
    int shards = 0;
    for (const auto& entry : fs::directory_iterator(base / "net"))
      shards += entry.path().filename().string().starts_with("model-000");
    CHECK(shards > 1);
    Net from_shards = seeded_net(5);
    accelerator.load_model(from_shards, (base / "net").string());
    CHECK(same_state(*saved, *from_shards));
    accelerator.save_model(saved, (base / "net").string());  // one file again: the shards and index go
    std::size_t files = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(base / "net")) ++files;
    CHECK(files == 1);

    // What does not fit is refused, and nothing is modified.
    auto refused = [&](const std::string& dir, auto& model) {
      const at::Tensor before = flat_parameters(*model).clone();
      const std::string what = what_of([&] { accelerator.load_model(model, dir); });
      CHECK(at::equal(before, flat_parameters(*model)));
      return what;
    };
    Mlp narrow(4, 8, 1), wide(4, 16, 1);
    accelerator.save_model(wide, (base / "wide").string());
    CHECK(refused((base / "wide").string(), narrow).find("body.0.weight is Float[16, 4] there, Float[8, 4] in the model") !=
          std::string::npos);
    const std::string net_into_mlp = refused((base / "net").string(), narrow);
    CHECK(net_into_mlp.find("model.safetensors does not fit the model: missing body.2.weight") != std::string::npos);
    CHECK(net_into_mlp.find("not in the model: body.1.bias, body.1.num_batches_tracked") != std::string::npos);
    fs::copy(base / "net", base / "cut", fs::copy_options::recursive);
    fs::resize_file(base / "cut" / "model.safetensors", fs::file_size(base / "cut" / "model.safetensors") - 4);
    CHECK(refused((base / "cut").string(), loaded).find("do not hold its") != std::string::npos);
    fs::create_directories(base / "junk");
    std::ofstream(base / "junk" / "model.safetensors") << "junk";
    CHECK(refused((base / "junk").string(), loaded).find("is not a safetensors file") != std::string::npos);
    {
      std::string bad = "{\"w\": [1,}";
      std::string bytes(8, '\0');
      bytes[0] = static_cast<char>(bad.size());
      std::ofstream(base / "junk" / "model.safetensors", std::ios::binary) << bytes + bad;
    }
    CHECK(refused((base / "junk").string(), loaded).find("bad JSON at byte") != std::string::npos);
    CHECK(refused((base / "none").string(), loaded).find("missing ") != std::string::npos);
    fs::remove_all(base);
    world().destroy();
  }

  TEST_CASE("training: configuration errors") {
    {  // cpu = true goes to the interface's config, not to the environment
      EnvGuard env{{"ACCEL_DEVICE", nullptr}};
      auto on_cpu = config();
      on_cpu.cpu = true;
      accel::Accelerator accelerator(on_cpu);
      CHECK(std::getenv("ACCEL_DEVICE") == nullptr);
      CHECK(accelerator.device() == c10::Device(c10::kCPU));
      on_cpu.distributed.device = accel::DeviceType::CUDA;
      CHECK_THROWS_WITH_AS(accel::Accelerator{on_cpu}, doctest::Contains("cpu = true, but distributed.device is cuda"),
                           accel::InvalidArgument);
    }
    auto bad = config();
    bad.gradient_accumulation_steps = 0;
    CHECK_THROWS_AS(accel::Accelerator{bad}, std::invalid_argument);
    bad = config();
    bad.mixed_precision = "fp8";
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad}, doctest::Contains("mixed_precision 'fp8'"), std::invalid_argument);
    bad.mixed_precision = "fp16";
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad}, doctest::Contains("needs CUDA"), std::invalid_argument);
    auto bf16 = config();
    bf16.mixed_precision = "bf16";
    accel::Accelerator accelerator(bf16);
    {
      auto autocast = accelerator.autocast();
      at::Tensor out = at::matmul(at::ones({2, 2}), at::ones({2, 2}));
      CHECK((out.scalar_type() == at::kBFloat16));  // LibTorch's CPU autocast at work
    }
    CHECK((at::matmul(at::ones({2, 2}), at::ones({2, 2})).scalar_type() == at::kFloat));
    world().destroy();
  }
}

// Run by tests/python_ref/run_safetensors.sh (CTest safetensors_python)
// around tests/python_ref/safetensors_check.py: skipped otherwise.
TEST_SUITE("python_safetensors" * doctest::skip()) {
  TEST_CASE("write: a model, sharded too, and its outputs, for Python to load") {
    const char* dir = std::getenv("ACCEL_SAFETENSORS_DIR");
    REQUIRE(dir != nullptr);
    accel::Accelerator accelerator(config());
    Net net = seeded_net(3);
    const at::Tensor x = at::linspace(-2, 2, 40).reshape({10, 4});
    torch::NoGradGuard no_grad;
    const at::Tensor y = net(x);
    accelerator.save_model(net, std::string(dir) + "/cpp");
    accelerator.save_model(net, std::string(dir) + "/cpp_sharded", 256);
    accel::detail::write_safetensors(std::string(dir) + "/io.safetensors", {{"x", x}, {"y", y}});
    world().destroy();
  }
  TEST_CASE("read: Python's model gives Python's outputs") {
    const char* dir = std::getenv("ACCEL_SAFETENSORS_DIR");
    REQUIRE(dir != nullptr);
    accel::Accelerator accelerator(config());
    Net net = seeded_net(9);
    accelerator.load_model(net, std::string(dir) + "/py");
    std::map<std::string, at::Tensor> io;
    for (auto& named : accel::detail::read_safetensors(std::string(dir) + "/py_io.safetensors")) io.insert(named);
    REQUIRE(io.count("x") == 1);
    REQUIRE(io.count("y") == 1);
    torch::NoGradGuard no_grad;
    CHECK(at::equal(net(io["x"]), io["y"]));
    CHECK(net->named_buffers()["body.1.num_batches_tracked"].item<int64_t>() == 7);
    world().destroy();
  }
}

// Run by tests/python_ref/run_fsdp2.sh (CTest python_fsdp2_*) around
// tests/python_ref/fsdp2_ref.py, which trains the same model with Python's
// DDP or FSDP2: skipped otherwise. The same start (DIR/init/model.safetensors,
// written by Python), the same batches (DIR/batches.safetensors: x and y,
// [steps, global batch, features], this process's rows of each), Adam with
// the same learning rate; the trained model goes to DIR/cpp_MODE_WORLD for
// fsdp2_ref.py to compare.
TEST_SUITE("python_fsdp2" * doctest::skip()) {
  TEST_CASE("train: Python's start, batches and optimizer under ACCEL_FSDP2_MODE") {
    const char* dir = std::getenv("ACCEL_FSDP2_DIR");
    const char* mode_name = std::getenv("ACCEL_FSDP2_MODE");
    REQUIRE(dir != nullptr);
    REQUIRE(mode_name != nullptr);
    const std::string mode = mode_name;
    const std::map<std::string, accel::ShardingStrategy> strategies{
        {"no_shard", accel::ShardingStrategy::NO_SHARD},
        {"shard_grad_op", accel::ShardingStrategy::SHARD_GRAD_OP},
        {"full_shard", accel::ShardingStrategy::FULL_SHARD},
        {"hybrid_shard", accel::ShardingStrategy::HYBRID_SHARD}};
    REQUIRE(strategies.count(mode) == 1);
    accel::AcceleratorConfig c = config();
    c.sharding_strategy = strategies.at(mode);
    if (mode == "hybrid_shard") c.distributed = test_config({.mp_replicate_size = 2});  // (2, P/2): fsdp2_ref's mesh
    accel::Accelerator accelerator(c);
    const int64_t P = accelerator.num_processes(), r = accelerator.process_index();
    Mlp model(16, 30, 2, 3);  // fsdp2_ref.py's Net
    accelerator.load_model(model, std::string(dir) + "/init");
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));  // fsdp2_ref.py's LR
    accel::AcceleratedOptimizer optimizer = std::get<1>(accelerator.prepare(model, adam));
    std::map<std::string, at::Tensor> batches;
    for (auto& named : accel::detail::read_safetensors(std::string(dir) + "/batches.safetensors")) batches.insert(named);
    const at::Tensor &x = batches.at("x"), &y = batches.at("y");
    REQUIRE(x.size(1) % P == 0);
    const int64_t b = x.size(1) / P;
    for (int64_t step = 0; step < x.size(0); ++step) {
      const at::Tensor loss = torch::mse_loss(model(x[step].narrow(0, r * b, b)), y[step].narrow(0, r * b, b));
      accelerator.backward(loss);
      optimizer.step();
      optimizer.zero_grad();
    }
    accelerator.save_model(model, std::string(dir) + "/cpp_" + mode + "_" + std::to_string(P));
    release_world();
  }
}

// Run by tests/python_ref/run_accelerate.sh (CTest python_accelerate_2) on 2
// processes around tests/python_ref/accelerate_ref.py: skipped otherwise.
// Each process writes DIR/cpp_rank<r>.txt in accelerate_ref.py's format (the
// batches it receives and what gather_for_metrics gives back), for the same
// cases, to be compared line for line with Accelerate's.
TEST_SUITE("python_accelerate" * doctest::skip()) {
  TEST_CASE("loaders: Accelerate's cases, batches and gather_for_metrics written down") {
    const char* dir = std::getenv("ACCEL_ACCELERATE_DIR");
    REQUIRE(dir != nullptr);
    struct Case {
      const char* name;
      std::size_t n, batch;
      bool split, even, dispatch, drop_last;
    };
    const Case cases[] = {  // accelerate_ref.py's CASES
        {"default_10_2", 10, 2, false, true, false, false},  {"default_11_2", 11, 2, false, true, false, false},
        {"default_13_3", 13, 3, false, true, false, false},  {"drop_last_11_3", 11, 3, false, true, false, true},
        {"split_12_4", 12, 4, true, true, false, false},     {"split_13_4", 13, 4, true, true, false, false},
        {"uneven_11_2", 11, 2, false, false, false, false},  {"uneven_13_3", 13, 3, false, false, false, false},
        {"dispatch_10_2", 10, 2, false, true, true, false},  {"dispatch_13_2", 13, 2, false, true, true, false}};
    std::ostringstream out;
    auto line = [&](const char* name, const char* what, const at::Tensor& values) {
      out << name << ' ' << what << ':';
      const at::Tensor flat = values.reshape({-1}).contiguous();
      for (int64_t i = 0; i < flat.numel(); ++i) out << ' ' << flat[i].item<int64_t>();
      out << '\n';
    };
    int rank = 0;
    for (const Case& c : cases) {
      accel::AcceleratorConfig ac = config();
      ac.split_batches = c.split;
      accel::Accelerator accelerator(ac);
      rank = accelerator.process_index();
      auto loader = accelerator.prepare_data_loader(
          Indexed(c.n).map(torch::data::transforms::Stack<>()),
          {.batch_size = c.batch, .even_batches = c.even, .drop_last = c.drop_last, .dispatch_batches = c.dispatch});
      for (auto& batch : loader) {
        line(c.name, "batch", batch.data);
        if (c.even) line(c.name, "gathered", accelerator.gather_for_metrics(batch.data));
      }
      accelerator.wait_for_everyone();
    }
    std::ofstream(std::string(dir) + "/cpp_rank" + std::to_string(rank) + ".txt") << out.str();
    release_world();
  }
}
