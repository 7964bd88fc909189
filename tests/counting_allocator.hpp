// A CPU allocator that counts: wraps LibTorch's and keeps live, peak and
// total bytes, so that tests and benchmarks report allocator bytes, not RSS
// guesses. Install with install(); every CPU allocation LibTorch makes goes
// through it from then on (c10::SetCPUAllocator), and uninstall() puts the
// previous one back (at a higher priority: c10 only takes an allocator of at
// least the current priority). Memory allocated meanwhile is released
// through its own context whenever it is freed, which may be long after
// (a Gloo worker thread drops a collective's tensors when it likes): so the
// one allocator is never destroyed, and is reached through instance().
//
// Its DataPtrs are LibTorch's own simple kind, whose context is the data
// pointer, so raw_allocate works through it too (LibTorch 2.15's bf16
// matrix products take their scratch memory that way, and assert that
// simple kind): the bytes of each allocation are kept in a table by
// address instead of a context of their own.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace accel_test {
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& instance() {
    static auto* one = new CountingAllocator();  // leaked on purpose: see above
    return *one;
  }
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override { return counted(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return const_cast<CountingAllocator*>(this)->counted(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void install() {
    if (c10::GetCPUAllocator() == this) return;  // already counting
    base_ = c10::GetCPUAllocator();
    base_deleter_ = base_->raw_deleter();
    if (!base_deleter_) throw std::logic_error("accel_test::CountingAllocator: the CPU allocator has no raw deleter");
    c10::SetCPUAllocator(this, /*priority=*/static_cast<uint8_t>(++priority()));
  }
  void uninstall() { c10::SetCPUAllocator(base_, /*priority=*/static_cast<uint8_t>(++priority())); }
  int64_t live() const { return live_; }
  int64_t peak() const { return peak_; }
  int64_t total() const { return total_; }  // every byte ever allocated
  void reset_peak() { peak_ = live_.load(); }

 private:
  CountingAllocator() = default;
  static int& priority() {
    static int p = 100;
    return p;
  }
  static void release(void* data) {
    CountingAllocator& self = instance();
    int64_t bytes = 0;
    {
      std::lock_guard lock(self.mutex_);
      const auto found = self.bytes_.find(data);
      if (found != self.bytes_.end()) {
        bytes = found->second;
        self.bytes_.erase(found);
      }
    }
    self.live_ -= bytes;
    self.base_deleter_(data);
  }
  c10::DataPtr counted(size_t n) {
    c10::DataPtr inner = base_->allocate(n);
    const c10::Device device = inner.device();
    // (LibTorch's CPU allocator gives simple pointers: the context is the data, freed by its raw deleter)
    if (inner.get() != inner.get_context() || inner.get_deleter() != base_deleter_)
      throw std::logic_error("accel_test::CountingAllocator: the CPU allocator's pointers are not simple");
    void* data = inner.release_context();
    {
      std::lock_guard lock(mutex_);
      bytes_[data] = static_cast<int64_t>(n);
    }
    total_ += static_cast<int64_t>(n);
    const int64_t now = live_ += static_cast<int64_t>(n);
    int64_t peak = peak_;
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &release, device};
  }
  c10::Allocator* base_ = nullptr;
  c10::DeleterFnPtr base_deleter_ = nullptr;
  std::mutex mutex_;
  std::unordered_map<void*, int64_t> bytes_;  // what each live allocation counted
  std::atomic<int64_t> live_{0}, peak_{0}, total_{0};
};
}  // namespace accel_test
