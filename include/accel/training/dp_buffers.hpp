// accel/training/dp_buffers.hpp: the sharding engine's working buffers, taken again step after step instead of allocated anew.
//
// Every step of sharded training moves the same buffers: a bucket's
// gradients laid out for the reduce-scatter, what the all-to-all under it
// receives, the folded result, the rows an all-gather lands in, a unit's
// parameters while it runs. On the CPU a fresh buffer of that size is fresh
// pages from the kernel each time (page faults, zeroing) and CUDA's caching
// allocator has no CPU counterpart, so the engine keeps its own: a buffer
// is given back to the pool once the collective that used it has landed,
// and the next request of about the same size and kind takes it again.
// The pool holds what the busiest moment of a step needed (the engine
// bounds that: at most one or two buckets in flight, see dp_scatter.hpp,
// and a unit's prefetch beside the unit running, see dp_units.hpp); clear()
// gives it back, as torch.cuda.empty_cache() does for the caching allocator.
#pragma once

#include "accel/training/torch_nn.hpp"

#include <deque>

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
class BufferPool {
 public:
  // A flat tensor of `numel` elements of `options`' dtype and device, its
  // contents left as they were, lent until give() takes it back: the front
  // of the smallest free buffer that holds it and is at most twice its size,
  // else of a new one (so buffers of close sizes, such as a bucket's
  // reduce-scatter input and its all-gather rows, are shared, and a small
  // request never takes a large one).
  at::Tensor take(int64_t numel, const at::TensorOptions& options) {
    Slot* best = nullptr;
    for (Slot& slot : slots_)
      if (!slot.lent && slot.buffer.numel() >= numel && slot.buffer.numel() <= 2 * numel &&
          slot.buffer.scalar_type() == options.dtype() && slot.buffer.device() == options.device() &&
          (!best || slot.buffer.numel() < best->buffer.numel()))
        best = &slot;
    if (!best) best = &slots_.emplace_back(Slot{at::empty({numel}, options.requires_grad(false)), false});
    best->lent = true;
    return best->buffer.narrow(0, 0, numel);
  }
  // Takes back what take() lent (any view of it), once the operation that
  // used it has completed. Told, not inferred from reference counts: c10d
  // may drop its references to a completed operation's tensors later, on
  // its own thread. Undefined tensors are ignored.
  void give(const at::Tensor& taken) {
    if (!taken.defined()) return;
    for (Slot& slot : slots_)
      if (slot.buffer.storage().is_alias_of(taken.storage())) slot.lent = false;
  }
  // Frees every buffer not lent now.
  void clear() {
    std::erase_if(slots_, [](const Slot& slot) { return !slot.lent; });
  }
  // Bytes the pool holds, lent or not.
  int64_t bytes() const {
    int64_t n = 0;
    for (const Slot& slot : slots_) n += slot.buffer.numel() * static_cast<int64_t>(slot.buffer.element_size());
    return n;
  }

 private:
  struct Slot {
    at::Tensor buffer;
    bool lent;
  };
  std::deque<Slot> slots_;  // (a deque: take() hands out a slot while others are added)
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END
