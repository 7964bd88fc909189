// The training helpers (Accelerator, DataParallel, prepared data loaders): the
// only test translation unit that includes <torch/torch.h> (ACCEL_TRAINING).

#define ACCEL_TRAINING
#include "test_helpers.hpp"

#include <sys/wait.h>
#include <unistd.h>

namespace {
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t layers) {
    int64_t width = in;
    for (int64_t i = 0; i < layers; ++i) {
      body->push_back(torch::nn::Linear(width, hidden));
      body->push_back(torch::nn::Tanh());
      width = hidden;
    }
    body->push_back(torch::nn::Linear(width, 1));
    register_module("body", body);
  }
  at::Tensor forward(const at::Tensor& x) { return body->forward(x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(Mlp);

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
struct Indexed : torch::data::datasets::Dataset<Indexed> {
  explicit Indexed(std::size_t n) : n(n) {}
  torch::data::Example<> get(std::size_t i) override {
    const auto value = static_cast<int64_t>(i);
    return {at::full({1}, value, at::kLong), at::full({}, value, at::kLong)};
  }
  torch::optional<std::size_t> size() const override { return n; }
  std::size_t n;
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
    if (dp->distributed()) dp->group()->setSequenceNumberForGroup();
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
    std::vector<std::string> where{accelerator.is_main_process()
                                       ? (std::filesystem::temp_directory_path() /
                                          ("accel_ckpt_" + std::to_string(getpid())))
                                             .string()
                                       : ""};
    accel::broadcast_object_list(where);
    const std::filesystem::path dir = where[0];
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
    accelerator.save_state(dir);
    CHECK(std::filesystem::exists(dir / "model.pt"));
    CHECK_FALSE(std::filesystem::exists(dir.string() + ".tmp"));
    const at::Tensor straight = train(3);
    accelerator.load_state(dir);
    const at::Tensor resumed = train(3);
    CHECK(at::equal(straight, resumed));
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
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

  TEST_CASE("training cleanup") { world().destroy(); }
}

TEST_SUITE("single") {
  TEST_CASE("data: ShardSampler's shards are Python's DistributedSampler's, for the same seed and epoch") {
    // Python (Debian's python3-torch, the same LibTorch) prints its shards;
    // ours must be the same lists.
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
    const auto path = std::filesystem::temp_directory_path() / ("accel_sampler_" + std::to_string(getpid()) + ".py");
    std::ofstream(path) << script;
    FILE* pipe = popen(("/usr/bin/python3 " + path.string() + " 2>&1").c_str(), "r");
    REQUIRE(pipe != nullptr);
    std::string python;
    char buffer[4096];
    while (std::size_t got = fread(buffer, 1, sizeof buffer, pipe)) python.append(buffer, got);
    const int status = pclose(pipe);
    std::filesystem::remove(path);
    INFO(python);
    REQUIRE(status == 0);
    std::ostringstream ours;
    for (std::size_t n : {1, 3, 7, 10, 33})
      for (std::size_t P = 1; P <= 4; ++P)
        for (int s = 0; s <= 1; ++s)
          for (int e = 0; e <= 1; ++e)
            for (std::size_t r = 0; r < P; ++r) {
              auto record = std::make_shared<accel::ShardSampler::Record>();
              record->epoch = static_cast<std::size_t>(e);
              accel::ShardSampler sampler(n, P, r, s == 1, 3, true, record);
              ours << n << ' ' << P << ' ' << s << ' ' << e << ' ' << r;
              for (std::size_t i : sampler.indices()) ours << ' ' << i;
              ours << '\n';
            }
    CHECK(ours.str() == python);
  }

  TEST_CASE("data: shards cover the dataset; repeats only with even_batches, and known as repeats") {
    for (std::size_t n = 0; n <= 9; ++n)
      for (std::size_t P = 1; P <= 4; ++P)
        for (bool even : {true, false})
          for (bool shuffle : {true, false}) {
            CAPTURE(n);
            CAPTURE(P);
            CAPTURE(even);
            std::vector<int> seen(n, 0);
            std::size_t real = 0, longest = 0, shortest = SIZE_MAX;
            for (std::size_t r = 0; r < P; ++r) {
              accel::ShardSampler sampler(n, P, r, shuffle, 11, even);
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
    CHECK_THROWS_AS(accel::ShardSampler(4, 2, 2, false, 0, true), std::invalid_argument);
  }

  TEST_CASE("training: a crash while saving leaves the previous checkpoint whole under the final name") {
    accel::Accelerator accelerator(config());
    Mlp model(4, 8, 1);
    torch::optim::SGD optimizer(model->parameters(), 0.1);
    accelerator.prepare(model, optimizer);
    const auto dir = std::filesystem::temp_directory_path() / ("accel_crash_" + std::to_string(getpid()));
    accelerator.save_state(dir);
    const at::Tensor saved = flat_parameters(*model).clone();
    const pid_t child = fork();
    if (child == 0) {  // change the weights, then die in the middle of saving them
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.add_(1.0);
      }
      accel::detail::checkpoint_hook() = [](const char*) { std::_Exit(3); };
      accelerator.save_state(dir);
      std::_Exit(0);  // not reached
    }
    int status = 0;
    REQUIRE(waitpid(child, &status, 0) == child);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
    CHECK(std::filesystem::exists(dir.string() + ".tmp"));  // the half-written one, not under the name
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.zero_();
    }
    accelerator.load_state(dir);
    CHECK(at::equal(flat_parameters(*model), saved));
    std::filesystem::remove_all(dir);
    std::filesystem::remove_all(dir.string() + ".tmp");
    world().destroy();
  }

  TEST_CASE("training: configuration errors") {
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
