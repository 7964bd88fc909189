// Training tests, the Accelerator's control of training: accumulation, no_sync, prepared optimizers and schedulers, joins, triggers, configuration errors.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

TEST_SUITE("ranks") {
  TEST_CASE(
      "collective helpers: one called on the main process alone is named (debug mode: at once; else in its error)") {
    release_world();
    if (!accel::is_distributed() || accel::get_world_size() < 2) return;
    namespace fs = std::filesystem;
    fs::path dir;
    {
      accel::Accelerator accelerator(config());
      Mlp model(4, 8, 1);
      accelerator.prepare(model);
      dir = shared_temp_path(accelerator, "accel_main_alone_");
      // Debug mode: the others' wait_for_everyone meets the main process's save_model, and every process names both.
      accel::set_debug_mode(true);
      const std::string both = what_of([&] {
        if (accelerator.is_main_process()) accelerator.save_model(model, dir.string());
        else accelerator.wait_for_everyone();
      });
      accel::set_debug_mode(false);
      CHECK(both.find("rank 0: accel::Accelerator::save_model") != std::string::npos);
      CHECK(both.find("rank 1: accel::Accelerator::wait_for_everyone") != std::string::npos);
      accelerator.wait_for_everyone();  // (both checks were the same all-gathers: still in step)
      // Without it, the main process waits in save_model's collective for the others, until the timeout.
      // Here they leave instead (below: they destroy their groups), so that it fails at once; its error,
      // as the timeout's would, says that save_model is a collective.
      if (accelerator.is_main_process()) {
        const std::string alone = what_of([&] { accelerator.save_model(model, dir.string()); });
        CHECK(alone.find("[accel::Accelerator::save_model is a collective: every process calls it") !=
              std::string::npos);
      }
    }
    release_world();  // a fresh world for what follows
    const int P = world().get_world_size();
    CHECK(accel::all_reduce(1, accel::ReduceOp::SUM) == P);
    if (accel::get_rank() == 0) fs::remove_all(dir);
  }

  TEST_CASE("Accelerate's names: prepare_model/optimizer/scheduler, ranks per dimension, is_fsdp2 and the rest") {
    release_world();
    const int P = accel::get_world_size(), r = accel::get_rank();
    {
      accel::Accelerator accelerator(config());
      Mlp model(4, 8, 1);
      CHECK(&accelerator.prepare_model(model) == &model);
      CHECK(accelerator.data_parallel(model) != nullptr);
      // The same as prepare(): a scheduler prepared either way steps alike.
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1)),
          twin(sgd.param_groups()[0].params(), torch::optim::SGDOptions(0.1));
      accel::AcceleratedOptimizer optimizer = accelerator.prepare_optimizer(sgd);
      accel::AcceleratedOptimizer twin_optimizer = accelerator.prepare(twin);
      torch::optim::StepLR step_lr(sgd, 1, 0.5), twin_lr(twin, 1, 0.5);
      accel::AcceleratedScheduler scheduler = accelerator.prepare_scheduler(step_lr);
      accel::AcceleratedScheduler twin_scheduler = accelerator.prepare(twin_lr);
      const auto data = dataset(8, 4);
      accelerator.backward(torch::mse_loss(model(data.first), data.second));
      optimizer.step();
      twin_optimizer.step();
      scheduler.step();
      twin_scheduler.step();
      CHECK(sgd.param_groups()[0].options().get_lr() == twin.param_groups()[0].options().get_lr());
      CHECK(accelerator.use_distributed() == (P > 1));
      CHECK(accelerator.data_parallel_rank() == r);  // the data mesh is (dp = P, cp = 1)
      CHECK(accelerator.context_parallel_rank() == 0);
      CHECK(accelerator.tensor_parallel_rank() == 0);
      CHECK(accelerator.pipeline_parallel_rank() == 0);
      CHECK_FALSE(accelerator.is_fsdp2());
      CHECK(accelerator.should_save_model());
      CHECK_FALSE(accelerator.verify_device_map(model));
      CHECK_THROWS_WITH_AS(accelerator.lomo_backward(at::ones({}), 0.1),
                           doctest::Contains("Are you sure you passed a LOMO optimizer"), accel::InvalidArgument);
    }
    if (P % 2 == 0) {  // (dp = P / 2, cp = 2), row-major: rank r is dp r / 2, cp r % 2
      release_world();
      auto c = config();
      c.distributed.cp_size = 2;
      accel::Accelerator accelerator(c);
      CHECK(accelerator.data_parallel_rank() == r / 2);
      CHECK(accelerator.context_parallel_rank() == r % 2);
    }
    if (P % 2 == 0) {  // pp above 1 (its training: test_training_pp.cpp)
      release_world();
      auto c = config();
      c.distributed.pp_size = 2;
      accel::Accelerator accelerator(c);
      CHECK(accelerator.pipeline_parallel_rank() == r / (P / 2));
      CHECK(accelerator.data_parallel_rank() == r % (P / 2));
    }
    for (const auto strategy : {accel::ShardingStrategy::SHARD_GRAD_OP, accel::ShardingStrategy::FULL_SHARD}) {
      release_world();
      auto c = config();
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      // parameters sharded at rest: FULL_SHARD with more than one process to shard over
      CHECK(accelerator.is_fsdp2() == (P > 1 && strategy == accel::ShardingStrategy::FULL_SHARD));
    }
    release_world();
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
            at::Tensor loss =
                torch::mse_loss(t.reference(accelerator.gather(batch.data)), accelerator.gather(batch.target));
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
  TEST_CASE(
      "prepare(model, optimizer, scheduler): steps and zero_grad skipped between syncs; the scheduler steps P times") {
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
    auto loader =
        accelerator.prepare_data_loader(Regression(40).map(torch::data::transforms::Stack<>()), {.batch_size = 4});
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

  // Accelerate's test_distributed_data_loop.py test_join_can_override_even_batches, with the passes counted.
  TEST_CASE("join_uneven_inputs(..., even_batches): the prepared loaders' setting for the passes inside the block") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    torch::nn::Linear model(1, 1);
    accelerator.prepare(model);
    // P + 1 samples in batches of 1: with even_batches every process gets 2 batches, without, process 0 only.
    const auto n = static_cast<std::size_t>(P + 1);
    auto train = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()), {.batch_size = 1});
    auto valid = accelerator.prepare_data_loader(Indexed(n).map(torch::data::transforms::Stack<>()), {.batch_size = 1});
    auto passes = [&] {
      std::vector<std::size_t> lengths;
      for (auto* loader : {&train, &valid}) {
        std::size_t k = 0;
        for (auto& batch : *loader) {
          (void)batch;
          ++k;
        }
        lengths.push_back(k);
        CHECK(loader->batches() == k);
      }
      return lengths;
    };
    const std::size_t even = P == 1 ? n : 2, uneven = P == 1 ? n : (r == 0 ? 2 : 1);
    CHECK(passes() == std::vector<std::size_t>{even, even});
    std::vector<std::size_t> inside;
    accelerator.join_uneven_inputs([&] { inside = passes(); }, /*even_batches=*/false, model);
    CHECK(inside == std::vector<std::size_t>{uneven, uneven});
    CHECK(passes() == std::vector<std::size_t>{even, even});  // the loaders' own setting again
    CHECK_THROWS_WITH_AS(accelerator.join_uneven_inputs([] { throw std::runtime_error("body failed"); }, false, model),
                         "body failed", std::runtime_error);
    CHECK(passes() == std::vector<std::size_t>{even, even});  // and after a body that threw
  }

  // Accelerate's free_memory between two training runs (its test_accelerator.py test_free_memory_dereferences_prepared_components:
  // nothing prepared stays referenced), here with what a C++ caller keeps: the model and optimizer themselves.
  TEST_CASE("free_memory: every prepared model a plain module again, sharded ones gathered; the step count restarts") {
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::SHARD_GRAD_OP,
                                accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(strategy);
      release_world();
      auto c = config(/*accumulation=*/2);
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      const bool sharded = accelerator.sharding_strategy() != accel::ShardingStrategy::NO_SHARD;
      torch::manual_seed(5);
      Mlp model(4, 8, 1);
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
      auto prepared = accelerator.prepare(model, adam);
      accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
      const auto data = dataset(8, 4);
      for (int step = 0; step < 3; ++step) {  // micro-steps 1 and 2 make a step; 3 accumulates
        auto guard = accelerator.accumulate(model);
        accelerator.backward(torch::mse_loss(model(data.first), data.second));
        optimizer.step();
        optimizer.zero_grad();
      }
      at::Tensor trained;
      {
        const auto full = accelerator.data_parallel(model)->summon_full_params();
        trained = flat_parameters(*model).clone();
      }
      accelerator.free_memory();
      CHECK(accelerator.data_parallel(model) == nullptr);
      CHECK(flat_parameters(*model).equal(trained));  // (at rest under FULL_SHARD before: gathered for good)
      // The optimizer steps the model's own parameters again; state kept per shard starts afresh.
      const auto params = model->parameters();
      const auto& group = adam.param_groups().at(0).params();
      REQUIRE(group.size() == params.size());
      for (std::size_t i = 0; i < params.size(); ++i) CHECK(group[i].is_same(params[i]));
      CHECK(adam.state().size() == (sharded ? 0 : params.size()));
      // A plain module: called directly, trained locally.
      adam.zero_grad();
      torch::mse_loss(model->body->forward(data.first), data.second).backward();
      adam.step();
      CHECK_FALSE(flat_parameters(*model).equal(trained));
      // A second run in the same process: prepared anew, its accumulation count from the start
      // (without the restart the third micro-step above would make this first one a sync step).
      torch::optim::SGD sgd(model->parameters(), 0.1);
      auto again = accelerator.prepare(model, sgd);
      std::vector<bool> syncs;
      for (int step = 0; step < 2; ++step) {
        auto guard = accelerator.accumulate(model);
        syncs.push_back(accelerator.sync_gradients());
        accelerator.backward(torch::mse_loss(model(data.first), data.second));
        std::get<1>(again).step();
        std::get<1>(again).zero_grad();
      }
      CHECK(syncs == std::vector<bool>{false, true});
      const auto full = accelerator.data_parallel(model)->summon_full_params();
      if (accelerator.data_parallel(model)->distributed())
        CHECK(identical_across_ranks(*model, accelerator.data_parallel(model)->group()));
    }
    release_world();
  }

  // Accelerate's test_script.py test_trigger and process_execution_check.
  TEST_CASE("set_trigger on one process stops every process; main_process_first and the on_* wrappers") {
    accel::Accelerator accelerator(config());
    const int P = accelerator.num_processes(), r = accelerator.process_index();
    CHECK_FALSE(accelerator.check_trigger());
    if (accelerator.is_last_process()) accelerator.set_trigger();
    CHECK(accelerator.check_trigger());
    CHECK_FALSE(accelerator.check_trigger());  // reset by the check

    std::vector<std::string> where{
        accelerator.is_main_process()
            ? (std::filesystem::temp_directory_path() / ("accel_first_" + std::to_string(getpid()) + ".txt")).string()
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
    CHECK(accelerator.reduce(at::full({2}, float(r)), "mean").equal(at::full({2}, (P - 1) / 2.0f)));  // as Accelerate
    CHECK_THROWS_WITH_AS(accelerator.reduce(at::ones({2}), "avg"), doctest::Contains("unknown reduction 'avg'"),
                         accel::InvalidArgument);
    CHECK(accelerator.gather(at::full({1}, r)).size(0) == P);
    CHECK(accelerator.pad_across_processes(at::ones({r + 1})).size(0) == P);
    CHECK(accelerator.split_between_processes(std::vector<int>(static_cast<std::size_t>(P), 1)).size() == 1);
  }
  TEST_CASE("log: the main process appends to metrics.jsonl and metrics.csv as Python's json and csv write them") {
    auto c = config();
    c.log_with = {"all"};
    c.project_config.project_dir = "unused";  // (logging_dir wins)
    std::filesystem::path root;
    {
      accel::Accelerator probe(config());
      root = shared_temp_path(probe, "accel_log_");
    }
    c.project_config.logging_dir = root;
    accel::Accelerator accelerator(c);
    accelerator.init_trackers("run", {{"lr", "0.01"}, {"note", "a \"quoted\" word"}});
    CHECK(accelerator.logging_dir() == root / "run");
    accelerator.log({{"loss", 1.5}}, 0);
    accelerator.log({{"loss", std::nan("")}, {"acc", 0.1}}, 1);             // a new key: the CSV header widens
    accelerator.log({{"loss", -std::numeric_limits<double>::infinity()}});  // no step
    accelerator.end_training();
    CHECK_THROWS_WITH_AS(accelerator.log({{"loss", 1.0}}, 3), doctest::Contains("after end_training()"),
                         accel::InvalidArgument);
    accelerator.wait_for_everyone();
    auto lines = [](const std::filesystem::path& file) {
      std::vector<std::string> out;
      std::ifstream in(file);
      for (std::string line; std::getline(in, line);) out.push_back(line);
      return out;
    };
    // What json.dumps / csv.writer give for the same values (written by hand from Python 3.11's output).
    CHECK(lines(root / "run" / "metrics.jsonl") == std::vector<std::string>{R"({"step": 0, "loss": 1.5})",
                                                                            R"({"step": 1, "acc": 0.1, "loss": NaN})",
                                                                            R"({"loss": -Infinity})"});
    CHECK(lines(root / "run" / "metrics.csv") ==
          std::vector<std::string>{"step,loss,acc", "0,1.5,", "1,nan,0.1", ",-inf,"});
    CHECK(lines(root / "run" / "config.json") ==
          std::vector<std::string>{R"({"lr": "0.01", "note": "a \"quoted\" word"})"});
    CHECK_FALSE(std::filesystem::exists("unused"));
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) std::filesystem::remove_all(root);
  }
  // Keys holding a comma, a quote or a line break (LF, CRLF) are RFC 4180 fields, and Python's csv module reads
  // back every row as logged: through the header's rewrites (a new key) and a resumed run (a second Accelerator
  // appending under the same header, widening it once more). On main before this, a rewrite read the quoted
  // header line by line and turned its second half into a row, and a resumed run took only its first line.
  TEST_CASE("log: metrics.csv keys with commas, quotes and line breaks read back in Python's csv, resumed too") {
    const std::string plain = "plain", comma = "a,b", quote = "say \"hi\"", lf = "line\nbreak", crlf = "cr\r\nlf";
    accel::AcceleratorConfig c = config();
    c.log_with = {"csv"};
    {
      accel::Accelerator probe(config());
      c.project_config.project_dir = shared_temp_path(probe, "accel_log_csv_");
    }
    const std::filesystem::path file = c.project_config.project_dir / "run" / "metrics.csv";
    {
      accel::Accelerator accelerator(c);
      accelerator.init_trackers("run");
      accelerator.log({{plain, 1.5}, {lf, 2.5}}, 0);
      accelerator.log({{comma, 3.5}}, 1);  // a new key: the header (holding a line break) is rewritten
      accelerator.log({{quote, 4.5}, {lf, 5.5}}, 2);
      accelerator.log({{plain, 6.5}}, 3);
      accelerator.end_training();
    }
    {  // resumed: the header is read back from the file, then widened
      accel::Accelerator accelerator(c);
      accelerator.init_trackers("run");
      accelerator.log({{crlf, 7.5}}, 4);
      accelerator.log({{lf, 8.5}}, 5);
      accelerator.wait_for_everyone();
      if (!accelerator.is_main_process()) return;
    }
    const std::string script = "import csv, json\nprint(json.dumps(list(csv.reader(open(" +
                               accel::detail::json_quote(file.string()) + ", newline='')))))\n";
    const accel::detail::Json read =
        accel::detail::JsonReader(python_output(script.c_str(), "metrics_csv"), "Python's csv").document();
    std::vector<std::vector<std::string>> rows;
    for (const auto& row : read.items) {
      rows.emplace_back();
      for (const auto& cell : row.items) rows.back().push_back(cell.text);
    }
    // Columns in the order the keys first came (within a call, the map's order: "line\nbreak" < "plain").
    const std::vector<std::vector<std::string>> expected{{"step", lf, plain, comma, quote, crlf},
                                                         {"0", "2.5", "1.5", "", "", ""},
                                                         {"1", "", "", "3.5", "", ""},
                                                         {"2", "5.5", "", "", "4.5", ""},
                                                         {"3", "", "6.5", "", "", ""},
                                                         {"4", "", "", "", "", "7.5"},
                                                         {"5", "8.5", "", "", "", ""}};
    CHECK(rows == expected);
    std::filesystem::remove_all(c.project_config.project_dir);
  }
  TEST_CASE("accelerator cleanup") { release_world(); }
}

TEST_SUITE("single") {
  TEST_CASE("training: every enum round-trips through its string form, as the core's do") {
    using accel::ShardingStrategy;
    for (auto s : {ShardingStrategy::NO_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::FULL_SHARD,
                   ShardingStrategy::HYBRID_SHARD})
      CHECK(accel::from_string<ShardingStrategy>(accel::to_string(s)) == s);
    CHECK(accel::from_string<ShardingStrategy>("HYBRID_SHARD") == ShardingStrategy::HYBRID_SHARD);
    CHECK_THROWS_WITH_AS(
        accel::from_string<ShardingStrategy>("full_shard"),
        doctest::Contains(
            "unknown value 'full_shard' (expected one of: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD)"),
        accel::InvalidArgument);
    CHECK(accel::from_string<accel::DistributedType>("MULTI_GPU") == accel::DistributedType::MULTI_GPU);
    CHECK(accel::to_string(accel::DDPCommunicationHookType::POWER_SGD) == "power_sgd");  // Accelerate's value
    CHECK(accel::from_string<accel::DDPCommunicationHookType>("bf16") == accel::DDPCommunicationHookType::BF16);
    CHECK(accel::from_string<accel::ShardLayout>("SAMPLES") == accel::ShardLayout::SAMPLES);
    std::ostringstream os;
    os << accel::DistributedType::MULTI_CPU << ' ' << ShardingStrategy::FULL_SHARD << ' '
       << accel::ShardLayout::BATCHES;
    CHECK(os.str() == "MULTI_CPU FULL_SHARD BATCHES");
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
    // Refused before the rendezvous: no rank leaves while its peers connect.
    release_world();
    auto bad = config();
    bad.log_with = {"tensorboard"};
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad}, doctest::Contains("log_with names 'tensorboard'"),
                         accel::InvalidArgument);
    bad.log_with = {"csv"};
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad}, doctest::Contains("needs project_config.project_dir"),
                         accel::InvalidArgument);
    bad = config();
    bad.gradient_accumulation_steps = 0;
    CHECK_THROWS_AS(accel::Accelerator{bad}, std::invalid_argument);
    bad = config();
    bad.mixed_precision = "fp8";
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad}, doctest::Contains("mixed_precision 'fp8'"), std::invalid_argument);
    bad.mixed_precision = "fp16";
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad}, doctest::Contains("needs CUDA"), std::invalid_argument);
    // Accelerate's ParallelismConfig: its sizes checked with Accelerate's messages, and given once.
    bad = config();
    bad.parallelism_config = accel::ParallelismConfig{.dp_shard_size = 0};
    CHECK_THROWS_WITH_AS(accel::Accelerator{bad},
                         "accel::ParallelismConfig: dp_shard_size must be at least 1, but got 0",
                         accel::InvalidArgument);
    bad.parallelism_config = accel::ParallelismConfig{.tp_size = 2};
    bad.distributed.cp_size = 2;
    CHECK_THROWS_WITH_AS(
        accel::Accelerator{bad},
        doctest::Contains("parallelism_config and distributed's sizes both given; give the sizes once"),
        accel::InvalidArgument);
    CHECK_FALSE(accel::DistributedInterface::is_initialized());
    auto bf16 = config();
    bf16.mixed_precision = "bf16";
    accel::Accelerator accelerator(bf16);
    CHECK(&accelerator.state() == &accel::DistributedInterface::instance());  // PartialState: the process's facts
    CHECK(accelerator.state().get_world_size() == accelerator.num_processes());
    CHECK_FALSE(accelerator.fp8_backend().has_value());  // no FP8 backend: Accelerate's None
    {
      auto autocast = accelerator.autocast();
      at::Tensor out = at::matmul(at::ones({2, 2}), at::ones({2, 2}));
      CHECK((out.scalar_type() == at::kBFloat16));  // LibTorch's CPU autocast at work
    }
    CHECK((at::matmul(at::ones({2, 2}), at::ones({2, 2})).scalar_type() == at::kFloat));
    world().destroy();
  }

  TEST_CASE("ParallelismConfig: Accelerate's sizes mapped field by field onto the model and data meshes") {
    // (dp_replicate, dp_shard, cp, tp) = (2, 2, 2, 2) on 16 processes: FSDP shards over dp_shard x cp.
    const accel::DistributedConfig all =
        accel::ParallelismConfig{.dp_replicate_size = 2, .dp_shard_size = 2, .tp_size = 2, .cp_size = 2}
            .distributed_config(16);
    CHECK(all.mp_replicate_size == 2);
    CHECK(all.mp_shard_size == 4);
    CHECK(all.dp_size == 4);
    CHECK(all.cp_size == 2);
    CHECK(all.tp_size == 2);
    const accel::DistributedStrategy mesh(all, 16);  // a valid strategy: each mesh multiplies to 16
    CHECK((mesh.model_mesh_shape() == std::array{2, 4}));
    CHECK((mesh.data_mesh_shape() == std::array{4, 2}));
    // The default: everything along dp_shard, as DistributedConfig's default puts it along mp_shard and dp.
    const accel::DistributedConfig plain = accel::ParallelismConfig{}.distributed_config(8);
    CHECK(accel::DistributedStrategy(plain, 8) == accel::DistributedStrategy(accel::DistributedConfig{}, 8));
    CHECK(accel::ParallelismConfig{.tp_size = 2}.distributed_config(8).dp_size == 4);
    CHECK_THROWS_WITH_AS(accel::ParallelismConfig{.dp_shard_size = 2}.distributed_config(6),
                         "accel::ParallelismConfig: total_size (2) does not match num_processes (6). Please adjust "
                         "dp_replicate_size/dp_shard_size/tp_size/cp_size.",
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(accel::ParallelismConfig{.tp_size = 4}.distributed_config(6),
                         "accel::ParallelismConfig: dp_replicate_size * tp_size * cp_size (4) does not divide "
                         "num_processes (6), so no dp_shard_size fits; please adjust dp_replicate_size/tp_size/cp_size",
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(accel::ParallelismConfig{.cp_size = -1}.distributed_config(4),
                         "accel::ParallelismConfig: cp_size must be at least 1, but got -1", accel::InvalidArgument);
  }
}
