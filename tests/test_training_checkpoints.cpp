// Training tests, checkpoints (save_state/load_state: crash safety, rotation, resuming) and safetensors, with Python reading ours (python_safetensors).
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

#include <sys/resource.h>

#include <csignal>

TEST_SUITE("ranks") {
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

    // (a file cut short: its size and hash are not those the manifest recorded)
    std::string what =
        refused([](const fs::path& d) { fs::resize_file(d / "optimizer.pt", fs::file_size(d / "optimizer.pt") / 2); },
                accelerator, model, optimizer);
    CHECK(what.find("accel::Accelerator::load_state: " + rank_prefix(0) + dir.string() +
                    "_0/optimizer.pt is damaged or is not this checkpoint's: ") != std::string::npos);
    CHECK(what.find("frame #") == std::string::npos);  // no C++ backtrace
    const std::string last_rng = "random_states_" + std::to_string(P - 1) + ".pt";
    what = refused([&](const fs::path& d) { fs::resize_file(d / last_rng, 10); }, accelerator, model, optimizer);
    CHECK(what.find(rank_prefix(P - 1) + dir.string() + "_1/" + last_rng + " is damaged") != std::string::npos);
    what = refused([&](const fs::path& d) { fs::remove(d / last_rng); }, accelerator, model, optimizer);
    CHECK(what.find(rank_prefix(P - 1) + "missing " + (dir.string() + "_2/") + last_rng) != std::string::npos);
    what = refused(
        [&](const fs::path& d) {  // (a manifest rewritten whole: its own hash is right)
          accel::detail::CheckpointManifest m = *accel::detail::read_manifest(d);
          m.processes = P + 1;
          m.shards = 2;  // sharded: one optimizer file per process
          accel::detail::write_manifest(d, m);
        },
        accelerator, model, optimizer);
    // (sharded: its optimizer state is in pieces, one file per process, which this run would put together)
    CHECK(what.find("missing " + (dir.string() + "_3/") + "optimizer_rank0.pt") != std::string::npos);
    what = refused([](const fs::path& d) { fs::remove(d / "accel_checkpoint.txt"); }, accelerator, model, optimizer);
    CHECK(what.find("no complete checkpoint: " + dir.string() +
                    "_4/accel_checkpoint.txt, which save_state writes last") != std::string::npos);
    {  // a model of another width
      accel::Accelerator other(config());
      Mlp narrow(4, 8, 1);
      torch::optim::SGD narrow_optimizer(narrow->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      other.prepare(narrow, narrow_optimizer);
      what = refused([](const fs::path&) {}, other, narrow, narrow_optimizer);
      CHECK(what.find("_5/model.pt: body.0.weight is Float[16, 4] there, Float[8, 4] in the model") !=
            std::string::npos);
    }
    {  // the same model, an optimizer over some of its parameters: refused as it loads, and put back
      accel::Accelerator other(config());
      Mlp same(4, 16, 1);
      torch::optim::SGD partial(same->body->ptr(0)->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      other.prepare(same, partial);
      what = refused([](const fs::path&) {}, other, same, partial);
      CHECK(what.find("_6/optimizer.pt does not fit the optimizer: ") != std::string::npos);
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

  // Every file of a checkpoint is listed in its manifest with its size and XXH64, and every piece carries the
  // checkpoint's id: a load checks each file it reads before anything changes. One bit flipped in a file's
  // data, a file replaced by the same file of another checkpoint of the same run (same model, processes and
  // strategy), a flipped bit in the manifest itself: refused on every process, naming the file, nothing changed.
  // Under NO_SHARD (model.pt, LibTorch's archive, whose zip CRCs LibTorch does not check) and FULL_SHARD (the
  // pieces, safetensors with no checksum of their own). On main before this, each loaded silently.
  TEST_CASE("checkpoints: a flipped bit or a file of another checkpoint is refused on every process, naming it") {
    namespace fs = std::filesystem;
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(accel::to_string(strategy));
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      const int P = accelerator.num_processes();
      const bool pieces = strategy == accel::ShardingStrategy::FULL_SHARD && P > 1;
      torch::manual_seed(6);
      Mlp model(4, 16, 1);
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      auto prepared = accelerator.prepare(model, optimizer);
      const auto data = dataset(8, 4);
      auto step = [&] {
        std::get<1>(prepared).zero_grad();
        accelerator.backward(torch::mse_loss(model(data.first), data.second));
        std::get<1>(prepared).step();
      };
      const fs::path dir = shared_temp_path(accelerator, "accel_integrity_"), other = dir.string() + "_other";
      step();
      accelerator.save_state(dir);
      step();
      accelerator.save_state(other);  // the same run's next checkpoint: every file of the same name and size
      const std::string target = pieces ? "rank-00000-part-0.safetensors" : "model.pt";
      auto parameters = [&] {
        const auto whole = accelerator.data_parallel(model)->summon_full_params();
        return flat_parameters(*model).clone();
      };
      int copies = 0;
      auto refused = [&](const std::function<void(const fs::path&)>& damage) {
        const fs::path copy = dir.string() + "_" + std::to_string(copies++);
        if (accelerator.is_main_process()) {
          fs::copy(dir, copy, fs::copy_options::recursive);
          damage(copy);
        }
        accelerator.wait_for_everyone();
        const at::Tensor before = parameters();
        const std::vector<double> momentum = momentum_sums(optimizer);
        const std::string what = what_of([&] { accelerator.load_state(copy); });
        CHECK(at::equal(before, parameters()));
        CHECK(momentum == momentum_sums(optimizer));
        accelerator.wait_for_everyone();
        if (accelerator.is_main_process()) fs::remove_all(copy);
        return what;
      };
      auto flip_bit = [](const fs::path& file, uintmax_t at) {
        std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
        io.seekg(static_cast<std::streamoff>(at));
        char byte = 0;
        io.read(&byte, 1);
        byte = static_cast<char>(byte ^ 0x10);
        io.seekp(static_cast<std::streamoff>(at));
        io.write(&byte, 1);
      };
      // One bit of the data (a safetensors file ends with its tensors' bytes; an archive's are inside it).
      std::string what = refused([&](const fs::path& d) {
        const uintmax_t size = fs::file_size(d / target);
        flip_bit(d / target, pieces ? size - 3 : size / 2);
      });
      CHECK(what.find("accel::Accelerator::load_state: ") == 0);
      CHECK(what.find(dir.string() + "_0/" + target + " is damaged or is not this checkpoint's: ") != std::string::npos);
      // The same file of the run's other checkpoint.
      what = refused([&](const fs::path& d) { fs::copy_file(fs::path(other) / target, d / target, fs::copy_options::overwrite_existing); });
      CHECK(what.find(dir.string() + "_1/" + target +
                      (pieces ? " is a piece of another checkpoint (its id " : " is damaged or is not this checkpoint's")) !=
            std::string::npos);
      // A bit of the manifest: no complete checkpoint (its own hash).
      what = refused([&](const fs::path& d) { flip_bit(d / "accel_checkpoint.txt", 30); });
      CHECK(what.find("no complete checkpoint: " + dir.string() + "_2/accel_checkpoint.txt") != std::string::npos);
      // The checkpoints themselves load, each its own state.
      const at::Tensor at_other = parameters();
      accelerator.load_state(dir);
      CHECK_FALSE(at::equal(parameters(), at_other));
      accelerator.load_state(other);
      CHECK(at::equal(parameters(), at_other));
      accelerator.wait_for_everyone();
      if (accelerator.is_main_process()) {
        fs::remove_all(dir);
        fs::remove_all(other);
      }
    }
  }

  // A state-dict adapter (SaveModelOptions / LoadModelOptions) writes a tied GPT-2-shaped model in Hugging Face's
  // GPT-2 layout (Conv1D weights transposed, the tied head left out) from NO_SHARD and from FULL_SHARD (each block
  // a unit, gathered unit by unit) and reads it back, into a plain model (the tie filled from its other name)
  // and into the sharded one; the file's tensors are one process's model's, transposed where GPT-2's are. An
  // adapter giving two tensors one name, or a name, dtype or shape that depends on the values, is refused by
  // name; so is a file whose two names of one tied tensor differ. (The files loaded by transformers'
  // GPT2LMHeadModel: the python_safetensors suite.)
  TEST_CASE("save_model: a state-dict adapter writes GPT-2's layout under every strategy; load_model takes it back") {
    namespace fs = std::filesystem;
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(accel::to_string(strategy));
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      c.auto_wrap_policy = gpt_blocks;
      accel::Accelerator accelerator(c);
      torch::manual_seed(11);
      Gpt model(GptOptions{.layers = 2});
      Gpt reference = copy_of(model);  // one process's model
      accelerator.prepare(model);
      const fs::path dir = shared_temp_path(accelerator, "accel_gpt2_export_");
      accelerator.save_model(model, dir.string(), accel::SaveModelOptions{.adapter = gpt2_adapter(true)});
      std::map<std::string, at::Tensor> file;
      for (auto& named : accel::detail::read_safetensors(dir / "model.safetensors")) file.insert(named);
      CHECK_FALSE(file.count("lm_head.weight"));
      std::size_t compared = 0;
      for (const auto& [name, t] : accel::detail::state_dict(*reference)) {
        if (name == "lm_head.weight") continue;
        REQUIRE(file.count(name));
        CHECK(at::equal(file.at(name), gpt2_conv1d(name) ? t.t() : t));
        compared += gpt2_conv1d(name);
      }
      CHECK(compared == 4 * 2);
      CHECK(file.size() == accel::detail::state_dict(*reference).size() - 1);
      // Back into a plain model with other weights: the head, left out of the file, is the embedding's tensor.
      torch::manual_seed(12);
      Gpt plain(GptOptions{.layers = 2});
      accel::load_model(plain, dir.string(), accel::LoadModelOptions{.adapter = gpt2_adapter(true)});
      CHECK(at::equal(flat_parameters(*plain), flat_parameters(*reference)));
      CHECK(plain->lm_head->weight.is_same(plain->wte->weight));
      // And into the prepared model, moved away from the saved weights first.
      {
        const auto whole = accelerator.data_parallel(model)->summon_full_params(/*writeback=*/true);
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.add_(1.0);
      }
      accelerator.load_model(model, dir.string(), accel::LoadModelOptions{.adapter = gpt2_adapter(true)});
      {
        const auto whole = accelerator.data_parallel(model)->summon_full_params();
        CHECK(at::equal(flat_parameters(*model), flat_parameters(*reference)));
      }
      // Refused, naming the tensors: two tensors to one name; a shape that depends on the values.
      accel::StateDictAdapter same_name;
      same_name.to_file = [](const std::string& name, const at::Tensor& v) {
        return std::optional<accel::NamedTensor>({name.ends_with("ln_f.bias") ? "transformer.ln_f.weight" : name, v});
      };
      CHECK_THROWS_WITH_AS(accelerator.save_model(model, (dir / "x").string(), {.adapter = same_name}),
                           doctest::Contains("the adapter's to_file gives 'transformer.ln_f.weight' and "
                                             "'transformer.ln_f.bias' the same name, 'transformer.ln_f.weight'"),
                           accel::InvalidArgument);
      accel::StateDictAdapter by_values;
      by_values.to_file = [](const std::string& name, const at::Tensor& v) {
        return std::optional<accel::NamedTensor>({name, v.is_meta() ? v : v.reshape({-1})});
      };
      CHECK_THROWS_WITH_AS(accelerator.save_model(model, (dir / "x").string(), {.adapter = by_values}),
                           doctest::Contains("the adapter's to_file gave 'transformer.wte.weight' "
                                             "'transformer.wte.weight', Float[2048] on its values, and "
                                             "'transformer.wte.weight', Float[64, 32] on a meta tensor"),
                           accel::RuntimeError);
      // A file holding both names of the tied tensor, with different values.
      accel::StateDictAdapter both_names = gpt2_adapter(false);  // (keeps lm_head.weight)
      const auto differing = both_names.to_file;
      both_names.to_file = [differing](const std::string& name, const at::Tensor& v) {
        auto out = differing(name, v);
        if (name == "lm_head.weight") out->second = v + 1;
        return out;
      };
      accelerator.save_model(model, (dir / "tied").string(), {.adapter = both_names});
      CHECK_THROWS_WITH_AS(
          accel::load_model(plain, (dir / "tied").string(), {.adapter = gpt2_adapter(true)}),
          doctest::Contains("transformer.wte.weight and lm_head.weight are one tensor in the model (tied), and differ"),
          std::runtime_error);
      CHECK(at::equal(flat_parameters(*plain), flat_parameters(*reference)));  // nothing changed
      accelerator.wait_for_everyone();
      if (accelerator.is_main_process()) fs::remove_all(dir);
    }
  }

  TEST_CASE("checkpoints: a write that fails (a full disk) is an error on every process; the last checkpoint stays") {
    // RLIMIT_FSIZE makes write(2) fail past a size (EFBIG) as a full disk or a
    // quota would (ENOSPC, EDQUOT): without privileges, on one process only.
    // LibTorch's archive writer used to end the process here with
    // std::terminate, throwing from its destructor (pytorch#156955).
    namespace fs = std::filesystem;
    accel::Accelerator accelerator(config());
    Mlp model(4, 512, 1);  // model.pt and model.safetensors: over 12 KB
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    accelerator.prepare(model, optimizer);
    const fs::path dir = shared_temp_path(accelerator, "accel_full_ckpt_");
    const fs::path weights = dir.string() + "_weights";
    accelerator.save_state(dir);
    accelerator.save_model(model, weights.string());
    const at::Tensor saved = flat_parameters(*model).clone();
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.add_(1.0);
    }
    auto bytes_of = [](const fs::path& file) {
      std::ifstream in(file, std::ios::binary);
      return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    };
    const std::string saved_weights = accelerator.is_main_process() ? bytes_of(weights / "model.safetensors") : "";
    // Runs body on every process with files on process `rank` limited to `bytes`.
    auto limited = [&](int rank, rlim_t bytes, const std::function<void()>& body) {
      struct rlimit before{};
      REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
      const auto handler = std::signal(SIGXFSZ, SIG_IGN);  // else past the limit the process is killed
      if (accelerator.process_index() == rank) {
        struct rlimit low = before;
        low.rlim_cur = bytes;
        REQUIRE(::setrlimit(RLIMIT_FSIZE, &low) == 0);
      }
      const std::string what = what_of(body);
      ::setrlimit(RLIMIT_FSIZE, &before);
      std::signal(SIGXFSZ, handler);
      return what;
    };
    const int P = accelerator.num_processes();
    // The last process cannot write its RNG states (over 5 KB), then the main process its model.pt.
    std::string what = limited(P - 1, 4096, [&] { accelerator.save_state(dir); });
    CHECK(what.find("accel::Accelerator::save_state: ") != std::string::npos);
    CHECK(what.find("cannot write " + dir.string() + ".tmp/random_states_" + std::to_string(P - 1) +
                    ".pt: File too large") != std::string::npos);
    what = limited(0, 8192, [&] { accelerator.save_state(dir); });
    CHECK(what.find("cannot write " + dir.string() + ".tmp/model.pt: File too large") != std::string::npos);
    accelerator.wait_for_everyone();                 // (the main process removes it after the error)
    CHECK_FALSE(fs::exists(dir.string() + ".tmp"));  // removed, to give a full disk its space back
    accelerator.load_state(dir);
    CHECK(at::equal(saved, flat_parameters(*model)));
    // save_model: the error on every process, the earlier file whole, no .tmp file left.
    what = limited(0, 8192, [&] { accelerator.save_model(model, weights.string()); });
    CHECK(what.find("accel::save_model: ") != std::string::npos);
    CHECK(what.find("cannot write " + (weights / "model.safetensors.tmp").string() + ": File too large") !=
          std::string::npos);
    if (accelerator.is_main_process()) {
      CHECK(bytes_of(weights / "model.safetensors") == saved_weights);
      CHECK_FALSE(fs::exists(weights / "model.safetensors.tmp"));
    }
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) {
      fs::remove_all(dir);
      fs::remove_all(weights);
    }
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

  TEST_CASE(
      "checkpoints: the learning rate and a scheduler's steps return (LibTorch's Optimizer::load drops the first)") {
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
    {                            // a scheduler already past the checkpoint cannot be replayed back
      accel::Accelerator other(config());
      Mlp m(4, 8, 1);
      torch::optim::SGD o(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::StepLR s(o, 3, 0.5);
      auto p = other.prepare(m, o, s);
      for (int i = 0; i < 5; ++i) std::get<2>(p).step();
      CHECK(what_of([&] { other.load_state(dir); }).find("load the checkpoint before stepping it") !=
            std::string::npos);
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
  // A run Python started goes on here: Python's dcp.save (HuggingFaceStorageWriter) of a model and its AdamW state
  // ({**model_state_dict, "optimizer": {"state": ...}}), written as torch 2.15 writes them: FSDP2's pieces, each
  // tensor's rows cut in two (torch.chunk's 4 + 3 of 7) into two ranks' files placed by DCP_SHARDING_INFO, the
  // 0-d steps in the second; or consolidated into one file (as a torch would whose consolidation kept 0-d tensors:
  // torch 2.15's writes them as zero, which is refused). load_state takes either under NO_SHARD and FULL_SHARD
  // at every number of processes: the weights exact, and the next step as one process's going on with the same
  // state (which a fresh AdamW's first step is far from); under FULL_SHARD the state read back through
  // save_state's own pieces equals what was written. tp_ref.py checks Python's own files (FSDP2 + DTensor, pip).
  TEST_CASE("checkpoints: load_state goes on from Python's dcp.save (the model and AdamW's state)") {
    namespace fs = std::filesystem;
    const auto data = dataset(8, 4);
    const at::Tensor& x = data.first;
    const at::Tensor& y = data.second;
    auto adamw = [](const std::vector<at::Tensor>& parameters) {
      return torch::optim::AdamW(parameters, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    };
    torch::manual_seed(11);
    Mlp reference(4, 7, 2);
    torch::optim::AdamW reference_optimizer = adamw(reference->parameters());
    auto reference_step = [&](torch::optim::Optimizer& optimizer) {
      optimizer.zero_grad();
      torch::mse_loss(reference(x), y).backward();
      optimizer.step();
    };
    reference_step(reference_optimizer);
    reference_step(reference_optimizer);
    // Python's names: the model's state_dict, then optimizer.state.<parameter>.<field>.
    std::vector<std::pair<std::string, at::Tensor>> saved;
    for (const auto& [name, t] : accel::detail::state_dict(*reference)) saved.emplace_back(name, t.detach().clone());
    for (const auto& p : reference->named_parameters()) {
      auto& states = reference_optimizer.state();
      auto& state = static_cast<torch::optim::AdamWParamState&>(
          *states.at(accel::detail::dp::state_key(states, p.value().unsafeGetTensorImpl())));
      const std::string prefix = "optimizer.state." + p.key() + ".";
      saved.emplace_back(prefix + "exp_avg", state.exp_avg().clone());
      saved.emplace_back(prefix + "exp_avg_sq", state.exp_avg_sq().clone());
      saved.emplace_back(prefix + "step", at::scalar_tensor(static_cast<double>(state.step()), at::kFloat));
    }
    // One process's next step from there, and a fresh AdamW's (which the loaded state must not give).
    const at::Tensor at_save = flat_parameters(*reference).clone();
    reference_step(reference_optimizer);
    const at::Tensor going_on = flat_parameters(*reference).clone();
    {
      const at::NoGradGuard no_grad;
      for (const auto& p : reference->named_parameters())
        for (const auto& [name, t] : saved)
          if (name == p.key()) p.value().copy_(t);
    }
    CHECK(at::equal(flat_parameters(*reference), at_save));
    torch::optim::AdamW fresh = adamw(reference->parameters());
    reference_step(fresh);
    const at::Tensor from_fresh = flat_parameters(*reference).clone();
    CHECK((going_on - from_fresh).abs().max().item<double>() > 1e-4);

    std::optional<accel::Accelerator> writer(std::in_place, config());
    const fs::path base = shared_temp_path(*writer, "accel_from_python_");
    auto write_dirs = [&](const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& stem,
                          bool with_consolidated = true) {
      fs::create_directories(base / stem);
      for (int rank = 0; rank < 2; ++rank) {
        std::vector<std::pair<std::string, at::Tensor>> pieces;
        std::string places;
        for (const auto& [name, t] : tensors) {
          if (t.dim() == 0 && rank == 0) continue;  // (the steps: in the second file)
          const int64_t first_rows = t.dim() == 0 ? 0 : (t.size(0) + 1) / 2, from = rank == 0 ? 0 : first_rows;
          const at::Tensor piece =
              t.dim() == 0 ? t : t.narrow(0, from, rank == 0 ? first_rows : t.size(0) - first_rows);
          pieces.emplace_back(name, piece.contiguous());
          std::string offsets = t.dim() == 0 ? "" : std::to_string(from);
          for (int64_t d = 1; d < t.dim(); ++d) offsets += ",0";
          if (!places.empty()) places += ',';  // (piece by piece: GCC 12's -Wrestrict misfires on "" + ...)
          places += "\"" + name + "\":{\"saved_offsets\":[" + offsets + "]}";
        }
        accel::detail::write_safetensors(
            base / stem / ("shard-0000" + std::to_string(rank + 1) + "-model-00001-of-00001.safetensors"), pieces,
            {{"DCP_VERSION", "1.0"}, {"format", "pt"}, {"DCP_SHARDING_INFO", "{" + places + "}"}});
      }
      if (!with_consolidated) return;
      fs::create_directories(base / (stem + "_consolidated"));  // (one file, and an index naming every tensor)
      accel::detail::write_safetensors(base / (stem + "_consolidated") / "model-00001-of-00001.safetensors", tensors,
                                       {});
      std::string index = R"({"metadata": {}, "weight_map": {)";
      for (std::size_t k = 0; k < tensors.size(); ++k) {
        if (k) index += ", ";
        index += "\"" + tensors[k].first + R"(": "model-00001-of-00001.safetensors")";
      }
      std::ofstream(base / (stem + "_consolidated") / "model.safetensors.index.json") << index << "}}";
    };
    if (writer->is_main_process()) {
      write_dirs(saved, "dcp");
      std::vector<std::pair<std::string, at::Tensor>> weights, partial = saved, foreign = saved;
      for (const auto& named : saved)
        if (!named.first.starts_with("optimizer.")) weights.push_back(named);
      write_dirs(weights, "weights", false);
      std::erase_if(partial, [](const auto& named) { return named.first == "optimizer.state.body.2.bias.step"; });
      write_dirs(partial, "partial", false);
      foreign.emplace_back("optimizer.state.body.0.weight.momentum_buffer", at::zeros({7, 4}));
      write_dirs(foreign, "foreign", false);
      // torch 2.15's consolidation writes every 0-d tensor as zero (the steps)
      fs::create_directories(base / "zero_steps");
      std::vector<std::pair<std::string, at::Tensor>> zero_steps = saved;
      for (auto& [name, t] : zero_steps)
        if (t.dim() == 0) t = at::zeros_like(t);
      accel::detail::write_safetensors(base / "zero_steps" / "model-00001-of-00001.safetensors", zero_steps, {});
      write_dirs(saved, "pickled", false);  // a param_groups file as the writer pickles it
      std::ofstream(base / "pickled" / "shard-00003-model-00001-of-00001.safetensors", std::ios::binary)
          << std::string("PK\x03\x04\x00\x00\x08\x08", 8);
    }
    writer->wait_for_everyone();
    const bool main = writer->is_main_process();
    writer.reset();

    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(accel::to_string(strategy));
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      accel::Accelerator accelerator(c);
      const bool pieces = strategy == accel::ShardingStrategy::FULL_SHARD && accelerator.num_processes() > 1;
      torch::manual_seed(12);
      Mlp model(4, 7, 2);
      torch::optim::AdamW optimizer = adamw(model->parameters());
      auto prepared = accelerator.prepare(model, optimizer);
      auto step = [&] {
        std::get<1>(prepared).zero_grad();
        accelerator.backward(torch::mse_loss(model(x), y));
        std::get<1>(prepared).step();
      };
      auto parameters = [&] {
        const auto whole = accelerator.data_parallel(model)->summon_full_params();
        return flat_parameters(*model).clone();
      };
      step();  // (a state of its own, which the load replaces)
      for (const char* refused : {"weights", "partial", "foreign", "zero_steps", "pickled"}) {
        CAPTURE(refused);
        const at::Tensor before = parameters();
        const std::string what = what_of([&] { accelerator.load_state(base / refused); });
        CHECK(at::equal(before, parameters()));
        const std::string dir = (base / refused).string();
        const std::string expected =
            std::string(refused) == "weights"
                ? dir + " holds no state of optimizer 0 (no tensor under optimizer.state.): a model's weights alone, "
                        "which load_model loads"
            : std::string(refused) == "partial"
                ? dir + " holds part of the state of 'body.2.bias' and not its step"
            : std::string(refused) == "foreign"
                ? dir + " holds optimizer.state.body.0.weight.momentum_buffer, which this run's optimizer "
                        "(torch::optim::AdamW) does not keep for any of its parameters"
            : std::string(refused) == "zero_steps"
                ? dir + ": optimizer.state.body.0.weight.step is 0 beside its moments: torch's consolidation"
                : dir + "/shard-00003-model-00001-of-00001.safetensors is a zip archive (torch.save's), not "
                        "safetensors: Python's HuggingFaceStorageWriter pickles";
        CHECK_MESSAGE(what.find(expected) != std::string::npos, what);
      }
      for (const char* stem : {"dcp", "dcp_consolidated"}) {
        CAPTURE(stem);
        accelerator.load_model(model, (base / stem).string());  // (the weights alone: the optimizer's state left)
        CHECK(at::equal(parameters(), at_save));
        step();
        accelerator.load_state(base / stem);
        CHECK(at::equal(parameters(), at_save));
        if (pieces) {  // the state as this run's own pieces place it: what was written
          const fs::path again = base / (std::string(stem) + "_again");
          accelerator.save_state(again);
          const auto read = accel::detail::read_dcp_pieces(again);
          REQUIRE(read.has_value());
          for (const auto& [name, t] : saved) {
            CAPTURE(name);
            CHECK(at::equal(read->at(name), t));
          }
        }
        step();
        const at::Tensor next = parameters();
        CHECK((next - going_on).abs().max().item<double>() <= 1e-6);
      }
      accelerator.wait_for_everyone();
    }
    if (main) fs::remove_all(base);
  }
  TEST_CASE("checkpoints cleanup") { release_world(); }
}

TEST_SUITE("single") {
  // XXH64 as xxHash computes it: the values of Python's xxhash.xxh64(...).intdigest() (xxhash 3.x), whole and
  // fed in pieces of every size; and a file's digest (its size and hash) as the manifest records it.
  TEST_CASE("checkpoints: XXH64 gives xxHash's values, whole or in pieces") {
    std::string repeated;
    for (int i = 0; i < 5; ++i)
      for (int b = 0; b < 256; ++b) repeated += static_cast<char>(b);
    const std::vector<std::pair<std::string, uint64_t>> vectors{
        {"", 0xef46db3751d8e999ull},
        {"a", 0xd24ec4f1a98c6e5bull},
        {"abc", 0x44bc2cf5ad770999ull},
        {"Nobody inspects the spammish repetition", 0xfbcea83c8a378bf1ull},
        {repeated, 0xafc184ad7938a354ull},
        {std::string(31, 'x'), 0x60dd0d01083b99f0ull},
        {std::string(32, 'y'), 0x64da1f1d3495ce66ull},
        {std::string(33, 'z'), 0xc5241253c64e0268ull}};
    for (const auto& [text, expected] : vectors) {
      CAPTURE(text.size());
      CHECK(accel::detail::xxh64(text.data(), text.size()) == expected);
      for (std::size_t piece = 1; piece <= 40; ++piece) {
        accel::detail::Xxh64 h;
        for (std::size_t at = 0; at < text.size(); at += piece) h.update(text.data() + at, std::min(piece, text.size() - at));
        CHECK(h.digest() == expected);
      }
    }
    const auto path = std::filesystem::temp_directory_path() / ("accel_xxh64_" + std::to_string(getpid()));
    std::ofstream(path, std::ios::binary) << repeated;
    const accel::detail::FileDigest digest = accel::detail::digest_of_file(path);
    CHECK(digest.bytes == repeated.size());
    CHECK(digest.xxh64 == 0xafc184ad7938a354ull);
    CHECK(accel::detail::hex64(digest.xxh64) == "afc184ad7938a354");
    CHECK(accel::detail::from_hex64("afc184ad7938a354") == digest.xxh64);
    CHECK_FALSE(accel::detail::from_hex64("afc184ad7938a35").has_value());
    std::filesystem::remove(path);
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

  TEST_CASE("sharded checkpoints: a flat piece as boxes; any range read back from pieces of another cut") {
    using accel::detail::boxes_of_range;
    auto describe = [](const std::vector<accel::detail::TensorBox>& boxes) {
      std::string out;
      for (const auto& b : boxes) out += c10::str(at::IntArrayRef(b.offsets), at::IntArrayRef(b.sizes), "@", b.begin, " ");
      return out;
    };
    // A partial first row, the whole rows, a partial last row (2d-1 boxes at most), each a contiguous run.
    CHECK(describe(boxes_of_range({5, 4}, 2, 17)) == "[0, 2][1, 2]@2 [1, 0][3, 4]@4 [4, 0][1, 1]@16 ");
    CHECK(describe(boxes_of_range({5, 4}, 4, 12)) == "[1, 0][2, 4]@4 ");
    CHECK(describe(boxes_of_range({5, 4}, 5, 7)) == "[1, 1][1, 2]@5 ");
    CHECK(describe(boxes_of_range({2, 3, 4}, 5, 19)) ==
          "[0, 1, 1][1, 1, 3]@5 [0, 2, 0][1, 1, 4]@8 [1, 0, 0][1, 1, 4]@12 [1, 1, 0][1, 1, 3]@16 ");
    CHECK(describe(boxes_of_range({}, 0, 1)) == "[][]@0 ");
    CHECK(boxes_of_range({7}, 3, 3).empty());
    // A [7, 5] tensor written as 3 processes' pieces (ceil(35/3) = 12 elements each), as write_model_shards
    // lays them out, read back in every range, and refused when a piece is missing or twice there.
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / ("accel_pieces_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    const at::Tensor whole = at::arange(35, at::kFloat).reshape({7, 5}), bias = at::arange(3, at::kDouble);
    auto write_piece = [&](int process, int64_t begin, int64_t end) {
      std::size_t j = 0;
      for (const auto& box : boxes_of_range(whole.sizes(), begin, end)) {
        std::vector<std::pair<std::string, at::Tensor>> tensors{
            {"w", whole.reshape({-1}).narrow(0, box.begin, box.numel()).view(box.sizes)}};
        std::string info = "{\"w\":{\"saved_offsets\":[" + std::to_string(box.offsets[0]) + "," +
                           std::to_string(box.offsets[1]) + "]}";
        if (process == 0 && j == 0) {
          tensors.emplace_back("b", bias);
          info += ",\"b\":{\"saved_offsets\":[0]}";
        }
        accel::detail::write_safetensors(dir / ("rank-" + std::to_string(process) + "-part-" + std::to_string(j++) +
                                                ".safetensors"),
                                         tensors, {{"DCP_SHARDING_INFO", info + "}"}});
      }
    };
    for (int k = 0; k < 3; ++k) write_piece(k, 12 * k, std::min<int64_t>(12 * (k + 1), 35));
    accel::detail::CheckpointFiles unrecorded(dir, {.format = 1});  // (no manifest: every *.safetensors, unchecked)
    const accel::detail::ShardedWeights weights(dir, unrecorded);
    weights.check_fits({{"w", at::empty({7, 5})}, {"b", at::empty({3}, at::kDouble)}});
    for (int64_t begin = 0; begin <= 35; ++begin)
      for (int64_t length = 0; begin + length <= 35; ++length)
        REQUIRE(at::equal(weights.read("w", begin, length), whole.reshape({-1}).narrow(0, begin, length)));
    CHECK(at::equal(weights.read("b", 0, 3), bias));
    auto refused = [&](auto fn) {
      try {
        fn();
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
      return std::string();
    };
    CHECK(refused([&] { weights.check_fits({{"w", at::empty({7, 5})}, {"b", at::empty({3})}}); })
              .find("b is Double[3] there, Float[3] in the model") != std::string::npos);
    CHECK(refused([&] { weights.check_fits({{"w", at::empty({7, 5})}}); }).find("not in the model: b") !=
          std::string::npos);
    fs::remove(dir / "rank-1-part-1.safetensors");
    CHECK(refused([&] { accel::detail::ShardedWeights{dir, unrecorded}; }).find("hold 30 of its 35 elements") !=
          std::string::npos);
    write_piece(1, 12, 24);
    fs::copy_file(dir / "rank-1-part-1.safetensors", dir / "rank-9-part-0.safetensors");
    CHECK(refused([&] { accel::detail::ShardedWeights{dir, unrecorded}; }).find("w has overlapping pieces") !=
          std::string::npos);
    fs::remove_all(dir);
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
    {  // Python's dcp.save through HuggingFaceStorageWriter, not consolidated: each rank's pieces in a file of its
       // own, placed by DCP_SHARDING_INFO, no model.safetensors or index (written here as torch 2.15 writes them:
       // the first rows of each tensor in one file, the rest in the other; a scalar in the first)
      fs::create_directories(base / "dcp");
      for (int rank = 0; rank < 2; ++rank) {
        std::vector<std::pair<std::string, at::Tensor>> pieces;
        std::string places;
        for (const auto& [name, t] : accel::detail::state_dict(*saved)) {
          if (t.dim() == 0 && rank == 1) continue;
          const int64_t half = t.dim() == 0 ? 0 : t.size(0) / 2, first = rank == 0 ? 0 : half;
          const at::Tensor piece = t.dim() == 0 ? t : t.narrow(0, first, rank == 0 ? half : t.size(0) - half);
          pieces.emplace_back(name, piece.contiguous());
          std::string offsets = t.dim() == 0 ? "" : std::to_string(first);
          for (int64_t d = 1; d < t.dim(); ++d) offsets += ", 0";
          places += (places.empty() ? "" : ", ") + ("\"" + name + "\": {\"saved_offsets\": [" + offsets + "]}");
        }
        accel::detail::write_safetensors(
            base / "dcp" / ("shard-0000" + std::to_string(rank + 1) + "-model-00001-of-00001.safetensors"), pieces,
            {{"DCP_VERSION", "1.0"}, {"format", "pt"}, {"DCP_SHARDING_INFO", "{" + places + "}"}});
      }
      Net from_pieces = seeded_net(7);
      accelerator.load_model(from_pieces, (base / "dcp").string());
      CHECK(same_state(*saved, *from_pieces));
      // load_state takes it (the ranks suite goes on from such a directory), but refuses what nothing prepared
      // here takes
      CHECK_THROWS_WITH_AS(accelerator.load_state((base / "dcp").string()),
                           doctest::Contains("/dcp holds body.0.bias, which nothing this run prepared takes (0 "
                                             "model(s), 0 optimizer(s))"),
                           accel::RuntimeError);
      fs::remove(base / "dcp" / "shard-00002-model-00001-of-00001.safetensors");  // a rank's file missing
      Net short_of_one = seeded_net(7);
      const std::string what = what_of([&] { accelerator.load_model(short_of_one, (base / "dcp").string()); });
      CHECK(what.find("may be a file missing) does not fit the model: body.0.weight is Float[4, 4] there, "
                      "Float[8, 4] in the model") != std::string::npos);
    }
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
    CHECK(refused((base / "wide").string(), narrow)
              .find("body.0.weight is Float[16, 4] there, Float[8, 4] in the model") != std::string::npos);
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
    // A tied GPT-2-shaped model exported in GPT-2's layout through a state-dict adapter (Conv1D weights
    // transposed, the tied head left out), with the config.json transformers reads, and its logits.
    torch::manual_seed(21);
    Gpt gpt(GptOptions{.layers = 2});
    const at::Tensor tokens = at::randint(64, {3, 16}, at::TensorOptions(at::kLong));
    accelerator.save_model(gpt, std::string(dir) + "/gpt2", {.adapter = gpt2_adapter(true)});
    std::ofstream(std::string(dir) + "/gpt2/config.json")
        << R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_positions": 16, )"
        << R"("n_embd": 32, "n_layer": 2, "n_head": 2, "n_inner": null, "activation_function": "gelu_new", )"
        << R"("layer_norm_epsilon": 1e-05, "tie_word_embeddings": true, "resid_pdrop": 0.0, "embd_pdrop": 0.0, )"
        << R"("attn_pdrop": 0.0})" << '\n';
    accel::detail::write_safetensors(std::string(dir) + "/gpt2_io.safetensors",
                                     {{"tokens", tokens}, {"logits", gpt(tokens)}});
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
    // transformers' GPT2LMHeadModel, saved by save_pretrained, into the tied Gpt through the adapter's inverse
    // (where run_safetensors.sh found transformers: the pip leg).
    if (std::getenv("ACCEL_SAFETENSORS_GPT2")) {
      Gpt gpt(GptOptions{.layers = 2});
      accelerator.load_model(gpt, std::string(dir) + "/py_gpt2", {.adapter = gpt2_adapter(true)});
      std::map<std::string, at::Tensor> gpt_io;
      for (auto& named : accel::detail::read_safetensors(std::string(dir) + "/py_gpt2_io.safetensors"))
        gpt_io.insert(named);
      const double difference = (gpt(gpt_io.at("tokens")) - gpt_io.at("logits")).abs().max().item<double>();
      MESSAGE("transformers' GPT-2 in C++: largest logit difference " << difference);
      CHECK(difference <= 1e-5);  // (the same sums as Conv1D's addmm, in another order)
      CHECK(gpt->lm_head->weight.is_same(gpt->wte->weight));
    }
    world().destroy();
  }
}

// Run by tests/resize_check.sh (CTest checkpoint_resize): a checkpoint saved
// by 2 processes, loaded by 1, 3 and 4 with the same global batch (12
// samples) and by 3 with another (ACCEL_RESIZE_BATCH per process); skipped
// otherwise. The saving run records what it saved and what came next into
// ACCEL_RESIZE_DIR; each loading run must match it.
TEST_SUITE("checkpoint_resize" * doctest::skip()) {
  constexpr size_t kGlobalBatch = 12;
  struct Resized {  // the training both sides run: Adam on an MLP, the batch from each sample's index
    explicit Resized(uint64_t seed, accel::Accelerator& acc) : accelerator(acc) {
      torch::manual_seed(seed);
      model = Mlp(4, 16, 1);
      optimizer = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(0.01));
      accelerator.prepare(model);
      stepper.emplace(accelerator.prepare(*optimizer));  // (under sharding its step gathers the parameters)
    }
    auto loader() {
      const char* batch = std::getenv("ACCEL_RESIZE_BATCH");
      const size_t per_process =
          batch ? std::stoul(batch) : kGlobalBatch / static_cast<size_t>(accelerator.num_processes());
      return accelerator.prepare_data_loader(Indexed(96).map(torch::data::transforms::Stack<>()),
                                             {.batch_size = per_process, .shuffle = true, .seed = 3});
    }
    void step(const at::Tensor& indices) {
      const at::Tensor i = indices.to(at::kFloat).reshape({-1, 1});
      stepper->zero_grad();
      accelerator.backward(torch::mse_loss(model((i * at::arange(1, 5, at::kFloat)).sin()), i.cos()));
      stepper->step();
    }
    // The whole parameters (gathered where FULL_SHARD keeps them in pieces between steps).
    at::Tensor parameters() {
      accel::DataParallel* dp = accelerator.data_parallel(model);
      if (dp && dp->sharded()) {
        const auto whole = dp->summon_full_params();
        return flat_parameters(*model).clone();
      }
      return flat_parameters(*model).clone();
    }
    // Under sharding: Adam's state of every parameter, whole (its shards' gathered), under the names a sharded
    // checkpoint gives it for Python (checkpoint/shards.hpp).
    std::vector<std::pair<std::string, at::Tensor>> whole_optimizer_state() {
      std::vector<std::pair<std::string, at::Tensor>> out;
      accel::DataParallel* dp = accelerator.data_parallel(model);
      for (const auto& [name, p] : accel::detail::state_dict(*model)) {
        const at::Tensor shard = dp->shard_of(p);
        const auto* state = dynamic_cast<const torch::optim::AdamParamState*>(
            accel::detail::state_for(*optimizer, shard));
        REQUIRE(state != nullptr);
        for (const auto& [key, value] : {std::pair{"exp_avg", state->exp_avg()}, {"exp_avg_sq", state->exp_avg_sq()}})
          out.emplace_back("optimizer.state." + name + "." + key,
                           accel::all_gather(value, dp->shard_group()).reshape({-1}).narrow(0, 0, p.numel()).view(
                               p.sizes()));
        out.emplace_back("optimizer.state." + name + ".step",
                         at::scalar_tensor(static_cast<double>(state->step()), at::kFloat));
      }
      return out;
    }
    // Every process's batch in rank order: the samples of the global batch in the loader's order.
    at::Tensor global(const at::Tensor& indices) { return accel::all_gather(indices.reshape({-1})).reshape({-1}); }
    accel::Accelerator& accelerator;
    Mlp model{nullptr};
    std::unique_ptr<torch::optim::Adam> optimizer;
    std::optional<accel::AcceleratedOptimizer> stepper;
  };
  // The Accelerator of the saving (ACCEL_RESIZE_SAVE) or loading (ACCEL_RESIZE_LOAD) run: no_shard (the
  // default), shard_grad_op, full_shard or hybrid_shard (a model mesh of 2 replicas).
  accel::AcceleratorConfig resize_config(const char* variable) {
    accel::AcceleratorConfig c = config();
    const char* set = std::getenv(variable);
    const std::string strategy = set ? set : "no_shard";
    c.sharding_strategy = strategy == "shard_grad_op"  ? accel::ShardingStrategy::SHARD_GRAD_OP
                          : strategy == "full_shard"   ? accel::ShardingStrategy::FULL_SHARD
                          : strategy == "hybrid_shard" ? accel::ShardingStrategy::HYBRID_SHARD
                                                       : accel::ShardingStrategy::NO_SHARD;
    if (strategy == "hybrid_shard") c.distributed = test_config({.mp_replicate_size = 2});
    REQUIRE((strategy == "no_shard" || c.sharding_strategy != accel::ShardingStrategy::NO_SHARD));
    return c;
  }
  std::filesystem::path resize_dir() {
    const char* dir = std::getenv("ACCEL_RESIZE_DIR");
    REQUIRE(dir != nullptr);
    return dir;
  }

  TEST_CASE("save: 3 steps, a checkpoint, what comes next") {
    const auto dir = resize_dir();
    accel::Accelerator accelerator(resize_config("ACCEL_RESIZE_SAVE"));
    Resized run(1, accelerator);
    auto loader = run.loader();
    int steps = 0;
    std::map<std::string, at::Tensor> expect;
    std::vector<at::Tensor> order;  // the samples of the pass after the checkpoint, in order
    for (auto& batch : loader) {
      if (steps == 3) {  // the batches after the checkpoint
        order.push_back(run.global(batch.data));
        if (order.size() == 1) {
          run.step(batch.data);
          expect["stepped"] = run.parameters().clone();
        }
        continue;
      }
      run.step(batch.data);
      if (++steps == 3) {
        accelerator.save_state(dir / "checkpoint");
        accelerator.save_model(run.model, (dir / "whole").string());  // (gathered: for Python's DCP to match)
        if (accelerator.data_parallel(run.model)->sharded()) {
          const auto state = run.whole_optimizer_state();
          if (accelerator.is_main_process()) accel::detail::write_safetensors(dir / "whole" / "optimizer.safetensors", state);
        }
        expect["params"] = run.parameters().clone();
        expect["rng"] = accel::all_gather(torch::rand({4}));  // each process's next draw
      }
    }
    expect["order"] = at::cat(order);
    REQUIRE(expect.size() == 4);
    if (accelerator.is_main_process())
      accel::detail::write_safetensors(dir / "expect.safetensors", {expect.begin(), expect.end()});
    release_world();  // (world() would ask for the default mesh)
  }

  // The checkpoint loaded and saved again, the same state, by a run whose main process dies at step
  // ACCEL_RESIZE_CRASH of the save (the others find it gone and fail): the "load" case after it must find
  // the saved state, whichever of the two copies recovery keeps, and nothing of the other. With
  // ACCEL_RESIZE_RENAMES the save takes the two-rename path (checkpoint/files.hpp). A step this
  // filesystem never reaches ("exchanged" where it cannot exchange) says so and passes.
  TEST_CASE("crash: a save that dies on the main process at ACCEL_RESIZE_CRASH") {
    const auto dir = resize_dir();
    const char* step = std::getenv("ACCEL_RESIZE_CRASH");
    REQUIRE(step != nullptr);
    const char* renames = std::getenv("ACCEL_RESIZE_RENAMES");
    accel::detail::checkpoint_use_exchange() = renames == nullptr || *renames == '\0';
    accel::Accelerator accelerator(resize_config("ACCEL_RESIZE_SAVE"));
    Resized run(7, accelerator);
    auto loader = run.loader();
    accelerator.load_state(dir / "checkpoint");
    if (accelerator.is_main_process())
      accel::detail::checkpoint_hook() = [step](const char* at) {
        if (std::strcmp(at, step) == 0) std::_Exit(3);
      };
    accelerator.save_state(dir / "checkpoint");
    accel::detail::checkpoint_use_exchange() = true;
    MESSAGE("no step \"", step, "\" in this save: the filesystem took another path");
    release_world();
  }

  TEST_CASE("load: the same model, optimizer, place and RNG; the next step as the saving run's") {
    const auto dir = resize_dir();
    std::map<std::string, at::Tensor> expect;
    for (auto& named : accel::detail::read_safetensors(dir / "expect.safetensors")) expect.insert(named);
    accel::Accelerator accelerator(resize_config("ACCEL_RESIZE_LOAD"));
    const int P = accelerator.num_processes(), saved = static_cast<int>(expect["rng"].size(0));
    Resized run(7, accelerator);  // other initial weights: the load must replace them
    auto loader = run.loader();
    CHECK_FALSE(at::equal(run.parameters(), expect["params"]));
    accelerator.load_state(dir / "checkpoint");
    CHECK(at::equal(run.parameters(), expect["params"]));
    CHECK_FALSE(std::filesystem::exists(dir / "checkpoint.tmp"));  // (a save that died: recovered)
    CHECK_FALSE(std::filesystem::exists(dir / "checkpoint.old"));
    const at::Tensor draws = accel::all_gather(torch::rand({4}));
    for (int p = 0; p < P; ++p) {
      if (p < saved) {
        CHECK(at::equal(draws[p], expect["rng"][p]));  // its own saved state
        continue;
      }
      for (int q = 0; q < P; ++q)  // a process the saving run did not have: a stream of its own
        if (q != p) CHECK_FALSE(at::equal(draws[p], draws[q]));
      for (int q = 0; q < saved; ++q) CHECK_FALSE(at::equal(draws[p], expect["rng"][q]));
    }
    bool stepped = false;
    for (auto& batch : loader) {
      // The samples after the saved place, whatever the layout: 36 read, then as many as a global batch holds.
      const at::Tensor samples = run.global(batch.data);
      CHECK(at::equal(samples, expect["order"].narrow(0, 0, samples.numel())));
      if (samples.numel() != static_cast<int64_t>(kGlobalBatch)) {  // another global batch: no step to compare
        MESSAGE(P, " processes after ", saved, ", ", samples.numel(), " samples per batch: resumed at sample 36");
        stepped = true;
        break;
      }
      run.step(batch.data);
      const double apart = (run.parameters() - expect["stepped"]).abs().max().item<double>();
      MESSAGE(P, " processes after ", saved, ": the next step ", apart, " from the saving run's");
      CHECK(apart < 1e-6);
      stepped = true;
      break;
    }
    CHECK(stepped);
    release_world();  // (world() would ask for the default mesh)
  }
}

TEST_SUITE("single") {
  TEST_CASE("checkpoints at another number of processes: a loader's place in samples; seeds of new processes") {
    using accel::detail::resumed_batches;
    // (index, batches read, samples per batch then, now, as many processes) -> batches to skip here
    CHECK(resumed_batches(0, 5, 12, 12, false).batches == 5);   // the same batches: as saved
    CHECK(resumed_batches(0, 3, 12, 6, false).batches == 6);    // 36 samples: 6 batches of 6
    const auto partial = resumed_batches(0, 3, 12, 24, false);  // 36 of 24 per batch: 1 skipped, 12 read again
    CHECK(partial.batches == 1);
    CHECK(partial.warning.find("prepared loader 0 read 36 samples of its pass in the saving run (3 batches of 12); "
                               "this run reads 24 per batch, so it skips 1 batches and reads the last 12 of those "
                               "samples again") != std::string::npos);
    CHECK(resumed_batches(0, 3, 12, 6, false).warning.empty());
    CHECK(resumed_batches(0, 0, 0, 8, false).batches == 0);  // at a pass's start nothing needs converting
    CHECK(resumed_batches(0, 3, 0, 0, true).batches == 3);   // not known, as many processes: as saved
    CHECK(resumed_batches(0, 4, 8, 8, false).batches == 4);  // (samples per batch known on both sides)
    const std::string unknown = what_of([] { resumed_batches(2, 3, 0, 8, false); });
    CHECK(unknown.find("prepared loader 2 stopped after 3 batches of its pass, and the samples per batch of the "
                       "saving run are not known (a custom batch sampler: set batch_sampler_batch_size), so its "
                       "place cannot be carried over to another number of processes") != std::string::npos);
    CHECK(what_of([] { resumed_batches(0, 3, 8, 0, false); }).find("of this run are not known") != std::string::npos);
    CHECK(what_of([] { resumed_batches(0, 3, 0, 0, false); }).find("are not known") != std::string::npos);
    using accel::detail::derived_seed;
    const at::Tensor state = at::detail::getDefaultCPUGenerator().get_state();
    CHECK(derived_seed(state, 3) == derived_seed(state.clone(), 3));  // the same at every resume
    CHECK(derived_seed(state, 3) != derived_seed(state, 4));          // each new process a stream of its own
    at::Tensor other = state.clone();
    other[0] = static_cast<uint8_t>(other[0].item<uint8_t>() + 1);
    CHECK(derived_seed(other, 3) != derived_seed(state, 3));
    CHECK(accel::detail::saved_process_for(1, 2) == 1);
    CHECK(accel::detail::saved_process_for(5, 2) == 1);
  }
}
