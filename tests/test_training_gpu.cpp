// Training tests, on a GPU and for one: the loss scaler of fp16 (everywhere, on
// the CPU where LibTorch has its kernels there), and the Accelerator,
// DataParallel and sharding on CUDA, checked against the same training on the
// CPU. The cases named "gpu: ..." print why they stop where no CUDA device
// is visible (CTest: cuda_gpu and cuda_gpu_ranks_2, skipped); the device
// machine runs them (tests/gpu/run_gpu.sh).
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

#if ACCEL_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>  // CUDA's sync debug mode
#endif

namespace {
// Parameters whose gradients are `grads` (each parameter zero, of its
// gradient's shape), and SGD with learning rate 1 over them: a step
// subtracts the gradient as it is then.
struct WithGrads {
  explicit WithGrads(const std::vector<at::Tensor>& grads) {
    for (const auto& g : grads) {
      at::Tensor p = at::zeros(g.sizes(), g.options()).requires_grad_();
      p.mutable_grad() = g;
      params.push_back(p);
    }
    sgd = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(1.0));
  }
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::SGD> sgd;
};

double max_difference(torch::nn::Module& a, torch::nn::Module& b) {
  return (flat_parameters(a).cpu() - flat_parameters(b).cpu()).abs().max().item<double>();
}
}  // namespace

TEST_SUITE("single") {
  TEST_CASE("GradScaler: torch.amp.GradScaler's unscaling, skipped steps and scale updates (PyTorch's test values)") {
#if ACCEL_TORCH_AT_LEAST(2, 4)
    // PyTorch's test_grad_scaling_unscale: gradients of 4 unscaled by a scale of 4 (inverse 0.25) are 1, in
    // contiguous, transposed and narrowed layouts; one inf or NaN anywhere is found (and the step skipped).
    const at::Tensor g = at::full({10, 10}, 4.0);
    at::Tensor ginf = g.clone(), gnan = g.clone();
    ginf[2][2] = std::numeric_limits<float>::infinity();
    gnan[2][2] = std::numeric_limits<float>::quiet_NaN();
    using Slice = at::indexing::Slice;
    auto narrow = [](const at::Tensor& t) { return t.index({Slice(), Slice(0, 5)}); };
    const std::vector<std::pair<std::vector<at::Tensor>, bool>> cases{
        {{g.clone(), g.clone()}, false},           {{g.clone(), g.clone().t()}, false},
        {{g.clone(), narrow(g.clone())}, false},   {{narrow(g.clone()), narrow(g.clone())}, false},
        {{g.clone(), ginf.clone()}, true},         {{g.clone(), gnan.clone()}, true},
        {{g.clone(), narrow(ginf.clone())}, true}, {{g.clone(), narrow(gnan.clone())}, true},
        {{ginf.clone(), narrow(g.clone())}, true}, {{narrow(ginf.clone()), narrow(g.clone())}, true}};
    for (std::size_t i = 0; i < cases.size(); ++i) {
      CAPTURE(i);
      accel::GradScaler scaler({.init_scale = 4.0});
      WithGrads w(cases[i].first);
      const bool stepped = scaler.step(*w.sgd);
      CHECK(stepped == !cases[i].second);
      for (const auto& p : w.params) {
        if (stepped) {
          CHECK(at::allclose(p.grad(), at::ones_like(p.grad()), 1e-5, 1e-7));
          CHECK(at::equal(p.detach(), at::full_like(p, -1.0)));  // the unscaled gradient, stepped
        } else {
          CHECK(at::equal(p.detach(), at::zeros_like(p)));  // skipped: untouched
        }
      }
    }
    // PyTorch's test_grad_scaling_update_scale: growth 2, backoff 0.25, growth interval 2, scale 4. Two
    // good steps in a row grow the scale (4, then 8); a step with an inf backs it off (2) and restarts the count.
    accel::GradScaler scaler({.init_scale = 4.0, .growth_factor = 2.0, .backoff_factor = 0.25, .growth_interval = 2});
    auto iteration = [&](const at::Tensor& grad) {
      WithGrads w({grad.clone()});
      const bool stepped = scaler.step(*w.sgd);
      scaler.update();
      return stepped;
    };
    CHECK(iteration(g));
    CHECK(scaler.growth_tracker() == 1);
    CHECK(scaler.get_scale() == 4.0);
    CHECK(iteration(g));
    CHECK(scaler.growth_tracker() == 0);
    CHECK(scaler.get_scale() == 8.0);
    CHECK_FALSE(iteration(ginf));
    CHECK(scaler.growth_tracker() == 0);
    CHECK(scaler.get_scale() == 2.0);
    // The loss is multiplied by the scale; unscale_ once per update (as Python: twice is an error), and a
    // step after it does not unscale again.
    CHECK(scaler.scale(at::scalar_tensor(1.5)).item<double>() == 3.0);
    CHECK(scaler.scale(at::scalar_tensor(1.5)).dim() == 0);
    WithGrads w({g.clone()});
    scaler.unscale_(*w.sgd);
    CHECK(at::equal(w.params[0].grad(), at::full_like(g, 2.0)));
    CHECK_THROWS_WITH_AS(scaler.unscale_(*w.sgd), doctest::Contains("already called on this optimizer"),
                         accel::LogicError);
    CHECK(scaler.step(*w.sgd));
    CHECK(at::equal(w.params[0].detach(), at::full_like(g, -2.0)));
    scaler.update();
    CHECK(scaler.get_scale() == 2.0);  // a good step after the back-off: counted (it grows at the second)
    CHECK(scaler.growth_tracker() == 1);
    // Refused: fp16 gradients (keep fp32 parameters under autocast, as Python says), settings outside the rules.
    WithGrads half({g.to(at::kHalf)});
    CHECK_THROWS_WITH_AS(scaler.unscale_(*half.sgd), doctest::Contains("a gradient is fp16"), accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(accel::GradScaler({.backoff_factor = 1.5}), doctest::Contains("0 < backoff_factor < 1"),
                         accel::InvalidArgument);
#else
    CHECK_THROWS_WITH_AS(accel::GradScaler(), doctest::Contains("on the CPU it needs LibTorch 2.4"),
                         accel::InvalidArgument);
#endif
    // Disabled, it is the identity: the loss as it is, every step taken, a scale of 1.
    accel::GradScaler off({.enabled = false});
    WithGrads plain({at::full({3}, 4.0)});
    const at::Tensor loss = at::scalar_tensor(2.5);
    CHECK(off.scale(loss).is_same(loss));
    CHECK(off.step(*plain.sgd));
    CHECK(at::equal(plain.params[0].detach(), at::full({3}, -4.0)));
    CHECK(off.get_scale() == 1.0);
  }
}

TEST_SUITE("cuda") {
  TEST_CASE(
      "gpu: DataParallel's backward and finish() on CUDA make the host wait for nothing (CUDA's sync debug mode "
      "set to error)") {
#if ACCEL_WITH_NCCL
    if (!gpu_or_skip("DataParallel on CUDA needs a GPU")) return;
    EnvGuard env{{"ACCEL_BACKEND", "nccl"}, {"ACCEL_DEVICE", "cuda"}};
    WorldOfOne one;
    auto& d = accel::DistributedInterface::instance(test_config());
    const c10::Device device = d.current_device();
    torch::manual_seed(6);
    Mlp model(8, 512, 3);  // 2 MiB of parameters
    Mlp reference = copy_of(model, 8, 512, 3);
    model->to(device);
    reference->to(device);
    // The first bucket 1 MiB (as DDP), then 4 KiB ones: several all-reduces in flight during the backward.
    accel::DataParallel dp(model.ptr(), d.world_group(), 4096);
    auto generator = at::detail::createCPUGenerator(8);
    const at::Tensor x = at::randn({16, 8}, generator).to(device), y = at::randn({16, 1}, generator).to(device);
    auto& warnings = c10::cuda::warning_state();
    struct Disabled {  // (the mode is process-wide: set back whatever a check throws)
      ~Disabled() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
    } disabled;
    // The mode catches a wait: reading a value back makes the host wait for the device.
    warnings.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    CHECK_THROWS(x.sum().item<float>());
    warnings.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      model->zero_grad();
      dp.prepare_for_backward();
      warnings.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
      // Each bucket's used-flags written, its all-reduce issued on NCCL's stream and waited for by the
      // current stream, the averages written back: all queued, none waited for by the host.
      CHECK_NOTHROW(torch::mse_loss(model(x), y).backward());
      CHECK_NOTHROW(dp.finish());
      warnings.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      reference->zero_grad();
      torch::mse_loss(reference(x), y).backward();
      const auto mine = model->parameters(), theirs = reference->parameters();
      for (std::size_t i = 0; i < mine.size(); ++i) {
        REQUIRE(mine[i].grad().defined());
        CHECK(at::allclose(mine[i].grad(), theirs[i].grad(), 1e-6, 1e-7));  // averaged over a world of one
      }
    }
#else
    std::printf("SKIPPED (no NCCL in this build): a CPU LibTorch, or no <nccl.h>\n");
#endif
  }

  TEST_CASE(
      "gpu: the Accelerator on CUDA over NCCL (a world of one) trains as the CPU does: fp32, bf16 autocast, fp16") {
#if ACCEL_WITH_NCCL
    if (!gpu_or_skip("the Accelerator on CUDA needs a GPU")) return;
    EnvGuard env{{"ACCEL_BACKEND", "nccl"}, {"ACCEL_DEVICE", "cuda"}};
    WorldOfOne one;
    for (const std::string precision : {"no", "bf16", "fp16"}) {
      CAPTURE(precision);
      accel::AcceleratorConfig c = config();
      c.mixed_precision = precision;
      accel::Accelerator accelerator(c);
      REQUIRE(accelerator.device().is_cuda());
      CHECK(accelerator.distributed_type() == accel::DistributedType::NO);  // (one process)
      CHECK((accelerator.scaler() != nullptr) == (precision == "fp16"));
      torch::manual_seed(3);
      Mlp model(8, 32, 2);
      Mlp reference = copy_of(model, 8, 32, 2);  // on the CPU, in fp32, with no Accelerator
      accelerator.prepare(model);
      CHECK(model->parameters()[0].is_cuda());
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      accel::AcceleratedOptimizer optimizer = accelerator.prepare(sgd);
      // One batch, 20 steps: the loss must fall (random batches each step would not).
      auto generator = at::detail::createCPUGenerator(17);
      const at::Tensor x = at::randn({16, 8}, generator), y = at::randn({16, 1}, generator);
      int skipped = 0;
      double first_loss = 0, last_loss = 0;
      for (int step = 0; step < 20; ++step) {
        at::Tensor out;
        {
          auto autocast = accelerator.autocast();
          out = model(x.to(accelerator.device()));
        }
        const at::ScalarType expected = precision == "bf16"   ? at::kBFloat16
                                        : precision == "fp16" ? at::kHalf
                                                              : at::kFloat;
        CHECK(std::string(c10::toString(out.scalar_type())) == c10::toString(expected));
        const at::Tensor loss = torch::mse_loss(out.to(at::kFloat), y.to(accelerator.device()));
        accelerator.backward(loss);
        const double norm = accelerator.clip_grad_norm_(model->parameters(), 1.0);
        if (precision != "fp16") CHECK(std::isfinite(norm));  // (fp16's may be inf: then the step is skipped)
        optimizer.step();
        optimizer.zero_grad();
        // The reference takes the same steps (fp16's skipped ones skipped too).
        const bool took = !optimizer.step_was_skipped();
        skipped += !took;
        reference_sgd.zero_grad();
        torch::mse_loss(reference(x), y).backward();
        torch::nn::utils::clip_grad_norm_(reference->parameters(), 1.0);
        if (took) reference_sgd.step();
        (step == 0 ? first_loss : last_loss) = loss.item<double>();
      }
      const double difference = max_difference(*model, *reference);
      MESSAGE(precision << ": largest difference from the CPU's fp32 weights " << difference << ", loss " << first_loss
                        << " -> " << last_loss << ", skipped steps " << skipped);
      CHECK(last_loss < first_loss);
      if (precision == "no") CHECK(difference < 1e-5);
      else CHECK(difference < (precision == "bf16" ? 5e-2 : 1e-2));
      if (precision == "fp16") {
        // Each skipped step halved the scale, and 20 good steps are far from the 2000 that grow it.
        CHECK(accelerator.scaler()->get_scale() == std::ldexp(65536.0, -skipped));
      } else {
        CHECK(skipped == 0);
      }
    }
#else
    std::printf("SKIPPED (no NCCL in this build): a CPU LibTorch, or no <nccl.h>\n");
#endif
  }

  TEST_CASE(
      "gpu: fp16's loss scaler skips a step with an inf gradient and backs off; checkpoints keep its scale and "
      "the CUDA RNG") {
#if ACCEL_WITH_NCCL
    if (!gpu_or_skip("fp16 needs a GPU")) return;
    EnvGuard env{{"ACCEL_BACKEND", "nccl"}, {"ACCEL_DEVICE", "cuda"}};
    WorldOfOne one;
    accel::AcceleratorConfig c = config();
    c.mixed_precision = "fp16";
    c.grad_scaler = {.init_scale = 1024.0, .growth_interval = 2};
    accel::Accelerator accelerator(c);
    torch::manual_seed(4);
    Mlp model(6, 16, 1);
    Mlp reference = copy_of(model, 6, 16, 1);
    accelerator.prepare(model);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    accel::AcceleratedOptimizer optimizer = accelerator.prepare(sgd);
    auto generator = at::detail::createCPUGenerator(5);
    const at::Tensor x = at::randn({8, 6}, generator), y = at::randn({8, 1}, generator);
    auto loss_of = [&] { return torch::mse_loss(model(x.to(accelerator.device())), y.to(accelerator.device())); };
    // fp32 compute (no autocast): the scaled gradients, unscaled by clip_grad_norm_, are the plain ones (the
    // scale is a power of two), so the norm is the CPU's.
    for (int step = 0; step < 2; ++step) {
      accelerator.backward(loss_of());
      const double norm = accelerator.clip_grad_norm_(model->parameters(), 1e9);
      reference->zero_grad();
      torch::mse_loss(reference(x), y).backward();
      const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), 1e9);
      CHECK(norm == doctest::Approx(expected).epsilon(1e-5));
      optimizer.step();
      optimizer.zero_grad();
      CHECK_FALSE(optimizer.step_was_skipped());
      torch::optim::SGD(reference->parameters(), torch::optim::SGDOptions(0.1)).step();
    }
    CHECK(max_difference(*model, *reference) < 1e-6);
    CHECK(accelerator.scaler()->get_scale() == 2048.0);  // grown after growth_interval (2) good steps
    // A checkpoint: the scale and the CUDA generator's state go in.
    const auto dir = std::filesystem::temp_directory_path() / ("accel_gpu_checkpoint_" + std::to_string(getpid()));
    accelerator.save_state(dir);
    CHECK(std::filesystem::exists(dir / "scaler.pt"));
    const at::Tensor drawn = at::randn({4}, at::TensorOptions().device(accelerator.device()));
    // A step with an inf gradient: skipped (the weights stay), the scale backs off.
    const at::Tensor before = flat_parameters(*model).clone();
    accelerator.backward(loss_of() * std::numeric_limits<float>::infinity());
    optimizer.step();
    optimizer.zero_grad();
    CHECK(optimizer.step_was_skipped());
    CHECK(at::equal(flat_parameters(*model), before));
    CHECK(accelerator.scaler()->get_scale() == 1024.0);
    // Loaded: the scale and the CUDA RNG of the save.
    accelerator.load_state(dir);
    CHECK(accelerator.scaler()->get_scale() == 2048.0);
    CHECK(at::equal(at::randn({4}, at::TensorOptions().device(accelerator.device())), drawn));
    std::filesystem::remove_all(dir);
#else
    std::printf("SKIPPED (no NCCL in this build): a CPU LibTorch, or no <nccl.h>\n");
#endif
  }
}

// Several processes on one GPU: Gloo with CUDA tensors (NCCL refuses two
// ranks on one device). Every process binds device 0.
TEST_SUITE("cuda_ranks") {
  TEST_CASE(
      "gpu: NO_SHARD, SHARD_GRAD_OP and FULL_SHARD on CUDA tensors (Gloo, one GPU shared) train as one CPU "
      "process") {
    if (!gpu_or_skip("DataParallel and sharding on CUDA need a GPU")) return;
    EnvGuard env{{"LOCAL_RANK", "0"}, {"ACCEL_BACKEND", "gloo"}, {"ACCEL_DEVICE", "cuda"}};
    release_world();  // (made anew with the device above)
    for (const auto strategy : {accel::ShardingStrategy::NO_SHARD, accel::ShardingStrategy::SHARD_GRAD_OP,
                                accel::ShardingStrategy::FULL_SHARD}) {
      CAPTURE(strategy);
      accel::AcceleratorConfig c = config();
      c.sharding_strategy = strategy;
      c.bucket_cap_mb = 1;
      accel::Accelerator accelerator(c);
      REQUIRE(accelerator.device().is_cuda());
      const int P = accelerator.num_processes(), r = accelerator.process_index();
      CHECK(accelerator.sharding_strategy() == (P > 1 ? strategy : accel::ShardingStrategy::NO_SHARD));
      torch::manual_seed(5);
      Mlp model(5, 33, 2);  // 33: sizes that 2 does not divide (padded shards)
      Mlp local = copy_of(model, 5, 33, 2);
      accelerator.prepare(model);
      torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
      torch::optim::Adam local_adam(local->parameters(), torch::optim::AdamOptions(1e-2));
      accel::AcceleratedOptimizer optimizer = accelerator.prepare(adam);
      auto generator = at::detail::createCPUGenerator(11);
      for (int step = 0; step < 4; ++step) {
        const at::Tensor x = at::randn({2 * P, 5}, generator), y = at::randn({2 * P, 1}, generator);
        const at::Tensor mine_x = x.narrow(0, 2 * r, 2).to(accelerator.device());
        accelerator.backward(torch::mse_loss(model(mine_x), y.narrow(0, 2 * r, 2).to(accelerator.device())));
        optimizer.step();
        optimizer.zero_grad();
        local_adam.zero_grad();
        torch::mse_loss(local(x), y).backward();
        local_adam.step();
      }
      const auto whole = accelerator.data_parallel(model)->summon_full_params();
      CHECK(model->parameters()[0].is_cuda());
      const double difference = max_difference(*model, *local);
      MESSAGE(to_string(strategy) << " at " << P << " processes on CUDA: largest difference from one CPU process "
                                  << difference);
      CHECK(difference < 1e-5);
    }
    release_world();
  }
}
