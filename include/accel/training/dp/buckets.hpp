// accel/training/dp/buckets.hpp: which gradients share a bucket (DDP's assignment, with FSDP units).
//
// DataParallel averages gradients a bucket at a time, as backward produces
// them. Which gradients share a bucket is decided once, here, by a pure
// function of their dtypes, devices and sizes, so it can be tested in one
// process against DDP's own cases (tests: "bucket assignment").
#pragma once

#include "accel/core/errors.hpp"
#include "accel/training/torch_nn.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What the assignment needs to know of one gradient.
struct BucketInput {
  c10::ScalarType dtype = c10::kFloat;
  c10::Device device = c10::kCPU;
  int64_t bytes = 0;  // numel * element size
  int64_t unit = -1;  // the FULL_SHARD unit it belongs to (-1: none)
};

struct BucketAssignment {
  std::vector<std::vector<std::size_t>> buckets;  // indices of the inputs, ascending in each bucket
  std::vector<int64_t> size_limits;               // the limit each bucket filled against (0: a unit's, none)
};

// torch's compute_bucket_assignment_by_size (c10d's reducer.cpp), for
// gradients listed in the order backward produces them (DataParallel lists
// the parameters reversed, as DDP does):
// - gradients of one dtype and device share buckets; a bucket takes them
//   until it holds at least its limit, then closes, so it ends with the
//   gradient that filled it (a large layer does not wait alone for the end
//   of backward);
// - each dtype and device goes through size_limits in turn, the last one
//   repeating (DDP passes 1 MiB, then bucket_cap_mb);
// - buckets still open at the end are kept, and all are ordered by their
//   first gradient: the order in which they complete.
// One addition for FULL_SHARD: the gradients of a unit make buckets of
// their own (one per dtype and device) with no limit, since a unit's
// parameters are gathered and freed together.
inline BucketAssignment compute_bucket_assignment_by_size(const std::vector<BucketInput>& inputs,
                                                          const std::vector<int64_t>& size_limits) {
  if (size_limits.empty()) throw InvalidArgument("accel::DataParallel: bucket assignment needs a size limit");
  for (int64_t limit : size_limits)
    if (limit < 1)
      throw InvalidArgument("accel::DataParallel: bucket size limit " + std::to_string(limit) + " is not positive");
  struct Open {
    std::vector<std::size_t> indices;
    int64_t bytes = 0;
    std::size_t limit = 0;  // into size_limits
  };
  using Key = std::tuple<int, int, int, int64_t>;  // dtype, device type, device index, unit
  std::map<Key, Open> open;
  BucketAssignment out;
  auto close = [&out, &size_limits](Open& bucket, bool unit) {
    out.buckets.push_back(std::move(bucket.indices));
    out.size_limits.push_back(unit ? 0 : size_limits[bucket.limit]);
    bucket.indices.clear();
    bucket.bytes = 0;
  };
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const BucketInput& in = inputs[i];
    Open& bucket =
        open[Key{static_cast<int>(in.dtype), static_cast<int>(in.device.type()), in.device.index(), in.unit}];
    bucket.indices.push_back(i);
    bucket.bytes += in.bytes;
    if (in.unit < 0 && bucket.bytes >= size_limits[bucket.limit]) {
      close(bucket, false);
      bucket.limit = std::min(bucket.limit + 1, size_limits.size() - 1);
    }
  }
  for (auto& [key, bucket] : open)
    if (!bucket.indices.empty()) close(bucket, std::get<3>(key) >= 0);
  // Ordered by first index (the buckets are disjoint, so this is a total order).
  std::vector<std::size_t> order(out.buckets.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&out](std::size_t a, std::size_t b) { return out.buckets[a].front() < out.buckets[b].front(); });
  BucketAssignment sorted;
  for (std::size_t k : order) {
    sorted.buckets.push_back(std::move(out.buckets[k]));
    sorted.size_limits.push_back(out.size_limits[k]);
  }
  return sorted;
}
}  // namespace detail

ACCEL_NAMESPACE_END
