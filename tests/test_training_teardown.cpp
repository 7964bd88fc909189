// Training tests, the way out: an Accelerator destroyed after a peer died or threw, after a failed gather,
// with a prefetch in flight, after an evaluation forward, under every strategy; the process goes on (its catch
// block runs) and exits with its own status, and the error it caught is the collective's own.
// One of the training translation units (ACCEL_TRAINING, set by CMake for them, with
// training_fixtures.hpp precompiled); the suites keep their names across files.

#include "training_fixtures.hpp"

#include <csignal>
#include <sys/wait.h>

namespace {
// What each process of a teardown world does. The world is started by accel::spawn; every rank forks once
// at the start and the child is the rank that trains (the parent only waits for it), so that a child killed
// by a signal, or exiting with a status of its own, is seen and judged here instead of ending the launch at
// once (the launcher stops every rank when one fails, and a survivor must be left the time to tear down).
//
// The victim (the last rank) faults at step 2 of a training loop over a tied GPT-2-shaped decoder:
//   kill              SIGKILL itself after the forward (mid-step, collectives of the others in flight);
//   throw_accumulate  throw a std::runtime_error of the user's inside accelerator.accumulate(model)'s scope;
//   throw_no_sync     the same inside accelerator.no_sync(model)'s scope (so the survivors are in a synced
//                     backward of the next step when the victim is gone);
//   eval              nobody faults: an evaluation forward calling the model twice and its first unit a
//                     third time (the unit after it prefetched), then the Accelerator goes;
//   save_rank0        nobody faults, but only rank 0 calls save_model (the others wait_for_everyone()).
// Each process's Accelerator lives inside its try block. Statuses of the training child:
//   10  caught accel::DistributedError naming a failed collective (op and group), and nothing else;
//   20  caught the user's own std::runtime_error (the victim of throw_*);
//   0   finished (eval);
//   anything else: what went wrong (11: a DistributedError without the collective's name, or one that
//   blames the parameters being at rest; 12: another exception; a signal: a crash).
// The parent exits 0 when its child's end is the expected one, else 1, and prints both.
struct TeardownCase {
  std::string strategy, scenario;
};
TeardownCase teardown_case() {
  return {accel::detail::getenv_str("ACCEL_TEST_TEARDOWN_STRATEGY").value_or(""),
          accel::detail::getenv_str("ACCEL_TEST_TEARDOWN_SCENARIO").value_or("")};
}

int train_until_the_fault(const TeardownCase& t) {
  const int rank = accel::get_rank(), P = accel::get_world_size();
  const bool victim = rank == P - 1;
  try {
    accel::AcceleratorConfig c;
    c.gradient_accumulation_steps = 2;
    c.distributed.timeout = std::chrono::seconds(t.scenario == "save_rank0" ? 3 : 30);
    const bool bf16 = t.strategy == "full_shard_bf16";
    c.sharding_strategy = accel::from_string<accel::ShardingStrategy>(bf16 ? "FULL_SHARD" : t.strategy);
    if (t.strategy == "HYBRID_SHARD") c.distributed.mp_replicate_size = 2;
    if (bf16) {  // (the tied weight at the root, in fp32: the units hand it fp32 activations)
      c.mixed_precision_policy = {.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat, .output_dtype = at::kFloat};
      c.auto_wrap_policy = gpt_blocks;
    }
    accel::Accelerator accelerator(c);
    torch::manual_seed(3);
    Gpt model(GptOptions{.tied = true});
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    auto prepared = accelerator.prepare(model, sgd);
    auto generator = at::detail::createCPUGenerator(9);
    for (int step = 0; step < 4; ++step) {
      const at::Tensor tokens = at::randint(64, {2 * P, 8}, generator).narrow(0, 2 * rank, 2);
      auto loss_of = [&] {
        const at::Tensor logits = model(tokens);
        return next_token_loss(logits, tokens);
      };
      if (t.scenario == "throw_no_sync" && step == 1) {
        auto guard = accelerator.no_sync(model);
        const at::Tensor loss = loss_of();
        if (victim) throw std::runtime_error("the user's own error, inside no_sync");
        accelerator.backward(loss);
        continue;
      }
      auto guard = accelerator.accumulate(model);
      const at::Tensor loss = loss_of();
      if (victim && step == 2) {
        if (t.scenario == "kill") raise(SIGKILL);
        if (t.scenario == "throw_accumulate") throw std::runtime_error("the user's own error, inside accumulate");
      }
      accelerator.backward(loss);
      std::get<1>(prepared).step();
      std::get<1>(prepared).zero_grad();
    }
    if (t.scenario == "eval") {
      torch::NoGradGuard no_grad;
      const at::Tensor tokens = at::randint(64, {2, 8}, generator);
      model(tokens);
      model(tokens);  // every unit a second time, and the first unit once more: the unit after it is
      if (bf16) accel::unit_forward(model->blocks[0], model->wte(tokens));
      else accel::unit_forward(model->wpe, at::arange(8));
      return 0;  // prefetched and still in flight as the Accelerator goes
    }
    if (t.scenario == "save_rank0") {
      const auto dir = std::filesystem::temp_directory_path() / ("accel_teardown_" + std::to_string(getpid()));
      if (rank == 0) accelerator.save_model(model, dir.string());
      else accelerator.wait_for_everyone();
      return 0;
    }
    std::cout << "rank " << rank << ": no fault reached" << std::endl;
    return 13;
  } catch (const accel::DistributedError& e) {
    const std::string what = e.what();
    std::cout << "rank " << rank << " caught accel::DistributedError: " << what << std::endl;
    const bool named = what.find("failed on group") != std::string::npos;
    return named && what.find("sharded at rest") == std::string::npos ? 10 : 11;
  } catch (const std::runtime_error& e) {
    std::cout << "rank " << rank << " caught " << e.what() << std::endl;
    return std::string(e.what()).starts_with("the user's own error") ? 20 : 12;
  } catch (const std::exception& e) {
    std::cout << "rank " << rank << " caught another exception: " << e.what() << std::endl;
    return 12;
  }
}

// How the training child of this rank is expected to end: exit status, or (negative) the signal.
int expected_end(const TeardownCase& t) {
  const bool victim = accel::get_rank() == accel::get_world_size() - 1;
  if (t.scenario == "eval") return 0;
  if (t.scenario == "save_rank0") return 10;  // every rank: the collective (rank 0's gather, the others' barrier)
  if (t.scenario == "kill") return victim ? -SIGKILL : 10;
  return victim ? 20 : 10;
}

int teardown_rank() {
  const TeardownCase t = teardown_case();
  std::cout.flush();
  const pid_t child = fork();
  if (child < 0) return 2;
  if (child == 0) {
    const int code = train_until_the_fault(t);
    std::cout.flush();
    std::_Exit(code);  // (as a process ends after main returns, without the parent's atexit work twice)
  }
  int status = 0;
  if (waitpid(child, &status, 0) != child) return 3;
  const int ended = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  const int expected = expected_end(t);
  std::cout << "rank " << accel::get_rank() << ": the training process ended with "
            << (ended < 0 ? "signal " + std::to_string(-ended) : "status " + std::to_string(ended)) << ", expected "
            << (expected < 0 ? "signal " + std::to_string(-expected) : "status " + std::to_string(expected))
            << std::endl;
  return ended == expected ? 0 : 1;
}
}  // namespace

// Every strategy (FULL_SHARD also under a bf16 MixedPrecisionPolicy; HYBRID_SHARD on a 2 x 2 mesh, at 4
// processes) with every fault, each in a world of its own (accel::spawn; 2 processes, 4 for HYBRID_SHARD).
// On main before this suite, FULL_SHARD's survivors died with SIGSEGV (or std::terminate: "sharded at rest"
// thrown inside a destructor) while their Accelerator was destroyed.
TEST_SUITE("teardown") {
  TEST_CASE("teardown: a peer killed or throwing, an evaluation forward, save_model on one rank: no crash") {
    struct World {
      std::string strategy;
      int processes;
      std::vector<std::string> scenarios;
    };
    const std::vector<std::string> faults{"kill", "throw_accumulate", "throw_no_sync"};
    std::vector<std::string> all = faults;
    all.insert(all.end(), {"eval", "save_rank0"});
    const std::vector<World> worlds{{"NO_SHARD", 2, faults},
                                    {"SHARD_GRAD_OP", 2, faults},
                                    {"FULL_SHARD", 2, all},
                                    {"full_shard_bf16", 2, all},
                                    {"HYBRID_SHARD", 4, {"kill", "throw_accumulate", "eval"}}};
    for (const World& world : worlds)
      for (const std::string& scenario : world.scenarios) {
        CAPTURE(world.strategy);
        CAPTURE(scenario);
        std::optional<EnvGuard> env;
        if (!std::getenv("ACCEL_SPAWNED_RANK"))  // (the ranks run the first spawn they reach, with these)
          env.emplace(std::initializer_list<std::pair<const char*, const char*>>{
              {"ACCEL_TEST_TEARDOWN_STRATEGY", world.strategy.c_str()},
              {"ACCEL_TEST_TEARDOWN_SCENARIO", scenario.c_str()}});
        std::ostringstream out;
        accel::LaunchOptions options;
        options.out = &out;
        options.timeout = std::chrono::seconds(120);
        const auto start = std::chrono::steady_clock::now();
        const int status = accel::spawn(world.processes, teardown_rank, options);
        INFO(out.str());
        MESSAGE(world.strategy << ", " << scenario << ": " << seconds_since(start) << " s");
        CHECK(status == 0);
      }
  }
}
