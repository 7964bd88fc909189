// Training tests, pipeline parallelism (accel::pp): every schedule's step against one process running the whole
// model on the whole batch (each micro-batch's loss, every stage's gradients, in float64), on every world size
// (pp = the world); what is refused, with the numbers, before a step and at the first step; pp composed with tensor
// and sequence parallelism, with data parallelism (replicated and sharded), with context parallelism and with the
// Accelerator (clipping over the pipeline); Python's pipelining live (tests/python_ref/pp_ref.py); a stage that
// throws or a rank that vanishes (every rank an error in bounded time); save_model and save_state under a pipeline,
// loaded at another pp.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with training_fixtures.hpp
// precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

#include <regex>

// Named, not anonymous: the training tests are one translation unit, where an anonymous namespace's names
// (kHidden) would meet the other files' (tp_fixtures::kHidden, brought in by using-directives).
namespace pp_test {
constexpr int64_t kIn = 5, kHidden = 8, kOut = 3;

// A residual block, as a transformer's: x + tanh(W x + b). The blocks are identical in shape.
struct ResidualImpl : torch::nn::Module {
  explicit ResidualImpl(int64_t width = kHidden) { lin = register_module("lin", torch::nn::Linear(width, width)); }
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(accel::unit_forward(lin, x)); }  // (a unit)
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Residual);

// The whole model cut into `stages` stages of uneven depth (stage k has k % 2 + 1 blocks): the first starts with
// an input projection, the last ends with a head; each stage's first block's weight is tied (registered again on
// the stage: LibTorch then lists it twice, and it must be divided and stepped once). Made from one seed, so every
// rank and the one-process reference hold the same weights. With `reuse`, each stage's last block runs twice
// (one module, as ALBERT's shared layers: its weight's gradient comes from two uses, one below the other).
std::vector<torch::nn::Sequential> stage_modules(int stages, bool reuse = false) {
  torch::manual_seed(11);
  std::vector<torch::nn::Sequential> out;
  for (int k = 0; k < stages; ++k) {
    torch::nn::Sequential seq;
    if (k == 0) seq->push_back(torch::nn::Linear(kIn, kHidden));
    Residual last{nullptr};
    for (int b = 0; b <= k % 2; ++b) seq->push_back(last = Residual());
    if (reuse) seq->push_back(last);
    if (k == stages - 1) seq->push_back(torch::nn::Linear(kHidden, kOut));
    // A tied weight: the first block's weight also the stage's own parameter, listed under both names.
    seq->register_parameter("tied", seq->ptr(k == 0 ? 1 : 0)->as<ResidualImpl>()->lin->weight);
    seq->to(at::kDouble);
    out.push_back(seq);
  }
  return out;
}
at::Tensor mse(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::mse_loss(output, target);
}

// The schedules by name, over this rank's stages (one, or two: a loop's r and r + p, a V's r and 2p - 1 - r).
const std::vector<std::string> kSchedules{
    "gpipe", "1f1b", "looped_bfs", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"};
int stages_per_rank(const std::string& name) { return name == "gpipe" || name == "1f1b" ? 1 : 2; }
std::vector<int> stage_indices(const std::string& name, int P, int r) {
  if (stages_per_rank(name) == 1) return {r};
  if (name == "zbv" || name == "dualpipev") return {r, 2 * P - 1 - r};
  return {r, r + P};
}
// m micro-batches, or for DualPipeV at least one per stage (its rule, as torch's).
int microbatches_for(const std::string& name, int P, int m) { return name == "dualpipev" ? std::max(m, 2 * P) : m; }
std::unique_ptr<accel::pp::PipelineSchedule> make_schedule(const std::string& name,
                                                           std::vector<accel::pp::PipelineStage>& stages, int m,
                                                           const accel::pp::LossFn& mse = pp_test::mse,
                                                           bool scale_grads = true) {
  namespace pp = accel::pp;
  std::vector<std::reference_wrapper<pp::PipelineStage>> refs(stages.begin(), stages.end());
  if (name == "gpipe") return std::make_unique<pp::ScheduleGPipe>(stages[0], m, mse, scale_grads);
  if (name == "1f1b") return std::make_unique<pp::Schedule1F1B>(stages[0], m, mse, scale_grads);
  if (name == "looped_bfs") return std::make_unique<pp::ScheduleLoopedBFS>(refs, m, mse, scale_grads);
  if (name == "interleaved_1f1b") return std::make_unique<pp::ScheduleInterleaved1F1B>(refs, m, mse, scale_grads);
  if (name == "interleaved_zero_bubble")
    return std::make_unique<pp::ScheduleInterleavedZeroBubble>(refs, m, mse, scale_grads);
  if (name == "zbv") return std::make_unique<pp::ScheduleZBVZeroBubble>(refs, m, mse, scale_grads);
  return std::make_unique<pp::ScheduleDualPipeV>(refs, m, mse, scale_grads);
}

// pp x tp: Megatron's MLP block, x + down(tanh(up(x))), whole (Up, Down: Linear, the one-process reference) or
// split over the tp group (ColumnParallelLinear, RowParallelLinear: whole activations in and out).
constexpr int64_t kFfn = 12;
template <class Up, class Down>
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    up = register_module("up", Up(kHidden, kFfn));
    down = register_module("down", Down(kFfn, kHidden));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(torch::tanh(up(x))); }
  Up up{nullptr};
  Down down{nullptr};
};
// The model of stage_modules with MLP blocks (stage k: k % 2 + 1 of them), no tied weight.
template <class Up, class Down>
std::vector<torch::nn::Sequential> mlp_stage_modules(int stages) {
  torch::manual_seed(13);
  std::vector<torch::nn::Sequential> out;
  for (int k = 0; k < stages; ++k) {
    torch::nn::Sequential seq;
    if (k == 0) seq->push_back(torch::nn::Linear(kIn, kHidden));
    for (int b = 0; b <= k % 2; ++b) seq->push_back(std::make_shared<MlpImpl<Up, Down>>());
    if (k == stages - 1) seq->push_back(torch::nn::Linear(kHidden, kOut));
    seq->to(at::kDouble);
    out.push_back(seq);
  }
  return out;
}
const auto whole_mlp_stages = mlp_stage_modules<torch::nn::Linear, torch::nn::Linear>;
const auto split_mlp_stages = mlp_stage_modules<accel::tp::ColumnParallelLinear, accel::tp::RowParallelLinear>;
// Sequence parallelism inside the stages: the first stage scatters its projection's output along the sequence
// (dimension 1), the blocks run on this rank's tokens (their column layers gather them, their row layers
// reduce-scatter back: the row layers' biases end the backward partial), and the last stage's head, a column
// layer, gathers them and gives this rank's columns of the output (the loss over them: split_columns_mse). The
// whole model (the reference): the same names, plain layers, no scatter.
constexpr int64_t kSeq = 4, kWideOut = 4;
struct SequenceParallelMlpImpl : torch::nn::Module {
  SequenceParallelMlpImpl() {
    up = register_module("up", accel::tp::ColumnParallelLinear(
                                   accel::tp::ColumnParallelLinearOptions(kHidden, kFfn).sequence_parallel(true)));
    down = register_module("down", accel::tp::RowParallelLinear(
                                       accel::tp::RowParallelLinearOptions(kFfn, kHidden).sequence_parallel(true)));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(torch::tanh(up(x))); }
  accel::tp::ColumnParallelLinear up{nullptr};
  accel::tp::RowParallelLinear down{nullptr};
};
template <class Layer>
struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(Layer layer) : head(register_module("head", std::move(layer))) {}
  at::Tensor forward(const at::Tensor& x) { return head(x); }
  Layer head;
};
std::vector<torch::nn::Sequential> sequence_parallel_stages(int stages, bool split) {
  torch::manual_seed(17);
  std::vector<torch::nn::Sequential> out;
  for (int k = 0; k < stages; ++k) {
    torch::nn::Sequential seq;
    if (k == 0) {
      seq->push_back(torch::nn::Linear(kIn, kHidden));
      seq->push_back(torch::nn::Functional(
          [split](const at::Tensor& x) { return split ? accel::tp::scatter_to_sequence_parallel_region(x, 1) : x; }));
    }
    for (int b = 0; b <= k % 2; ++b) {
      if (split) seq->push_back(std::make_shared<SequenceParallelMlpImpl>());
      else seq->push_back(std::make_shared<MlpImpl<torch::nn::Linear, torch::nn::Linear>>());
    }
    if (k == stages - 1) {
      if (split)
        seq->push_back(std::make_shared<HeadImpl<accel::tp::ColumnParallelLinear>>(accel::tp::ColumnParallelLinear(
            accel::tp::ColumnParallelLinearOptions(kHidden, kWideOut).sequence_parallel(true))));
      else seq->push_back(std::make_shared<HeadImpl<torch::nn::Linear>>(torch::nn::Linear(kHidden, kWideOut)));
    }
    seq->to(at::kDouble);
    out.push_back(seq);
  }
  return out;
}
// The mean squared error over the whole output, from tp rank t's columns of it: each rank's sum of squares,
// summed over tp (reduce_from_parallel_region: its backward hands each rank its own part).
accel::pp::LossFn split_columns_mse(int T, int t) {
  return [T, t](const at::Tensor& out, const at::Tensor& target) {
    const at::Tensor local = (out - target.chunk(T, 2)[t]).pow(2).sum();
    return accel::tp::reduce_from_parallel_region(local) / static_cast<double>(target.numel());
  };
}

// Tp rank t's piece (of T) of a whole parameter or gradient of the MLP stages, by name.
at::Tensor tp_piece(const std::string& name, const at::Tensor& whole, int T, int t) {
  if (name.ends_with("up.weight") || name.ends_with("up.bias") || name.ends_with("head.weight") ||
      name.ends_with("head.bias"))
    return whole.chunk(T, 0)[t];
  if (name.ends_with("down.weight")) return whole.chunk(T, 1)[t];
  return whole;  // (a row-parallel layer's bias, and the plain layers: whole on every tp rank)
}
// A split stage given the whole one's values.
void load_pieces(torch::nn::Module& split, torch::nn::Module& whole, int T, int t) {
  const at::NoGradGuard no_grad;
  const auto from = whole.named_parameters();
  for (auto& p : split.named_parameters()) p.value().copy_(tp_piece(p.key(), from[p.key()], T, t));
}

// Through the Accelerator: this rank's stage modules (by index) prepared and made stages, each driven by its
// prepared DataParallel; returns their parameters, each tensor once (a tied one is listed twice by LibTorch).
std::vector<at::Tensor> prepare_stages(accel::Accelerator& accelerator, std::vector<torch::nn::Sequential>& modules,
                                       const std::vector<int>& indices, int S,
                                       std::vector<accel::pp::PipelineStage>& stages) {
  std::vector<at::Tensor> params;
  for (const int k : indices) {
    torch::nn::Sequential& seq = accelerator.prepare_model(modules[static_cast<std::size_t>(k)]);
    stages.emplace_back(seq.ptr(), [seq](const at::Tensor& x) mutable { return accel::unit_forward(seq, x); }, k, S);
    stages.back().set_data_parallel(*accelerator.data_parallel(seq));
    for (const auto& p : accel::detail::unique_tensors(seq->parameters())) params.push_back(p);
  }
  return params;
}
std::vector<at::Tensor> all_parameters(std::vector<torch::nn::Sequential>& modules) {
  std::vector<at::Tensor> params;
  for (auto& seq : modules)
    for (const auto& p : accel::detail::unique_tensors(seq->parameters())) params.push_back(p);
  return params;
}

// A model whose stages keep the whole model's names, as torchtitan's stages and llama::Stage do: "proj" on the
// first stage, the blocks as "blocks.<index in the whole model>", "head" on the last. kNamedBlocks blocks split
// as evenly as they go (at 2 stages 4 + 3, at 4 stages 2 + 2 + 2 + 1), so the whole model is the same at every
// stage count; each tensor's values come from its own seed, so any stages and the whole model agree.
constexpr int kNamedBlocks = 7;
struct NamedStageImpl : torch::nn::Module {
  // stages first..last of S in one module (0..S-1: the whole model)
  NamedStageImpl(int first, int last, int S) {
    const int per = kNamedBlocks / S, extra = kNamedBlocks % S;
    const int from = first * per + std::min(first, extra), end = (last + 1) * per + std::min(last + 1, extra);
    torch::manual_seed(40);
    if (first == 0) proj = register_module("proj", torch::nn::Linear(kIn, kHidden));
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> mine;
    for (int i = from; i < end; ++i) {
      torch::manual_seed(41 + i);
      mine.emplace_back(std::to_string(i), Residual().ptr());
    }
    blocks->update(mine);
    register_module("blocks", blocks);
    torch::manual_seed(60);
    if (last == S - 1) head = register_module("head", torch::nn::Linear(kHidden, kOut));
    to(at::kDouble);
  }
  // (each Linear a unit under FULL_SHARD: accel::unit_forward gathers its parameters)
  at::Tensor forward(at::Tensor x) {
    if (proj) x = accel::unit_forward(proj, x);
    for (const auto& block : blocks->items()) x = block.second->as<ResidualImpl>()->forward(x);
    return head ? accel::unit_forward(head, x) : x;
  }
  torch::nn::Linear proj{nullptr}, head{nullptr};
  torch::nn::ModuleDict blocks;
};
TORCH_MODULE(NamedStage);
// Stage k's values as this test sets them (each of its parameters plus 0.25 (k + 1): a value on the wrong stage's
// rank, or under another stage's name, shows), by name.
std::map<std::string, at::Tensor> named_stage_values(int k, int S) {
  NamedStage stage(k, k, S);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : stage->named_parameters()) out[p.key()] = p.value().detach() + 0.25 * (k + 1);
  return out;
}

// Whether a world of W ranks splits into pp 2 (an even W); where it does not, says so and the case is skipped.
bool even_world(const char* layout, int W) {
  if (W % 2 == 0) return true;
  MESSAGE(layout << " needs an even world; this one has " << W << " ranks");
  return false;
}

// pp x cp: a block that mixes the sequence, as attention does: x + tanh(W (x + the mean over every position of the
// sequence)). Under context parallelism (`cp` a group) x is this rank's slice of each sequence ([B, T / cp, H]) and
// the sum over positions is all-reduced over cp (accel::autograd: the backward sums what every rank's loss asks of
// it); without (the one-process reference) x is the whole sequence.
struct SequenceMixImpl : torch::nn::Module {
  explicit SequenceMixImpl(accel::GroupPtr cp) : cp(std::move(cp)) {
    lin = register_module("lin", torch::nn::Linear(kHidden, kHidden));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor sum = x.sum(1, /*keepdim=*/true);
    int64_t positions = x.size(1);
    if (cp) {
      sum = accel::autograd::all_reduce(sum, accel::ReduceOp::SUM, cp);
      positions *= cp->getSize();
    }
    return x + torch::tanh(accel::unit_forward(lin, x + sum / static_cast<double>(positions)));
  }
  accel::GroupPtr cp;
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(SequenceMix);
// stage_modules' model (uneven depth, a tied weight per stage) with SequenceMix blocks, on [B, T, features].
std::vector<torch::nn::Sequential> sequence_mix_stages(int stages, const accel::GroupPtr& cp) {
  torch::manual_seed(17);
  std::vector<torch::nn::Sequential> out;
  for (int k = 0; k < stages; ++k) {
    torch::nn::Sequential seq;
    if (k == 0) seq->push_back(torch::nn::Linear(kIn, kHidden));
    for (int b = 0; b <= k % 2; ++b) seq->push_back(SequenceMix(cp));
    if (k == stages - 1) seq->push_back(torch::nn::Linear(kHidden, kOut));
    seq->register_parameter("tied", seq->ptr(k == 0 ? 1 : 0)->as<SequenceMixImpl>()->lin->weight);
    seq->to(at::kDouble);
    out.push_back(seq);
  }
  return out;
}

// pp 2 through the Accelerator, SGD stepping this rank's stages of `mine` beside one process stepping `whole` (the
// same model, seeded alike): what the clipping and the context-parallel cases share. After each schedule step,
// clip_and_step clips over every stage to max_norm (the norm checked against one process's from its loss on the
// whole batch), steps both, and checks every parameter of this rank's stages (gathered where sharded) against one
// process's.
struct ClippedStages {
  ClippedStages(accel::Accelerator& accelerator, std::vector<torch::nn::Sequential>& mine,
                std::vector<torch::nn::Sequential>& whole, const std::string& name, int P, int m)
      : accelerator(accelerator),
        mine(mine),
        whole(whole),
        S(P * stages_per_rank(name)),
        indices(stage_indices(name, P, accelerator.pipeline_parallel_rank())),
        params(prepare_stages(accelerator, mine, indices, S, stages)),
        whole_params(all_parameters(whole)),
        sgd(params, torch::optim::SGDOptions(0.5)),
        optimizer(accelerator.prepare_optimizer(sgd)),
        reference(whole_params, torch::optim::SGDOptions(0.5)),
        schedule(make_schedule(name, stages, m)),
        first_here(std::ranges::count(indices, 0) == 1),
        last_here(std::ranges::count(indices, S - 1) == 1) {}
  // `whole_loss`: one process's loss on the whole batch, its graph through `whole`.
  void clip_and_step(const at::Tensor& whole_loss, double max_norm) {
    const double norm = accelerator.clip_grad_norm_(params, max_norm);
    optimizer.step();
    optimizer.zero_grad();
    reference.zero_grad();
    whole_loss.backward();
    const double expected = torch::nn::utils::clip_grad_norm_(whole_params, max_norm);
    REQUIRE(expected > max_norm);
    CHECK(norm == doctest::Approx(expected).epsilon(1e-10));
    reference.step();
    for (const int k : indices) {
      CAPTURE(k);
      auto& seq = mine[static_cast<std::size_t>(k)];
      const auto full = accelerator.data_parallel(seq)->summon_full_params();
      const auto got = seq->named_parameters(), want = whole[static_cast<std::size_t>(k)]->named_parameters();
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        CAPTURE(got[i].key());
        CHECK(at::allclose(got[i].value(), want[i].value(), 1e-10, 1e-12));
      }
    }
  }
  accel::Accelerator& accelerator;
  std::vector<torch::nn::Sequential>& mine;
  std::vector<torch::nn::Sequential>& whole;
  const int S;
  const std::vector<int> indices;
  std::vector<accel::pp::PipelineStage> stages;  // (before params, which prepare_stages fills it beside)
  const std::vector<at::Tensor> params, whole_params;
  torch::optim::SGD sgd;
  accel::AcceleratedOptimizer optimizer;
  torch::optim::SGD reference;
  std::unique_ptr<accel::pp::PipelineSchedule> schedule;
  const bool first_here, last_here;
};

// A run of NamedStage through the Accelerator, AdamW stepping it: a schedule's stages at pp 2 (each rank's, each
// prepared), or with `name` "none" the whole model prepared on every process (no pipeline). step() trains on this
// process's share of a batch: its data-parallel replica's rows, in micro-batches through the schedule.
struct NamedRun {
  NamedRun(accel::AcceleratorConfig c, const std::string& schedule_name, int m = 4) {
    const bool pipeline = schedule_name != "none";
    c.distributed.pp_size = pipeline ? 2 : 1;
    accelerator = std::make_unique<accel::Accelerator>(c);
    S = pipeline ? 2 * stages_per_rank(schedule_name) : 1;
    indices = pipeline ? stage_indices(schedule_name, 2, accelerator->pipeline_parallel_rank()) : std::vector<int>{0};
    stages.reserve(indices.size());  // (a schedule holds references to its stages)
    std::vector<at::Tensor> params;
    for (const int k : indices) {
      NamedStage& stage = accelerator->prepare_model(modules.emplace_back(k, k, S));
      for (const auto& p : stage->parameters()) params.push_back(p);
      if (!pipeline) continue;
      stages.emplace_back(stage.ptr(), [stage](const at::Tensor& x) mutable { return stage->forward(x); }, k, S);
      stages.back().set_data_parallel(*accelerator->data_parallel(stage));
    }
    optimizer = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    prepared.emplace(accelerator->prepare_optimizer(*optimizer));
    if (pipeline) schedule = make_schedule(schedule_name, stages, m);
  }
  void step(const at::Tensor& x, const at::Tensor& y) {
    const int replicas = schedule ? accelerator->num_processes() / 2 : accelerator->num_processes();
    const int d = schedule ? accelerator->data_parallel_rank() : accelerator->process_index();
    const int64_t rows = x.size(0) / replicas;
    const at::Tensor mine = x.narrow(0, d * rows, rows), target = y.narrow(0, d * rows, rows);
    if (schedule) {
      schedule->step(std::ranges::count(indices, 0) ? mine : at::Tensor(),
                     std::ranges::count(indices, S - 1) ? target : at::Tensor());
    } else {
      accelerator->backward(mse(modules[0]->forward(mine), target));
    }
    prepared->step();
    prepared->zero_grad();
  }
  // Every parameter of this process's stages, whole (gathered where sharded), by name.
  std::map<std::string, at::Tensor> parameters() {
    std::map<std::string, at::Tensor> out;
    for (auto& module : modules) {
      const auto full = accelerator->data_parallel(module)->summon_full_params();
      for (const auto& p : module->named_parameters()) out[p.key()] = p.value().detach().clone();
    }
    return out;
  }

  std::unique_ptr<accel::Accelerator> accelerator;
  int S = 1;
  std::vector<int> indices;
  std::vector<NamedStage> modules;
  std::vector<accel::pp::PipelineStage> stages;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::optional<accel::AcceleratedOptimizer> prepared;
  std::unique_ptr<accel::pp::PipelineSchedule> schedule;
};

TEST_SUITE("ranks") {
  // scale_grads (torch's default) averages the micro-batches' gradients: one process's on the whole batch; without
  // it they are summed: m times that.
  TEST_CASE("pipeline schedules: each micro-batch's loss and every gradient as one process, every schedule") {
    const int P = accel::get_world_size();
    accel::DistributedInterface& world = fresh({.pp_size = P});
    const int r = world.get_rank(Dim::PP);
    const accel::GroupPtr group = world.get_group(Dim::PP);
    for (const std::string& name : kSchedules) {
      const int S = P * stages_per_rank(name);
      for (const auto& [m, scale_grads] : {std::pair{P, true}, {2 * P, true}, {4, true}, {4, false}}) {
        if (m < P && name == "1f1b") continue;           // (torch's rule: at least a micro-batch per stage)
        if (m < 2 * P && name == "dualpipev") continue;  // (and DualPipeV's, over its 2p stages)
        if ((name == "interleaved_1f1b" || name == "interleaved_zero_bubble") && m % std::max(1, m / P) != 0) continue;
        CAPTURE(name);
        CAPTURE(m);
        CAPTURE(scale_grads);
        // The pipeline: this rank's stages of the model. The reference: the whole model, here too.
        std::vector<torch::nn::Sequential> mine = stage_modules(S, true), whole = stage_modules(S, true);
        std::vector<accel::pp::PipelineStage> stages;
        for (const int k : stage_indices(name, P, r))
          stages.emplace_back(mine[static_cast<std::size_t>(k)], k, S, c10::Device(c10::kCPU), group);
        const auto schedule = make_schedule(name, stages, m, mse, scale_grads);
        const std::vector<int> indices = stage_indices(name, P, r);
        const bool first_here = std::ranges::count(indices, 0) == 1,
                   last_here = std::ranges::count(indices, S - 1) == 1;
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          const int64_t batch = m * (step + 1);  // (another batch size each step: shapes told per step)
          torch::manual_seed(100 + step);
          const at::Tensor x = torch::randn({batch, kIn}, at::kDouble), y = torch::randn({batch, kOut}, at::kDouble);
          if (step == 0) {  // (the second step's gradients add to the first's, as two backwards in one process)
            for (auto& seq : mine) seq->zero_grad();
            for (auto& seq : whole) seq->zero_grad();
          }
          std::vector<at::Tensor> losses;
          const uint64_t split_before = accel::detail::pp::split_weight_passes();
          const at::Tensor out = schedule->step(first_here ? x : at::Tensor(), last_here ? y : at::Tensor(), &losses);
          // The zero-bubble schedules' W ran from what I kept on every stage past the first, each micro-batch,
          // not through the graph again (the reused block's weight: two uses, one below the other).
          if (name == "interleaved_zero_bubble" || name == "zbv")
            CHECK(accel::detail::pp::split_weight_passes() ==
                  split_before +
                      static_cast<uint64_t>(m * std::ranges::count_if(indices, [](int k) { return k > 0; })));
          // DualPipeV splits only its drain's backwards: each W of this rank's past the first stage ran so.
          if (name == "dualpipev") {
            uint64_t weights = 0;
            const accel::detail::pp::PipelineOrder order =
                accel::detail::pp::expand_overlaps(schedule->pipeline_order());
            for (const auto& a : order[static_cast<std::size_t>(r)])
              weights +=
                  a && a->computation_type == accel::detail::pp::ComputationType::BACKWARD_WEIGHT && a->stage_index > 0;
            CHECK(accel::detail::pp::split_weight_passes() == split_before + weights);
          }
          // One process: the whole batch through every stage, the loss averaging over it.
          at::Tensor h = x;
          for (auto& seq : whole) h = seq->forward(h);
          (scale_grads ? mse(h, y) : mse(h, y) * m).backward();
          if (last_here) {
            REQUIRE(out.defined());
            CHECK(at::allclose(out, h.detach(), 1e-12, 1e-14));
            REQUIRE(losses.size() == static_cast<std::size_t>(m));
            const auto pieces = h.detach().chunk(m, 0), targets = y.chunk(m, 0);
            for (int i = 0; i < m; ++i)
              CHECK(losses[static_cast<std::size_t>(i)].item<double>() ==
                    doctest::Approx(
                        mse(pieces[static_cast<std::size_t>(i)], targets[static_cast<std::size_t>(i)]).item<double>())
                        .epsilon(1e-12));
          } else {
            CHECK_FALSE(out.defined());
            CHECK(losses.empty());
          }
          for (const int k : indices) {
            CAPTURE(k);
            const auto got = mine[static_cast<std::size_t>(k)]->parameters();
            const auto expected = whole[static_cast<std::size_t>(k)]->parameters();
            REQUIRE(got.size() == expected.size());
            for (std::size_t i = 0; i < got.size(); ++i) {
              REQUIRE(got[i].grad().defined());
              CHECK(at::allclose(got[i].grad(), expected[i].grad(), 1e-10, 1e-12));
            }
          }
          CHECK(schedule->compute_seconds() > 0);
          for (const auto& stage : stages) {
            CHECK(stage.microbatches_in_flight() == 0);
            // The activations a stage held at once: GPipe every micro-batch's, 1F1B the stages' from it to the last.
            const std::size_t peak = stage.peak_microbatches_in_flight();
            if (name == "gpipe") CHECK(peak == static_cast<std::size_t>(m));
            if (name == "1f1b") CHECK(peak == static_cast<std::size_t>(std::min(m, P - r)));
          }
        }
      }
    }
    release_world();
  }

  // Activation checkpointing inside the stages (accel::checkpoint around each stage's blocks: its backward runs a
  // backward of its own, which accumulates the weights' gradients): each weight's gradient counted once, under
  // the zero-bubble schedules' split backward too (I, then W).
  TEST_CASE("pipeline schedules: checkpointed stages give every gradient once, as one process, every schedule") {
    const int P = accel::get_world_size();
    accel::DistributedInterface& world = fresh({.pp_size = P});
    const int r = world.get_rank(Dim::PP);
    const accel::GroupPtr group = world.get_group(Dim::PP);
    for (const std::string& name : kSchedules) {
      CAPTURE(name);
      const int S = P * stages_per_rank(name), m = microbatches_for(name, P, 4);
      std::vector<torch::nn::Sequential> mine = stage_modules(S), whole = stage_modules(S);
      std::vector<accel::pp::PipelineStage> stages;
      const std::vector<int> indices = stage_indices(name, P, r);
      for (const int k : indices) {
        torch::nn::Sequential seq = mine[static_cast<std::size_t>(k)];
        stages.emplace_back(
            seq.ptr(),
            [seq](const at::Tensor& x) {
              return accel::checkpoint([seq](const at::Tensor& h) mutable { return seq->forward(h); }, x);
            },
            k, S, c10::Device(c10::kCPU), group);
      }
      const auto schedule = make_schedule(name, stages, m);
      torch::manual_seed(200);
      const at::Tensor x = torch::randn({2 * m, kIn}, at::kDouble), y = torch::randn({2 * m, kOut}, at::kDouble);
      schedule->step(std::ranges::count(indices, 0) ? x : at::Tensor(),
                     std::ranges::count(indices, S - 1) ? y : at::Tensor());
      at::Tensor h = x;
      for (auto& seq : whole) h = seq->forward(h);
      mse(h, y).backward();
      for (const int k : indices) {
        CAPTURE(k);
        const auto got = mine[static_cast<std::size_t>(k)]->named_parameters();
        const auto want = whole[static_cast<std::size_t>(k)]->named_parameters();
        for (const auto& p : got) {
          CAPTURE(p.key());
          REQUIRE(p.value().grad().defined());
          CHECK(at::allclose(p.value().grad(), want[p.key()].grad(), 1e-10, 1e-12));
        }
      }
    }
    release_world();
  }

  TEST_CASE("pipeline schedules: what does not fit is refused before a step, with the numbers") {
    const int P = accel::get_world_size();
    accel::DistributedInterface& world = fresh({.pp_size = P});
    const int r = world.get_rank(Dim::PP);
    const accel::GroupPtr group = world.get_group(Dim::PP);
    namespace pp = accel::pp;
    auto modules = stage_modules(2 * P);
    // A stage on another rank's place: stage r + 1 (mod P) here.
    pp::PipelineStage misplaced(modules[static_cast<std::size_t>((r + 1) % P)], (r + 1) % P, P, c10::Device(c10::kCPU),
                                group);
    if (P > 1)
      CHECK_THROWS_WITH_AS(pp::ScheduleGPipe(misplaced, 4, mse),
                           doctest::Contains(("stage " + std::to_string((r + 1) % P) + " belongs on rank " +
                                              std::to_string((r + 1) % P) + " of the pipeline group")
                                                 .c_str()),
                           accel::InvalidArgument);
    pp::PipelineStage own(modules[static_cast<std::size_t>(r)], r, P, c10::Device(c10::kCPU), group);
    accel::DataParallel foreign(modules[static_cast<std::size_t>(2 * P - 1)].ptr(), accel::GroupPtr(),
                                accel::DataParallel::kFirstBucketBytes);  // (no group: local, no collective)
    CHECK_THROWS_WITH_AS(own.set_data_parallel(foreign), doctest::Contains("the DataParallel of another module"),
                         accel::InvalidArgument);
    pp::PipelineStage other(modules[static_cast<std::size_t>(r + P)], r + P, 2 * P, c10::Device(c10::kCPU), group);
    CHECK_THROWS_WITH_AS(pp::ScheduleInterleaved1F1B({own, other}, 4, mse),
                         doctest::Contains("differ in num_stages, group or device"), accel::InvalidArgument);
    // 2P stages with one per rank; 1F1B with fewer micro-batches than stages; ZBV with one stage per rank.
    pp::PipelineStage of_more(modules[static_cast<std::size_t>(r)], r, 2 * P, c10::Device(c10::kCPU), group);
    CHECK_THROWS_WITH_AS(pp::ScheduleGPipe(of_more, 4, mse),
                         doctest::Contains((std::to_string(2 * P) + " stages over a pipeline group of " +
                                            std::to_string(P) + " ranks with 1 stage(s) on each")
                                               .c_str()),
                         accel::InvalidArgument);
    if (P > 1)
      CHECK_THROWS_WITH_AS(pp::Schedule1F1B(own, P - 1, mse), doctest::Contains("at least one micro-batch per stage"),
                           accel::InvalidArgument);
    if (r == P - 1)
      CHECK_THROWS_WITH_AS(pp::ScheduleGPipe(own, 4), doctest::Contains("no loss_fn was given"),
                           accel::InvalidArgument);
    pp::PipelineStage v_first(modules[static_cast<std::size_t>(r)], r, 2 * P, c10::Device(c10::kCPU), group);
    pp::PipelineStage v_second(modules[static_cast<std::size_t>(2 * P - 1 - r)], 2 * P - 1 - r, 2 * P,
                               c10::Device(c10::kCPU), group);
    if ((2 * P - 1 - r) % P != r)  // (in a loop, stage 2P - 1 - r is rank (P - 1 - r)'s: at 3 ranks rank 1 has both)
      CHECK_THROWS_WITH_AS(pp::ScheduleInterleaved1F1B({v_first, v_second}, 4, mse),
                           doctest::Contains("belongs on rank"), accel::InvalidArgument);
    pp::ScheduleZBVZeroBubble zbv({v_first, v_second}, 4, mse);
    // DualPipeV: at least a micro-batch per stage.
    CHECK_THROWS_WITH_AS(pp::ScheduleDualPipeV({v_first, v_second}, 2 * P - 1, mse),
                         doctest::Contains("DualPipeV needs at least as many micro-batches as stages"),
                         accel::InvalidArgument);
    pp::ScheduleDualPipeV dualpipev({v_first, v_second}, 2 * P, mse);
    // A custom order: ours written and read back runs (DualPipeV's with its compound actions); one that breaks a
    // rule is refused, naming it.
    const std::string dir = std::filesystem::temp_directory_path() / ("accel_pp_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    zbv.dump_csv(dir + "/zbv.csv");
    zbv.load_csv(dir + "/zbv.csv");
    dualpipev.dump_csv(dir + "/dualpipev.csv");
    const accel::detail::pp::PipelineOrder made = dualpipev.pipeline_order();
    dualpipev.load_csv(dir + "/dualpipev.csv");
    const bool same_order = dualpipev.pipeline_order() == made;  // (an order has no text doctest prints)
    CHECK(same_order);
    std::ofstream(dir + "/short.csv") << "0F0\n";
    CHECK_THROWS_WITH_AS(zbv.load_csv(dir + "/short.csv"),
                         doctest::Contains(P == 1 ? "breaks a rule" : "has 1 rows; the pipeline group has"),
                         accel::InvalidArgument);
    std::filesystem::remove_all(dir);
    release_world();
  }

  // A schedule's first step runs micro-batch 0 through every stage before anything trains
  // (training/pp/shape_check.hpp): what does not fit throws the same InvalidArgument on every rank at once, naming
  // the stage and the shapes, instead of one rank failing mid-step while the others wait for the group's timeout
  // (60 s here: a DistributedError, not an InvalidArgument, would come then). Two stages per rank (a loop), so a
  // one-rank world has a stage boundary too; the group stays usable after a refusal.
  TEST_CASE("pipeline schedules: stages that do not fit are refused on every rank at the first step, naming shapes") {
    const int P = accel::get_world_size(), S = 2 * P, m = 4;
    accel::DistributedInterface& world = fresh({.pp_size = P});
    const int r = world.get_rank(Dim::PP);
    const accel::GroupPtr group = world.get_group(Dim::PP);
    namespace pp = accel::pp;
    const bool first_here = r == 0, last_here = r == P - 1;  // (a loop: stage 0 on rank 0, stage S - 1 on P - 1)
    auto step = [&](std::vector<torch::nn::Sequential> modules, int64_t batch, int64_t target_width,
                    pp::LossFn loss = mse) {
      std::vector<pp::PipelineStage> stages;
      for (const int k : {r, r + P})
        stages.emplace_back(modules[static_cast<std::size_t>(k)], k, S, c10::Device(c10::kCPU), group);
      pp::ScheduleLoopedBFS schedule({stages[0], stages[1]}, m, std::move(loss));
      const at::Tensor x = torch::randn({batch, kIn}, at::kDouble),
                       y = torch::randn({batch, target_width}, at::kDouble);
      schedule.step(first_here ? x : at::Tensor(), last_here ? y : at::Tensor());
    };
    const std::string refused =
        "accel::pp::ScheduleLoopedBFS: the stages were checked before the first step (micro-batch 0 through each)";
    // Stage 1's blocks are 6 wide; stage 0 gives 8 columns.
    auto narrow = stage_modules(S);
    narrow[1] = torch::nn::Sequential(Residual(6));
    narrow[1]->to(at::kDouble);
    const std::string narrow_error =
        refused + ": " + (P > 1 ? "rank 1: " : "") + "stage 1's forward cannot take stage 0's output, Double[2, 8]: ";
    CHECK_THROWS_WITH_AS(step(narrow, 8, kOut), doctest::Contains(narrow_error.c_str()), accel::InvalidArgument);
    // A target the loss cannot take with the last stage's output.
    CHECK_THROWS_WITH_AS(step(stage_modules(S), 8, kOut + 1),
                         doctest::Contains("loss_fn cannot take the last stage's output, Double[2, 3], with "
                                           "micro-batch 0 of the target, Double[2, 4]: "),
                         accel::InvalidArgument);
    // A loss that is not one number; a batch that does not cut into equal micro-batches (refused on the first
    // stage's rank, and through the check on every other).
    CHECK_THROWS_WITH_AS(
        step(stage_modules(S), 8, kOut, [](const at::Tensor& out, const at::Tensor& target) { return out - target; }),
        doctest::Contains("loss_fn returned Double[2, 3] for micro-batch 0; a loss is one number"),
        accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(step(stage_modules(S), 6, kOut),
                         doctest::Contains("the inputs' batch of 6 rows does not cut into 4 micro-batches"),
                         accel::InvalidArgument);
    // Every message of the refused checks was received: the group still carries a step, which trains.
    auto modules = stage_modules(S);
    step(modules, 8, kOut);
    CHECK(modules[static_cast<std::size_t>(r)]->parameters()[0].grad().defined());
    release_world();
  }

  // The check's forward leaves no trace: the buffers (a BatchNorm's running statistics) and the random generator
  // (dropout) are what they were, so a run with the check is the run without it.
  TEST_CASE("pipeline schedules: the first step's check leaves buffers and random numbers as they were") {
    torch::nn::Sequential seq(torch::nn::Linear(kIn, kHidden), torch::nn::BatchNorm1d(kHidden),
                              torch::nn::Dropout(0.5));
    const int P = accel::get_world_size();
    accel::DistributedInterface& world = fresh({.pp_size = P});
    accel::pp::PipelineStage stage(seq, world.get_rank(Dim::PP), P, c10::Device(c10::kCPU), world.get_group(Dim::PP));
    const at::Tensor x = torch::randn({4, kIn});
    std::vector<at::Tensor> buffers;
    for (const auto& b : seq->buffers()) buffers.push_back(b.clone());
    torch::manual_seed(5);
    const at::Tensor expected = torch::rand({16});
    torch::manual_seed(5);
    const at::Tensor out = stage.probe_forward(x);
    CHECK_FALSE(out.requires_grad());
    CHECK(at::equal(torch::rand({16}), expected));
    const auto after = seq->buffers();
    REQUIRE(after.size() == buffers.size());
    for (std::size_t i = 0; i < buffers.size(); ++i) CHECK(at::equal(after[i], buffers[i]));
    seq->forward(x);  // (the check would fail without the restore: a training forward moves them)
    CHECK_FALSE(at::equal(seq->buffers()[0], buffers[0]));
    release_world();
  }

  // pp 2 x tp (the rest of the world): each stage's blocks split over its tp group as Megatron's (whole
  // activations between the blocks and between the stages, the input's gradient summed over tp by the column
  // layer's backward before it goes back), every schedule, against one process: each micro-batch's loss and every
  // piece's gradient, in float64.
  TEST_CASE("pipeline x tensor parallel: Megatron's blocks inside the stages, every schedule, as one process") {
    const int W = accel::get_world_size();
    if (!even_world("pp 2 x tp", W)) return;
    const int P = 2, T = W / 2, m = 4;
    accel::DistributedInterface& world = fresh({.tp_size = T, .pp_size = P});
    const int r = world.get_rank(Dim::PP), t = world.get_rank(Dim::TP);
    REQUIRE(world.get_group(Dim::TP)->getSize() == T);
    for (const std::string& name : kSchedules) {
      CAPTURE(name);
      const int S = P * stages_per_rank(name);
      const std::vector<int> indices = stage_indices(name, P, r);
      std::vector<torch::nn::Sequential> whole = whole_mlp_stages(S), mine = split_mlp_stages(S);
      std::vector<accel::pp::PipelineStage> stages;
      for (const int k : indices) {
        load_pieces(*mine[static_cast<std::size_t>(k)], *whole[static_cast<std::size_t>(k)], T, t);
        stages.emplace_back(mine[static_cast<std::size_t>(k)], k, S, c10::Device(c10::kCPU), world.get_group(Dim::PP));
      }
      const auto schedule = make_schedule(name, stages, m);
      const bool last_here = std::ranges::count(indices, S - 1) == 1;
      torch::manual_seed(400);
      const at::Tensor x = torch::randn({2 * m, kIn}, at::kDouble), y = torch::randn({2 * m, kOut}, at::kDouble);
      std::vector<at::Tensor> losses;
      schedule->step(std::ranges::count(indices, 0) ? x : at::Tensor(), last_here ? y : at::Tensor(), &losses);
      at::Tensor h = x;
      for (auto& seq : whole) h = seq->forward(h);
      mse(h, y).backward();
      if (last_here) {
        REQUIRE(losses.size() == static_cast<std::size_t>(m));
        for (int i = 0; i < m; ++i)
          CHECK(losses[static_cast<std::size_t>(i)].item<double>() ==
                doctest::Approx(
                    mse(h.detach().chunk(m, 0)[static_cast<std::size_t>(i)], y.chunk(m, 0)[static_cast<std::size_t>(i)])
                        .item<double>())
                    .epsilon(1e-12));
      }
      for (const int k : indices) {
        const auto want = whole[static_cast<std::size_t>(k)]->named_parameters();
        for (const auto& p : mine[static_cast<std::size_t>(k)]->named_parameters()) {
          CAPTURE(k);
          CAPTURE(p.key());
          REQUIRE(p.value().grad().defined());
          CHECK(at::allclose(p.value().grad(), tp_piece(p.key(), want[p.key()].grad(), T, t), 1e-10, 1e-12));
        }
      }
    }
    release_world();
  }

  // pp 2 x dp (the rest of the world): each stage's module kept in sync by a DataParallel over the data-parallel
  // ranks (all-reduced; ZeRO-2; ZeRO-3 with each block a unit), each replica stepping its own part of the batch.
  // Against one process over the whole batch (losses, and the parameters after an SGD step), and the reduction
  // issued once per step, whatever the micro-batches.
  TEST_CASE("pipeline x data parallel: one reduction per step, every schedule, replicated and sharded") {
    const int W = accel::get_world_size();
    if (!even_world("pp 2 x dp", W)) return;  // (pp 2 x dp W/2: at 2 and 4 ranks)
    const int P = 2, D = W / 2, m = 4;
    accel::DistributedInterface& world = fresh({.pp_size = P});
    const int r = world.get_rank(Dim::PP), d = world.get_rank(Dim::DP);
    const accel::GroupPtr group = world.get_group(Dim::PP), dp_group = world.get_group(Dim::DP);
    REQUIRE(dp_group->getSize() == D);
    for (const std::string mode : {"replicate", "shard_grad_op", "full_shard", "full_shard_recompute"}) {
      for (const std::string& name : kSchedules) {
        CAPTURE(mode);
        CAPTURE(name);
        // (with activation checkpointing around each stage: its weights' gradients come in the backward of the
        // region, which must count in the step's one reduction, under the zero-bubble schedules too)
        const bool recompute = mode == "full_shard_recompute";
        const int S = P * stages_per_rank(name);
        const std::vector<int> indices = stage_indices(name, P, r);
        std::vector<torch::nn::Sequential> mine = stage_modules(S), whole = stage_modules(S);
        std::vector<std::unique_ptr<accel::DataParallel>> dps;
        std::vector<accel::pp::PipelineStage> stages;
        std::vector<at::Tensor> params;
        for (const int k : indices) {
          torch::nn::Sequential& seq = mine[static_cast<std::size_t>(k)];
          std::vector<std::shared_ptr<torch::nn::Module>> units;
          if (mode.starts_with("full_shard"))
            for (const auto& child : seq->children()) units.push_back(child);
          dps.push_back(std::make_unique<accel::DataParallel>(
              seq.ptr(), dp_group, accel::DataParallel::kFirstBucketBytes,
              mode == "replicate" ? accel::GroupPtr() : world.get_group(Dim::MP_SHARD), accel::GroupPtr(), units));
          stages.emplace_back(
              seq.ptr(),
              [seq, recompute](const at::Tensor& x) mutable {
                auto run = [seq](const at::Tensor& h) mutable { return accel::unit_forward(seq, h); };
                return recompute ? accel::checkpoint(run, x) : run(x);
              },
              k, S, c10::Device(c10::kCPU), group);
          stages.back().set_data_parallel(*dps.back());
          for (const auto& p : accel::detail::unique_tensors(seq->parameters())) params.push_back(p);
        }
        torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.5));
        std::size_t issued = 0, buckets = 0;
        for (const auto& dp : dps) {
          if (dp->sharded()) dp->shard_optimizer(sgd);
          dp->on_bucket_issued([&issued](std::size_t) { ++issued; });
          buckets += dp->bucket_count();
        }
        std::vector<at::Tensor> whole_params;
        for (auto& seq : whole)
          for (const auto& p : accel::detail::unique_tensors(seq->parameters())) whole_params.push_back(p);
        torch::optim::SGD reference(whole_params, torch::optim::SGDOptions(0.5));
        const auto schedule = make_schedule(name, stages, m);
        const bool first_here = std::ranges::count(indices, 0) == 1,
                   last_here = std::ranges::count(indices, S - 1) == 1;
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          const int64_t rows = m * (step + 1);  // (a replica's batch; another size each step)
          torch::manual_seed(200 + step);
          const at::Tensor x = torch::randn({D * rows, kIn}, at::kDouble),
                           y = torch::randn({D * rows, kOut}, at::kDouble);
          const at::Tensor my_x = x.narrow(0, d * rows, rows), my_y = y.narrow(0, d * rows, rows);
          sgd.zero_grad();
          reference.zero_grad();
          issued = 0;
          if (step == 1) {  // gradient accumulation over steps: first a step with sync off, on another batch
            for (const auto& dp : dps) dp->set_requires_gradient_sync(false);
            torch::manual_seed(250);
            const at::Tensor xa = torch::randn({D * m, kIn}, at::kDouble),
                             ya = torch::randn({D * m, kOut}, at::kDouble);
            schedule->step(first_here ? xa.narrow(0, d * m, m) : at::Tensor(),
                           last_here ? ya.narrow(0, d * m, m) : at::Tensor());
            for (const auto& dp : dps) CHECK_FALSE(dp->requires_gradient_sync());  // (the caller's setting kept)
            for (const auto& dp : dps) dp->set_requires_gradient_sync(true);
            at::Tensor h = xa;
            for (auto& seq : whole) h = seq->forward(h);
            mse(h, ya).backward();
            CHECK(issued == 0);
          }
          std::vector<at::Tensor> losses;
          schedule->step(first_here ? my_x : at::Tensor(), last_here ? my_y : at::Tensor(), &losses);
          CHECK(issued == buckets);  // every bucket once, not once per micro-batch
          sgd.step();
          for (const auto& dp : dps)
            if (dp->sharded()) dp->gather_shards();
          // One process: the whole batch of every replica through the whole model, the loss averaging over it.
          at::Tensor h = x;
          for (auto& seq : whole) h = seq->forward(h);
          mse(h, y).backward();
          reference.step();
          if (last_here) {
            REQUIRE(losses.size() == static_cast<std::size_t>(m));
            const auto pieces = h.detach().narrow(0, d * rows, rows).chunk(m, 0), targets = my_y.chunk(m, 0);
            for (int i = 0; i < m; ++i)
              CHECK(losses[static_cast<std::size_t>(i)].item<double>() ==
                    doctest::Approx(
                        mse(pieces[static_cast<std::size_t>(i)], targets[static_cast<std::size_t>(i)]).item<double>())
                        .epsilon(1e-12));
          }
          for (std::size_t j = 0; j < indices.size(); ++j) {
            const auto k = static_cast<std::size_t>(indices[j]);
            CAPTURE(k);
            const auto full = dps[j]->summon_full_params();
            const auto got = mine[k]->named_parameters(), expected = whole[k]->named_parameters();
            REQUIRE(got.size() == expected.size());
            for (std::size_t i = 0; i < got.size(); ++i) {
              CAPTURE(got[i].key());
              CHECK(at::allclose(got[i].value(), expected[i].value(), 1e-10, 1e-12));
            }
          }
        }
      }
    }
    release_world();
  }
}

// The same through the Accelerator: each stage's module prepared (NO_SHARD over its data-parallel ranks, or
// FULL_SHARD with its Linears as units), the stage given the prepared model's DataParallel, the optimizer prepared
// (the shards stepped and gathered), the gradients clipped to a global norm over every stage and replica.
TEST_SUITE("ranks") {
  TEST_CASE("pipeline with the Accelerator: prepared stages, clipping over the pipeline, every schedule") {
    const int W = accel::get_world_size();
    if (!even_world("pp 2 x dp", W)) return;
    const int P = 2, D = W / 2, m = 4;
    const double max_norm = 0.05;  // (below every step's norm here: the clipping scales)
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::FULL_SHARD}) {
      for (const std::string& name : kSchedules) {
        CAPTURE(strategy);
        CAPTURE(name);
        release_world();
        accel::AcceleratorConfig c = config();
        c.distributed.pp_size = P;
        c.sharding_strategy = strategy;
        accel::Accelerator accelerator(c);
        const int d = accelerator.data_parallel_rank(), S = P * stages_per_rank(name);
        std::vector<torch::nn::Sequential> mine = stage_modules(S), whole = stage_modules(S);
        ClippedStages run(accelerator, mine, whole, name, P, m);
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          const int64_t rows = m * (step + 1);
          torch::manual_seed(300 + step);
          const at::Tensor x = torch::randn({D * rows, kIn}, at::kDouble),
                           y = torch::randn({D * rows, kOut}, at::kDouble);
          run.schedule->step(run.first_here ? x.narrow(0, d * rows, rows) : at::Tensor(),
                             run.last_here ? y.narrow(0, d * rows, rows) : at::Tensor());
          at::Tensor h = x;
          for (auto& seq : whole) h = seq->forward(h);
          run.clip_and_step(mse(h, y), max_norm);
        }
        // What a pipeline does not do yet is refused by name, on every rank alike.
        CHECK_THROWS_WITH_AS(accelerator.backward(at::zeros({}, at::kDouble)),
                             doctest::Contains("not built for pp_size 2 yet; with a pipeline the schedule runs"),
                             accel::InvalidArgument);
      }
    }
    release_world();
    accel::AcceleratorConfig c = config();
    c.distributed.pp_size = 2;
    c.gradient_accumulation_steps = 2;
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("give the schedule more micro-batches instead"),
                         accel::InvalidArgument);
    c.gradient_accumulation_steps = 1;
    c.mixed_precision = "fp16";
    CHECK_THROWS_WITH_AS(accel::Accelerator{c}, doctest::Contains("use \"bf16\""), accel::InvalidArgument);
    CHECK_FALSE(accel::DistributedInterface::is_initialized());  // (refused before the rendezvous)
  }
  // The same through the Accelerator (pp 2 x tp, each stage prepared): clip_grad_norm_ sums the pieces over tp and
  // every stage over pp, and returns one process's norm; the clipped, stepped pieces are one process's. With
  // sequence parallelism inside the stages, a stage's step that reduces its gradients also sums the partial ones
  // over tp (the row layers' biases), as Accelerator::backward does without a pipeline.
  TEST_CASE("pipeline x tensor and sequence parallel with the Accelerator: the norm over tp and pp, every schedule") {
    const int W = accel::get_world_size();
    if (!even_world("pp 2 x tp", W)) return;
    const int P = 2, T = W / 2, m = 4;
    const double max_norm = 0.05;
    for (const bool sequence_parallel : {false, true}) {
      for (const std::string& name : kSchedules) {
        CAPTURE(sequence_parallel);
        CAPTURE(name);
        release_world();
        accel::AcceleratorConfig c = config();
        c.distributed.pp_size = P;
        c.distributed.tp_size = T;
        accel::Accelerator accelerator(c);
        const int r = accelerator.pipeline_parallel_rank(), t = accelerator.tensor_parallel_rank();
        const int S = P * stages_per_rank(name);
        const std::vector<int> indices = stage_indices(name, P, r);
        std::vector<torch::nn::Sequential> whole = sequence_parallel ? sequence_parallel_stages(S, false)
                                                                     : whole_mlp_stages(S),
                                           mine = sequence_parallel ? sequence_parallel_stages(S, true)
                                                                    : split_mlp_stages(S);
        for (const int k : indices)
          load_pieces(*mine[static_cast<std::size_t>(k)], *whole[static_cast<std::size_t>(k)], T, t);
        std::vector<accel::pp::PipelineStage> stages;
        const std::vector<at::Tensor> params = prepare_stages(accelerator, mine, indices, S, stages),
                                      whole_params = all_parameters(whole);
        torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.5));
        auto optimizer = accelerator.prepare_optimizer(sgd);
        torch::optim::SGD reference(whole_params, torch::optim::SGDOptions(0.5));
        // Sequence parallel: the head gives this rank's columns, the loss is over them.
        const auto schedule = sequence_parallel ? make_schedule(name, stages, m, split_columns_mse(T, t))
                                                : make_schedule(name, stages, m);
        torch::manual_seed(sequence_parallel ? 600 : 500);
        const at::Tensor x = sequence_parallel ? torch::randn({2 * m, kSeq, kIn}, at::kDouble)
                                               : torch::randn({2 * m, kIn}, at::kDouble),
                         y = sequence_parallel ? torch::randn({2 * m, kSeq, kWideOut}, at::kDouble)
                                               : torch::randn({2 * m, kOut}, at::kDouble);
        std::vector<at::Tensor> losses;
        schedule->step(std::ranges::count(indices, 0) ? x : at::Tensor(),
                       std::ranges::count(indices, S - 1) ? y : at::Tensor(), &losses);
        const double norm = accelerator.clip_grad_norm_(params, max_norm);
        optimizer.step();
        at::Tensor h = x;
        for (auto& seq : whole) h = seq->forward(h);
        mse(h, y).backward();
        CHECK(losses.size() == (std::ranges::count(indices, S - 1) ? std::size_t(m) : 0));
        if (!losses.empty())
          CHECK(at::stack(losses).mean().item<double>() == doctest::Approx(mse(h, y).item<double>()).epsilon(1e-12));
        const double expected = torch::nn::utils::clip_grad_norm_(whole_params, max_norm);
        REQUIRE(expected > max_norm);
        CHECK(norm == doctest::Approx(expected).epsilon(1e-10));
        reference.step();
        for (const int k : indices) {
          const auto want = whole[static_cast<std::size_t>(k)]->named_parameters();
          for (const auto& p : mine[static_cast<std::size_t>(k)]->named_parameters()) {
            CAPTURE(k);
            CAPTURE(p.key());
            CHECK(at::allclose(p.value(), tp_piece(p.key(), want[p.key()], T, t), 1e-10, 1e-12));
          }
        }
      }
    }
    release_world();
  }
  // pp x cp through the Accelerator: each cp rank's micro-batches are its slice of every sequence, and the stages'
  // SequenceMix blocks sum over the positions of the whole sequence on the stage's cp group; the gradients are
  // averaged over dp x cp (each rank's loss is over its own tokens). Replicated and sharded (FULL_SHARD shards
  // along mp_shard, which spans cp), every schedule: each micro-batch's loss, the clipping norm over every stage
  // and the parameters after two steps are one process's on the whole sequences.
  TEST_CASE("pipeline x context parallel with the Accelerator: blocks that mix the sequence, every schedule") {
    const int W = accel::get_world_size();
    if (W % 4 != 0) {
      MESSAGE("pp 2 x cp 2 needs a world of a multiple of 4 ranks; this one has " << W);
      return;
    }
    const int P = 2, C = 2, D = W / (P * C), m = 4;
    constexpr int64_t T = 6, slice = T / 2;  // positions of a sequence, and of each cp rank's slice
    const double max_norm = 0.05;
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::FULL_SHARD}) {
      for (const std::string& name : kSchedules) {
        CAPTURE(strategy);
        CAPTURE(name);
        release_world();
        accel::AcceleratorConfig c = config();
        c.distributed.pp_size = P;
        c.distributed.cp_size = C;
        c.sharding_strategy = strategy;
        accel::Accelerator accelerator(c);
        const int d = accelerator.data_parallel_rank(), cp_rank = accelerator.context_parallel_rank(),
                  S = P * stages_per_rank(name);
        std::vector<torch::nn::Sequential> mine = sequence_mix_stages(
                                               S, accel::DistributedInterface::instance().get_group(accel::Dim::CP)),
                                           whole = sequence_mix_stages(S, accel::GroupPtr());
        ClippedStages run(accelerator, mine, whole, name, P, m);
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          const int64_t rows = m * (step + 1), per = rows / m;  // this dp rank's sequences, and a micro-batch's
          torch::manual_seed(700 + step);
          const at::Tensor x = torch::randn({D * rows, T, kIn}, at::kDouble),
                           y = torch::randn({D * rows, T, kOut}, at::kDouble);
          const auto mine_of = [&](const at::Tensor& t) {
            return t.narrow(0, d * rows, rows).narrow(1, cp_rank * slice, slice);
          };
          std::vector<at::Tensor> losses;
          run.schedule->step(run.first_here ? mine_of(x) : at::Tensor(), run.last_here ? mine_of(y) : at::Tensor(),
                             &losses);
          at::Tensor h = x;
          for (auto& seq : whole) h = seq->forward(h);
          // Each micro-batch's loss: over its sequences' positions on this cp rank.
          REQUIRE(losses.size() == (run.last_here ? std::size_t(m) : 0));
          for (std::size_t j = 0; j < losses.size(); ++j) {
            CAPTURE(j);
            const auto micro = [&](const at::Tensor& t) {
              return mine_of(t).narrow(0, static_cast<int64_t>(j) * per, per);
            };
            CHECK(losses[j].item<double>() == doctest::Approx(mse(micro(h), micro(y)).item<double>()).epsilon(1e-12));
          }
          run.clip_and_step(mse(h, y), max_norm);
        }
      }
    }
    release_world();
  }
  // save_model under a pipeline writes the whole model (every stage's tensors under the names it keeps, which are
  // the whole model's), each tensor sent to the main process by a process of its stage; load_model gives each stage
  // its own. Saved at one stage layout, read back by one process (the whole model) and by the other layout's
  // stages; replicated and sharded (FULL_SHARD: gathered unit by unit).
  TEST_CASE("pipeline with the Accelerator: save_model writes the whole model, load_model reads it at another pp") {
    const int W = accel::get_world_size();
    if (!even_world("pp 2 x dp", W)) return;
    const int P = 2;
    // This rank's stages of a layout prepared (one per rank for 1f1b, two for zbv), and their S.
    auto prepare = [&](accel::Accelerator& accelerator, const std::string& name, std::vector<NamedStage>& out) {
      const int S = P * stages_per_rank(name);
      for (const int k : stage_indices(name, P, accelerator.pipeline_parallel_rank())) {
        out.emplace_back(k, k, S);
        accelerator.prepare_model(out.back());
      }
      return S;
    };
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::FULL_SHARD}) {
      for (const auto& [saved, loaded] : {std::pair<std::string, std::string>{"1f1b", "zbv"}, {"zbv", "1f1b"}}) {
        CAPTURE(strategy);
        CAPTURE(saved);
        release_world();
        accel::AcceleratorConfig c = config();
        c.distributed.pp_size = P;
        c.sharding_strategy = strategy;
        std::filesystem::path dir;
        std::map<std::string, at::Tensor> want;  // the whole model's values, as the stages were set
        {
          accel::Accelerator accelerator(c);
          dir = shared_temp_path(accelerator, "accel_pp_save_model_");
          std::vector<NamedStage> stages;
          const int S = prepare(accelerator, saved, stages);
          for (int k = 0; k < S; ++k) want.merge(named_stage_values(k, S));
          for (auto& stage : stages) {
            const auto full = accelerator.data_parallel(stage)->summon_full_params(/*writeback=*/true);
            const at::NoGradGuard no_grad;
            for (auto& p : stage->named_parameters()) p.value().copy_(want.at(p.key()));
          }
          accelerator.save_model(stages.back(), dir.string());
          // One process's whole model reads every tensor under its name.
          NamedStage whole(0, 0, 1);
          accel::load_model(whole, dir.string());
          const auto got = whole->named_parameters();
          CHECK(got.size() == want.size());
          for (const auto& p : got) {
            CAPTURE(p.key());
            CHECK(at::equal(p.value(), want.at(p.key())));
          }
        }
        // The other layout's stages read their own tensors.
        release_world();
        accel::Accelerator accelerator(c);
        std::vector<NamedStage> stages;
        prepare(accelerator, loaded, stages);
        accelerator.load_model(stages.front(), dir.string());
        for (auto& stage : stages) {
          const auto full = accelerator.data_parallel(stage)->summon_full_params();
          for (const auto& p : stage->named_parameters()) {
            CAPTURE(p.key());
            CHECK(at::equal(p.value(), want.at(p.key())));
          }
        }
        accelerator.wait_for_everyone();
        if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
      }
    }
    // What does not fit is refused on every rank alike, before anything is written or loaded.
    release_world();
    accel::AcceleratorConfig c = config();
    c.distributed.pp_size = P;
    accel::Accelerator accelerator(c);
    const int r = accelerator.pipeline_parallel_rank();
    const std::filesystem::path dir = shared_temp_path(accelerator, "accel_pp_refused_");
    NamedStage unprepared(r, r, P);
    CHECK_THROWS_WITH_AS(accelerator.save_model(unprepared, dir.string()),
                         doctest::Contains("pass one of this process's prepared stages"), accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(accelerator.load_model(unprepared, dir.string()),
                         doctest::Contains("pass one of this process's prepared stages"), accel::InvalidArgument);
    // A tensor no stage holds: each rank's stage takes its own tensors, and the file is checked against all of them.
    NamedStage stage(r, r, P);
    accelerator.prepare_model(stage);
    {
      NamedStage whole(0, 0, 1);
      whole->register_parameter("extra", torch::zeros({2}, at::kDouble));
      accel::save_model(whole, dir.string());
    }
    const std::string refused = what_of([&] { accelerator.load_model(stage, dir.string()); });
    CHECK(refused.find("does not fit the model's stages: not in the model: extra.") != std::string::npos);
    CHECK(refused.find("missing") == std::string::npos);
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
    // Stages that hold one name twice (every rank's holds the first stage's modules): the file could keep either.
    release_world();
    accel::Accelerator twice(c);
    NamedStage first(0, 0, P);
    twice.prepare_model(first);
    CHECK_THROWS_WITH_AS(twice.save_model(first, (dir / "twice").string()),
                         doctest::Contains("'proj.weight' is held by the stages on pipeline ranks 0 and 1"),
                         accel::InvalidArgument);
    CHECK_FALSE(std::filesystem::exists(dir));
    // save_state refuses them too, at the save (its pieces would overlap, and load_state refuse them later),
    // before anything is written.
    CHECK_THROWS_WITH_AS(twice.save_state(dir / "twice"),
                         doctest::Contains("accel::Accelerator::save_state: 'proj.weight' is held by the stages on "
                                           "pipeline ranks 0 and 1 (a weight tied across stages: give it to one "
                                           "stage)"),
                         accel::InvalidArgument);
    CHECK_FALSE(std::filesystem::exists(dir));
    // Two stages on one process that hold one name (each process's two stages hold the first stage's modules).
    release_world();
    accel::Accelerator looped(c);
    NamedStage one(0, 0, 2 * P), other(0, 0, 2 * P);
    looped.prepare_model(one);
    looped.prepare_model(other);
    CHECK_THROWS_WITH_AS(looped.save_model(one, (dir / "twice").string()),
                         doctest::Contains("'proj.weight' is held by two stages on pipeline rank 0"),
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(looped.save_state(dir / "twice"),
                         doctest::Contains("'proj.weight' is held by two stages on pipeline rank 0"),
                         accel::InvalidArgument);
    CHECK_FALSE(std::filesystem::exists(dir));
    release_world();
  }

  // save_state under a pipeline: each process writes its stages in pieces under the whole model's names, AdamW's
  // state beside them (as Python's DCP reads them), and its own optimizer file. Loaded in the saving layout, the
  // next step is taken again bit for bit; in another (another schedule's stages, with the other sharding or the
  // same, or no pipeline: every process the whole model), the next step gives one process's parameters.
  TEST_CASE("pipeline with the Accelerator: save_state resumes a step bit for bit, and loads at another pp") {
    const int W = accel::get_world_size();
    if (!even_world("pp 2 x dp", W)) return;
    const int64_t batch = W / 2 * 8;  // (8 rows per pipeline replica: 4 micro-batches of 2)
    auto data = [&](int step) {
      torch::manual_seed(500 + step);
      const at::Tensor x = torch::randn({batch, kIn}, at::kDouble);
      return std::pair{x, torch::randn({batch, kOut}, at::kDouble)};
    };
    // One process, the whole model on the whole batch: its parameters after the second step.
    std::map<std::string, at::Tensor> one;
    {
      NamedStage whole(0, 0, 1);
      torch::optim::AdamW adamw(whole->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      for (int step = 0; step < 2; ++step) {
        const auto [x, y] = data(step);
        adamw.zero_grad();
        mse(whole->forward(x), y).backward();
        adamw.step();
      }
      for (const auto& p : whole->named_parameters()) one[p.key()] = p.value().detach().clone();
    }
    using Strategy = accel::ShardingStrategy;
    for (const auto strategy : {Strategy::FULL_SHARD, Strategy::NO_SHARD}) {
      // (zbv to interleaved_1f1b: as many processes and stages per process, the same sharding, but rank 0 holds
      // stages 0 and 3, then 0 and 2: its optimizer's parameters are others, in other places)
      const std::vector<std::tuple<std::string, std::string, bool>> moves{
          {"1f1b", "zbv", true}, {"zbv", "none", true}, {"zbv", "interleaved_1f1b", false}};
      for (const auto& [saved, loaded, other_sharding] : moves) {
        CAPTURE(strategy);
        CAPTURE(saved);
        CAPTURE(loaded);
        release_world();
        accel::AcceleratorConfig c = config();
        c.sharding_strategy = strategy;
        std::filesystem::path dir;
        const auto [x0, y0] = data(0);
        const auto [x1, y1] = data(1);
        {
          NamedRun run(c, saved);
          dir = shared_temp_path(*run.accelerator, "accel_pp_state_");
          run.step(x0, y0);
          run.accelerator->save_state(dir);
          run.step(x1, y1);
          const auto straight = run.parameters();
          run.accelerator->load_state(dir);
          run.step(x1, y1);
          const auto resumed = run.parameters();
          CHECK(resumed.size() == straight.size());
          for (const auto& [name, p] : resumed) {
            CAPTURE(name);
            CHECK(at::equal(p, straight.at(name)));
            CHECK(at::allclose(p, one.at(name), 1e-9, 1e-12));
          }
          // The piece files hold the whole model under its names, and AdamW's state of each parameter under
          // Python's (its moments, and its step once): each name once, nothing else.
          if (run.accelerator->is_main_process()) {
            std::multiset<std::string> names;
            for (const auto& entry : std::filesystem::directory_iterator(dir))
              if (entry.path().extension() == ".safetensors")
                for (const auto& named : accel::detail::read_safetensors(entry.path().string()))
                  names.insert(named.first);
            std::multiset<std::string> want;
            for (const auto& named : one)
              for (const char* state : {"", ".exp_avg", ".exp_avg_sq", ".step"})
                want.insert((*state ? "optimizer.state." : "") + named.first + state);
            if (strategy == Strategy::NO_SHARD) CHECK(names == want);  // (a shard's boxes: several per name)
            else
              CHECK(std::set<std::string>(names.begin(), names.end()) ==
                    std::set<std::string>(want.begin(), want.end()));
          }
        }
        // Another layout: the stages (and the sharding) change; the parameters after the next step are one process's.
        release_world();
        if (other_sharding)
          c.sharding_strategy = strategy == Strategy::NO_SHARD ? Strategy::FULL_SHARD : Strategy::NO_SHARD;
        NamedRun run(c, loaded);
        run.accelerator->load_state(dir);
        run.step(x1, y1);
        for (const auto& [name, p] : run.parameters()) {
          CAPTURE(name);
          CHECK(at::allclose(p, one.at(name), 1e-9, 1e-12));
        }
        run.accelerator->wait_for_everyone();
        if (run.accelerator->is_main_process()) std::filesystem::remove_all(dir);
      }
    }
    // A checkpoint of the whole model (model.pt: no pipeline, NO_SHARD) is refused by stages, naming it, on every
    // rank, before anything changes.
    release_world();
    std::filesystem::path dir;
    {
      NamedRun run(config(), "none");
      dir = shared_temp_path(*run.accelerator, "accel_pp_whole_state_");
      run.accelerator->save_state(dir);
    }
    release_world();
    NamedRun run(config(), "1f1b");
    const auto before = run.parameters();
    CHECK_THROWS_WITH_AS(run.accelerator->load_state(dir),
                         doctest::Contains("model.pt holds the model whole (saved without a pipeline"),
                         accel::RuntimeError);
    for (const auto& [name, p] : run.parameters()) CHECK(at::equal(p, before.at(name)));
    run.accelerator->wait_for_everyone();
    if (run.accelerator->is_main_process()) std::filesystem::remove_all(dir);
    release_world();
  }
}

// tests/python_ref/pp_ref.py's model and run (its docstring says what both sides do): a stage's layers in order,
// each under the whole model's name ("blocks.3" registered as "blocks_3": LibTorch's names have no dots).
constexpr int64_t kPyIn = 6, kPyHidden = 16, kPyOut = 4, kPyBlocks = 8;
struct PyStageImpl : torch::nn::Module {
  PyStageImpl(int k, int stages, const std::map<std::string, at::Tensor>& start) {
    const int64_t per = kPyBlocks / stages;
    if (k == 0) names.push_back("inp");
    for (int64_t i = k * per; i < (k + 1) * per; ++i) names.push_back("blocks." + std::to_string(i));
    if (k == stages - 1) names.push_back("head");
    for (const auto& name : names) {
      const std::string local = std::regex_replace(name, std::regex("\\."), "_");
      std::shared_ptr<torch::nn::Module> layer;
      if (name == "inp") layer = torch::nn::Linear(kPyIn, kPyHidden).ptr();
      else if (name == "head") layer = torch::nn::Linear(kPyHidden, kPyOut).ptr();
      else layer = Residual(kPyHidden).ptr();
      layers.push_back(register_module(local, layer));
    }
    to(at::kDouble);
    at::NoGradGuard no_grad;
    for (auto& [name, p] : by_whole_name()) p.copy_(start.at(name));
  }
  // Each layer through DataParallel::unit_call: a unit under FULL_SHARD (gathered for its forward), else a call.
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) {
      x = accel::DataParallel::unit_call(
          layer.get(),
          [&layer](const at::Tensor& in) {
            if (auto* linear = layer->as<torch::nn::LinearImpl>()) return linear->forward(in);
            return layer->as<ResidualImpl>()->forward(in);
          },
          x);
    }
    return x;
  }
  std::map<std::string, at::Tensor> by_whole_name() {
    std::map<std::string, at::Tensor> out;
    for (const auto& p : named_parameters()) {
      const std::string key = p.key();
      const std::size_t dot = key.find('.');
      out[std::regex_replace(key.substr(0, dot), std::regex("^blocks_"), "blocks.") + key.substr(dot)] = p.value();
    }
    return out;
  }
  std::vector<std::string> names;
  std::vector<std::shared_ptr<torch::nn::Module>> layers;
};
TORCH_MODULE(PyStage);

// D > 1: pp_ref.py's (pp, dp_shard) mesh; each stage's module a DataParallel over Dim::MP_SHARD, FULL_SHARD with
// each layer a unit (Python: fully_shard on each layer and the stage), each replica on its D-th of every batch.
void train_pp_as_python(const std::string& dir, const std::string& name, int D) {
  accel::DistributedInterface& world = accel::DistributedInterface::instance();
  const int P = world.get_world_size(Dim::PP), r = world.get_rank(Dim::PP), d = world.get_rank(Dim::MP_SHARD);
  REQUIRE(world.get_world_size(Dim::MP_SHARD) == D);
  std::map<std::string, at::Tensor> start, batches;
  for (auto& named : accel::detail::read_safetensors(dir + "/init.safetensors")) start.insert(named);
  for (auto& named : accel::detail::read_safetensors(dir + "/batches.safetensors")) batches.insert(named);
  const int S = P * stages_per_rank(name), m = 2 * P;
  const std::vector<int> indices = stage_indices(name, P, r);
  std::vector<PyStage> modules;
  std::vector<std::unique_ptr<accel::DataParallel>> dps;
  std::vector<accel::pp::PipelineStage> stages;
  std::vector<at::Tensor> params;
  for (const int k : indices) {
    modules.emplace_back(k, S, start);
    stages.emplace_back(modules.back(), k, S, c10::Device(c10::kCPU), world.get_group(Dim::PP));
    for (const auto& p : modules.back()->parameters()) params.push_back(p);
    if (D == 1) continue;
    dps.push_back(std::make_unique<accel::DataParallel>(
        modules.back().ptr(), world.get_group(Dim::DP), accel::DataParallel::kFirstBucketBytes,
        world.get_group(Dim::MP_SHARD), accel::GroupPtr(), modules.back()->layers));
    stages.back().set_data_parallel(*dps.back());
  }
  const auto schedule = make_schedule(name, stages, m);
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  for (const auto& dp : dps) dp->shard_optimizer(optimizer);
  const bool first = std::ranges::count(indices, 0) == 1, last = std::ranges::count(indices, S - 1) == 1;
  const int64_t rows = batches.at("x").size(1) / D;  // (this replica's rows of each batch)
  std::vector<at::Tensor> step_losses;
  for (int64_t step = 0; step < batches.at("x").size(0); ++step) {
    std::vector<at::Tensor> losses;
    schedule->step(first ? batches.at("x")[step].narrow(0, d * rows, rows) : at::Tensor(),
                   last ? batches.at("y")[step].narrow(0, d * rows, rows) : at::Tensor(), &losses);
    optimizer.step();
    optimizer.zero_grad();
    for (const auto& dp : dps) dp->gather_shards();
    if (last) step_losses.push_back(at::stack(losses));
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t j = 0; j < modules.size(); ++j) {
    const auto full =
        j < dps.size() ? dps[j]->summon_full_params() : accel::DataParallel::FullParameters(nullptr, false);
    for (const auto& [whole_name, p] : modules[j]->by_whole_name())
      out.emplace_back(whole_name, p.detach().clone().contiguous());
  }
  if (last) out.emplace_back("losses", at::stack(step_losses).contiguous());
  const std::string tag = D == 1 ? std::to_string(P) : std::to_string(P) + "x" + std::to_string(D);
  accel::detail::write_safetensors(
      dir + "/cpp_" + name + "_" + tag + "_" + std::to_string(world.get_rank()) + ".safetensors", out);
}

// tests/python_ref/run_pp.sh: each schedule of ACCEL_PP_SCHEDULES trained from pp_ref.py's start on its batches.
TEST_SUITE("python_pp_train" * doctest::skip()) {
  TEST_CASE("train: Python's start and batches with each schedule of ACCEL_PP_SCHEDULES") {
    const char* dir = std::getenv("ACCEL_PP_DIR");
    const char* schedules = std::getenv("ACCEL_PP_SCHEDULES");
    const char* dp = std::getenv("ACCEL_PP_DP");
    REQUIRE(dir != nullptr);
    REQUIRE(schedules != nullptr);
    const int D = dp ? std::stoi(dp) : 1;
    fresh({.pp_size = accel::get_world_size() / D});
    std::istringstream names(schedules);
    int named = 0;
    for (std::string name; names >> name; ++named) train_pp_as_python(dir, name, D);
    REQUIRE(named > 0);
    release_world();
  }
}

// This rank's stage of a pipeline over the whole world (a fresh interface whose groups time out after `timeout`:
// not fresh(), whose tests' timeout is 60 s), its forward running `fault` on the last rank at its second
// micro-batch; every rank's step over a batch of 8 in 4 micro-batches, and the seconds it took to end.
struct FaultyPipeline {
  FaultyPipeline(std::chrono::seconds timeout, std::function<void()> fault) {
    release_world();
    const int P = accel::get_world_size();
    r = accel::DistributedInterface::instance(accel::DistributedConfig{.pp_size = P, .timeout = timeout})
            .get_rank(Dim::PP);
    last = r == P - 1;
    seq = stage_modules(P)[static_cast<std::size_t>(r)];
    stage = std::make_unique<accel::pp::PipelineStage>(
        seq.ptr(),
        [this, fault = std::move(fault)](const at::Tensor& x) {
          if (last && ++forwards == 3) fault();  // (the first: the first step's check)
          return seq->forward(x);
        },
        r, P);
  }
  template <class Schedule>
  void step() {
    Schedule schedule(*stage, 4, mse);
    began = std::chrono::steady_clock::now();
    schedule.step(torch::randn({8, kIn}, at::kDouble), torch::randn({8, kOut}, at::kDouble));
  }
  // The others' error: a DistributedError naming the pipeline's message and the group.
  template <class Schedule>
  void step_fails_for_the_others() {
    try {
      step<Schedule>();
      FAIL("the step returned");
    } catch (const accel::DistributedError& e) {
      MESSAGE(std::string(e.what()));
      CHECK(std::string(e.what()).find("(point to point) failed on group") != std::string::npos);
    }
    CHECK(stage->microbatches_in_flight() == 0);  // (the step's micro-batches let go)
    MESSAGE("rank " << r << " threw after " << seconds() << " s");
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(); }

  int r = 0, forwards = 0;
  bool last = false;
  torch::nn::Sequential seq{nullptr};
  std::unique_ptr<accel::pp::PipelineStage> stage;
  std::chrono::steady_clock::time_point began;
};

// A pipeline rank that fails mid-step (the last stage's, at its second micro-batch's forward): every other rank's
// step throws a DistributedError naming the pipeline's message and the group, in bounded time, one after the
// other down the pipeline.
TEST_SUITE("pp_peer_gone") {
  // A stage that throws, its process going on (the user catches the error): its rank gets its own error at once,
  // the messages in flight abandoned, not waited for; the others' steps end by the group's timeout (3 s here),
  // after one wait each, not one per message in flight, the roll call naming the rank that did not answer.
  TEST_CASE("a stage that throws: its rank gets its own error, every other rank a DistributedError by the timeout") {
    if (accel::get_world_size() == 1) return;
    FaultyPipeline pipeline(std::chrono::seconds(3), [] { throw std::runtime_error("the user's stage failed"); });
    if (pipeline.last) {
      CHECK_THROWS_WITH_AS(pipeline.step<accel::pp::ScheduleGPipe>(), "the user's stage failed", std::runtime_error);
      CHECK(pipeline.stage->microbatches_in_flight() == 0);
      std::this_thread::sleep_for(std::chrono::seconds(6));  // alive while the others time out
    } else {
      pipeline.step_fails_for_the_others<accel::pp::ScheduleGPipe>();
    }
  }

  // A rank that vanishes: the others' errors come at once (a dead peer's connection closes; the timeout, 10 s
  // here, is not what ends them).
  TEST_CASE("a stage's rank that vanishes mid-step makes every other rank's step throw, naming the message") {
    FaultyPipeline pipeline(std::chrono::seconds(10), [] { std::_Exit(0); });  // gone without a word
    pipeline.step_fails_for_the_others<accel::pp::Schedule1F1B>();
  }
}
}  // namespace pp_test
