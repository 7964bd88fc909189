// Trains a small LLaMA (llama.hpp) on bytes, on both meshes: sharded along
// the model mesh (FULL_SHARD; HSDP when mp_replicate > 1), data parallel
// along dp, Ulysses context parallelism along cp and tensor parallelism
// along tp (the pieces sharded along mp_shard: FSDP + TP); gradient accumulation,
// clipping, bf16 autocast, AdamW with warmup and cosine decay, activation
// checkpointing, checkpoints resumed mid-epoch, a progress line and a loss
// log (metrics.csv, metrics.jsonl). The model is written and read in Hugging
// Face's Llama layout: transformers.LlamaForCausalLM.from_pretrained(dir)
// loads what --export writes, and --import starts from such a directory.
//
// Build:  cmake --build build --target train_llama accel_launch
// Run:    build/examples/train_llama                       (one process, about a minute on 2 cores)
//         build/examples/train_llama --spawn 4 --mp-replicate 2 --mp-shard 2 --dp 2 --cp 2
//         build/tests/accel_launch 4 build/examples/train_llama --cp 4   (or torchrun)
// Flags:  sizes --layers --hidden --heads --kv-heads --intermediate --seq;
//         --batch (sequences per micro-step, all processes together) --accumulate --steps
//         --lr --warmup --clip --seed --corpus (a file or directory; default /usr/share/common-licenses)
//         meshes --mp-replicate --mp-shard --dp --cp (default: everything along mp_shard and dp)
//         --tp N (tensor parallelism, torchtitan's plan with sequence parallelism: llama::tp_plan; the model
//         mesh's mp_shard shards the pieces: FSDP + TP; prints the collectives a step issues on the tp group)
//         --pp N --schedule NAME --microbatches M (pipeline parallelism: the layers split evenly into stages as
//         torchtitan's pipeline_llama, llama::Stage; NAME gpipe, 1f1b (default), looped_bfs, interleaved_1f1b,
//         interleaved_zero_bubble, zbv or dualpipev, the last five with two stages per rank; each stage sharded or
//         replicated over its data-parallel ranks, with --tp split by the plan inside; M micro-batches per
//         step, default pp; with --cp each rank's micro-batches are its slice of the sequences; not yet with
//         --accumulate)
//         --sharding no_shard|shard_grad_op|full_shard (default full_shard)
//         --mixed-precision no|bf16
//         --recompute (activation checkpointing per decoder layer)
//         --dir DIR (checkpoints and logs; default train_llama_run) --save-every N --resume --stop-after N
//         --export DIR --import DIR --logits FILE (write the logits of a fixed input and stop)
//         --generate PROMPT (greedy decoding with a key/value cache: print what follows PROMPT, its bytes the
//         tokens, and stop) --max-new-tokens N (default 32)
#include "llama.hpp"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <unistd.h>

namespace {

struct Options {
  llama::Config model;
  int64_t seq = 128, batch = 16, accumulate = 1, steps = 400, warmup = 20, save_every = 0, stop_after = -1, seed = 0;
  double lr = 3e-3, clip = 1.0;
  int spawn = 0, mp_replicate = 1, mp_shard = 0, dp = 0, cp = 1, tp = 1, pp = 1, microbatches = 0;
  accel::ShardingStrategy sharding = accel::ShardingStrategy::FULL_SHARD;
  std::string schedule = "1f1b", mixed_precision = "no", corpus = "/usr/share/common-licenses", dir = "train_llama_run",
              export_dir, import_dir, logits, generate;
  int64_t max_new_tokens = 32;
  bool recompute = false, resume = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    auto integer = [&] { return std::stoll(value()); };
    if (arg == "--layers") o.model.num_hidden_layers = integer();
    else if (arg == "--hidden") o.model.hidden_size = integer();
    else if (arg == "--heads") o.model.num_attention_heads = integer();
    else if (arg == "--kv-heads") o.model.num_key_value_heads = integer();
    else if (arg == "--intermediate") o.model.intermediate_size = integer();
    else if (arg == "--seq") o.seq = integer();
    else if (arg == "--batch") o.batch = integer();
    else if (arg == "--accumulate") o.accumulate = integer();
    else if (arg == "--steps") o.steps = integer();
    else if (arg == "--warmup") o.warmup = integer();
    else if (arg == "--lr") o.lr = std::stod(value());
    else if (arg == "--clip") o.clip = std::stod(value());
    else if (arg == "--seed") o.seed = integer();
    else if (arg == "--corpus") o.corpus = value();
    else if (arg == "--spawn") o.spawn = static_cast<int>(integer());
    else if (arg == "--mp-replicate") o.mp_replicate = static_cast<int>(integer());
    else if (arg == "--mp-shard") o.mp_shard = static_cast<int>(integer());
    else if (arg == "--dp") o.dp = static_cast<int>(integer());
    else if (arg == "--cp") o.cp = static_cast<int>(integer());
    else if (arg == "--tp") o.tp = static_cast<int>(integer());
    else if (arg == "--pp") o.pp = static_cast<int>(integer());
    else if (arg == "--schedule") o.schedule = value();
    else if (arg == "--microbatches") o.microbatches = static_cast<int>(integer());
    else if (arg == "--sharding") {
      std::string name = value();  // full_shard -> FULL_SHARD, FSDP's spelling
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
      o.sharding = accel::from_string<accel::ShardingStrategy>(name);
    } else if (arg == "--mixed-precision") o.mixed_precision = value();
    else if (arg == "--recompute") o.recompute = true;
    else if (arg == "--dir") o.dir = value();
    else if (arg == "--save-every") o.save_every = integer();
    else if (arg == "--resume") o.resume = true;
    else if (arg == "--stop-after") o.stop_after = integer();
    else if (arg == "--export") o.export_dir = value();
    else if (arg == "--import") o.import_dir = value();
    else if (arg == "--logits") o.logits = value();
    else if (arg == "--generate") {
      o.generate = value();
      if (o.generate.empty()) throw std::invalid_argument("--generate needs a prompt (its bytes are the tokens)");
    } else if (arg == "--max-new-tokens") o.max_new_tokens = integer();
    else throw std::invalid_argument("unknown flag " + arg);
  }
  o.model.max_position_embeddings = std::max(o.model.max_position_embeddings, o.seq);
  return o;
}

// The corpus as bytes: a file, or every regular file of a directory (not
// links: /usr/share/common-licenses/GPL is GPL-3 again), in name order.
std::string read_corpus(const std::filesystem::path& where) {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(where)) {
    for (const auto& entry : std::filesystem::directory_iterator(where))
      if (entry.is_regular_file() && !entry.is_symlink()) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(where);
  }
  std::string text;
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  if (text.empty()) throw std::invalid_argument("train_llama: no text in " + where.string());
  return text;
}

// Windows of seq + 1 bytes at a stride of seq: input = the first seq, label = the last seq.
struct Windows : torch::data::datasets::Dataset<Windows> {
  Windows(const std::string& text, int64_t seq) : seq(seq) {
    bytes = torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8)
                .to(torch::kLong);
  }
  torch::data::Example<> get(size_t i) override {
    const at::Tensor w = bytes.narrow(0, static_cast<int64_t>(i) * seq, seq + 1);
    return {w.narrow(0, 0, seq), w.narrow(0, 1, seq)};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>((bytes.size(0) - 1) / seq); }
  at::Tensor bytes;
  int64_t seq;
};

// The optimizer-step count, kept in every checkpoint (it drives the learning-rate schedule).
struct StepCount {
  int64_t value = 0;
  void save(torch::serialize::OutputArchive& out) const { out.write("step", at::scalar_tensor(value, at::kLong)); }
  void load(torch::serialize::InputArchive& in) {
    at::Tensor t;
    in.read("step", t);
    value = t.item<int64_t>();
  }
};

// Linear warmup to lr, then cosine decay to lr / 10 at the last step.
double learning_rate(const Options& o, int64_t step) {
  if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
  const double progress =
      static_cast<double>(step - o.warmup) / static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress))));
}

// Every configuration error before the first step, in words.
void check(const Options& o, int world) {
  const auto& m = o.model;
  auto fail = [](const std::string& why) { throw std::invalid_argument("train_llama: " + why); };
  if (m.hidden_size % m.num_attention_heads != 0)
    fail("--hidden " + std::to_string(m.hidden_size) + " is not a multiple of --heads " +
         std::to_string(m.num_attention_heads));
  if (m.num_attention_heads % m.num_key_value_heads != 0)
    fail("--heads " + std::to_string(m.num_attention_heads) + " is not a multiple of --kv-heads " +
         std::to_string(m.num_key_value_heads));
  if (m.head_dim() % 2 != 0) fail("the head size (--hidden / --heads) must be even for rotary embeddings");
  if (o.tp < 1 || o.cp < 1) fail("--tp and --cp must be at least 1");
  const int heads_split = o.tp * o.cp;  // tp splits the heads, then Ulysses splits tp's share over cp
  if (m.num_attention_heads % heads_split != 0 || m.num_key_value_heads % heads_split != 0)
    fail(
        (o.tp > 1 ? "--tp " + std::to_string(o.tp) + (o.cp > 1 ? " x --cp " : "") : std::string("Ulysses over --cp ")) +
        (o.cp > 1 ? std::to_string(o.cp) : std::string()) + " splits the heads: --heads " +
        std::to_string(m.num_attention_heads) + " and --kv-heads " + std::to_string(m.num_key_value_heads) +
        " must both be multiples of " + std::to_string(heads_split));
  if (o.seq % o.cp != 0)
    fail("--seq " + std::to_string(o.seq) + " is not a multiple of --cp " + std::to_string(o.cp) +
         " (each cp rank holds an equal slice of every sequence)");
  if ((o.seq / o.cp) % o.tp != 0)
    fail("--seq " + std::to_string(o.seq) + " / --cp " + std::to_string(o.cp) + " is not a multiple of --tp " +
         std::to_string(o.tp) + " (sequence parallelism splits each rank's slice over tp)");
  if (o.pp < 1) fail("--pp must be at least 1");
  const int dp = o.dp ? o.dp : world / (o.cp * o.tp * o.pp);
  if (o.batch % dp != 0)
    fail("--batch " + std::to_string(o.batch) + " is not a multiple of the dp size " + std::to_string(dp));
  if (o.pp > 1) {
    if (o.accumulate > 1) fail("--pp with --accumulate is not built yet (more micro-batches per step: --microbatches)");
    const std::vector<std::string> schedules{
        "gpipe", "1f1b", "looped_bfs", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev"};
    if (std::find(schedules.begin(), schedules.end(), o.schedule) == schedules.end())
      fail("--schedule " + o.schedule +
           " (expected gpipe, 1f1b, looped_bfs, interleaved_1f1b, interleaved_zero_bubble, zbv or dualpipev)");
    const int64_t stages = o.pp * (o.schedule == "gpipe" || o.schedule == "1f1b" ? 1 : 2);
    if (m.num_hidden_layers < stages)
      fail("--layers " + std::to_string(m.num_hidden_layers) + " over " + std::to_string(stages) +
           " stages leaves a stage without a layer");
    const int64_t microbatches = o.microbatches ? o.microbatches : o.pp;
    if ((o.batch / dp) % microbatches != 0)
      fail("--batch " + std::to_string(o.batch) + " gives each of the " + std::to_string(dp) + " data-parallel ranks " +
           std::to_string(o.batch / dp) + " sequences, which do not cut into --microbatches " +
           std::to_string(microbatches));
  }
  if (o.steps < 1 || o.warmup < 1 || o.accumulate < 1) fail("--steps, --warmup and --accumulate must be at least 1");
}

// This process's peak resident memory (Linux's VmHWM), MiB; 0 where /proc has none.
double peak_rss_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

void write_logits(const Options& o, llama::Llama& model) {
  // A fixed input: the first seq bytes of a sentence repeated.
  const std::string sentence = "The quick brown fox jumps over the lazy dog. ";
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < o.seq; ++i) ids.push_back(static_cast<unsigned char>(sentence[i % sentence.size()]));
  torch::NoGradGuard no_grad;
  model->eval();
  const at::Tensor logits = model->forward(torch::tensor(ids).view({1, o.seq})).contiguous();
  std::ofstream out(o.logits, std::ios::binary);
  out.write(static_cast<const char*>(logits.data_ptr()), static_cast<std::streamsize>(logits.nbytes()));
  if (!out) throw std::runtime_error("train_llama: cannot write " + o.logits);
  std::printf("train_llama: logits [1, %lld, %lld] in %s\n", static_cast<long long>(o.seq),
              static_cast<long long>(o.model.vocab_size), o.logits.c_str());
}

// Greedy decoding from o.generate's bytes: the continuation as text (bytes outside printable ASCII as \xNN) and
// as token ids.
void write_generated(const Options& o, llama::Llama& model) {
  if (o.max_new_tokens < 1) throw std::invalid_argument("train_llama: --max-new-tokens must be at least 1");
  std::vector<int64_t> prompt;
  for (const char c : o.generate) prompt.push_back(static_cast<unsigned char>(c));
  model->eval();
  const std::vector<int64_t> ids = model->generate(torch::tensor(prompt).view({1, -1}), o.max_new_tokens);
  std::string text, numbers;
  for (const int64_t id : ids) {
    char escaped[8];
    std::snprintf(escaped, sizeof escaped, "\\x%02x", static_cast<unsigned>(id));
    text += (id >= 32 && id < 127 && id != '\\') ? std::string(1, static_cast<char>(id)) : std::string(escaped);
    numbers += (numbers.empty() ? "" : " ") + std::to_string(id);
  }
  std::printf("train_llama: %s|%s\ntrain_llama: generated ids %s\n", o.generate.c_str(), text.c_str(), numbers.c_str());
}

// The progress line, every 10 steps and at the last.
void print_progress(const Options& o, int64_t step, int64_t first, std::chrono::steady_clock::time_point start,
                    double loss, bool tty) {
  if (step % 10 != 0 && step != o.steps) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double per_step = seconds / static_cast<double>(step - first);
  std::printf("%sstep %5lld/%lld  loss %.4f  %.0f tokens/s  ETA %.0f s%s", tty ? "\r" : "",
              static_cast<long long>(step), static_cast<long long>(o.steps), loss,
              static_cast<double>(o.batch * o.seq * o.accumulate) / per_step,
              per_step * static_cast<double>(o.steps - step), tty ? "" : "\n");
}

// The corpus's windows, shuffled, each of the `replicas` data-parallel replicas reading --batch / replicas of them
// per step.
auto prepare_loader(accel::Accelerator& accelerator, const Options& o, int replicas) {
  return accelerator.prepare_data_loader(Windows(read_corpus(o.corpus), o.seq).map(torch::data::transforms::Stack<>()),
                                         {.batch_size = static_cast<size_t>(o.batch / replicas),
                                          .shuffle = true,
                                          .seed = static_cast<uint64_t>(o.seed),
                                          .drop_last = true});
}
// logs/metrics.csv and its run's settings.
void start_logs(accel::Accelerator& accelerator, const Options& o) {
  accelerator.init_trackers("logs", {{"layers", std::to_string(o.model.num_hidden_layers)},
                                     {"hidden", std::to_string(o.model.hidden_size)},
                                     {"seq", std::to_string(o.seq)},
                                     {"batch", std::to_string(o.batch)},
                                     {"lr", std::to_string(o.lr)}});
}

// --save-every and --stop-after, after a step: a checkpoint every N steps, and after --stop-after steps of this
// run one more and the end, as if the run were killed there. Returns whether to stop.
bool checkpoint_after_step(accel::Accelerator& accelerator, const Options& o, int64_t step, int64_t steps_run) {
  if (o.save_every > 0 && step % o.save_every == 0) accelerator.save_state(o.dir + "/checkpoint");
  if (steps_run != o.stop_after) return false;
  accelerator.save_state(o.dir + "/checkpoint");
  accel::print("\ntrain_llama: stopped after", o.stop_after, "steps; resume with --resume");
  accelerator.end_training();
  return true;
}

// The steady rate, from the step after `from` (the first ones warm up) to `to`, and the largest peak RSS over
// the processes (a collective): the final line run_llama_bench.sh reads.
void print_throughput(const Options& o, int64_t from, int64_t to, std::chrono::steady_clock::time_point start) {
  if (to <= from) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double peak = accel::all_reduce(peak_rss_mib(), accel::ReduceOp::MAX);
  accel::print(
      "train_llama:", std::llround(static_cast<double>(o.batch * o.seq * o.accumulate * (to - from)) / seconds),
      "tokens/s over steps", from + 1, "to", to, "- peak RSS", std::llround(peak), "MiB (the largest process)");
}

// --export: model.safetensors (or shards and an index) under HF's names, and config.json.
template <class ModuleHolder>
void export_model(accel::Accelerator& accelerator, ModuleHolder& model, const Options& o) {
  accelerator.save_model(model, o.export_dir);
  if (accelerator.is_main_process())
    std::ofstream(std::filesystem::path(o.export_dir) / "config.json") << o.model.to_json();
  accel::print("train_llama: model in", o.export_dir, "(transformers.LlamaForCausalLM.from_pretrained loads it)");
}

// The schedule named by --schedule over this rank's stages.
std::unique_ptr<accel::pp::PipelineSchedule> make_schedule(const std::string& name,
                                                           std::vector<accel::pp::PipelineStage>& stages, int m,
                                                           accel::pp::LossFn loss) {
  namespace pp = accel::pp;
  std::vector<std::reference_wrapper<pp::PipelineStage>> refs(stages.begin(), stages.end());
  if (name == "gpipe") return std::make_unique<pp::ScheduleGPipe>(stages[0], m, loss);
  if (name == "1f1b") return std::make_unique<pp::Schedule1F1B>(stages[0], m, loss);
  if (name == "looped_bfs") return std::make_unique<pp::ScheduleLoopedBFS>(refs, m, loss);
  if (name == "interleaved_1f1b") return std::make_unique<pp::ScheduleInterleaved1F1B>(refs, m, loss);
  if (name == "interleaved_zero_bubble") return std::make_unique<pp::ScheduleInterleavedZeroBubble>(refs, m, loss);
  if (name == "zbv") return std::make_unique<pp::ScheduleZBVZeroBubble>(refs, m, loss);
  return std::make_unique<pp::ScheduleDualPipeV>(refs, m, loss);
}

// --pp: this rank's stages of the model (llama::Stage; two in a loop or a V for the schedules that take two),
// with --tp split by the plan (the hidden states between stages split along the sequence) and with --cp running
// Ulysses' attention on the cp group (each rank's micro-batches its slice of the sequences), each prepared
// (sharded or replicated over its data-parallel ranks) and given to the schedule, which runs every micro-batch's
// forward and backward and reduces the gradients once per step (sequence parallelism's partial ones summed over
// tp then); clipped over every stage, AdamW stepped. The loss logged: the last stage's micro-batches' mean,
// averaged over the ranks holding the last stage (each data-parallel rank's cp and tp ranks).
int train_pipelined(const Options& o, accel::AcceleratorConfig config, llama::Llama whole) {
  config.distributed.pp_size = o.pp;
  accel::Accelerator accelerator(config);
  const int P = o.pp, r = accelerator.pipeline_parallel_rank();
  const bool two_per_rank = o.schedule != "gpipe" && o.schedule != "1f1b";
  const int S = P * (two_per_rank ? 2 : 1);
  std::vector<int> indices{r};
  if (two_per_rank) indices.push_back(o.schedule == "zbv" || o.schedule == "dualpipev" ? 2 * P - 1 - r : r + P);
  int64_t parameters = 0;
  for (const auto& p : whole->parameters()) parameters += p.numel();
  std::vector<llama::Stage> modules;
  for (const int k : indices) modules.emplace_back(whole, k, S);
  whole = llama::Llama(nullptr);  // (the other ranks' layers go; this rank keeps its stages')
  if (o.tp > 1)  // (each rank keeps its pieces of its stages, the hidden states between them split along the sequence)
    for (auto& stage : modules) {
      accel::tp::parallelize_module(*stage, stage->tp_plan_of(llama::tp_plan()));
      stage->sequence_shards = o.tp;
    }
  if (o.cp > 1)  // (Ulysses inside each stage's attention, on this rank's slice of every sequence)
    for (auto& stage : modules) stage->cp = accel::DistributedInterface::instance().get_group(accel::Dim::CP);
  std::vector<accel::pp::PipelineStage> stages;
  stages.reserve(modules.size());  // (a schedule holds references to its stages: they must not move)
  std::vector<at::Tensor> params;
  int64_t mine = 0;
  for (std::size_t j = 0; j < modules.size(); ++j) {
    llama::Stage& stage = accelerator.prepare_model(modules[j]);
    stages.emplace_back(
        stage.ptr(),
        [stage, &accelerator, recompute = o.recompute](const at::Tensor& x) mutable {
          auto autocast = accelerator.autocast();
          return stage->forward(x, recompute);
        },
        indices[j], S, accelerator.device());
    stages.back().set_data_parallel(*accelerator.data_parallel(stage));
    for (const auto& p : stage->parameters()) params.push_back(p);
  }
  for (const auto& p : params) mine += p.numel();
  // --import: each stage reads its own tensors from the whole model's files (a stage keeps HF's names).
  if (!o.import_dir.empty()) accelerator.load_model(modules.front(), o.import_dir);
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(o.lr).weight_decay(0.1).betas({0.9, 0.95}));
  accel::AcceleratedOptimizer optimizer = accelerator.prepare_optimizer(adamw);
  const int microbatches = o.microbatches ? o.microbatches : P;
  const auto schedule = make_schedule(
      o.schedule, stages, microbatches,
      [V = o.model.vocab_size, tp = o.tp](const at::Tensor& logits, const at::Tensor& labels) {
        // (under tp the logits are this rank's columns of the vocabulary)
        return tp > 1
                   ? accel::tp::vocab_parallel_cross_entropy(logits, labels)
                   : torch::nn::functional::cross_entropy(logits.reshape({-1, V}).to(at::kFloat), labels.reshape({-1}));
      });
  const int dp = accel::DistributedInterface::instance().get_world_size(accel::Dim::DP);
  auto loader = prepare_loader(accelerator, o, dp);  // (cp peers read the same sequences, each its slice)
  const int64_t slice = o.seq / o.cp, cp_rank = accelerator.context_parallel_rank();
  StepCount step;
  accelerator.register_for_checkpointing(step);
  // --resume: every stage's tensors and AdamW's state for them, in whichever pipeline layout saved them.
  if (o.resume) accelerator.load_state(o.dir + "/checkpoint");
  start_logs(accelerator, o);
  accel::print("train_llama:", accelerator.num_processes(), "process(es), pp", P, "x dp", dp, "x cp", o.cp, "x tp",
               o.tp, "-", o.schedule, "over", S, "stages,", microbatches, "micro-batches per step,",
               accel::to_string(accelerator.sharding_strategy()), "per stage -", o.model.num_hidden_layers,
               "layers, hidden", o.model.hidden_size, "-", parameters, "parameters, rank 0's stages", mine, "- seq",
               o.seq);
  const bool first_here = indices[0] == 0, last_here = std::count(indices.begin(), indices.end(), S - 1) == 1;
  const bool tty = isatty(STDOUT_FILENO);
  const auto start = std::chrono::steady_clock::now();
  const int64_t first = step.value, timed_from = o.steps - first > 5 ? first + 5 : first;  // (as train's)
  auto timed_start = start;
  int64_t steps_run = 0;
  double last_loss = 0;
  while (step.value < o.steps) {
    for (auto& batch : loader) {
      for (auto& group : adamw.param_groups()) group.options().set_lr(learning_rate(o, step.value));
      std::vector<at::Tensor> losses;
      schedule->step(first_here ? batch.data.narrow(1, cp_rank * slice, slice) : at::Tensor(),
                     last_here ? batch.target.narrow(1, cp_rank * slice, slice) : at::Tensor(), &losses);
      if (o.clip > 0) accelerator.clip_grad_norm_(params, o.clip);
      optimizer.step();
      optimizer.zero_grad();
      ++step.value;
      const double local = last_here ? at::stack(losses).mean().item<double>() : 0.0;
      // (each cp rank has its slice's, each of its tp ranks the same)
      last_loss = accel::all_reduce(local, accel::ReduceOp::SUM) / (dp * o.cp * o.tp);
      accelerator.log({{"loss", last_loss}, {"lr", learning_rate(o, step.value - 1)}}, step.value);
      if (accelerator.is_main_process()) print_progress(o, step.value, first, start, last_loss, tty);
      if (step.value == timed_from) timed_start = std::chrono::steady_clock::now();
      if (checkpoint_after_step(accelerator, o, step.value, ++steps_run)) return 0;
      if (step.value >= o.steps) break;
    }
  }
  if (accelerator.is_main_process() && tty) std::printf("\n");
  accel::print("train_llama: final loss", last_loss, "after", step.value, "steps; log in",
               accelerator.logging_dir().string() + "/metrics.csv");
  print_throughput(o, timed_from, step.value, timed_start);
  if (!o.export_dir.empty()) export_model(accelerator, modules.front(), o);  // (every stage's tensors: the whole model)
  accelerator.end_training();
  accelerator.wait_for_everyone();
  return 0;
}

int train(Options o) {
  const int world = accel::get_world_size();  // (the launch environment; 1 without a launcher)
  if (!o.import_dir.empty()) {
    std::ifstream in(std::filesystem::path(o.import_dir) / "config.json");
    if (!in) throw std::invalid_argument("train_llama: --import " + o.import_dir + " has no config.json");
    const llama::Config imported = llama::Config::from_json(std::string(std::istreambuf_iterator<char>(in), {}));
    o.model = imported;
    o.model.max_position_embeddings = std::max(imported.max_position_embeddings, o.seq);
  }
  check(o, world);
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  llama::Llama model(o.model);
  if (!o.logits.empty() || !o.generate.empty()) {  // (one process: no Accelerator)
    if (!o.import_dir.empty()) accel::load_model(model, o.import_dir);
    if (!o.logits.empty()) write_logits(o, model);
    if (!o.generate.empty()) write_generated(o, model);
    return 0;
  }

  accel::AcceleratorConfig config;
  config.gradient_accumulation_steps = static_cast<int>(o.accumulate);
  config.mixed_precision = o.mixed_precision;
  config.sharding_strategy = o.sharding;
  config.auto_wrap_policy = [](const std::string& name, const torch::nn::Module&) { return llama::is_unit(name); };
  config.distributed.mp_replicate_size = o.mp_replicate;
  if (o.mp_shard) config.distributed.mp_shard_size = o.mp_shard;  // (unset: world / mp_replicate)
  config.distributed.cp_size = o.cp;
  config.distributed.tp_size = o.tp;
  if (o.dp) config.distributed.dp_size = o.dp;  // (unset: world / cp)
  config.project_config.project_dir = o.dir;
  config.log_with = {"csv", "jsonl"};
  if (o.pp > 1) return train_pipelined(o, config, model);
  accel::Accelerator accelerator(config);  // (a mesh that does not fit the world is its error)
  // Every process reads the whole model (HF's names are this model's names), before tp cuts it and prepare shards it.
  if (!o.import_dir.empty()) accel::load_model(model, o.import_dir);
  const accel::GroupPtr cp =
      o.cp > 1 ? accel::DistributedInterface::instance().get_group(accel::Dim::CP) : accel::GroupPtr();
  const int cp_rank = accelerator.context_parallel_rank();

  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();  // (whole: prepare shards them)
  // Each rank keeps its pieces of the same whole model (the same seed everywhere), before the optimizer sees them.
  if (o.tp > 1) {
    accel::tp::parallelize_module(*model, llama::tp_plan());
    int64_t mine = 0;  // (AdamW's state follows: two tensors of each parameter's shape)
    for (const auto& p : model->parameters()) mine += p.numel();
    accel::print("train_llama: tp", o.tp, "-", mine, "of the", parameters, "parameters on each process");
  }
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(0.1).betas({0.9, 0.95}));
  auto prepared = accelerator.prepare(model, adamw);
  accel::AcceleratedOptimizer& optimizer = std::get<1>(prepared);
  const int dp = accelerator.num_processes() / (o.cp * o.tp);  // (tp peers read the same sequences)
  auto loader = prepare_loader(accelerator, o, dp);
  StepCount step;
  accelerator.register_for_checkpointing(step);
  if (o.resume) accelerator.load_state(o.dir + "/checkpoint");
  start_logs(accelerator, o);

  const accel::DistributedStrategy& mesh = accel::DistributedInterface::instance().strategy();
  accel::print("train_llama:", accelerator.num_processes(), "process(es),",
               accel::to_string(accelerator.sharding_strategy()), "on the model mesh", mesh.mp_replicate_size(), "x",
               mesh.mp_shard_size(), "- data mesh dp", mesh.dp_size(), "x cp", mesh.cp_size(), "- tp", mesh.tp_size(),
               "-", o.model.num_hidden_layers, "layers, hidden", o.model.hidden_size, "-", parameters,
               "parameters - seq", o.seq);
  const bool tty = isatty(STDOUT_FILENO);
  const auto start = std::chrono::steady_clock::now();
  const int64_t first = step.value, slice = o.seq / o.cp;
  // The steady rate, for the final line: timed from the 5th step of this run on (the first ones warm up).
  const int64_t timed_from = o.steps - first > 5 ? first + 5 : first;
  auto timed_start = start;
  int64_t steps_run = 0, micro_steps = 0;
  at::Tensor step_loss = at::zeros({});
  double last_loss = 0;
  // Under tp, the collectives the run's second step issues on the tp group (forward, backward, clipping and the
  // optimizer step; the first step is left out, it may set things up): what tensor parallelism costs per step.
  const accel::GroupPtr tp_group =
      o.tp > 1 ? accel::DistributedInterface::instance().get_group(accel::Dim::TP) : accel::GroupPtr();
  int64_t tp_sequence = -1;
  while (step.value < o.steps) {
    for (auto& batch : loader) {
      auto sync = accelerator.accumulate(model);
      if (tp_group && micro_steps == 0 && step.value == first + 1) tp_sequence = tp_group->getSequenceNumberForGroup();
      // This rank's slice of every sequence (cp), of this dp rank's sequences (the loader).
      const at::Tensor ids = batch.data.narrow(1, cp_rank * slice, slice).to(accelerator.device());
      const at::Tensor labels = batch.target.narrow(1, cp_rank * slice, slice).to(accelerator.device());
      at::Tensor loss;
      {
        auto autocast = accelerator.autocast();
        const at::Tensor logits = model->forward(ids, cp, o.recompute);
        // Under tp the logits are this rank's columns of the vocabulary (the loss computed without gathering them).
        loss = o.tp > 1 ? accel::tp::vocab_parallel_cross_entropy(logits, labels)
                        : torch::nn::functional::cross_entropy(logits.reshape({-1, o.model.vocab_size}).to(at::kFloat),
                                                               labels.reshape({-1}));
      }
      accelerator.backward(loss);
      step_loss += loss.detach();
      ++micro_steps;
      if (!accelerator.sync_gradients()) continue;
      for (auto& group : adamw.param_groups()) group.options().set_lr(learning_rate(o, step.value));
      if (o.clip > 0) accelerator.clip_grad_norm_(model->parameters(), o.clip);
      optimizer.step();
      optimizer.zero_grad();
      if (tp_sequence >= 0 && step.value == first + 1)
        accel::print("train_llama: step", step.value + 1, "issued", tp_group->getSequenceNumberForGroup() - tp_sequence,
                     "collectives on the tp group (forward, backward, clipping, optimizer step)");
      ++step.value;
      // The mean over every token of the step's micro-batches, on every process.
      last_loss = accelerator.reduce(step_loss / micro_steps, "mean").item<double>();
      step_loss = at::zeros({}), micro_steps = 0;
      accelerator.log({{"loss", last_loss}, {"lr", learning_rate(o, step.value - 1)}}, step.value);
      if (accelerator.is_main_process()) print_progress(o, step.value, first, start, last_loss, tty);
      if (step.value == timed_from) timed_start = std::chrono::steady_clock::now();
      if (checkpoint_after_step(accelerator, o, step.value, ++steps_run)) return 0;
      if (step.value >= o.steps) break;
    }
  }
  if (accelerator.is_main_process() && tty) std::printf("\n");
  accel::print("train_llama: final loss", last_loss, "after", step.value, "steps; log in",
               accelerator.logging_dir().string() + "/metrics.csv");
  print_throughput(o, timed_from, step.value, timed_start);
  if (!o.export_dir.empty()) export_model(accelerator, model, o);
  accelerator.end_training();
  accelerator.wait_for_everyone();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options options = parse(argc, argv);
    if (options.spawn > 0)  // this program again as N processes (accel::spawn), each running train()
      return accel::spawn(options.spawn, [&] { return train(options); });
    return train(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
