// accel/core/launcher.hpp: the local launcher: spawn and launch_processes (Linux).
//
// accel::spawn(nprocs, fn), the C++ torch.multiprocessing.spawn: this program
// is started nprocs more times, each a rank with torchrun's environment; the
// ranks run fn and exit; the caller gets 0, or the first failing rank's
// status once the others are stopped. Call it at the top of main (code
// before it runs in every rank, as code outside `if __name__ == "__main__"`
// does in Python). launch_processes does the same for any program (the
// accel_launch tool is built on it).
//
// Local runs open no TCP port: the ranks meet in a c10d::FileStore inside a
// private directory (mode 0700, removed afterwards), named by ACCEL_STORE_DIR,
// and Gloo is bound to loopback. Each rank's output lines are prefixed with
// "[rank r] "; ranks never outlive the launcher (PR_SET_PDEATHSIG) and are
// stopped as whole process groups, so nothing is left behind.
#pragma once

#include "accel/core/environment.hpp"

ACCEL_NAMESPACE_BEGIN

#if defined(__linux__)

struct LaunchOptions {
  std::chrono::duration<double> timeout{0};  // 0: none; else every rank is stopped then, status 124
  bool prefix_output = true;                 // "[rank r] " before each line
  std::ostream* out = &std::cout;            // where the ranks' output goes
};

namespace detail {
struct ChildRank {
  pid_t pid = -1;
  int out = -1;         // read end of the rank's stdout+stderr
  std::string pending;  // an unfinished line
  bool running = true;
};

inline void forward_output(int rank, ChildRank& child, bool final, const LaunchOptions& options) {
  char buffer[4096];
  auto emit = [&](std::string_view line) {
    std::string text = options.prefix_output ? "[rank " + std::to_string(rank) + "] " : std::string();
    text.append(line);
    text += '\n';
    options.out->write(text.data(), static_cast<std::streamsize>(text.size()));
    options.out->flush();
  };
  for (;;) {
    const ssize_t n = read(child.out, buffer, sizeof buffer);
    if (n <= 0) break;
    child.pending.append(buffer, static_cast<std::size_t>(n));
    for (std::size_t pos; (pos = child.pending.find('\n')) != std::string::npos;) {
      emit(std::string_view(child.pending).substr(0, pos));
      child.pending.erase(0, pos + 1);
    }
  }
  if (final && !child.pending.empty()) {
    emit(child.pending);
    child.pending.clear();
  }
}

// The ranks of one launch. Whatever ends the launch (its normal end, or an
// exception on the way: no pipe, no fork, a failing output stream), the
// destructor kills every rank still running with its process group, reaps
// it and closes every pipe: nothing outlives launch_processes.
class RankSet {
 public:
  explicit RankSet(std::size_t n) : ranks_(n) {}
  RankSet(const RankSet&) = delete;
  RankSet& operator=(const RankSet&) = delete;
  ~RankSet() {
    stop();
    for (auto& child : ranks_) close_output(child);
  }

  // Kills every running rank's process group and reaps the ranks.
  void stop() {
    for (auto& child : ranks_)
      if (child.running && child.pid > 0) kill(-child.pid, SIGKILL);
    for (auto& child : ranks_)
      if (child.running && child.pid > 0) {
        waitpid(child.pid, nullptr, 0);
        child.running = false;
      }
  }
  static void close_output(ChildRank& child) {
    if (child.out >= 0) close(child.out);
    child.out = -1;
  }
  ChildRank& operator[](std::size_t rank) { return ranks_[rank]; }
  std::vector<ChildRank>::iterator begin() { return ranks_.begin(); }
  std::vector<ChildRank>::iterator end() { return ranks_.end(); }
  std::size_t size() const { return ranks_.size(); }

 private:
  std::vector<ChildRank> ranks_;
};

// A TCP port free on this host now (the kernel's pick for port 0).
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (fd >= 0) close(fd);
  if (!ok) throw RuntimeError(std::string("accel: cannot find a free TCP port: ") + std::strerror(errno));
  return ntohs(addr.sin_port);
}

// A private directory for a local rendezvous, removed on destruction.
class PrivateDir {
 public:
  PrivateDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "accel-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr)  // mode 0700
      throw RuntimeError("accel: cannot create a private directory in " + pattern + ": " + std::strerror(errno));
    path_ = pattern;
  }
  PrivateDir(const PrivateDir&) = delete;
  PrivateDir& operator=(const PrivateDir&) = delete;
  ~PrivateDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Rank `rank`'s environment for launch_processes: the caller's, with the
// launch variables set (and OMP_NUM_THREADS=1 beside other ranks unless set).
inline std::vector<std::string> rank_environment(int rank, int nprocs, int port, const std::string& store_dir,
                                                 const std::vector<std::pair<std::string, std::string>>& extra_env) {
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(nprocs)},
      {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(nprocs)},
      {"MASTER_ADDR", "127.0.0.1"},         {"ACCEL_STORE_DIR", store_dir}};
  if (!getenv_str("MASTER_PORT")) set.emplace_back("MASTER_PORT", std::to_string(port));
  if (nprocs > 1 && !getenv_str("OMP_NUM_THREADS")) set.emplace_back("OMP_NUM_THREADS", "1");
  set.insert(set.end(), extra_env.begin(), extra_env.end());
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const auto name = entry.substr(0, entry.find('='));
    if (std::none_of(set.begin(), set.end(), [&](const auto& kv) { return kv.first == name; })) env.emplace_back(entry);
  }
  for (const auto& [name, value] : set) env.push_back(name + "=" + value);
  return env;
}

// Forks one rank and execs the program in it, its output into a pipe that
// `child` reads from then on. The environment and every string are made
// before fork: between fork and exec the child may only make
// async-signal-safe calls (no allocation).
inline void start_rank(ChildRank& child, std::vector<char*>& args, const std::vector<std::string>& env, pid_t launcher,
                       const std::string& exec_error) {
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) throw RuntimeError(std::string("accel::launch_processes: pipe: ") + std::strerror(errno));
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(fds[0]);
    close(fds[1]);
    throw RuntimeError(std::string("accel::launch_processes: fork: ") + std::strerror(error));
  }
  if (pid == 0) {  // only async-signal-safe calls from here to exec
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != launcher) _exit(127);
    signal(SIGPIPE, SIG_DFL);  // a distributed launcher ignores it (detail::ignore_sigpipe)
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    execvpe(args[0], args.data(), envp.data());
    if (write(STDERR_FILENO, exec_error.data(), exec_error.size()) < 0) _exit(127);
    _exit(127);
  }
  child.pid = pid;  // owned by the rank set from here
  child.out = fds[0];
  setpgid(pid, pid);
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
}

// Forwards the ranks' output until every rank has ended: the first non-zero
// status (or 124 after the timeout) stops the others and is the result.
inline int supervise(RankSet& ranks, const LaunchOptions& options) {
  const int nprocs = static_cast<int>(ranks.size());
  const auto start = std::chrono::steady_clock::now();
  int running = nprocs, result = 0;
  while (running > 0) {
    std::vector<pollfd> fds;
    for (auto& child : ranks)
      if (child.out >= 0) fds.push_back({child.out, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (int rank = 0; rank < nprocs; ++rank) {
      auto& child = ranks[static_cast<std::size_t>(rank)];
      if (child.out >= 0) forward_output(rank, child, false, options);
      if (!child.running) continue;
      int status = 0;
      if (waitpid(child.pid, &status, WNOHANG) != child.pid) continue;
      child.running = false;
      --running;
      kill(-child.pid, SIGKILL);  // anything the rank left running in its group
      forward_output(rank, child, true, options);
      RankSet::close_output(child);
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && result == 0) {
        *options.out << "accel: rank " << rank << " failed with status " << code << "; stopping the others"
                     << std::endl;
        result = code;
        ranks.stop();
        running = 0;
      }
    }
    if (running > 0 && options.timeout.count() > 0 && std::chrono::steady_clock::now() - start > options.timeout) {
      *options.out << "accel: timed out after " << options.timeout.count() << " s; stopping every rank" << std::endl;
      ranks.stop();
      result = 124;
      running = 0;
    }
  }
  for (int rank = 0; rank < nprocs; ++rank) {
    auto& child = ranks[static_cast<std::size_t>(rank)];
    if (child.out >= 0) forward_output(rank, child, true, options);
  }
  return result;  // the rank set closes the pipes
}
}  // namespace detail

// Starts nprocs ranks of `argv` (argv[0] looked up in PATH) on this host and
// waits for them. Returns 0 when every rank exits 0; otherwise the first
// failing rank's status (128+signal when killed) after stopping the others;
// 124 on timeout. `extra_env` is set in every rank. MASTER_PORT, unless
// already set, is a free port (for ranks that rendezvous over TCP after all,
// such as Python's torch.distributed). OMP_NUM_THREADS, unless already set, is
// 1 when there are several ranks, as torchrun sets it: ranks that each start
// a thread per core overload the host, and OpenMP and MKL then shrink their
// teams as the load changes, so the same run can sum in another order (seen:
// a resumed training run whose weights differed in the last bit).
inline int launch_processes(int nprocs, const std::vector<std::string>& argv, const LaunchOptions& options = {},
                            const std::vector<std::pair<std::string, std::string>>& extra_env = {}) {
  if (nprocs < 1)
    throw InvalidArgument("accel::launch_processes: nprocs must be at least 1, got " + std::to_string(nprocs));
  if (argv.empty()) throw InvalidArgument("accel::launch_processes: no program to run");
  detail::PrivateDir store_dir;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t launcher = getpid();
  detail::RankSet ranks(static_cast<std::size_t>(nprocs));
  options.out->flush();
  const int port = detail::free_port();
  const std::string exec_error = "accel: cannot run " + argv[0] + "\n";
  for (int rank = 0; rank < nprocs; ++rank)
    detail::start_rank(ranks[static_cast<std::size_t>(rank)], args,
                       detail::rank_environment(rank, nprocs, port, store_dir.path(), extra_env), launcher, exec_error);
  return detail::supervise(ranks, options);
}

// In the caller: starts nprocs ranks of this very program (same arguments)
// and returns their combined status as launch_processes does. In a rank it
// started: runs fn (void or int: the exit status), then exits; an exception
// is printed and exits with 1. fn never runs in the caller.
template <std::invocable F>
int spawn(int nprocs, F&& fn, const LaunchOptions& options = {}) {
  if (detail::getenv_str("ACCEL_SPAWNED_RANK")) {
    int code = 0;
    try {
      if constexpr (std::is_void_v<std::invoke_result_t<F>>) std::invoke(std::forward<F>(fn));
      else code = static_cast<int>(std::invoke(std::forward<F>(fn)));
    } catch (const std::exception& e) {
      std::cerr << "accel::spawn: rank " << detail::getenv_str("RANK").value_or("?")
                << " failed: " << detail::without_backtrace(e) << std::endl;
      code = 1;
    }
    std::cout.flush();
    std::cerr.flush();
    std::exit(code);
  }
  std::vector<std::string> argv;
  {
    std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
    for (std::string arg; std::getline(cmdline, arg, '\0');) argv.push_back(arg);
  }
  if (argv.empty()) throw RuntimeError("accel::spawn: cannot read this program's arguments");
  argv[0] = std::filesystem::read_symlink("/proc/self/exe").string();
  return launch_processes(nprocs, argv, options, {{"ACCEL_SPAWNED_RANK", "1"}});
}
#endif  // __linux__

ACCEL_NAMESPACE_END
