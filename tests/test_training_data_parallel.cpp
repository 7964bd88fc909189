// Training tests, DataParallel without sharding: bucket assignment, gradient averaging, communication hooks, the autograd collectives, overlap.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

TEST_SUITE("ranks") {
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
    release_world();  // (refused before the rendezvous)
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("comm_hook is about the all-reduce of NO_SHARD"),
                         accel::InvalidArgument);
    CHECK_FALSE(accel::DistributedInterface::is_initialized());
    // tp = every process through Accelerate's spelling: one data-parallel rank, the tp rank the process's
    // (training beside tp: test_training_tp.cpp).
    accel::AcceleratorConfig t = config();
    t.parallelism_config = accel::ParallelismConfig{.tp_size = P};
    {
      accel::Accelerator tensor_parallel(t);
      CHECK(accel::DistributedInterface::instance().strategy().tp_size() == P);
      CHECK(accel::DistributedInterface::instance().strategy().dp_size() == 1);
      CHECK(tensor_parallel.tensor_parallel_rank() == accel::get_rank());
      CHECK(tensor_parallel.data_parallel_rank() == 0);
    }
    release_world();
    // Accelerate's pure replication (dp_replicate = every process): the model mesh replicates, the data splits.
    t.parallelism_config = accel::ParallelismConfig{.dp_replicate_size = P};
    {
      accel::Accelerator replicated(t);
      CHECK(accel::DistributedInterface::instance().strategy().mp_replicate_size() == P);
      CHECK(accel::DistributedInterface::instance().strategy().mp_shard_size() == 1);
      CHECK(accel::DistributedInterface::instance().strategy().dp_size() == P);
      CHECK(replicated.tensor_parallel_rank() == 0);
    }
    release_world();
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

  // DDP's gradient_as_bucket_view: the gradients are views of the persistent buckets. Training is bit for bit the
  // copying path's (with accumulation, and after gradients set to none). Neither path allocates a bucket per step
  // (allocator bytes): the copying path's bucket persists too, as DDP's (a fresh one per step cost page faults).
  TEST_CASE("training: gradient_as_bucket_view trains bit for bit as the copying path; neither allocates a bucket per step") {
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
    CHECK(per_step[0] == per_step[1]);  // (a bucket per step made them differ by bucket_bytes)
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
    // Buckets issued, whatever path each takes (small ones go point to point, whose messages LibTorch 1.13
    // does not number).
    std::size_t issued = 0;
    dp->on_bucket_issued([&](std::size_t) { ++issued; });
    for (int step = 0; step < 3; ++step) {
      for (int i = 0; i < k; ++i) {
        const int64_t sequence = dp->distributed() ? dp->group()->getSequenceNumberForGroup() : 0;
        issued = 0;
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
          if (i + 1 < k) CHECK(collectives == 0);                 // accumulated locally
          CHECK(issued == (i + 1 < k ? 0 : dp->bucket_count()));  // then the buckets' all-reduces
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
    // The bucket timeline of that backward: every bucket ready, issued, waited for and landed in that order,
    // issued in bucket order, the waits inside finish(); the first issued before the input's gradient.
    const accel::detail::dp::BackwardTimeline timeline = dp->bucket_timeline();
    REQUIRE(timeline.buckets.size() == dp->bucket_count());
    CHECK(timeline.finish_began >= 0);
    CHECK(timeline.finished >= timeline.finish_began);
    int64_t bytes = 0;
    for (std::size_t b = 0; b < timeline.buckets.size(); ++b) {
      const auto& t = timeline.buckets[b];
      CAPTURE(b);
      CHECK(t.ready >= 0);
      CHECK(t.issued >= t.ready);
      CHECK(t.waiting >= std::max(t.issued, timeline.finish_began));
      CHECK(t.landed >= t.waiting);
      CHECK(t.landed <= timeline.finished);
      if (b > 0) CHECK(t.issued >= timeline.buckets[b - 1].issued);
      bytes += t.bytes;
    }
    int64_t gradient_bytes = 0;  // (plus one used-flag per parameter in each bucket)
    for (const auto& p : model->parameters()) gradient_bytes += p.numel() * 4;
    CHECK(bytes >= gradient_bytes);
    CHECK(bytes <= gradient_bytes + 4 * static_cast<int64_t>(model->parameters().size()));
    CHECK(timeline.buckets.front().issued < timeline.finish_began);  // (during the backward)
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
  TEST_CASE("data parallel cleanup") { release_world(); }
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
}
