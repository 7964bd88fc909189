// Shared by the test translation units: includes, environment guards and
// the interface the multi-rank suites use.
#pragma once

// The tests build on the include tree accel.hpp is generated from, so that a
// compiler error names the part (the examples, the fuzzers, the ABI test and
// the copy_header_ entries build on accel.hpp itself, as users do).
#ifdef ACCEL_TRAINING
#include "accel/training.hpp"
#else
#include "accel/distributed.hpp"
#endif

// Debian's LibTorch logs through glog, whose CHECK* macros (pulled in by
// ATen) would silently replace doctest's: include accel first, drop them,
// then include doctest.
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LE
#undef CHECK_LT
#undef CHECK_GE
#undef CHECK_GT
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>
#include <unistd.h>

using accel::Dim;
using accel::ReduceOp;

// == Helpers ==================================================================

// Values as numbers doctest can print (char8_t and friends have no <<);
// long double holds every integer these tests use exactly.
template <class T>
long double num(T x) {
  return static_cast<long double>(x);
}

// Sets (or, with nullptr, unsets) environment variables for one scope.
class EnvGuard {
 public:
  EnvGuard(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (auto [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
      if (value) setenv(name, value, 1);
      else unsetenv(name);
    }
  }
  ~EnvGuard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) setenv(it->first.c_str(), it->second->c_str(), 1);
      else unsetenv(it->first.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// Tests use a short timeout so that a desynchronised rank fails fast.
inline accel::DistributedConfig test_config(accel::DistributedConfig config = {}) {
  config.timeout = std::chrono::seconds(60);
  return config;
}

inline accel::DistributedInterface& world() { return accel::DistributedInterface::instance(test_config()); }

// A fresh interface with `config`, whatever was live before.
inline accel::DistributedInterface& fresh(accel::DistributedConfig config = {}) {
  if (accel::DistributedInterface::is_initialized()) accel::DistributedInterface::instance().destroy();
  return accel::DistributedInterface::instance(test_config(config));
}

// Ends the suite's live interface, if any: never makes one only to destroy it (a rank that did would leave
// at once, its peers still making their groups on the store it serves).
inline void release_world() {
  if (accel::DistributedInterface::is_initialized()) accel::DistributedInterface::instance().destroy();
}

// False, with the reason printed for CTest (SKIP_REGULAR_EXPRESSION
// "SKIPPED ("), where no CUDA device is visible: the "gpu: " cases.
inline bool gpu_or_skip(const char* what) {
  if (accel::is_torch_cuda_available()) return true;
  std::printf("SKIPPED (no CUDA device visible): %s\n", what);
  return false;
}

// A world of one over a private FileStore directory (no launcher), for as
// long as it lives; its interface is destroyed with it.
class WorldOfOne {
 public:
  WorldOfOne()
      : dir_(std::filesystem::temp_directory_path() / ("accel_one_" + std::to_string(getpid()))),
        env_{{"RANK", "0"},
             {"WORLD_SIZE", "1"},
             {"LOCAL_RANK", "0"},
             {"LOCAL_WORLD_SIZE", "1"},
             {"ACCEL_STORE_DIR", make_dir(dir_)}} {}
  ~WorldOfOne() {
    release_world();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

 private:
  static const char* make_dir(const std::filesystem::path& dir) {
    std::filesystem::create_directories(dir);
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all);
    static thread_local std::string text;
    text = dir.string();
    return text.c_str();
  }
  std::filesystem::path dir_;
  EnvGuard env_;
};

// Collectives are counted by the group's sequence number. LibTorch before
// 2.15 starts it only when asked (setSequenceNumberForGroup); from 2.15 on it
// always starts at 0 and ProcessGroup no longer has the call.
template <class Group>  // (a template: the requires-expression must be able to fail)
void start_sequence(const c10::intrusive_ptr<Group>& g) {
  if constexpr (requires { g->setSequenceNumberForGroup(); }) g->setSequenceNumberForGroup();
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}
