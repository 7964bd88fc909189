// Training tests, tensor parallelism (accel::tp): Megatron's layers, the vocabulary-parallel loss and dropout
// against one process computing the whole model, with and without sequence parallelism, on every world size
// (tp = the world); the Accelerator beside tp (dp x tp); and, under python_tp, against Python's DTensor.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with training_fixtures.hpp
// precompiled); the suites keep their names across files.

#include "tp_fixtures.hpp"
#include <sstream>

namespace {
using namespace tp_fixtures;

// The whole model, in one process: a tied embedding and head, identical pre-norm MLP blocks with residuals, a
// final norm; torch::nn's own layers and loss.
struct WholeBlockImpl : torch::nn::Module {
  WholeBlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    up = register_module("up", torch::nn::Linear(kHidden, kFfn));
    down = register_module("down", torch::nn::Linear(kFfn, kHidden));
  }
  at::Tensor forward(const at::Tensor& h) { return h + down(torch::gelu(up(norm(h)))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(WholeBlock);

struct WholeModelImpl : torch::nn::Module {
  WholeModelImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kHidden));
    for (int64_t i = 0; i < kBlocks; ++i) blocks->push_back(WholeBlock());
    register_module("blocks", blocks);
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
  }
  WholeBlockImpl& block(int64_t i) { return *blocks[i]->as<WholeBlockImpl>(); }
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& targets) {
    at::Tensor h = embed(ids);
    for (int64_t i = 0; i < kBlocks; ++i) h = block(i).forward(h);
    const at::Tensor logits = torch::nn::functional::linear(norm(h), embed->weight);  // the tied head
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(WholeModel);

// The same model over the tensor-parallel group: the embedding's rows and the up projection's rows split, the down
// projection's columns; the head shares the embedding's piece; norms whole (under sequence parallelism, on this
// rank's tokens).
struct TpBlockImpl : torch::nn::Module {
  explicit TpBlockImpl(bool sp) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    up = register_module("up", accel::tp::ColumnParallelLinear(
                                   accel::tp::ColumnParallelLinearOptions(kHidden, kFfn).sequence_parallel(sp)));
    down = register_module(
        "down", accel::tp::RowParallelLinear(accel::tp::RowParallelLinearOptions(kFfn, kHidden).sequence_parallel(sp)));
  }
  at::Tensor forward(const at::Tensor& h) { return h + down(torch::gelu(up(norm(h)))); }
  torch::nn::LayerNorm norm{nullptr};
  accel::tp::ColumnParallelLinear up{nullptr};
  accel::tp::RowParallelLinear down{nullptr};
};
TORCH_MODULE(TpBlock);

struct TpModelImpl : torch::nn::Module {
  explicit TpModelImpl(bool sp) {
    embed =
        register_module("embed", accel::tp::VocabParallelEmbedding(
                                     accel::tp::VocabParallelEmbeddingOptions(kVocab, kHidden).sequence_parallel(sp)));
    for (int64_t i = 0; i < kBlocks; ++i) blocks->push_back(TpBlock(sp));
    register_module("blocks", blocks);
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    head = register_module(
        "head", accel::tp::ColumnParallelLinear(
                    accel::tp::ColumnParallelLinearOptions(kHidden, kVocab).bias(false).sequence_parallel(sp)));
    head->tie_weight(embed->weight);  // one tensor: the embedding's rows are the head's
  }
  TpBlockImpl& block(int64_t i) { return *blocks[i]->as<TpBlockImpl>(); }
  // The head's logits are this rank's columns of the vocabulary, as the loss takes them.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& targets) {
    at::Tensor h = embed(ids);
    for (int64_t i = 0; i < kBlocks; ++i) h = block(i).forward(h);
    return accel::tp::vocab_parallel_cross_entropy(head(norm(h)), targets);
  }
  // The norms' weights and biases: whole on every rank, partial gradients under sequence parallelism.
  std::vector<at::Tensor> norm_parameters() {
    std::vector<at::Tensor> out = norm->parameters();
    for (int64_t i = 0; i < kBlocks; ++i)
      for (const auto& p : block(i).norm->parameters()) out.push_back(p);
    return out;
  }
  accel::tp::VocabParallelEmbedding embed{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm{nullptr};
  accel::tp::ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(TpModel);

// Whole parameters (the one-process model's) loaded into the tensor-parallel model through load_full.
void load_whole(TpModel& tp, WholeModel& whole) {
  tp->embed->load_full(whole->embed->weight);
  for (int64_t i = 0; i < kBlocks; ++i) {
    tp->block(i).up->load_full(whole->block(i).up->weight, whole->block(i).up->bias);
    tp->block(i).down->load_full(whole->block(i).down->weight, whole->block(i).down->bias);
    const at::NoGradGuard no_grad;
    tp->block(i).norm->weight.copy_(whole->block(i).norm->weight);
    tp->block(i).norm->bias.copy_(whole->block(i).norm->bias);
  }
  const at::NoGradGuard no_grad;
  tp->norm->weight.copy_(whole->norm->weight);
  tp->norm->bias.copy_(whole->norm->bias);
}

}  // namespace

TEST_SUITE("ranks") {
  TEST_CASE("tensor parallelism: Megatron's layers train as one process does, with and without sequence parallelism") {
    const int P = accel::get_world_size();
    fresh({.tp_size = P});
    const int r = accel::DistributedInterface::instance().get_rank(accel::Dim::TP);
    for (const bool sp : {false, true}) {
      CAPTURE(sp);
      torch::manual_seed(7);
      WholeModel whole;
      whole->to(at::kDouble);
      TpModel tp(sp);
      tp->to(at::kDouble);
      load_whole(tp, whole);
      torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      // (LibTorch's parameters() lists the tied weight under both names: stepped twice, it would train wrongly)
      torch::optim::AdamW tp_opt(accel::detail::unique_tensors(tp->parameters()),
                                 torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      const auto whole_params = by_name(*whole);
      const auto tp_params = by_name(*tp);
      CHECK(tp_params.size() == whole_params.size());
      CHECK(tp->head->weight.is_same(tp->embed->weight));  // tied: one tensor
      CHECK(tp->named_parameters().contains("head.weight"));
      for (int step = 0; step < 4; ++step) {
        CAPTURE(step);
        const at::Tensor ids = torch::randint(kVocab, {kBatch, kSeq}, at::kLong);  // the same on every rank
        at::Tensor targets = torch::randint(kVocab, {kBatch, kSeq}, at::kLong);
        targets.index_put_({0, torch::indexing::Slice(0, 3)}, -100);  // ignored, as torch's default ignore_index
        const at::Tensor whole_loss = whole->forward(ids, targets);
        const at::Tensor tp_loss = tp->forward(ids, targets);
        CHECK(tp_loss.item<double>() == doctest::Approx(whole_loss.item<double>()).epsilon(1e-12));
        whole_opt.zero_grad();
        tp_opt.zero_grad();
        whole_loss.backward();
        tp_loss.backward();
        // Only under sequence parallelism are the norms' gradients partial (without it each rank's is whole, and
        // summing would multiply it by tp); the row layers' biases the layers name themselves.
        const int issued = accel::tp::all_reduce_sequence_parallel_gradients(
            *tp, sp ? tp->norm_parameters() : std::vector<at::Tensor>{});
        CHECK(issued == (sp && P > 1 ? 1 : 0));  // every partial gradient in one all-reduce
        for (const auto& [name, p] : tp_params) {
          CAPTURE(name);
          const at::Tensor expected = piece(name, whole_params.at(name).grad(), P, r);
          REQUIRE(p.grad().sizes() == expected.sizes());
          CHECK(at::allclose(p.grad(), expected, 1e-11, 1e-13));
        }
        whole_opt.step();
        tp_opt.step();
      }
      for (const auto& [name, p] : tp_params) {
        CAPTURE(name);
        CHECK(at::allclose(p, piece(name, whole_params.at(name), P, r), 1e-10, 1e-12));
      }
    }
    release_world();
  }

  TEST_CASE(
      "tensor parallelism: gather_output and a whole input to the row layer; new layers hold the pieces of "
      "torch::nn's") {
    const int P = accel::get_world_size();
    fresh({.tp_size = P});
    const int r = accel::DistributedInterface::instance().get_rank(accel::Dim::TP);
    // New layers: with the same random state, the pieces of the layer torch::nn would have drawn.
    torch::manual_seed(11);
    torch::nn::Linear up_whole(kHidden, kFfn), down_whole(kFfn, kHidden);
    torch::nn::Embedding embed_whole(kVocab, kHidden);
    torch::manual_seed(11);
    accel::tp::ColumnParallelLinear up(accel::tp::ColumnParallelLinearOptions(kHidden, kFfn).gather_output(true));
    accel::tp::RowParallelLinear down(accel::tp::RowParallelLinearOptions(kFfn, kHidden).input_is_parallel(false));
    accel::tp::VocabParallelEmbedding embed(kVocab, kHidden);
    CHECK(at::equal(up->weight, up_whole->weight.chunk(P, 0)[r]));
    CHECK(at::equal(up->bias, up_whole->bias.chunk(P, 0)[r]));
    CHECK(at::equal(down->weight, down_whole->weight.chunk(P, 1)[r]));
    CHECK(at::equal(down->bias, down_whole->bias));
    CHECK(at::equal(embed->weight, embed_whole->weight.chunk(P, 0)[r]));
    CHECK(embed->vocab_start() == r * kVocab / P);
    // Column with gather_output (all-gather forward, piece backward) into Row splitting a whole input.
    for (auto* m : std::initializer_list<torch::nn::Module*>{up.get(), down.get(), up_whole.get(), down_whole.get()})
      m->to(at::kDouble);
    const at::Tensor x = torch::randn({kBatch, kSeq, kHidden}, at::kDouble);
    const at::Tensor x_tp = x.clone().requires_grad_(true), x_whole = x.clone().requires_grad_(true);
    const at::Tensor y_tp = down(torch::tanh(up(x_tp)));
    const at::Tensor y_whole = down_whole(torch::tanh(up_whole(x_whole)));
    CHECK(at::allclose(y_tp, y_whole, 1e-12, 1e-14));
    const at::Tensor w = torch::randn({kBatch, kSeq, kHidden}, at::kDouble);  // the same loss on every rank
    (y_tp * w).sum().backward();
    (y_whole * w).sum().backward();
    CHECK(at::allclose(x_tp.grad(), x_whole.grad(), 1e-12, 1e-14));
    CHECK(at::allclose(up->weight.grad(), up_whole->weight.grad().chunk(P, 0)[r], 1e-12, 1e-14));
    CHECK(at::allclose(down->weight.grad(), down_whole->weight.grad().chunk(P, 1)[r], 1e-12, 1e-14));
    CHECK(at::allclose(down->bias.grad(), down_whole->bias.grad(), 1e-12, 1e-14));
    release_world();
  }

  TEST_CASE("tensor parallelism: the vocabulary-parallel loss equals torch's cross_entropy, bfloat16 included") {
    const int P = accel::get_world_size();
    fresh({.tp_size = P});
    const int r = accel::DistributedInterface::instance().get_rank(accel::Dim::TP);
    torch::manual_seed(3);
    const at::Tensor logits = torch::randn({2, 5, kVocab}, at::kDouble) * 4;
    at::Tensor targets = torch::randint(kVocab, {2, 5}, at::kLong);
    targets.index_put_({1, 2}, -1);
    for (const auto dtype : {at::kDouble, at::kBFloat16}) {
      CAPTURE(dtype);
      const at::Tensor whole = logits.to(dtype).clone().requires_grad_(true);
      const at::Tensor mine = logits.to(dtype).chunk(P, -1)[r].clone().requires_grad_(true);
      const at::Tensor expected =
          torch::nn::functional::cross_entropy(whole.to(at::kDouble).reshape({-1, kVocab}), targets.reshape({-1}),
                                               torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
      const at::Tensor loss = accel::tp::vocab_parallel_cross_entropy(mine, targets, -1);
      const double tolerance = dtype == at::kDouble ? 1e-13 : 1e-6;  // bfloat16's logits computed in float32
      CHECK(loss.item<double>() == doctest::Approx(expected.item<double>()).epsilon(tolerance));
      expected.backward();
      loss.backward();
      CHECK((mine.grad().scalar_type() == dtype));
      CHECK(at::allclose(mine.grad().to(at::kDouble), whole.grad().to(at::kDouble).chunk(P, -1)[r],
                         dtype == at::kDouble ? 1e-12 : 1e-2, dtype == at::kDouble ? 1e-14 : 1e-4));
    }
    // Every target ignored: NaN, as torch's.
    CHECK(std::isnan(accel::tp::vocab_parallel_cross_entropy(logits.chunk(P, -1)[r], at::full({2, 5}, -100, at::kLong))
                         .item<double>()));
    release_world();
  }

  TEST_CASE(
      "tensor parallelism: dropout draws one mask for the whole activation, one process's, whichever piece a "
      "rank holds") {
    const int P = accel::get_world_size();
    auto& d = fresh({.tp_size = P});
    const int r = d.get_rank(accel::Dim::TP);
    const accel::GroupPtr group = d.get_group(accel::Dim::TP);
    torch::manual_seed(5);
    const at::Tensor x = torch::randn({kBatch, kSeq, kFfn});  // the same on every rank
    for (const int64_t dim : {1, -1}) {  // the sequence (sequence parallelism), the hidden pieces (a column layer's)
      CAPTURE(dim);
      torch::manual_seed(21);
      const at::Tensor expected = torch::dropout(x, 0.3, true);
      const at::Tensor expected_next = torch::rand({4});
      torch::manual_seed(21);
      const at::Tensor piece_in = x.chunk(P, dim)[r].clone().requires_grad_(true);
      const at::Tensor mine = accel::tp::dropout(piece_in, 0.3, true, dim);
      CHECK(at::equal(mine, expected.chunk(P, dim)[r]));  // bit for bit one process's piece
      CHECK(at::equal(torch::rand({4}), expected_next));  // and the generator moved as one process's did
      mine.sum().backward();                              // the gradient: the kept elements' scale, zero elsewhere
      CHECK(at::equal(piece_in.grad(), (expected.chunk(P, dim)[r] != 0).to(at::kFloat) / 0.7f));
    }
    // Replicated: torch::dropout's mask, the same on every rank.
    torch::manual_seed(21);
    const at::Tensor replicated = accel::tp::dropout(x, 0.3, true);
    torch::manual_seed(21);
    CHECK(at::equal(replicated, torch::dropout(x, 0.3, true)));
    const at::Tensor all = accel::all_gather(replicated, group);
    for (int k = 0; k < P; ++k) CHECK(at::equal(all[k], replicated));
    CHECK(at::equal(accel::tp::dropout(x, 0.3, false, 1), x));  // evaluation: the identity
    CHECK_THROWS_WITH_AS(accel::tp::dropout(x, 1.5, true), "accel::tp::dropout: p must lie in [0, 1], got 1.500000",
                         std::invalid_argument);
    release_world();
  }

  TEST_CASE(
      "tensor parallelism: the Accelerator trains tp layers beside data parallelism, replicated or with sharded "
      "gradients (ZeRO-2 + TP), as one process does (accumulation, clipping; sequence parallelism too)") {
    const int P = accel::get_world_size();
    const int tp = P % 2 == 0 ? 2 : P, dp = P / tp;  // (2, 1), (2, 2) at 2 and 4 processes; tp = P at 1 and 3
    // (FULL_SHARD would need the layers called through accel::unit_forward: this model calls them directly)
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::SHARD_GRAD_OP})
      for (const bool sp : {false, true}) {
        const std::string mode(accel::to_string(strategy));
        CAPTURE(mode);
        CAPTURE(sp);
        accel::AcceleratorConfig c = config(/*accumulation=*/2);
        c.distributed.tp_size = tp;
        c.sharding_strategy = strategy;
        release_world();
        accel::Accelerator accelerator(c);
        auto& d = accel::DistributedInterface::instance();
        const int r = d.get_rank(accel::Dim::TP), data_rank = accelerator.data_parallel_rank();
        CHECK(accelerator.tensor_parallel_rank() == r);
        CHECK(d.get_world_size(accel::Dim::DP) == dp);
        torch::manual_seed(7);
        WholeModel whole;
        whole->to(at::kDouble);
        TpModel model(sp);
        model->to(at::kDouble);
        load_whole(model, whole);
        torch::optim::AdamW whole_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        {  // tp ranks that start with different copies of a whole tensor: prepare gives them tp rank 0's
          const at::NoGradGuard no_grad;
          model->norm->weight.add_(r);
        }
        auto prepared = accelerator.prepare(model, adamw);  // (prepare gives the optimizer the tied weight once)
        CHECK(at::equal(model->norm->weight, whole->norm->weight));
        accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
        const auto whole_params = by_name(*whole);
        const auto tp_params = by_name(*model);
        for (int64_t micro = 0; micro < 4; ++micro) {  // two optimizer steps of two micro-batches
          CAPTURE(micro);
          // A global batch of dp x 2 sequences, the same on every rank; this data rank's 2 of them.
          const at::Tensor ids = torch::randint(kVocab, {2 * dp, kSeq}, at::kLong);
          at::Tensor targets = torch::randint(kVocab, {2 * dp, kSeq}, at::kLong);
          targets.index_put_({0, torch::indexing::Slice(0, 3)}, -100);
          // One process: the mean of the data ranks' losses, over the accumulation's micro-batches.
          at::Tensor reference = at::zeros({}, at::kDouble);
          for (int k = 0; k < dp; ++k)
            reference = reference + whole->forward(ids.narrow(0, 2 * k, 2), targets.narrow(0, 2 * k, 2));
          (reference / dp / 2).backward();
          auto guard = accelerator.accumulate(model);
          const at::Tensor loss = model->forward(ids.narrow(0, 2 * data_rank, 2), targets.narrow(0, 2 * data_rank, 2));
          accelerator.backward(loss);
          if (!accelerator.sync_gradients()) continue;
          // The norms' parts (under sharding, their shards' gradients); asked again, nothing, though the shards'
          // gradients are views of one buffer whose version every write moves.
          if (sp) {
            CHECK(accel::tp::all_reduce_sequence_parallel_gradients(*model, model->norm_parameters()) == (tp > 1));
            CHECK(accel::tp::all_reduce_sequence_parallel_gradients(*model, model->norm_parameters()) == 0);
          }
          const double expected_norm = torch::nn::utils::clip_grad_norm_(whole->parameters(), 0.5);
          const double norm = accelerator.clip_grad_norm_(model->parameters(), 0.5);
          CHECK(norm ==
                doctest::Approx(expected_norm).epsilon(1e-12));  // the whole model's norm, pieces summed over tp
          for (const auto& [name, p] : tp_params) {
            CAPTURE(name);
            const auto [got, want] = stepped_gradient(*accelerator.data_parallel(model), p,
                                                      piece(name, whole_params.at(name).grad(), tp, r));
            CHECK(at::allclose(got, want, 1e-11, 1e-13));
          }
          optimizer.step();
          optimizer.zero_grad();
          whole_opt.step();
          whole_opt.zero_grad();
        }
        for (const auto& [name, p] : tp_params) {
          CAPTURE(name);
          CHECK(at::allclose(p, piece(name, whole_params.at(name), tp, r), 1e-10, 1e-12));
        }
        if (tp > 1 && strategy == accel::ShardingStrategy::NO_SHARD) {
          // save_model gathers the layers' pieces (the tied head's under its name too).
          namespace fs = std::filesystem;
          const fs::path dir = shared_temp_path(accelerator, "accel_tp_layers_export_");
          accelerator.save_model(model, dir.string());
          std::map<std::string, at::Tensor> file;
          for (auto& named : accel::detail::read_safetensors(dir / "model.safetensors")) file.insert(named);
          for (const auto& [name, p] : whole_params) {
            CAPTURE(name);
            CHECK(at::allclose(file.at(name), p, 1e-10, 1e-12));
          }
          CHECK(at::equal(file.at("head.weight"), file.at("embed.weight")));
          accelerator.wait_for_everyone();
          if (accelerator.is_main_process()) fs::remove_all(dir);
          // save_state writes each rank's pieces of the layers placed in the whole tensors; load_state puts them
          // back (test_training_tp_plan.cpp checks the files against one process, and a resumed step).
          const fs::path checkpoint = shared_temp_path(accelerator, "accel_tp_layers_state_");
          accelerator.save_state(checkpoint);
          std::map<std::string, at::Tensor> saved;
          {
            const at::NoGradGuard no_grad;
            for (const auto& [name, p] : tp_params) saved[name] = p.detach().clone();
            for (const auto& [name, p] : tp_params) p.add_(1);
          }
          accelerator.load_state(checkpoint);
          for (const auto& [name, p] : tp_params) {
            CAPTURE(name);
            CHECK(at::equal(p, saved.at(name)));
          }
          accelerator.wait_for_everyone();
          if (accelerator.is_main_process()) fs::remove_all(checkpoint);
          CHECK_THROWS_WITH_AS(accelerator.join_uneven_inputs([] {}, model),
                               doctest::Contains("a joined process would leave its tensor-parallel peers waiting"),
                               std::invalid_argument);
        }
      }
    release_world();
  }

  TEST_CASE("tensor parallelism: what does not split, or does not fit, is refused with the numbers") {
    const int P = accel::get_world_size();
    fresh({.tp_size = P});
    using accel::tp::ColumnParallelLinearOptions;
    using accel::tp::RowParallelLinearOptions;
    if (P > 1) {
      const std::string uneven = "accel::tp::ColumnParallelLinear: out_features " + std::to_string(4 * P + 1) +
                                 " does not split into " + std::to_string(P) +
                                 " equal pieces (the tensor-parallel group's size)";
      CHECK_THROWS_WITH_AS(accel::tp::ColumnParallelLinear(4, 4 * P + 1), uneven.c_str(), std::invalid_argument);
      CHECK_THROWS_WITH_AS(accel::tp::RowParallelLinear(4 * P + 1, 4), doctest::Contains("in_features"),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(accel::tp::VocabParallelEmbedding(4 * P + 1, 4), doctest::Contains("num_embeddings"),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(accel::tp::scatter_to_sequence_parallel_region(torch::zeros({2, 4 * P + 1})),
                           doctest::Contains("does not split into"), std::invalid_argument);
    }
    CHECK_THROWS_WITH_AS(accel::tp::ColumnParallelLinear(
                             ColumnParallelLinearOptions(4, 4 * P).gather_output(true).sequence_parallel(true)),
                         doctest::Contains("gather_output and sequence_parallel exclude each other"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::tp::RowParallelLinear(
                             RowParallelLinearOptions(4 * P, 4).input_is_parallel(false).sequence_parallel(true)),
                         doctest::Contains("sequence_parallel needs input_is_parallel"), std::invalid_argument);
    accel::tp::ColumnParallelLinear layer(4, 4 * P);
    const std::string wrong_shape = "accel::tp::ColumnParallelLinear::load_full: the whole weight must have shape [" +
                                    std::to_string(4 * P) + ", 4], got Float[" + std::to_string(4 * P) + ", 5] cpu";
    CHECK_THROWS_WITH_AS(layer->load_full(torch::zeros({4 * P, 5})), wrong_shape.c_str(), std::invalid_argument);
    accel::tp::VocabParallelEmbedding embed(4 * P, 3);
    const std::string outside = "accel::tp::VocabParallelEmbedding: token ids must lie in [0, " +
                                std::to_string(4 * P) + "), got ids from 0 to " + std::to_string(4 * P);
    CHECK_THROWS_WITH_AS(embed(torch::tensor({0L, 4L * P}, at::kLong)), outside.c_str(), std::invalid_argument);
    const at::Tensor logits = torch::zeros({3, 4});
    CHECK_THROWS_WITH_AS(accel::tp::vocab_parallel_cross_entropy(logits, torch::zeros({4}, at::kLong)),
                         doctest::Contains("target must have the logits' shape without its last"),
                         std::invalid_argument);
    const std::string target_outside = "target ids must lie in [0, " + std::to_string(4 * P) + ")";
    CHECK_THROWS_WITH_AS(accel::tp::vocab_parallel_cross_entropy(logits, torch::full({3}, 4 * P, at::kLong)),
                         doctest::Contains(target_outside.c_str()), std::invalid_argument);
    release_world();
    // Launched, with no interface to take the tp group from: not the world (that would split the model over
    // data-parallel peers).
    CHECK_THROWS_WITH_AS(accel::tp::ColumnParallelLinear(4, 4),
                         doctest::Contains("no group given and no DistributedInterface"), std::logic_error);
  }
}

// Against tests/python_ref/tp_ref.py (tp_fixtures::PythonRun), which trains the same model with Python's DTensor
// tensor parallelism (parallelize_module with torchtitan's styles, loss_parallel). MODE: tp, or tp_sp (sequence
// parallelism).
namespace {
void train_tp_as_python(const std::string& dir, const std::string& mode) {
  CAPTURE(mode);
  REQUIRE((mode == "tp" || mode == "tp_sp"));
  const bool sp = mode == "tp_sp";
  auto& d = fresh({.tp_size = accel::get_world_size()});
  const accel::GroupPtr group = d.get_group(accel::Dim::TP);
  TpModel tp(sp);
  tp->to(at::kDouble);
  PythonRun run(dir);
  tp->embed->load_full(run.start.at("embed.weight"));
  for (int64_t i = 0; i < kBlocks; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    tp->block(i).up->load_full(run.start.at(b + "up.weight"), run.start.at(b + "up.bias"));
    tp->block(i).down->load_full(run.start.at(b + "down.weight"), run.start.at(b + "down.bias"));
  }
  {
    const at::NoGradGuard no_grad;
    for (const auto& [name, p] : by_name(*tp))
      if (!split_dim(name) && !name.ends_with("down.bias")) p.copy_(run.start.at(name));
  }
  torch::optim::AdamW optimizer(accel::detail::unique_tensors(tp->parameters()),
                                torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  run.train(optimizer, group, [&](const at::Tensor& ids, const at::Tensor& targets) {
    at::Tensor loss = tp->forward(ids, targets);
    loss.backward();
    accel::tp::all_reduce_sequence_parallel_gradients(*tp, sp ? tp->norm_parameters() : std::vector<at::Tensor>{});
    return loss;
  });
  run.write(mode, *tp, group);
  d.barrier();
  release_world();
}
}  // namespace

TEST_SUITE("python_tp" * doctest::skip()) {
  TEST_CASE("train: Python's start and batches in each mode of ACCEL_TP_MODES") {
    const char* dir = std::getenv("ACCEL_TP_DIR");
    const char* modes = std::getenv("ACCEL_TP_MODES");
    REQUIRE(dir != nullptr);
    REQUIRE(modes != nullptr);
    std::istringstream names(modes);
    int named = 0;
    for (std::string mode; names >> mode; ++named)  // (plan_ modes: test_training_tp_plan.cpp's)
      if (!mode.starts_with("plan_")) train_tp_as_python(dir, mode);
    REQUIRE(named > 0);
  }
}
