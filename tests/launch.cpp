// accel_launch — starts N ranks of a program on this host, for tests and
// examples: accel::launch_processes (accel.hpp's local launcher) as a tool.
// Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR) and a private ACCEL_STORE_DIR for the
// rendezvous (no TCP port), plus MASTER_PORT, unless set, a free port for
// programs that rendezvous over TCP (Python's torch.distributed). Output lines
// are prefixed with "[rank r] "; the first rank that fails stops the others;
// a hard timeout stops everything.
//
//   accel_launch [--timeout SECONDS] NPROCS PROGRAM [ARGS...]
//
// Exit status: 0 when every rank succeeded; the first failing rank's status
// (128+signal when it was killed); 124 on timeout; 2 on bad usage.
#define ACCEL_CORE_ONLY
#include "../accel.hpp"

int main(int argc, char** argv) try {
  int arg = 1;
  accel::LaunchOptions options;
  options.timeout = std::chrono::duration<double>(300);
  if (arg + 1 < argc && std::strcmp(argv[arg], "--timeout") == 0) {
    options.timeout = std::chrono::duration<double>(std::atof(argv[arg + 1]));
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
  const std::vector<std::string> program(argv + arg + 1, argv + argc);
  return accel::launch_processes(nprocs, program, options);
} catch (const std::exception& e) {
  std::fprintf(stderr, "accel_launch: %s\n", e.what());
  return 2;
}
