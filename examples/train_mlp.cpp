// Data-parallel training of an MLP on a synthetic regression task, with
// accel::Accelerator: sharded data loading, bucketed gradient all-reduce that
// overlaps backward, gradient accumulation, a progress line and a checkpoint.
//
// Build:  cmake --build build --target train_mlp accel_launch
// Run 4:  build/examples/train_mlp --spawn 4 --epochs 3   (accel::spawn)
//         build/tests/accel_launch 4 build/examples/train_mlp --epochs 3
//         (or torchrun/mpirun; one process without a launcher also works)
// Flags:  --spawn N  --epochs N (in all, counting a resumed run's earlier ones)
//         --batch N (per process)  --accumulate K
//         --checkpoint DIR (default train_mlp_checkpoint)  --resume
//         --export DIR (the final weights as safetensors, for Python)
//         --sharding shard_grad_op (ZeRO-2: optimizer state and gradients
//         sharded across the processes), full_shard (ZeRO-3: the parameters
//         too, each Linear a unit gathered only while it runs); default
//         no_shard
//         --mixed-precision bf16 (autocast; the CPU or a GPU), fp16 (a GPU:
//         autocast with dynamic loss scaling); default no
//         --stop-after N (save and stop after N batches, as if interrupted;
//         --resume then goes on mid-epoch and ends with the same weights,
//         bit for bit, as an uninterrupted run: the last line's checksum)
//
// Exits non-zero when training did not lower the loss, so that CI can run it.
#define ACCEL_TRAINING
#include "accel.hpp"

#include <chrono>
#include <cstdio>
#include <string>
#include <unistd.h>

namespace {

// y = sin(x . w) + noise, 4096 samples of 16 features, generated from a fixed
// seed: every rank builds the same set and reads its own shard of it.
struct Regression : torch::data::datasets::Dataset<Regression> {
  Regression() {
    auto generator = at::detail::createCPUGenerator(1234);
    x = at::randn({4096, 16}, generator);
    at::Tensor w = at::randn({16, 1}, generator) / 4;
    y = at::sin(x.matmul(w)) + 0.05 * at::randn({4096, 1}, generator);
  }
  torch::data::Example<> get(size_t i) override {
    const auto k = static_cast<int64_t>(i);
    return {x[k], y[k]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  at::Tensor x, y;
};

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : body(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64), torch::nn::ReLU(),
             torch::nn::Linear(64, 1)) {
    register_module("body", body);
  }
  // Each layer through accel::unit_forward: under FULL_SHARD a Linear's
  // parameters exist only while it runs; otherwise a plain call.
  at::Tensor forward(const at::Tensor& x) { return accel::unit_forward(body, x); }
  torch::nn::Sequential body;
};
TORCH_MODULE(Mlp);

struct Options {
  int spawn = 0, epochs = 3, accumulate = 1;
  int64_t stop_after = -1;
  size_t batch = 32;
  std::string checkpoint = "train_mlp_checkpoint", export_dir, mixed_precision = "no";
  bool resume = false;
  accel::ShardingStrategy sharding = accel::ShardingStrategy::NO_SHARD;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--spawn") o.spawn = std::stoi(value());
    else if (arg == "--epochs") o.epochs = std::stoi(value());
    else if (arg == "--batch") o.batch = std::stoul(value());
    else if (arg == "--accumulate") o.accumulate = std::stoi(value());
    else if (arg == "--checkpoint") o.checkpoint = value();
    else if (arg == "--resume") o.resume = true;
    else if (arg == "--export") o.export_dir = value();
    else if (arg == "--stop-after") o.stop_after = std::stoll(value());
    else if (arg == "--mixed-precision") o.mixed_precision = value();
    else if (arg == "--sharding") {
      const std::string v = value();
      if (v == "no_shard") o.sharding = accel::ShardingStrategy::NO_SHARD;
      else if (v == "shard_grad_op") o.sharding = accel::ShardingStrategy::SHARD_GRAD_OP;
      else if (v == "full_shard") o.sharding = accel::ShardingStrategy::FULL_SHARD;
      else throw std::invalid_argument("--sharding " + v + " (expected no_shard, shard_grad_op or full_shard)");
    } else throw std::invalid_argument("unknown flag " + arg);
  }
  return o;
}

// The mean squared error over the whole set, every sample counted once
// (gather_for_metrics drops the shards' repeated samples).
template <class Loader>
double evaluate(accel::Accelerator& accelerator, Mlp& model, Loader& loader) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> errors;
  for (auto& batch : loader) {
    const c10::Device device = accelerator.device();
    at::Tensor error = (model(batch.data.to(device)) - batch.target.to(device)).pow(2).reshape({-1});
    errors.push_back(accelerator.gather_for_metrics(error));
  }
  return at::cat(errors).mean().item<double>();
}

int train(const Options& options) {
  accel::AcceleratorConfig config;
  config.gradient_accumulation_steps = options.accumulate;
  config.sharding_strategy = options.sharding;
  config.mixed_precision = options.mixed_precision;  // (checked: fp16 needs a GPU)
  accel::Accelerator accelerator(config);

  torch::manual_seed(42);
  Mlp model;
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  // The prepared optimizer steps only on the steps that sync (and, sharded,
  // gathers the parameters from the shards it stepped).
  accel::AcceleratedOptimizer optimizer = std::get<1>(accelerator.prepare(model, adam));
  auto stack = torch::data::transforms::Stack<>();
  auto train = accelerator.prepare_data_loader(Regression().map(stack),
                                               {.batch_size = options.batch, .shuffle = true, .seed = 7});
  auto eval = accelerator.prepare_data_loader(Regression().map(stack), {.batch_size = 256});
  // After everything is prepared: the loaders' places in their passes are in the checkpoint too.
  if (options.resume) accelerator.load_state(options.checkpoint);

  const double initial = evaluate(accelerator, model, eval);
  accel::print("train_mlp:", accelerator.num_processes(), "process(es),", to_string(accelerator.distributed_type()),
               "on", accelerator.device().str(), "mixed precision", accelerator.mixed_precision(), "- initial mse",
               initial);
  const bool tty = isatty(STDOUT_FILENO);  // one updating line on a terminal, else a line per report
  int64_t batches_run = 0;
  for (int epoch = static_cast<int>(train.next_epoch()); epoch < options.epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    int64_t samples = 0, step = 0;
    for (auto& batch : train) {
      auto sync = accelerator.accumulate(model);
      // The loaders hand out CPU tensors: on a GPU they go to the model's device.
      const at::Tensor x = batch.data.to(accelerator.device()), y = batch.target.to(accelerator.device());
      at::Tensor loss;
      {
        auto autocast = accelerator.autocast();  // bf16 or fp16 compute where configured; else nothing
        loss = torch::mse_loss(model(x).to(at::kFloat), y);
      }
      accelerator.backward(loss);
      if (accelerator.sync_gradients()) accelerator.clip_grad_norm_(model->parameters(), 1.0);
      optimizer.step();
      optimizer.zero_grad();
      samples += batch.data.size(0);
      if (++step % 20 == 0 || accelerator.end_of_dataloader()) {
        // Global figures: this rank's count times the ranks (even batches).
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (accelerator.is_main_process())
          std::printf("%sepoch %d  step %3lld/%zu  loss %.4f  %.0f samples/s%s", tty ? "\r" : "", epoch,
                      static_cast<long long>(step), train.batches(), loss.item<double>(),
                      static_cast<double>(samples * accelerator.num_processes()) / seconds, tty ? "" : "\n");
      }
      if (++batches_run == options.stop_after) {  // as if the run were killed here, after a checkpoint
        accelerator.save_state(options.checkpoint);
        accel::print("train_mlp: stopped after", options.stop_after, "batches; checkpoint in", options.checkpoint);
        accelerator.wait_for_everyone();
        accel::DistributedInterface::instance().destroy();
        return 0;
      }
    }
    if (accelerator.is_main_process() && tty) std::printf("\n");
  }
  const double final_mse = evaluate(accelerator, model, eval);
  accelerator.save_state(options.checkpoint);
  accel::print("train_mlp: final mse", final_mse, "- checkpoint in", options.checkpoint);
  if (!options.export_dir.empty()) {  // model.safetensors: Python's load_state_dict takes it as it is
    accelerator.save_model(model, options.export_dir);
    accel::print("train_mlp: weights in", options.export_dir + "/model.safetensors");
  }
  // FNV-1a over the weights' bytes: equal checksums, bit-identical weights
  // (under FULL_SHARD, gathered for the while).
  const auto whole = accelerator.data_parallel(model)->summon_full_params();
  uint64_t checksum = 14695981039346656037ull;
  for (const auto& p : model->parameters()) {
    const at::Tensor bytes = p.detach().cpu().contiguous();
    const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
    for (size_t i = 0; i < bytes.nbytes(); ++i) checksum = (checksum ^ data[i]) * 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum));
  accel::print("train_mlp: weights checksum", hex);
  accelerator.wait_for_everyone();
  accel::DistributedInterface::instance().destroy();
  return final_mse < initial ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const Options options = parse(argc, argv);
  // --spawn N: this program starts N ranks of itself, which run train().
  if (options.spawn > 0) return accel::spawn(options.spawn, [&] { return train(options); });
  return train(options);
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_mlp: %s\n", e.what());
  return 2;
}
