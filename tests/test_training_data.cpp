// Training tests, prepared data loaders: Accelerate's sharding and dispatch, samplers, gather_for_metrics, and Accelerate itself compared (python_accelerate).
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

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

  TEST_CASE(
      "data: nested prepared loaders: end_of_dataloader and active_dataloader follow the innermost (Accelerate's "
      "test_dataloader_break)") {
    accel::Accelerator accelerator(config());
    const auto P = static_cast<std::size_t>(accelerator.num_processes());
    auto first = accelerator.prepare_data_loader(Indexed(5 * P).map(torch::data::transforms::Stack<>()));
    auto second = accelerator.prepare_data_loader(Indexed(6 * P).map(torch::data::transforms::Stack<>()));
    CHECK_FALSE(accelerator.end_of_dataloader());
    CHECK(accelerator.active_dataloader() == nullptr);
    std::size_t iteration = 0;
    for (auto& outer : first) {
      (void)outer;
      CHECK(accelerator.active_dataloader() == &first);
      CHECK(accelerator.end_of_dataloader() == (iteration == first.batches() - 1));
      if (iteration == 1) {
        std::size_t inner = 0;
        for (auto& batch : second) {
          (void)batch;
          CHECK(accelerator.active_dataloader() == &second);
          CHECK(accelerator.end_of_dataloader() == (inner++ == second.batches() - 1));
        }
        CHECK(accelerator.active_dataloader() == &first);
        CHECK_FALSE(accelerator.end_of_dataloader());  // back in the outer pass, not its last batch
      }
      ++iteration;
    }
    CHECK(accelerator.active_dataloader() == nullptr);
    CHECK_FALSE(accelerator.end_of_dataloader());
    for (auto& batch : first) {  // a pass left early ends with its iterator
      (void)batch;
      if (accelerator.end_of_dataloader()) break;
    }
    CHECK_FALSE(accelerator.end_of_dataloader());
  }

  // As Accelerate's stateful-dataloader tests (test_data_loader.py, use_stateful_dataloader): a state_dict
  // taken mid-pass resumes another loader right after it; one taken after a pass, at the next epoch.
  TEST_CASE("data: a prepared loader's state_dict resumes a loader where it was taken, in any process") {
    accel::Accelerator accelerator(config());
    const auto P = static_cast<std::size_t>(accelerator.num_processes());
    auto make = [&] {
      return accelerator.prepare_data_loader(Indexed(8 * P).map(torch::data::transforms::Stack<>()),
                                             {.batch_size = 2, .shuffle = true, .seed = 9});
    };
    auto loader = make();
    for (auto& batch : loader) (void)batch;  // epoch 0
    std::vector<int64_t> rest;
    c10::Dict<std::string, int64_t> mid;
    std::size_t i = 0;
    for (auto& batch : loader) {  // epoch 1: 2 of 4 batches, then the state, then the rest
      if (++i == 2) mid = loader.state_dict();
      if (i > 2)
        for (int64_t k = 0; k < batch.target.size(0); ++k) rest.push_back(batch.target[k].item<int64_t>());
    }
    CHECK(mid.at("epoch") == 1);
    CHECK(mid.at("batches_handed_out") == 2);
    CHECK(loader.state_dict().at("epoch") == 2);  // after the pass: the next one, from its start
    CHECK(loader.state_dict().at("batches_handed_out") == 0);
    // Through LibTorch's pickler, as a checkpoint would keep it.
    const c10::IValue kept = torch::pickle_load(torch::pickle_save(c10::IValue(mid)));
    auto resumed = make();
    resumed.load_state_dict(c10::impl::toTypedDict<std::string, int64_t>(kept.toGenericDict()));
    // Taken again before the pass starts (a save right after a load): the same place, not the pass's start.
    CHECK(resumed.state_dict().at("epoch") == 1);
    CHECK(resumed.state_dict().at("batches_handed_out") == 2);
    std::vector<int64_t> got;
    for (auto& batch : resumed)
      for (int64_t k = 0; k < batch.target.size(0); ++k) got.push_back(batch.target[k].item<int64_t>());
    CHECK(got == rest);
    CHECK(resumed.next_epoch() == 2);
    c10::Dict<std::string, int64_t> bad;
    bad.insert("epoch", 1);
    CHECK_THROWS_WITH_AS(resumed.load_state_dict(bad), doctest::Contains("takes what its state_dict() returns"),
                         accel::InvalidArgument);
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
  TEST_CASE("data cleanup") { release_world(); }
}

TEST_SUITE("single") {
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
    // Accelerate shards a BatchSampler(range(n), batch, drop_last) there: our own batches, and a custom
    // batch sampler making the same ones and stating their size (as a BatchSampler's batch_size does).
    auto batch_sampler = [](std::size_t n, std::size_t batch, bool drop_last) {
      return [=](std::size_t) {
        Batches out;
        for (std::size_t i = 0; i < n; i += batch)
          if (i + batch <= n || !drop_last) {
            out.emplace_back();
            for (std::size_t k = i; k < std::min(n, i + batch); ++k) out.back().push_back(k);
          }
        return out;
      };
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
        accel::ShardSampler custom({.size = c.n, .num_replicas = 2, .rank = r, .even_batches = c.even,
                                    .drop_last = c.drop_last, .split_batches = c.split,
                                    .batch_sampler = batch_sampler(c.n, c.batch, c.drop_last),
                                    .batch_sampler_batch_size = c.batch});
        CHECK(custom.batches() == (r == 0 ? c.p0 : c.p1));
      }
    }
    // A stated size the batches do not keep is an error, not a guess.
    auto stated = [](Batches sequence, std::size_t size) {
      return accel::ShardSampler({.size = 8, .num_replicas = 2, .batch_sampler = [sequence](std::size_t) { return sequence; },
                                  .batch_sampler_batch_size = size});
    };
    CHECK_THROWS_WITH_AS(stated({{0, 1, 2}, {3, 4, 5, 6}}, 3), doctest::Contains("batch 1 holds 4 indices, but it states batches of 3"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(stated({{0, 1}, {2, 3, 4}}, 3), doctest::Contains("batch 0 holds 2 indices"),
                         std::invalid_argument);
    CHECK(stated({{0, 1, 2}, {3, 4}}, 3).batches() == Batches{{0, 1, 2}});  // process 0 of 2
    CHECK_THROWS_WITH_AS(accel::ShardSampler({.size = 8, .batch_sampler_batch_size = 2}),
                         doctest::Contains("there is none"), std::invalid_argument);
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
