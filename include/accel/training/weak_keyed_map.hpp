// accel/training/weak_keyed_map.hpp: a map keyed by a tensor's or module's address that forgets an entry once its object has gone.
//
// Some facts about a tensor or module live beside it rather than in it (the
// style a plan gave a module, the twin of a gathered activation, the version
// of a gradient already summed): LibTorch has no slot to hang them on. They
// are kept by address with a weak reference, so an entry whose object has
// gone is never found, even when a new object takes its address, and is
// dropped at the next insertion. Safe to use from several threads.
#pragma once

#include "accel/training/torch_nn.hpp"

#include <mutex>

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Weak is c10::weak_intrusive_ptr<c10::TensorImpl> (TensorKeyedMap) or
// std::weak_ptr<const torch::nn::Module> (ModuleKeyedMap).
template <class Weak, class Value>
class WeakKeyedMap {
 public:
  // Keeps `value` for `object`, replacing what was kept for it.
  void insert(Weak object, Value value) {
    const auto alive = object.lock();
    if (!alive) return;
    const std::lock_guard lock(mutex_);
    std::erase_if(entries_, [](const auto& entry) { return entry.second.object.expired(); });
    entries_.insert_or_assign(static_cast<const void*>(alive.get()), Entry{std::move(object), std::move(value)});
  }
  // What is kept for the live object at `address`, if anything.
  std::optional<Value> find(const void* address) const {
    const std::lock_guard lock(mutex_);
    const auto found = entries_.find(address);
    if (found == entries_.end() || static_cast<const void*>(found->second.object.lock().get()) != address)
      return std::nullopt;
    return found->second.value;
  }
  // How many entries' objects are alive.
  std::size_t live() const {
    const std::lock_guard lock(mutex_);
    return static_cast<std::size_t>(std::count_if(entries_.begin(), entries_.end(),
                                                  [](const auto& entry) { return !entry.second.object.expired(); }));
  }

 private:
  struct Entry {
    Weak object;
    Value value;
  };
  mutable std::mutex mutex_;
  std::unordered_map<const void*, Entry> entries_;
};

template <class Value>
using TensorKeyedMap = WeakKeyedMap<c10::weak_intrusive_ptr<c10::TensorImpl>, Value>;
template <class Value>
using ModuleKeyedMap = WeakKeyedMap<std::weak_ptr<const torch::nn::Module>, Value>;

inline c10::weak_intrusive_ptr<c10::TensorImpl> weak_tensor(const at::Tensor& tensor) {
  return c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr());
}
}  // namespace detail

ACCEL_NAMESPACE_END
