// accel/distributed/process_control.hpp: process control: split_between_processes, on_main_process, ....
#pragma once

#include "accel/distributed/exchange.hpp"
#include "accel/distributed/nested.hpp"

ACCEL_NAMESPACE_BEGIN

// Blocks until every rank of the group (default: the world) arrives.
inline void wait_for_everyone(const GroupPtr& group = {}) { barrier(group); }

namespace detail {
// A call every process makes, in the same order (the Accelerator's
// backward, save_model, save_state, ...). One made on some processes only,
// as in `if (is_main_process()) save_model(...)`, waits for the others until
// the timeout (five hours by default), and in a group of its own debug
// mode's check would not see the others either. So in debug mode each such
// call first checks on the world group that every process made the same
// one: it meets the others' next one (their backward, wait_for_everyone)
// and every process names both at once. In any mode a DistributedError out
// of it (the timeout) says that `name` is a collective.
template <class Body>
decltype(auto) every_process_calls(const char* name, Body&& body) {
  if (checking_calls()) [[unlikely]]
    if (c10d::ProcessGroup* world = resolve({}, name)) verify_call(*world, name);
  try {
    return std::forward<Body>(body)();
  } catch (const DistributedError& e) {
    throw DistributedError(std::string(e.what()) + " [" + name +
                           " is a collective: every process calls it, in the same order; called on some processes "
                           "only, as in `if (is_main_process()) ...`, it waits for the others until the timeout]");
  }
}
}  // namespace detail

// main_process_first with the main process of each host (local rank 0).
template <class Body>
std::invoke_result_t<Body&> local_main_process_first(Body&& body) {
  return main_process_first(std::forward<Body>(body), /*local_only=*/true);
}

namespace detail {
// Accelerate's split arithmetic: the first n % size ranks get one more; a
// rank past the end (n < size) gets an empty share.
struct SplitRange {
  int64_t begin, end, target;  // target: every rank's length after padding
};
inline SplitRange split_range(int64_t n, int rank, int size) {
  const int64_t per = n / size, extras = n % size;
  const int64_t begin = rank * per + std::min<int64_t>(rank, extras);  // <= n for every rank < size
  const int64_t end = begin + per + (rank < extras ? 1 : 0);
  return {begin, end, per + (extras > 0)};
}

inline std::pair<int, int> rank_and_size(const GroupPtr& group, const char* op) {
  c10d::ProcessGroup* g = resolve(group, op);
  return g ? std::pair{g->getRank(), g->getSize()} : std::pair{0, 1};
}

template <class T>
int64_t split_length(const T& values) {
  if constexpr (std::is_same_v<T, at::Tensor>) return values.dim() ? values.size(0) : 1;
  else return static_cast<int64_t>(values.size());
}

// With apply_padding a share shorter than the longest is padded with the
// LAST ITEM OF THE WHOLE INPUT (as Accelerate), an empty share included.
template <class T>
T split_part(const T& values, SplitRange range, bool apply_padding) {
  const int64_t n = split_length(values), length = range.end - range.begin;
  const bool pad = apply_padding && n > 0 && length < range.target;
  if constexpr (std::is_same_v<T, at::Tensor>) {
    at::Tensor part = values.narrow(0, range.begin, length);
    if (!pad) return part;
    std::vector<int64_t> sizes = values.sizes().vec();
    sizes[0] = range.target - length;
    return at::cat({part, values.narrow(0, n - 1, 1).expand(sizes)}, 0);
  } else {
    T part(values.begin() + range.begin, values.begin() + range.end);
    if (pad) part.insert(part.end(), static_cast<std::size_t>(range.target - length), values.back());
    return part;
  }
}
}  // namespace detail

// This rank's share of `inputs` (a std::vector, a tensor along dim 0, or a
// string-keyed map of equal-length vectors or tensors), split as Accelerate
// does: 17 items on 4 ranks give 5, 4, 4, 4; 2 items on 4 ranks give 1, 1,
// 0, 0. With apply_padding every share is padded to the longest with the
// last item of the whole input (rank 1 of 17 on 4: 5, 6, 7, 8, 16).
template <class T>
  requires(detail::is_vector<T>::value || std::is_same_v<T, at::Tensor> || detail::is_string_map<T>::value)
T split_between_processes(const T& inputs, bool apply_padding = false, const GroupPtr& group = {}) {
  const auto [rank, size] = detail::rank_and_size(group, "split_between_processes");
  if constexpr (detail::is_string_map<T>::value) {
    std::optional<int64_t> length;
    for (auto* entry : detail::entries_by_key(inputs)) {
      const int64_t n = detail::split_length(entry->second);
      if (length && n != *length)
        throw InvalidArgument("accel::split_between_processes: every value must have the same length; '" +
                              entry->first + "' has " + std::to_string(n) + ", others " + std::to_string(*length));
      length = n;
    }
    T out;
    if (!length) return out;  // an empty map
    for (const auto& [key, values] : inputs)
      out.emplace(key, detail::split_part(values, detail::split_range(*length, rank, size), apply_padding));
    return out;
  } else {
    if constexpr (std::is_same_v<T, at::Tensor>)
      if (inputs.dim() == 0) throw InvalidArgument("accel::split_between_processes: a 0-d tensor cannot be split");
    return detail::split_part(inputs, detail::split_range(detail::split_length(inputs), rank, size), apply_padding);
  }
}

namespace detail {
// One argument of print: a bool as true/false, and a floating-point number in
// the fewest digits that read back as the same value (as Python's print),
// not iostream's 6 significant digits; anything else through operator<<.
template <class T>
void print_one(std::ostream& os, const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    os << (value ? "true" : "false");
  } else if constexpr (std::is_floating_point_v<T>) {
#if defined(__cpp_lib_to_chars)
    std::array<char, 64> text;
    const char* end = std::to_chars(text.data(), text.data() + text.size(), value).ptr;
    os.write(text.data(), end - text.data());
#else  // libc++ before 20: every digit that can matter instead
    os.precision(std::numeric_limits<T>::max_digits10);
    os << value;
#endif
  } else {
    os << value;
  }
}
}  // namespace detail

// Prints its arguments, separated by spaces, on the main process (global
// rank 0) only, as one write, so lines from different hosts never interleave.
template <class... Args>
void print(const Args&... args) {
  if (get_rank() != 0) return;
  std::ostringstream line;
  bool first = true;
  ((line << (first ? "" : " "), detail::print_one(line, args), first = false), ...);
  line << '\n';
  std::cout << line.str() << std::flush;
}

namespace detail {
template <class Fn, class Predicate>
auto on_condition(Fn fn, Predicate runs_here) {
  return [fn = std::move(fn), runs_here](auto&&... args) mutable {
    using R = std::invoke_result_t<Fn&, decltype(args)...>;
    if constexpr (std::is_void_v<R>) {
      if (runs_here()) std::invoke(fn, std::forward<decltype(args)>(args)...);
    } else {
      return runs_here() ? std::optional<R>(std::invoke(fn, std::forward<decltype(args)>(args)...)) : std::nullopt;
    }
  };
}
}  // namespace detail

// Wraps fn so that it runs only on one process; elsewhere the wrapper does
// nothing (and returns an empty std::optional when fn returns a value).
template <class Fn>
auto on_process(Fn fn, int process_index) {
  return detail::on_condition(std::move(fn), [process_index] { return get_rank() == process_index; });
}
template <class Fn>
auto on_main_process(Fn fn) {
  return on_process(std::move(fn), 0);
}
template <class Fn>
auto on_local_main_process(Fn fn) {
  return detail::on_condition(std::move(fn), [] { return get_local_rank() == 0; });
}
template <class Fn>
auto on_last_process(Fn fn) {
  return detail::on_condition(std::move(fn), [] { return get_rank() == get_world_size() - 1; });
}

ACCEL_NAMESPACE_END
