// accel/training/dp/buffers.hpp: the sharding engine's working buffers, lent by handle and taken again step after step instead of allocated anew.
//
// Every step of sharded training moves the same buffers: a bucket's
// gradients laid out for the reduce-scatter, what the all-to-all under it
// receives, the folded result, the rows an all-gather lands in, a unit's
// parameters while it runs. On the CPU a fresh buffer of that size is fresh
// pages from the kernel each time (page faults, zeroing) and CUDA's caching
// allocator has no CPU counterpart, so the engine keeps its own pool.
//
// A buffer is lent as a Lease, a handle that gives it back when it goes
// (reset, destroyed, or moved over); and a buffer given back is taken
// again only when nothing else refers to it: no tensor (a view of it that
// c10d or autograd still holds shares its storage, which the pool counts)
// and no storage pointed into it (a unit's parameters: borrow() makes
// their data pointers, counted until they let go). So a buffer cannot be
// reused while a tensor saved for backward still reads it; the next request
// gets another buffer instead (the bug of a pooled buffer handed on while
// autograd held a view of it, which gave wrong gradients without a word,
// cannot be written again). The pool holds what the busiest moment of a
// step needed (the engine bounds that: at most one or two buckets in
// flight, see dp/scatter.hpp, and a unit's prefetch beside the unit
// running, see dp/unit_params.hpp); clear() gives back the memory of every buffer
// not in use, as torch.cuda.empty_cache() does for the caching allocator.
#pragma once

#include "accel/training/torch_nn.hpp"

#include <chrono>
#include <thread>

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
class BufferPool {
  struct Slot {
    at::Tensor buffer;
    bool lent = false;
    std::atomic<int> borrows{0};  // data pointers into it alive (borrow(): freed on any thread)
  };

 public:
  // A buffer lent by the pool: `tensor()` is a flat view of numel elements
  // of it (its contents as they were). Move-only; gives the buffer back
  // when reset or destroyed. An empty Lease (default-made, or reset) holds
  // nothing.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept : slot_(std::move(other.slot_)), view_(std::move(other.view_)) {}
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        reset();
        slot_ = std::move(other.slot_);
        view_ = std::move(other.view_);
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    const at::Tensor& tensor() const { return view_; }
    explicit operator bool() const { return slot_ != nullptr; }
    void reset() noexcept {
      view_ = at::Tensor();  // (its reference to the storage first: the pool counts them)
      if (slot_) slot_->lent = false;
      slot_.reset();
    }
    // A data pointer `offset` bytes into the buffer, for a storage that
    // points into it (a unit's parameter while the unit holds its values):
    // the buffer is not taken again, nor its memory freed, while the
    // pointer lives, whatever happens to this Lease.
    c10::DataPtr borrow(std::size_t offset, c10::Device device) const {
      auto* keep = new std::shared_ptr<Slot>(slot_);
      ++(*keep)->borrows;
      return c10::DataPtr(static_cast<char*>(view_.data_ptr()) + offset, keep, &give_back_borrow, device);
    }

   private:
    friend class BufferPool;
    Lease(std::shared_ptr<Slot> slot, at::Tensor view) : slot_(std::move(slot)), view_(std::move(view)) {}
    static void give_back_borrow(void* keep) {
      auto* slot = static_cast<std::shared_ptr<Slot>*>(keep);
      --(*slot)->borrows;
      delete slot;
    }
    std::shared_ptr<Slot> slot_;
    at::Tensor view_;
  };

  // A buffer of at least `numel` elements of `options`' dtype and device:
  // the smallest free one that holds it and is at most twice its size (so
  // buffers of close sizes, such as a bucket's reduce-scatter input and its
  // all-gather rows, are shared, and a small request never takes a large
  // one), else a new one.
  Lease take(int64_t numel, const at::TensorOptions& options) {
    std::shared_ptr<Slot> best;
    bool held_elsewhere = false;  // a fitting buffer given back that something still refers to
    for (const auto& slot : slots_) {
      if (!fits(*slot, numel, options)) continue;
      if (!free_of_references(*slot)) {
        held_elsewhere = true;
        continue;
      }
      if (!best || slot->buffer.numel() < best->buffer.numel()) best = slot;
    }
    if (!best && held_elsewhere) best = wait_for_release(numel, options);
    if (!best) {
      best = std::make_shared<Slot>();
      best->buffer = at::empty({numel}, options.requires_grad(false));
      slots_.push_back(best);
    }
    best->lent = true;
    return Lease(best, best->buffer.narrow(0, 0, numel));
  }
  // Frees every buffer not in use now.
  void clear() {
    std::erase_if(slots_, [](const std::shared_ptr<Slot>& slot) { return !slot->lent && free_of_references(*slot); });
  }
  // Bytes the pool holds, lent or not.
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto& slot : slots_) n += slot->buffer.numel() * static_cast<int64_t>(slot->buffer.element_size());
    return n;
  }

 private:
  // A buffer not lent, of the dtype and device, holding numel elements and at most twice that.
  static bool fits(const Slot& slot, int64_t numel, const at::TensorOptions& options) {
    return !slot.lent && slot.buffer.numel() >= numel && slot.buffer.numel() <= 2 * numel &&
           slot.buffer.scalar_type() == options.dtype() && slot.buffer.device() == options.device();
  }
  // Nothing but the pool refers to the buffer: no tensor shares its
  // storage, no data pointer points into it.
  static bool free_of_references(const Slot& slot) {
    return slot.borrows.load() == 0 && slot.buffer.storage().use_count() == 1;
  }
  // c10d lets go of a finished operation's tensors a moment after its Work
  // completes, on its own thread (Gloo's worker drops the operation after
  // marking it done): a buffer given back just now may still be referred to
  // for that moment. Waits a little for one to come free; what autograd or
  // a caller holds stays held, and the request then gets a new buffer. The
  // wait sleeps rather than spins, so that on a machine with more processes
  // than cores the worker gets the core it needs (a 2 ms spin let the pool
  // grow by a buffer now and then on two cores running two 4-process
  // tests); it is paid only where the pool would otherwise grow, which
  // happens a bounded number of times in a run.
  std::shared_ptr<Slot> wait_for_release(int64_t numel, const at::TensorOptions& options) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    do {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      for (const auto& slot : slots_)
        if (fits(*slot, numel, options) && free_of_references(*slot)) return slot;
    } while (std::chrono::steady_clock::now() < until);
    return nullptr;
  }

  // (shared: a borrowed data pointer keeps its slot, and the memory, alive past the pool)
  std::vector<std::shared_ptr<Slot>> slots_;
};
using Lease = BufferPool::Lease;
}  // namespace detail::dp

ACCEL_NAMESPACE_END
