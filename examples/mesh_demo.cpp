// Mesh demo: each rank's coordinates in the model mesh (mp_replicate,
// mp_shard) and the data mesh (dp, cp), and the result of a collective along
// every dimension, printed as one table by rank 0.
//
//   accel_launch 4 ./mesh_demo [mp_replicate_size [cp_size]]   (default 2 2)
#include "accel.hpp"

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  using accel::Dim;
  accel::DistributedConfig config;
  config.mp_replicate_size = argc > 1 ? std::atoi(argv[1]) : 2;
  config.cp_size = argc > 2 ? std::atoi(argv[2]) : 2;
  config.timeout = std::chrono::seconds(60);
  if (!accel::is_distributed()) config = {};  // a single process: every size is 1
  auto& dist = accel::DistributedInterface::instance(config);
  const int64_t rank = dist.get_rank();
  constexpr Dim dims[] = {Dim::MP_REPLICATE, Dim::MP_SHARD, Dim::DP, Dim::CP};

  // This rank's row: its rank, its coordinate along each dimension, then the
  // all_gather of every member's rank along each dimension (its group).
  std::vector<int64_t> row{rank};
  for (Dim dim : dims) row.push_back(dist.get_rank(dim));
  for (Dim dim : dims)
    for (int64_t member : dist.all_gather(rank, dim)) row.push_back(member);
  auto table = dist.all_gather(row, std::nullopt);  // one row from every rank of the world

  if (rank == 0) {
    auto list = [](const std::vector<int64_t>& r, std::size_t& at, int n) {
      std::string s = "[";
      for (int i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(r[at++]);
      return s + "]";
    };
    std::ostringstream strategy;
    strategy << dist.strategy();
    std::printf("%s\n\nrank | model (mp_replicate, mp_shard) | data (dp, cp) |"
                " all_gather(rank) along: mp_replicate  mp_shard  dp  cp\n",
                strategy.str().c_str());
    for (const auto& r : table) {
      std::size_t at = 5;
      std::string groups;
      for (Dim dim : dims) groups += list(r, at, dist.get_world_size(dim)) + "  ";
      std::printf("%4lld | %30s | %13s | %s\n", static_cast<long long>(r[0]),
                  ("(" + std::to_string(r[1]) + ", " + std::to_string(r[2]) + ")").c_str(),
                  ("(" + std::to_string(r[3]) + ", " + std::to_string(r[4]) + ")").c_str(),
                  groups.c_str());
    }
  }
  dist.destroy();
}
