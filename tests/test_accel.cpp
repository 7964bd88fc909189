// The accel.hpp test suite: one binary (this file, test_launch.cpp,
// test_ops.cpp, test_training_*.cpp), real c10d Gloo groups.
//
// Test suites, selected with doctest's -ts option by CTest:
//   single        one process, no RANK: parsing, validation, identity collectives
//   ranks         any world size (CTest runs it at 1, 2, 3 and 4 ranks)
//   mesh4         exactly 4 ranks: every mesh dimension under three strategies,
//                 and Accelerate's 4-d layouts with their flattened dimensions
//                 (also across two network namespaces: tests/netns)
//   exit          leaves with a live interface: static destruction must be clean
//   peer_gone     a rank vanishes mid-program (2 and 4 ranks)
//   failures      rendezvous failures in one process, short timeouts
//   mismatch      two ranks believe in different world sizes
//   peer_timeout  time-to-error for a dead peer under ACCEL_TIMEOUT=5
//   spawn         accel::spawn (the binary starts itself; one case per run)
//   mpirun        ranks started by Open MPI's mpirun
//   torchrun      ranks started by real torchrun (tests/python_ref): its
//                 environment and agent store, and every mesh dimension's
//                 group (the seed's meshes, Accelerate's 4-d layouts,
//                 flattened and sliced) against Python's init_device_mesh
// Multi-rank entries run under tests/launch.cpp, which gives every rank
// torchrun's environment, stops all ranks when one fails, and has a hard
// timeout. Every rank runs the same test cases in the same order.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "test_helpers.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>

#include <regex>

// == Every public template, explicitly instantiated for every TensorLike ====

// A function object for operate_tensorlike. Not in an anonymous namespace:
// instantiations over an internal-linkage type may be dropped unemitted,
// which would hide the link errors they are here to catch.
struct Twice {
  at::Tensor operator()(at::Tensor& t) const { return t * 2; }
};

#define ACCEL_INSTANTIATE(T)                                                                      \
  template T accel::all_reduce<T>(T, accel::ReduceOp, const accel::GroupPtr&);                    \
  template T accel::broadcast<T>(T, int, const accel::GroupPtr&);                                 \
  template auto accel::all_gather<T>(const T&, const accel::GroupPtr&);                           \
  template T accel::operate_tensorlike<T, Twice>(Twice&&, T);                                     \
  template auto accel::DistributedInterface::all_gather<T>(const T&, std::optional<Dim>);         \
  template T accel::DistributedInterface::all_reduce<T>(T, ReduceOp, std::optional<Dim>);         \
  template T accel::DistributedInterface::broadcast<T>(T, int, std::optional<Dim>);               \
  template accel::Work<T> accel::all_reduce_async<T>(T, accel::ReduceOp, const accel::GroupPtr&); \
  template accel::Work<T> accel::broadcast_async<T>(T, int, const accel::GroupPtr&);              \
  template auto accel::all_gather_async<T>(const T&, const accel::GroupPtr&);
// The second wave: every TensorLike; the splitting ones for tensors and vectors.
#define ACCEL_INSTANTIATE_WAVE2(T)                                                        \
  template T accel::reduce_to<T>(T, int, accel::ReduceOp, const accel::GroupPtr&);        \
  template auto accel::gather_to<T>(const T&, int, const accel::GroupPtr&);               \
  template T accel::scatter<T>(const std::vector<T>&, int, const accel::GroupPtr&);       \
  template void accel::send<T>(const T&, int, const accel::GroupPtr&, int);               \
  template T accel::recv<T>(T, int, const accel::GroupPtr&, int);                         \
  template accel::Work<void> accel::isend<T>(const T&, int, const accel::GroupPtr&, int); \
  template accel::Work<T> accel::irecv<T>(T, int, const accel::GroupPtr&, int);
#define ACCEL_INSTANTIATE_SPLIT(T)                                                                           \
  template T accel::reduce_scatter<T>(const T&, accel::ReduceOp, const accel::GroupPtr&);                    \
  template T accel::all_to_all<T>(const T&, const accel::GroupPtr&);                                         \
  template accel::Work<T> accel::reduce_scatter_async<T>(const T&, accel::ReduceOp, const accel::GroupPtr&); \
  template accel::Work<T> accel::all_to_all_async<T>(const T&, const accel::GroupPtr&);
#define ACCEL_INSTANTIATE_SCALAR(T) \
  ACCEL_INSTANTIATE(T)              \
  ACCEL_INSTANTIATE(std::vector<T>) \
  ACCEL_INSTANTIATE_WAVE2(T) ACCEL_INSTANTIATE_WAVE2(std::vector<T>) ACCEL_INSTANTIATE_SPLIT(std::vector<T>)

ACCEL_INSTANTIATE(at::Tensor)
ACCEL_INSTANTIATE_WAVE2(at::Tensor)
ACCEL_INSTANTIATE_SPLIT(at::Tensor)
ACCEL_INSTANTIATE_SCALAR(char)
ACCEL_INSTANTIATE_SCALAR(signed char)
ACCEL_INSTANTIATE_SCALAR(unsigned char)
ACCEL_INSTANTIATE_SCALAR(short)
ACCEL_INSTANTIATE_SCALAR(unsigned short)
ACCEL_INSTANTIATE_SCALAR(int)
ACCEL_INSTANTIATE_SCALAR(unsigned int)
ACCEL_INSTANTIATE_SCALAR(long)
ACCEL_INSTANTIATE_SCALAR(unsigned long)
ACCEL_INSTANTIATE_SCALAR(long long)
ACCEL_INSTANTIATE_SCALAR(unsigned long long)
ACCEL_INSTANTIATE_SCALAR(float)
ACCEL_INSTANTIATE_SCALAR(double)
ACCEL_INSTANTIATE_SCALAR(long double)
ACCEL_INSTANTIATE_SCALAR(wchar_t)
ACCEL_INSTANTIATE_SCALAR(char8_t)
ACCEL_INSTANTIATE_SCALAR(char16_t)
ACCEL_INSTANTIATE_SCALAR(char32_t)

#define ACCEL_SCALAR_TYPES                                                                                    \
  char, signed char, unsigned char, short, unsigned short, int, unsigned int, long, unsigned long, long long, \
      unsigned long long, float, double, long double, wchar_t, char8_t, char16_t, char32_t

static_assert(accel::TensorLike<at::Tensor> && accel::TensorLike<std::vector<char32_t>>);
static_assert(!accel::TensorLike<bool> && !accel::TensorLike<std::vector<bool>>);
static_assert(!accel::TensorLike<std::string> && !accel::TensorLike<std::vector<std::string>>);

// == single: one process, nothing distributed =================================

TEST_SUITE("single") {
  TEST_CASE("enums: to_string, from_string and operator<<") {
    CHECK(accel::to_string(accel::DeviceType::CUDA) == "cuda");
    CHECK(accel::to_string(accel::DeviceType::XPU) == "xpu");
    CHECK(accel::to_string(ReduceOp::MEAN) == "mean");
    CHECK(accel::to_string(Dim::MP_REPLICATE) == "mp_replicate");
    CHECK(accel::from_string<Dim>("cp") == Dim::CP);
    CHECK(accel::from_string<Dim>("tp") == Dim::TP);
    CHECK(accel::from_string<Dim>("pp") == Dim::PP);
    CHECK(accel::from_string<ReduceOp>("max") == ReduceOp::MAX);
    CHECK(accel::from_string<accel::DeviceType>("npu") == accel::DeviceType::NPU);
    std::ostringstream os;
    os << Dim::MP_SHARD << ' ' << ReduceOp::MIN << ' ' << accel::DeviceType::META;
    CHECK(os.str() == "mp_shard min meta");
    CHECK_THROWS_WITH_AS(accel::from_string<Dim>("DP"),
                         "accel::from_string<Dim>: unknown value 'DP' (expected one of: "
                         "mp_replicate, mp_shard, dp, cp, tp, pp)",
                         std::invalid_argument);
    CHECK_THROWS_AS(accel::from_string<ReduceOp>("avg"), std::invalid_argument);
  }

  TEST_CASE("environment: defaults and torchrun values") {
    EnvGuard env{{"RANK", nullptr}, {"WORLD_SIZE", nullptr}, {"LOCAL_RANK", nullptr}, {"LOCAL_WORLD_SIZE", nullptr}};
    CHECK_FALSE(accel::is_distributed());
    CHECK(accel::get_rank() == 0);
    CHECK(accel::get_world_size() == 1);
    CHECK(accel::get_local_rank() == 0);
    CHECK(accel::get_local_world_size() == 1);
    EnvGuard set{{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}};
    CHECK(accel::is_distributed());
    CHECK(accel::get_rank() == 5);
    CHECK(accel::get_world_size() == 8);
    CHECK(accel::get_local_rank() == 1);
    CHECK(accel::get_local_world_size() == 4);
  }

  TEST_CASE("environment: bad values name the variable and the value") {
    EnvGuard base{{"RANK", nullptr}, {"WORLD_SIZE", nullptr}, {"LOCAL_RANK", nullptr}, {"LOCAL_WORLD_SIZE", nullptr}};
    {
      EnvGuard env{{"RANK", "abc"}};
      CHECK_THROWS_WITH_AS(accel::get_rank(), "accel: environment variable RANK='abc' is not an integer",
                           std::invalid_argument);
    }
    {
      EnvGuard env{{"RANK", "4"}, {"WORLD_SIZE", "4"}};
      CHECK_THROWS_WITH_AS(accel::get_rank(), "accel: RANK=4 must be smaller than WORLD_SIZE=4", std::invalid_argument);
    }
    {
      EnvGuard env{{"WORLD_SIZE", "0"}};
      CHECK_THROWS_WITH_AS(accel::get_world_size(), "accel: environment variable WORLD_SIZE=0 must be at least 1",
                           std::invalid_argument);
    }
    {
      EnvGuard env{{"RANK", "-1"}, {"WORLD_SIZE", "2"}};
      CHECK_THROWS_WITH_AS(accel::get_rank(), "accel: environment variable RANK=-1 must be at least 0",
                           std::invalid_argument);
    }
    {
      EnvGuard env{{"LOCAL_RANK", "-2"}};
      CHECK_THROWS_AS(accel::get_local_rank(), std::invalid_argument);
    }
    {
      EnvGuard env{{"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}};
      CHECK_THROWS_WITH_AS(accel::get_local_rank(), "accel: LOCAL_RANK=2 must be smaller than LOCAL_WORLD_SIZE=2",
                           std::invalid_argument);
    }
    {
      EnvGuard env{{"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}};
      CHECK_THROWS_WITH_AS(accel::get_local_world_size(), "accel: LOCAL_WORLD_SIZE=3 must not exceed WORLD_SIZE=2",
                           std::invalid_argument);
    }
    {
      EnvGuard env{{"WORLD_SIZE", "3x"}};
      CHECK_THROWS_AS(accel::get_world_size(), std::invalid_argument);
    }
    {
      EnvGuard env{{"WORLD_SIZE", "99999999999"}};
      CHECK_THROWS_WITH_AS(accel::get_world_size(),
                           "accel: environment variable WORLD_SIZE=99999999999 is out of range (at most 2147483647)",
                           accel::InvalidArgument);
    }
    {  // set but empty is not unset: a rank launched with RANK="" must not run alone as a world of 1
      EnvGuard env{{"RANK", ""}, {"WORLD_SIZE", "2"}};
      CHECK_THROWS_WITH_AS(accel::is_distributed(),
                           "accel: environment variable RANK is set but empty (unset it, or give a number)",
                           accel::InvalidArgument);
      CHECK_THROWS_AS(accel::get_world_size(), std::invalid_argument);
      CHECK_THROWS_AS(accel::DistributedStrategy{}, std::invalid_argument);
    }
    {
      EnvGuard env{{"ACCEL_DEBUG_MODE", ""}};
      CHECK_THROWS_WITH_AS(accel::detail::env_bool("ACCEL_DEBUG_MODE", false), doctest::Contains("set but empty"),
                           accel::InvalidArgument);
    }
    {  // the environment is validated as a whole, before the strategy
      EnvGuard env{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "5"}, {"LOCAL_WORLD_SIZE", "2"}};
      CHECK_THROWS_WITH_AS(accel::DistributedStrategy(accel::DistributedConfig{.cp_size = 3}),
                           "accel: LOCAL_RANK=5 must be smaller than LOCAL_WORLD_SIZE=2", std::invalid_argument);
      CHECK_THROWS_AS(accel::get_rank(), std::invalid_argument);  // any getter reads the whole environment
    }
  }

  TEST_CASE("errors: one family, accel::Error, each kind still its std exception") {
    auto kind_of = [](const std::function<void()>& f) -> std::string {
      try {
        f();
      } catch (const accel::Error& e) {
        return e.what();
      }
      return "nothing thrown";
    };
    CHECK(kind_of([] { accel::from_string<accel::Dim>("ep"); }).find("unknown value 'ep'") != std::string::npos);
    CHECK(kind_of([] {
            accel::operate_tensorlike([](at::Tensor& t) { return t; }, ~uint64_t{0});
          }).find("does not fit") != std::string::npos);
    CHECK(kind_of([] { accel::DistributedStrategy(accel::DistributedConfig{.cp_size = 0}, 4); }).find("cp_size") !=
          std::string::npos);
    static_assert(std::is_base_of_v<std::invalid_argument, accel::InvalidArgument>);
    static_assert(std::is_base_of_v<std::out_of_range, accel::OutOfRange>);
    static_assert(std::is_base_of_v<std::logic_error, accel::LogicError>);
    static_assert(std::is_base_of_v<std::runtime_error, accel::DistributedError>);
    static_assert(std::is_base_of_v<accel::Error, accel::DistributedError>);
    // Caught as std::exception too (one std::exception base, no ambiguity).
    try {
      throw accel::DistributedError("x");
    } catch (const std::exception& e) {
      CHECK(std::string(e.what()) == "x");
    }
  }

  TEST_CASE("devices on a CPU build") {
    if (accel::is_torch_cuda_available()) {  // (seen on the GPU machine: CUDA is then the default device)
      std::printf("SKIPPED (a CUDA device is visible): what a machine without one sees\n");
      return;
    }
    EnvGuard env{{"ACCEL_DEVICE", nullptr}, {"ACCEL_BACKEND", nullptr}};
    CHECK(accel::get_current_accelerator().type() == c10::DeviceType::CPU);
    CHECK(accel::get_current_device() == c10::Device(c10::kCPU));
    CHECK(accel::get_device_count() == 1);
    CHECK(accel::get_process_group_backend() == "gloo");
    CHECK_NOTHROW(accel::synchronize());
    CHECK_NOTHROW(accel::set_device_index());
    CHECK_FALSE(accel::is_torch_cuda_available());
    CHECK_FALSE(accel::is_torch_npu_available());
    {
      EnvGuard cuda{{"ACCEL_DEVICE", "cuda"}};
      CHECK_THROWS_WITH_AS(accel::get_current_accelerator(),
                           doctest::Contains("ACCEL_DEVICE=cuda, but this LibTorch has no usable cuda device"),
                           std::runtime_error);
      CHECK(accel::get_current_accelerator(false).type() == c10::DeviceType::CUDA);
    }
    {
      EnvGuard bogus{{"ACCEL_DEVICE", "tpu"}};
      CHECK_THROWS_AS(accel::get_current_accelerator(), std::invalid_argument);
    }
    {
      EnvGuard cpu{{"ACCEL_DEVICE", "cpu"}};
      CHECK(accel::get_current_accelerator().type() == c10::DeviceType::CPU);
    }
    {  // DistributedConfig::device instead of the environment
      if (accel::DistributedInterface::is_initialized()) accel::DistributedInterface::instance().destroy();
      CHECK_THROWS_WITH_AS(
          accel::DistributedInterface::instance(accel::DistributedConfig{.device = accel::DeviceType::CUDA}),
          doctest::Contains("DistributedConfig::device is cuda, but this LibTorch has no usable cuda"),
          accel::RuntimeError);
      auto& cpu = accel::DistributedInterface::instance(accel::DistributedConfig{.device = accel::DeviceType::CPU});
      CHECK(cpu.current_device() == c10::Device(c10::kCPU));
      CHECK(&accel::DistributedInterface::instance(accel::DistributedConfig{}) == &cpu);  // unset: what is in force
      CHECK(cpu.config().device == accel::DeviceType::CPU);
      cpu.destroy();
    }
    // (ACCEL_BACKEND=nccl: test_cuda.cpp, on builds with and without NCCL.)
    {
      EnvGuard gloo{{"ACCEL_BACKEND", "gloo"}};
      CHECK(accel::get_process_group_backend() == "gloo");
    }
    {
      EnvGuard mpi{{"ACCEL_BACKEND", "mpi"}};
      CHECK_THROWS_AS(accel::get_process_group_backend(), std::invalid_argument);
    }
  }

  TEST_CASE("strategy: defaults and validation messages") {
    using accel::DistributedConfig;
    using accel::DistributedStrategy;
    const auto to_text = [](const auto& value) {
      std::ostringstream os;
      os << value;
      return os.str();
    };
    DistributedStrategy s8(DistributedConfig{.mp_replicate_size = 2, .cp_size = 2}, 8);
    CHECK((s8.model_mesh_shape() == std::array{2, 4}));
    CHECK((s8.data_mesh_shape() == std::array{4, 2}));
    CHECK((s8.model_mesh_dim_names() == std::array<std::string_view, 2>{"mp_replicate", "mp_shard"}));
    CHECK((s8.data_mesh_dim_names() == std::array<std::string_view, 2>{"dp", "cp"}));
    DistributedStrategy s6(DistributedConfig{.mp_shard_size = 6, .dp_size = 3, .cp_size = 2}, 6);
    CHECK((s6.model_mesh_shape() == std::array{1, 6}));
    CHECK((s6.data_mesh_shape() == std::array{3, 2}));

    auto fails = [](DistributedConfig c, int world) { return what_of([&] { DistributedStrategy(c, world); }); };
    CHECK(fails({.mp_replicate_size = 3}, 4) ==
          "accel::DistributedStrategy: world_size 4 is not divisible by mp_replicate_size 3");
    CHECK(fails({.mp_replicate_size = 2, .mp_shard_size = 3}, 4) ==
          "accel::DistributedStrategy: mp_replicate_size * mp_shard_size must equal world_size, "
          "got 2 * 3 != 4");
    CHECK(fails({.dp_size = 3, .cp_size = 2}, 4) ==
          "accel::DistributedStrategy: cp_size * dp_size must equal world_size, got 2 * 3 != 4");
    CHECK(fails({.cp_size = 3}, 4) == "accel::DistributedStrategy: world_size 4 is not divisible by cp_size 3");
    CHECK(fails({.mp_replicate_size = 0}, 4) ==
          "accel::DistributedStrategy: mp_replicate_size must be positive, got 0");
    CHECK(fails({.mp_shard_size = -4}, 4) == "accel::DistributedStrategy: mp_shard_size must be positive, got -4");
    CHECK(fails({.dp_size = 0}, 4) == "accel::DistributedStrategy: dp_size must be positive, got 0");
    CHECK(fails({.cp_size = -1}, 4) == "accel::DistributedStrategy: cp_size must be positive, got -1");
    CHECK(fails({}, 0) == "accel::DistributedStrategy: world_size must be positive, got 0");
    CHECK_THROWS_AS(DistributedStrategy(DistributedConfig{.mp_replicate_size = 3}, 4), std::invalid_argument);

    // tp: innermost in both meshes, so each of them multiplies to world / tp.
    DistributedStrategy t8(DistributedConfig{.mp_replicate_size = 2, .cp_size = 2, .tp_size = 2}, 8);
    CHECK(t8.tp_size() == 2);
    CHECK((t8.model_mesh_shape() == std::array{2, 2}));  // the meshes without tp
    CHECK((t8.data_mesh_shape() == std::array{2, 2}));
    CHECK(to_text(t8) == "DistributedStrategy(mp_replicate_size=2, mp_shard_size=2, dp_size=2, cp_size=2, tp_size=2)");
    CHECK(to_text(s8) == "DistributedStrategy(mp_replicate_size=2, mp_shard_size=4, dp_size=4, cp_size=2)");
    CHECK(DistributedStrategy(DistributedConfig{.tp_size = 4}, 4).mp_shard_size() == 1);
    CHECK(fails({.tp_size = 3}, 4) == "accel::DistributedStrategy: world_size 4 is not divisible by tp_size 3");
    CHECK(fails({.tp_size = 0}, 4) == "accel::DistributedStrategy: tp_size must be positive, got 0");
    CHECK(fails({.mp_replicate_size = 4, .tp_size = 2}, 4) ==
          "accel::DistributedStrategy: world_size 4 / tp_size 2 = 2 is not divisible by mp_replicate_size 4");
    CHECK(fails({.mp_replicate_size = 2, .mp_shard_size = 2, .tp_size = 2}, 4) ==
          "accel::DistributedStrategy: mp_replicate_size * mp_shard_size * tp_size must equal world_size, "
          "got 2 * 2 * 2 != 4");
    CHECK(fails({.dp_size = 3, .tp_size = 2}, 8) ==
          "accel::DistributedStrategy: cp_size * dp_size * tp_size must equal world_size, got 1 * 3 * 2 != 8");
    CHECK(to_text(DistributedConfig{.tp_size = 2}) ==
          "DistributedConfig(mp_replicate_size=1, mp_shard_size=auto, dp_size=auto, cp_size=1, tp_size=2, "
          "timeout=default)");
    CHECK(to_text(DistributedConfig{}).find("tp_size") == std::string::npos);  // unchanged at tp 1

    // pp: outermost in both meshes, so each of them multiplies to world / (tp * pp).
    DistributedStrategy p16(DistributedConfig{.mp_replicate_size = 2, .cp_size = 2, .tp_size = 2, .pp_size = 2}, 16);
    CHECK(p16.pp_size() == 2);
    CHECK((p16.model_mesh_shape() == std::array{2, 2}));  // the meshes without pp and tp
    CHECK((p16.data_mesh_shape() == std::array{2, 2}));
    CHECK(to_text(p16) ==
          "DistributedStrategy(mp_replicate_size=2, mp_shard_size=2, dp_size=2, cp_size=2, tp_size=2, pp_size=2)");
    CHECK(to_text(DistributedStrategy(DistributedConfig{.pp_size = 2}, 4)) ==
          "DistributedStrategy(mp_replicate_size=1, mp_shard_size=2, dp_size=2, cp_size=1, pp_size=2)");
    CHECK(DistributedStrategy(DistributedConfig{.pp_size = 4}, 4).dp_size() == 1);
    CHECK(fails({.pp_size = 3}, 4) == "accel::DistributedStrategy: world_size 4 is not divisible by pp_size 3");
    CHECK(fails({.tp_size = 2, .pp_size = 4}, 4) ==
          "accel::DistributedStrategy: world_size 4 / tp_size 2 = 2 is not divisible by pp_size 4");
    CHECK(fails({.pp_size = 0}, 4) == "accel::DistributedStrategy: pp_size must be positive, got 0");
    CHECK(fails({.mp_replicate_size = 4, .pp_size = 2}, 4) ==
          "accel::DistributedStrategy: world_size 4 / pp_size 2 = 2 is not divisible by mp_replicate_size 4");
    CHECK(fails({.cp_size = 2, .tp_size = 2, .pp_size = 2}, 4) ==
          "accel::DistributedStrategy: world_size 4 / tp_size 2 / pp_size 2 = 1 is not divisible by cp_size 2");
    CHECK(fails({.mp_replicate_size = 2, .mp_shard_size = 2, .pp_size = 2}, 4) ==
          "accel::DistributedStrategy: mp_replicate_size * mp_shard_size * pp_size must equal world_size, "
          "got 2 * 2 * 2 != 4");
    CHECK(fails({.dp_size = 3, .tp_size = 2, .pp_size = 2}, 8) ==
          "accel::DistributedStrategy: cp_size * dp_size * tp_size * pp_size must equal world_size, "
          "got 1 * 3 * 2 * 2 != 8");
    CHECK(to_text(DistributedConfig{.pp_size = 2}) ==
          "DistributedConfig(mp_replicate_size=1, mp_shard_size=auto, dp_size=auto, cp_size=1, pp_size=2, "
          "timeout=default)");
    CHECK(to_text(DistributedConfig{}).find("pp_size") == std::string::npos);  // unchanged at pp 1

    EnvGuard env{{"RANK", nullptr}, {"WORLD_SIZE", nullptr}};
    DistributedStrategy single(DistributedConfig{.mp_replicate_size = 2, .cp_size = 2});
    CHECK((single.model_mesh_shape() == std::array{1, 1}));  // not distributed: every size is 1
    CHECK((single.data_mesh_shape() == std::array{1, 1}));
    CHECK(DistributedStrategy(DistributedConfig{.tp_size = 2}).tp_size() == 1);
    CHECK(DistributedStrategy(DistributedConfig{.pp_size = 2}).pp_size() == 1);
    CHECK_THROWS_AS(DistributedStrategy(DistributedConfig{.cp_size = 0}), std::invalid_argument);
  }

  TEST_CASE("not distributed: identity collectives; all_gather still stacks") {
    EnvGuard env{{"RANK", nullptr}, {"WORLD_SIZE", nullptr}};
    auto& d = accel::DistributedInterface::instance();
    CHECK_FALSE(d.distributed());
    CHECK(d.get_rank() == 0);
    CHECK(d.get_rank(Dim::CP) == 0);
    CHECK(d.get_world_size(Dim::DP) == 1);
    CHECK(d.get_group(Dim::DP).get() == nullptr);
    CHECK(d.get_device_mesh(Dim::DP) == nullptr);
    CHECK_THROWS_AS(d.get_device_mesh(std::nullopt), std::invalid_argument);
    // A mesh of one rank: null groups, flattening without communication.
    accel::DeviceMesh lone = accel::init_device_mesh({1, 1}, {"dp", "cp"});
    CHECK(lone.get_group("cp").get() == nullptr);
    CHECK((lone.flatten().dim_names() == std::vector<std::string>{"dp_cp"}));
    CHECK(lone.slice("dp_cp").ranks() == std::vector<int>{0});
    CHECK_THROWS_WITH_AS(accel::init_device_mesh({2}, {"dp"}), doctest::Contains("the world has 1 ranks"),
                         std::invalid_argument);

    at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3});
    at::Tensor same = accel::all_reduce(t, ReduceOp::SUM);
    CHECK(same.data_ptr() == t.data_ptr());
    CHECK(at::equal(same, at::arange(6, at::kFloat).reshape({2, 3})));
    at::Tensor stacked = accel::all_gather(t);
    CHECK(stacked.sizes() == at::IntArrayRef({1, 2, 3}));
    CHECK(at::equal(stacked[0], t));
    CHECK(d.all_gather(at::scalar_tensor(7.0)).sizes() == at::IntArrayRef({1}));
    CHECK(accel::all_gather(3) == std::vector<int>{3});
    at::Tensor into = at::zeros({1, 2, 3});
    accel::all_gather_into_tensor(into, t);
    CHECK(at::equal(into[0], t));
    at::Tensor wrong = at::zeros({2, 2, 3});
    CHECK_THROWS_AS(accel::all_gather_into_tensor(wrong, t), std::invalid_argument);
    CHECK((accel::all_gather(std::vector<double>{1, 2}) == std::vector<std::vector<double>>{{1, 2}}));
    CHECK(accel::all_reduce(2.5) == 2.5);
    CHECK((accel::broadcast(std::vector<int>{4, 5}) == std::vector<int>{4, 5}));
    CHECK_THROWS_AS(accel::broadcast(1, 1), std::invalid_argument);
    CHECK_THROWS_AS(accel::all_reduce(int64_t{3}, ReduceOp::MEAN), std::invalid_argument);
    CHECK(accel::main_process_first([] { return 42; }) == 42);
    d.destroy();
  }

  TEST_CASE("MEAN on an integral type throws and says what to use") {
    CHECK_THROWS_WITH_AS(accel::all_reduce(int64_t{1}, ReduceOp::MEAN),
                         doctest::Contains("ReduceOp::MEAN on integral type Long would truncate; use "
                                           "ReduceOp::SUM"),
                         std::invalid_argument);
    CHECK_THROWS_AS(accel::all_reduce(std::vector<unsigned>{1, 2}, ReduceOp::MEAN), std::invalid_argument);
    CHECK_THROWS_AS(accel::all_reduce(at::ones({2}, at::kInt), ReduceOp::MEAN), std::invalid_argument);
    CHECK_NOTHROW(accel::all_reduce(at::ones({2}, at::kDouble), ReduceOp::MEAN));
  }

  TEST_CASE("operate_tensorlike keeps the C++ type, exact values and the memory") {
    const int64_t big = (int64_t{1} << 53) + 1;  // not representable in float or double
    CHECK(accel::operate_tensorlike([](at::Tensor& t) { return t; }, big) == big);
    CHECK(accel::operate_tensorlike([](at::Tensor& t) { return t + 1; }, big) == big + 1);
    std::vector<int64_t> v{big, -big, 3};
    const void* seen = nullptr;
    const int64_t* original = v.data();
    auto same = accel::operate_tensorlike(
        [&](at::Tensor& t) {
          seen = t.data_ptr();
          CHECK((t.scalar_type() == at::kLong));
          return t.mul_(2);
        },
        std::move(v));
    CHECK(seen == original);  // a 1-d view of the vector's own memory
    CHECK(same.data() == original);
    CHECK((same == std::vector<int64_t>{2 * big, -2 * big, 6}));
    auto doubled = accel::operate_tensorlike(Twice{}, std::vector<float>{1.5f, -2});
    CHECK((doubled == std::vector<float>{3, -4}));
    CHECK(accel::operate_tensorlike(Twice{}, 0.25) == 0.5);
    CHECK(accel::operate_tensorlike(Twice{}, uint64_t{1} << 62) == uint64_t{1} << 63);
    CHECK_THROWS_AS(accel::operate_tensorlike(Twice{}, ~uint64_t{0}), std::out_of_range);
    CHECK(accel::operate_tensorlike(Twice{}, char16_t{40000}) == char16_t{80000 - 65536});
    // C++ types that share an ATen dtype with another (long long and int64_t,
    // char and int8_t, wchar_t and int32_t, char8_t and uint8_t).
    CHECK((accel::operate_tensorlike(Twice{}, std::vector<long long>{1LL << 40, -3}) ==
           std::vector<long long>{1LL << 41, -6}));
    CHECK((accel::operate_tensorlike(Twice{}, std::vector<char>{'\x01', '\x20'}) == std::vector<char>{2, 64}));
    CHECK((accel::operate_tensorlike(Twice{}, std::vector<wchar_t>{L'a'}) == std::vector<wchar_t>{2 * L'a'}));
    CHECK(accel::operate_tensorlike(Twice{}, char8_t{100}) == char8_t{200});
    CHECK(accel::operate_tensorlike(Twice{}, 21LL) == 42LL);
    // A function may change the length: the vector follows.
    CHECK((accel::operate_tensorlike([](at::Tensor& t) { return at::cat({t, t}); }, std::vector<short>{1, 2}) ==
           std::vector<short>{1, 2, 1, 2}));
  }
}

// == ranks: any world size ====================================================

TEST_SUITE("ranks") {
  TEST_CASE_TEMPLATE("exact values for every scalar type and its vector", T, ACCEL_SCALAR_TYPES) {
    auto& d = world();
    const int P = d.get_world_size();
    const int r = d.get_rank();
    const T mine = static_cast<T>(r + 1);
    const long long sum = P * (P + 1) / 2;

    CHECK(num(accel::all_reduce(mine, ReduceOp::SUM)) == sum);
    CHECK(num(accel::all_reduce(mine, ReduceOp::MAX)) == P);
    CHECK(num(accel::all_reduce(mine, ReduceOp::MIN)) == 1);
    if constexpr (std::is_floating_point_v<T>) {
      CHECK(num(accel::all_reduce(mine, ReduceOp::MEAN)) == static_cast<long double>(P + 1) / 2);
    } else {
      CHECK_THROWS_AS(accel::all_reduce(mine, ReduceOp::MEAN), std::invalid_argument);
    }
    // The interface's default dimension (dp) spans the world here.
    CHECK(num(d.all_reduce(mine, ReduceOp::SUM)) == sum);

    std::vector<T> gathered = accel::all_gather(mine);
    REQUIRE(gathered.size() == static_cast<std::size_t>(P));
    for (int i = 0; i < P; ++i) CHECK(num(gathered[i]) == i + 1);

    const int src = P - 1;  // group-local, and not rank 0 when P > 1
    CHECK(num(accel::broadcast(mine, src)) == P);
    CHECK(num(d.broadcast(mine, src, Dim::DP)) == P);

    std::vector<T> v{mine, static_cast<T>(2 * (r + 1)), static_cast<T>(r)};
    auto vsum = accel::all_reduce(v, ReduceOp::SUM);
    CHECK(num(vsum[0]) == sum);
    CHECK(num(vsum[1]) == 2 * sum);
    CHECK(num(vsum[2]) == sum - P);
    auto vmax = accel::all_reduce(v, ReduceOp::MAX, d.world_group());
    CHECK(num(vmax[0]) == P);
    CHECK(num(vmax[2]) == P - 1);
    auto vmin = d.all_reduce(v, ReduceOp::MIN, std::nullopt);  // no dim: the world
    CHECK(num(vmin[0]) == 1);
    CHECK(num(vmin[2]) == 0);
    if constexpr (std::is_floating_point_v<T>)
      CHECK(num(accel::all_reduce(v, ReduceOp::MEAN)[1]) == static_cast<long double>(P + 1));

    auto vg = d.all_gather(v);
    REQUIRE(vg.size() == static_cast<std::size_t>(P));
    for (int i = 0; i < P; ++i) {
      REQUIRE(vg[i].size() == 3);
      CHECK(num(vg[i][0]) == i + 1);
      CHECK(num(vg[i][2]) == i);
    }
    auto vb = accel::broadcast(v, src);
    CHECK(num(vb[1]) == 2 * P);
    CHECK(num(vb[2]) == P - 1);
  }

  TEST_CASE_TEMPLATE("tensors: in place, stacked gather, broadcast", T, float, double, int64_t) {
    auto& d = world();
    const int P = d.get_world_size();
    const int r = d.get_rank();
    const auto dtype = c10::CppTypeToScalarType<T>::value;
    auto filled = [&](double value) { return at::full({2, 3}, value, at::TensorOptions().dtype(dtype)); };

    at::Tensor t = filled(r + 1);
    const void* storage = t.data_ptr();
    at::Tensor out = accel::all_reduce(t, ReduceOp::SUM);
    CHECK(out.data_ptr() == storage);  // in place, and returned
    CHECK(at::equal(t, filled(P * (P + 1) / 2)));
    CHECK(at::equal(accel::all_reduce(filled(r + 1), ReduceOp::MAX), filled(P)));
    CHECK(at::equal(accel::all_reduce(filled(r + 1), ReduceOp::MIN), filled(1)));
    if constexpr (std::is_floating_point_v<T>) {
      CHECK(at::allclose(d.all_reduce(filled(r + 1)), filled((P + 1) / 2.0)));  // MEAN by default
    } else {
      CHECK_THROWS_AS(d.all_reduce(filled(r + 1)), std::invalid_argument);
    }

    // A non-contiguous tensor is reduced through a temporary, still in place.
    at::Tensor base = filled(0);
    base.select(1, 1).fill_(r + 1);
    at::Tensor column = base.select(1, 1);
    REQUIRE_FALSE(column.is_contiguous());
    accel::all_reduce(column, ReduceOp::SUM);
    CHECK(at::equal(base.select(1, 1), at::full({2}, P * (P + 1) / 2.0, at::TensorOptions().dtype(dtype))));
    CHECK(at::equal(base.select(1, 0), at::zeros({2}, at::TensorOptions().dtype(dtype))));

    at::Tensor stacked = accel::all_gather(filled(r + 1));
    CHECK(stacked.sizes() == at::IntArrayRef({P, 2, 3}));
    for (int i = 0; i < P; ++i) CHECK(at::equal(stacked[i], filled(i + 1)));
    at::Tensor zero_d = d.all_gather(at::scalar_tensor(r + 1, at::TensorOptions().dtype(dtype)));
    CHECK(zero_d.sizes() == at::IntArrayRef({P}));

    // Into a buffer the caller owns and reuses.
    at::Tensor buffer = at::empty({P, 2, 3}, at::TensorOptions().dtype(dtype));
    const void* buffer_data = buffer.data_ptr();
    for (int round = 0; round < 2; ++round) {
      at::Tensor& same = accel::all_gather_into_tensor(buffer, filled(r + 1 + round));
      CHECK(&same == &buffer);
      CHECK(buffer.data_ptr() == buffer_data);
      for (int i = 0; i < P; ++i) CHECK(at::equal(buffer[i], filled(i + 1 + round)));
    }
    at::Tensor wrong = at::empty({P + 1, 2, 3}, at::TensorOptions().dtype(dtype));
    CHECK_THROWS_WITH_AS(accel::all_gather_into_tensor(wrong, filled(1)), doctest::Contains("output must have shape"),
                         std::invalid_argument);

    at::Tensor b = filled(r + 1);
    accel::broadcast(b, P - 1);
    CHECK(at::equal(b, filled(P)));

    if constexpr (std::is_floating_point_v<T>) {
      // A leaf that requires grad (a parameter, a logged loss): collectives
      // bypass autograd instead of tripping its in-place checks.
      at::Tensor leaf = filled(r + 1).requires_grad_(true);
      CHECK_NOTHROW(accel::all_reduce(leaf));
      CHECK(at::allclose(leaf.detach(), filled((P + 1) / 2.0)));
      CHECK_NOTHROW(accel::broadcast(leaf, 0));
      CHECK(accel::all_gather(leaf).sizes() == at::IntArrayRef({P, 2, 3}));
    }
  }

  TEST_CASE("every dtype LibTorch has, zero elements too: all_reduce, broadcast, all_gather, gather, reduce") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    std::vector<c10::ScalarType> dtypes{at::kBool,  at::kByte,   at::kChar,         at::kShort,
                                        at::kInt,   at::kLong,   at::kHalf,         at::kBFloat16,
                                        at::kFloat, at::kDouble, at::kComplexFloat, at::kComplexDouble};
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
    for (auto extra : {at::kUInt16, at::kUInt32, at::kUInt64, at::kFloat8_e4m3fn, at::kFloat8_e5m2})
      dtypes.push_back(extra);
#endif
    // Rank k holds k+1 everywhere (complex: k+1 - (k+1)i; bool: k is odd).
    auto value_of = [](int k, c10::ScalarType dtype) {
      if (dtype == at::kBool) return at::full({2, 3}, k % 2 == 1, at::kBool);
      at::Tensor v = at::full({2, 3}, k + 1, at::kDouble);
      if (c10::isComplexType(dtype)) v = at::complex(v, -v);
      return v.to(dtype);
    };
    auto doubles = [](const at::Tensor& t) {  // real and imaginary parts, for complex
      at::Tensor wide =
          c10::isComplexType(t.scalar_type()) ? at::view_as_real(t.to(at::kComplexDouble)) : t.to(at::kDouble);
      wide = wide.contiguous().flatten();
      return std::vector<double>(wide.data_ptr<double>(), wide.data_ptr<double>() + wide.numel());
    };
    for (const auto dtype : dtypes) {
      CAPTURE(dtype);
      const bool is_bool = dtype == at::kBool, is_complex = c10::isComplexType(dtype);
      auto same = [&](const at::Tensor& got, const at::Tensor& want) {
        CHECK((got.scalar_type() == dtype));
        CHECK(got.sizes() == want.sizes());
        CHECK(doubles(got) == doubles(want));
      };
      // SUM: the sum of 1..P; bool: an or; MAX and MIN likewise.
      at::Tensor sum = is_bool ? value_of(P > 1 ? 1 : 0, dtype) : value_of(P * (P + 1) / 2 - 1, dtype);
      same(accel::all_reduce(value_of(r, dtype), ReduceOp::SUM), sum);
      if (is_complex) {
        CHECK_THROWS_WITH_AS(accel::all_reduce(value_of(r, dtype), ReduceOp::MAX),
                             doctest::Contains("complex numbers have no order"), std::invalid_argument);
        same(accel::all_reduce(value_of(r, dtype), ReduceOp::MEAN), value_of(0, dtype) * ((P + 1) / 2.0));
      } else {
        same(accel::all_reduce(value_of(r, dtype), ReduceOp::MAX), value_of(is_bool ? (P > 1 ? 1 : 0) : P - 1, dtype));
        same(accel::all_reduce(value_of(r, dtype), ReduceOp::MIN), value_of(0, dtype));
      }
      if (c10::isFloatingType(dtype))
        same(accel::all_reduce(value_of(r, dtype), ReduceOp::MEAN),
             at::full({2, 3}, (P + 1) / 2.0, at::kDouble).to(dtype));
      // A non-contiguous one, in place.
      at::Tensor wide = at::cat({value_of(r, dtype), value_of(r, dtype)}, 1);
      at::Tensor strided = wide.slice(1, 0, 6, 2);
      REQUIRE_FALSE(strided.is_contiguous());
      accel::all_reduce(strided, ReduceOp::SUM);
      same(wide.slice(1, 0, 6, 2), sum);

      at::Tensor b = value_of(r, dtype);
      accel::broadcast(b, P - 1);
      same(b, value_of(P - 1, dtype));
      at::Tensor stacked = accel::all_gather(value_of(r, dtype));
      REQUIRE(stacked.size(0) == P);
      for (int k = 0; k < P; ++k) same(stacked[k], value_of(k, dtype));

      // Accelerate's operations, several dtypes in one structure.
      std::map<std::string, at::Tensor> nested{{"a", value_of(r, dtype)}, {"b", at::full({1}, r, at::kFloat)}};
      auto gathered = accel::gather(nested);
      for (int k = 0; k < P; ++k) same(gathered["a"].slice(0, 2 * k, 2 * k + 2), value_of(k, dtype));
      same(accel::reduce(nested, ReduceOp::SUM)["a"], sum);
      accel::broadcast(nested, P - 1);
      same(nested["a"], value_of(P - 1, dtype));

      // reduce_scatter and all_to_all: P copies of this rank's value, split by rank.
      std::vector<at::Tensor> copies(static_cast<std::size_t>(P), value_of(r, dtype));
      same(accel::reduce_scatter(at::cat(copies), ReduceOp::SUM), sum);
      at::Tensor exchanged = accel::all_to_all(at::cat(copies));
      for (int k = 0; k < P; ++k) same(exchanged.slice(0, 2 * k, 2 * k + 2), value_of(k, dtype));
      at::Tensor reduced = accel::reduce_to(value_of(r, dtype), P - 1, ReduceOp::SUM);
      if (r == P - 1) same(reduced, sum);
      at::Tensor on_root = accel::gather_to(value_of(r, dtype), 0);
      if (r == 0)
        for (int k = 0; k < P; ++k) same(on_root[k], value_of(k, dtype));
      std::vector<at::Tensor> parts;
      if (r == P - 1)
        for (int k = 0; k < P; ++k) parts.push_back(value_of(k, dtype));
      same(accel::scatter(parts, P - 1), value_of(r, dtype));
      if (P > 1) {  // a ring, even ranks sending first
        at::Tensor from_left = at::empty({2, 3}, at::TensorOptions().dtype(dtype));
        const int right = (r + 1) % P, left = (r + P - 1) % P;
        if (r % 2 == 0) accel::send(value_of(r, dtype), right);
        accel::recv(from_left, left);
        if (r % 2 == 1) accel::send(value_of(r, dtype), right);
        same(from_left, value_of(left, dtype));
      }

      // Zero elements: every operation returns at once, the right shape (before: SIGFPE inside Gloo).
      at::Tensor empty = at::empty({0, 3}, at::TensorOptions().dtype(dtype));
      CHECK(accel::all_reduce(empty, ReduceOp::SUM).numel() == 0);
      CHECK(accel::all_reduce(std::vector<float>{}, ReduceOp::MEAN).empty());  // (a view of no memory)
      CHECK(accel::all_reduce(std::vector<int64_t>{}, ReduceOp::SUM).empty());
      CHECK(accel::broadcast(empty, P - 1).numel() == 0);
      CHECK(accel::all_gather(empty).sizes() == at::IntArrayRef({P, 0, 3}));
      at::Tensor into = at::empty({P, 0, 3}, at::TensorOptions().dtype(dtype));
      CHECK(accel::all_gather_into_tensor(into, empty).sizes() == at::IntArrayRef({P, 0, 3}));
      CHECK(accel::gather(empty).sizes() == at::IntArrayRef({0, 3}));
      CHECK(accel::reduce(empty, ReduceOp::SUM).sizes() == at::IntArrayRef({0, 3}));
      CHECK(accel::reduce_scatter(empty, ReduceOp::SUM).sizes() == at::IntArrayRef({0, 3}));
      CHECK(accel::all_to_all(empty).sizes() == at::IntArrayRef({0, 3}));
      CHECK(accel::reduce_to(empty, 0, ReduceOp::SUM).numel() == 0);
      CHECK(accel::gather_to(empty, 0).numel() == 0);
      CHECK(accel::scatter(r == 0 ? std::vector<at::Tensor>(P, empty) : std::vector<at::Tensor>{}, 0).sizes() ==
            at::IntArrayRef({0, 3}));
    }
  }

  // distributed/direct_all_reduce.hpp, which the data-parallel engine runs for its small buckets: the sum Gloo's
  // all_reduce gives (the same bits at 2 ranks, where each element is one addition, and for integers; within
  // rounding beyond), the same bits on every rank, for lengths that do not split evenly (shorter than the
  // group, empty chunks) and with two in flight, both first phases issued before either second.
  TEST_CASE("the all-reduce point to point: Gloo's sums, the same bits on every rank, uneven lengths, two in flight") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    c10d::ProcessGroup& g = *d.world_group();
    const int tag = 0x7a11;
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{P + 1}, int64_t{7 * P + 3}, int64_t{4099}}) {
      for (const auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kBFloat16}) {
        CAPTURE(n);
        CAPTURE(dtype);
        const double tolerance = dtype == at::kBFloat16 ? 2e-2 : dtype == at::kFloat ? 1e-5 : 1e-12;
        auto generator = at::detail::createCPUGenerator(100 + r);
        const at::Tensor a = dtype == at::kLong ? at::randint(-1000, 1000, {n}, generator, at::kLong)
                                                : at::randn({n}, generator, at::kDouble).to(dtype),
                         b = a.flip(0).mul(3);
        const int64_t columns = (n + P - 1) / P;
        at::Tensor da = a.clone(), db = b.clone();
        const at::Tensor rows_a = at::empty({P, columns}, a.options()), rows_b = at::empty({P, columns}, a.options());
        auto first_a = accel::detail::start_all_reduce_direct(g, da, rows_a, tag);
        auto first_b = accel::detail::start_all_reduce_direct(g, db, rows_b, tag);
        auto second_a = first_a.wait();
        auto second_b = first_b.wait();
        const at::Tensor sum_a = second_a.wait(), sum_b = second_b.wait();
        CHECK(sum_a.data_ptr() == da.data_ptr());  // in place
        for (const auto& [direct, input] : {std::pair{sum_a, a}, std::pair{sum_b, b}}) {
          const at::Tensor gloo = accel::all_reduce(input.clone(), ReduceOp::SUM);
          if (dtype == at::kLong || (P <= 2 && dtype != at::kBFloat16)) CHECK(at::equal(direct, gloo));
          else CHECK(at::allclose(direct.to(at::kDouble), gloo.to(at::kDouble), tolerance, tolerance));
          const at::Tensor everywhere = accel::all_gather(direct);
          for (int k = 1; k < P; ++k) CHECK(at::equal(everywhere[k], everywhere[0]));
        }
      }
    }
  }

  TEST_CASE("reduce_scatter, all_to_all, reduce_to, gather_to, scatter, send/recv, monitored_barrier: arange values") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    const at::Tensor base = at::arange(2 * P * 3, at::kFloat).view({2 * P, 3});  // rank k's part: rows 2k, 2k+1
    const at::Tensor x = base + 100 * r;
    const at::Tensor mine = base.slice(0, 2 * r, 2 * r + 2);
    CHECK(at::equal(accel::reduce_scatter(x, ReduceOp::SUM), mine * P + 100 * P * (P - 1) / 2));
    CHECK(at::equal(accel::reduce_scatter(x, ReduceOp::MAX), mine + 100 * (P - 1)));
    CHECK(at::equal(accel::reduce_scatter(x, ReduceOp::MIN), mine));
    CHECK(at::allclose(accel::reduce_scatter(x, ReduceOp::MEAN), mine + 50.0 * (P - 1)));
    CHECK(at::equal(x, base + 100 * r));  // the input is left alone
    CHECK_THROWS_WITH_AS(accel::reduce_scatter(at::ones({})), doctest::Contains("does not split into"),
                         std::invalid_argument);
    if (P > 1)
      CHECK_THROWS_WITH_AS(accel::reduce_scatter(at::ones({2 * P + 1})), doctest::Contains("does not split into"),
                           std::invalid_argument);
    CHECK_THROWS_AS(accel::reduce_scatter(at::ones({2 * P}, at::kLong), ReduceOp::MEAN), std::invalid_argument);
    // std::vector: element j of rank r is j + 10 r; exact for a type no backend reduces (uint32).
    std::vector<int64_t> v(2 * static_cast<std::size_t>(P));
    std::vector<uint32_t> u(v.size());
    for (std::size_t j = 0; j < v.size(); ++j) {
      v[j] = static_cast<int64_t>(j) + 10 * r;
      u[j] = 4000000000u + static_cast<uint32_t>(j + r);
    }
    CHECK(accel::reduce_scatter(v, ReduceOp::SUM) ==
          std::vector<int64_t>{2 * r * P + 10 * P * (P - 1) / 2, (2 * r + 1) * P + 10 * P * (P - 1) / 2});
    CHECK(accel::reduce_scatter(u, ReduceOp::MAX) ==
          std::vector<uint32_t>{4000000000u + static_cast<uint32_t>(2 * r + P - 1),
                                4000000000u + static_cast<uint32_t>(2 * r + P)});

    // all_to_all: row j of rank k holds 100 k + j; rank r receives rows 2r, 2r+1 of every rank.
    const at::Tensor rows = at::arange(2 * P, at::kLong) + 100 * r;
    at::Tensor expected = at::empty({2 * P}, at::kLong);
    for (int k = 0; k < P; ++k) {
      expected[2 * k] = 100 * k + 2 * r;
      expected[2 * k + 1] = 100 * k + 2 * r + 1;
    }
    CHECK(at::equal(accel::all_to_all(rows), expected));
    std::vector<double> w(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + 2 * P);
    const std::vector<double> w_expected(expected.data_ptr<int64_t>(), expected.data_ptr<int64_t>() + 2 * P);
    CHECK(accel::all_to_all(w) == w_expected);

    // Uneven: rank i sends i + j rows to rank j (none from 0 to 0: at one rank, an empty exchange), each
    // row 1000 i + 10 j + t (t-th of its segment), of shape (n, 2).
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> segments, wanted;
    for (int j = 0; j < P; ++j) {
      in_splits.push_back(r + j);
      out_splits.push_back(j + r);
      segments.push_back((at::arange(r + j, at::kLong) + 1000 * r + 10 * j).unsqueeze(1).repeat({1, 2}));
      wanted.push_back((at::arange(j + r, at::kLong) + 1000 * j + 10 * r).unsqueeze(1).repeat({1, 2}));
    }
    const at::Tensor uneven = accel::all_to_all(at::cat(segments), out_splits, in_splits);
    CHECK(at::equal(uneven, at::cat(wanted)));
    CHECK_THROWS_WITH_AS(accel::all_to_all(at::cat(segments), out_splits, std::vector<int64_t>(P, 1000)),
                         doctest::Contains("input_split_sizes add up to"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::all_to_all(at::cat(segments), out_splits, std::vector<int64_t>(P + 1, 0)),
                         doctest::Contains("entries; the group has"), std::invalid_argument);

    // reduce_to onto every rank in turn: valid there.
    for (int dst = 0; dst < P; ++dst) {
      at::Tensor t = at::full({3}, r + 1, at::kDouble);
      accel::reduce_to(t, dst, ReduceOp::SUM);
      if (r == dst) CHECK(at::equal(t, at::full({3}, P * (P + 1) / 2, at::kDouble)));
      const double mean = accel::reduce_to(r + 1.0, dst, ReduceOp::MEAN);
      if (r == dst) CHECK(mean == (P + 1) / 2.0);
      const auto longs = accel::reduce_to(std::vector<int64_t>{r, 1}, dst, ReduceOp::MAX);
      if (r == dst) CHECK(longs == std::vector<int64_t>{P - 1, 1});
    }
    CHECK_THROWS_WITH_AS(accel::reduce_to(1.0, P), doctest::Contains(("dst=" + std::to_string(P)).c_str()),
                         std::invalid_argument);

    // gather_to: stacked on dst, empty elsewhere.
    const int dst = P - 1;
    const at::Tensor g = accel::gather_to(at::full({2}, r, at::kLong), dst);
    const auto scalars = accel::gather_to(static_cast<int16_t>(r), dst);
    const auto vectors = accel::gather_to(std::vector<float>{static_cast<float>(r), 0.5f}, dst);
    if (r == dst) {
      CHECK(g.sizes() == at::IntArrayRef({P, 2}));
      for (int k = 0; k < P; ++k) CHECK(at::equal(g[k], at::full({2}, k, at::kLong)));
      CHECK(scalars.size() == static_cast<std::size_t>(P));
      for (int k = 0; k < P; ++k) CHECK(scalars[k] == k);
      CHECK(vectors.back() == std::vector<float>{static_cast<float>(P - 1), 0.5f});
    } else {
      CHECK(g.numel() == 0);
      CHECK(scalars.empty());
      CHECK(vectors.empty());
    }

    // scatter from the last rank: tensors, scalars, and vectors of different lengths (part k: k+1 copies of k).
    std::vector<at::Tensor> tensor_parts;
    std::vector<int> scalar_parts;
    std::vector<std::vector<int>> vector_parts;
    if (r == dst)
      for (int k = 0; k < P; ++k) {
        tensor_parts.push_back(at::full({2, 2}, 10 * k, at::kInt));
        scalar_parts.push_back(7 * k);
        vector_parts.emplace_back(k + 1, k);
      }
    CHECK(at::equal(accel::scatter(tensor_parts, dst), at::full({2, 2}, 10 * r, at::kInt)));
    CHECK(accel::scatter(scalar_parts, dst) == 7 * r);
    CHECK(accel::scatter(vector_parts, dst) == std::vector<int>(r + 1, r));
    if (r == dst) {
      CHECK_THROWS_WITH_AS(accel::scatter(std::vector<int>(P + 1, 0), dst), doctest::Contains("parts; the group has"),
                           std::invalid_argument);
      tensor_parts.back() = at::ones({3});
    }
    if (P > 1)  // parts that disagree: every rank throws, the group stays in step
      CHECK_THROWS_WITH_AS(accel::scatter(tensor_parts, dst), doctest::Contains("share one shape"),
                           std::invalid_argument);

    // send/recv: tags keep two messages apart; a vector and a scalar.
    if (P > 1 && r < 2) {
      const int peer = 1 - r;
      if (r == 0) {
        accel::send(std::vector<double>{1, 2, 3}, peer, {}, 7);
        accel::send(int64_t{42}, peer, {}, 8);
      } else {
        CHECK(accel::recv(std::vector<double>(3), peer, {}, 7) == std::vector<double>{1, 2, 3});
        CHECK(accel::recv(int64_t{0}, peer, {}, 8) == 42);
      }
    }
    CHECK_THROWS_WITH_AS(accel::send(1, r), doctest::Contains("is this rank itself"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::recv(1, P), doctest::Contains("is not a rank of"), std::invalid_argument);

    CHECK_NOTHROW(accel::monitored_barrier());
    CHECK_NOTHROW(accel::monitored_barrier({}, std::chrono::seconds(30)));
    CHECK(accel::all_reduce(1, ReduceOp::SUM) == P);  // still in step
  }

  // torch's all_to_all_single(output, input, ...): into an output the caller keeps.
  TEST_CASE("all_to_all_single: into the caller's output, reused; staged when c10d cannot write it; checked") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    // Equal parts: row j of rank k holds 100 k + j; rank r receives rows 2r, 2r+1 of every rank.
    const at::Tensor rows = (at::arange(2 * P, at::kFloat) + 100 * r).unsqueeze(1).repeat({1, 3});
    const at::Tensor expected = accel::all_to_all(rows);
    at::Tensor output = at::empty({2 * P, 3}, at::kFloat);
    const void* memory = output.data_ptr();
    for (int call = 0; call < 2; ++call) {
      output.zero_();
      at::Tensor got = accel::all_to_all_single(output, rows);
      CHECK(got.data_ptr() == memory);  // received straight into it: nothing allocated for the result
      CHECK(at::equal(output, expected));
    }
    // An output c10d cannot write directly (a transposed view) and a dtype Gloo does not move (bfloat16).
    at::Tensor columns = at::empty({3, 2 * P}, at::kFloat);
    at::Tensor view = columns.t();
    accel::all_to_all_single(view, rows);
    CHECK(at::equal(columns.t(), expected));
    at::Tensor bf16 = at::empty({2 * P, 3}, at::kBFloat16);
    accel::all_to_all_single(bf16, rows.to(at::kBFloat16));
    CHECK(at::equal(bf16, expected.to(at::kBFloat16)));  // (bfloat16 rounds values past 256 alike)
    // Uneven: rank i sends i + j rows to rank j (as in the all_to_all test above).
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> segments, wanted;
    for (int j = 0; j < P; ++j) {
      in_splits.push_back(r + j);
      out_splits.push_back(j + r);
      segments.push_back((at::arange(r + j, at::kLong) + 1000 * r + 10 * j).unsqueeze(1));
      wanted.push_back((at::arange(j + r, at::kLong) + 1000 * j + 10 * r).unsqueeze(1));
    }
    at::Tensor uneven = at::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0}), 1}, at::kLong);
    CHECK(at::equal(accel::all_to_all_single_async(uneven, at::cat(segments), out_splits, in_splits).wait(),
                    at::cat(wanted)));
    CHECK(at::equal(uneven, at::cat(wanted)));
    // Mistakes, before anything is sent (the same on every rank).
    CHECK_THROWS_WITH_AS(accel::all_to_all_single(at::empty({2 * P, 4}), rows),
                         doctest::Contains(("output is Float[" + std::to_string(2 * P) + ", 4]").c_str()),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::all_to_all_single(at::empty({2 * P, 3}, at::kDouble), rows),
                         doctest::Contains("but this rank receives Float["), std::invalid_argument);
    at::Tensor same = rows.clone();
    CHECK_THROWS_WITH_AS(accel::all_to_all_single(same, same), doctest::Contains("share memory"),
                         std::invalid_argument);
    CHECK(accel::all_reduce(1, ReduceOp::SUM) == P);  // still in step
  }

  TEST_CASE("broadcast checks src against the group") {
    auto& d = world();
    const int P = d.get_world_size();
    CHECK_THROWS_WITH_AS(accel::broadcast(1.0, P), doctest::Contains("is not a rank of group 'world'"),
                         std::invalid_argument);
    CHECK_THROWS_AS(accel::broadcast(1.0, -1), std::invalid_argument);
  }

  TEST_CASE("a std::vector of 1000 doubles is one c10d collective") {
    auto& d = world();
    accel::GroupPtr g = d.world_group();
    start_sequence(g);
    const auto before = g->getSequenceNumberForGroup();
    std::vector<double> v(1000, d.get_rank() + 1.0);
    v = accel::all_reduce(std::move(v), ReduceOp::SUM, g);
    CHECK(g->getSequenceNumberForGroup() - before == 1);
    const int P = d.get_world_size();
    CHECK(v.front() == P * (P + 1) / 2.0);
    CHECK(v.back() == P * (P + 1) / 2.0);
    // A type no backend reduces natively still costs one collective.
    const auto before_bytes = g->getSequenceNumberForGroup();
    std::vector<uint32_t> u(1000, static_cast<uint32_t>(d.get_rank()) + 4000000000u / 8);
    u = accel::all_reduce(std::move(u), ReduceOp::MAX, g);
    CHECK(g->getSequenceNumberForGroup() - before_bytes == 1);
    CHECK(u[999] == static_cast<uint32_t>(P - 1) + 4000000000u / 8);
  }

  TEST_CASE("unsigned and extended types stay exact") {
    auto& d = world();
    const int P = d.get_world_size();
    const int r = d.get_rank();
    const uint64_t high = (uint64_t{1} << 63) + static_cast<uint64_t>(r);  // above INT64_MAX
    CHECK(accel::all_reduce(high, ReduceOp::MAX) == (uint64_t{1} << 63) + static_cast<uint64_t>(P - 1));
    CHECK(accel::all_reduce(high, ReduceOp::MIN) == uint64_t{1} << 63);
    CHECK(accel::all_gather(high).back() == high - static_cast<uint64_t>(r) + static_cast<uint64_t>(P - 1));
    const long double third = 1.0L / 3.0L + r;  // more digits than a double holds
    long double expected = 0;
    for (int i = 0; i < P; ++i) expected += 1.0L / 3.0L + i;
    CHECK(accel::all_reduce(third, ReduceOp::SUM) == expected);
    CHECK(accel::broadcast(third, 0) == 1.0L / 3.0L);
  }

  TEST_CASE("per-rank group count is constant: the world and one per mesh dimension") {
    const int before = accel::detail::groups_created().load();
    auto& d = fresh();
    // The world, mp_replicate, mp_shard, dp, cp, tp and pp (each one group both meshes share; of this rank alone
    // at size 1).
    CHECK(accel::detail::groups_created().load() - before == 7);
    CHECK(d.get_world_size(Dim::DP) == d.get_world_size());
    CHECK(d.get_world_size(Dim::CP) == 1);
    CHECK(d.get_world_size(Dim::MP_REPLICATE) == 1);
    CHECK(d.get_world_size(Dim::MP_SHARD) == d.get_world_size());
  }

  TEST_CASE("initialisation: instance() returns on no rank before every rank has made its groups") {
    // The last rank is held once its groups are made (a slow peer) until
    // another rank says, through a FIFO, that it returned from instance(),
    // or 1.5 s (poll's timeout). Before instance() waited for every rank,
    // the others returned at once, then could destroy their groups or exit
    // (and with rank 0 the store) under a rank still making its own
    // ("Connection reset by peer", seen in CI). The FIFO is open for reading
    // before the last rank makes its groups, so no other rank can have
    // returned before it is there to write to.
    release_world();
    const int P = accel::get_world_size(), r = accel::get_rank();
    if (!accel::is_distributed() || P < 2) return;
    const std::string fifo =
        (std::filesystem::temp_directory_path() / ("accel_init_wait_" + std::to_string(::getppid()))).string();
    int reader = -1;
    bool early = false;
    if (r == P - 1) {
      ::unlink(fifo.c_str());
      REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
      reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
      REQUIRE(reader >= 0);
      accel::detail::groups_made_hook() = [&] {
        pollfd ready{.fd = reader, .events = POLLIN, .revents = 0};
        early = ::poll(&ready, 1, 1500) > 0 && (ready.revents & POLLIN);
      };
    }
    auto& d = fresh();
    accel::detail::groups_made_hook() = [] {};
    if (r != P - 1) {
      const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // (none: another parent; nothing to say)
      if (writer >= 0) {
        CHECK(::write(writer, "r", 1) == 1);
        ::close(writer);
      }
    }
    CHECK_FALSE(early);
    d.barrier();
    if (r == P - 1) {
      ::close(reader);
      ::unlink(fifo.c_str());
    }
  }

  TEST_CASE("singleton: same object, conflicting config, destroy and afresh") {
    auto& a = world();
    auto& b = accel::DistributedInterface::instance();
    CHECK(&a == &b);
    CHECK(&accel::DistributedInterface::instance(test_config()) == &a);
    auto other = test_config();
    other.cp_size = 2;
    CHECK_THROWS_WITH_AS(accel::DistributedInterface::instance(other), doctest::Contains("already initialised"),
                         std::logic_error);
    other = test_config();
    other.timeout = std::chrono::seconds(61);
    CHECK_THROWS_AS(accel::DistributedInterface::instance(other), std::logic_error);

    a.destroy();
    auto& c = world();  // afresh: a new rendezvous and new groups that work
    const int P = c.get_world_size();
    CHECK(c.all_reduce(c.get_rank() + 1, ReduceOp::SUM) == P * (P + 1) / 2);
    std::ostringstream os;
    os << c;
    CHECK(os.str().find("is_distributed=true") != std::string::npos);
  }

  TEST_CASE("singleton: concurrent first calls build it once") {
    if (accel::DistributedInterface::is_initialized()) accel::DistributedInterface::instance().destroy();
    const int before = accel::detail::groups_created().load();
    std::vector<accel::DistributedInterface*> seen(4);
    std::vector<std::string> errors(4);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i)
      threads.emplace_back([&seen, &errors, i] {
        try {
          seen[i] = &accel::DistributedInterface::instance(test_config());
        } catch (const std::exception& e) {  // reported below, not std::terminate
          errors[i] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (const auto& e : errors) CHECK(e == "");
    REQUIRE(seen[0] != nullptr);
    for (auto* p : seen) CHECK(p == seen[0]);
    CHECK(accel::detail::groups_created().load() - before == 7);  // the world and one per dimension (tp's and pp's too)
    const int P = seen[0]->get_world_size();
    CHECK(seen[0]->all_reduce(1, ReduceOp::SUM, std::nullopt) == P);
  }

  TEST_CASE("main_process_first: the main process runs first and its result returns") {
    auto& d = world();
    const std::string marker = "/tmp/accel_test_mpf_" + std::string(std::getenv("MASTER_PORT"));
    if (d.get_rank() == 0) std::filesystem::remove(marker);
    d.barrier();
    bool saw_marker = accel::main_process_first([&] {
      const bool exists = std::filesystem::exists(marker);
      if (d.get_local_rank() == 0) std::ofstream(marker) << "made by the main process";
      return exists;
    });
    // The main process ran before the marker existed; every other rank after.
    CHECK(saw_marker == (d.get_local_rank() != 0));
    int ran = 0;
    accel::main_process_first([&] { ++ran; }, /*local_only=*/false);
    CHECK(ran == 1);
    d.barrier();
    if (d.get_rank() == 0) std::filesystem::remove(marker);
  }

  TEST_CASE("main_process_first: a throwing main releases the others with an error") {
    auto& d = world();
    bool others_ran = false;
    auto body = [&] {
      if (d.get_local_rank() == 0) throw std::runtime_error("cache build failed");
      others_ran = true;
    };
    if (d.get_local_rank() == 0) {
      CHECK_THROWS_WITH_AS(accel::main_process_first(body), "cache build failed", std::runtime_error);
    } else {
      CHECK_THROWS_WITH_AS(accel::main_process_first(body),
                           "accel::main_process_first: the main process (rank 0) threw; this rank did "
                           "not run the body",
                           accel::DistributedError);
      CHECK_FALSE(others_ran);
    }
    // The group is still in step afterwards.
    CHECK(d.all_reduce(1, ReduceOp::SUM, std::nullopt) == d.get_world_size());
  }

  TEST_CASE("new_group and split_group: members, ranks within them, outsiders alone, debug mode") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    // The even ranks, given in reverse order: group ranks follow the world's order.
    std::vector<int> evens;
    for (int k = P - 1; k >= 0; --k)
      if (k % 2 == 0) evens.push_back(k);
    const int even_count = static_cast<int>(evens.size());
    accel::GroupPtr g = accel::new_group(evens);
    REQUIRE(g);
    if (r % 2 == 0) {
      CHECK(g->getSize() == even_count);
      CHECK(g->getRank() == r / 2);
      CHECK(accel::all_reduce(int64_t{r}, ReduceOp::SUM, g) == int64_t{even_count} * (even_count - 1));
      CHECK(accel::broadcast(r, even_count - 1, g) == 2 * (even_count - 1));
    } else {  // not a member: a group of its own, collectives are the identity
      CHECK(g->getSize() == 1);
      CHECK(accel::all_reduce(int64_t{r}, ReduceOp::SUM, g) == r);
    }
    std::vector<int> every(static_cast<std::size_t>(P));
    std::iota(every.begin(), every.end(), 0);
    accel::GroupPtr all = accel::new_group(every);
    CHECK(all->getSize() == P);
    CHECK(accel::all_gather(r, all) == every);
    CHECK_THROWS_WITH_AS(accel::new_group({0, P}), doctest::Contains("is not a rank of the world"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::new_group({0, 0}), doctest::Contains("is given twice"), std::invalid_argument);
    CHECK_THROWS_AS(accel::new_group({}), std::invalid_argument);

    // split_group: same parity, ordered by key = -rank (so the highest rank is rank 0 within the group).
    accel::GroupPtr parity = accel::split_group(r % 2, -r);
    std::vector<int> same;
    for (int k = P - 1; k >= 0; --k)
      if (k % 2 == r % 2) same.push_back(k);
    CHECK(parity->getSize() == static_cast<int>(same.size()));
    CHECK(accel::all_gather(r, parity) == same);
    std::vector<int> splits(static_cast<std::size_t>(parity->getSize()) * 2, r);  // the new collectives run on it
    CHECK(accel::reduce_scatter(splits, ReduceOp::SUM, parity).size() == 2);
    // A negative color joins no group.
    accel::GroupPtr most = accel::split_group(r == 0 ? -1 : 7);
    CHECK(most->getSize() == (r == 0 ? 1 : P - 1));
    CHECK(accel::all_reduce(1, ReduceOp::SUM, most) == (r == 0 ? 1 : P - 1));
    // Debug mode: different ranks on different processes are named.
    if (P > 1) {
      accel::set_debug_mode(true);
      const std::string text =
          what_of([&] { accel::new_group(r == 0 ? std::vector<int>{0} : std::vector<int>{0, 1}); });
      accel::set_debug_mode(false);
      CHECK(text.find("rank 0: new_group([0])") != std::string::npos);
      CHECK(text.find("rank 1: new_group([0, 1])") != std::string::npos);
    }
    CHECK(accel::all_reduce(1, ReduceOp::SUM) == P);  // the world is still in step
  }

  TEST_CASE("init_device_mesh: named dimensions, slicing, flattening (Accelerate's dp_shard_cp), errors") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    // Accelerate's layout (dp_replicate, dp_shard, cp, tp) = (1, a, b, 1), a * b = P:
    // this rank's coordinate is (0, r / b, r % b, 0).
    const int a = P % 2 == 0 ? P / 2 : P, b = P / a;
    accel::DeviceMesh mesh = accel::init_device_mesh({1, a, b, 1}, {"dp_replicate", "dp_shard", "cp", "tp"});
    CHECK((mesh.shape() == std::vector<int>{1, a, b, 1}));
    CHECK((mesh.get_coordinate() == std::vector<int>{0, r / b, r % b, 0}));
    std::vector<int> all(static_cast<std::size_t>(P)), shard_line, cp_line;
    std::iota(all.begin(), all.end(), 0);
    for (int j = 0; j < a; ++j) shard_line.push_back(j * b + r % b);
    for (int k = 0; k < b; ++k) cp_line.push_back(r / b * b + k);
    CHECK(mesh.ranks() == all);
    const auto reaches = [&](const accel::DeviceMesh& m, std::string_view name, const std::vector<int>& members) {
      CAPTURE(name);
      CHECK(m.slice(name).ranks() == members);
      const int position = static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
      CHECK(m.slice(name).get_local_rank() == position);
      CHECK(m.slice(name).get_group()->getRank() == position);
      CHECK(accel::all_gather(r, m.slice(name).get_group()) == members);  // exactly these ranks, in this order
    };
    reaches(mesh, "dp_replicate", {r});
    reaches(mesh, "dp_shard", shard_line);
    reaches(mesh, "cp", cp_line);
    reaches(mesh, "tp", {r});
    // Accelerate's flattened dimensions; the root finds them by name afterwards.
    accel::DeviceMesh dp = mesh.slice("dp_replicate", "dp_shard").flatten("dp");
    accel::DeviceMesh dp_shard_cp = mesh.slice("dp_shard", "cp").flatten("dp_shard_cp");
    accel::DeviceMesh dp_cp = mesh.slice("dp_replicate", "dp_shard", "cp").flatten();  // default name
    CHECK((dp_cp.dim_names() == std::vector<std::string>{"dp_replicate_dp_shard_cp"}));
    reaches(mesh, "dp", shard_line);
    reaches(mesh, "dp_shard_cp", all);
    reaches(dp_cp, "dp_replicate_dp_shard_cp", all);
    CHECK(dp_shard_cp.get_local_rank() == r);
    CHECK(accel::all_reduce(int64_t{r}, ReduceOp::SUM, dp_shard_cp.get_group()) == int64_t{P} * (P - 1) / 2);
    // A sub-mesh mixing a root dimension and a flattened one.
    accel::DeviceMesh mixed = mesh.slice("dp_replicate", "dp_shard_cp");
    CHECK((mixed.shape() == std::vector<int>{1, P}));
    CHECK((mixed.get_coordinate() == std::vector<int>{0, r}));
    CHECK(mixed.ranks() == all);
    // Flattening the same dimensions under the same name again: the same group, no communication.
    CHECK(mesh.slice("dp_shard", "cp").flatten("dp_shard_cp").get_group().get() == dp_shard_cp.get_group().get());
    CHECK(mesh.get_group("dp_shard").get() == mesh.slice("dp_shard").get_group().get());
    std::ostringstream text;
    text << mixed;
    CHECK(text.str() == "DeviceMesh(cpu, shape=(1," + std::to_string(P) +
                            "), dims=(dp_replicate,dp_shard_cp), coordinate=(0," + std::to_string(r) + "))");

    // Errors, each naming what is wrong (no communication: every rank throws alike).
    CHECK_THROWS_WITH_AS(mesh.slice("cp", "dp_shard"), doctest::Contains("'dp_shard' must come after 'cp'"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(mesh.slice("cp", "cp"), doctest::Contains("must come after"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(mesh.slice("dp_shard", "dp"), doctest::Contains("must come after"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(mesh.slice("pp"),
                         doctest::Contains("no dimension named 'pp' in (dp_replicate, dp_shard, cp, tp)"),
                         std::invalid_argument);
    // As Python's: a flattened dimension is reached by slicing, not as a dimension of the root.
    CHECK_THROWS_WITH_AS(mesh.get_group("dp"), doctest::Contains("no dimension named 'dp'"), std::invalid_argument);
    CHECK_THROWS_AS(mesh.get_group(4), std::out_of_range);
    CHECK_THROWS_WITH_AS(mesh.slice("cp", "tp").flatten("dp"),
                         doctest::Contains("'dp' is already a flattened dimension of other dimensions"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(mesh.slice("cp", "tp").flatten("tp"),
                         doctest::Contains("'tp' is already a dimension of the root"), std::invalid_argument);
    const std::string world_text = ", the world has " + std::to_string(P) + " ranks";
    CHECK(what_of([&] {
            accel::init_device_mesh({P, 2}, {"x", "y"});
          }).find("the sizes multiply to " + std::to_string(2 * P) + world_text) != std::string::npos);
    CHECK(what_of([&] { accel::init_device_mesh({1 << 30, 1 << 30}, {"x", "y"}); }).find(world_text) !=
          std::string::npos);
    CHECK_THROWS_WITH_AS(accel::init_device_mesh({P, 1}, {"x"}), doctest::Contains("2 sizes but 1 names"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::init_device_mesh({P, 1}, {"x", "x"}), doctest::Contains("the name 'x' is given twice"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::init_device_mesh({P, 0}, {"x", "y"}),
                         doctest::Contains("the size of 'y' must be positive, got 0"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::init_device_mesh({P}, {""}), doctest::Contains("dimension 0 has no name"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(accel::init_device_mesh({}, {}), doctest::Contains("at least one dimension"),
                         std::invalid_argument);
    // Debug mode: different meshes on different ranks are named, rank by rank.
    if (P > 1) {
      accel::set_debug_mode(true);
      const std::string call = what_of([&] {
        if (r == 0) accel::init_device_mesh({P}, {"x"});
        else accel::init_device_mesh({1, P}, {"x", "y"});
      });
      const std::string flat = what_of([&] { mesh.slice("dp_shard", "cp").flatten(r == 0 ? "one" : "other"); });
      accel::set_debug_mode(false);
      CHECK(call.find("rank 0: init_device_mesh((" + std::to_string(P) + "), (x))") != std::string::npos);
      CHECK(call.find("rank 1: init_device_mesh((1, " + std::to_string(P) + "), (x, y))") != std::string::npos);
      CHECK(flat.find("rank 0: DeviceMesh::flatten('one') of (dp_shard, cp)") != std::string::npos);
    }
    CHECK(accel::all_reduce(1, ReduceOp::SUM) == P);  // the world is still in step
    // A mesh outliving its interface keeps its groups but cannot make new ones.
    d.destroy();
    CHECK_THROWS_WITH_AS(mesh.slice("cp", "tp").flatten(), doctest::Contains("was destroyed"), std::logic_error);
    CHECK(mesh.slice("dp_shard_cp").ranks() == all);
    CHECK(world().get_world_size() == P);
  }

  TEST_CASE("async forms: the blocking forms' results, in flight together, owning their buffers") {
    auto& d = world();
    const int P = d.get_world_size(), r = d.get_rank();
    const int64_t tri = int64_t{P} * (P - 1) / 2;  // 0 + 1 + ... + P-1
    // Issued together (ranks in the same order), waited for in reverse.
    at::Tensor t = at::arange(6, at::kFloat) + r;                             // in place
    at::Tensor strided = (at::arange(12, at::kDouble).view({3, 4}) + r).t();  // not contiguous: staged
    at::Tensor half = (at::arange(4, at::kFloat) + r).to(at::kBFloat16);      // bf16 on Gloo: reduced in float32
    auto w_tensor = accel::all_reduce_async(t, ReduceOp::SUM);
    auto w_strided = accel::all_reduce_async(strided, ReduceOp::MAX);
    auto w_half = accel::all_reduce_async(half, ReduceOp::SUM);
    auto w_mean = accel::all_reduce_async(std::vector<double>{1.0 * r, 2.0 * r}, ReduceOp::MEAN);
    auto w_scalar = accel::all_reduce_async(int64_t{r}, ReduceOp::SUM);
    auto w_exact = accel::all_reduce_async(std::vector<uint64_t>{(1ull << 63) + r}, ReduceOp::MAX);  // folded
    auto w_bcast = accel::broadcast_async(std::vector<int>{r, r + 1}, P - 1);
    std::optional<accel::Work<std::vector<std::vector<int64_t>>>> w_gather;
    {
      std::vector<int64_t> short_lived{r, 10 * r};
      w_gather.emplace(accel::all_gather_async(short_lived));
      short_lived.assign({-1, -1});  // the Work holds its own copy
    }
    auto w_gather_tensor = accel::all_gather_async(at::full({2}, r, at::kLong));
    const at::Tensor base = at::arange(2 * P, at::kFloat);
    auto w_scatter = accel::reduce_scatter_async(base + 100 * r, ReduceOp::SUM);
    auto w_a2a = accel::all_to_all_async(at::arange(P, at::kLong) + 100 * r);
    std::vector<int64_t> in_splits, out_splits;  // rank i sends j rows to rank j
    for (int j = 0; j < P; ++j) {
      in_splits.push_back(j);
      out_splits.push_back(r);
    }
    auto w_uneven = accel::all_to_all_async(at::full({tri}, r, at::kLong), out_splits, in_splits);

    at::Tensor expected_a2a = at::arange(P, at::kLong) * 100 + r;
    CHECK(at::equal(w_uneven.wait(), at::arange(P, at::kLong).repeat_interleave(r)));
    CHECK(at::equal(w_a2a.wait(), expected_a2a));
    CHECK(at::equal(w_scatter.wait(), base.slice(0, 2 * r, 2 * r + 2) * P + 100 * tri));
    CHECK(at::equal(w_gather_tensor.wait(), at::arange(P, at::kLong).unsqueeze(1).repeat({1, 2})));
    std::vector<std::vector<int64_t>> gathered;
    for (int k = 0; k < P; ++k) gathered.push_back({k, 10 * k});
    CHECK(w_gather->wait() == gathered);
    CHECK(w_bcast.wait() == std::vector<int>{P - 1, P});
    CHECK(w_exact.wait() == std::vector<uint64_t>{(1ull << 63) + P - 1});
    CHECK(w_scalar.wait() == tri);
    CHECK(w_mean.wait() == std::vector<double>{tri / double(P), 2 * tri / double(P)});
    const at::Tensor half_sum = w_half.wait();
    CHECK(half_sum.is_same(half));  // in place, back in bf16
    CHECK(at::equal(half, ((at::arange(4, at::kFloat) * P) + tri).to(at::kBFloat16)));
    CHECK(at::equal(w_strided.wait(), (at::arange(12, at::kDouble).view({3, 4}) + (P - 1)).t()));
    // Done, or soon: Gloo runs a group's operations on two threads, so the
    // first one may land after later ones (a check of is_completed() right
    // here failed once on a loaded machine).
    CHECK(w_tensor.wait_for(std::chrono::seconds(60)));
    CHECK(w_tensor.is_completed());
    CHECK(at::equal(w_tensor.wait(), at::arange(6, at::kFloat) * P + tri));
    CHECK(at::equal(t, at::arange(6, at::kFloat) * P + tri));

    // Work itself: waited for once, then completed (as torch's Work.isCompleted()); moves; a default
    // or moved-from one holds nothing.
    CHECK_FALSE(w_tensor.valid());
    CHECK(w_tensor.is_completed());
    CHECK(w_tensor.wait_for(std::chrono::milliseconds(0)));
    CHECK_THROWS_WITH_AS(w_tensor.wait(), doctest::Contains("already waited for"), accel::LogicError);
    accel::Work<int> none;
    CHECK_THROWS_WITH_AS(none.is_completed(), doctest::Contains("holds no operation"), accel::LogicError);
    CHECK_THROWS_WITH_AS(none.wait(), doctest::Contains("holds no operation"), accel::LogicError);
    none = accel::all_reduce_async(1, ReduceOp::SUM);
    accel::Work<int> moved = std::move(none);
    CHECK_FALSE(none.valid());
    CHECK_THROWS_WITH_AS(none.wait_for(std::chrono::milliseconds(0)), doctest::Contains("holds no operation"),
                         accel::LogicError);
    CHECK(moved.wait() == P);
    accel::Work<int> waited = std::move(moved);  // "completed" moves with the Work
    CHECK(waited.is_completed());
    CHECK_THROWS_AS(moved.is_completed(), accel::LogicError);
    // Dropped without wait(): it is waited for and lands (the tensor holds the mean).
    at::Tensor dropped = at::full({3}, float(r));
    {
      auto unwaited = accel::all_reduce_async(dropped, ReduceOp::MEAN);
    }
    CHECK(at::equal(dropped, at::full({3}, tri / float(P))));
    // Checks come before anything moves, as in the blocking forms.
    CHECK_THROWS_AS(accel::all_reduce_async(at::ones({2}, at::kLong), ReduceOp::MEAN), std::invalid_argument);
    CHECK_THROWS_AS(accel::broadcast_async(1, P), std::invalid_argument);
    if (P > 1) CHECK_THROWS_AS(accel::isend(1, r), std::invalid_argument);
    // A tensor whose elements share memory cannot take a result in place: refused on every rank before
    // anything is sent (c10d would throw its own error after the collective ran; one process would
    // not notice), so the next collective still pairs up.
    const at::Tensor overlapping = at::full({1}, 1.0).expand({4});
    CHECK_THROWS_WITH_AS(accel::all_reduce(overlapping, ReduceOp::SUM), doctest::Contains("share memory"),
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(accel::all_reduce_async(overlapping, ReduceOp::SUM),
                         doctest::Contains("accel::all_reduce: the Float[4] cpu has elements that share memory"),
                         accel::InvalidArgument);
    CHECK_THROWS_AS(accel::broadcast(overlapping, 0), accel::InvalidArgument);
    CHECK_THROWS_AS(accel::reduce_to(overlapping, 0), accel::InvalidArgument);
    if (P > 1) CHECK_THROWS_AS(accel::irecv(overlapping, (r + 1) % P), accel::InvalidArgument);
    CHECK(accel::all_reduce(at::full({1}, 1.0).expand({4}).contiguous(), ReduceOp::SUM).equal(at::full({4}, 1.0 * P)));

    if (P > 1) {
      // Not completed while a peer has not joined: rank 0's operations wait for the others, which join
      // only after a barrier on a second group that rank 0 enters after asking.
      std::vector<int> every(static_cast<std::size_t>(P));
      std::iota(every.begin(), every.end(), 0);
      accel::GroupPtr side = accel::new_group(every);
      if (r == 0) {
        auto w = accel::all_reduce_async(int64_t{1}, ReduceOp::SUM);
        auto received = accel::irecv(std::vector<float>(3), 1, {}, /*tag=*/7);
        CHECK_FALSE(w.is_completed());
        CHECK_FALSE(w.wait_for(std::chrono::milliseconds(30)));
        CHECK_FALSE(received.is_completed());  // Gloo's recv: watched by a thread of accel's
        CHECK_FALSE(received.wait_for(std::chrono::milliseconds(30)));
        accel::barrier(side);
        CHECK(w.wait_for(std::chrono::seconds(60)));
        CHECK(w.wait() == P);
        CHECK(received.wait_for(std::chrono::seconds(60)));
        CHECK(received.wait() == std::vector<float>{1.5f, 2.5f, 3.5f});
      } else {
        accel::barrier(side);
        CHECK(accel::all_reduce(int64_t{1}, ReduceOp::SUM) == P);
        if (r == 1) {
          std::optional<accel::Work<void>> sent;
          {
            const std::vector<float> short_lived{1.5f, 2.5f, 3.5f};
            sent.emplace(accel::isend(short_lived, 0, {}, 7));
          }
          sent->wait();
        }
      }
      // Point to point both ways at once (a ring): no deadlock, every rank's value arrives.
      const int next = (r + 1) % P, prev = (r + P - 1) % P;
      auto to_next = accel::isend(at::full({2}, r, at::kInt), next);
      auto from_prev = accel::irecv(at::empty({2}, at::kInt), prev);
      CHECK(at::equal(from_prev.wait(), at::full({2}, prev, at::kInt)));
      to_next.wait();
    }
    CHECK(accel::all_reduce(1, ReduceOp::SUM) == P);  // the world is still in step
  }

  TEST_CASE("cleanup") { release_world(); }
}

// == mesh4: every mesh dimension at world size 4 ==============================

namespace {
// The groups init_device_mesh makes for arange(4).reshape(rows, cols): along
// dim 0 a column of the grid, along dim 1 a row.
std::vector<int> expected_group(int rank, int rows, int cols, int axis) {
  std::vector<std::vector<int>> grid(rows, std::vector<int>(cols));
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) grid[i][j] = i * cols + j;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j)
      if (grid[i][j] == rank) {
        std::vector<int> members;
        if (axis == 0)
          for (int k = 0; k < rows; ++k) members.push_back(grid[k][j]);
        else
          for (int k = 0; k < cols; ++k) members.push_back(grid[i][k]);
        return members;
      }
  return {};
}

// init_device_mesh's group along root dimensions `dims` through `rank` of
// arange(world).reshape(shape): every rank whose coordinates off `dims` equal
// this rank's, in rank order (= row-major over `dims`).
std::vector<int> brute_force_group(const std::vector<int>& shape, int rank, const std::vector<int>& dims) {
  const auto coordinate = [&](int r) {
    std::vector<int> c(shape.size());
    for (std::size_t d = shape.size(); d-- > 0;) c[d] = r % shape[d], r /= shape[d];
    return c;
  };
  const int world = std::accumulate(shape.begin(), shape.end(), 1, std::multiplies<>());
  std::vector<int> members;
  for (int r = 0; r < world; ++r) {
    bool same = true;
    for (std::size_t d = 0; d < shape.size(); ++d)
      if (std::find(dims.begin(), dims.end(), static_cast<int>(d)) == dims.end() &&
          coordinate(r)[d] != coordinate(rank)[d])
        same = false;
    if (same) members.push_back(r);
  }
  return members;
}

// Accelerate's (dp_replicate, dp_shard, cp, tp) meshes at world size 4.
std::vector<std::vector<int>> accelerate_layouts() {
  return {{2, 2, 1, 1}, {1, 2, 2, 1}, {2, 1, 2, 1}, {1, 1, 2, 2}, {2, 1, 1, 2}, {1, 4, 1, 1}};
}
// The flattened dimensions Accelerate's ParallelismConfig builds.
void flatten_as_accelerate(const accel::DeviceMesh& mesh) {
  mesh.slice("dp_replicate", "dp_shard").flatten("dp");
  mesh.slice("dp_shard", "cp").flatten("dp_shard_cp");
  mesh.slice("dp_replicate", "dp_shard", "cp").flatten("dp_cp");
}

void check_dimension(accel::DistributedInterface& d, Dim dim, int rows, int cols, int axis) {
  CAPTURE(accel::to_string(dim));
  const int rank = d.get_rank();
  const auto members = expected_group(rank, rows, cols, axis);
  const int position = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  CHECK(d.get_world_size(dim) == static_cast<int>(members.size()));
  CHECK(d.get_rank(dim) == position);
  CHECK(d.get_group(dim)->getSize() == static_cast<int>(members.size()));
  CHECK(d.get_group(dim)->getRank() == position);
  CHECK(d.get_device_mesh(dim)->ranks() == members);
  // The collectives reach exactly these ranks, in this order.
  auto gathered = d.all_gather(static_cast<int64_t>(rank), dim);
  CHECK(std::vector<int>(gathered.begin(), gathered.end()) == members);
  int64_t sum = 0;
  for (int m : members) sum += m;
  CHECK(d.all_reduce(static_cast<int64_t>(rank), ReduceOp::SUM, dim) == sum);
  CHECK(d.broadcast(static_cast<int64_t>(rank), static_cast<int>(members.size()) - 1, dim) == members.back());
}
}  // namespace

TEST_SUITE("mesh4") {
  TEST_CASE("every mesh dimension under (2,2 | 2,2), (1,4 | 4,1) and (4,1 | 1,4)") {
    REQUIRE(accel::get_world_size() == 4);
    struct Case {
      int mp_replicate, mp_shard, dp, cp;
    };
    for (Case c : {Case{2, 2, 2, 2}, Case{1, 4, 4, 1}, Case{4, 1, 1, 4}}) {
      CAPTURE(c.mp_replicate);
      CAPTURE(c.dp);
      auto& d =
          fresh({.mp_replicate_size = c.mp_replicate, .mp_shard_size = c.mp_shard, .dp_size = c.dp, .cp_size = c.cp});
      CHECK((d.strategy().model_mesh_shape() == std::array{c.mp_replicate, c.mp_shard}));
      CHECK((d.strategy().data_mesh_shape() == std::array{c.dp, c.cp}));
      CHECK(
          (d.model_mesh()->get_coordinate() == std::vector<int>{d.get_rank() / c.mp_shard, d.get_rank() % c.mp_shard}));
      CHECK((d.data_mesh()->get_coordinate() == std::vector<int>{d.get_rank() / c.cp, d.get_rank() % c.cp}));
      check_dimension(d, Dim::MP_REPLICATE, c.mp_replicate, c.mp_shard, 0);
      check_dimension(d, Dim::MP_SHARD, c.mp_replicate, c.mp_shard, 1);
      check_dimension(d, Dim::DP, c.dp, c.cp, 0);
      check_dimension(d, Dim::CP, c.dp, c.cp, 1);
    }
    accel::DistributedInterface::instance().destroy();
  }

  TEST_CASE("tp: the innermost dimension of both meshes, one group shared by them; out of view at tp 1") {
    REQUIRE(accel::get_world_size() == 4);
    struct Case {
      int mp_replicate, cp, tp;
    };
    for (Case c : {Case{1, 1, 2}, Case{2, 2, 2}, Case{1, 1, 4}}) {
      CAPTURE(c.mp_replicate * 100 + c.cp * 10 + c.tp);
      const int rest = 4 / c.tp, mp_shard = rest / c.mp_replicate, dp = rest / c.cp;
      auto& d = fresh({.mp_replicate_size = c.mp_replicate, .cp_size = c.cp, .tp_size = c.tp});
      const int rank = d.get_rank();
      CHECK(d.strategy().tp_size() == c.tp);
      CHECK((d.model_mesh()->shape() == std::vector<int>{c.mp_replicate, mp_shard, c.tp}));
      CHECK((d.model_mesh()->dim_names() == std::vector<std::string>{"mp_replicate", "mp_shard", "tp"}));
      CHECK((d.data_mesh()->shape() == std::vector<int>{dp, c.cp, c.tp}));
      CHECK((d.data_mesh()->dim_names() == std::vector<std::string>{"dp", "cp", "tp"}));
      // Every dimension's group against arange(4).reshape(shape), by brute force.
      const std::vector<int> model{c.mp_replicate, mp_shard, c.tp}, data{dp, c.cp, c.tp};
      const std::pair<Dim, std::pair<const std::vector<int>*, int>> dims[] = {{Dim::MP_REPLICATE, {&model, 0}},
                                                                              {Dim::MP_SHARD, {&model, 1}},
                                                                              {Dim::DP, {&data, 0}},
                                                                              {Dim::CP, {&data, 1}},
                                                                              {Dim::TP, {&model, 2}}};
      for (const auto& entry : dims) {
        const Dim dim = entry.first;
        CAPTURE(accel::to_string(dim));
        const auto members = brute_force_group(*entry.second.first, rank, {entry.second.second});
        CHECK(d.get_device_mesh(dim)->ranks() == members);
        CHECK(d.get_world_size(dim) == static_cast<int>(members.size()));
        CHECK(d.get_rank(dim) == static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin()));
        auto gathered = d.all_gather(static_cast<int64_t>(rank), dim);
        CHECK(std::vector<int>(gathered.begin(), gathered.end()) == members);
      }
      CHECK(d.get_rank(Dim::TP) == rank % c.tp);  // adjacent ranks
      // One tp group, whichever mesh it is reached through.
      CHECK(d.get_group(Dim::TP).get() == d.model_mesh()->get_group("tp").get());
      CHECK(d.get_group(Dim::TP).get() == d.data_mesh()->get_group("tp").get());
      CHECK(accel::detail::describe(*d.get_group(Dim::TP)).find("group 'tp{mp_replicate=") != std::string::npos);
      // The data-parallel ranks of this tp coordinate: dp and cp flattened.
      const auto dp_cp = brute_force_group(data, rank, {0, 1});
      CHECK(d.data_mesh()->slice("dp_cp").ranks() == dp_cp);
      CHECK(accel::all_gather(rank, d.data_mesh()->slice("dp_cp").get_group()) == dp_cp);
      std::ostringstream printed;
      printed << d;
      CHECK(printed.str().find("tp_size=" + std::to_string(c.tp) + ")") != std::string::npos);
      CHECK(printed.str().find("dims=(mp_replicate,mp_shard,tp)") != std::string::npos);
    }
    // tp 1: the meshes print and name their groups as before tp existed; Dim::TP is this rank alone.
    auto& d = fresh({.mp_replicate_size = 2});
    const int rank = d.get_rank();
    std::ostringstream printed;
    printed << d;
    CHECK(printed.str().find("tp") == std::string::npos);
    CHECK(d.model_mesh()->ndim() == 2);
    CHECK(d.data_mesh()->ndim() == 2);
    CHECK(accel::detail::describe(*d.get_group(Dim::MP_SHARD)) ==
          "group 'mp_shard{mp_replicate=" + std::to_string(rank / 2) + "}' (gloo, rank " + std::to_string(rank % 2) +
              " of 2)");
    CHECK(d.get_world_size(Dim::TP) == 1);
    CHECK(d.get_rank(Dim::TP) == 0);
    CHECK(d.get_device_mesh(Dim::TP)->ranks() == std::vector<int>{rank});
    CHECK(d.get_group(Dim::TP)->getSize() == 1);  // never null: a null group is the world
    CHECK(d.all_reduce(static_cast<int64_t>(rank), ReduceOp::SUM, Dim::TP) == rank);
    CHECK(d.get_group(Dim::TP).get() == d.data_mesh()->slice("tp").get_group().get());
    // pp 1 likewise: out of view, Dim::PP this rank alone.
    CHECK(printed.str().find("pp") == std::string::npos);
    CHECK(d.get_world_size(Dim::PP) == 1);
    CHECK(d.get_rank(Dim::PP) == 0);
    CHECK(d.get_group(Dim::PP)->getSize() == 1);
    CHECK(d.get_group(Dim::PP).get() == d.model_mesh()->slice("pp").get_group().get());
    d.destroy();
  }

  TEST_CASE("pp: the outermost dimension of both meshes, one group shared by them; beside tp and cp") {
    REQUIRE(accel::get_world_size() == 4);
    struct Case {
      int mp_replicate, cp, tp, pp;
    };
    for (Case c : {Case{1, 1, 1, 2}, Case{1, 1, 1, 4}, Case{1, 1, 2, 2}, Case{2, 1, 1, 2}, Case{1, 2, 1, 2}}) {
      CAPTURE(c.mp_replicate * 1000 + c.cp * 100 + c.tp * 10 + c.pp);
      const int rest = 4 / c.tp / c.pp, mp_shard = rest / c.mp_replicate, dp = rest / c.cp;
      auto& d = fresh({.mp_replicate_size = c.mp_replicate, .cp_size = c.cp, .tp_size = c.tp, .pp_size = c.pp});
      const int rank = d.get_rank();
      CHECK(d.strategy().pp_size() == c.pp);
      // The meshes as Python's init_device_mesh((pp, ..., tp)) would hold them (tp out of view at 1).
      std::vector<int> model{c.pp, c.mp_replicate, mp_shard}, data{c.pp, dp, c.cp};
      std::vector<std::string> model_names{"pp", "mp_replicate", "mp_shard"}, data_names{"pp", "dp", "cp"};
      if (c.tp > 1) {
        model.push_back(c.tp), data.push_back(c.tp);
        model_names.emplace_back("tp"), data_names.emplace_back("tp");
      }
      CHECK(d.model_mesh()->shape() == model);
      CHECK(d.model_mesh()->dim_names() == model_names);
      CHECK(d.data_mesh()->shape() == data);
      CHECK(d.data_mesh()->dim_names() == data_names);
      // Every dimension's group against arange(4).reshape(shape), by brute force.
      const std::pair<Dim, std::pair<const std::vector<int>*, int>> dims[] = {{Dim::PP, {&model, 0}},
                                                                              {Dim::MP_REPLICATE, {&model, 1}},
                                                                              {Dim::MP_SHARD, {&model, 2}},
                                                                              {Dim::DP, {&data, 1}},
                                                                              {Dim::CP, {&data, 2}}};
      for (const auto& entry : dims) {
        CAPTURE(accel::to_string(entry.first));
        const auto members = brute_force_group(*entry.second.first, rank, {entry.second.second});
        CHECK(d.get_device_mesh(entry.first)->ranks() == members);
        CHECK(d.get_rank(entry.first) ==
              static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin()));
        CHECK(accel::all_gather(rank, d.get_group(entry.first)) == members);
      }
      CHECK(d.get_rank(Dim::PP) == rank / (4 / c.pp));  // the outermost: stages of adjacent blocks of ranks
      CHECK(d.get_rank(Dim::TP) == rank % c.tp);
      // One pp group, whichever mesh it is reached through.
      CHECK(d.get_group(Dim::PP).get() == d.model_mesh()->get_group("pp").get());
      CHECK(d.get_group(Dim::PP).get() == d.data_mesh()->get_group("pp").get());
      // The data-parallel ranks of this (pp, tp) coordinate: dp and cp flattened.
      const auto dp_cp = brute_force_group(data, rank, {1, 2});
      CHECK(d.data_mesh()->slice("dp_cp").ranks() == dp_cp);
      CHECK(accel::all_gather(rank, d.data_mesh()->slice("dp_cp").get_group()) == dp_cp);
      std::ostringstream printed;
      printed << d;
      CHECK(printed.str().find("pp_size=" + std::to_string(c.pp) + ")") != std::string::npos);
      CHECK(printed.str().find("dims=(pp,mp_replicate,mp_shard") != std::string::npos);
    }
    accel::DistributedInterface::instance().destroy();
  }

  TEST_CASE("init_device_mesh: Accelerate's 4-d layouts and flattened dimensions, every group by brute force") {
    auto& d = world();
    const int rank = d.get_rank();
    const std::vector<std::string> names{"dp_replicate", "dp_shard", "cp", "tp"};
    for (const std::vector<int>& shape : accelerate_layouts()) {
      CAPTURE(shape[0] * 1000 + shape[1] * 100 + shape[2] * 10 + shape[3]);
      accel::DeviceMesh mesh = accel::init_device_mesh(shape, names);
      flatten_as_accelerate(mesh);
      for (const auto& entry : std::vector<std::pair<std::string, std::vector<int>>>{{"dp_replicate", {0}},
                                                                                     {"dp_shard", {1}},
                                                                                     {"cp", {2}},
                                                                                     {"tp", {3}},
                                                                                     {"dp", {0, 1}},
                                                                                     {"dp_shard_cp", {1, 2}},
                                                                                     {"dp_cp", {0, 1, 2}}}) {
        const std::string& name = entry.first;  // (CAPTURE's lambda cannot take a structured binding on clang < 16)
        const std::vector<int>& dims = entry.second;
        CAPTURE(name);
        const auto members = brute_force_group(shape, rank, dims);
        CHECK(mesh.slice(name).ranks() == members);
        CHECK(accel::all_gather(rank, mesh.slice(name).get_group()) == members);
        CHECK(mesh.slice(name).get_local_rank() ==
              static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin()));
      }
    }
  }
}

// == exit: leaving without destroy() ==========================================

TEST_SUITE("exit") {
  TEST_CASE("a live interface at exit is released cleanly by static destruction") {
    auto& d = world();
    CHECK(d.all_reduce(1, ReduceOp::SUM, std::nullopt) == d.get_world_size());
  }
}

// == peer_gone: a rank that disappears ========================================

TEST_SUITE("peer_gone") {
  // c10d waits for a Gloo point-to-point message for ever unless given a timeout: each rank of a pair receives
  // from the other, neither sends, both live on. (First: the next case's rank leaves the world.)
  TEST_CASE("a receive from a live peer that never sends throws by the group's timeout, naming it and the group") {
    release_world();
    auto& d = accel::DistributedInterface::instance(accel::DistributedConfig{.timeout = std::chrono::seconds(2)});
    const int P = d.get_world_size(), r = d.get_rank();
    if (P % 2 == 0 || r + 1 < P) {  // (an odd world's last rank has no partner)
      const auto start = std::chrono::steady_clock::now();
      CHECK_THROWS_WITH_AS(accel::recv(at::zeros({4}), r ^ 1), doctest::Contains("accel::recv failed on group 'world'"),
                           accel::DistributedError);
      const double waited = seconds_since(start);
      MESSAGE("recv threw after " << waited << " s");
      CHECK(waited < 30);  // the 2 s timeout and the roll call, not for ever (the launcher's 60 s)
    }
    release_world();
  }

  TEST_CASE("a rank that leaves makes the others' collective throw, naming it and the group") {
    auto& d = accel::DistributedInterface::instance(accel::DistributedConfig{.timeout = std::chrono::seconds(10)});
    d.barrier();
    const int P = d.get_world_size();
    if (d.get_rank() == P - 1) std::_Exit(0);  // gone without a word, mid-program
    CHECK_THROWS_WITH_AS(d.all_reduce(1.0, ReduceOp::SUM, std::nullopt),
                         doctest::Contains("accel::all_reduce failed on group 'world' (gloo, rank"),
                         accel::DistributedError);
  }
}

// == async_peer_gone: a rank that dies while async operations wait for it =====
// Each operation in a world of its own (accel::spawn): the dead rank ends it.

TEST_SUITE("async_peer_gone") {
  TEST_CASE("a peer that dies during an async operation makes wait() throw, naming the operation and the group") {
    for (const char* op : {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"}) {
      CAPTURE(op);
      std::optional<EnvGuard> env;
      if (!std::getenv("ACCEL_SPAWNED_RANK"))  // the ranks run the first spawn they reach, with this op
        env.emplace(std::initializer_list<std::pair<const char*, const char*>>{{"ACCEL_TEST_ASYNC_OP", op}});
      std::ostringstream out;
      accel::LaunchOptions options;
      options.out = &out;
      options.timeout = std::chrono::seconds(90);
      const int status = accel::spawn(
          2,
          [] {
            const std::string name = std::getenv("ACCEL_TEST_ASYNC_OP");
            auto& d =
                accel::DistributedInterface::instance(accel::DistributedConfig{.timeout = std::chrono::seconds(20)});
            // Writing to the dead peer's socket must not kill this rank with SIGPIPE (status 141, seen in CI).
            struct sigaction disposition{};
            if (sigaction(SIGPIPE, nullptr, &disposition) != 0 || disposition.sa_handler != SIG_IGN) return 4;
            d.barrier();
            if (d.get_rank() == 1) std::_Exit(0);  // gone without a word
            const auto start = std::chrono::steady_clock::now();
            accel::Work<at::Tensor> reduced;
            try {
              const at::Tensor x = at::ones({4}, at::kFloat);
              if (name == "all_reduce") (reduced = accel::all_reduce_async(x, ReduceOp::SUM)).wait();
              else if (name == "broadcast") accel::broadcast_async(x, 1).wait();
              else if (name == "all_gather") accel::all_gather_async(x).wait();
              else if (name == "reduce_scatter") accel::reduce_scatter_async(x).wait();
              else if (name == "all_to_all") accel::all_to_all_async(x).wait();
              else if (name == "send")
                accel::isend(at::ones({1 << 24}, at::kFloat), 1).wait();  // 64 MB: not buffered away
              else accel::irecv(x, 1).wait();
              std::cout << "wait() returned" << std::endl;
              return 2;
            } catch (const accel::DistributedError& e) {
              std::cout << "threw after " << seconds_since(start) << " s: " << e.what() << std::endl;
              if (name == "all_reduce" && !reduced.is_completed()) return 5;  // it ended, with an error: completed
              return std::string(e.what()).find("accel::" + name + " failed on group 'world'") != std::string::npos ? 0
                                                                                                                    : 3;
            }
          },
          options);
      MESSAGE(out.str());
      CHECK(status == 0);
    }
  }
}

// == torchrun: started by Python's launcher =====================================

TEST_SUITE("torchrun") {
  TEST_CASE("torchrun: its agent's store, and every mesh dimension's group equals Python's init_device_mesh's") {
    // Really under torchrun: its agent serves the store, every rank connects.
    REQUIRE(accel::detail::getenv_str("TORCHELASTIC_USE_AGENT_STORE") == "True");
    CHECK(accel::launcher() == "torchrun");
    const int P = accel::get_world_size();
    const int rank = accel::get_rank();
    CHECK(accel::get_local_world_size() == P);
    CHECK(accel::get_local_rank() == rank);
    // tests/python_ref/mesh_groups.py, run under torchrun with the same world,
    // wrote the global ranks of mesh[name].get_group() on each rank.
    const auto dir = accel::detail::getenv_str("ACCEL_PYTHON_MESH_DIR");
    REQUIRE(dir.has_value());
    std::ifstream file(*dir + "/rank" + std::to_string(rank) + ".txt");
    REQUIRE(file.good());
    const std::string python((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    REQUIRE(!python.empty());
    std::ostringstream ours;
    for (int mp_replicate = 1; mp_replicate <= P; ++mp_replicate) {
      if (P % mp_replicate) continue;
      for (int cp = 1; cp <= P; ++cp) {
        if (P % cp) continue;
        auto& d = fresh({.mp_replicate_size = mp_replicate, .cp_size = cp});
        for (Dim dim : {Dim::MP_REPLICATE, Dim::MP_SHARD, Dim::DP, Dim::CP}) {
          const auto& members = d.get_device_mesh(dim)->ranks();
          ours << mp_replicate << ' ' << P / mp_replicate << ' ' << P / cp << ' ' << cp << ' ' << dim << ':';
          for (int m : members) ours << ' ' << m;
          ours << '\n';
          // The group reaches exactly these ranks, in this order.
          auto gathered = d.all_gather(static_cast<int64_t>(rank), dim);
          CHECK(std::vector<int>(gathered.begin(), gathered.end()) == members);
        }
      }
    }
    // tp above 1, innermost in both meshes (mesh_groups.py writes the same lines).
    for (int tp = 2; tp <= P; ++tp) {
      if (P % tp) continue;
      for (int mp_replicate = 1; mp_replicate <= P / tp; ++mp_replicate) {
        if ((P / tp) % mp_replicate) continue;
        for (int cp = 1; cp <= P / tp; ++cp) {
          if ((P / tp) % cp) continue;
          auto& d = fresh({.mp_replicate_size = mp_replicate, .cp_size = cp, .tp_size = tp});
          for (Dim dim : {Dim::MP_REPLICATE, Dim::MP_SHARD, Dim::TP, Dim::DP, Dim::CP, Dim::TP}) {
            const auto& members = d.get_device_mesh(dim)->ranks();
            ours << "tp " << mp_replicate << ' ' << P / tp / mp_replicate << ' ' << P / tp / cp << ' ' << cp << ' '
                 << tp << ' ' << dim << ':';
            for (int m : members) ours << ' ' << m;
            ours << '\n';
            auto gathered = d.all_gather(static_cast<int64_t>(rank), dim);
            CHECK(std::vector<int>(gathered.begin(), gathered.end()) == members);
          }
        }
      }
    }
    // pp above 1, outermost in both meshes (mesh_groups.py writes the same lines).
    for (int pp = 2; pp <= P; ++pp) {
      if (P % pp) continue;
      for (int tp = 1; tp <= P / pp; ++tp) {
        if ((P / pp) % tp) continue;
        const int rest = P / pp / tp;
        for (int mp_replicate = 1; mp_replicate <= rest; ++mp_replicate) {
          if (rest % mp_replicate) continue;
          for (int cp = 1; cp <= rest; ++cp) {
            if (rest % cp) continue;
            auto& d = fresh({.mp_replicate_size = mp_replicate, .cp_size = cp, .tp_size = tp, .pp_size = pp});
            for (Dim dim : {Dim::PP, Dim::MP_REPLICATE, Dim::MP_SHARD, Dim::TP, Dim::DP, Dim::CP}) {
              const auto& members = d.get_device_mesh(dim)->ranks();
              ours << "pp " << pp << ' ' << mp_replicate << ' ' << rest / mp_replicate << ' ' << rest / cp << ' ' << cp
                   << ' ' << tp << ' ' << dim << ':';
              for (int m : members) ours << ' ' << m;
              ours << '\n';
              CHECK(accel::all_gather(rank, d.get_group(dim)) == members);
            }
          }
        }
      }
    }
    // Accelerate's 4-d layouts and flattened dimensions (mesh_groups.py writes the same lines).
    auto& d = fresh({});
    for (const std::vector<int>& shape : P == 4 ? accelerate_layouts() : std::vector<std::vector<int>>{}) {
      accel::DeviceMesh mesh = accel::init_device_mesh(shape, {"dp_replicate", "dp_shard", "cp", "tp"});
      flatten_as_accelerate(mesh);
      const auto line = [&](const std::string& what, const accel::DeviceMesh& m) {
        ours << "nd";
        for (int s : shape) ours << ' ' << s;
        ours << ' ' << what << ':';
        for (int member : m.ranks()) ours << ' ' << member;
        ours << " coordinate";
        for (int c : m.get_coordinate()) ours << ' ' << c;
        ours << '\n';
      };
      for (const char* name : {"dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"}) {
        line(name, mesh.slice(name));
        CHECK(accel::all_gather(rank, mesh.slice(name).get_group()) == mesh.slice(name).ranks());
      }
      line("dp_replicate,dp_shard_cp", mesh.slice("dp_replicate", "dp_shard_cp"));
      line("dp_shard,tp", mesh.slice("dp_shard", "tp"));
    }
    CHECK(ours.str() == python);
    d.destroy();
  }
}

// == pipeline schedules' orders (core/pipeline_actions.hpp, core/pipeline_orders.hpp) ==

namespace {
namespace pp = accel::detail::pp;
std::string csv_of(const pp::PipelineOrder& order) {
  std::ostringstream out;
  pp::write_csv(out, order);
  return out.str();
}
// Each rank's actions without the empty slots, as text.
std::vector<std::string> sequences_of(const pp::PipelineOrder& order) {
  std::vector<std::string> rows;
  for (const auto& row : order) {
    std::string text;
    for (const auto& a : row) {
      if (!a) continue;
      if (!text.empty()) text += ",";
      text += pp::to_string(*a);
    }
    rows.push_back(text);
  }
  return rows;
}
}  // namespace

TEST_SUITE("single") {
  TEST_CASE("pipeline actions: torch's text both ways, every computation type, and what is refused") {
    for (const auto& [type, text] : pp::kComputationTypeText) {
      if (type == pp::ComputationType::OVERLAP_F_B) continue;  // (only in its compound form)
      const pp::Action a{3, type, 7}, whole_step{2, type, std::nullopt};
      CHECK(pp::to_string(a) == "3" + std::string(text) + "7");
      CHECK(pp::parse_action(pp::to_string(a)) == a);
      CHECK(pp::parse_action(pp::to_string(whole_step)) == whole_step);
    }
    CHECK(pp::parse_action(" 12SEND_F30\r") == pp::Action{12, pp::ComputationType::SEND_F, 30});
    CHECK(pp::parse_action("1UNSHARD") == pp::Action{1, pp::ComputationType::UNSHARD, std::nullopt});
    CHECK_FALSE(pp::parse_action("  ").has_value());  // an empty slot
    for (const char* bad : {"F0", "0X1", "0F0x", "0f0", "0SEND_X1", "99999999999F0", "0F99999999999"})
      CHECK_THROWS_WITH_AS(pp::parse_action(bad), doctest::Contains("[stage][type][micro-batch]"),
                           accel::InvalidArgument);
    // DualPipeV's compound action: its sub-actions, torch's text back; what is not one refused.
    pp::Action overlap{-1, pp::ComputationType::OVERLAP_F_B};
    overlap.sub_actions = {{0, pp::ComputationType::FORWARD, 1}, {1, pp::ComputationType::FULL_BACKWARD, 0}};
    CHECK(pp::parse_action("(0F1;1B0)OVERLAP_F_B") == overlap);
    CHECK(pp::to_string(overlap) == "(0F1;1B0)OVERLAP_F_B");
    for (const auto& [bad, why] : std::vector<std::pair<const char*, const char*>>{
             {"(0F1;1B0)F", "not \"(...)OVERLAP_F_B\""},
             {"(0F1;1B0", "not \"(...)OVERLAP_F_B\""},
             {"(0F1;(1B0)OVERLAP_F_B)OVERLAP_F_B", "not \"(...)OVERLAP_F_B\""},  // (nested)
             {"(0F1;)OVERLAP_F_B", "an empty sub-action"},
             {"(0F1;1X0)OVERLAP_F_B", "no computation type"},
             {"0OVERLAP_F_B", "without its sub-actions"}})
      CHECK_THROWS_WITH_AS(pp::parse_action(bad), doctest::Contains(why), accel::InvalidArgument);
    // torch's CSV: a row per rank, "" for an empty slot, "\r\n" ends (Python's csv writer); read back the same.
    const std::string text = "0F0,,0B0\r\n,1F0,1B0\r\n";
    std::istringstream in(text);
    const pp::PipelineOrder order = pp::read_csv(in);
    REQUIRE(order.size() == 2);
    CHECK_FALSE(order[0][1].has_value());
    CHECK(order[1][2] == pp::Action{1, pp::ComputationType::FULL_BACKWARD, 0});
    CHECK(csv_of(order) == text);
    std::istringstream unix_ends("0F0,0B0\n1F0\n");
    CHECK(csv_of(pp::read_csv(unix_ends)) == "0F0,0B0\r\n1F0\r\n");
    std::istringstream quoted("0F0,\"0B0\"\n");
    CHECK_THROWS_WITH_AS(pp::read_csv(quoted), doctest::Contains("quotes a field"), accel::InvalidArgument);
  }

  // Expected values from torch 2.15's schedules.py for the same arguments (its _dump_csv for the looped
  // schedules; for GPipe and 1F1B its pipeline_order's forwards and backwards, the last rank's forwards
  // numbered as its step runs them). tests/python_ref/pp_orders.py checks 416 cases live on the pip leg.
  TEST_CASE("pipeline orders: torch's for the same arguments; every one keeps the rules; torch's refusals") {
    CHECK(
        csv_of(pp::interleaved_1f1b_order(4, 2, 8)) ==
        "0F0,0F1,0F2,0F3,4F0,4F1,4F2,4F3,0F4,0F5,,,,,0F6,4B0,0F7,4B1,4F4,4B2,4F5,4B3,4F6,0B0,4F7,0B1,,0B2,,0B3,,4B4,,"
        "4B5,,4B6,,4B7,,0B4,,0B5,,0B6,,0B7\r\n"
        ",1F0,1F1,1F2,1F3,5F0,5F1,5F2,5F3,,,,1F4,5B0,1F5,5B1,1F6,5B2,1F7,5B3,5F4,1B0,5F5,1B1,5F6,1B2,5F7,1B3,,5B4,,"
        "5B5,,5B6,,5B7,,1B4,,1B5,,1B6,,1B7\r\n"
        ",,2F0,2F1,2F2,2F3,6F0,6F1,,,6F2,6B0,6F3,6B1,2F4,6B2,2F5,6B3,2F6,2B0,2F7,2B1,6F4,2B2,6F5,2B3,6F6,6B4,6F7,6B5,,"
        "6B6,,6B7,,2B4,,2B5,,2B6,,2B7\r\n"
        ",,,3F0,3F1,3F2,3F3,,7F0,7B0,7F1,7B1,7F2,7B2,7F3,7B3,3F4,3B0,3F5,3B1,3F6,3B2,3F7,3B3,7F4,7B4,7F5,7B5,7F6,7B6,"
        "7F7,7B7,,3B4,,3B5,,3B6,,3B7\r\n");
    CHECK(csv_of(pp::looped_bfs_order(2, 2, 4)) ==
          "0F0,0F1,0F2,0F3,2F0,2F1,2F2,2F3,,,2B3,2B2,2B1,2B0,0B3,0B2,0B1,0B0\r\n"
          ",1F0,1F1,1F2,1F3,3F0,3F1,3F2,3F3,3B3,3B2,3B1,3B0,1B3,1B2,1B1,1B0\r\n");
    CHECK(sequences_of(pp::gpipe_order(2, 4)) ==
          std::vector<std::string>{"0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3", "1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3"});
    CHECK(sequences_of(pp::one_f_one_b_order(4, 8)) ==
          std::vector<std::string>{"0F0,0F1,0F2,0F3,0B0,0F4,0B1,0F5,0B2,0F6,0B3,0F7,0B4,0B5,0B6,0B7",
                                   "1F0,1F1,1F2,1B0,1F3,1B1,1F4,1B2,1F5,1B3,1F6,1B4,1F7,1B5,1B6,1B7",
                                   "2F0,2F1,2B0,2F2,2B1,2F3,2B2,2F4,2B3,2F5,2B4,2F6,2B5,2F7,2B6,2B7",
                                   "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3,3F4,3B4,3F5,3B5,3F6,3B6,3F7,3B7"});
    CHECK(csv_of(pp::interleaved_zero_bubble_order(2, 2, 4)) ==
          "0F0,0F1,2F0,,2F1,2I0,2W0,0F2,2I1,2W1,0F3,0I0,0W0,2F2,0I1,0W1,2F3,2I2,2W2,2I3,2W3,0I2,0W2,0I3,0W3\r\n"
          ",1F0,1F1,3F0,3I0,3F1,3I1,3W0,1F2,1I0,3W1,1F3,1I1,1W0,3F2,3I2,1W1,3F3,3I3,3W2,1I2,3W3,1I3,1W2,1W3\r\n");
    CHECK(csv_of(pp::zbv_zero_bubble_order(2, 4)) ==
          "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,0I2,0W2,0I3,0W3\r\n"
          ",1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,1I3,1W2,2W3,1W3\r\n");
    // DualPipeV: no empty slots; its main phase pairs a forward with a backward (OVERLAP_F_B), the last rank's
    // first pair not overlapped.
    CHECK(csv_of(pp::dualpipev_order(2, 4)) ==
          "0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,(3F2;0B0)OVERLAP_F_B,3B2,(3F3;0B1)OVERLAP_F_B,3B3,0I2,"
          "0W2,0I3,0W3\r\n"
          "1F0,2F0,1F1,2F1,1F2,2B0,(2F2;1B0)OVERLAP_F_B,(1F3;2B1)OVERLAP_F_B,(2F3;1B1)OVERLAP_F_B,2B2,1B2,2I3,1I3,"
          "2W3,1W3\r\n");
    // 1F1B at its earliest steps: a backward as soon as the stage after has run it.
    CHECK(csv_of(pp::one_f_one_b_order(2, 4)) ==
          "0F0,0F1,,0B0,0F2,0B1,0F3,0B2,,0B3\r\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\r\n");
    for (int ranks = 1; ranks <= 4; ++ranks)
      for (int local = 1; local <= 3; ++local)
        for (int m = ranks; m <= 16; ++m) {
          CAPTURE(ranks);
          CAPTURE(local);
          CAPTURE(m);
          if (local == 1) {
            CHECK_FALSE(pp::order_error(pp::gpipe_order(ranks, m), 1, m));
            CHECK_FALSE(pp::order_error(pp::one_f_one_b_order(ranks, m), 1, m));
          }
          if (local == 2) CHECK_FALSE(pp::order_error(pp::zbv_zero_bubble_order(ranks, m), 2, m, pp::StageStyle::v));
          if (local == 2 && m >= 2 * ranks)
            CHECK_FALSE(pp::order_error(pp::dualpipev_order(ranks, m), 2, m, pp::StageStyle::v));
          CHECK_FALSE(pp::order_error(pp::looped_bfs_order(ranks, local, m), local, m));
          if (m % std::max(1, m / ranks) == 0) {
            CHECK_FALSE(pp::order_error(pp::interleaved_1f1b_order(ranks, local, m), local, m));
            CHECK_FALSE(pp::order_error(pp::interleaved_zero_bubble_order(ranks, local, m), local, m));
          }
        }
    CHECK_THROWS_WITH_AS(pp::one_f_one_b_order(4, 3), doctest::Contains("at least one micro-batch per stage"),
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(pp::interleaved_1f1b_order(2, 2, 5), doctest::Contains("multiple of the number of rounds, 2"),
                         accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(pp::gpipe_order(0, 4), doctest::Contains("each must be at least 1"), accel::InvalidArgument);
    CHECK_THROWS_WITH_AS(pp::dualpipev_order(2, 3),
                         doctest::Contains("3 micro-batches for 4 stages: DualPipeV needs at least as many"),
                         accel::InvalidArgument);
  }

  TEST_CASE("pipeline orders: the rules, each broken once, named") {
    auto error_of = [](const std::string& text, int local, int m) {
      std::istringstream in(text);
      return doctest::String(pp::order_error(pp::read_csv(in), local, m).value_or("").c_str());
    };
    CHECK(error_of("0F0,0B0\n1F0,1B0\n", 1, 1) == "");
    CHECK(error_of("0F0,0B0\n0F0,1B0\n", 1, 1) ==
          doctest::Contains("rank 1, step 0: 0F0: stage 0 is not one of this rank's"));
    CHECK(error_of("0F0,0B0\n1F0,1B0,1F0\n", 1, 1) == doctest::Contains("runs twice"));
    CHECK(error_of("0F0,0B0\n1F0,1B1\n", 1, 1) == doctest::Contains("no micro-batch of the 1"));
    CHECK(error_of("0F0,0B0\n1F0\n", 1, 1) == doctest::Contains("stage 1, micro-batch 0: no backward"));
    CHECK(error_of("0B0,0F0\n1F0,1B0\n", 1, 1) == doctest::Contains("backward before its forward"));
    CHECK(error_of("0F0,0I0,0W0,0B0\n1F0,1B0\n", 1, 1) == doctest::Contains("both B and I"));
    CHECK(error_of("0F0,0I0\n1F0,1B0\n", 1, 1) == doctest::Contains("I without W"));
    CHECK(error_of("0F0,0UNSHARD\n1F0,1B0\n", 1, 1) == doctest::Contains("not a computation"));
    // Each rank's list in a valid order, but run together every rank waits: stage 1 runs its forwards in the
    // order 1, 0 while stage 0 sends 0 first and then waits for 0's backward.
    CHECK(error_of("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", 1, 2) ==
          doctest::Contains(
              "cannot go on (2 micro-batches): every rank waits for another: rank 0 at 0B0, rank 1 at 1F1"));
    CHECK(error_of("0F0,0I0,0W0\n1F0,1I0,1W0\n", 1, 1) == "");  // zero bubble's split backward
    // A compound action counts as its sub-actions, one step each.
    CHECK(error_of("0F0,0F1,(0B0;0F2)OVERLAP_F_B,0B1,0B2\n1F0,1B0,1F1,1B1,1F2,1B2\n", 1, 3) == "");
    CHECK(error_of("0F0,(0B0;0B0)OVERLAP_F_B\n1F0,1B0\n", 1, 1) ==
          doctest::Contains("rank 0, step 2: 0B0: runs twice (first at step 1)"));
  }
}

TEST_SUITE("single") {
  // Expected values: torch 2.15's _add_send_recv of the same compute-only orders (python_pp_orders compares
  // every case's lowering live on the pip leg).
  TEST_CASE("pipeline lowering: the sends and receives torch puts in each rank's list") {
    CHECK(csv_of(pp::as_order(pp::add_send_recv(pp::one_f_one_b_order(2, 4), 1, pp::StageStyle::loop))) ==
          "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0F2,0SEND_F2,0RECV_B1,0B1,0F3,0SEND_F3,0RECV_B2,0B2,0RECV_B3,0B3\r\n"
          "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1RECV_F2,1B1,1SEND_B1,1F2,1RECV_F3,1B2,1SEND_B2,1F3,1B3,"
          "1SEND_B3\r\n");
    // ZBV: stages 1 and 2 share rank 1 and stages 0 and 3 rank 0, so 1F0 hands 2F0 its activation without a
    // message, and 3I0 sends its gradient to rank 1's stage 2.
    CHECK(csv_of(pp::as_order(pp::add_send_recv(pp::zbv_zero_bubble_order(2, 4), 2, pp::StageStyle::v))) ==
          "0F0,0SEND_F0,0F1,0SEND_F1,0F2,0SEND_F2,3RECV_F0,3F0,3I0,3SEND_B0,3RECV_F1,3W0,3F1,3I1,3SEND_B1,3W1,"
          "0RECV_B0,0F3,0SEND_F3,0I0,3RECV_F2,0W0,3F2,3I2,3SEND_B2,3W2,0RECV_B1,0I1,0W1,3RECV_F3,3F3,3I3,3SEND_B3,"
          "3W3,0RECV_B2,0I2,0W2,0RECV_B3,0I3,0W3\r\n"
          "1RECV_F0,1RECV_F1,1F0,1RECV_F2,2F0,2SEND_F0,1F1,2RECV_B0,2F1,2SEND_F1,2I0,2W0,2RECV_B1,1F2,1I0,1SEND_B0,"
          "1RECV_F3,1W0,2F2,2SEND_F2,2I1,2W1,2RECV_B2,1F3,1I1,1SEND_B1,1W1,2F3,2SEND_F3,2I2,2RECV_B3,2W2,1I2,"
          "1SEND_B2,2I3,1I3,1SEND_B3,1W2,2W3,1W3\r\n");
    // An order whose ranks wait on each other (stage 1 runs micro-batch 1 first) cannot be lowered.
    std::istringstream crossed("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n");
    CHECK_THROWS_WITH_AS(pp::add_send_recv(pp::read_csv(crossed), 1, pp::StageStyle::loop),
                         doctest::Contains("cannot be lowered to sends and receives: every rank waits for a message "
                                           "no rank is yet to send (rank 0 at 0B0, rank 1 at 1F1)"),
                         accel::InvalidArgument);
  }
}

// tests/python_ref/pp_orders.py's cases (the files it wrote to ACCEL_PP_DIR): ours written beside torch's
// (ours_CASE.csv, or ours_CASE.err where a schedule refuses the case), each of ours keeping the rules; torch's
// read and written back byte for byte, and (but 1F1B's, whose last rank it numbers from 1) keeping them too.
TEST_SUITE("python_pp" * doctest::skip()) {
  TEST_CASE("pipeline orders against torch's, live") {
    const char* dir = std::getenv("ACCEL_PP_DIR");
    REQUIRE_MESSAGE(dir, "set ACCEL_PP_DIR (tests/python_ref/run_pp_orders.sh does)");
    int cases = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string file = entry.path().filename().string();
      if (!file.starts_with("torch_")) continue;
      const std::string c = entry.path().stem().string().substr(6);
      CAPTURE(c);
      std::istringstream fields(std::regex_replace(c, std::regex("_(\\d+)_(\\d+)_(\\d+)$"), " $1 $2 $3"));
      std::string name;
      int ranks = 0, local = 0, m = 0;
      const bool parsed = static_cast<bool>(fields >> name >> ranks >> local >> m);
      REQUIRE(parsed);
      ++cases;
      const std::filesystem::path ours = entry.path().parent_path() / ("ours_" + c);
      const pp::StageStyle style = name == "zbv" || name == "dualpipev" ? pp::StageStyle::v : pp::StageStyle::loop;
      try {
        const pp::PipelineOrder order = name == "gpipe"              ? pp::gpipe_order(ranks, m)
                                        : name == "1f1b"             ? pp::one_f_one_b_order(ranks, m)
                                        : name == "looped_bfs"       ? pp::looped_bfs_order(ranks, local, m)
                                        : name == "interleaved_1f1b" ? pp::interleaved_1f1b_order(ranks, local, m)
                                        : name == "interleaved_zero_bubble"
                                            ? pp::interleaved_zero_bubble_order(ranks, local, m)
                                        : name == "zbv"       ? pp::zbv_zero_bubble_order(ranks, m)
                                        : name == "dualpipev" ? pp::dualpipev_order(ranks, m)
                                                              : throw std::logic_error("no schedule " + name);
        CHECK(pp::order_error(order, local, m, style) == std::nullopt);
        std::ofstream(ours.string() + ".csv", std::ios::binary) << csv_of(order);
        std::ofstream(entry.path().parent_path() / ("lowered_ours_" + c + ".csv"), std::ios::binary)
            << csv_of(pp::as_order(pp::add_send_recv(order, local, style)));
      } catch (const accel::InvalidArgument& e) {
        std::ofstream(ours.string() + ".err") << e.what();
      }
      if (entry.path().extension() != ".csv") continue;
      std::ifstream in(entry.path(), std::ios::binary);
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::istringstream again(text);
      const pp::PipelineOrder theirs = pp::read_csv(again);
      CHECK(csv_of(theirs) == text);
      if (name != "1f1b") CHECK(pp::order_error(theirs, local, m, style) == std::nullopt);
    }
    MESSAGE(cases << " cases of torch's");
    CHECK(cases > 0);
  }
}
