// accel/distributed/pending.hpp: Pending: a collective issued (its start) and not landed yet (its land), the result it gives.
#pragma once

#include "accel/distributed/issue.hpp"

ACCEL_NAMESPACE_BEGIN

namespace detail {
// An operation issued to c10d and not landed yet. Every collective is
// start (checks, staging, issue) then land (after c10d's Work completes:
// copy back from staging, MEAN's division, unpacking), which gives the
// result and owns every buffer the operation uses. A blocking form waits at
// once; an _async form keeps the Pending in an accel::Work. `work` is null
// when nothing was issued (nothing to move).
template <class Land>
struct Pending {
  c10d::ProcessGroup* group;
  const char* op;
  c10::intrusive_ptr<c10d::Work> work;
  Land land;
  decltype(auto) wait() {
    if (work) await(op, *group, *work);
    return land();
  }
};
template <class Land>
Pending(c10d::ProcessGroup*, const char*, c10::intrusive_ptr<c10d::Work>, Land) -> Pending<Land>;

// A Pending whose result is `value`, with nothing to wait for.
template <class T>
auto ready(c10d::ProcessGroup* group, const char* op, T value) {
  return Pending{group, op, {}, [value = std::move(value)]() mutable { return std::move(value); }};
}
// The same operation, its result passed through `next` when it lands.
template <class Land, class Next>
auto then(Pending<Land> pending, Next next) {
  return Pending{pending.group, pending.op, std::move(pending.work),
                 [land = std::move(pending.land), next = std::move(next)]() mutable {
                   if constexpr (std::is_void_v<decltype(land())>) {
                     land();
                     return next();
                   } else {
                     return next(land());
                   }
                 }};
}
}  // namespace detail

ACCEL_NAMESPACE_END
