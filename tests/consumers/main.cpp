// An out-of-tree program that uses accel.hpp through one of the ways a
// project consumes it (see the CMakeLists.txt next to this file's copies).
#ifdef ACCEL_CONSUMER_INCLUDE_TREE  // the installed include tree, as the pkg-config build uses it
#include <accel/distributed.hpp>
#else
#include <accel.hpp>
#endif

#include <iostream>

int main() {
  auto& dist = accel::DistributedInterface::instance();
  const int world = dist.get_world_size();
  const int64_t sum = dist.all_reduce(int64_t{dist.get_rank() + 1}, accel::ReduceOp::SUM);
  if (dist.get_rank() == 0)
    std::cout << "consumer ok: sum " << sum << " on " << world << " ranks, accel " << ACCEL_VERSION_MAJOR << "."
              << ACCEL_VERSION_MINOR << "." << ACCEL_VERSION_PATCH << "\n";
  dist.destroy();
  return sum == int64_t{world} * (world + 1) / 2 ? 0 : 1;
}
