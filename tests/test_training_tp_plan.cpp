// Training tests, tensor parallelism by plan (accel::tp::parallelize_module): a plain torch::nn model (tied
// embedding and head, identical pre-norm MLP blocks, a final norm) styled with torchtitan's plan, against the same
// model in one process, with and without sequence parallelism, at every world size (tp = the world); an
// attention-like block under PrepareModuleInput whose gathered input also has a reader outside the plan; every
// plan mistake refused; and, under python_tp, against Python's DTensor with the same plan.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with training_fixtures.hpp
// precompiled); the suites keep their names across files.

#include "tp_fixtures.hpp"
#include <sstream>

namespace tp_plan_test {
using namespace tp_fixtures;

// tests/python_ref/tp_ref.py's model, name for name, written as a plain model: every module a plan may style is
// called through accel::unit_forward (in one process, or unstyled, the module itself).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    up = register_module("up", torch::nn::Linear(kHidden, kFfn));
    down = register_module("down", torch::nn::Linear(kFfn, kHidden));
  }
  at::Tensor forward(const at::Tensor& h) {
    return h + accel::unit_forward(down, torch::gelu(accel::unit_forward(up, accel::unit_forward(norm, h))));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  ModelImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kHidden));
    for (int64_t i = 0; i < kBlocks; ++i) blocks->push_back(Block());
    register_module("blocks", blocks);
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kHidden, kVocab).bias(false)));
    // Tied as LibTorch users tie: the head's forward reads the embedding's tensor (LibTorch cannot re-register a
    // parameter; the head's own registered "weight" is left unused, without a gradient).
    head->weight = embed->weight;
  }
  // The logits: under a plan with a column head, this rank's columns of the vocabulary.
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = accel::unit_forward(embed, ids);
    for (const auto& block : *blocks) h = block->as<BlockImpl>()->forward(h);
    return accel::unit_forward(head, accel::unit_forward(norm, h));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Model);

// tp_ref.py's plan (torchtitan's styles): without sequence parallelism the activations between blocks are whole;
// with it they are split along the sequence (Shard(1)) and the norms run on this rank's tokens.
std::map<std::string, accel::tp::ParallelStyle> plan(bool sp) {
  using namespace accel::tp;
  const Layout sequence = sp ? Layout{Shard{1}} : Layout{Replicate{}};
  std::map<std::string, ParallelStyle> out = {
      {"embed", RowwiseParallel{.input_layouts = Replicate{}, .output_layouts = sequence}},
      {"blocks.*.up", ColwiseParallel{.input_layouts = sequence}},
      {"blocks.*.down", RowwiseParallel{.output_layouts = sequence}},
      {"head", ColwiseParallel{.input_layouts = sequence, .output_layouts = Shard{-1}}},
  };
  if (sp) {
    out["blocks.*.norm"] = SequenceParallel{};
    out["norm"] = SequenceParallel{};
  }
  return out;
}

Model fresh_model(uint64_t seed) {
  torch::manual_seed(seed);
  Model model;
  model->to(at::kDouble);
  const at::NoGradGuard no_grad;  // LayerNorm's start is ones and zeros: moved off them, so a wrong gradient shows
  for (const auto& p : model->named_parameters())
    if (p.key().find("norm") != std::string::npos) p.value().add_(torch::randn_like(p.value()) * 0.1);
  return model;
}

// An attention-like block: PrepareModuleInput gathers its sequence-split input; two column layers read it (their
// input gradients are this rank's parts: one reduce-scatter for both), and a plain Linear outside the plan reads it
// too (its gradient is whole on every rank: only this rank's piece is kept); a row layer reduce-scatters the result.
struct MixerImpl : torch::nn::Module {
  MixerImpl() {
    a = register_module("a", torch::nn::Linear(kHidden, kFfn));
    b = register_module("b", torch::nn::Linear(kHidden, kFfn));
    out = register_module("out", torch::nn::Linear(kFfn, kHidden));
    gate = register_module("gate", torch::nn::Linear(kHidden, kHidden));
  }
  at::Tensor forward(const at::Tensor& x) {  // x: whole along the sequence (the plan gathered it)
    const at::Tensor mixed =
        accel::unit_forward(out, torch::gelu(accel::unit_forward(a, x)) * accel::unit_forward(b, x));
    // (the gate's whole output, cut to this rank's tokens as the row layer's is; in one process the identity)
    const at::Tensor gated = torch::tanh(gate(x));
    return mixed + (group ? accel::tp::scatter_to_sequence_parallel_region(gated, 1, group) : gated);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, out{nullptr}, gate{nullptr};
  accel::GroupPtr group;  // the tp group; null in the one-process reference, whose scatter is then the identity
};
TORCH_MODULE(Mixer);

struct MixerModelImpl : torch::nn::Module {
  MixerModelImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    mixer = register_module("mixer", Mixer());
  }
  at::Tensor forward(const at::Tensor& h) { return h + accel::unit_forward(mixer, accel::unit_forward(norm, h)); }
  torch::nn::LayerNorm norm{nullptr};
  Mixer mixer{nullptr};
};
TORCH_MODULE(MixerModel);

// An embedding split by columns (each rank holds every token's slice of the features, Megatron's other embedding),
// with a padding row, read by a projection: a row layer taking the embedding's Shard(-1) output, or, with the
// embedding's output gathered (Replicate), a plain Linear outside the plan.
struct ColumnEmbedImpl : torch::nn::Module {
  ColumnEmbedImpl() {
    embed = register_module("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(kVocab, kFfn).padding_idx(0)));
    proj = register_module("proj", torch::nn::Linear(kFfn, kHidden));
  }
  at::Tensor forward(const at::Tensor& ids) { return accel::unit_forward(proj, accel::unit_forward(embed, ids)); }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear proj{nullptr};
};
TORCH_MODULE(ColumnEmbed);

// A checkpoint's piece files read as Python's DCP reads them (every box placed by DCP_SHARDING_INFO, checked to tile
// its tensor): the whole parameters and, given one, AdamW's state under Python's names, against one process's.
void check_pieces_are_whole(const std::filesystem::path& dir, const std::map<std::string, at::Tensor>& whole,
                            torch::optim::Optimizer* whole_optimizer = nullptr, const std::string& prefix = "") {
  const auto manifest = accel::detail::read_manifest(dir);
  REQUIRE(manifest);
  accel::detail::CheckpointFiles files(dir, *manifest);
  const accel::detail::ShardedWeights weights(dir, files);
  int64_t states = 0;
  for (const auto& [name, p] : whole) {
    CAPTURE(name);
    REQUIRE(weights.holds(prefix + name));
    CHECK(at::allclose(weights.read(prefix + name, 0, p.numel()).view(p.sizes()), p, 1e-10, 1e-12));
    if (!whole_optimizer) continue;
    for (const auto& [key, value] : accel::detail::python_state(accel::detail::state_for(*whole_optimizer, p))) {
      CAPTURE(key);
      const std::string saved = "optimizer.state." + name + "." + key;
      REQUIRE(weights.holds(saved));
      CHECK(at::allclose(weights.read(saved, 0, value.numel()).view(value.sizes()), value, 1e-10, 1e-14));
      ++states;
    }
  }
  // (AdamW: exp_avg, exp_avg_sq and step for every parameter)
  if (whole_optimizer) CHECK(states == 3 * static_cast<int64_t>(whole.size()));
  files.wait();
}

TEST_SUITE("ranks") {
  TEST_CASE(
      "tensor parallelism by plan: parallelize_module trains a plain model as one process does, with and "
      "without sequence parallelism") {
    const int P = accel::get_world_size();
    auto& d = fresh({.tp_size = P});
    const int r = d.get_rank(accel::Dim::TP);
    for (const bool sp : {false, true}) {
      CAPTURE(sp);
      Model whole = fresh_model(7), model = fresh_model(7);
      accel::tp::parallelize_module(*model, plan(sp));
      CHECK(model->head->weight.is_same(model->embed->weight));  // still tied: narrowed once, in place
      CHECK(model->embed->weight.sizes() == c10::IntArrayRef({kVocab / P, kHidden}));
      const auto split = accel::detail::tp::split_tensors(*model);
      CHECK(split.layers.size() == (P > 1 ? 2 * kBlocks + 2 : 0));  // what the Accelerator and save_model see
      torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      const auto whole_params = by_name(*whole);
      const auto params = by_name(*model);
      for (int step = 0; step < 4; ++step) {
        CAPTURE(step);
        const at::Tensor ids = torch::randint(kVocab, {kBatch, kSeq}, at::kLong);  // the same on every rank
        at::Tensor targets = torch::randint(kVocab, {kBatch, kSeq}, at::kLong);
        targets.index_put_({0, torch::indexing::Slice(0, 3)}, -100);
        const at::Tensor whole_loss =
            torch::nn::functional::cross_entropy(whole->forward(ids).reshape({-1, kVocab}), targets.reshape({-1}));
        const at::Tensor loss = accel::tp::vocab_parallel_cross_entropy(model->forward(ids), targets);
        CHECK(loss.item<double>() == doctest::Approx(whole_loss.item<double>()).epsilon(1e-12));
        whole_opt.zero_grad();
        opt.zero_grad();
        whole_loss.backward();
        loss.backward();
        // The plan knows its SequenceParallel norms and row layers: nothing to list.
        CHECK(accel::tp::all_reduce_sequence_parallel_gradients(*model) == (sp && P > 1 ? 1 : 0));
        for (const auto& [name, p] : params) {
          CAPTURE(name);
          const at::Tensor expected = piece(name, whole_params.at(name).grad(), P, r);
          REQUIRE(p.grad().sizes() == expected.sizes());
          CHECK(at::allclose(p.grad(), expected, 1e-11, 1e-13));
        }
        whole_opt.step();
        opt.step();
      }
      for (const auto& [name, p] : params) {
        CAPTURE(name);
        CHECK(at::allclose(p, piece(name, whole_params.at(name), P, r), 1e-10, 1e-12));
      }
    }
    release_world();
  }

  TEST_CASE(
      "tensor parallelism by plan: the Accelerator trains a planned model beside data parallelism, replicated or "
      "sharded (FSDP + TP), as one process does, the partial gradients summed in its backward (accumulation, "
      "clipping)") {
    using accel::ShardingStrategy;
    const int P = accel::get_world_size();
    const int tp = P % 2 == 0 ? 2 : P, dp = P / tp;
    for (const auto strategy :
         {ShardingStrategy::NO_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::FULL_SHARD})
      for (const bool sp : {false, true}) {
        const std::string mode(accel::to_string(strategy));
        CAPTURE(mode);
        CAPTURE(sp);
        accel::AcceleratorConfig c = config(/*accumulation=*/2);
        c.distributed.tp_size = tp;
        c.sharding_strategy = strategy;
        // FULL_SHARD's units: the column and row layers themselves (their style's collectives around the unit,
        // their pieces computed in it); the tied embedding and head, and the norms, sharded as under ZeRO-2.
        c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) {
          return name.ends_with(".up") || name.ends_with(".down");
        };
        release_world();
        accel::Accelerator accelerator(c);
        const int r = accelerator.tensor_parallel_rank(), data_rank = accelerator.data_parallel_rank();
        Model whole = fresh_model(5), model = fresh_model(5);
        if (tp > 1 && strategy == ShardingStrategy::NO_SHARD) {  // prepared before the plan: refused
          Model early = fresh_model(5);
          accelerator.prepare(early);
          CHECK_THROWS_WITH_AS(accel::tp::parallelize_module(*early, plan(sp)),
                               doctest::Contains("a data-parallel wrapper (Accelerator::prepare, DataParallel) made "
                                                 "before the plan; apply the plan first"),
                               std::invalid_argument);
        }
        accel::tp::parallelize_module(*model, plan(sp));
        torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        auto prepared = accelerator.prepare(model, adamw);
        accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
        accel::DataParallel& wrapper = *accelerator.data_parallel(model);
        CHECK(accelerator.is_fsdp2() == (strategy == ShardingStrategy::FULL_SHARD && dp > 1));
        const auto whole_params = by_name(*whole);
        const auto params = by_name(*model);
        for (int64_t micro = 0; micro < 4; ++micro) {  // two optimizer steps of two micro-batches
          CAPTURE(micro);
          const at::Tensor ids = torch::randint(kVocab, {2 * dp, kSeq}, at::kLong);  // the same on every rank
          const at::Tensor targets = torch::randint(kVocab, {2 * dp, kSeq}, at::kLong);
          at::Tensor reference = at::zeros({}, at::kDouble);
          for (int k = 0; k < dp; ++k)
            reference = reference + torch::nn::functional::cross_entropy(
                                        whole->forward(ids.narrow(0, 2 * k, 2)).reshape({-1, kVocab}),
                                        targets.narrow(0, 2 * k, 2).reshape({-1}));
          (reference / dp / 2).backward();
          auto guard = accelerator.accumulate(model);
          accelerator.backward(accel::tp::vocab_parallel_cross_entropy(model->forward(ids.narrow(0, 2 * data_rank, 2)),
                                                                       targets.narrow(0, 2 * data_rank, 2)));
          if (!accelerator.sync_gradients()) continue;
          // (nothing to call for sequence parallelism: backward summed the norms' parts; a second sum is none)
          CHECK(accel::tp::all_reduce_sequence_parallel_gradients(*model) == 0);
          const double expected_norm = torch::nn::utils::clip_grad_norm_(whole->parameters(), 0.5);
          CHECK(accelerator.clip_grad_norm_(model->parameters(), 0.5) == doctest::Approx(expected_norm).epsilon(1e-12));
          for (const auto& [name, p] : params) {
            CAPTURE(name);
            const auto [got, want] = stepped_gradient(wrapper, p, piece(name, whole_params.at(name).grad(), tp, r));
            CHECK(at::allclose(got, want, 1e-11, 1e-13));
          }
          optimizer.step();
          optimizer.zero_grad();
          whole_opt.step();
          whole_opt.zero_grad();
        }
        {
          const auto full = wrapper.summon_full_params();  // (FULL_SHARD: the units' parameters rest without memory)
          for (const auto& [name, p] : params) {
            CAPTURE(name);
            CHECK(at::allclose(p, piece(name, whole_params.at(name), tp, r), 1e-10, 1e-12));
          }
        }
        // save_model writes whole tensors under the plain names (each piece gathered along its split: Hugging
        // Face's layout); load_model gives a planned model this rank's piece of each.
        namespace fs = std::filesystem;
        const fs::path dir = shared_temp_path(accelerator, "accel_tp_export_");
        accelerator.save_model(model, dir.string());
        std::map<std::string, at::Tensor> file;
        for (auto& named : accel::detail::read_safetensors(dir / "model.safetensors")) file.insert(named);
        for (const auto& [name, p] : whole_params) {
          CAPTURE(name);
          REQUIRE(file.count(name) == 1);
          CHECK(at::allclose(file.at(name), p, 1e-10, 1e-12));
        }
        Model loaded = fresh_model(6);
        accel::tp::parallelize_module(*loaded, plan(sp));
        accel::load_model(loaded, dir.string());
        for (const auto& [name, p] : by_name(*loaded)) {
          CAPTURE(name);
          CHECK(at::equal(p, piece(name, file.at(name), tp, r)));
        }
        // save_state writes each rank's piece (or its shard of it) placed in the whole tensor, nothing gathered, as
        // Python's DCP reads it; a step taken after it is taken again, bit for bit, after load_state.
        const fs::path checkpoint = shared_temp_path(accelerator, "accel_tp_state_");
        accelerator.save_state(checkpoint);
        const bool second = tp > 1 && strategy == ShardingStrategy::NO_SHARD;  // (the model prepared early: first)
        if (tp > 1 || wrapper.sharded())  // (else one process writes model.pt, whole)
          check_pieces_are_whole(checkpoint, whole_params, &whole_opt, second ? "model_1." : "");
        auto one_step = [&] {
          for (int micro = 0; micro < 2; ++micro) {
            const at::Tensor ids = torch::randint(kVocab, {2 * dp, kSeq}, at::kLong);  // (the RNG: restored too)
            const at::Tensor targets = torch::randint(kVocab, {2 * dp, kSeq}, at::kLong);
            auto guard = accelerator.accumulate(model);
            accelerator.backward(accel::tp::vocab_parallel_cross_entropy(
                model->forward(ids.narrow(0, 2 * data_rank, 2)), targets.narrow(0, 2 * data_rank, 2)));
          }
          REQUIRE(accelerator.sync_gradients());
          optimizer.step();
          optimizer.zero_grad();
          const auto full = wrapper.summon_full_params();
          std::map<std::string, at::Tensor> out;
          for (const auto& [name, p] : params) out[name] = p.detach().clone();
          return out;
        };
        const auto stepped = one_step();
        accelerator.load_state(checkpoint);
        const auto again = one_step();
        for (const auto& [name, p] : stepped) {
          CAPTURE(name);
          CHECK(!at::equal(p, piece(name, whole_params.at(name), tp, r)));  // (the step moved it)
          CHECK(at::equal(p, again.at(name)));
        }
        accelerator.wait_for_everyone();
        if (accelerator.is_main_process()) {
          fs::remove_all(dir);
          fs::remove_all(checkpoint);
        }
      }
    release_world();
  }

  TEST_CASE(
      "tensor parallelism by plan: a checkpoint of pieces loads at another tp size and strategy, the model and "
      "AdamW's state: the next step is one process's") {
    const int P = accel::get_world_size();
    if (P % 2 != 0) return;
    namespace fs = std::filesystem;
    using accel::ShardingStrategy;
    // One batch per step, the same on every rank (data ranks average equal gradients: one process's).
    torch::manual_seed(11);
    const at::Tensor ids = torch::randint(kVocab, {2, 2, kSeq}, at::kLong);
    const at::Tensor targets = torch::randint(kVocab, {2, 2, kSeq}, at::kLong);
    auto loss_of = [&](at::Tensor logits, int step) {
      return accel::tp::vocab_parallel_cross_entropy(std::move(logits), targets[step]);
    };
    Model whole = fresh_model(7);  // the reference: two steps in one process
    torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int step = 0; step < 2; ++step) {
      torch::nn::functional::cross_entropy(whole->forward(ids[step]).reshape({-1, kVocab}), targets[step].reshape({-1}))
          .backward();
      whole_opt.step();
      whole_opt.zero_grad();
    }
    fs::path checkpoint;
    {  // saved at tp 2 (NO_SHARD) after the first step
      accel::AcceleratorConfig c = config();
      c.distributed.tp_size = 2;
      release_world();
      accel::Accelerator accelerator(c);
      Model model = fresh_model(7);
      accel::tp::parallelize_module(*model, plan(true));
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      auto prepared = accelerator.prepare(model, adamw);
      accelerator.backward(loss_of(model->forward(ids[0]), 0));
      std::get<1>(prepared).step();
      std::get<1>(prepared).zero_grad();
      checkpoint = shared_temp_path(accelerator, "accel_tp_layout_");
      accelerator.save_state(checkpoint);
    }
    // Loaded at tp 1 under FULL_SHARD along 2 (2 processes), or at tp 4 (4): the second step, as one process's.
    accel::AcceleratorConfig c = config();
    const int tp = c.distributed.tp_size = P == 2 ? 1 : 4;
    c.sharding_strategy = P == 2 ? ShardingStrategy::FULL_SHARD : ShardingStrategy::NO_SHARD;
    c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) {  // (the tied pair: not units)
      return name.ends_with(".up") || name.ends_with(".down");
    };
    release_world();
    accel::Accelerator accelerator(c);
    const int r = accelerator.tensor_parallel_rank();
    Model model = fresh_model(8);
    if (tp > 1) accel::tp::parallelize_module(*model, plan(true));
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3));  // (the saved options win)
    auto prepared = accelerator.prepare(model, adamw);
    accelerator.load_state(checkpoint);
    accelerator.backward(loss_of(model->forward(ids[1]), 1));
    std::get<1>(prepared).step();
    {
      const auto full = accelerator.data_parallel(model)->summon_full_params();
      const auto whole_params = by_name(*whole);
      for (const auto& [name, p] : by_name(*model)) {
        CAPTURE(name);
        CHECK(at::allclose(p, piece(name, whole_params.at(name), tp, r), 1e-10, 1e-12));
      }
    }
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) fs::remove_all(checkpoint);
    release_world();
    // RMSprop's state has no copy placed in the whole tensors (Python's names are kept for Adam, AdamW and SGD):
    // across tp layouts it is refused, naming it, with nothing changed.
    fs::path rmsprop_checkpoint;
    {
      accel::AcceleratorConfig saving = config();
      saving.distributed.tp_size = 2;
      accel::Accelerator saver(saving);
      Model saved = fresh_model(7);
      accel::tp::parallelize_module(*saved, plan(true));
      torch::optim::RMSprop rmsprop(saved->parameters(), torch::optim::RMSpropOptions(1e-2));
      auto prepared_rmsprop = saver.prepare(saved, rmsprop);
      saver.backward(loss_of(saved->forward(ids[0]), 0));
      std::get<1>(prepared_rmsprop).step();
      rmsprop_checkpoint = shared_temp_path(saver, "accel_tp_rmsprop_");
      saver.save_state(rmsprop_checkpoint);
    }
    release_world();
    accel::Accelerator loader(c);
    Model moved = fresh_model(8);
    if (tp > 1) accel::tp::parallelize_module(*moved, plan(true));
    torch::optim::RMSprop rmsprop(moved->parameters(), torch::optim::RMSpropOptions(1e-2));
    loader.prepare(moved, rmsprop);
    std::map<std::string, at::Tensor> kept;
    {
      const auto full = loader.data_parallel(moved)->summon_full_params();
      for (const auto& [name, p] : by_name(*moved)) kept[name] = p.detach().clone();
    }
    CHECK_THROWS_WITH_AS(loader.load_state(rmsprop_checkpoint),
                         doctest::Contains("cannot move to another tensor-parallel layout: the piece files do not "
                                           "place it in the whole tensor (they do for Adam, AdamW and SGD)"),
                         std::runtime_error);
    {
      const auto full = loader.data_parallel(moved)->summon_full_params();
      for (const auto& [name, p] : by_name(*moved)) {
        CAPTURE(name);
        CHECK(at::equal(p, kept.at(name)));
      }
    }
    loader.wait_for_everyone();
    if (loader.is_main_process()) fs::remove_all(rmsprop_checkpoint);
    release_world();
  }

  TEST_CASE(
      "tensor parallelism by plan: PrepareModuleInput's gathered input read by column layers and by a module "
      "outside the plan; one reduce-scatter for the column layers") {
    using namespace accel::tp;
    const int P = accel::get_world_size();
    auto& d = fresh({.tp_size = P});
    const int r = d.get_rank(accel::Dim::TP);
    const accel::GroupPtr group = d.get_group(accel::Dim::TP);
    torch::manual_seed(3);
    MixerModel whole;
    whole->to(at::kDouble);
    torch::manual_seed(3);
    MixerModel model;
    model->to(at::kDouble);
    model->mixer->group = group;
    parallelize_module(*model, {{"norm", SequenceParallel{}},
                                {"mixer", PrepareModuleInput{{Shard{1}}, {Replicate{}}}},
                                {"mixer.a", ColwiseParallel{}},
                                {"mixer.b", ColwiseParallel{}},
                                {"mixer.out", RowwiseParallel{.output_layouts = Shard{1}}}});
    const at::Tensor x = torch::randn({kBatch, kSeq, kHidden}, at::kDouble);  // the same on every rank
    const at::Tensor w = torch::randn({kBatch, kSeq, kHidden}, at::kDouble);
    const at::Tensor x_whole = x.clone().requires_grad_(true);
    const at::Tensor x_mine = x.chunk(P, 1)[r].clone().requires_grad_(true);  // the sequence split
    const at::Tensor y_whole = whole->forward(x_whole);
    start_sequence(group);
    const uint64_t before = group->getSequenceNumberForGroup();
    const at::Tensor y = model->forward(x_mine);
    CHECK(at::allclose(y, y_whole.chunk(P, 1)[r], 1e-12, 1e-14));
    (y_whole * w).sum().backward();
    (y * w.chunk(P, 1)[r]).sum().backward();
    accel::tp::all_reduce_sequence_parallel_gradients(*model);
    // The gathered input is freed with the graph that read it (the twin kept for column layers holds none of it).
    CHECK(accel::detail::tp::SequenceGatherTwins::instance().live() == 0);
    if (P > 1)  // forward: the gather, the row layer's reduce-scatter; backward: one reduce-scatter (a and b
                // together; the gate's piece costs nothing), the row layer's all-gather, the scatter's all-gather;
                // the norm's partial gradients: one all-reduce
      CHECK(group->getSequenceNumberForGroup() - before == 6);
    CHECK(at::allclose(x_mine.grad(), x_whole.grad().chunk(P, 1)[r], 1e-12, 1e-14));
    const auto expected = by_name(*whole);
    for (const auto& [name, p] : by_name(*model)) {
      CAPTURE(name);
      const int64_t dim = name == "mixer.out.weight" ? 1 : 0;
      const bool split = name.starts_with("mixer.a") || name.starts_with("mixer.b") || name == "mixer.out.weight";
      const at::Tensor g = expected.at(name).grad();
      CHECK(at::allclose(p.grad(), split ? g.chunk(P, dim)[r] : g, 1e-12, 1e-14));
    }
    release_world();
  }

  TEST_CASE(
      "tensor parallelism by plan: a column-split embedding (padding row kept) feeds a row layer, or gathered, a "
      "plain Linear, as one process computes") {
    using namespace accel::tp;
    const int P = accel::get_world_size();
    auto& d = fresh({.tp_size = P});
    const int r = d.get_rank(accel::Dim::TP);
    for (const bool row : {true, false}) {
      CAPTURE(row);
      torch::manual_seed(11);
      ColumnEmbed whole;
      torch::manual_seed(11);
      ColumnEmbed model;
      whole->to(at::kDouble);
      model->to(at::kDouble);
      std::map<std::string, ParallelStyle> styles = {{"embed", ColwiseParallel{.output_layouts = Replicate{}}}};
      if (row) styles = {{"embed", ColwiseParallel{}}, {"proj", RowwiseParallel{}}};
      parallelize_module(*model, styles);
      CHECK(model->embed->weight.sizes() == c10::IntArrayRef({kVocab, kFfn / P}));
      at::Tensor ids = torch::randint(kVocab, {kBatch, kSeq}, at::kLong);  // the same on every rank
      ids.index_put_({0, torch::indexing::Slice(0, 2)}, 0);                // the padding row, read
      const at::Tensor w = torch::randn({kBatch, kSeq, kHidden}, at::kDouble);
      const at::Tensor y_whole = whole->forward(ids), y = model->forward(ids);
      CHECK(at::allclose(y, y_whole, 1e-12, 1e-14));  // whole on every rank, either way
      (y_whole * w).sum().backward();
      (y * w).sum().backward();
      CHECK(model->embed->weight.grad()[0].abs().max().item<double>() == 0.0);  // padding_idx: no gradient
      const auto expected = by_name(*whole);
      for (const auto& [name, p] : by_name(*model)) {
        CAPTURE(name);
        const bool split = name == "embed.weight" || (row && name == "proj.weight");
        const at::Tensor g = expected.at(name).grad();
        CHECK(at::allclose(p.grad(), split ? g.chunk(P, 1)[r] : g, 1e-12, 1e-14));
      }
    }
    release_world();
  }

  TEST_CASE("tensor parallelism by plan: every plan mistake is refused before anything changes, naming the module") {
    using namespace accel::tp;
    const int P = accel::get_world_size();
    fresh({.tp_size = P});
    Model model = fresh_model(1);
    const at::Tensor before = model->embed->weight.detach().clone();
    if (P > 1) {  // a graph made before the plan, still alive, reads the weights the plan would narrow
      const at::Tensor kept = model->forward(torch::zeros({1, 2}, at::kLong));
      CHECK_THROWS_WITH_AS(
          parallelize_module(*model, plan(false)),
          doctest::Contains("its weight's gradient is already wired: an autograd graph of an earlier forward"),
          std::invalid_argument);
    }
    CHECK_THROWS_WITH_AS(parallelize_module(*model, {{"blocks.*.upp", ColwiseParallel{}}}),
                         doctest::Contains("the plan's key 'blocks.*.upp' matches no submodule of the model (its "
                                           "submodules: 'embed', 'blocks', 'blocks.0'"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        parallelize_module(*model, {{"blocks.*.up", ColwiseParallel{}}, {"blocks.0.*", RowwiseParallel{}}}),
        "accel::tp::parallelize_module: 'blocks.0.up' is matched by the keys 'blocks.*.up' and "
        "'blocks.0.*'; give each module one style",
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(parallelize_module(*model, {{"norm", ColwiseParallel{}}}),
                         "accel::tp::parallelize_module: 'norm' (ColwiseParallel, key 'norm') applies to a "
                         "torch::nn::Linear or Embedding; this module is torch::nn::LayerNormImpl",
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(parallelize_module(*model, {{"head", ColwiseParallel{.output_layouts = Shard{1}}}}),
                         doctest::Contains("its output_layouts Shard(1) must be Shard(-1)"), std::invalid_argument);
    {
      torch::nn::Embedding embed(4 * P, 4 * P);
      torch::nn::Linear head(4 * P, 4 * P);
      head->weight = embed->weight;  // tied: rows split for the embedding, columns for a row-style head
      torch::nn::Sequential tied(embed, head);
      CHECK_THROWS_WITH_AS(
          parallelize_module(*tied, {{"0", RowwiseParallel{.input_layouts = Replicate{}}}, {"1", RowwiseParallel{}}}),
          "accel::tp::parallelize_module: '1' and '0' share a weight and split it along different "
          "dimensions (1 and 0)",
          std::invalid_argument);
    }
    CHECK_THROWS_WITH_AS(parallelize_module(*model, {{"blocks.0", PrepareModuleInput{{Shard{1}}, {}}}}),
                         doctest::Contains("input_layouts has 1 entries and desired_input_layouts 0"),
                         std::invalid_argument);
    if (P > 1) {
      torch::nn::Linear odd(kHidden, 4 * P + 1);
      torch::nn::Sequential holder(odd);
      const std::string uneven = "accel::tp::parallelize_module: '0' (ColwiseParallel, key '0'): out_features " +
                                 std::to_string(4 * P + 1) + " does not split into " + std::to_string(P) +
                                 " equal pieces (the tensor-parallel group's size)";
      CHECK_THROWS_WITH_AS(parallelize_module(*holder, {{"0", ColwiseParallel{}}}), uneven.c_str(),
                           std::invalid_argument);
    }
    CHECK(at::equal(model->embed->weight, before));  // nothing narrowed by a refused plan
    parallelize_module(*model, plan(false));
    if (P > 1) {
      CHECK_THROWS_WITH_AS(parallelize_module(*model, {{"blocks.0.up", ColwiseParallel{}}}),
                           doctest::Contains("'blocks.0.up' (ColwiseParallel, key 'blocks.0.up') already has a "
                                             "parallel style"),
                           std::invalid_argument);
      // A row layer the plan says gets this rank's piece, given the whole input.
      const at::Tensor whole_input = torch::zeros({2, kFfn}, at::kDouble);
      CHECK_THROWS_WITH_AS(accel::unit_forward(model->blocks[0]->as<BlockImpl>()->down, whole_input),
                           doctest::Contains("a whole input; where the plan gives it whole, say input_layouts = "
                                             "Replicate()"),
                           std::invalid_argument);
      // A styled module called directly: its gradient refused in the backward, with its name.
      const at::Tensor ids = torch::randint(kVocab, {kBatch, kSeq}, at::kLong);
      auto& block = *model->blocks[0]->as<BlockImpl>();
      const at::Tensor h = accel::unit_forward(model->embed, ids);
      const at::Tensor direct = block.down(torch::gelu(block.up(block.norm(h))));  // around the styles
      CHECK_THROWS_WITH_AS(direct.sum().backward(),
                           doctest::Contains("was called directly (module->forward(x) or module(x))"),
                           std::logic_error);
      model->zero_grad();
      // Through unit_forward the same backward passes the watch.
      const at::Tensor styled = block.forward(accel::unit_forward(model->embed, ids));
      CHECK_NOTHROW(styled.sum().backward());
    }
    release_world();
  }
}

}  // namespace tp_plan_test

// Against tests/python_ref/tp_ref.py (tp_fixtures::PythonRun) beside test_training_tp.cpp's Megatron layers, with
// the same plan as Python's: modes plan_tp and plan_tp_sp (tp = the world), compared with Python's tp and tp_sp;
// plan_fsdp_tp_sp (tp 2, the pieces sharded along mp_shard = world / 2 by the Accelerator's FULL_SHARD; each dp rank trains its part of every batch), compared with Python's fsdp_tp_sp (FSDP2 + DTensor).
namespace tp_plan_test {
void train_plan_as_python(const std::string& dir, const std::string& mode) {
  CAPTURE(mode);
  REQUIRE((mode == "plan_tp" || mode == "plan_tp_sp" || mode == "plan_fsdp_tp_sp"));
  const bool fsdp = mode == "plan_fsdp_tp_sp";
  Model model = fresh_model(0);
  PythonRun run(dir);
  {
    const at::NoGradGuard no_grad;
    for (const auto& [name, p] : by_name(*model)) p.copy_(run.start.at(name));
  }
  if (!fsdp) {
    auto& d = fresh({.tp_size = accel::get_world_size()});
    const accel::GroupPtr group = d.get_group(accel::Dim::TP);
    accel::tp::parallelize_module(*model, plan(mode == "plan_tp_sp"));
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    run.train(optimizer, group, [&](const at::Tensor& ids, const at::Tensor& targets) {
      at::Tensor loss = accel::tp::vocab_parallel_cross_entropy(model->forward(ids), targets);
      loss.backward();
      accel::tp::all_reduce_sequence_parallel_gradients(*model);
      return loss;
    });
    run.write(mode, *model, group);
    d.barrier();
    release_world();
    return;
  }
  REQUIRE(accel::get_world_size() % 2 == 0);
  accel::AcceleratorConfig c = config();
  c.distributed.tp_size = 2;
  c.sharding_strategy = accel::ShardingStrategy::FULL_SHARD;
  // (the blocks' norm, up and down as units: this model calls its blocks directly, their modules through
  // accel::unit_forward; Python's units are the blocks, the same numbers in another grouping)
  c.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) {
    return name.starts_with("blocks.") && name.find('.', 7) != std::string::npos;
  };
  release_world();
  {
    accel::Accelerator accelerator(c);
    auto& d = accel::DistributedInterface::instance();
    const accel::GroupPtr group = d.get_group(accel::Dim::TP), dp_group = d.get_group(accel::Dim::DP);
    const int dp = d.get_world_size(accel::Dim::DP), data_rank = accelerator.data_parallel_rank();
    accel::tp::parallelize_module(*model, plan(true));
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    auto prepared = accelerator.prepare(model, adamw);
    REQUIRE(accelerator.is_fsdp2());
    run.train(std::get<1>(prepared), group, [&](const at::Tensor& ids, const at::Tensor& targets) {
      const at::Tensor loss = accel::tp::vocab_parallel_cross_entropy(model->forward(ids.chunk(dp)[data_rank]),
                                                                      targets.chunk(dp)[data_rank]);
      accelerator.backward(loss);
      return accel::all_reduce(loss.detach().clone(), accel::ReduceOp::MEAN, dp_group);  // the mean over dp
    });
    // Each process's shards of its pieces, for Python's DCP to load into its own placement (tp_ref.py dcp).
    accelerator.save_state(dir + "/cpp_" + mode + "_" + std::to_string(accel::get_world_size()) + "_checkpoint");
    {
      const auto full = accelerator.data_parallel(model)->summon_full_params();
      run.write(mode, *model, group);
    }
    // Python's own checkpoint of its run (dcp.save through HuggingFaceStorageWriter: each rank's pieces of its
    // 2-D DTensors, no index; and consolidated): load_model reads it into this layout, and both into a whole model
    // on every process, Python's trained parameters exactly.
    const std::string world = std::to_string(accel::get_world_size()),
                      python_dcp = dir + "/py_fsdp_tp_sp_" + world + "_dcp";
    std::map<std::string, at::Tensor> python;
    for (auto& named : accel::detail::read_safetensors(dir + "/py_fsdp_tp_sp_" + world + ".safetensors"))
      python.insert(named);
    accelerator.load_model(model, python_dcp);
    {
      const auto full = accelerator.data_parallel(model)->summon_full_params();
      for (const auto& [name, p] : by_name(*model)) {
        CAPTURE(name);
        CHECK(at::equal(whole_of(name, p, group), python.at(name)));
      }
    }
    for (const std::string& saved : {python_dcp, python_dcp + "_consolidated"}) {  // (one file and an index)
      Model whole = fresh_model(1);
      accel::load_model(whole, saved);
      for (const auto& [name, p] : by_name(*whole)) {
        CAPTURE(saved);
        CAPTURE(name);
        CHECK(at::equal(p, python.at(name)));
      }
    }
    // load_state goes on from Python's run in this layout: its parameters and AdamW's state exactly (the state
    // read back through save_state's own pieces, placed in the whole tensors, against Python's own whole state),
    // each time after this run's own checkpoint, whose state is its own (within 1e-10 of Python's, not equal).
    std::map<std::string, at::Tensor> python_state;
    for (auto& named :
         accel::detail::read_safetensors(dir + "/py_fsdp_tp_sp_" + world + "_optimizer.safetensors"))
      python_state.insert(named);
    REQUIRE(!python_state.empty());
    auto state_now = [&] {
      const std::string again = dir + "/cpp_from_python_" + world;
      accelerator.save_state(again);
      auto read = accel::detail::read_dcp_pieces(again);
      REQUIRE(read.has_value());
      return *read;
    };
    // (torch 2.15's consolidation writes every 0-d tensor, the steps, as zero: refused, naming the pieces it
    // consolidated, which load)
    CHECK_THROWS_WITH_AS(accelerator.load_state(python_dcp + "_consolidated"),
                         doctest::Contains("is 0 beside its moments: torch's consolidation"), std::runtime_error);
    for (const std::string& saved : {python_dcp, python_dcp + "_consolidated/sharded"}) {
      CAPTURE(saved);
      accelerator.load_state(dir + "/cpp_" + mode + "_" + world + "_checkpoint");
      auto unequal = [&](const std::map<std::string, at::Tensor>& state) {
        int count = 0;
        for (const auto& [name, t] : python_state) count += !at::equal(state.at(name), t);
        return count;
      };
      CHECK(unequal(state_now()) > 0);
      accelerator.load_state(saved);
      {
        const auto full = accelerator.data_parallel(model)->summon_full_params();
        for (const auto& [name, p] : by_name(*model)) {
          CAPTURE(name);
          CHECK(at::equal(whole_of(name, p, group), python.at(name)));
        }
      }
      CHECK(unequal(state_now()) == 0);
    }
    d.barrier();
  }
  release_world();
}
}  // namespace tp_plan_test

TEST_SUITE("python_tp" * doctest::skip()) {
  TEST_CASE("train by plan: Python's start and batches in each plan_ mode of ACCEL_TP_MODES") {
    const char* dir = std::getenv("ACCEL_TP_DIR");
    const char* modes = std::getenv("ACCEL_TP_MODES");
    REQUIRE(dir != nullptr);
    REQUIRE(modes != nullptr);
    std::istringstream names(modes);
    for (std::string mode; names >> mode;)
      if (mode.starts_with("plan_")) tp_plan_test::train_plan_as_python(dir, mode);
  }
}
