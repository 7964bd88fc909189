// accel_launch — starts N ranks of a program on this host, for tests and
// examples. Each rank gets torchrun's environment (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with a free port,
// its output lines are prefixed with "[rank r] ", and the first rank that
// fails stops the others. A hard timeout stops everything.
//
//   accel_launch [--timeout SECONDS] NPROCS PROGRAM [ARGS...]
//
// Exit status: 0 when every rank succeeded; the first failing rank's status
// (128+signal when it was killed); 124 on timeout; 2 on bad usage.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;  // the kernel picks a free port
  socklen_t len = sizeof addr;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("accel_launch: cannot find a free port");
    std::exit(2);
  }
  close(fd);
  return ntohs(addr.sin_port);
}

struct Rank {
  pid_t pid = -1;
  int out = -1;           // read end of the rank's stdout+stderr
  std::string pending;    // an unfinished line
  bool running = true;
};

void emit(int rank, const std::string& line) {
  std::string text = "[rank " + std::to_string(rank) + "] " + line + "\n";
  fwrite(text.data(), 1, text.size(), stdout);
  fflush(stdout);
}

void drain(int rank, Rank& r, bool final) {
  char buffer[4096];
  for (;;) {
    ssize_t n = read(r.out, buffer, sizeof buffer);
    if (n <= 0) break;
    r.pending.append(buffer, static_cast<size_t>(n));
    for (size_t pos; (pos = r.pending.find('\n')) != std::string::npos;) {
      emit(rank, r.pending.substr(0, pos));
      r.pending.erase(0, pos + 1);
    }
  }
  if (final && !r.pending.empty()) {
    emit(rank, r.pending);
    r.pending.clear();
  }
}

void stop_all(std::vector<Rank>& ranks) {
  for (auto& r : ranks)
    if (r.running) kill(-r.pid, SIGKILL);  // each rank leads its own process group
}

}  // namespace

int main(int argc, char** argv) {
  int arg = 1;
  double timeout_s = 300;
  if (arg + 1 < argc && std::strcmp(argv[arg], "--timeout") == 0) {
    timeout_s = std::atof(argv[arg + 1]);
    arg += 2;
  }
  if (arg + 1 >= argc) {
    std::fprintf(stderr, "usage: accel_launch [--timeout SECONDS] NPROCS PROGRAM [ARGS...]\n");
    return 2;
  }
  const int nprocs = std::atoi(argv[arg]);
  if (nprocs < 1) {
    std::fprintf(stderr, "accel_launch: NPROCS must be positive, got '%s'\n", argv[arg]);
    return 2;
  }
  char** program = argv + arg + 1;
  const std::string port = std::to_string(free_port());
  const pid_t launcher = getpid();

  std::vector<Rank> ranks(nprocs);
  for (int rank = 0; rank < nprocs; ++rank) {
    int fds[2];
    if (pipe(fds) != 0) {
      std::perror("accel_launch: pipe");
      stop_all(ranks);
      return 2;
    }
    pid_t pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
      if (getppid() != launcher) _exit(127);
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nprocs).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      execvp(program[0], program);
      std::fprintf(stderr, "accel_launch: cannot run %s: %s\n", program[0], std::strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);
    close(fds[1]);
    fcntl(fds[0], F_SETFL, O_NONBLOCK);
    ranks[rank].pid = pid;
    ranks[rank].out = fds[0];
  }

  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int running = nprocs;
  int status_out = 0;
  while (running > 0) {
    std::vector<pollfd> fds;
    for (auto& r : ranks)
      if (r.out >= 0) fds.push_back({r.out, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (int rank = 0; rank < nprocs; ++rank) {
      Rank& r = ranks[rank];
      if (r.out >= 0) drain(rank, r, false);
      if (!r.running) continue;
      int status = 0;
      if (waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.running = false;
      --running;
      drain(rank, r, true);
      close(r.out);
      r.out = -1;
      int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && status_out == 0) {
        std::fprintf(stdout, "accel_launch: rank %d failed with status %d; stopping the others\n",
                     rank, code);
        status_out = code;
        stop_all(ranks);
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stdout, "accel_launch: timed out after %.0f s; stopping every rank\n", timeout_s);
      stop_all(ranks);
      for (auto& r : ranks)
        if (r.running) waitpid(r.pid, nullptr, 0);
      return 124;
    }
  }
  return status_out;
}
