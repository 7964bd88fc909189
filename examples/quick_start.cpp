// Quick start: average a loss and gather per-rank counts across all ranks.
// Build:  g++ -std=c++20 quick_start.cpp -o quick_start -ltorch_cpu -lc10
// Run 2:  for r in 0 1; do RANK=$r WORLD_SIZE=2 ./quick_start & done; wait
#include "accel.hpp"
#include <iostream>

int main() {
  auto& dist = accel::DistributedInterface::instance();  // rendezvous via MASTER_ADDR/PORT
  at::Tensor loss = at::full({}, 1.0 + dist.get_rank());
  dist.all_reduce(loss);                                   // in place, MEAN over the dp group
  auto counts = dist.all_gather(int64_t{10 * dist.get_rank()});  // std::vector<int64_t>
  if (dist.get_rank() == 0)
    std::cout << "mean loss " << loss.item<double>() << ", counts from " << counts.size() << " ranks\n";
  dist.destroy();
}
