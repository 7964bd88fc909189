// Training tests, activation checkpointing (accel::checkpoint): the same values and gradients as the plain forward, the
// random and autocast states replayed, less memory kept, and under FULL_SHARD's units.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

namespace {
// A residual block with dropout between its layers: recomputed, it must draw the same mask.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width)
      : up(register_module("up", torch::nn::Linear(width, 4 * width))),
        down(register_module("down", torch::nn::Linear(4 * width, width))) {}
  at::Tensor forward(const at::Tensor& x, double p) {
    return x + down(torch::dropout(torch::tanh(up(x)), p, is_training()));
  }
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t width, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(width)));
    head = register_module("head", torch::nn::Linear(width, 1));
  }
  // Each block a unit of its own under FULL_SHARD (unit_forward), through accel::checkpoint when `recompute`.
  at::Tensor forward(at::Tensor h, bool recompute, double p = 0.25) {
    for (auto& block : blocks) {
      if (recompute)
        h = accel::checkpoint([&block](const at::Tensor& x, double q) { return accel::unit_forward(block, x, q); }, h,
                              p);
      else h = accel::unit_forward(block, h, p);
    }
    return accel::unit_forward(head, h);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

std::vector<at::Tensor> gradients_of(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad().clone());
  return out;
}
bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!at::equal(a[i], b[i])) return false;
  return true;
}
}  // namespace

TEST_SUITE("single") {
  TEST_CASE("checkpoint: the loss, every gradient and the random stream equal the plain forward's, bit for bit") {
    for (const bool bf16 : {false, true}) {
      CAPTURE(bf16);
      std::vector<at::Tensor> losses, grads, input_grads, after;
      for (const bool recompute : {false, true}) {
        torch::manual_seed(3);
        Stack model(8, 3);
        const at::Tensor x = at::randn({5, 8}).requires_grad_();
        at::Tensor loss;
        {
          // The backward below runs outside autocast: the recomputation must turn it on again itself.
          std::optional<accel::detail::AutocastScope> autocast;
          if (bf16) autocast.emplace(c10::DeviceType::CPU, true, at::kBFloat16);
          loss = model->forward(x, recompute).to(at::kFloat).pow(2).mean();
        }
        loss.backward();
        losses.push_back(loss.detach());
        grads = recompute ? grads : gradients_of(*model);
        if (recompute) CHECK(all_equal(grads, gradients_of(*model)));
        input_grads.push_back(x.grad());
        after.push_back(at::rand({4}));  // the stream after the step: the recomputation's draws leave no trace
      }
      CHECK(at::equal(losses[0], losses[1]));
      CHECK(at::equal(input_grads[0], input_grads[1]));
      CHECK(at::equal(after[0], after[1]));
    }
  }

  TEST_CASE("checkpoint: parameters get gradients when no input requires grad; no_grad is a plain call") {
    torch::manual_seed(4);
    Block block(6);
    block->eval();                           // no dropout: two forwards agree
    const at::Tensor x = at::randn({3, 6});  // requires no grad
    auto run = [&](bool recompute) {
      block->zero_grad();
      const at::Tensor out =
          recompute ? accel::checkpoint([&](const at::Tensor& h) { return block(h, 0.0); }, x) : block(x, 0.0);
      out.sum().backward();
      return gradients_of(*block);
    };
    const auto plain = run(false), recomputed = run(true);
    REQUIRE(recomputed.front().defined());
    CHECK(all_equal(plain, recomputed));
    {
      torch::NoGradGuard no_grad;
      const at::Tensor out = accel::checkpoint([&](const at::Tensor& h) { return block(h, 0.0); }, x);
      CHECK_FALSE(out.requires_grad());
      CHECK(at::equal(out, block(x, 0.0)));
    }
    // An input changed in place between the forward and the backward: autograd's version check, not stale values.
    const at::Tensor y = at::randn({3, 6}).requires_grad_();
    at::Tensor h = y * 2;
    const at::Tensor out = accel::checkpoint([&](const at::Tensor& in) { return block(in, 0.0); }, h);
    {
      torch::NoGradGuard no_grad;
      h.add_(1);
    }
    CHECK_THROWS_WITH(out.sum().backward(), doctest::Contains("modified by an inplace operation"));
  }

  TEST_CASE("checkpoint: a stack keeps its blocks' inputs, not their activations (allocator bytes)") {
    torch::manual_seed(5);
    Stack model(64, 6);
    const at::Tensor x = at::randn({256, 64});  // activations well above the parameters' gradients (0.8 MB)
    accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();
    std::vector<int64_t> kept, peak;
    for (const bool recompute : {false, true}) {
      model->zero_grad(/*set_to_none=*/true);
      counting.install();
      const int64_t live = counting.live();
      counting.reset_peak();
      at::Tensor loss = model->forward(x, recompute).pow(2).mean();
      kept.push_back(counting.live() - live);  // what the forward keeps for the backward
      loss.backward();
      loss = at::Tensor();
      peak.push_back(counting.peak() - live);
      counting.uninstall();
    }
    // Per block the plain forward keeps its input, tanh's output, the dropout mask and dropout's output (256 x 64
    // and twice 256 x 256 floats, a 256 x 256 mask); checkpointing keeps each block's input (256 x 64 floats) and
    // the random-number state its forward started from (torch.utils.checkpoint keeps it too).
    // (tanh, not gelu: LibTorch's gelu takes scratch memory in a way the counting allocator cannot serve.)
    MESSAGE("kept after the forward: " << kept[0] << " B plain, " << kept[1] << " B checkpointed; peak " << peak[0]
                                       << " / " << peak[1] << " B");
    const int64_t block_input = 256 * 64 * 4, rng = at::detail::getDefaultCPUGenerator().get_state().nbytes();
    CHECK(kept[1] <= 6 * (block_input + rng) + 16 * 1024);  // and the head's input, the loss
    CHECK(kept[0] >= 6 * (block_input + 2 * 256 * 256 * 4));
    CHECK(peak[1] < peak[0]);
  }
}

TEST_SUITE("ranks") {
  TEST_CASE("checkpoint: through FULL_SHARD's units and SHARD_GRAD_OP, with dropout and bf16, equal to the plain run") {
    std::vector<at::Tensor> finals;
    const std::array<std::pair<accel::ShardingStrategy, bool>, 4> runs{{{accel::ShardingStrategy::FULL_SHARD, false},
                                                                        {accel::ShardingStrategy::FULL_SHARD, true},
                                                                        {accel::ShardingStrategy::SHARD_GRAD_OP, true},
                                                                        {accel::ShardingStrategy::NO_SHARD, true}}};
    for (const auto& run : runs) {
      const accel::ShardingStrategy strategy = run.first;  // (not a structured binding: clang 14 cannot capture one)
      const bool recompute = run.second;
      CAPTURE(accel::to_string(strategy));
      CAPTURE(recompute);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      c.mixed_precision = "bf16";
      c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) {
        return name.starts_with("block") || name == "head";  // each block one unit (its two layers together)
      };
      accel::Accelerator accelerator(c);
      const int r = accelerator.process_index();
      torch::manual_seed(8);
      Stack model(6, 3);
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
      auto prepared = accelerator.prepare(model, adam);
      const bool full = accelerator.num_processes() > 1 && strategy == accel::ShardingStrategy::FULL_SHARD;
      auto generator = at::detail::createCPUGenerator(40 + r);
      torch::manual_seed(60 + r);  // dropout's stream: the same in every run, rank by rank
      for (int step = 0; step < 4; ++step) {
        const at::Tensor x = at::randn({4, 6}, generator), y = at::randn({4, 1}, generator);
        std::get<1>(prepared).zero_grad();
        at::Tensor loss;
        {
          auto autocast = accelerator.autocast();
          loss = torch::mse_loss(model->forward(x, recompute).to(at::kFloat), y);
        }
        accelerator.backward(loss);
        std::get<1>(prepared).step();
        if (full)  // every unit freed again after its backward, recomputed or not
          for (const auto& block : model->blocks)
            for (const auto& p : block->parameters()) {
              bool holds = false;
              try {
                holds = p.storage().data() != nullptr && p.storage().nbytes() > 0;
              } catch (const c10::Error&) {
              }
              CHECK_FALSE(holds);
            }
      }
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      finals.push_back(flat_parameters(*model).clone());
    }
    CHECK(at::equal(finals[0], finals[1]));  // FULL_SHARD, recomputed or not
    CHECK(at::equal(finals[1], finals[2]));  // FULL_SHARD against SHARD_GRAD_OP (as the bf16 sharding case)
    const double to_no_shard = (finals[1] - finals[3]).abs().max().item<double>();
    MESSAGE("checkpointed FULL_SHARD against NO_SHARD: largest parameter difference " << to_no_shard);
    CHECK(to_no_shard < 1e-5);  // (averaged in another order: all-reduce against reduce-scatter)
  }
}
