// Training tests, sharded training (SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD), the fused Adam it steps shards with,
// and Python's FSDP2 compared (python_fsdp2).
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"
#include <sstream>

TEST_SUITE("ranks") {
  // Sharded data parallel (ZeRO-2 and ZeRO-3): the training of one process
  // on the global batch, every replica identical, optimizer state and
  // gradients 1/S (and under FULL_SHARD the parameters at rest: none).
  TEST_CASE("sharding: SHARD_GRAD_OP and FULL_SHARD train as one process on the global batch, with 1/S of the state") {
    // SGD momentum, Adam, SGD momentum with 2 accumulation steps; x2; then accel::FusedAdam under each
    // (where LibTorch has its kernel, 2.4 on): the kernel steps each shard's values as the whole parameter's.
    std::vector<int> variants{0, 1, 2, 3, 4, 5};
    if (accel::detail::has_fused_adam) variants.insert(variants.end(), {6, 7});
    for (const int variant : variants) {
      const auto strategy =
          variant < 3 || variant == 6 ? accel::ShardingStrategy::SHARD_GRAD_OP : accel::ShardingStrategy::FULL_SHARD;
      const bool fused = variant >= 6, adam = variant % 3 == 1 || fused;
      const int micro = variant % 3 == 2 && !fused ? 2 : 1;
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
        for (const auto& p : model->parameters()) {
          bool holds = false;  // (a parameter at rest may refuse even to show its data pointer)
          try {
            holds = p.storage().data() != nullptr;
          } catch (const c10::Error&) {
          }
          if (holds) bytes += p.storage().nbytes();
        }
        return bytes;
      };
      if (full) CHECK(at_rest() == 0);
      Mlp local = [&] {
        const auto whole = accelerator.data_parallel(model)->summon_full_params();
        return copy_of(model, 5, 33, 2);
      }();
      auto make = [&](Mlp& m) -> std::unique_ptr<torch::optim::Optimizer> {
        if (fused) return std::make_unique<accel::FusedAdam>(m->parameters(), torch::optim::AdamOptions(1e-2));
        if (adam) return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
        return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      };
      auto optimizer = make(model), local_optimizer = make(local);
      accel::AcceleratedOptimizer prepared = accelerator.prepare(*optimizer);
      auto generator = at::detail::createCPUGenerator(11);
      double worst_norm = 0;
      const void* gradients_at = nullptr;  // where the shards' gradients live: the same memory every step
      // On Gloo with CPU tensors an all-gather is a send to and a receive from each other process; c10d
      // numbers those from LibTorch 2.x on (1.13 does not): a send and a receive around the ring say which.
      int64_t numbered_per_message = 0;
      if (const auto& shards = accelerator.data_parallel(model)->shard_group()) {
        start_sequence(shards);
        const int S = shards->getSize(), me = shards->getRank();
        const int64_t before = shards->getSequenceNumberForGroup();
        auto sent = accel::isend(at::zeros({1}), (me + 1) % S, shards);
        auto received = accel::irecv(at::zeros({1}), (me + S - 1) % S, shards);
        sent.wait();
        received.wait();
        numbered_per_message = (shards->getSequenceNumberForGroup() - before) / 2;
      }
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
          if (P > 1 && accelerator.sync_gradients()) {  // (zero_grad sets them to none: kept memory all the same)
            const void* at_now = optimizer->param_groups()[0].params()[0].grad().data_ptr();
            if (!gradients_at) gradients_at = at_now;
            CHECK(at_now == gradients_at);
          }
          if (step < 4) prepared.zero_grad();  // the last step's gradients are counted below
        }
        if (shards) {  // collectives per step on the shard group: nothing gathered twice
          // ZeRO-2: a reduce-scatter and an all-gather per bucket (one here), the norm's all-reduce.
          // FULL_SHARD: per unit and micro-step an all-gather for forward, and per unit a reduce-scatter;
          // the norm's all-reduce. These units are small (kAheadBytes, dp/state.hpp), so each keeps its
          // parameters from its forward to its backward, except in the very first forward, which has no
          // order of units yet to judge by: its units are gathered again for their backward. (An all-gather
          // point to point: see above.)
          const bool direct = shards->getBackendName() == "gloo" && accelerator.device().is_cpu();
          const int64_t per_gather = direct ? 2 * (shards->getSize() - 1) * numbered_per_message : 1;
          const int64_t collectives = shards->getSequenceNumberForGroup() - sequence;
          const int64_t unit_gathers = micro + (step == 0 ? 1 : 0);
          CHECK(collectives == (full ? 3 * unit_gathers : 1) * per_gather + (full ? 3 : 1) + 1);
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
      MESSAGE(std::string(accel::to_string(strategy)) << " at " << P << " process(es), "
                                                      << std::string(fused  ? "FusedAdam"
                                                                     : adam ? "Adam"
                                                                            : "SGD momentum")
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
      if (P > 1) {  // a bucket's shards stand on one buffer (the all-gather's input), their gradients on one
        const auto& shards = optimizer->param_groups()[0].params();
        for (std::size_t i = 0; i < shards.size(); ++i) {
          const at::Tensor& first = shards[full ? i - i % 2 : 0];  // FULL_SHARD: a bucket per unit (weight, bias)
          CHECK(shards[i].is_alias_of(first));
          CHECK(shards[i].grad().is_alias_of(first.grad()));
          if (full && i >= 2) CHECK_FALSE(shards[i].is_alias_of(shards[0]));
        }
      }
      if (P > 1)
        for (const auto& p : model->parameters()) CHECK_FALSE(p.grad().defined());  // released at the step
    }
  }

  // Large parameters are gathered straight into their storage (dp/unit_params.hpp, gather_params: on Gloo with CPU
  // tensors, a message per parameter and peer where the bucket's pieces average kPieceBytes or more; the
  // small ones as rows copied out). A unit with a large weight, its bias and a one-element gain (the gain's
  // piece is empty on every process but the first: neither sent nor received there) beside a small head
  // (rows): training equals one process's, and the messages per step are those of the path each bucket takes.
  // The odd processes leave the gain unused (its gradient none there): every process still takes the same
  // path, the gain's gradient the average of the even processes' over all.
  struct BlockImpl : torch::nn::Module {
    BlockImpl() {
      lin = register_module("lin", torch::nn::Linear(1023, 1025));
      gain = register_parameter("gain", at::full({1}, 0.5));
    }
    at::Tensor forward(const at::Tensor& x) { return use_gain ? lin(x) * gain : lin(x); }
    torch::nn::Linear lin{nullptr};
    at::Tensor gain;
    bool use_gain = true;
  };
  TORCH_MODULE(Block);
  struct BigImpl : torch::nn::Module {
    BigImpl() {
      block = register_module("block", Block());
      head = register_module("head", torch::nn::Linear(1025, 1));
    }
    at::Tensor forward(const at::Tensor& x) {
      return accel::unit_forward(head, torch::tanh(accel::unit_forward(block, x)));
    }
    Block block{nullptr};
    torch::nn::Linear head{nullptr};
  };
  TORCH_MODULE(Big);
  // Big's units under FULL_SHARD: the block and the head.
  bool big_units(const std::string& name, const torch::nn::Module&) { return name == "block" || name == "head"; }
  // A single-process Big with the same weights as `source`.
  Big copy_of_big(Big & source) {
    Big copy;
    torch::NoGradGuard no_grad;
    auto to = copy->parameters();
    auto from = source->parameters();
    for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
    return copy;
  }
  TEST_CASE("sharding: large parameters are gathered straight into their storage, small ones through rows") {
    // SHARD_GRAD_OP; FULL_SHARD; FULL_SHARD with backward_prefetch off (then no unit keeps its parameters
    // from its forward to its backward: each is gathered twice every step).
    for (const int variant : {0, 1, 2}) {
      const auto strategy = variant == 0 ? accel::ShardingStrategy::SHARD_GRAD_OP : accel::ShardingStrategy::FULL_SHARD;
      const bool keeps = variant == 1;
      CAPTURE(variant);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      c.backward_prefetch = variant != 2;
      c.auto_wrap_policy = big_units;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      if (P == 1) return;  // nothing is sharded
      const bool full = strategy == accel::ShardingStrategy::FULL_SHARD;
      torch::manual_seed(9);
      Big model;
      Big local = copy_of_big(model);
      accelerator.prepare(model);
      CHECK(accelerator.data_parallel(model)->unit_count() == (full ? 2u : 0u));
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      torch::optim::SGD local_sgd(local->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      accel::AcceleratedOptimizer prepared = accelerator.prepare(sgd);
      const accel::GroupPtr& shards = accelerator.data_parallel(model)->shard_group();
      const int S = shards->getSize(), me = shards->getRank();
      // Messages c10d numbers per point-to-point operation (LibTorch 2.x: 1; 1.13 numbers none).
      start_sequence(shards);
      int64_t numbered = shards->getSequenceNumberForGroup();
      {
        auto sent = accel::isend(at::zeros({1}), (me + 1) % S, shards);
        auto received = accel::irecv(at::zeros({1}), (me + S - 1) % S, shards);
        sent.wait();
        received.wait();
      }
      numbered = (shards->getSequenceNumberForGroup() - numbered) / 2;
      // Per gather on this process, the messages of the direct path: to each of the S - 1 peers its own
      // non-empty pieces, from each its non-empty ones. Pieces of `large` elements are non-empty everywhere
      // (every size here is at least 254 per piece), those of one element on the first process only.
      auto messages = [&](int large, int single) {
        return (S - 1) * (large + (me == 0 ? single : 0)) + (S - 1) * large + (me == 0 ? 0 : single);
      };
      // The reduce-scatter of such a bucket is point to point too (dp/scatter.hpp): the same pieces the
      // other way (a piece of one element goes only to the first process), and the used-flags to and
      // from each peer. A bucket through rows: one message to and one from each peer for its all-gather,
      // one c10d all-to-all for its reduce-scatter.
      auto scattered = [&](int large, int single) { return messages(large, single) + 2 * (S - 1); };
      // ZeRO-2: buckets in reverse order of parameters() (the gain, a block's own parameter, comes first
      // there), the first closed once it reaches 1 MiB, as DDP's: the head's bias and weight and the
      // linear's bias and weight directly; the gain alone in a second bucket, through rows. FULL_SHARD:
      // the block (weight, bias, gain) directly, gathered twice; the head through rows, gathered twice in
      // the first step and once after: the last unit of the forward and small (kAheadBytes, dp/state.hpp),
      // it keeps its parameters for its backward once the engine knows the order of the units (with
      // backward_prefetch on).
      CHECK(accelerator.data_parallel(model)->bucket_count() == 2u);
      const int64_t direct = full ? 2 * messages(2, 1) + scattered(2, 1) : messages(3, 1) + scattered(3, 1);
      auto generator = at::detail::createCPUGenerator(13);
      for (int step = 0; step < 3; ++step) {
        const int64_t rows = full ? (step > 0 && keeps ? 1 : 2) * 2 * (S - 1) : 2 * (S - 1);
        const int64_t per_step = (direct + rows) * numbered + 1;
        const at::Tensor x = at::randn({2 * P, 1023}, generator), y = at::randn({2 * P, 1}, generator);
        const int64_t sequence = shards->getSequenceNumberForGroup();
        prepared.zero_grad();
        model->block->use_gain = r % 2 == 0;
        accelerator.backward(torch::mse_loss(model(x.narrow(0, 2 * r, 2)), y.narrow(0, 2 * r, 2)));
        prepared.step();
        CHECK(shards->getSequenceNumberForGroup() - sequence == per_step);
        local_sgd.zero_grad();
        at::Tensor loss = at::zeros({});
        for (int k = 0; k < P; ++k) {  // (what DDP's average gives: each process's loss over P)
          local->block->use_gain = k % 2 == 0;
          loss = loss + torch::mse_loss(local(x.narrow(0, 2 * k, 2)), y.narrow(0, 2 * k, 2)) / P;
        }
        loss.backward();
        local_sgd.step();
      }
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      const double difference = (flat_parameters(*model) - flat_parameters(*local)).abs().max().item<double>();
      MESSAGE(std::string(accel::to_string(strategy))
              << " at " << P << " processes, large parameters: largest difference to one process " << difference);
      CHECK(difference < 1e-5);
      CHECK(identical_across_ranks(*model, world().world_group()));
    }
  }

  // The same paths where the reduce-scatter's result is averaged along a replicate group too (HSDP on a
  // 2 x 2 model mesh: the point-to-point path divides after its fold) and where gradients accumulate over
  // two micro-steps before they are sent.
  TEST_CASE("sharding: large parameters on a 2 x 2 model mesh, with accumulation, train as one process") {
    if (world().get_world_size() != 4) return;
    world().destroy();
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(accel::to_string(strategy));
      accel::AcceleratorConfig c = config(2);
      c.distributed = test_config({.mp_replicate_size = 2});
      c.sharding_strategy = strategy;
      c.auto_wrap_policy = big_units;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      torch::manual_seed(9);
      Big model;
      Big local = copy_of_big(model);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      torch::optim::SGD local_sgd(local->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      auto prepared = accelerator.prepare(model, sgd);
      CHECK(accelerator.data_parallel(model)->shard_group()->getSize() == 2);
      auto generator = at::detail::createCPUGenerator(17);
      for (int step = 0; step < 3; ++step) {
        const at::Tensor x = at::randn({4 * P, 1023}, generator), y = at::randn({4 * P, 1}, generator);
        for (int k = 0; k < 2; ++k) {
          auto guard = accelerator.accumulate(model);
          const int64_t at = (k * P + r) * 2;
          accelerator.backward(torch::mse_loss(model(x.narrow(0, at, 2)), y.narrow(0, at, 2)));
          std::get<1>(prepared).step();
          std::get<1>(prepared).zero_grad();
        }
        local_sgd.zero_grad();
        torch::mse_loss(local(x), y).backward();
        local_sgd.step();
      }
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      const double difference = (flat_parameters(*model) - flat_parameters(*local)).abs().max().item<double>();
      MESSAGE(std::string(accel::to_string(strategy))
              << " on a 2 x 2 mesh, 2 micro-steps, large parameters: largest difference to one process " << difference);
      CHECK(difference < 1e-5);
      CHECK(identical_across_ranks(*model, accel::DistributedInterface::instance().world_group()));
    }
    accel::DistributedInterface::instance().destroy();
  }

  // No process gathers the whole model to save it: save_state writes each process's pieces
  // (checkpoint/shards.hpp) and gathers nothing; save_model gathers one unit at a time as the files reach it,
  // which takes that unit's parameters and the rows its all-gather lands in. Deterministic: the counting
  // allocator's peak of live bytes during each save above those live before it, with the engine's pool
  // emptied first (else what it kept from training would serve every unit without an allocation);
  // summon_full_params (every unit at once, what both saves did before) is the control that passes the bound.
  TEST_CASE("sharding: saving a FULL_SHARD model holds at most one unit's whole parameters beside the shards") {
    namespace fs = std::filesystem;
    accel::AcceleratorConfig c = config();
    c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
    accel::Accelerator accelerator(c);
    if (accelerator.num_processes() == 1) return;  // nothing is sharded
    torch::manual_seed(3);
    Mlp model(8, 128, 5);  // units: the Linears, of 1,152, 4 x 16,512 and 129 floats
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto prepared = accelerator.prepare(model, adam);
    const at::Tensor x = at::randn({4, 8}), y = at::randn({4, 1});
    for (int step = 0; step < 2; ++step) {  // (Adam's state is made)
      std::get<1>(prepared).zero_grad();
      accelerator.backward(torch::mse_loss(model(x), y));
      std::get<1>(prepared).step();
    }
    int64_t largest_unit = 0;
    for (const auto& layer : model->body->children()) {
      int64_t bytes = 0;
      for (const auto& p : layer->parameters()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
      largest_unit = std::max(largest_unit, bytes);
    }
    const fs::path dir = shared_temp_path(accelerator, "accel_save_peak_");
    accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();
    counting.install();
    auto peak_of = [&](auto&& save) {
      accelerator.wait_for_everyone();
      accelerator.data_parallel(model)->release_buffers();
      const int64_t before = counting.live();
      counting.reset_peak();
      save();
      return counting.peak() - before;
    };
    const int64_t state = peak_of([&] { accelerator.save_state(dir / "state"); });
    const int64_t exported = peak_of([&] { accelerator.save_model(model, (dir / "export").string()); });
    const int64_t summoned =
        peak_of([&] { const auto whole = accelerator.data_parallel(model)->summon_full_params(); });
    counting.uninstall();
    // Besides: small tensors (the RNG states, 5 KB on the CPU; scalars; the collectives' padding; the error
    // exchange at the end). Measured at 2 to 4 processes: 5 KB in save_state, 12-14 KB in save_model.
    constexpr int64_t kSlack = 24 << 10;
    MESSAGE(accelerator.num_processes() << " processes, peak bytes above the live ones: save_state " << state
                                        << ", save_model " << exported << ", summon_full_params " << summoned
                                        << "; the largest unit " << largest_unit);
    CHECK(state <= kSlack);                        // nothing gathered
    CHECK(exported <= 2 * largest_unit + kSlack);  // one unit: its parameters and its all-gather's rows
    CHECK(summoned > 2 * largest_unit + kSlack);   // the control: every unit at once
    {                                              // what save_model wrote is the whole model
      Mlp plain(8, 128, 5);
      accel::load_model(plain, (dir / "export").string());
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      CHECK(at::equal(flat_parameters(*plain), flat_parameters(*model)));
    }
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) fs::remove_all(dir);
  }

  // The sharding engine allocates its working buffers once (dp/buffers.hpp): from the third step on, a
  // sharded step allocates no more than the same step of an unsharded model on one process, apart from
  // what c10d itself stages inside an all-gather and a few scalars. That staging depends on the LibTorch
  // (Gloo on 1.13 gathers into a flat tensor of its own and copies out: one gathered copy; on 2.15 two),
  // so it is measured here, with an all-gather of all the shards into an output we own, and counted once
  // per all-gather round of the step (ZeRO-2: one; FULL_SHARD: forward and backward).
  // Before the engine kept its buffers, each step also allocated every bucket's reduce-scatter input,
  // what its all-to-all received and the folded result, and the all-gather's rows (by their sizes, about 3.5
  // copies of the parameters more): the bound fails then. Deterministic: the counting allocator's bytes.
  TEST_CASE("sharding: from the third step on, the engine allocates no buffer per step") {
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(accel::to_string(strategy));
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes();
      if (P == 1) return;  // nothing is sharded
      torch::manual_seed(3);
      Mlp model(5, 64, 3);
      accelerator.prepare(model);
      Mlp local = [&] {
        const auto whole = accelerator.data_parallel(model)->summon_full_params();
        return copy_of(model, 5, 64, 3);
      }();
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      torch::optim::SGD local_sgd(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      accel::AcceleratedOptimizer prepared = accelerator.prepare(sgd);
      auto generator = at::detail::createCPUGenerator(21 + accelerator.process_index());
      const at::Tensor x = at::randn({4, 5}, generator), y = at::randn({4, 1}, generator);
      accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();
      counting.install();
      auto bytes_of = [&](auto&& step) {
        const int64_t before = counting.total();
        step();
        return counting.total() - before;
      };
      const bool full = strategy == accel::ShardingStrategy::FULL_SHARD;
      CHECK(accelerator.data_parallel(model)->unit_count() == (full ? 4u : 0u));  // every Linear a unit
      // A few scalar tensors besides (56 and 96 bytes on LibTorch 1.13 and 2.15): far below a bucket (17 KB).
      constexpr int64_t kScalars = 256;
      const int64_t gathers = full ? 2 : 1;  // all parameters gathered once per step; FULL_SHARD's units twice
      int64_t shard_elements = 0;            // this rank's shards, all parameters (padded chunks)
      for (const auto& p : model->parameters()) shard_elements += (p.numel() + P - 1) / P;
      at::Tensor gathered = at::empty({P, shard_elements});
      auto gather_all = [&] {
        accel::all_gather_into_tensor(gathered, at::zeros({shard_elements}),
                                      accelerator.data_parallel(model)->shard_group());
      };
      gather_all();  // (once first: what a first call of its kind sets up is not per step)
      const int64_t staged = bytes_of(gather_all) - shard_elements * 4;  // (less the input made here)
      // On Gloo with CPU tensors the engine gathers point to point, straight
      // into its pooled rows: nothing per step but those scalars. Elsewhere
      // it takes c10d's all-gather, which stages what it gathers (measured
      // above, per round).
      const bool direct =
          accelerator.data_parallel(model)->shard_group()->getBackendName() == "gloo" && accelerator.device().is_cpu();
      const int64_t allowed = (direct ? 0 : gathers * staged) + kScalars;
      for (int step = 0; step < 6; ++step) {
        const int64_t sharded = bytes_of([&] {
          prepared.zero_grad(true);
          accelerator.backward(torch::mse_loss(accel::unit_forward(model, x), y));
          prepared.step();
        });
        const int64_t plain = bytes_of([&] {
          for (auto& p : local->parameters()) p.mutable_grad().reset();
          torch::mse_loss(local(x), y).backward();
          local_sgd.step();
        });
        CAPTURE(step);
        if (step < 2) continue;  // the pool fills, the momentum buffers are made
        MESSAGE(std::string(accel::to_string(strategy))
                << " at " << P << " processes, step " << step << ": " << sharded << " allocator bytes, one process's "
                << plain << "; c10d's all-gather would stage " << staged << " per round");
        CHECK(sharded - plain <= allowed);
      }
      counting.uninstall();
    }
  }

  // FULL_SHARD's peak within a step, above what it holds between steps (the shards, their gradients and the
  // engine's pool, which already holds the gathered units and a reduce-scatter's receive buffer): the
  // gradients autograd makes whole before they are reduce-scattered. One reduce-scatter is in flight
  // under FULL_SHARD (dp/scatter.hpp), so at most two units' gradients live at once: the one in flight
  // and the one being made. With two in flight this step held three. Units of 4 MiB (large pieces: their
  // reduce-scatter sends from the gradients themselves on Gloo); activations and scalars are kilobytes.
  // Then the same under a bf16 MixedPrecisionPolicy (units of 2 MiB gathered in bf16, gradients reduced in
  // fp32): the step trains and holds the same bound, plus the bf16 gradient autograd makes before it casts it
  // to the parameter's fp32 (LibTorch's bf16 matrix products take scratch memory through raw_allocate, which
  // the counting allocator must serve as LibTorch's own does: it aborted the process here until it did).
  // Deterministic: the counting allocator's bytes.
  TEST_CASE("sharding: a FULL_SHARD step holds at most two units' whole gradients beside what it keeps") {
    for (const bool policy : {false, true}) {
      CAPTURE(policy);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
      if (policy) c.mixed_precision_policy = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat};
      accel::Accelerator accelerator(c);
      if (accelerator.num_processes() == 1 || !accelerator.device().is_cpu()) return;  // (CPU bytes are counted)
      torch::manual_seed(3);
      Mlp model(1024, 1024, 3, 1024);  // four units of 1024 x 1024 + 1024 floats
      Mlp local = copy_of(model, 1024, 1024, 3, 1024);
      const at::Tensor start = flat_parameters(*local).clone();
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01));
      torch::optim::SGD local_sgd(local->parameters(), torch::optim::SGDOptions(0.01));
      auto prepared = accelerator.prepare(model, sgd);
      REQUIRE(accelerator.data_parallel(model)->unit_count() == 4u);
      const int64_t unit = (1024 * 1024 + 1024) * 4;
      const int64_t P = accelerator.num_processes(), r = accelerator.process_index();
      auto generator = at::detail::createCPUGenerator(3);
      const at::Tensor x = at::randn({4 * P, 1024}, generator), y = at::randn({4 * P, 1024}, generator);
      accel_test::CountingAllocator& counting = accel_test::CountingAllocator::instance();
      counting.install();
      for (int step = 0; step < 4; ++step) {
        const int64_t before = counting.live();
        counting.reset_peak();
        std::get<1>(prepared).zero_grad();
        accelerator.backward(torch::mse_loss(model(x.narrow(0, 4 * r, 4)).to(at::kFloat), y.narrow(0, 4 * r, 4)));
        std::get<1>(prepared).step();
        const int64_t above = counting.peak() - before;
        local_sgd.zero_grad();
        torch::mse_loss(local(x), y).backward();
        local_sgd.step();
        CAPTURE(step);
        if (step < 2) continue;  // the pool fills
        MESSAGE(accelerator.num_processes() << " processes" << std::string(policy ? ", bf16 units" : "")
                                            << ", step " << step << ": peak " << above
                                            << " bytes above those live before it; a unit's gradient " << unit);
        CHECK(above > unit);  // the gradient being made is counted
        // and one other, in flight (under the policy also the bf16 gradient the fp32 one is cast from)
        CHECK(above <= (policy ? 2 * unit + unit / 2 : 2 * unit) + (256 << 10));
      }
      counting.uninstall();
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      const double difference = (flat_parameters(*model) - flat_parameters(*local)).abs().max().item<double>();
      const double moved = (flat_parameters(*local) - start).abs().max().item<double>();
      MESSAGE("largest difference to one process " << difference << " (training moved the parameters up to "
                                                    << moved << ")");
      CHECK(difference < (policy ? 0.02 : 1e-3) * moved);
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
    {  // FULL_SHARD: a unit called around unit_forward finds no data (an error, not garbage); a policy
       // that chooses no unit is refused
      c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
      accel::Accelerator accelerator(c);
      Mlp model(4, 8, 1);
      accelerator.prepare(model);
      const std::string bypass = what_of([&] { model->body->forward(data.first); });
      CAPTURE(bypass);
      if constexpr (accel::detail::dp::refuses_at_rest<>) {
        // Every kernel that reads a parameter at rest refuses, naming it, its unit and the way out:
        // a Linear, and an element-wise product (a custom RMSNorm's `x * weight`, a crash before).
        const std::string rest = "the parameter 'body.0.weight' is sharded at rest (fully sharded unit 'body.0')";
        CHECK(bypass.find("accel: the parameter 'body.0.") != std::string::npos);  // (the bias or the weight first)
        CHECK(bypass.find("is sharded at rest (fully sharded unit 'body.0')") != std::string::npos);
        CHECK(bypass.find("accel::unit_forward(unit, ...)") != std::string::npos);
        const at::Tensor weight = model->body[0]->as<torch::nn::Linear>()->weight;
        const std::string product = what_of([&] { (data.first * weight).sum(); });
        CHECK(product.find(rest) != std::string::npos);
        CHECK(what_of([&] { weight.clone(); }).find(rest) != std::string::npos);
      } else {
        // LibTorch's words: a view of a parameter finds "storage of size 0", a direct read "data is not
        // allocated"; this LibTorch has no way to make an element-wise kernel refuse (it would read null).
        CHECK((bypass.find("storage of size 0") != std::string::npos ||
               bypass.find("data is not allocated") != std::string::npos));
      }
      c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) { return name == "nothing"; };
      accel::Accelerator none(c);
      Mlp other(4, 8, 1);
      CHECK_THROWS_WITH_AS(none.prepare(other), doctest::Contains("FULL_SHARD found no unit in the model"),
                           accel::InvalidArgument);
      // A tied weight (one tensor in two modules) in two units, or in a unit and outside it, is one
      // parameter, kept at the root (whole while the model runs); parameters that share a storage without
      // being one tensor cannot be freed alone: an error naming the parameter and its unit.
      const at::Tensor w = at::randn({4, 4});
      torch::nn::Sequential tied(std::make_shared<TiedImpl>(w), std::make_shared<TiedImpl>(w));
      accel::AcceleratorConfig d = c;
      d.auto_wrap_policy = {};
      accel::Accelerator both(d);
      both.prepare(tied);
      CHECK(both.data_parallel(tied)->unit_count() == 0u);  // (its one parameter at the root)
      d.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) { return name == "0"; };
      accel::Accelerator first(d);
      torch::nn::Sequential tied_again(std::make_shared<TiedImpl>(w), std::make_shared<TiedImpl>(w));
      first.prepare(tied_again);
      CHECK(first.data_parallel(tied_again)->unit_count() == 0u);
      const at::Tensor base = at::randn({8, 4});
      torch::nn::Sequential views(std::make_shared<TiedImpl>(base.narrow(0, 0, 4)),
                                  std::make_shared<TiedImpl>(base.narrow(0, 4, 4)));
      accel::Accelerator viewed(d);
      CHECK_THROWS_WITH_AS(viewed.prepare(views),
                           doctest::Contains("'0.w' of unit '0' shares its storage with another parameter"),
                           accel::InvalidArgument);
      // One view of a larger tensor that no other parameter shares (a piece narrowed from a whole, as tensor
      // parallelism cuts them) takes a storage of its own and is sharded; what it was cut from stays as it was.
      const at::Tensor larger = at::arange(32, at::kFloat).view({4, 8});
      torch::nn::Sequential piece(std::make_shared<TiedImpl>(larger.narrow(1, 2, 4)));
      accel::Accelerator cut(d);
      cut.prepare(piece);
      CHECK(cut.data_parallel(piece)->unit_count() == (cut.num_processes() > 1 ? 1u : 0u));
      {
        const auto whole = cut.data_parallel(piece)->summon_full_params();
        CHECK(at::equal(piece->parameters()[0], at::arange(32, at::kFloat).view({4, 8}).narrow(1, 2, 4)));
      }
      CHECK(at::equal(larger, at::arange(32, at::kFloat).view({4, 8})));
      c.auto_wrap_policy = {};
    }

    // A checkpoint: each process's optimizer shard in a file of its own, and
    // its pieces of the model (checkpoint/shards.hpp); the run resumed from
    // it goes on bit for bit. save_model/load_model see whole parameters.
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
      CHECK_FALSE(fs::exists(dir / "model.pt"));  // nothing gathered: each process wrote its pieces
      {
        accel::detail::CheckpointFiles files(dir, *accel::detail::read_manifest(dir));
        const accel::detail::ShardedWeights pieces(dir, files);
        Mlp plain(4, 16, 1);
        torch::NoGradGuard no_grad;
        for (const auto& [name, t] : accel::detail::state_dict(*plain))
          t.copy_(pieces.read(name, 0, t.numel()).view(t.sizes()));
        CHECK(at::equal(flat_parameters(*plain), saved));  // the whole parameters, under every strategy
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
      {  // the same checkpoint in an unsharded run (NO_SHARD): the optimizer's pieces put together, the next step
         // the sharded run's
        accelerator.load_state(dir);
        const at::Tensor next = train(1);
        accel::Accelerator other(config());
        Mlp m(4, 16, 1);
        torch::optim::Adam o(m->parameters(), torch::optim::AdamOptions(1e-2));
        auto plain = other.prepare(m, o);
        other.load_state(dir);
        CHECK(at::equal(flat_parameters(*m), saved));
        std::get<1>(plain).zero_grad();
        other.backward(loss_of(m));
        std::get<1>(plain).step();
        const double apart = (flat_parameters(*m) - next).abs().max().item<double>();
        MESSAGE(accel::to_string(strategy), " saved, NO_SHARD loaded: its next step ", apart,
                " from the sharded run's");
        CHECK(apart < 1e-6);
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
          : fc1(register_module("fc1", torch::nn::Linear(6, 20))),
            fc2(register_module("fc2", torch::nn::Linear(20, 20))),
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

  // FSDP2's MixedPrecisionPolicy: units gathered and computed in bf16, gradients reduced in fp32 or in bf16
  // (FSDP2's default, reduce_dtype unset), parameters, shards, gradients and Adam's state kept in fp32. Against
  // one process training in fp32 on the global batch: within bf16's precision, and not equal to it (the
  // policy took effect); every replica identical. fc2 (512 x 512, no bias) is large enough at 2 processes
  // for the point-to-point gather and reduce-scatter (dp/state.hpp's large_pieces), fc1 and fc3 go through
  // rows.
  TEST_CASE("sharding: a MixedPrecisionPolicy computes units in bf16 and keeps fp32 masters") {
    struct NetImpl : torch::nn::Module {
      NetImpl()
          : fc1(register_module("fc1", torch::nn::Linear(6, 512))),
            fc2(register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(512, 512).bias(false)))),
            fc3(register_module("fc3", torch::nn::Linear(512, 1))) {}
      at::Tensor forward(const at::Tensor& x) {
        hidden = accel::unit_forward(fc1, x).tanh();
        return accel::unit_forward(fc3, accel::unit_forward(fc2, hidden).tanh());
      }
      torch::nn::Linear fc1, fc2, fc3;
      at::Tensor hidden;
    };
    TORCH_MODULE(Net);
    for (const bool reduce_in_fp32 : {true, false}) {
      CAPTURE(reduce_in_fp32);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
      c.mixed_precision_policy.param_dtype = at::kBFloat16;
      if (reduce_in_fp32) c.mixed_precision_policy.reduce_dtype = at::kFloat;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      if (P == 1) return;  // nothing is sharded (the policy applies to units)
      torch::manual_seed(21);
      Net model, local;
      {
        torch::NoGradGuard no_grad;
        auto to = local->parameters();
        auto from = model->parameters();
        for (std::size_t i = 0; i < to.size(); ++i) to[i].copy_(from[i]);
      }
      const at::Tensor start = flat_parameters(*local).clone();
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      torch::optim::SGD local_sgd(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      auto prepared = accelerator.prepare(model, sgd);
      auto generator = at::detail::createCPUGenerator(77);
      for (int step = 0; step < 6; ++step) {
        const at::Tensor x = at::randn({4 * P, 6}, generator), y = at::randn({4 * P, 1}, generator);
        std::get<1>(prepared).zero_grad();
        const at::Tensor out = model(x.narrow(0, 4 * r, 4));
        CHECK((model->hidden.scalar_type() == at::kBFloat16));  // fc1 computed in bf16 (its input cast)
        CHECK((out.scalar_type() == at::kBFloat16));
        accelerator.backward(torch::mse_loss(out.to(at::kFloat), y.narrow(0, 4 * r, 4)));
        for (const auto& p : model->parameters()) CHECK((p.scalar_type() == at::kFloat));  // at rest: fp32
        std::get<1>(prepared).step();
        local_sgd.zero_grad();
        torch::mse_loss(local(x), y).backward();
        local_sgd.step();
      }
      for (const auto& group : sgd.param_groups())
        for (const auto& shard : group.params()) {
          CHECK((shard.scalar_type() == at::kFloat));
          CHECK((shard.grad().scalar_type() == at::kFloat));
        }
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      for (const auto& p : model->parameters()) CHECK((p.scalar_type() == at::kFloat));
      const at::Tensor ours = flat_parameters(*model), fp32 = flat_parameters(*local);
      const double moved = (fp32 - start).abs().max().item<double>();
      const double difference = (ours - fp32).abs().max().item<double>();
      MESSAGE("bf16 units, reductions in " << (reduce_in_fp32 ? "fp32" : "bf16") << ", " << P
                                           << " processes: largest difference to one process in fp32 " << difference
                                           << " (training moved the parameters up to " << moved << ")");
      CHECK(moved > 0.05);
      CHECK(difference < 0.03 * moved);  // bf16 keeps 8 bits: about 0.4 % per value, over six steps
      CHECK(difference > 1e-6);          // and it was bf16 that ran, not fp32
      CHECK(identical_across_ranks(*model, world().world_group()));
    }
  }
  // FSDP2's MixedPrecisionPolicy on the shape every transformer has: identical blocks, whose units are of the
  // same size and so take the same pooled buffers one after another. A GPT-2-shaped decoder (untied: every layer
  // a unit, the embeddings and the head too) under FULL_SHARD, and HYBRID_SHARD on a 2 x 2 mesh, units computed in
  // bf16, gradients reduced in fp32 or bf16, with and without activation checkpointing and forward prefetching:
  // against one process training in fp32 on the global batch, the first step's gradient norm within 1 % (bf16
  // keeps 8 bits; measured 0.15 %) and the parameters after 6 SGD steps within 2 % of how far training moved them
  // (measured 0.6-0.7 %), and not equal (bf16 ran). The gradients that the forward's saved tensors give must be
  // those of their own unit's parameters, never those of the unit that took the pooled buffer after it (which
  // gave 4.6 % off at the first step here, and a norm of 244 instead of 3.1 on a wider model).
  TEST_CASE("sharding: a MixedPrecisionPolicy on identical blocks trains as one process in fp32") {
    struct Run {
      accel::ShardingStrategy strategy;
      bool reduce_in_fp32, recompute, prefetch;
    };
    std::vector<Run> runs;
    for (const bool reduce_in_fp32 : {true, false})
      for (const bool recompute : {false, true})
        for (const bool prefetch : {true, false})
          runs.push_back({accel::ShardingStrategy::FULL_SHARD, reduce_in_fp32, recompute, prefetch});
    if (world().get_world_size() == 4)
      for (const bool recompute : {false, true})
        runs.push_back({accel::ShardingStrategy::HYBRID_SHARD, true, recompute, true});
    for (const Run& run : runs) {
      CAPTURE(accel::to_string(run.strategy));
      CAPTURE(run.reduce_in_fp32);
      CAPTURE(run.recompute);
      CAPTURE(run.prefetch);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = run.strategy;
      c.forward_prefetch = run.prefetch;
      c.backward_prefetch = run.prefetch;
      c.mixed_precision_policy.param_dtype = at::kBFloat16;
      if (run.reduce_in_fp32) c.mixed_precision_policy.reduce_dtype = at::kFloat;
      if (run.strategy == accel::ShardingStrategy::HYBRID_SHARD) {
        release_world();
        c.distributed = test_config({.mp_replicate_size = 2});
      }
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      if (P == 1) return;  // nothing is sharded (the policy applies to units)
      torch::manual_seed(31);
      Gpt model(GptOptions{.tied = false});
      Gpt local = copy_of(model);
      model->recompute = run.recompute;
      const at::Tensor start = flat_parameters(*local).clone();
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      torch::optim::SGD local_sgd(local->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
      auto prepared = accelerator.prepare(model, sgd);
      CHECK(accelerator.data_parallel(model)->unit_count() == 4 + 6 * 3u);  // wte, wpe, ln_f, lm_head; 6 per block
      auto generator = at::detail::createCPUGenerator(5);
      for (int step = 0; step < 6; ++step) {
        const at::Tensor tokens = at::randint(64, {2 * P, 12}, generator);
        std::get<1>(prepared).zero_grad();
        const at::Tensor mine = tokens.narrow(0, 2 * r, 2), logits = model(mine);
        CHECK((logits.scalar_type() == at::kBFloat16));
        accelerator.backward(next_token_loss(logits, mine));
        const double norm = accelerator.clip_grad_norm_(model->parameters(), 1e9);
        std::get<1>(prepared).step();
        local_sgd.zero_grad();
        next_token_loss(local(tokens), tokens).backward();
        const double local_norm = torch::nn::utils::clip_grad_norm_(local->parameters(), 1e9);
        local_sgd.step();
        if (step == 0) {
          MESSAGE("first gradient norm " << norm << ", one process in fp32 " << local_norm);
          CHECK(std::abs(norm - local_norm) < 0.01 * local_norm);  // bf16 computes with 8 bits
        }
      }
      for (const auto& p : model->parameters()) CHECK((p.scalar_type() == at::kFloat));  // at rest: fp32
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      const at::Tensor ours = flat_parameters(*model), fp32 = flat_parameters(*local);
      const double moved = (fp32 - start).abs().max().item<double>();
      const double difference = (ours - fp32).abs().max().item<double>();
      MESSAGE(std::string(accel::to_string(run.strategy))
              << " at " << P << " processes, bf16 units, reductions in "
              << std::string(run.reduce_in_fp32 ? "fp32" : "bf16") << std::string(run.recompute ? ", checkpointed" : "")
              << std::string(run.prefetch ? "" : ", no prefetch") << ": largest difference to one process in fp32 "
              << difference << " (training moved the parameters up to " << moved << ")");
      CHECK(moved > 0.02);
      CHECK(difference < 0.02 * moved);
      CHECK(difference > 1e-6);
      CHECK(identical_across_ranks(*model, accel::DistributedInterface::instance().world_group()));
    }
    release_world();  // (the 2 x 2 mesh's)
  }
  // Tied weights as FSDP2 takes them: GPT-2's token embedding and head are one tensor registered under two names
  // (transformer.wte.weight, lm_head.weight), which LibTorch's parameters() lists twice. Built the way a user
  // would (the optimizer made from model->parameters(), clip_grad_norm_ over them too), under every strategy
  // (FULL_SHARD with a unit per layer, where the tie lies in two units, and per block, where it lies at the
  // root; with activation checkpointing; HYBRID_SHARD on a 2 x 2 mesh; a bf16 policy with output_dtype fp32,
  // the root in fp32), it trains as one process does with each parameter once: the gradient norm of every
  // step within 1e-5 (the policy: 1 %), the parameters after 5 steps within 1e-5 (the policy: 2 % of how far
  // they moved), the tied weight one tensor still, and an evaluation forward (no_grad, twice) equal to one
  // process's. A tied weight stepped or counted twice is far outside these (its gradient twice in the norm:
  // about 1.4 times it here).
  TEST_CASE("sharding: a tied GPT-2-shaped model trains as one process under every strategy, with a policy too") {
    struct Run {
      const char* name;
      accel::ShardingStrategy strategy;
      bool blocks, recompute, policy;
    };
    std::vector<Run> runs{{"NO_SHARD", accel::ShardingStrategy::NO_SHARD, false, false, false},
                          {"SHARD_GRAD_OP", accel::ShardingStrategy::SHARD_GRAD_OP, false, false, false},
                          {"FULL_SHARD, a unit per layer", accel::ShardingStrategy::FULL_SHARD, false, false, false},
                          {"FULL_SHARD, a unit per block", accel::ShardingStrategy::FULL_SHARD, true, false, false},
                          {"FULL_SHARD, checkpointed blocks", accel::ShardingStrategy::FULL_SHARD, true, true, false},
                          {"FULL_SHARD, bf16 blocks", accel::ShardingStrategy::FULL_SHARD, true, false, true},
                          {"FULL_SHARD, bf16 layers", accel::ShardingStrategy::FULL_SHARD, false, false, true}};
    if (world().get_world_size() == 4)
      runs.push_back({"HYBRID_SHARD, a unit per block", accel::ShardingStrategy::HYBRID_SHARD, true, false, false});
    for (const Run& run : runs) {
      CAPTURE(run.name);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = run.strategy;
      if (run.blocks) c.auto_wrap_policy = gpt_blocks;
      if (run.policy) c.mixed_precision_policy = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat,
                                                  .output_dtype = at::kFloat};
      if (run.strategy == accel::ShardingStrategy::HYBRID_SHARD) {
        release_world();
        c.distributed = test_config({.mp_replicate_size = 2});
      }
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      if (run.policy && P == 1) continue;  // (nothing sharded: no units for the policy)
      torch::manual_seed(17);
      Gpt model(GptOptions{.tied = true});
      Gpt local = copy_of(model);
      model->recompute = run.recompute;
      CHECK(model->parameters().size() == unique_parameters(*model).size() + 1);  // LibTorch's list: twice
      const at::Tensor start = flat_parameters(*local).clone();
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));  // (twice in it)
      torch::optim::SGD local_sgd(unique_parameters(*local), torch::optim::SGDOptions(0.5).momentum(0.9));
      auto prepared = accelerator.prepare(model, sgd);
      if (auto* dp = accelerator.data_parallel(model); dp && dp->sharded() && run.strategy != accel::ShardingStrategy::SHARD_GRAD_OP)
        CHECK(dp->unit_count() == (run.blocks ? 3u : 2u + 6u * 3u));  // the blocks, or every layer but the tie's two
      auto generator = at::detail::createCPUGenerator(23);
      double worst_norm = 0;
      for (int step = 0; step < 5; ++step) {
        const at::Tensor tokens = at::randint(64, {2 * P, 10}, generator);
        std::get<1>(prepared).zero_grad();
        const at::Tensor mine = tokens.narrow(0, 2 * r, 2);
        accelerator.backward(next_token_loss(model(mine), mine));
        const double norm = accelerator.clip_grad_norm_(model->parameters(), 1e9);
        std::get<1>(prepared).step();
        local_sgd.zero_grad();
        next_token_loss(local(tokens), tokens).backward();
        const double local_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*local), 1e9);
        local_sgd.step();
        worst_norm = std::max(worst_norm, std::abs(norm - local_norm) / local_norm);
      }
      const at::Tensor eval_tokens = at::randint(64, {2, 10}, generator);
      at::Tensor evaluated, local_evaluated;
      {
        torch::NoGradGuard no_grad;
        model(eval_tokens);
        evaluated = model(eval_tokens).to(at::kFloat);  // (each unit twice)
        local_evaluated = local(eval_tokens);
      }
      CHECK(model->lm_head->weight.is_same(model->wte->weight));
      const auto whole = accelerator.data_parallel(model) ? std::optional(accelerator.data_parallel(model)->summon_full_params())
                                                          : std::nullopt;
      const at::Tensor ours = flat_parameters(*model), fp32 = flat_parameters(*local);
      const double moved = (fp32 - start).abs().max().item<double>();
      const double difference = (ours - fp32).abs().max().item<double>();
      const double eval_difference = (evaluated - local_evaluated).abs().max().item<double>();
      MESSAGE(std::string(run.name) << " at " << P << " processes: largest parameter difference to one process " << difference
                       << " (moved " << moved << "), gradient norms " << worst_norm << " apart, evaluation "
                       << eval_difference);
      CHECK(moved > 0.02);
      CHECK(worst_norm < (run.policy ? 0.01 : 1e-5));
      CHECK(difference < (run.policy ? 0.02 * moved : 1e-5));
      CHECK(eval_difference < (run.policy ? 0.05 : 1e-5));
      if (P > 1) CHECK(identical_across_ranks(*model, accel::DistributedInterface::instance().world_group()));
    }
    release_world();
  }

  // A tensor in two of an optimizer's groups is Python's error too ("some parameters appear in more than one
  // parameter group"); named by the prepared model's first name for it.
  TEST_CASE("sharding: a tied weight in two parameter groups is an error naming it") {
    accel::Accelerator accelerator(config());
    Gpt model(GptOptions{.layers = 1});
    torch::optim::SGD twice(std::vector<torch::optim::OptimizerParamGroup>{{{model->wte->weight}}, {{model->lm_head->weight}}},
                            torch::optim::SGDOptions(0.1));
    accelerator.prepare(model);
    CHECK_THROWS_WITH_AS(accelerator.prepare(twice),
                         "accel::Accelerator::prepare: the parameter 'transformer.wte.weight' is in more than one of "
                         "the optimizer's parameter groups (as in Python, a parameter belongs to one group)",
                         accel::InvalidArgument);
  }

  // The policy is for FULL_SHARD's units: refused under other strategies, and for dtypes that are not
  // floating-point. Parameters in no unit compute in their own dtype: a unit's output_dtype hands them
  // activations in it (a Sequential's second Linear at the root, after a bf16 unit), and without it the
  // mixed dtypes are LibTorch's own error.
  TEST_CASE("sharding: a MixedPrecisionPolicy is for FULL_SHARD's units; output_dtype meets the root") {
    accel::AcceleratorConfig c = config();
    c.sharding_strategy = accel::ShardingStrategy::SHARD_GRAD_OP;
    c.mixed_precision_policy.param_dtype = at::kBFloat16;
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("FULL_SHARD or HYBRID_SHARD"),
                         accel::InvalidArgument);
    c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
    c.mixed_precision_policy.param_dtype = at::kInt;
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("floating-point"), accel::InvalidArgument);
    c.mixed_precision_policy.param_dtype = at::kBFloat16;
    c.mixed_precision_policy.output_dtype = at::kInt;
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("floating-point"), accel::InvalidArgument);
    c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) { return name == "0"; };
    for (const bool output_in_fp32 : {true, false}) {
      CAPTURE(output_in_fp32);
      c.mixed_precision_policy.output_dtype =
          output_in_fp32 ? std::optional<c10::ScalarType>(at::kFloat) : std::nullopt;
      accel::Accelerator accelerator(c);
      if (accelerator.num_processes() == 1) return;
      torch::manual_seed(4);
      torch::nn::Linear first(3, 4), second(4, 1);
      torch::nn::Sequential model(first, second);
      torch::optim::SGD sgd(model->parameters(), 0.1);
      accelerator.prepare(model, sgd);
      CHECK(accelerator.data_parallel(model)->unit_count() == 1u);
      auto forward = [&] { return second(accel::unit_forward(first, at::ones({2, 3}))); };
      if (output_in_fp32) {
        const at::Tensor out = forward();
        CHECK((out.scalar_type() == at::kFloat));  // the root's Linear in fp32
        accelerator.backward(out.sum());
        CHECK((sgd.param_groups()[0].params()[0].grad().scalar_type() == at::kFloat));
      } else {
        CHECK_THROWS_AS(forward(), c10::Error);  // bf16 activations, an fp32 weight: LibTorch's dtype error
      }
    }
  }

  // What only NO_SHARD does (DataParallel's strategy, dp/strategy.hpp): a
  // sharded model refuses it with a named error before it communicates, and
  // a NO_SHARD one has nothing of sharding's (no shards, units or pieces).
  TEST_CASE("sharding: what only NO_SHARD does is refused by a sharded model; NO_SHARD has no shards") {
    auto& d = world();
    if (d.get_world_size() == 1) return;  // (one process shards nothing)
    torch::manual_seed(5);
    torch::nn::Linear layer(3, 2);
    accel::DataParallel sharded(layer.ptr(), d.world_group(), 1 << 20, d.world_group());
    CHECK(sharded.sharded());
    CHECK(sharded.shard_group() == d.world_group());
    CHECK_THROWS_WITH_AS(sharded.register_comm_hook(accel::comm_hooks::allreduce_hook()),
                         doctest::Contains("communication hooks need NO_SHARD"), accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(sharded.gradient_as_bucket_view(true), doctest::Contains("reduce-scattered into its shards"),
                         accel::InvalidArgument);
    sharded.gradient_as_bucket_view(false);  // (what it is anyway: nothing to do)
    CHECK_THROWS_WITH_AS(sharded.shadow_backward(), doctest::Contains("use NO_SHARD, or even batches"),
                         accel::LogicError);
    CHECK(sharded.shard_of(layer->weight).defined());
    CHECK(sharded.sharded_state_dict().piece_of(layer->weight).has_value());

    torch::nn::Linear plain(3, 2);
    accel::DataParallel replicated(plain.ptr(), d.world_group(), 1 << 20);
    CHECK_FALSE(replicated.sharded());
    CHECK(replicated.shard_group() == nullptr);
    CHECK_FALSE(replicated.shard_of(plain->weight).defined());
    CHECK(replicated.unit_count() == 0u);
    const accel::detail::dp::ShardedStateDict state = replicated.sharded_state_dict();
    CHECK_FALSE(state.piece_of(plain->weight).has_value());
    CHECK_FALSE(state.writes_pieces());
    CHECK(state.load_range(plain->weight) == std::pair<int64_t, int64_t>{0, 6});
    torch::optim::SGD sgd(plain->parameters(), 0.1);
    replicated.shard_optimizer(sgd);
    CHECK(sgd.param_groups()[0].params()[0].is_same(plain->weight));  // untouched
    CHECK_FALSE(replicated.steps_with(sgd));
  }

  // HSDP on a 2 x 2 model mesh: shards along mp_shard, averaged along
  // mp_replicate; with SHARD_GRAD_OP that is FSDP's _HYBRID_SHARD_ZERO2, with
  // HYBRID_SHARD the parameters are sharded at rest too, and FULL_SHARD is the
  // same (FSDP2's fully_shard on a 2-D mesh: the mesh decides).
  TEST_CASE(
      "sharding: SHARD_GRAD_OP, HYBRID_SHARD and FULL_SHARD on a 2 x 2 model mesh (replicated shards) train as one "
      "process") {
    if (world().get_world_size() != 4) return;
    accel::AcceleratorConfig c = config();
    c.distributed = test_config({.mp_replicate_size = 2});
    world().destroy();
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::HYBRID_SHARD,
                                accel::ShardingStrategy::FULL_SHARD}) {
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      CHECK(accelerator.sharding_strategy() == strategy);
      // (each strategy from the same start, whatever the tests before consumed: a start where Adam divides
      // a near-zero gradient by its own size shows float's summation order at 1e-5, seen once)
      torch::manual_seed(12);
      Mlp model(5, 33, 2);
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
      auto prepared = accelerator.prepare(model, adam);
      accel::DataParallel& dp = *accelerator.data_parallel(model);
      CHECK(dp.unit_count() == (strategy == accel::ShardingStrategy::SHARD_GRAD_OP ? 0u : 3u));
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
    // With mp_shard_size == 1 every strategy is NO_SHARD: nothing is sharded, FULL_SHARD's units included.
    accel::DistributedInterface::instance().destroy();
    c.distributed = test_config({.mp_replicate_size = 4});
    c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
    {
      accel::Accelerator accelerator(c);
      Mlp model(5, 33, 2);
      accelerator.prepare(model);
      CHECK(accelerator.data_parallel(model)->unit_count() == 0u);
      int64_t held = 0;
      for (const auto& p : model->parameters()) held += p.numel();
      CHECK(held == (5 * 33 + 33) + (33 * 33 + 33) + (33 * 1 + 1));  // every parameter whole on every rank
    }
    accel::DistributedInterface::instance().destroy();
  }
  TEST_CASE("sharding cleanup") { release_world(); }
}

// Parameters that are already pieces of larger tensors, as tensor parallelism
// hands them to the engine (Megatron's column- and row-parallel linears):
// piece t of n of a Linear's rows (weight and bias), and of its columns (a
// view of the whole weight: not contiguous, on a storage larger than itself).
namespace {
struct ColumnPieceImpl : torch::nn::Module {
  ColumnPieceImpl(const torch::nn::Linear& whole, int64_t t, int64_t n) {
    const int64_t h = whole->weight.size(0) / n;
    weight = register_parameter("weight", whole->weight.detach().clone().narrow(0, t * h, h));
    bias = register_parameter("bias", whole->bias.detach().clone().narrow(0, t * h, h));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  at::Tensor weight, bias;
};
TORCH_MODULE(ColumnPiece);
struct RowPieceImpl : torch::nn::Module {
  RowPieceImpl(const torch::nn::Linear& whole, int64_t t, int64_t n) {
    const int64_t h = whole->weight.size(1) / n;
    weight = register_parameter("weight", whole->weight.detach().clone().narrow(1, t * h, h));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(RowPiece);
// fc2(tanh(fc1(x))) with fc1 cut by rows and fc2 by columns over `tp`: each
// process computes its part of fc2's output, summed over tp.
struct PiecesImpl : torch::nn::Module {
  PiecesImpl(const torch::nn::Linear& fc1_whole, const torch::nn::Linear& fc2_whole, accel::GroupPtr group)
      : tp(std::move(group)) {
    fc1 = register_module("fc1", ColumnPiece(fc1_whole, tp->getRank(), tp->getSize()));
    fc2 = register_module("fc2", RowPiece(fc2_whole, tp->getRank(), tp->getSize()));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = at::tanh(accel::unit_forward(fc1, x));
    return accel::autograd::all_reduce(accel::unit_forward(fc2, h), accel::ReduceOp::SUM, tp);
  }
  ColumnPiece fc1{nullptr};
  RowPiece fc2{nullptr};
  accel::GroupPtr tp;
};
TORCH_MODULE(Pieces);
}  // namespace

TEST_SUITE("mesh4") {
  TEST_CASE("ParallelismConfig: Accelerate's sizes give the groups of Accelerate's mesh, through both meshes") {
    REQUIRE(accel::get_world_size() == 4);
    const std::vector<std::vector<int>> layouts{{2, 2, 1, 1}, {1, 2, 2, 1}, {2, 1, 2, 1},
                                                {1, 1, 2, 2}, {2, 1, 1, 2}, {1, 4, 1, 1}};
    for (const std::vector<int>& shape : layouts) {  // (dp_replicate, dp_shard, cp, tp)
      CAPTURE(shape[0] * 1000 + shape[1] * 100 + shape[2] * 10 + shape[3]);
      // Accelerate's mesh, as its ParallelismConfig builds it (init_device_mesh's groups are checked
      // against Python's under torchrun): FSDP shards over dp_shard_cp, replicates over dp_replicate,
      // splits the data over dp and averages the loss over dp_cp.
      fresh();
      const accel::DeviceMesh mesh = accel::init_device_mesh(shape, {"dp_replicate", "dp_shard", "cp", "tp"});
      mesh.slice("dp_replicate", "dp_shard").flatten("dp");
      mesh.slice("dp_shard", "cp").flatten("dp_shard_cp");
      mesh.slice("dp_replicate", "dp_shard", "cp").flatten("dp_cp");
      const accel::ParallelismConfig p{
          .dp_replicate_size = shape[0], .dp_shard_size = shape[1], .tp_size = shape[3], .cp_size = shape[2]};
      auto& d = fresh(p.distributed_config(4));
      const std::pair<Dim, const char*> same[] = {{Dim::MP_REPLICATE, "dp_replicate"},
                                                  {Dim::MP_SHARD, "dp_shard_cp"},
                                                  {Dim::DP, "dp"},
                                                  {Dim::CP, "cp"},
                                                  {Dim::TP, "tp"}};
      for (const auto& entry : same) CHECK(d.get_device_mesh(entry.first)->ranks() == mesh.slice(entry.second).ranks());
      if (shape[3] > 1) CHECK(d.data_mesh()->slice("dp_cp").ranks() == mesh.slice("dp_cp").ranks());
    }
    // Unset dp_shard_size: what the world leaves.
    const accel::DistributedConfig left = accel::ParallelismConfig{.dp_replicate_size = 2}.distributed_config(4);
    CHECK((left.mp_replicate_size == 2 && left.mp_shard_size == 2 && left.dp_size == 4 && left.cp_size == 1));
    release_world();
  }

  // Four processes as a (shard 2, tp 2) mesh, tp innermost: each parameter is
  // a tensor-parallel piece, sharded further over the shard group (FSDP over
  // TP). Two micro-batches per step, the first with gradient sync off
  // (FSDP2's set_requires_gradient_sync): after 3 SGD steps every piece
  // equals its part of one process's model trained on the global batches.
  TEST_CASE("sharding: pieces of larger tensors shard, reduce once per step and step as the whole model") {
    auto& d = world();
    REQUIRE(d.get_world_size() == 4);
    const int r = d.get_rank(), s = r / 2;
    const accel::GroupPtr tp = d.split_group(s, r), shard = d.split_group(r % 2, r);
    for (const bool units : {false, true}) {  // SHARD_GRAD_OP, FULL_SHARD
      CAPTURE(units);
      torch::manual_seed(3);
      torch::nn::Linear fc1(8, 14), fc2(torch::nn::LinearOptions(14, 5).bias(false));  // 14: pieces of 7 rows
      Pieces pieces(fc1, fc2, tp);
      REQUIRE_FALSE(pieces->fc2->weight.is_contiguous());
      const std::vector<std::shared_ptr<torch::nn::Module>> unit_list =
          units ? std::vector<std::shared_ptr<torch::nn::Module>>{pieces->fc1.ptr(), pieces->fc2.ptr()}
                : std::vector<std::shared_ptr<torch::nn::Module>>{};
      accel::DataParallel dp(pieces.ptr(), shard, 1 << 20, shard, {}, unit_list);
      CHECK(dp.unit_count() == (units ? 2u : 0u));
      torch::optim::SGD optimizer(pieces->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      dp.shard_optimizer(optimizer);
      torch::optim::SGD whole_optimizer(std::vector<at::Tensor>{fc1->weight, fc1->bias, fc2->weight},
                                        torch::optim::SGDOptions(0.1).momentum(0.9));
      auto generator = at::detail::createCPUGenerator(17);
      for (int step = 0; step < 3; ++step) {
        // [micro-batch, shard rank, rows, features]: a shard rank's rows, read alike by its tp pair
        const at::Tensor x = at::randn({2, 2, 3, 8}, generator), y = at::randn({2, 2, 3, 5}, generator);
        for (int k = 0; k < 2; ++k) {
          dp.set_requires_gradient_sync(k == 1);
          // Each tp peer computes the same loss; all_reduce's adjoint sums their gradients, hence the halving.
          const at::Tensor loss = torch::mse_loss(pieces(x[k][s]), y[k][s]) / 2;
          dp.check_shards();
          dp.prepare_for_backward();
          loss.backward();
          CHECK(dp.finish() == (k == 1));  // the first micro-batch communicates nothing
        }
        optimizer.step();
        dp.gather_shards();
        optimizer.zero_grad();
        whole_optimizer.zero_grad();
        at::Tensor whole_loss = at::zeros({});
        for (int k = 0; k < 2; ++k)
          whole_loss = whole_loss + torch::mse_loss(fc2(at::tanh(fc1(x[k].reshape({6, 8})))), y[k].reshape({6, 5}));
        whole_loss.backward();
        whole_optimizer.step();
      }
      const auto held = dp.summon_full_params();
      const int64_t t = tp->getRank();
      at::NoGradGuard no_grad;
      const double difference = std::max({(pieces->fc1->weight - fc1->weight.narrow(0, 7 * t, 7)).abs().max().item<double>(),
                                          (pieces->fc1->bias - fc1->bias.narrow(0, 7 * t, 7)).abs().max().item<double>(),
                                          (pieces->fc2->weight - fc2->weight.narrow(1, 7 * t, 7)).abs().max().item<double>()});
      MESSAGE(std::string(units ? "FULL_SHARD" : "SHARD_GRAD_OP") << " over tp pieces: largest difference to one process " << difference);
      CHECK(difference < 1e-5);
      CHECK((fc1->weight.narrow(0, 7 * t, 7) - fc1->weight.narrow(0, 7 * (1 - t), 7)).abs().max().item<double>() > 1e-3);
    }
  }
}

// Run by tests/python_ref/run_fsdp2.sh (CTest python_fsdp2_*) around
// tests/python_ref/fsdp2_ref.py, which trains the same model with Python's
// DDP or FSDP2: skipped otherwise. The same start (DIR/init/model.safetensors,
// written by Python), the same batches (DIR/batches.safetensors: x and y,
// [steps, global batch, features], this process's rows of each), Adam with
// the same learning rate; the trained model goes to DIR/cpp_MODE_WORLD for
// fsdp2_ref.py to compare. One run trains each mode of ACCEL_FSDP2_MODES (a
// space-separated list), each in a world of its own, one after the other.
namespace {
// fsdp2_ref.py's gpt_ modes: its Gpt (training_fixtures.hpp's) from its start, on its tokens, with SGD and
// momentum; each step's loss averaged over the processes into DIR/cpp_MODE_WORLD/losses.safetensors.
void train_gpt_as_python(accel::Accelerator& accelerator, const std::string& dir, const std::string& mode) {
  const int64_t P = accelerator.num_processes(), r = accelerator.process_index();
  const bool tied = mode.starts_with("gpt_tied");
  Gpt model(GptOptions{.tied = tied});
  accelerator.load_model(model, dir + (tied ? "/gpt_tied" : "/gpt"));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));  // (fsdp2_ref's GPT_LR)
  accel::AcceleratedOptimizer optimizer = std::get<1>(accelerator.prepare(model, sgd));
  const at::Tensor tokens = [&] {
    for (auto& named : accel::detail::read_safetensors(dir + "/batches.safetensors"))
      if (named.first == "tokens") return named.second;
    return at::Tensor();
  }();
  REQUIRE(tokens.defined());
  REQUIRE(tokens.size(1) % P == 0);
  const int64_t b = tokens.size(1) / P;
  std::vector<double> losses;
  for (int64_t step = 0; step < tokens.size(0); ++step) {
    const at::Tensor mine = tokens[step].narrow(0, r * b, b);
    const at::Tensor loss = next_token_loss(model(mine), mine);
    accelerator.backward(loss);
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(accelerator.reduce(loss.detach(), "mean").item<double>());
  }
  const std::string out = dir + "/cpp_" + mode + "_" + std::to_string(P);
  accelerator.save_model(model, out);
  if (accelerator.is_main_process())
    accel::detail::write_safetensors(out + "/losses.safetensors",
                                     {{"losses", at::tensor(losses, at::TensorOptions(at::kDouble))}});
  accelerator.wait_for_everyone();
}

void train_as_python(const std::string& dir, const std::string& mode) {
  CAPTURE(mode);
  const std::map<std::string, accel::ShardingStrategy> strategies{
      {"no_shard", accel::ShardingStrategy::NO_SHARD},
      {"shard_grad_op", accel::ShardingStrategy::SHARD_GRAD_OP},
      {"full_shard", accel::ShardingStrategy::FULL_SHARD},
      {"hybrid_shard", accel::ShardingStrategy::HYBRID_SHARD},
      {"full_shard_bf16", accel::ShardingStrategy::FULL_SHARD},
      {"gpt_full_shard_bf16", accel::ShardingStrategy::FULL_SHARD},
      {"gpt_tied_full_shard_bf16", accel::ShardingStrategy::FULL_SHARD},
      {"gpt_tied_full_shard", accel::ShardingStrategy::FULL_SHARD}};
  REQUIRE(strategies.count(mode) == 1);
  accel::AcceleratorConfig c = config();
  c.sharding_strategy = strategies.at(mode);
  if (mode == "full_shard_bf16" || mode == "gpt_full_shard_bf16")  // (fsdp2_ref.py's MixedPrecisionPolicy)
    c.mixed_precision_policy = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat};
  if (mode.starts_with("gpt_tied")) c.auto_wrap_policy = gpt_blocks;  // (the tie at the root, in fp32)
  if (mode == "gpt_tied_full_shard_bf16")
    c.mixed_precision_policy = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat, .output_dtype = at::kFloat};
  if (mode == "hybrid_shard") c.distributed = test_config({.mp_replicate_size = 2});  // (2, P/2): fsdp2_ref's mesh
  accel::Accelerator accelerator(c);
  if (mode.starts_with("gpt_")) {
    train_gpt_as_python(accelerator, dir, mode);
    release_world();
    return;
  }
  const int64_t P = accelerator.num_processes(), r = accelerator.process_index();
  Mlp model(16, 30, 2, 3);  // fsdp2_ref.py's Net
  accelerator.load_model(model, std::string(dir) + "/init");
  // fsdp2_ref.py's optimizer_for: Adam at its LR; SGD with momentum under the bf16 policy
  std::unique_ptr<torch::optim::Optimizer> chosen;
  if (mode == "full_shard_bf16")
    chosen = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  else chosen = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  accel::AcceleratedOptimizer optimizer = std::get<1>(accelerator.prepare(model, *chosen));
  std::map<std::string, at::Tensor> batches;
  for (auto& named : accel::detail::read_safetensors(std::string(dir) + "/batches.safetensors")) batches.insert(named);
  const at::Tensor &x = batches.at("x"), &y = batches.at("y");
  REQUIRE(x.size(1) % P == 0);
  const int64_t b = x.size(1) / P;
  for (int64_t step = 0; step < x.size(0); ++step) {
    const at::Tensor out = model(x[step].narrow(0, r * b, b)).to(at::kFloat);
    const at::Tensor loss = torch::mse_loss(out, y[step].narrow(0, r * b, b));
    accelerator.backward(loss);
    optimizer.step();
    optimizer.zero_grad();
  }
  accelerator.save_model(model, std::string(dir) + "/cpp_" + mode + "_" + std::to_string(P));
  release_world();
}
}  // namespace

TEST_SUITE("python_fsdp2" * doctest::skip()) {
  TEST_CASE("train: Python's start, batches and optimizer in each mode of ACCEL_FSDP2_MODES") {
    const char* dir = std::getenv("ACCEL_FSDP2_DIR");
    const char* modes = std::getenv("ACCEL_FSDP2_MODES");
    REQUIRE(dir != nullptr);
    REQUIRE(modes != nullptr);
    std::istringstream names(modes);
    int trained = 0;
    for (std::string mode; names >> mode; ++trained) train_as_python(dir, mode);
    REQUIRE(trained > 0);
  }
}

// accel::FusedAdam / FusedAdamW (optim/fused_adam.hpp): LibTorch's fused kernel,
// checked live against Python's Adam(fused=True) / AdamW(fused=True) on the
// leg's own torch (the same kernel: the same bits), and against
// torch::optim::Adam / AdamW (another order of rounding: close, not equal).
namespace {
// Two parameters (37 values, and 3 x 5) and, at each step, gradients made by
// the same ops on both sides; the parameters' bits after 5 steps.
const char* fused_adam_python = R"(
import torch
for decoupled in (False, True):
    for amsgrad in (False, True):
        for weight_decay in (0.0, 0.1):
            a = torch.linspace(-1, 1, 37)
            b = torch.linspace(0.5, -2, 15).reshape(3, 5)
            ps = [a.clone().requires_grad_(), b.clone().requires_grad_()]
            kind = torch.optim.AdamW if decoupled else torch.optim.Adam
            opt = kind(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad, fused=True)
            for step in range(5):
                for i, p in enumerate(ps):
                    p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (0.37 * (step + 1) + i)).reshape(p.shape)
                opt.step()
            print(int(decoupled), int(amsgrad), weight_decay, *[v for p in ps for v in p.detach().view(torch.int32).flatten().tolist()])
)";

// Runs our side: the same lines as the script above prints, with `Kind` the
// optimizer (FusedAdam: fused; torch::optim::Adam: LibTorch's own) for each
// setting; the parameters kept in `out` (for the closeness check).
template <class Adam, class AdamW>
std::string fused_adam_lines(std::vector<std::vector<at::Tensor>>* out = nullptr) {
  std::ostringstream lines;
  for (const bool decoupled : {false, true})
    for (const bool amsgrad : {false, true})
      for (const double weight_decay : {0.0, 0.1}) {
        std::vector<at::Tensor> ps{at::linspace(-1, 1, 37).requires_grad_(),
                                   at::linspace(0.5, -2, 15).reshape({3, 5}).requires_grad_()};
        std::unique_ptr<torch::optim::Optimizer> opt;
        if (decoupled)
          opt = std::make_unique<AdamW>(ps, torch::optim::AdamWOptions(0.01)
                                                .betas({0.9, 0.99})
                                                .eps(1e-8)
                                                .weight_decay(weight_decay)
                                                .amsgrad(amsgrad));
        else
          opt = std::make_unique<Adam>(
              ps,
              torch::optim::AdamOptions(0.01).betas({0.9, 0.99}).eps(1e-8).weight_decay(weight_decay).amsgrad(amsgrad));
        for (int step = 0; step < 5; ++step) {
          for (std::size_t i = 0; i < ps.size(); ++i)
            ps[i].mutable_grad() =
                at::sin(at::arange(ps[i].numel(), at::kFloat) * (0.37 * (step + 1) + static_cast<double>(i)))
                    .reshape(ps[i].sizes());
          opt->step();
        }
        lines << decoupled << ' ' << amsgrad << ' ' << (weight_decay == 0 ? "0.0" : "0.1");
        for (const auto& p : ps) {
          const at::Tensor bits = p.detach().view(at::kInt).contiguous();
          for (int64_t j = 0; j < bits.numel(); ++j) lines << ' ' << bits.data_ptr<int32_t>()[j];
        }
        lines << '\n';
        if (out) out->push_back(ps);
      }
  return lines.str();
}
}  // namespace

TEST_SUITE("single") {
  // The engine's pool lends buffers by handle, and takes one back only when nothing refers to it: a view of it
  // that outlives its lease (what autograd saves in a forward), or a data pointer borrowed into it (a unit's
  // parameter), keeps it from the next request, which gets another buffer; once they go, it is taken again with
  // no new allocation. A borrowed pointer keeps the memory alive past the pool itself.
  TEST_CASE("sharding: the pool never lends a buffer that a tensor or a borrowed pointer still refers to") {
    using accel::detail::dp::BufferPool;
    const auto f32 = at::TensorOptions(at::kFloat);
    BufferPool pool;
    BufferPool::Lease a = pool.take(100, f32);
    a.tensor().fill_(1.0f);
    at::Tensor saved = a.tensor().view({10, 10});  // a view that outlives the lease
    const void* first = a.tensor().data_ptr();
    a.reset();
    CHECK_FALSE(a);
    BufferPool::Lease b = pool.take(100, f32);  // the first buffer is referred to: another one
    CHECK(b.tensor().data_ptr() != first);
    CHECK(pool.bytes() == 2 * 100 * 4);
    b.tensor().fill_(2.0f);
    CHECK(saved.eq(1.0f).all().item<bool>());  // the saved view still reads its own values
    const void* second = b.tensor().data_ptr();
    saved = at::Tensor();
    b.reset();
    BufferPool::Lease c = pool.take(90, f32);  // both free now: one of them, nothing allocated
    CHECK((c.tensor().data_ptr() == first || c.tensor().data_ptr() == second));
    CHECK(pool.bytes() == 2 * 100 * 4);
    // A borrowed data pointer: the buffer is not lent again while it lives.
    const void* lent = c.tensor().data_ptr();
    c10::DataPtr borrowed = c.borrow(8, c10::Device(c10::kCPU));
    CHECK(static_cast<const char*>(borrowed.get()) == static_cast<const char*>(lent) + 8);
    c.reset();
    BufferPool::Lease d = pool.take(100, f32), e = pool.take(100, f32);
    CHECK(d.tensor().data_ptr() != lent);
    CHECK(e.tensor().data_ptr() != lent);  // (a third buffer: the borrowed one stays out)
    CHECK(pool.bytes() == 3 * 100 * 4);
    d.reset();
    e.reset();
    pool.clear();  // frees the two free buffers; the borrowed one stays
    CHECK(pool.bytes() == 100 * 4);
    borrowed = c10::DataPtr();
    BufferPool::Lease g = pool.take(100, f32);
    CHECK(g.tensor().data_ptr() == lent);
    // A pointer borrowed past the pool's end keeps the memory.
    c10::DataPtr outlives;
    {
      BufferPool short_lived;
      BufferPool::Lease h = short_lived.take(16, f32);
      h.tensor().fill_(3.0f);
      outlives = h.borrow(0, c10::Device(c10::kCPU));
    }
    CHECK(static_cast<const float*>(outlives.get())[15] == 3.0f);
  }

  TEST_CASE("FusedAdam and FusedAdamW: Python's fused=True bit for bit, torch::optim::Adam's to rounding") {
    if (!accel::detail::has_fused_adam) {
      const std::string refused = what_of([] { accel::FusedAdam adam(std::vector<at::Tensor>{at::zeros({1})}); });
      MESSAGE("LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << ": " << refused);
      CHECK(refused.find("accel::FusedAdam needs LibTorch 2.4 or newer") != std::string::npos);
      CHECK(what_of([] {
              accel::FusedAdamW adamw(std::vector<at::Tensor>{at::zeros({1})});
            }).find("use torch::optim::AdamW") != std::string::npos);
      return;
    }
    std::vector<std::vector<at::Tensor>> fused, plain;
    const std::string ours = fused_adam_lines<accel::FusedAdam, accel::FusedAdamW>(&fused);
    CHECK(ours == python_output(fused_adam_python, "fused_adam"));
    fused_adam_lines<torch::optim::Adam, torch::optim::AdamW>(&plain);
    REQUIRE(fused.size() == plain.size());
    double worst = 0;
    for (std::size_t k = 0; k < fused.size(); ++k)
      for (std::size_t i = 0; i < fused[k].size(); ++i)
        worst = std::max(worst, (fused[k][i] - plain[k][i]).abs().max().item<double>());
    MESSAGE("largest difference to torch::optim::Adam / AdamW after 5 steps: " << worst);
    CHECK(worst < 1e-6);  // the same update, rounded otherwise (a step moves a parameter by about lr = 0.01)
  }

  TEST_CASE("FusedAdam: LibTorch's state (checkpoints and sharding read it), and what the kernel refuses") {
    if (!accel::detail::has_fused_adam) return;  // (the constructor refuses: above)
    Mlp model(4, 8, 1), local = copy_of(model, 4, 8, 1);
    accel::FusedAdam fused(model->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
    torch::optim::Adam plain(local->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
    const at::Tensor x = at::linspace(-1, 1, 12).reshape({3, 4});
    for (int step = 0; step < 3; ++step)
      for (auto [m, o] : {std::pair<Mlp*, torch::optim::Optimizer*>{&model, &fused}, {&local, &plain}}) {
        o->zero_grad();
        (*m)(x).pow(2).sum().backward();
        o->step();
      }
    REQUIRE(fused.state().size() == plain.state().size());
    const auto params = model->parameters(), local_params = local->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& f = static_cast<const torch::optim::AdamParamState&>(
          *fused.state().find(accel::detail::dp::state_key(fused.state(), params[i].unsafeGetTensorImpl()))->second);
      const auto& p = static_cast<const torch::optim::AdamParamState&>(
          *plain.state()
               .find(accel::detail::dp::state_key(plain.state(), local_params[i].unsafeGetTensorImpl()))
               ->second);
      CHECK(f.step() == 3);
      CHECK(f.step() == p.step());
      CHECK(at::allclose(f.exp_avg(), p.exp_avg(), 1e-5, 1e-7));
      CHECK(at::allclose(f.exp_avg_sq(), p.exp_avg_sq(), 1e-5, 1e-7));
      CHECK(at::allclose(f.max_exp_avg_sq(), p.max_exp_avg_sq(), 1e-5, 1e-7));
    }
    // A closure, as LibTorch's step takes it: its loss comes back.
    const at::Tensor loss = fused.step([&] {
      fused.zero_grad();
      const at::Tensor l = model(x).pow(2).sum();
      l.backward();
      return l;
    });
    CHECK(loss.defined());
    // Gradients the kernel cannot take, named.
    at::Tensor w = at::ones({4}).requires_grad_();
    accel::FusedAdam one(std::vector<at::Tensor>{w});
    w.mutable_grad() = at::ones({4}, at::kDouble);
    CHECK(what_of([&] { one.step(); }).find("parameter 0 of its group is Float on cpu with a gradient of Double") !=
          std::string::npos);
    w.mutable_grad() = at::ones({4}).to_sparse();
    CHECK(what_of([&] { one.step(); }).find("accel::FusedAdam does not support sparse gradients") != std::string::npos);
    CHECK(one.state().empty());  // a refused step moves nothing (no state made, no count advanced)
  }
}
