// accel/core/environment.hpp: reading torchrun's and the MPI/Slurm launchers' environment.
//
// torchrun's contract. Values are validated: a malformed or inconsistent
// variable throws InvalidArgument naming the variable and its value.
#pragma once

#include "accel/core/enums.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline std::optional<std::string> getenv_str(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// A variable that must hold a number: unset gives `fallback`; set but empty,
// not an integer, out of int's range or below `minimum` is an error naming it.
inline int env_int(const char* name, int fallback, int minimum) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return fallback;
  const std::string text(raw);
  auto fail = [&](const std::string& what) {
    throw InvalidArgument(std::string("accel: environment variable ") + name + what);
  };
  if (text.empty()) fail(" is set but empty (unset it, or give a number)");
  int value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range)
    fail("=" + text + " is out of range (at most " + std::to_string(std::numeric_limits<int>::max()) + ")");
  if (error != std::errc() || end != text.data() + text.size()) fail("='" + text + "' is not an integer");
  if (value < minimum) fail("=" + text + " must be at least " + std::to_string(minimum));
  return value;
}

// ASCII only, whatever the C locale says.
inline std::string lowercase(std::string text) {
  for (char& c : text) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return text;
}
// A yes/no switch: 1/0, true/false, yes/no, on/off (any case); anything else
// is an error naming the variable, never a silent default.
inline bool env_bool(const char* name, bool fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return fallback;
  const std::string text(raw);
  if (text.empty())
    throw InvalidArgument(std::string("accel: environment variable ") + name +
                          " is set but empty (unset it, or use 1/0, true/false, yes/no or on/off)");
  const std::string lower = lowercase(text);
  for (const char* yes : {"1", "true", "yes", "on"})
    if (lower == yes) return true;
  for (const char* no : {"0", "false", "no", "off"})
    if (lower == no) return false;
  throw InvalidArgument(std::string("accel: environment variable ") + name + "='" + text +
                        "' is not a switch (use 1/0, true/false, yes/no or on/off)");
}
}  // namespace detail

// Launchers' contracts, one row each. The first complete set wins, in this
// order (torchrun's is complete when RANK is set, even to "": its other
// variables have defaults); when none is, a partly set one (other than
// torchrun's) is an error naming what is there and what is missing, and
// otherwise the process is not distributed and torchrun's variables, or
// their defaults, give the sizes.
namespace detail {
struct LauncherVars {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
  const char* local_size_alt = nullptr;  // read when local_size is unset (Slurm's task list)
  bool defaults = false;                 // only rank is needed: the others default to 1, 0, 1
};
inline constexpr LauncherVars kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", nullptr, true},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"},
};

struct LaunchEnv {
  const char* launcher;  // nullptr: not launched
  int rank, world, local_rank, local_world;
};

// Slurm's tasks on this node: SLURM_NTASKS_PER_NODE when set, else this
// node's entry of SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
// three nodes, then 1), picked by SLURM_NODEID.
inline std::optional<int> slurm_local_size() {
  if (getenv_str("SLURM_NTASKS_PER_NODE")) return env_int("SLURM_NTASKS_PER_NODE", 1, 1);
  auto text = getenv_str("SLURM_TASKS_PER_NODE");
  if (!text) return std::nullopt;
  auto bad = [&] {
    return InvalidArgument("accel: environment variable SLURM_TASKS_PER_NODE='" + *text +
                           "' is not a Slurm task list such as 2(x3),1");
  };
  auto number = [&](std::string_view digits) {
    int value = 0;
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (error != std::errc() || end != digits.data() + digits.size() || value < 1) throw bad();
    return value;
  };
  std::vector<int> per_node;
  std::string_view rest(*text);
  for (bool more = true; more;) {
    const std::string_view item = rest.substr(0, rest.find(','));
    more = item.size() < rest.size();  // a comma follows: another item must come
    rest.remove_prefix(std::min(rest.size(), item.size() + 1));
    if (item.empty()) throw bad();
    const auto paren = item.find("(x");
    const int tasks = number(item.substr(0, paren));
    int repeat = 1;
    if (paren != std::string_view::npos) {
      if (item.back() != ')') throw bad();
      repeat = number(item.substr(paren + 2, item.size() - paren - 3));
    }
    if (per_node.size() + static_cast<std::size_t>(repeat) > 1000000) throw bad();
    per_node.insert(per_node.end(), static_cast<std::size_t>(repeat), tasks);
  }
  if (per_node.empty()) throw bad();
  if (getenv_str("SLURM_NODEID")) {
    const int node = env_int("SLURM_NODEID", 0, 0);
    if (static_cast<std::size_t>(node) >= per_node.size())
      throw InvalidArgument("accel: SLURM_NODEID=" + std::to_string(node) + " is past the " +
                            std::to_string(per_node.size()) + " nodes of SLURM_TASKS_PER_NODE=" + *text);
    return per_node[static_cast<std::size_t>(node)];
  }
  if (std::adjacent_find(per_node.begin(), per_node.end(), std::not_equal_to<>()) != per_node.end())
    throw InvalidArgument("accel: SLURM_TASKS_PER_NODE=" + *text +
                          " differs between nodes and SLURM_NODEID is not set");
  return per_node.front();
}

// One launcher's values, read and checked against each other.
inline LaunchEnv read_launcher(const LauncherVars& vars) {
  // The variable that gives the local size: local_size, else its alternative.
  const char* local_size = vars.local_size_alt && !std::getenv(vars.local_size) ? vars.local_size_alt : vars.local_size;
  LaunchEnv env{vars.launcher, env_int(vars.rank, 0, 0), env_int(vars.size, 1, 1), env_int(vars.local_rank, 0, 0),
                local_size == vars.local_size_alt ? *slurm_local_size() : env_int(local_size, 1, 1)};
  auto contradiction = [&](const char* name, int value, const char* relation, const char* bound_name, int bound) {
    const std::string where = vars.defaults ? "" : std::string(" (") + vars.launcher + "'s environment)";
    return InvalidArgument(std::string("accel: ") + name + "=" + std::to_string(value) + relation + bound_name + "=" +
                           std::to_string(bound) + where);
  };
  if (env.rank >= env.world) throw contradiction(vars.rank, env.rank, " must be smaller than ", vars.size, env.world);
  if (env.local_world > env.world)
    throw contradiction(local_size, env.local_world, " must not exceed ", vars.size, env.world);
  if (env.local_rank >= env.local_world)
    throw contradiction(vars.local_rank, env.local_rank, " must be smaller than ", local_size, env.local_world);
  return env;
}

// Which of a launcher's four values are set (even to ""; the local size
// under either of its names).
inline std::array<bool, 4> present(const LauncherVars& vars) {
  return {std::getenv(vars.rank) != nullptr, std::getenv(vars.size) != nullptr, std::getenv(vars.local_rank) != nullptr,
          std::getenv(vars.local_size) != nullptr || (vars.local_size_alt && std::getenv(vars.local_size_alt))};
}

// The launcher whose variables are set, at least in part (torchrun's: RANK),
// or null. Unlike launch_env() it reads no values and cannot fail: a
// collective with no world group asks it, to tell a process that is alone
// (where collectives are the identity) from one that has not called
// DistributedInterface::instance() yet. Being a few getenv calls, it keeps
// the environment's parse out of every translation unit that calls a
// collective.
inline const char* launcher_in_environment() {
  for (const auto& vars : kLaunchers) {
    const std::array<bool, 4> set = present(vars);
    if (vars.defaults ? set[0] : std::count(set.begin(), set.end(), true) > 0) return vars.launcher;
  }
  return nullptr;
}

// The launch environment, read and validated in one pass (see kLaunchers).
inline LaunchEnv launch_env() {
  const LauncherVars* partial = nullptr;
  for (const auto& vars : kLaunchers) {
    const std::array<bool, 4> set = present(vars);
    const auto count = std::count(set.begin(), set.end(), true);
    if (vars.defaults ? set[0] : count == 4) return read_launcher(vars);
    if (!vars.defaults && count > 0 && !partial) partial = &vars;
  }
  if (partial) {
    const std::string local_size = partial->local_size_alt
                                       ? std::string(partial->local_size) + " or " + partial->local_size_alt
                                       : partial->local_size;
    const std::string names[] = {partial->rank, partial->size, partial->local_rank, local_size};
    const std::array<bool, 4> there = present(*partial);
    std::string set, missing;
    for (int i = 0; i < 4; ++i) {
      std::string& list = there[i] ? set : missing;
      list += list.empty() ? names[i] : ", " + names[i];
    }
    throw InvalidArgument(std::string("accel: ") + partial->launcher + "'s environment is incomplete: " + set +
                          " set but " + missing + " missing (set RANK and WORLD_SIZE to override)");
  }
  LaunchEnv env = read_launcher(kLaunchers[0]);  // not launched: torchrun's variables or their defaults
  env.launcher = nullptr;
  return env;
}
}  // namespace detail

// Whether this process is one rank of a launched job: RANK is set, or
// another launcher's complete set (Open MPI, MPICH/Intel MPI, MVAPICH, Slurm).
// Each of these reads and validates the whole launch environment.
inline bool is_distributed() { return detail::launch_env().launcher != nullptr; }
inline int get_world_size() { return detail::launch_env().world; }
inline int get_rank() { return detail::launch_env().rank; }
inline int get_local_world_size() { return detail::launch_env().local_world; }
inline int get_local_rank() { return detail::launch_env().local_rank; }

// The launcher whose environment get_rank() and friends read: "torchrun"
// (RANK set), "Open MPI", "MPICH/Intel MPI", "MVAPICH", "Slurm", or "none".
inline std::string_view launcher() {
  const char* name = detail::launch_env().launcher;
  return name ? name : "none";
}

ACCEL_NAMESPACE_END
