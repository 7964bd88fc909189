// accel/distributed/staging.hpp: Pending (each collective: a start, then a land), staging, the debug check.
#pragma once

#include "accel/distributed/devices.hpp"
#include "accel/distributed/concepts.hpp"
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

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::MAX: return c10d::ReduceOp::MAX;
    case ReduceOp::MIN: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;  // MEAN is SUM, then a division
  }
}

inline void reject_integral_mean(c10::ScalarType dtype, const char* op = "all_reduce") {
  if (!c10::isFloatingType(dtype) && !c10::isComplexType(dtype))
    throw InvalidArgument(std::string("accel::") + op + ": ReduceOp::MEAN on integral type " + c10::toString(dtype) +
                          " would truncate; use ReduceOp::SUM and divide by the group size, "
                          "or pass a floating-point value");
}

// Dtypes Gloo moves and reduces on every LibTorch version: float32/64,
// float16, int8, uint8, int32 and int64; NCCL has every real dtype. Others
// travel in another form: as their bytes where an operation only moves data;
// for a reduction (stage), bool as uint8, complex as its real
// and imaginary parts, other floating types (bfloat16) in float32 and other
// integers (int16, unsigned) in int64. (Python's torch.distributed fails on
// most of these with Gloo: "Invalid scalar type".) The common dtypes answer
// without asking the backend's name.
inline bool native_dtype(const c10d::ProcessGroup& group, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kChar:
    case c10::kByte:
    case c10::kInt:
    case c10::kLong: return true;
    default: return !c10::isComplexType(dtype) && group.getBackendName() != "gloo";
  }
}
// What c10d gets for a contiguous tensor: itself, or a view of its bytes
// where the backend does not move its dtype (native_dtype).
inline at::Tensor backend_view(const c10d::ProcessGroup& group, const at::Tensor& contiguous) {
  if (native_dtype(group, contiguous.scalar_type())) return contiguous;
  return contiguous.reshape({-1}).view(c10::kByte);
}

// NCCL only moves device memory: CPU data visits the current device. (Only
// builds with NCCL can hold an NCCL group, so others skip the name lookup.)
inline std::optional<c10::Device> staging_device([[maybe_unused]] const c10d::ProcessGroup& group,
                                                 [[maybe_unused]] const at::Tensor& tensor) {
#if ACCEL_WITH_NCCL
  if (!tensor.is_cuda() && group.getBackendName() == "nccl") return get_current_device();
#endif
  return std::nullopt;
}

// How an in-place operation (all_reduce, reduce_to, broadcast, recv) reaches
// c10d: `c10d_tensor` is the tensor c10d gets. The common case runs on the
// caller's tensor itself (contiguous, on the group's device, a dtype the
// backend handles) and leaves `staged` undefined; otherwise it runs on
// `staged`, a contiguous copy on the group's device, which land_in_place
// copies back. A reduction of a dtype the backend cannot reduce is staged
// in a form it can (native_dtype): bool as uint8 (SUM then MAX: a logical
// or, as NCCL's bool sum), complex as its real and imaginary parts, other
// floating types in float32, other integers in int64.
inline bool direct(const c10d::ProcessGroup& group, const at::Tensor& tensor) {
  return !staging_device(group, tensor) && native_dtype(group, tensor.scalar_type()) && tensor.is_contiguous();
}
struct InPlace {
  at::Tensor staged;
  at::Tensor c10d_tensor;
  ReduceOp op = ReduceOp::SUM;  // what c10d_tensor is reduced with
};
inline InPlace stage(const c10d::ProcessGroup& group, const at::Tensor& tensor,
                     std::optional<ReduceOp> reduction = std::nullopt) {
  ReduceOp op = reduction.value_or(ReduceOp::SUM);
  if (direct(group, tensor)) [[likely]]
    return {{}, tensor, op};
  const auto device = staging_device(group, tensor);
  const c10::ScalarType dtype = tensor.scalar_type();
  const bool native = native_dtype(group, dtype);
  at::NoGradGuard no_grad;
  at::Tensor staged = tensor;
  if (reduction && !native) {
    if (dtype == c10::kBool) {
      if (op == ReduceOp::SUM) op = ReduceOp::MAX;
    } else if (c10::isFloatingType(dtype)) {
      staged = staged.to(c10::kFloat);
    } else if (!c10::isComplexType(dtype)) {
      staged = staged.to(c10::kLong);
    }
  }
  if (device) staged = staged.to(*device);
  staged = staged.contiguous();
  at::Tensor c10d_tensor =
      reduction && c10::isComplexType(dtype) ? at::view_as_real(staged) : backend_view(group, staged);
  return {staged.is_same(tensor) ? at::Tensor() : staged, std::move(c10d_tensor), op};
}
// After an in-place operation: MEAN's division (on the staged form, before
// any rounding back to the caller's dtype), then the copy back.
inline void land_in_place(at::Tensor& tensor, const at::Tensor& staged, int64_t divisor) {
  at::NoGradGuard no_grad;
  if (divisor > 1) (staged.defined() ? staged : tensor).div_(divisor);
  if (staged.defined()) tensor.copy_(staged);
}

// Whether a reduction of dtype with op is defined (checked before anything
// moves, on every world size, so that one process behaves as many).
inline void check_other_reduction(c10::ScalarType dtype, ReduceOp op, const char* name);
inline void check_reduction(c10::ScalarType dtype, ReduceOp op, const char* name) {
  if (dtype != c10::kFloat && dtype != c10::kDouble) [[unlikely]]  // (every op is defined on these)
    check_other_reduction(dtype, op, name);
}
inline void check_other_reduction(c10::ScalarType dtype, ReduceOp op, const char* name) {
  if (op == ReduceOp::MEAN) reject_integral_mean(dtype, name);
  if (c10::isComplexType(dtype) && (op == ReduceOp::MAX || op == ReduceOp::MIN))
    throw InvalidArgument(std::string("accel::") + name + ": ReduceOp::" + std::string(to_string(op)) + " of " +
                          c10::toString(dtype) + " is undefined (complex numbers have no order); SUM and MEAN work");
  if (dtype != c10::kBool && !c10::isFloatingType(dtype) && !c10::isComplexType(dtype) &&
      !c10::isIntegralType(dtype, /*includeBool=*/false))
    throw InvalidArgument(std::string("accel::") + name + ": dtype " + c10::toString(dtype) + " cannot be reduced");
}

// Collectives are not differentiable: our own in-place copies and the MEAN
// division must not trip autograd's checks (in Python, c10d ops bypass
// autograd too), so they run under NoGradGuard. A tensor with no elements
// moves nothing (Gloo divides by the element count).
//
// The blocking all_reduce of a tensor c10d can reduce where it is (direct)
// is the hot path (callgrind_overhead guards it): it runs without a Pending,
// whose moves, captures and destructors cost 200 instructions per call
// (+2.5%); every other case takes start_all_reduce.
inline void all_reduce_direct(c10d::ProcessGroup& group, at::Tensor& tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors(1, tensor);
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  run("all_reduce", group, [&] { return group.allreduce(tensors, opts); });
  if (op == ReduceOp::MEAN) {
    at::NoGradGuard no_grad;
    tensor.div_(group.getSize());
  }
}
// The c10d call of an all_reduce of what stage() made.
inline c10::intrusive_ptr<c10d::Work> issue_all_reduce(c10d::ProcessGroup& group, const InPlace& s) {
  std::vector<at::Tensor> tensors{s.c10d_tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(s.op);
  return issue("all_reduce", group, [&] { return group.allreduce(tensors, opts); });
}
inline auto start_all_reduce(c10d::ProcessGroup& group, at::Tensor tensor, ReduceOp op) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) [[likely]] {
    s = stage(group, tensor, op);
    work = issue_all_reduce(group, s);
  }
  const int64_t divisor = op == ReduceOp::MEAN ? group.getSize() : 1;
  return Pending{&group, "all_reduce", std::move(work),
                 [tensor = std::move(tensor), staged = std::move(s.staged), divisor]() mutable {
                   if (divisor > 1 || staged.defined()) [[unlikely]]
                     land_in_place(tensor, staged, divisor);
                   return std::move(tensor);
                 }};
}
// Onto rank `dst` of the group: only there is the result defined (and
// divided for MEAN).
inline auto start_reduce(c10d::ProcessGroup& group, at::Tensor tensor, ReduceOp op, int dst) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) {
    s = stage(group, tensor, op);
    std::vector<at::Tensor> tensors{s.c10d_tensor};
    c10d::ReduceOptions opts;
    opts.reduceOp = to_c10d(s.op);
    opts.rootRank = dst;
    work = issue("reduce_to", group, [&] { return group.reduce(tensors, opts); });
  }
  const int64_t divisor = op == ReduceOp::MEAN && dst == group.getRank() ? group.getSize() : 1;
  return Pending{&group, "reduce_to", std::move(work),
                 [tensor = std::move(tensor), staged = std::move(s.staged), divisor]() mutable {
                   land_in_place(tensor, staged, divisor);
                   return std::move(tensor);
                 }};
}
// The blocking all_reduce of a tensor. A tensor that must be staged first
// takes the steps of start_all_reduce without its Pending: a file that calls
// all_reduce compiles this path whether it runs or not, and the Pending's
// captures and moves cost a sixth of what the compiler spends on a raw c10d
// allreduce call (counted in its instructions).
inline void all_reduce_tensor(c10d::ProcessGroup& group, at::Tensor& tensor, ReduceOp op) {
  if (tensor.numel() == 0) return;
  if (direct(group, tensor)) [[likely]]
    return all_reduce_direct(group, tensor, op);
  const InPlace s = stage(group, tensor, op);
  await("all_reduce", group, *issue_all_reduce(group, s));
  land_in_place(tensor, s.staged, op == ReduceOp::MEAN ? group.getSize() : 1);
}

// The source of a broadcast is a rank within the group (`name` is how the
// operation's parameter is called); without a group only rank 0 exists.
inline void check_source(const c10d::ProcessGroup* group, int src, const char* op, const char* name) {
  if (!group && src != 0)
    throw InvalidArgument(std::string("accel::") + op + ": " + name + "=" + std::to_string(src) +
                          " but the process is not distributed (only rank 0 exists)");
  if (group && (src < 0 || src >= group->getSize()))
    throw InvalidArgument(std::string("accel::") + op + ": " + name + "=" + std::to_string(src) + " is not a rank of " +
                          describe(*group) + " (" + name + " is a rank within the group)");
}

inline void check_peer(const c10d::ProcessGroup* group, int peer, const char* op, const char* name) {
  check_source(group, peer, op, name);
  if (group && peer == group->getRank())
    throw InvalidArgument(std::string("accel::") + op + ": " + name + "=" + std::to_string(peer) +
                          " is this rank itself");
}

// `src` was checked by the caller (check_source).
inline auto start_broadcast(c10d::ProcessGroup& group, at::Tensor tensor, int src) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) {
    s = stage(group, tensor);
    std::vector<at::Tensor> tensors{s.c10d_tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    work = issue("broadcast", group, [&] { return group.broadcast(tensors, opts); });
  }
  return Pending{&group, "broadcast", std::move(work),
                 [tensor = std::move(tensor), staged = std::move(s.staged)]() mutable {
                   land_in_place(tensor, staged, 1);
                   return std::move(tensor);
                 }};
}
inline void broadcast_tensor(c10d::ProcessGroup& group, const at::Tensor& tensor, int src) {
  start_broadcast(group, tensor, src).wait();
}

// Gathers `input` from every rank into `outputs[r]` (same shape, any
// memory); outputs c10d cannot write into directly are staged and copied
// back when it lands.
inline auto start_all_gather_into(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<at::Tensor> outputs,
                                  const char* op = "all_gather") {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> staged;  // empty: c10d writes into outputs
  if (input.numel() != 0) {
    const auto device = staging_device(group, input);
    std::vector<at::Tensor> inputs{backend_view(group, device ? input.to(*device).contiguous() : input.contiguous())};
    const bool direct =
        !device && std::all_of(outputs.begin(), outputs.end(), [](const at::Tensor& t) { return t.is_contiguous(); });
    if (!direct)
      for (const auto& t : outputs)
        staged.push_back(at::empty(t.sizes(), t.options().device(device.value_or(t.device()))));
    std::vector<std::vector<at::Tensor>> output_lists(1);
    for (const auto& t : direct ? outputs : staged) output_lists[0].push_back(backend_view(group, t));
    work = issue(op, group, [&] { return group.allgather(output_lists, inputs); });
  }
  return Pending{&group, op, std::move(work), [outputs = std::move(outputs), staged = std::move(staged)] {
                   at::NoGradGuard no_grad;
                   for (std::size_t r = 0; r < staged.size(); ++r) outputs[r].copy_(staged[r]);
                 }};
}
inline void all_gather_into(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<at::Tensor> outputs,
                            const char* op = "all_gather") {
  start_all_gather_into(group, input, std::move(outputs), op).wait();
}

// The all-gather of a Gloo group's CPU tensors without c10d's staging.
// Gloo's allgather gathers into a flat buffer of its own, allocated per call,
// and copies the rows out (LibTorch 2.15: through two such buffers). Here
// each rank sends its pieces to every other rank and receives theirs straight
// where they belong, `into(from, i)` for piece i of rank `from` (a
// contiguous CPU tensor of that piece's length, the same on every rank; an
// empty one is neither sent nor received), and copies its own pieces in: no
// allocation, one local copy, and the same bytes on the wire as Gloo's ring
// (each rank sends and receives size - 1 rows). Gloo moves a
// point-to-point message as bytes, whatever the dtype. Messages between two
// ranks with one tag match in the order they were issued, and every rank
// issues the same gathers in the same order; `tag` keeps them apart from
// the caller's own sends. The Pending waits on the last operation issued,
// and its landing on every other one. A piece is a message, so many small
// pieces cost more than one row copied out after (see dp_units.hpp).
inline constexpr const char* kDirectGather = "all_gather (point to point)";
inline bool direct_gather_fits(const c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& rows) {
  return group.getBackendName() == "gloo" && input.device().is_cpu() && rows.device().is_cpu() &&
         input.is_contiguous() && rows.is_contiguous() && input.numel() > 0;
}
// The exchange under it (and under the sharding engine's point-to-point
// reduce-scatter, dp_scatter.hpp, named kDirectScatter): to every other
// rank `to`, `count` pieces sent(to, i); from every other rank `from`,
// count pieces received into into(from, i). Both sides must agree on each
// piece's length (an empty one is neither sent nor received).
inline constexpr const char* kDirectScatter = "reduce_scatter (point to point)";
// The messages of an exchange not waited for yet. await_all() waits for
// them in order and throws the first failure; whatever it left (after a
// failure, or when the exchange's own last message failed first and its
// landing never ran) is waited for when this is dropped, failures ignored:
// an exchange ends with every message of it ended, so no buffer it reads
// or writes goes back to its owner (the sharding engine's pool) while a
// message still uses it. A message of a dead peer fails at once; one of a
// live peer that never sends ends by the group's timeout.
class Outstanding {
 public:
  Outstanding(c10d::ProcessGroup* group, const char* op, std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : group_(group), op_(op), works_(std::move(works)) {}
  Outstanding(Outstanding&& other) noexcept
      : group_(other.group_), op_(other.op_), works_(std::move(other.works_)), next_(std::exchange(other.next_, 0)) {
    other.works_.clear();
  }
  Outstanding(const Outstanding&) = delete;
  Outstanding& operator=(const Outstanding&) = delete;
  Outstanding& operator=(Outstanding&&) = delete;
  ~Outstanding() {
    for (; next_ < works_.size(); ++next_) {
      try {
        works_[next_]->wait();
      } catch (const std::exception&) {  // (the exchange has reported its failure, or is being dropped)
      }
    }
  }
  void await_all() {
    while (next_ < works_.size()) await(op_, *group_, *works_[next_++]);
  }

 private:
  c10d::ProcessGroup* group_;
  const char* op_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::size_t next_ = 0;
};
template <class Sent, class Into>
inline auto start_exchange_pieces(c10d::ProcessGroup& group, std::size_t count, Sent sent, Into into, int tag,
                                  const char* op = kDirectGather) {
  const int size = group.getSize(), rank = group.getRank();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(2 * static_cast<std::size_t>(size - 1) * count);
  for (int step = 1; step < size; ++step) {  // (peers in a ring order: rank + 1 first, so no rank is everyone's first)
    const int to = (rank + step) % size, from = (rank - step + size) % size;
    for (std::size_t i = 0; i < count; ++i) {
      std::vector<at::Tensor> out{sent(to, i)}, in{into(from, i)};
      if (out[0].numel() > 0) works.push_back(issue(op, group, [&] { return group.send(out, to, tag); }));
      if (in[0].numel() > 0) works.push_back(issue(op, group, [&] { return group.recv(in, from, tag); }));
    }
  }
  c10::intrusive_ptr<c10d::Work> last;
  if (!works.empty()) {
    last = works.back();
    works.pop_back();
  }
  return Pending{&group, op, std::move(last),
                 [outstanding = Outstanding{&group, op, std::move(works)}]() mutable { outstanding.await_all(); }};
}
template <class Into>
inline auto start_all_gather_pieces(c10d::ProcessGroup& group, const std::vector<at::Tensor>& pieces, Into into,
                                    int tag) {
  auto pending = start_exchange_pieces(group, pieces.size(), [&](int, std::size_t i) { return pieces[i]; }, into, tag);
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < pieces.size(); ++i)
    if (pieces[i].numel() > 0) into(group.getRank(), i).copy_(pieces[i]);
  return pending;
}
// ... of one piece per rank, into `rows` (group size rows, in rank order).
inline auto start_all_gather_direct(c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& rows,
                                    int tag) {
  return then(start_all_gather_pieces(
                  group, {input}, [rows](int from, std::size_t) { return rows.select(0, from); }, tag),
              [rows] {});
}

// Rank `src` sends pieces[r] to rank r of the group; every rank returns its
// own (the source: an empty vector; it keeps its piece). One broadcast of the
// lengths, one scatter of the pieces padded to the longest: each rank
// receives only its own bytes. `pieces` matters on the source only.
inline std::vector<char> scatter_bytes(c10d::ProcessGroup& group, int src, const std::vector<std::vector<char>>& pieces,
                                       const char* op) {
  const int size = group.getSize(), rank = group.getRank();
  std::vector<int64_t> lengths(static_cast<std::size_t>(size), 0);
  if (rank == src)
    for (int r = 0; r < size; ++r)
      if (r != src) lengths[r] = static_cast<int64_t>(pieces.at(static_cast<std::size_t>(r)).size());
  at::Tensor length_view = at::from_blob(lengths.data(), {size}, cpu_options(c10::kLong));
  broadcast_tensor(group, length_view, src);
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  at::Tensor output = at::empty({longest}, cpu_options(c10::kByte));
  const std::optional<c10::Device> device = staging_device(group, output);
  std::vector<std::vector<at::Tensor>> inputs;
  if (rank == src) {
    inputs.emplace_back();
    for (int r = 0; r < size; ++r) {
      at::Tensor padded = at::zeros({longest}, cpu_options(c10::kByte));
      if (lengths[r] > 0) std::memcpy(padded.data_ptr(), pieces[r].data(), static_cast<std::size_t>(lengths[r]));
      inputs.back().push_back(device ? padded.to(*device) : padded);
    }
  }
  std::vector<at::Tensor> outputs{device ? output.to(*device) : output};
  c10d::ScatterOptions opts;
  opts.rootRank = src;
  run(op, group, [&] { return group.scatter(outputs, inputs, opts); });
  const at::Tensor received = outputs.front().to(c10::kCPU);
  const auto* bytes = static_cast<const char*>(received.data_ptr());
  return std::vector<char>(bytes, bytes + lengths[static_cast<std::size_t>(rank)]);
}

// Every rank's `count` elements at `mine` (CPU memory), rank-major into
// `all`, which holds group size * count elements.
template <class T>
auto start_all_gather_cpu(c10d::ProcessGroup& group, const T* mine, int64_t count, T* all, const char* op) {
  constexpr c10::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  std::vector<at::Tensor> outputs;
  for (int r = 0; r < group.getSize(); ++r)
    outputs.push_back(at::from_blob(all + r * count, {count}, cpu_options(dtype)));
  // c10d only reads an allgather's input.
  return start_all_gather_into(group, at::from_blob(const_cast<T*>(mine), {count}, cpu_options(dtype)),
                               std::move(outputs), op);
}
template <class T>
void all_gather_cpu(c10d::ProcessGroup& group, const T* mine, int64_t count, T* all, const char* op) {
  start_all_gather_cpu(group, mine, count, all, op).wait();
}

inline std::vector<int64_t> stacked_shape(int size, const at::Tensor& input) {
  std::vector<int64_t> shape{size};
  shape.insert(shape.end(), input.sizes().begin(), input.sizes().end());
  return shape;
}

// Gathers into the rows of `stacked`, of shape (group size, *input's shape).
inline auto start_all_gather_rows(c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& stacked,
                                  const char* op = "all_gather") {
  std::vector<at::Tensor> rows;
  rows.reserve(group.getSize());
  for (int r = 0; r < group.getSize(); ++r) rows.push_back(stacked.select(0, r));
  return start_all_gather_into(group, input, std::move(rows), op);
}

// Types no backend reduces natively travel as bytes; all_reduce then gathers
// every rank's bytes and folds them locally in T, which stays exact.
template <Scalar T>
T fold(ReduceOp op, const T* values, int count, int stride) {
  T acc = values[0];
  for (int r = 1; r < count; ++r) {
    T x = values[static_cast<std::size_t>(r) * stride];
    switch (op) {
      case ReduceOp::SUM:
      case ReduceOp::MEAN: acc = static_cast<T>(acc + x); break;
      case ReduceOp::MAX: acc = std::max(acc, x); break;
      case ReduceOp::MIN: acc = std::min(acc, x); break;
    }
  }
  if (op == ReduceOp::MEAN) acc = static_cast<T>(acc / count);
  return acc;
}

template <Scalar T>
auto start_fold(c10d::ProcessGroup& group, std::vector<T> data, ReduceOp op, const char* name) {
  const int size = group.getSize();
  std::vector<T> gathered(data.size() * static_cast<std::size_t>(size));
  auto pending = start_all_gather_cpu(group, reinterpret_cast<const uint8_t*>(data.data()),
                                      static_cast<int64_t>(data.size() * sizeof(T)),
                                      reinterpret_cast<uint8_t*>(gathered.data()), name);
  // (Moving a std::vector keeps its elements where c10d reads and writes them.)
  return then(std::move(pending), [data = std::move(data), gathered = std::move(gathered), op, size]() mutable {
    for (std::size_t i = 0; i < data.size(); ++i)
      data[i] = fold<T>(op, gathered.data() + i, size, static_cast<int>(data.size()));
    return std::move(data);
  });
}

// FNV-1a: the same on every host and compiler (std::hash promises neither).
inline uint64_t fnv1a(const void* data, std::size_t size) {
  uint64_t hash = 1469598103934665603ull;
  for (std::size_t i = 0; i < size; ++i) {
    hash ^= static_cast<const unsigned char*>(data)[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

// Debug mode: one fixed-size all_gather of (hash, length) of every rank's
// description of its call; only on a mismatch a second one carries the
// texts, so that every rank throws the same listing. Both are the same size
// on every rank whatever was passed, so the check itself cannot desynchronise.
inline void verify_same_call(c10d::ProcessGroup& group, const std::string& call) {
  const int size = group.getSize();
  std::array<int64_t, 2> mine{static_cast<int64_t>(fnv1a(call.data(), call.size())), static_cast<int64_t>(call.size())};
  std::vector<int64_t> all(2 * static_cast<std::size_t>(size));
  all_gather_cpu<int64_t>(group, mine.data(), 2, all.data(), "debug-mode check");
  // Decided on data every rank holds, so every rank decides alike.
  int64_t longest = 0;
  bool same = true;
  for (int r = 0; r < size; ++r) {
    same = same && all[2 * r] == all[0] && all[2 * r + 1] == all[1];
    longest = std::max(longest, all[2 * r + 1]);
  }
  if (same) return;
  std::string padded = call;
  padded.resize(static_cast<std::size_t>(longest), '\0');
  std::string texts(static_cast<std::size_t>(longest) * size, '\0');
  all_gather_cpu(group, reinterpret_cast<const uint8_t*>(padded.data()), longest,
                 reinterpret_cast<uint8_t*>(texts.data()), "debug-mode check");
  std::string message = "accel [ACCEL_DEBUG_MODE]: the ranks of group '" + group_name(group) + "' (" +
                        group.getBackendName() + ", " + std::to_string(size) + " ranks) made different calls:";
  for (int r = 0; r < size; ++r)
    message += "\n  rank " + std::to_string(r) + ": " +
               texts.substr(static_cast<std::size_t>(longest) * r, static_cast<std::size_t>(all[2 * r + 1]));
  throw DistributedError(message);
}

// Debug mode's check, through the pointer that registering a group or
// set_debug_mode sets (registration.hpp says why).
inline void verify_call(c10d::ProcessGroup& group, const std::string& call) {
  auto* verify = registry().verify_same_call.load(std::memory_order_acquire);
  if (!verify)
    throw LogicError(
        "accel: debug mode is on (or ACCEL_DEBUG_MODE is set) but its check is not set up in this process: it comes "
        "with the groups accel makes (DistributedInterface::instance(), new_group, split_group, meshes) and with "
        "accel::set_debug_mode(); call accel::set_debug_mode(true) before using a group made with c10d directly "
        "(or set_debug_mode(std::nullopt) to go by ACCEL_DEBUG_MODE)");
  verify(group, call);
}
// Runs the debug-mode check when it is on; `describe` builds the text only then.
template <class Describe>
void check_same_call(c10d::ProcessGroup& group, Describe&& describe) {
  if (checking_calls()) [[unlikely]]
    verify_call(group, describe());
}

inline std::string describe_tensor(const at::Tensor& t, std::optional<int64_t> free_dim = std::nullopt) {
  if (!t.defined()) return "undefined tensor";
  std::ostringstream os;
  os << t.scalar_type() << "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) os << ", ";
    if (free_dim && *free_dim == i) os << '*';
    else os << t.size(i);
  }
  os << "] " << t.device();
  return os.str();
}

// Debug mode's texts are built only when it is on, but their code is
// compiled in every file that calls a collective; so the building is done by
// these functions, compiled once per file, rather than at each call site.
// A number type (int32, uint8, float64); a std::vector of them with its size.
inline std::string number_type(bool floating, bool is_signed, std::size_t bytes) {
  return (floating ? "float" : is_signed ? "int" : "uint") + std::to_string(bytes * 8);
}
inline std::string vector_of(const std::string& element, std::size_t size) {
  return "vector<" + element + ">[" + std::to_string(size) + "]";
}
// A call: "op(arg, arg)".
inline std::string call_text(const char* op, std::initializer_list<std::string_view> args) {
  std::string text = std::string(op) + "(";
  for (std::string_view arg : args) text.append(text.back() == '(' ? "" : ", ").append(arg);
  return text + ")";
}

template <Scalar T>
std::string type_tag() {
  return number_type(std::is_floating_point_v<T>, std::is_signed_v<T>, sizeof(T));
}

template <TensorLike T>
std::string describe_tensorlike(const T& data) {
  if constexpr (std::same_as<T, at::Tensor>) return describe_tensor(data);
  else if constexpr (Scalar<T>) return type_tag<T>();
  else return vector_of(type_tag<element_t<T>>(), data.size());
}

// An in-place operation (all_reduce, broadcast, reduce_to, recv) writes every element of
// the tensor it is given. Elements that share memory (expand(), a stride of 0)
// would each receive a result in the same place: c10d notices only after the
// collective ran (a c10::Error on every rank), and nothing notices on one
// process, so it is refused before anything is sent, at every world size.
inline void check_no_overlap(const at::Tensor& t, const char* op) {
  if (!t.defined() || at::has_internal_overlap(t) != at::MemOverlap::Yes) return;
  std::ostringstream os;
  os << "accel::" << op << ": the " << describe_tensor(t) << " has elements that share memory (strides " << t.strides()
     << ", as from expand()), so it cannot receive the result in place; pass .contiguous() or .clone()";
  throw InvalidArgument(os.str());
}
template <TensorLike T>
void check_writable(const T& data, const char* op) {
  if constexpr (std::same_as<T, at::Tensor>) check_no_overlap(data, op);
}
}  // namespace detail

ACCEL_NAMESPACE_END
