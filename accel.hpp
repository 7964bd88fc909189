// accel.hpp — distributed training helpers for LibTorch, in one C++20 header.
//
// Rank and device helpers, collectives over tensors, scalars and std::vector,
// validated parallelism meshes (named N-D layouts with slicing and
// flattening) with per-dimension process groups, Accelerate's operations and
// data-parallel and sharded training, on the real c10d backends (Gloo
// everywhere, NCCL on CUDA builds of LibTorch).
//
// SPDX-License-Identifier: MIT
// Copyright (c) 2026 the accel.hpp authors. See LICENSE for the full text.
//
// GENERATED FILE: do not edit. tools/amalgamate.py assembles it from the
// parts under include/accel/ (edit those, then run it; CONTRIBUTING.md).
// Each part begins at a line "// == accel/<tier>/<part>.hpp"; search for it.
//
// Contents, in the order data flows through the header:
//   core:
//     accel/core/version.hpp                             the version macros (CMake and the packages read them here)
//     accel/core/config.hpp                              compile-time knobs, the environment's names, the ABI namespace
//     accel/core/errors.hpp                              the error family: accel::Error and its kinds
//     accel/core/enums.hpp                               ReduceOp, Dim, DeviceType and friends, with their string forms
//     accel/core/environment.hpp                         reading torchrun's and the MPI/Slurm launchers' environment
//     accel/core/strategy.hpp                            DistributedConfig and DistributedStrategy: the parallel sizes, validated
//     accel/core/launcher.hpp                            the local launcher: spawn and launch_processes (Linux)
//     accel/core/pipeline_actions.hpp                    a pipeline schedule's actions as torch.distributed.pipelining writes them (2F0, 1UNSHARD, 3SEND_F1), and its CSV of a row per rank
//     accel/core/pipeline_rules.hpp                      the rules every pipeline order keeps (each stage's forward before its backward, what a stage needs from its neighbours), which rank holds a stage, and an order placed at the steps it can run
//     accel/core/pipeline_orders.hpp                     the compute-only orders of torch's pipeline schedules (GPipe, 1F1B, Looped BFS, Interleaved 1F1B, the zero-bubble two)
//     accel/core/pipeline_lowering.hpp                   a compute-only pipeline order lowered for running: each rank's sends and receives of activations and gradients put in its list, as torch's _add_send_recv puts them
//   distributed:
//     accel/distributed/torch.hpp                        feature detection and the LibTorch headers the collectives need
//     accel/distributed/devices.hpp                      devices: which accelerator a process uses, binding and synchronising it
//     accel/distributed/concepts.hpp                     what the collectives take: Scalar, ScalarVector, TensorLike
//     accel/distributed/issue.hpp                        debug mode, the group registry, issuing c10d operations, their errors
//     accel/distributed/pending.hpp                      Pending: a collective issued (its start) and not landed yet (its land), the result it gives
//     accel/distributed/staging.hpp                      what c10d gets for a tensor: dtypes every backend moves, staged copies, the device NCCL needs, reductions checked
//     accel/distributed/start_gather.hpp                 the all-gather family started: into given outputs, into rows, of CPU elements
//     accel/distributed/start_reduce.hpp                 the all-reduce family started: in place, onto one rank, and folded locally for types no backend reduces
//     accel/distributed/start_broadcast.hpp              the broadcast family started: a tensor from one rank, its pieces scattered from one rank, the ranks checked
//     accel/distributed/pieces.hpp                       a Gloo group's exchange of pieces point to point: the all-gather and reduce-scatter the sharding engine runs without staging
//     accel/distributed/debug_check.hpp                  debug mode's check that every rank made the same call, and the texts that describe a call
//     accel/distributed/registration.hpp                 registering the groups accel makes, with the code that diagnoses their failures
//     accel/distributed/work.hpp                         accel::Work: an operation in flight, what the _async forms return
//     accel/distributed/collectives.hpp                  all_reduce, broadcast, all_gather and their _async forms
//     accel/distributed/all_to_all.hpp                   all_to_all (even and uneven) and reduce_scatter, both on c10d's all-to-all
//     accel/distributed/direct_all_reduce.hpp            a Gloo group's all-reduce point to point, for small tensors: a reduce-scatter then an all-gather, each one round of messages
//     accel/distributed/exchange.hpp                     reduce_to, gather_to, scatter, send/recv, barriers
//     accel/distributed/backends.hpp                     one c10d process group made on either LibTorch generation, over a store
//     accel/distributed/rendezvous.hpp                   rendezvous: the store ranks meet on, and agreeing on the world
//     accel/distributed/make_groups.hpp                  several c10d groups made at once over the rendezvous store, and every rank waiting until all are made
//     accel/distributed/mesh.hpp                         DeviceMesh: named dimensions, slice, flatten
//     accel/distributed/world.hpp                        World: the ranks of one initialisation, their rendezvous store and the groups made on it
//     accel/distributed/interface.hpp                    DistributedInterface (the singleton), new_group, init_device_mesh
//     accel/distributed/nested.hpp                       nested data (vectors, maps, tuples of tensors), packed for few collectives
//     accel/distributed/operations.hpp                   Accelerate's operations: gather, pad_across_processes, reduce, ...
//     accel/distributed/objects.hpp                      objects through the pickler: broadcast_object_list, gather_object, ...
//     accel/distributed/process_control.hpp              process control: split_between_processes, on_main_process, ...
//     accel/distributed/reproducibility.hpp              set_seed and synchronize_rng_states
//   training:
//     accel/training/torch_nn.hpp                        the LibTorch headers the training helpers need (<torch/torch.h>)
//     accel/training/weak_keyed_map.hpp                  a map keyed by a tensor's or module's address that forgets an entry once its object has gone
//     accel/training/parameters.hpp                      a module's parameters as Python counts them: each tensor once, known by all its names
//     accel/training/parallel/autograd.hpp               autograd-aware collectives (accel::autograd)
//     accel/training/tp/regions.hpp                      Megatron's region mappings (accel::tp): the collectives around a tensor-parallel region
//     accel/training/tp/layer.hpp                        what every tensor-parallel layer shares: its group, its piece of a whole tensor, its partial gradients
//     accel/training/tp/linear.hpp                       Megatron-core's ColumnParallelLinear and RowParallelLinear as torch::nn modules
//     accel/training/tp/embedding.hpp                    Megatron-core's VocabParallelEmbedding as a torch::nn module
//     accel/training/tp/cross_entropy.hpp                vocab_parallel_cross_entropy (torch's loss_parallel, Megatron's vocab-parallel cross entropy)
//     accel/training/tp/dropout.hpp                      tp::dropout, one random mask for the whole activation whichever piece a rank holds
//     accel/training/tp/styles.hpp                       torch's parallel styles (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput) and the layouts they name, as plain values for a plan
//     accel/training/tp/registry.hpp                     the modules a plan styled (tp::parallelize_module), found by address when they run, and the watch that refuses a styled module called around its style
//     accel/training/tp/pieces.hpp                       what of a module is split over a tensor-parallel group (by accel::tp's layers or by a plan), and what whole-model operations do with it
//     accel/training/tp/sequence_parallel.hpp            all_reduce_sequence_parallel_gradients, the partial gradients of sequence parallelism summed in one collective
//     accel/training/tp/styled_forward.hpp               a styled module run with its parallel style: its inputs moved to the layouts it needs, its pieces computed, its output moved to the layout the plan says
//     accel/training/tp/plan.hpp                         tp::parallelize_module, torch's plan of parallel styles applied to a plain model's Linear and Embedding layers, norms and blocks
//     accel/training/pp/microbatches.hpp                 a batch cut into a pipeline's micro-batches along its first dimension, and the last stage's outputs put back together
//     accel/training/pp/messages.hpp                     the activations and gradients a pipeline step sends between ranks, the receives posted in the order the senders send, and each stage's input shape told once per step
//     accel/training/precision/autocast.hpp              AutocastGuard: LibTorch's autocast on for a scope, in the configured precision
//     accel/training/precision/grad_scaler.hpp           GradScaler: dynamic loss scaling for fp16 training, as torch.amp.GradScaler
//     accel/training/precision/policy.hpp                MixedPrecisionPolicy: the dtypes fully sharded units compute and reduce in, as FSDP2's
//     accel/training/optim/fused_adam.hpp                Adam and AdamW stepped by LibTorch's fused kernels
//     accel/training/data/sampler.hpp                    data loading: ShardSampler, which deals out each process's share of a dataset
//     accel/training/data/loader_state.hpp               what a prepared loader is configured with and shares: DataLoaderConfig, its place in its passes, Accelerate's GradientState
//     accel/training/accelerator_config.hpp              AcceleratorConfig, AcceleratedOptimizer, AcceleratedScheduler
//     accel/training/data/dispatch.hpp                   dispatch_batches: one rank reads, the others receive their slices
//     accel/training/data/loaders.hpp                    PreparedDataLoader and PreparedIterableDataLoader
//     accel/training/dp/comm_hooks.hpp                   communication hooks: GradBucket, CommHook, PowerSGD
//     accel/training/dp/buckets.hpp                      which gradients share a bucket (DDP's assignment, with FSDP units)
//     accel/training/dp/buffers.hpp                      the sharding engine's working buffers, lent by handle and taken again step after step instead of allocated anew
//     accel/training/dp/timeline.hpp                     when each gradient bucket of the last synced backward was ready, issued, waited for and landed
//     accel/training/dp/strategy.hpp                     Strategy, what NO_SHARD and the sharded strategies do differently: the one place DataParallel branches on its mode
//     accel/training/dp/state.hpp                        DataParallel's state: the buckets' common layout and the strategy's own (Replicated, or Sharded with FULL_SHARD's Units), shared with its autograd hooks
//     accel/training/dp/chunks.hpp                       the chunk layout sharding cuts every parameter into: S equal chunks, the last padded
//     accel/training/dp/scatter.hpp                      ZeRO's gradient reduce-scatter: issued from reused buffers, landed in the shards' gradients
//     accel/training/dp/reducer.hpp                      DataParallel's reducer: a bucket issued as soon as its gradients are ready
//     accel/training/dp/unit_plan.hpp                    ZeRO-3's units planned: which unit holds each parameter, the registry accel::unit_forward finds a unit in, the policy's dtypes, the names a read at rest reports
//     accel/training/dp/unit_params.hpp                  ZeRO-3's parameters gathered into a pooled buffer for a unit's forward and backward, and put back at rest after
//     accel/training/dp/units.hpp                        ZeRO-3's units: parameters gathered from their shards for a unit's forward and backward, freed after
//     accel/training/recompute.hpp                       accel::checkpoint, activation checkpointing as torch.utils.checkpoint
//     accel/training/dp/shards.hpp                       ZeRO-2's shards: each parameter cut in S chunks, this rank's kept and stepped
//     accel/training/dp/sharded_state_dict.hpp           what checkpoints ask of a sharded DataParallel: each rank's pieces, written and loaded without gathering
//     accel/training/dp/strategies.hpp                   the two strategies' operations (Replicated: NO_SHARD; Sharded: ZeRO-2, ZeRO-3, HSDP), each a call into the engine's part that does it
//     accel/training/dp/data_parallel.hpp                DataParallel, the class: data parallelism for one module (buckets, ZeRO-2 shards, ZeRO-3 units)
//     accel/training/pp/stage.hpp                        accel::pp::PipelineStage, this rank's part of a model in a pipeline: its forward and backward one micro-batch at a time, the backward whole or split into the input's gradient and the weights'
//     accel/training/pp/runtime.hpp                      one pipeline step on this rank: its lowered list of actions run in order, the stages' forwards and backwards between the messages
//     accel/training/pp/schedules.hpp                    torch.distributed.pipelining's schedules (ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble): step() over this rank's stages, and the order as torch's CSV
//     accel/training/dp/unit_forward.hpp                 accel::unit_forward, the call that runs a FULL_SHARD unit with its parameters gathered and a styled module with its tensor-parallel style
//     accel/training/io/json.hpp                         JSON: a reader that checks everything it is given, and the quoting of a string
//     accel/training/io/file_digest.hpp                  XXH64 and a file's digest (size and hash), by which a checkpoint knows its own files
//     accel/training/io/checked_file.hpp                 files written with every error checked: CheckedFile, atomic writes, archives
//     accel/training/io/safetensors.hpp                  safetensors: Hugging Face's weight format, written and read
//     accel/training/checkpoint/file_names.hpp           the name of every file save_state and save_model write, in one place
//     accel/training/checkpoint/prepared.hpp             what an Accelerator has prepared (models, optimizers, schedulers, loaders, objects)
//     accel/training/accelerator/join.hpp                Join: training on uneven inputs, as DDP's Join (Accelerator::join_uneven_inputs), and the block's even_batches
//     accel/training/checkpoint/manifest.hpp             a checkpoint's manifest (every file with its size and XXH64, the checkpoint's id) and the checks a load makes against it
//     accel/training/checkpoint/files.hpp                a checkpoint's directory: atomic install, recovery, rotation, and the checks every load shares
//     accel/training/checkpoint/world.hpp                a checkpoint loaded by another number of processes: loader positions in samples, RNG states for new processes
//     accel/training/checkpoint/context.hpp              where this process stands, as a checkpoint records and checks it, and which files are its own
//     accel/training/checkpoint/shards.hpp               a sharded model in a checkpoint: each process writes its own pieces, as Python's DCP reads them (checkpoint/sharded_weights.hpp reads them back)
//     accel/training/checkpoint/sharded_weights.hpp      a sharded model's pieces read back: every file's boxes checked to tile each tensor, this process's part read
//     accel/training/checkpoint/optimizer_slots.hpp      what each position of an optimizer's parameter list is in this run (a shard, a tensor-parallel piece, its names), and its state read from the piece files across tensor-parallel layouts
//     accel/training/checkpoint/reshard.hpp              an optimizer's saved state cut again for this run's shards (4 -> 2, ZeRO <-> NO_SHARD)
//     accel/training/checkpoint/item.hpp                 what one artifact of a checkpoint does in each phase of a save and a load, and what each phase hands it
//     accel/training/checkpoint/model_items.hpp          the models in a checkpoint: each model whole (model_<i>.pt), or the sharded models' pieces every process writes
//     accel/training/checkpoint/state_items.hpp          the training state in a checkpoint, an item each: optimizers, schedulers, registered objects, the loaders' places, the loss scaler, this process's RNG states
//     accel/training/checkpoint/from_python.hpp          load_state of a checkpoint Python's dcp.save wrote through HuggingFaceStorageWriter: the models, and the optimizers' state under Python's names
//     accel/training/checkpoint/state.hpp                save_state's and load_state's driver: the phases of a checkpoint's items, with the collectives between them
//     accel/training/checkpoint/weights.hpp              save_model and load_model: a module's weights as Hugging Face's safetensors
//     accel/training/accelerator/trackers.hpp            Accelerate's experiment tracking (log_with, init_trackers, log) into JSON-lines and CSV files
//     accel/training/accelerator/setup.hpp               what an Accelerator runs on: its checked configuration, the world, the device, and the DataParallel a model gets
//     accel/training/accelerator/accelerator.hpp         the Accelerator, declared: every public method in one place, and the state it holds
//     accel/training/accelerator/properties.hpp          the Accelerator's constructor and properties: what it runs on, read off its setup
//     accel/training/accelerator/preparing.hpp           the Accelerator's prepare() in all its forms, and letting go of what it prepared
//     accel/training/accelerator/training_step.hpp       the Accelerator's training step: backward, gradient sync and accumulation, uneven inputs, clipping, the loss scale
//     accel/training/accelerator/process_operations.hpp  the Accelerator's work over every process: Accelerate's operations as methods, metrics, the trigger, the experiment log
//     accel/training/accelerator/checkpoints.hpp         the Accelerator's checkpoints (save_state, load_state) and exported weights (save_model, load_model)

#ifndef ACCEL_HPP
#define ACCEL_HPP

// == accel/core/version.hpp ===================================================
// accel/core/version.hpp: the version macros (CMake and the packages read them here).

#define ACCEL_VERSION_MAJOR 0
#define ACCEL_VERSION_MINOR 1
#define ACCEL_VERSION_PATCH 0
#define ACCEL_VERSION (ACCEL_VERSION_MAJOR * 10000 + ACCEL_VERSION_MINOR * 100 + ACCEL_VERSION_PATCH)

// == accel/core/config.hpp ====================================================
// accel/core/config.hpp: compile-time knobs, the environment's names, the ABI namespace.
//
// The compile-time knobs (macros defined before including accel.hpp) and
// the environment variables read at run time are listed, each with its
// meaning, in one table: README.md, "Configuration". The macros' defaults
// are set below.

// Timeout of the store and of every group when DistributedConfig says nothing
// else (LLaMA-Factory's).
#ifndef ACCEL_DEFAULT_TIMEOUT_SECONDS
#define ACCEL_DEFAULT_TIMEOUT_SECONDS 18000
#endif
// cuda_cmake_macros.h is generated only by CUDA builds of LibTorch, so CPU
// packages that ship the c10/cuda headers anyway are not mistaken for CUDA.
#ifndef ACCEL_WITH_NCCL
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>) && __has_include(<nccl.h>)
#define ACCEL_WITH_NCCL 1
#else
#define ACCEL_WITH_NCCL 0
#endif
#endif

// The knobs change inline bodies, so they are part of every name's linkage:
// everything lives in an inline namespace named after the version and the
// configuration (as json.hpp's ABI tags). Two translation units configured
// differently then link to different functions instead of silently sharing
// one body (each has its own DistributedInterface, too: configure alike).
// ACCEL_DEFAULT_TIMEOUT_SECONDS must therefore be an integer literal.
#define ACCEL_ABI_NAME_(major, minor, patch, timeout, nccl) abi_v##major##_##minor##_##patch##_t##timeout##_nccl##nccl
#define ACCEL_ABI_NAME(major, minor, patch, timeout, nccl) ACCEL_ABI_NAME_(major, minor, patch, timeout, nccl)
#define ACCEL_ABI_NAMESPACE                                                                                    \
  ACCEL_ABI_NAME(ACCEL_VERSION_MAJOR, ACCEL_VERSION_MINOR, ACCEL_VERSION_PATCH, ACCEL_DEFAULT_TIMEOUT_SECONDS, \
                 ACCEL_WITH_NCCL)
#define ACCEL_NAMESPACE_BEGIN \
  namespace accel {           \
  inline namespace ACCEL_ABI_NAMESPACE {
#define ACCEL_NAMESPACE_END \
  }                         \
  }

#if __cplusplus < 202002L
#error "accel.hpp needs C++20 (-std=c++20)"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#endif

// == accel/core/errors.hpp ====================================================
// accel/core/errors.hpp: the error family: accel::Error and its kinds.
//
// Everything accel.hpp throws is an accel::Error, so `catch (const
// accel::Error& e)` catches anything accel; each kind also derives from the
// std exception it names, so `catch (const std::invalid_argument&)` keeps
// working:
//   InvalidArgument (std::invalid_argument)  a bad value: argument,
//                       configuration, environment variable
//   OutOfRange (std::out_of_range)           a value that does not fit its type
//   LogicError (std::logic_error)            a call out of order (e.g. a second
//                       configuration for a live singleton)
//   RuntimeError (std::runtime_error)        the system or the build cannot do
//                       it (no free port, no such device or backend, bad bytes)
//   DistributedError (a RuntimeError)        a collective, the rendezvous or a
//                       process group failed (peer gone, timeout, mismatched
//                       calls); the message names the operation and the group
// Exceptions from user code (bodies, datasets) pass through unchanged.

ACCEL_NAMESPACE_BEGIN

class Error {
 public:
  virtual ~Error() = default;
  virtual const char* what() const noexcept = 0;
};

namespace detail {
template <class Std>
class ErrorOf : public Std, public Error {
 public:
  explicit ErrorOf(const std::string& message) : Std(message) {}
  const char* what() const noexcept override { return Std::what(); }
};
}  // namespace detail

class InvalidArgument : public detail::ErrorOf<std::invalid_argument> {
 public:
  using ErrorOf::ErrorOf;
};
class OutOfRange : public detail::ErrorOf<std::out_of_range> {
 public:
  using ErrorOf::ErrorOf;
};
class LogicError : public detail::ErrorOf<std::logic_error> {
 public:
  using ErrorOf::ErrorOf;
};
class RuntimeError : public detail::ErrorOf<std::runtime_error> {
 public:
  using ErrorOf::ErrorOf;
};
class DistributedError : public RuntimeError {
 public:
  using RuntimeError::RuntimeError;
};

namespace detail {
// An exception's text without the C++ backtrace LibTorch appends to a
// c10::Error's what() ("\nException raised from ... (most recent call
// first):\nframe #0: ..."): the message is what a user acts on, and thirty
// frames from every rank bury it. The core cannot name c10::Error (no
// LibTorch here), so it cuts the text where that backtrace starts.
inline std::string without_backtrace(const std::exception& e) {
  const std::string_view text = e.what();
  return std::string(text.substr(0, text.find("\nException raised from ")));
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/core/enums.hpp =====================================================
// accel/core/enums.hpp: ReduceOp, Dim, DeviceType and friends, with their string forms.

ACCEL_NAMESPACE_BEGIN

enum class DeviceType { CPU, CUDA, META, MPS, NPU, XPU };
enum class ReduceOp { SUM, MEAN, MAX, MIN };
enum class Dim { MP_REPLICATE, MP_SHARD, DP, CP, TP, PP };

namespace detail {
template <class E>
struct enum_names;
template <>
struct enum_names<DeviceType> {
  static constexpr std::string_view type = "DeviceType";
  static constexpr std::array<std::string_view, 6> names{"cpu", "cuda", "meta", "mps", "npu", "xpu"};
};
template <>
struct enum_names<ReduceOp> {
  static constexpr std::string_view type = "ReduceOp";
  static constexpr std::array<std::string_view, 4> names{"sum", "mean", "max", "min"};
};
template <>
struct enum_names<Dim> {
  static constexpr std::string_view type = "Dim";
  static constexpr std::array<std::string_view, 6> names{"mp_replicate", "mp_shard", "dp", "cp", "tp", "pp"};
};
template <class E>
concept AccelEnum = requires { enum_names<E>::names; };
}  // namespace detail

template <detail::AccelEnum E>
constexpr std::string_view to_string(E value) {
  return detail::enum_names<E>::names.at(static_cast<std::size_t>(value));
}

template <detail::AccelEnum E>
E from_string(std::string_view text) {
  const auto& names = detail::enum_names<E>::names;
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == text) return static_cast<E>(i);
  std::string expected;
  for (auto name : names) expected += (expected.empty() ? "" : ", ") + std::string(name);
  throw InvalidArgument("accel::from_string<" + std::string(detail::enum_names<E>::type) + ">: unknown value '" +
                        std::string(text) + "' (expected one of: " + expected + ")");
}

template <detail::AccelEnum E>
std::ostream& operator<<(std::ostream& os, E value) {
  return os << to_string(value);
}

ACCEL_NAMESPACE_END

// == accel/core/environment.hpp ===============================================
// accel/core/environment.hpp: reading torchrun's and the MPI/Slurm launchers' environment.
//
// torchrun's contract. Values are validated: a malformed or inconsistent
// variable throws InvalidArgument naming the variable and its value.

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline std::optional<std::string> getenv_str(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// A variable that must hold a number: unset gives `fallback`; set but empty,
// not an integer, out of int's range or below `minimum` is an error naming it.
inline int env_int(const char* name, int fallback, int minimum) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return fallback;
  const std::string text(raw);
  auto fail = [&](const std::string& what) {
    throw InvalidArgument(std::string("accel: environment variable ") + name + what);
  };
  if (text.empty()) fail(" is set but empty (unset it, or give a number)");
  int value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range)
    fail("=" + text + " is out of range (at most " + std::to_string(std::numeric_limits<int>::max()) + ")");
  if (error != std::errc() || end != text.data() + text.size()) fail("='" + text + "' is not an integer");
  if (value < minimum) fail("=" + text + " must be at least " + std::to_string(minimum));
  return value;
}

// ASCII only, whatever the C locale says.
inline std::string lowercase(std::string text) {
  for (char& c : text) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return text;
}
// A yes/no switch: 1/0, true/false, yes/no, on/off (any case); anything else
// is an error naming the variable, never a silent default.
inline bool env_bool(const char* name, bool fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return fallback;
  const std::string text(raw);
  if (text.empty())
    throw InvalidArgument(std::string("accel: environment variable ") + name +
                          " is set but empty (unset it, or use 1/0, true/false, yes/no or on/off)");
  const std::string lower = lowercase(text);
  for (const char* yes : {"1", "true", "yes", "on"})
    if (lower == yes) return true;
  for (const char* no : {"0", "false", "no", "off"})
    if (lower == no) return false;
  throw InvalidArgument(std::string("accel: environment variable ") + name + "='" + text +
                        "' is not a switch (use 1/0, true/false, yes/no or on/off)");
}
}  // namespace detail

// Launchers' contracts, one row each. The first complete set wins, in this
// order (torchrun's is complete when RANK is set, even to "": its other
// variables have defaults); when none is, a partly set one (other than
// torchrun's) is an error naming what is there and what is missing, and
// otherwise the process is not distributed and torchrun's variables, or
// their defaults, give the sizes.
namespace detail {
struct LauncherVars {
  const char* launcher;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
  const char* local_size_alt = nullptr;  // read when local_size is unset (Slurm's task list)
  bool defaults = false;                 // only rank is needed: the others default to 1, 0, 1
};
inline constexpr LauncherVars kLaunchers[] = {
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", nullptr, true},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPICH/Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"},
};

struct LaunchEnv {
  const char* launcher;  // nullptr: not launched
  int rank, world, local_rank, local_world;
};

// Slurm's tasks on this node: SLURM_NTASKS_PER_NODE when set, else this
// node's entry of SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
// three nodes, then 1), picked by SLURM_NODEID.
inline std::optional<int> slurm_local_size() {
  if (getenv_str("SLURM_NTASKS_PER_NODE")) return env_int("SLURM_NTASKS_PER_NODE", 1, 1);
  auto text = getenv_str("SLURM_TASKS_PER_NODE");
  if (!text) return std::nullopt;
  auto bad = [&] {
    return InvalidArgument("accel: environment variable SLURM_TASKS_PER_NODE='" + *text +
                           "' is not a Slurm task list such as 2(x3),1");
  };
  auto number = [&](std::string_view digits) {
    int value = 0;
    auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (error != std::errc() || end != digits.data() + digits.size() || value < 1) throw bad();
    return value;
  };
  std::vector<int> per_node;
  std::string_view rest(*text);
  for (bool more = true; more;) {
    const std::string_view item = rest.substr(0, rest.find(','));
    more = item.size() < rest.size();  // a comma follows: another item must come
    rest.remove_prefix(std::min(rest.size(), item.size() + 1));
    if (item.empty()) throw bad();
    const auto paren = item.find("(x");
    const int tasks = number(item.substr(0, paren));
    int repeat = 1;
    if (paren != std::string_view::npos) {
      if (item.back() != ')') throw bad();
      repeat = number(item.substr(paren + 2, item.size() - paren - 3));
    }
    if (per_node.size() + static_cast<std::size_t>(repeat) > 1000000) throw bad();
    per_node.insert(per_node.end(), static_cast<std::size_t>(repeat), tasks);
  }
  if (per_node.empty()) throw bad();
  if (getenv_str("SLURM_NODEID")) {
    const int node = env_int("SLURM_NODEID", 0, 0);
    if (static_cast<std::size_t>(node) >= per_node.size())
      throw InvalidArgument("accel: SLURM_NODEID=" + std::to_string(node) + " is past the " +
                            std::to_string(per_node.size()) + " nodes of SLURM_TASKS_PER_NODE=" + *text);
    return per_node[static_cast<std::size_t>(node)];
  }
  if (std::adjacent_find(per_node.begin(), per_node.end(), std::not_equal_to<>()) != per_node.end())
    throw InvalidArgument("accel: SLURM_TASKS_PER_NODE=" + *text +
                          " differs between nodes and SLURM_NODEID is not set");
  return per_node.front();
}

// One launcher's values, read and checked against each other.
inline LaunchEnv read_launcher(const LauncherVars& vars) {
  // The variable that gives the local size: local_size, else its alternative.
  const char* local_size = vars.local_size_alt && !std::getenv(vars.local_size) ? vars.local_size_alt : vars.local_size;
  LaunchEnv env{vars.launcher, env_int(vars.rank, 0, 0), env_int(vars.size, 1, 1), env_int(vars.local_rank, 0, 0),
                local_size == vars.local_size_alt ? *slurm_local_size() : env_int(local_size, 1, 1)};
  auto contradiction = [&](const char* name, int value, const char* relation, const char* bound_name, int bound) {
    const std::string where = vars.defaults ? "" : std::string(" (") + vars.launcher + "'s environment)";
    return InvalidArgument(std::string("accel: ") + name + "=" + std::to_string(value) + relation + bound_name + "=" +
                           std::to_string(bound) + where);
  };
  if (env.rank >= env.world) throw contradiction(vars.rank, env.rank, " must be smaller than ", vars.size, env.world);
  if (env.local_world > env.world)
    throw contradiction(local_size, env.local_world, " must not exceed ", vars.size, env.world);
  if (env.local_rank >= env.local_world)
    throw contradiction(vars.local_rank, env.local_rank, " must be smaller than ", local_size, env.local_world);
  return env;
}

// Which of a launcher's four values are set (even to ""; the local size
// under either of its names).
inline std::array<bool, 4> present(const LauncherVars& vars) {
  return {std::getenv(vars.rank) != nullptr, std::getenv(vars.size) != nullptr, std::getenv(vars.local_rank) != nullptr,
          std::getenv(vars.local_size) != nullptr || (vars.local_size_alt && std::getenv(vars.local_size_alt))};
}

// The launcher whose variables are set, at least in part (torchrun's: RANK),
// or null. Unlike launch_env() it reads no values and cannot fail: a
// collective with no world group asks it, to tell a process that is alone
// (where collectives are the identity) from one that has not called
// DistributedInterface::instance() yet. Being a few getenv calls, it keeps
// the environment's parse out of every translation unit that calls a
// collective.
inline const char* launcher_in_environment() {
  for (const auto& vars : kLaunchers) {
    const std::array<bool, 4> set = present(vars);
    if (vars.defaults ? set[0] : std::count(set.begin(), set.end(), true) > 0) return vars.launcher;
  }
  return nullptr;
}

// The launch environment, read and validated in one pass (see kLaunchers).
inline LaunchEnv launch_env() {
  const LauncherVars* partial = nullptr;
  for (const auto& vars : kLaunchers) {
    const std::array<bool, 4> set = present(vars);
    const auto count = std::count(set.begin(), set.end(), true);
    if (vars.defaults ? set[0] : count == 4) return read_launcher(vars);
    if (!vars.defaults && count > 0 && !partial) partial = &vars;
  }
  if (partial) {
    const std::string local_size = partial->local_size_alt
                                       ? std::string(partial->local_size) + " or " + partial->local_size_alt
                                       : partial->local_size;
    const std::string names[] = {partial->rank, partial->size, partial->local_rank, local_size};
    const std::array<bool, 4> there = present(*partial);
    std::string set, missing;
    for (int i = 0; i < 4; ++i) {
      std::string& list = there[i] ? set : missing;
      list += list.empty() ? names[i] : ", " + names[i];
    }
    throw InvalidArgument(std::string("accel: ") + partial->launcher + "'s environment is incomplete: " + set +
                          " set but " + missing + " missing (set RANK and WORLD_SIZE to override)");
  }
  LaunchEnv env = read_launcher(kLaunchers[0]);  // not launched: torchrun's variables or their defaults
  env.launcher = nullptr;
  return env;
}
}  // namespace detail

// Whether this process is one rank of a launched job: RANK is set, or
// another launcher's complete set (Open MPI, MPICH/Intel MPI, MVAPICH, Slurm).
// Each of these reads and validates the whole launch environment.
inline bool is_distributed() { return detail::launch_env().launcher != nullptr; }
inline int get_world_size() { return detail::launch_env().world; }
inline int get_rank() { return detail::launch_env().rank; }
inline int get_local_world_size() { return detail::launch_env().local_world; }
inline int get_local_rank() { return detail::launch_env().local_rank; }

// The launcher whose environment get_rank() and friends read: "torchrun"
// (RANK set), "Open MPI", "MPICH/Intel MPI", "MVAPICH", "Slurm", or "none".
inline std::string_view launcher() {
  const char* name = detail::launch_env().launcher;
  return name ? name : "none";
}

ACCEL_NAMESPACE_END

// == accel/core/strategy.hpp ==================================================
// accel/core/strategy.hpp: DistributedConfig and DistributedStrategy: the parallel sizes, validated.
//
// The parallelism sizes, validated against the world size.

ACCEL_NAMESPACE_BEGIN

// The timeout of a DistributedConfig that gives none: ACCEL_TIMEOUT (whole
// seconds) when set, else ACCEL_DEFAULT_TIMEOUT_SECONDS.
inline std::chrono::seconds default_timeout() {
  return std::chrono::seconds(detail::env_int("ACCEL_TIMEOUT", ACCEL_DEFAULT_TIMEOUT_SECONDS, 1));
}

// A plain value: making one reads no environment and cannot throw; the
// defaults are filled in (resolved()) when DistributedInterface starts.
struct DistributedConfig {
  int mp_replicate_size = 1;
  std::optional<int> mp_shard_size{};  // default: world / mp_replicate_size
  std::optional<int> dp_size{};        // default: world / cp_size
  int cp_size = 1;
  // Tensor parallelism: the innermost dimension of both meshes (peers hold
  // pieces of the same layers and read the same batch; adjacent ranks).
  int tp_size = 1;
  // Pipeline parallelism: the outermost dimension of both meshes (each pp
  // coordinate holds one stage's layers; the fewest, largest messages go
  // between them, so the slowest links).
  int pp_size = 1;
  std::chrono::seconds timeout{0};     // of the store and every group; 0: default_timeout()
  std::optional<DeviceType> device{};  // the accelerator to use; unset: ACCEL_DEVICE, else the best available
  bool operator==(const DistributedConfig&) const = default;

  // This config with the default timeout filled in.
  DistributedConfig resolved() const {
    if (timeout.count() < 0)
      throw InvalidArgument("accel::DistributedConfig: timeout must be positive (0 for the default), got " +
                            std::to_string(timeout.count()) + " s");
    DistributedConfig out = *this;
    if (out.timeout.count() == 0) out.timeout = default_timeout();
    return out;
  }
};

inline std::ostream& operator<<(std::ostream& os, const DistributedConfig& c) {
  auto opt = [](const std::optional<int>& v) { return v ? std::to_string(*v) : std::string("auto"); };
  return os << "DistributedConfig(mp_replicate_size=" << c.mp_replicate_size
            << ", mp_shard_size=" << opt(c.mp_shard_size) << ", dp_size=" << opt(c.dp_size) << ", cp_size=" << c.cp_size
            << (c.tp_size != 1 ? ", tp_size=" + std::to_string(c.tp_size) : std::string())
            << (c.pp_size != 1 ? ", pp_size=" + std::to_string(c.pp_size) : std::string())
            << ", timeout=" << (c.timeout.count() ? std::to_string(c.timeout.count()) + "s" : std::string("default"))
            << (c.device ? ", device=" + std::string(to_string(*c.device)) : std::string()) << ")";
}

// The mesh sizes, validated against the world size on construction: the
// model mesh (pp, mp_replicate, mp_shard, tp) and the data mesh (pp, dp, cp,
// tp) each multiply to the world; pp, the outermost, and tp, the innermost,
// are the same in both.
class DistributedStrategy {
 public:
  // Validates against WORLD_SIZE; when not distributed every size is 1.
  explicit DistributedStrategy(const DistributedConfig& config = {})
      : DistributedStrategy(config, accel::get_world_size(), is_distributed()) {}

  // Validates against an explicit world size (as if distributed).
  DistributedStrategy(const DistributedConfig& config, int world_size)
      : DistributedStrategy(config, world_size, true) {}

  int mp_replicate_size() const { return mp_replicate_; }
  int mp_shard_size() const { return mp_shard_; }
  int dp_size() const { return dp_; }
  int cp_size() const { return cp_; }
  int tp_size() const { return tp_; }
  int pp_size() const { return pp_; }
  int world_size() const { return world_; }

  // The meshes without pp and tp (their shapes when both are 1): the
  // data-parallel dimensions. The meshes themselves
  // (DistributedInterface::model_mesh(), data_mesh()) add pp as their first
  // dimension and tp as their last when above 1.
  std::array<int, 2> model_mesh_shape() const { return {mp_replicate_, mp_shard_}; }
  std::array<std::string_view, 2> model_mesh_dim_names() const {
    return {to_string(Dim::MP_REPLICATE), to_string(Dim::MP_SHARD)};
  }
  std::array<int, 2> data_mesh_shape() const { return {dp_, cp_}; }
  std::array<std::string_view, 2> data_mesh_dim_names() const { return {to_string(Dim::DP), to_string(Dim::CP)}; }

  bool operator==(const DistributedStrategy&) const = default;

 private:
  DistributedStrategy(const DistributedConfig& c, int world, bool distributed) {
    auto positive = [](const char* name, int value) {
      if (value < 1)
        throw InvalidArgument(std::string("accel::DistributedStrategy: ") + name + " must be positive, got " +
                              std::to_string(value));
    };
    if (world < 1)
      throw InvalidArgument("accel::DistributedStrategy: world_size must be positive, got " + std::to_string(world));
    positive("mp_replicate_size", c.mp_replicate_size);
    positive("cp_size", c.cp_size);
    positive("tp_size", c.tp_size);
    positive("pp_size", c.pp_size);
    if (c.mp_shard_size) positive("mp_shard_size", *c.mp_shard_size);
    if (c.dp_size) positive("dp_size", *c.dp_size);
    if (!distributed) {  // a single process: every dimension has size 1
      world_ = 1;
      return;
    }
    world_ = world;
    if (world % c.tp_size != 0)
      throw InvalidArgument("accel::DistributedStrategy: world_size " + std::to_string(world) +
                            " is not divisible by tp_size " + std::to_string(c.tp_size));
    tp_ = c.tp_size;
    if ((world / tp_) % c.pp_size != 0)
      throw InvalidArgument(
          "accel::DistributedStrategy: world_size " + std::to_string(world) +
          (tp_ > 1 ? " / tp_size " + std::to_string(tp_) + " = " + std::to_string(world / tp_) : std::string()) +
          " is not divisible by pp_size " + std::to_string(c.pp_size));
    pp_ = c.pp_size;
    std::tie(mp_replicate_, mp_shard_) =
        split(world, c.mp_replicate_size, c.mp_shard_size, "mp_replicate_size", "mp_shard_size");
    std::tie(cp_, dp_) = split(world, c.cp_size, c.dp_size, "cp_size", "dp_size");
  }

  // (given, other): other defaults to world / (tp * pp) / given; given *
  // other * tp * pp is world. The messages name tp and pp only when above 1.
  std::pair<int, int> split(int world, int given, std::optional<int> other, const char* given_name,
                            const char* other_name) const {
    const int rest = world / tp_ / pp_;
    std::string outer_names, outer_sizes;  // " * tp_size * pp_size", " * 2 * 2" (those above 1)
    for (const auto& [name, size] : {std::pair{"tp_size", tp_}, std::pair{"pp_size", pp_}})
      if (size > 1) {
        outer_names += std::string(" * ") + name;
        outer_sizes += " * " + std::to_string(size);
      }
    std::ostringstream message;
    message << "accel::DistributedStrategy: ";
    if (!other) {
      if (rest % given != 0) {
        message << "world_size " << world;
        if (tp_ > 1) message << " / tp_size " << tp_;
        if (pp_ > 1) message << " / pp_size " << pp_;
        if (rest != world) message << " = " << rest;
        message << " is not divisible by " << given_name << " " << given;
        throw InvalidArgument(message.str());
      }
      return {given, rest / given};
    }
    if (static_cast<long long>(given) * *other != rest) {
      message << given_name << " * " << other_name << outer_names << " must equal world_size, got " << given << " * "
              << *other << outer_sizes << " != " << world;
      throw InvalidArgument(message.str());
    }
    return {given, *other};
  }

  int mp_replicate_ = 1, mp_shard_ = 1, dp_ = 1, cp_ = 1, tp_ = 1, pp_ = 1, world_ = 1;
};

inline std::ostream& operator<<(std::ostream& os, const DistributedStrategy& s) {
  return os << "DistributedStrategy(mp_replicate_size=" << s.mp_replicate_size()
            << ", mp_shard_size=" << s.mp_shard_size() << ", dp_size=" << s.dp_size() << ", cp_size=" << s.cp_size()
            << (s.tp_size() > 1 ? ", tp_size=" + std::to_string(s.tp_size()) : std::string())
            << (s.pp_size() > 1 ? ", pp_size=" + std::to_string(s.pp_size()) : std::string()) << ")";
}

ACCEL_NAMESPACE_END

// == accel/core/launcher.hpp ==================================================
// accel/core/launcher.hpp: the local launcher: spawn and launch_processes (Linux).
//
// accel::spawn(nprocs, fn), the C++ torch.multiprocessing.spawn: this program
// is started nprocs more times, each a rank with torchrun's environment; the
// ranks run fn and exit; the caller gets 0, or the first failing rank's
// status once the others are stopped. Call it at the top of main (code
// before it runs in every rank, as code outside `if __name__ == "__main__"`
// does in Python). launch_processes does the same for any program (the
// accel_launch tool is built on it).
//
// Local runs open no TCP port: the ranks meet in a c10d::FileStore inside a
// private directory (mode 0700, removed afterwards), named by ACCEL_STORE_DIR,
// and Gloo is bound to loopback. Each rank's output lines are prefixed with
// "[rank r] "; ranks never outlive the launcher (PR_SET_PDEATHSIG) and are
// stopped as whole process groups, so nothing is left behind.

ACCEL_NAMESPACE_BEGIN

#if defined(__linux__)

struct LaunchOptions {
  std::chrono::duration<double> timeout{0};  // 0: none; else every rank is stopped then, status 124
  bool prefix_output = true;                 // "[rank r] " before each line
  std::ostream* out = &std::cout;            // where the ranks' output goes
};

namespace detail {
struct ChildRank {
  pid_t pid = -1;
  int out = -1;         // read end of the rank's stdout+stderr
  std::string pending;  // an unfinished line
  bool running = true;
};

inline void forward_output(int rank, ChildRank& child, bool final, const LaunchOptions& options) {
  char buffer[4096];
  auto emit = [&](std::string_view line) {
    std::string text = options.prefix_output ? "[rank " + std::to_string(rank) + "] " : std::string();
    text.append(line);
    text += '\n';
    options.out->write(text.data(), static_cast<std::streamsize>(text.size()));
    options.out->flush();
  };
  for (;;) {
    const ssize_t n = read(child.out, buffer, sizeof buffer);
    if (n <= 0) break;
    child.pending.append(buffer, static_cast<std::size_t>(n));
    for (std::size_t pos; (pos = child.pending.find('\n')) != std::string::npos;) {
      emit(std::string_view(child.pending).substr(0, pos));
      child.pending.erase(0, pos + 1);
    }
  }
  if (final && !child.pending.empty()) {
    emit(child.pending);
    child.pending.clear();
  }
}

// The ranks of one launch. Whatever ends the launch (its normal end, or an
// exception on the way: no pipe, no fork, a failing output stream), the
// destructor kills every rank still running with its process group, reaps
// it and closes every pipe: nothing outlives launch_processes.
class RankSet {
 public:
  explicit RankSet(std::size_t n) : ranks_(n) {}
  RankSet(const RankSet&) = delete;
  RankSet& operator=(const RankSet&) = delete;
  ~RankSet() {
    stop();
    for (auto& child : ranks_) close_output(child);
  }

  // Kills every running rank's process group and reaps the ranks.
  void stop() {
    for (auto& child : ranks_)
      if (child.running && child.pid > 0) kill(-child.pid, SIGKILL);
    for (auto& child : ranks_)
      if (child.running && child.pid > 0) {
        waitpid(child.pid, nullptr, 0);
        child.running = false;
      }
  }
  static void close_output(ChildRank& child) {
    if (child.out >= 0) close(child.out);
    child.out = -1;
  }
  ChildRank& operator[](std::size_t rank) { return ranks_[rank]; }
  std::vector<ChildRank>::iterator begin() { return ranks_.begin(); }
  std::vector<ChildRank>::iterator end() { return ranks_.end(); }
  std::size_t size() const { return ranks_.size(); }

 private:
  std::vector<ChildRank> ranks_;
};

// A TCP port free on this host now (the kernel's pick for port 0).
inline int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (fd >= 0) close(fd);
  if (!ok) throw RuntimeError(std::string("accel: cannot find a free TCP port: ") + std::strerror(errno));
  return ntohs(addr.sin_port);
}

// A private directory for a local rendezvous, removed on destruction.
class PrivateDir {
 public:
  PrivateDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "accel-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr)  // mode 0700
      throw RuntimeError("accel: cannot create a private directory in " + pattern + ": " + std::strerror(errno));
    path_ = pattern;
  }
  PrivateDir(const PrivateDir&) = delete;
  PrivateDir& operator=(const PrivateDir&) = delete;
  ~PrivateDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Rank `rank`'s environment for launch_processes: the caller's, with the
// launch variables set (and OMP_NUM_THREADS=1 beside other ranks unless set).
inline std::vector<std::string> rank_environment(int rank, int nprocs, int port, const std::string& store_dir,
                                                 const std::vector<std::pair<std::string, std::string>>& extra_env) {
  std::vector<std::pair<std::string, std::string>> set = {
      {"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(nprocs)},
      {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(nprocs)},
      {"MASTER_ADDR", "127.0.0.1"},         {"ACCEL_STORE_DIR", store_dir}};
  if (!getenv_str("MASTER_PORT")) set.emplace_back("MASTER_PORT", std::to_string(port));
  if (nprocs > 1 && !getenv_str("OMP_NUM_THREADS")) set.emplace_back("OMP_NUM_THREADS", "1");
  set.insert(set.end(), extra_env.begin(), extra_env.end());
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const auto name = entry.substr(0, entry.find('='));
    if (std::none_of(set.begin(), set.end(), [&](const auto& kv) { return kv.first == name; })) env.emplace_back(entry);
  }
  for (const auto& [name, value] : set) env.push_back(name + "=" + value);
  return env;
}

// Forks one rank and execs the program in it, its output into a pipe that
// `child` reads from then on. The environment and every string are made
// before fork: between fork and exec the child may only make
// async-signal-safe calls (no allocation).
inline void start_rank(ChildRank& child, std::vector<char*>& args, const std::vector<std::string>& env, pid_t launcher,
                       const std::string& exec_error) {
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int fds[2];
  if (pipe(fds) != 0) throw RuntimeError(std::string("accel::launch_processes: pipe: ") + std::strerror(errno));
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(fds[0]);
    close(fds[1]);
    throw RuntimeError(std::string("accel::launch_processes: fork: ") + std::strerror(error));
  }
  if (pid == 0) {  // only async-signal-safe calls from here to exec
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the launcher
    if (getppid() != launcher) _exit(127);
    signal(SIGPIPE, SIG_DFL);  // a distributed launcher ignores it (detail::ignore_sigpipe)
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    execvpe(args[0], args.data(), envp.data());
    if (write(STDERR_FILENO, exec_error.data(), exec_error.size()) < 0) _exit(127);
    _exit(127);
  }
  child.pid = pid;  // owned by the rank set from here
  child.out = fds[0];
  setpgid(pid, pid);
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
}

// Forwards the ranks' output until every rank has ended: the first non-zero
// status (or 124 after the timeout) stops the others and is the result.
inline int supervise(RankSet& ranks, const LaunchOptions& options) {
  const int nprocs = static_cast<int>(ranks.size());
  const auto start = std::chrono::steady_clock::now();
  int running = nprocs, result = 0;
  while (running > 0) {
    std::vector<pollfd> fds;
    for (auto& child : ranks)
      if (child.out >= 0) fds.push_back({child.out, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    for (int rank = 0; rank < nprocs; ++rank) {
      auto& child = ranks[static_cast<std::size_t>(rank)];
      if (child.out >= 0) forward_output(rank, child, false, options);
      if (!child.running) continue;
      int status = 0;
      if (waitpid(child.pid, &status, WNOHANG) != child.pid) continue;
      child.running = false;
      --running;
      kill(-child.pid, SIGKILL);  // anything the rank left running in its group
      forward_output(rank, child, true, options);
      RankSet::close_output(child);
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && result == 0) {
        *options.out << "accel: rank " << rank << " failed with status " << code << "; stopping the others"
                     << std::endl;
        result = code;
        ranks.stop();
        running = 0;
      }
    }
    if (running > 0 && options.timeout.count() > 0 && std::chrono::steady_clock::now() - start > options.timeout) {
      *options.out << "accel: timed out after " << options.timeout.count() << " s; stopping every rank" << std::endl;
      ranks.stop();
      result = 124;
      running = 0;
    }
  }
  for (int rank = 0; rank < nprocs; ++rank) {
    auto& child = ranks[static_cast<std::size_t>(rank)];
    if (child.out >= 0) forward_output(rank, child, true, options);
  }
  return result;  // the rank set closes the pipes
}
}  // namespace detail

// Starts nprocs ranks of `argv` (argv[0] looked up in PATH) on this host and
// waits for them. Returns 0 when every rank exits 0; otherwise the first
// failing rank's status (128+signal when killed) after stopping the others;
// 124 on timeout. `extra_env` is set in every rank. MASTER_PORT, unless
// already set, is a free port (for ranks that rendezvous over TCP after all,
// such as Python's torch.distributed). OMP_NUM_THREADS, unless already set, is
// 1 when there are several ranks, as torchrun sets it: ranks that each start
// a thread per core overload the host, and OpenMP and MKL then shrink their
// teams as the load changes, so the same run can sum in another order (seen:
// a resumed training run whose weights differed in the last bit).
inline int launch_processes(int nprocs, const std::vector<std::string>& argv, const LaunchOptions& options = {},
                            const std::vector<std::pair<std::string, std::string>>& extra_env = {}) {
  if (nprocs < 1)
    throw InvalidArgument("accel::launch_processes: nprocs must be at least 1, got " + std::to_string(nprocs));
  if (argv.empty()) throw InvalidArgument("accel::launch_processes: no program to run");
  detail::PrivateDir store_dir;
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t launcher = getpid();
  detail::RankSet ranks(static_cast<std::size_t>(nprocs));
  options.out->flush();
  const int port = detail::free_port();
  const std::string exec_error = "accel: cannot run " + argv[0] + "\n";
  for (int rank = 0; rank < nprocs; ++rank)
    detail::start_rank(ranks[static_cast<std::size_t>(rank)], args,
                       detail::rank_environment(rank, nprocs, port, store_dir.path(), extra_env), launcher, exec_error);
  return detail::supervise(ranks, options);
}

// In the caller: starts nprocs ranks of this very program (same arguments)
// and returns their combined status as launch_processes does. In a rank it
// started: runs fn (void or int: the exit status), then exits; an exception
// is printed and exits with 1. fn never runs in the caller.
template <std::invocable F>
int spawn(int nprocs, F&& fn, const LaunchOptions& options = {}) {
  if (detail::getenv_str("ACCEL_SPAWNED_RANK")) {
    int code = 0;
    try {
      if constexpr (std::is_void_v<std::invoke_result_t<F>>) std::invoke(std::forward<F>(fn));
      else code = static_cast<int>(std::invoke(std::forward<F>(fn)));
    } catch (const std::exception& e) {
      std::cerr << "accel::spawn: rank " << detail::getenv_str("RANK").value_or("?")
                << " failed: " << detail::without_backtrace(e) << std::endl;
      code = 1;
    }
    std::cout.flush();
    std::cerr.flush();
    std::exit(code);
  }
  std::vector<std::string> argv;
  {
    std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
    for (std::string arg; std::getline(cmdline, arg, '\0');) argv.push_back(arg);
  }
  if (argv.empty()) throw RuntimeError("accel::spawn: cannot read this program's arguments");
  argv[0] = std::filesystem::read_symlink("/proc/self/exe").string();
  return launch_processes(nprocs, argv, options, {{"ACCEL_SPAWNED_RANK", "1"}});
}
#endif  // __linux__

ACCEL_NAMESPACE_END

// == accel/core/pipeline_actions.hpp ==========================================
// accel/core/pipeline_actions.hpp: a pipeline schedule's actions as torch.distributed.pipelining writes them (2F0, 1UNSHARD, 3SEND_F1), and its CSV of a row per rank.
//
// A pipeline schedule is, per pipeline rank, a list of actions in time
// order: "stage 2 runs the forward of micro-batch 0" is written 2F0, and an
// empty slot (a step where the rank waits for its neighbours) is nothing.
// torch keeps schedules in this form (its _Action, _ComputationType,
// _load_csv and _dump_csv), and so do we, so that a schedule written for
// one runs on the other and the two can be compared line by line. These
// are the forms only; the schedules that make them are
// core/pipeline_orders.hpp.

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// torch's _ComputationType, with its text. F, I, W and B are computation
// (forward; backward split into the input's gradient and the weights';
// the whole backward), the others what a schedule lowered for running adds:
// parameters gathered and freed (FSDP), activations and their gradients sent
// and received, the data-parallel reduction of the gradients.
enum class ComputationType {
  FORWARD,
  BACKWARD_INPUT,
  BACKWARD_WEIGHT,
  UNSHARD,
  RESHARD,
  SEND_F,
  RECV_F,
  SEND_B,
  RECV_B,
  WAIT_SEND_F,
  WAIT_SEND_B,
  FULL_BACKWARD,
  OVERLAP_F_B,
  REDUCE_GRAD,
  WAIT_REDUCE_GRAD,
};
inline constexpr std::array<std::pair<ComputationType, std::string_view>, 15> kComputationTypeText{{
    {ComputationType::FORWARD, "F"},
    {ComputationType::BACKWARD_INPUT, "I"},
    {ComputationType::BACKWARD_WEIGHT, "W"},
    {ComputationType::UNSHARD, "UNSHARD"},
    {ComputationType::RESHARD, "RESHARD"},
    {ComputationType::SEND_F, "SEND_F"},
    {ComputationType::RECV_F, "RECV_F"},
    {ComputationType::SEND_B, "SEND_B"},
    {ComputationType::RECV_B, "RECV_B"},
    {ComputationType::WAIT_SEND_F, "WAIT_SEND_F"},
    {ComputationType::WAIT_SEND_B, "WAIT_SEND_B"},
    {ComputationType::FULL_BACKWARD, "B"},
    {ComputationType::OVERLAP_F_B, "OVERLAP_F_B"},
    {ComputationType::REDUCE_GRAD, "REDUCE_GRAD"},
    {ComputationType::WAIT_REDUCE_GRAD, "WAIT_REDUCE_GRAD"},
}};
inline std::string_view to_string(ComputationType type) {
  for (const auto& [t, text] : kComputationTypeText)
    if (t == type) return text;
  throw InvalidArgument("accel::pp: no such computation type");
}

// One action: the stage it runs on (a global stage index), what it does, and
// the micro-batch (none for the actions of a whole step: UNSHARD, RESHARD,
// REDUCE_GRAD, WAIT_REDUCE_GRAD).
struct Action {
  int stage_index = 0;
  ComputationType computation_type = ComputationType::FORWARD;
  std::optional<int> microbatch_index{};
  friend bool operator==(const Action&, const Action&) = default;
};
inline std::string to_string(const Action& a) {
  std::string text = std::to_string(a.stage_index) + std::string(to_string(a.computation_type));
  if (a.microbatch_index) text += std::to_string(*a.microbatch_index);
  return text;
}
inline std::string to_string(const std::optional<Action>& a) { return a ? to_string(*a) : std::string(); }

// An action's text back (torch's _Action.from_str): stage digits, a type,
// micro-batch digits or none; surrounding blanks ignored, an empty text is
// an empty slot. Where torch's regular expression matches a prefix and
// drops the rest ("0F0x" reads as 0F0), the whole text must be an action
// here: a typo in a hand-written schedule is an error, not a different
// schedule. OVERLAP_F_B's compound form ("(0F1;1B0)OVERLAP_F_B", DualPipeV's)
// is refused by name: no schedule of ours makes or runs it yet.
inline std::optional<Action> parse_action(std::string_view text) {
  auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!text.empty() && blank(text.front())) text.remove_prefix(1);
  while (!text.empty() && blank(text.back())) text.remove_suffix(1);
  if (text.empty()) return std::nullopt;
  auto refuse = [&](const std::string& why) -> std::optional<Action> {
    throw InvalidArgument("accel::pp: the action \"" + std::string(text) + "\" " + why +
                          " (an action is [stage][type][micro-batch], as torch writes them: 2F0, 1UNSHARD, 3SEND_F1)");
  };
  if (text.front() == '(')
    return refuse("is a compound OVERLAP_F_B action (DualPipeV's), which accel.hpp does not run");
  auto digits = [](std::string_view s) {
    std::size_t n = 0;
    while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
    return n;
  };
  const std::size_t stage_digits = digits(text);
  if (stage_digits == 0) return refuse("does not start with a stage index");
  std::string_view rest = text.substr(stage_digits);
  const std::size_t type_length = rest.find_last_not_of("0123456789") + 1;  // (npos + 1: no type, 0)
  const std::string_view type_text = rest.substr(0, type_length), microbatch_text = rest.substr(type_length);
  const auto type = std::find_if(kComputationTypeText.begin(), kComputationTypeText.end(),
                                 [&](const auto& entry) { return entry.second == type_text; });
  if (type == kComputationTypeText.end())
    return refuse(
        "has no computation type of torch's (F, I, W, B, UNSHARD, RESHARD, SEND_F, RECV_F, SEND_B, RECV_B, "
        "WAIT_SEND_F, WAIT_SEND_B, REDUCE_GRAD, WAIT_REDUCE_GRAD)");
  auto number = [&](std::string_view s) {
    int value = 0;
    const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), value);
    if (error != std::errc() || end != s.data() + s.size()) refuse("has a number out of range");
    return value;
  };
  Action action{number(text.substr(0, stage_digits)), type->first, std::nullopt};
  if (!microbatch_text.empty()) action.microbatch_index = number(microbatch_text);
  return action;
}

// A schedule: per pipeline rank (0, 1, ...) its actions in time order, an
// empty slot where it waits.
using PipelineOrder = std::vector<std::vector<std::optional<Action>>>;

// torch's CSV of a schedule (_dump_csv, Python's csv writer): a row per
// rank, its actions' texts separated by commas, an empty field for an empty
// slot, each row ended by "\r\n". Written here byte for byte as torch
// writes it; read with "\n" or "\r\n" ends (no field holds a comma or a
// quote, so none is quoted).
inline void write_csv(std::ostream& out, const PipelineOrder& order) {
  for (const auto& row : order) {
    for (std::size_t i = 0; i < row.size(); ++i) out << (i ? "," : "") << to_string(row[i]);
    out << "\r\n";
  }
}
inline PipelineOrder read_csv(std::istream& in) {
  PipelineOrder order;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<std::optional<Action>> row;
    if (!line.empty()) {  // (an empty line: a rank with no actions, as Python's csv writer writes one)
      std::size_t begin = 0;
      for (;;) {
        const std::size_t comma = line.find(',', begin);
        const std::string_view field = std::string_view(line).substr(begin, comma - begin);
        if (field.find('"') != std::string_view::npos)
          throw InvalidArgument("accel::pp: row " + std::to_string(order.size()) +
                                " of the schedule's CSV quotes a field (\"" + std::string(field) +
                                "\"); no action's text needs quotes");
        row.push_back(parse_action(field));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
    }
    order.push_back(std::move(row));
  }
  return order;
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END

// == accel/core/pipeline_rules.hpp ============================================
// accel/core/pipeline_rules.hpp: the rules every pipeline order keeps (each stage's forward before its backward, what a stage needs from its neighbours), which rank holds a stage, and an order placed at the steps it can run.
//
// A schedule's order (core/pipeline_actions.hpp) is right when every
// stage runs each micro-batch's forward and backward once, in that order,
// on the rank that holds it, and when the ranks' lists, each run in order,
// never all wait on each other: a forward needs the stage before's forward
// of its micro-batch (its activation is sent on), a backward the stage
// after's backward (its gradient is sent back). order_error checks an
// order (one of core/pipeline_orders.hpp's, or a user's from a CSV);
// aligned places lists at the earliest steps they can run.

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// Which rank holds a stage: in a loop (stage s on rank s mod p: every
// schedule but ZBV) or in a V (stages 0..p-1 on ranks 0..p-1, then p..2p-1
// back on ranks p-1..0, and so on), as torch's
// generate_stage_to_rank_mapping.
enum class StageStyle { loop, v };
inline int stage_rank(int stage, int ranks, StageStyle style) {
  const int at = stage % ranks;
  return style == StageStyle::loop || (stage / ranks) % 2 == 0 ? at : ranks - 1 - at;
}

// Places each rank's actions (in their order, without empty slots) at the
// earliest steps the rules below (order_error) allow: each action one step
// after the one before it on its rank and after what it needs from the
// neighbouring stages (the forward before, the backward after). An action
// that never can run (the ranks wait on each other) is an error naming it.
inline PipelineOrder aligned(const PipelineOrder& sequences, int stages_per_rank, int microbatches) {
  const int ranks = static_cast<int>(sequences.size()), stages = ranks * stages_per_rank;
  std::map<std::tuple<int, int, char>, int> done;  // (stage, micro-batch, F / B / W) -> step
  auto ran = [&](int stage, int mb, char kind, int before) {
    const auto it = done.find({stage, mb, kind});
    return it != done.end() && it->second < before;
  };
  PipelineOrder order(sequences.size());
  std::vector<std::size_t> next(sequences.size(), 0);
  std::size_t left = 0;
  for (const auto& row : sequences)
    left +=
        static_cast<std::size_t>(std::count_if(row.begin(), row.end(), [](const auto& a) { return a.has_value(); }));
  for (int step = 0; left > 0; ++step) {
    bool moved = false;
    for (int r = 0; r < ranks; ++r) {
      auto& row = sequences[static_cast<std::size_t>(r)];
      std::size_t& k = next[static_cast<std::size_t>(r)];
      while (k < row.size() && !row[k]) ++k;
      if (k == row.size()) continue;
      const Action& a = *row[k];
      const int stage = a.stage_index, mb = a.microbatch_index.value_or(0);
      // F needs the stage before's F; B and I (the input's gradient, 'B' below) this stage's F and the stage
      // after's B or I; W this stage's I.
      const char kind = a.computation_type == ComputationType::FORWARD           ? 'F'
                        : a.computation_type == ComputationType::BACKWARD_WEIGHT ? 'W'
                                                                                 : 'B';
      const bool ready = kind == 'F' ? (stage == 0 || ran(stage - 1, mb, 'F', step))
                         : kind == 'W'
                             ? ran(stage, mb, 'B', step)
                             : ran(stage, mb, 'F', step) && (stage + 1 == stages || ran(stage + 1, mb, 'B', step));
      auto& out = order[static_cast<std::size_t>(r)];
      if (!ready) {
        out.push_back(std::nullopt);
        continue;
      }
      out.push_back(a);
      done[{stage, mb, kind}] = step;
      ++k;
      --left;
      moved = true;
    }
    if (!moved) {
      std::string waiting;
      for (int r = 0; r < ranks; ++r)
        if (next[static_cast<std::size_t>(r)] < sequences[static_cast<std::size_t>(r)].size()) {
          if (!waiting.empty()) waiting += ", ";
          waiting += "rank " + std::to_string(r) + " at " +
                     to_string(sequences[static_cast<std::size_t>(r)][next[static_cast<std::size_t>(r)]]);
        }
      throw InvalidArgument("accel::pp: the schedule cannot go on (" + std::to_string(microbatches) +
                            " micro-batches): every rank waits for another: " + waiting);
    }
  }
  for (auto& row : order)  // (the steps after a rank's last action)
    while (!row.empty() && !row.back()) row.pop_back();
  return order;
}

// The rules every compute-only order keeps, returned as the first one
// broken, or nothing (what torch's _validate_schedule checks, and that it
// can run): every stage of the `ranks x stages_per_rank` lives on its rank
// (stage_rank); each stage runs each micro-batch's forward once and its
// backward once (B, or I then W), the forward first; and the ranks' lists,
// run in order with what each action needs from the neighbouring stages
// (aligned), never all wait on each other. Not checked: the empty slots'
// timing, which is only a picture (torch's own orders put some actions at
// the step of what they need when micro-batches are fewer than ranks).
inline std::optional<std::string> order_error(const PipelineOrder& order, int stages_per_rank, int microbatches,
                                              StageStyle style = StageStyle::loop) {
  const int ranks = static_cast<int>(order.size()), stages = ranks * stages_per_rank;
  enum Kind { F, B, I, W, kinds };
  std::vector<int> at(static_cast<std::size_t>(stages * microbatches * kinds), -1);
  auto slot = [&](int stage, int mb, Kind k) -> int& {
    return at[static_cast<std::size_t>((stage * microbatches + mb) * kinds + k)];
  };
  for (int r = 0; r < ranks; ++r)
    for (std::size_t t = 0; t < order[static_cast<std::size_t>(r)].size(); ++t) {
      const std::optional<Action>& a = order[static_cast<std::size_t>(r)][t];
      if (!a) continue;
      const std::string where = "rank " + std::to_string(r) + ", step " + std::to_string(t) + ": " + to_string(*a);
      if (a->stage_index < 0 || a->stage_index >= stages || stage_rank(a->stage_index, ranks, style) != r)
        return where + ": stage " + std::to_string(a->stage_index) + " is not one of this rank's";
      Kind k;
      switch (a->computation_type) {
        case ComputationType::FORWARD: k = F; break;
        case ComputationType::FULL_BACKWARD: k = B; break;
        case ComputationType::BACKWARD_INPUT: k = I; break;
        case ComputationType::BACKWARD_WEIGHT: k = W; break;
        default: return where + ": not a computation (a compute-only order has F, B, I and W)";
      }
      if (!a->microbatch_index || *a->microbatch_index < 0 || *a->microbatch_index >= microbatches)
        return where + ": no micro-batch of the " + std::to_string(microbatches);
      int& seen = slot(a->stage_index, *a->microbatch_index, k);
      if (seen >= 0) return where + ": runs twice (first at step " + std::to_string(seen) + ")";
      seen = static_cast<int>(t);
    }
  for (int s = 0; s < stages; ++s)
    for (int mb = 0; mb < microbatches; ++mb) {
      const std::string what = "stage " + std::to_string(s) + ", micro-batch " + std::to_string(mb);
      const int f = slot(s, mb, F), b = slot(s, mb, B), i = slot(s, mb, I), w = slot(s, mb, W);
      if (f < 0) return what + ": no forward";
      if ((b >= 0) == (i >= 0)) return what + (b >= 0 ? ": both B and I" : ": no backward (B, or I and W)");
      if ((i >= 0) != (w >= 0)) return what + (i >= 0 ? ": I without W" : ": W without I");
      if ((b >= 0 ? b : i) <= f) return what + ": backward before its forward";
      if (w >= 0 && w <= i) return what + ": W before I";
    }
  try {
    (void)aligned(order, stages_per_rank, microbatches);
  } catch (const InvalidArgument& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END

// == accel/core/pipeline_orders.hpp ===========================================
// accel/core/pipeline_orders.hpp: the compute-only orders of torch's pipeline schedules (GPipe, 1F1B, Looped BFS, Interleaved 1F1B, the zero-bubble two).
//
// A compute-only order says, per pipeline rank and time step, which stage
// runs the forward (F) or backward (B; zero bubble: I then W) of which
// micro-batch, an empty slot where the rank waits for a neighbour: one time
// step per action, the model torch's schedules are written in
// (pipeline_order). Stages are spread over the ranks in a loop: with p ranks
// and v stages per rank, rank r holds stages r, r + p, ..., r + (v - 1) p
// (ZBV's V: r and 2p - 1 - r). Each function here makes the order
// torch.distributed.pipelining makes for the same arguments (torch 2.15's
// schedules.py; tests: "pipeline orders", and python_pp_orders live); the
// communication a running schedule adds (sends, receives, the gradients'
// reduction) is not part of it. The rules every order keeps are
// core/pipeline_rules.hpp's.

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
inline void check_order_sizes(std::string_view schedule, int ranks, int stages_per_rank, int microbatches) {
  if (ranks < 1 || stages_per_rank < 1 || microbatches < 1)
    throw InvalidArgument("accel::pp::" + std::string(schedule) + ": " + std::to_string(ranks) + " ranks, " +
                          std::to_string(stages_per_rank) + " stages per rank and " + std::to_string(microbatches) +
                          " micro-batches: each must be at least 1");
}
inline Action forward(int stage, int microbatch) { return {stage, ComputationType::FORWARD, microbatch}; }
inline Action backward(int stage, int microbatch) { return {stage, ComputationType::FULL_BACKWARD, microbatch}; }
inline void wait_steps(std::vector<std::optional<Action>>& row, int steps) {
  row.insert(row.end(), static_cast<std::size_t>(std::max(steps, 0)), std::nullopt);
}

// GPipe: every forward, then every backward. Rank r starts r steps late; its
// first backward waits 3 (p - 1 - r) steps, for the backward to come back
// from the last rank (torch's ScheduleGPipe._get_pipeline_order, before it
// drops the empty slots and adds the reduction).
inline PipelineOrder gpipe_order(int ranks, int microbatches) {
  check_order_sizes("ScheduleGPipe", ranks, 1, microbatches);
  PipelineOrder order(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& row = order[static_cast<std::size_t>(r)];
    wait_steps(row, r);
    for (int mb = 0; mb < microbatches; ++mb) row.push_back(forward(r, mb));
    wait_steps(row, 3 * (ranks - 1 - r));
    for (int mb = 0; mb < microbatches; ++mb) row.push_back(backward(r, mb));
  }
  return order;
}

// 1F1B: p - 1 - r forwards to fill the pipeline, then one forward and one
// backward in turn, then the backwards left (torch's Schedule1F1B), each at
// the earliest step it can run (aligned). torch's own order of it
// (_get_pipeline_order, which only its tools read) differs in two ways: it
// names the last rank's forwards 1..m where its step runs 0..m-1, and its
// empty slots put some forwards at the step of the stage before them; here
// the micro-batches are those the step runs and every step is one it can
// run (docs/differences.md).
inline PipelineOrder one_f_one_b_order(int ranks, int microbatches) {
  check_order_sizes("Schedule1F1B", ranks, 1, microbatches);
  if (microbatches < ranks)
    throw InvalidArgument("accel::pp::Schedule1F1B: " + std::to_string(microbatches) + " micro-batches for " +
                          std::to_string(ranks) +
                          " stages: 1F1B needs at least one micro-batch per stage (as torch's)");
  PipelineOrder sequences(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& row = sequences[static_cast<std::size_t>(r)];
    const int warmup = ranks - 1 - r;
    for (int mb = 0; mb < warmup; ++mb) row.push_back(forward(r, mb));
    int next_backward = 0;
    for (int mb = warmup; mb < microbatches; ++mb) {
      row.push_back(forward(r, mb));
      row.push_back(backward(r, next_backward++));
    }
    while (next_backward < microbatches) row.push_back(backward(r, next_backward++));
  }
  return aligned(sequences, 1, microbatches);
}

// Looped BFS (breadth first, arXiv 2211.05953): each rank runs every
// micro-batch's forward on its first stage, then on its next, ...; then the
// backwards, last stage first and last micro-batch first (torch's
// ScheduleLoopedBFS._calculate_single_rank_operations).
inline PipelineOrder looped_bfs_order(int ranks, int stages_per_rank, int microbatches) {
  check_order_sizes("ScheduleLoopedBFS", ranks, stages_per_rank, microbatches);
  PipelineOrder order(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    auto& row = order[static_cast<std::size_t>(r)];
    wait_steps(row, r);
    for (int local = 0; local < stages_per_rank; ++local)
      for (int mb = 0; mb < microbatches; ++mb) row.push_back(forward(r + local * ranks, mb));
    wait_steps(row, 2 * (ranks - 1 - r));
    for (int local = stages_per_rank - 1; local >= 0; --local)
      for (int mb = microbatches - 1; mb >= 0; --mb) row.push_back(backward(r + local * ranks, mb));
  }
  return order;
}

// The micro-batches' rounds of the interleaved schedules: m / max(1, m / p)
// micro-batches each, m a multiple of their number (torch's rule).
inline int microbatches_per_round(std::string_view schedule, int ranks, int microbatches) {
  const int rounds = std::max(1, microbatches / ranks);
  if (microbatches % rounds != 0)
    throw InvalidArgument("accel::pp::" + std::string(schedule) + ": " + std::to_string(microbatches) +
                          " micro-batches are not a multiple of the number of rounds, " + std::to_string(rounds) +
                          " (max(1, micro-batches / " + std::to_string(ranks) + " ranks)), as torch requires");
  return microbatches / rounds;
}

// One rank's list of an interleaved schedule (torch's _get_1f1b_rank_ops):
// `warmup` forwards, round by round over the rank's stages, then a forward
// and a backward in turn, then the backwards left, the backwards going over
// the stages in reverse. Interleaved 1F1B waits for the first backward after
// the warm-up and before each backward of the cool-down; zero bubble splits
// each backward into I and, from the (`first_weights` + 1)-th backward on,
// the W of the oldest backward whose weights are pending, and the W left at
// the end, with no waits of its own (_add_bubbles adds them).
inline std::vector<std::optional<Action>> interleaved_rank_ops(int ranks, int v, int per_round, int microbatches, int r,
                                                               int warmup, bool zero_bubble, int first_weights) {
  const int ops = v * microbatches;
  auto forward_stage = [&](int step) { return (step / per_round) % v * ranks + r; };
  auto backward_stage = [&](int step) { return (v - 1 - ((step - warmup) / per_round) % v) * ranks + r; };
  const ComputationType backward_type = zero_bubble ? ComputationType::BACKWARD_INPUT : ComputationType::FULL_BACKWARD;
  std::map<int, int> forwards, backwards, weights;  // per stage: the next micro-batch
  std::vector<int> backward_steps;                  // the steps whose backward ran, in order
  std::size_t weighed = 0;
  std::vector<std::optional<Action>> row;
  auto weight = [&] {
    const int stage = backward_stage(backward_steps[weighed++]);
    row.push_back(Action{stage, ComputationType::BACKWARD_WEIGHT, weights[stage]++});
  };
  wait_steps(row, r);
  for (int step = 0; step < ops + warmup; ++step) {
    // (warmup forwards, then ops - warmup steps of a forward and a backward, then warmup backwards)
    if (step < warmup) {
      const int stage = forward_stage(step);
      row.push_back(forward(stage, forwards[stage]++));
      if (step == warmup - 1)
        wait_steps(row, zero_bubble ? ranks - r - 1 : v * ranks + 2 * (ranks - 1 - r) - (warmup + r));
      continue;
    }
    if (step < ops) {
      const int f = forward_stage(step);
      row.push_back(forward(f, forwards[f]++));
    } else if (!zero_bubble) {
      row.push_back(std::nullopt);
    }
    const int b = backward_stage(step);
    row.push_back(Action{b, backward_type, backwards[b]++});
    backward_steps.push_back(step);
    if (zero_bubble && step - warmup >= first_weights) weight();
  }
  while (zero_bubble && weighed < backward_steps.size()) weight();
  return row;
}

// Interleaved 1F1B (Megatron's virtual pipeline): a rank warms up with
// (v - 1) rounds' forwards plus 2 (p - 1 - r), at most v m (torch's
// ScheduleInterleaved1F1B).
inline PipelineOrder interleaved_1f1b_order(int ranks, int stages_per_rank, int microbatches) {
  check_order_sizes("ScheduleInterleaved1F1B", ranks, stages_per_rank, microbatches);
  const int per_round = microbatches_per_round("ScheduleInterleaved1F1B", ranks, microbatches);
  PipelineOrder order;
  for (int r = 0; r < ranks; ++r) {
    const int warmup =
        std::min((stages_per_rank - 1) * per_round + 2 * (ranks - 1 - r), stages_per_rank * microbatches);
    order.push_back(interleaved_rank_ops(ranks, stages_per_rank, per_round, microbatches, r, warmup, false, 0));
  }
  return order;
}

// Zero bubble interleaved (arXiv 2401.10241): as Interleaved 1F1B with a
// warm-up of (v - 1) rounds plus p - 1 - r and the backward split, rank r
// deferring its first r backwards' weights; then each rank's slots walked in
// step with the others', an empty slot put before a forward whose stage
// before has not run it yet (torch's ScheduleInterleavedZeroBubble and its
// _add_bubbles_to_actions, which waits for nothing else: an I may run at the
// step of the stage after's).
inline PipelineOrder interleaved_zero_bubble_order(int ranks, int stages_per_rank, int microbatches) {
  check_order_sizes("ScheduleInterleavedZeroBubble", ranks, stages_per_rank, microbatches);
  const int per_round = microbatches_per_round("ScheduleInterleavedZeroBubble", ranks, microbatches);
  PipelineOrder lists;
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min((stages_per_rank - 1) * per_round + (ranks - 1 - r), stages_per_rank * microbatches);
    lists.push_back(interleaved_rank_ops(ranks, stages_per_rank, per_round, microbatches, r, warmup, true, r));
  }
  // (stage, micro-batch) whose forward ran at an earlier step
  std::vector<char> forwarded(static_cast<std::size_t>(ranks * stages_per_rank * microbatches), 0);
  auto ran = [&](int stage, int mb) -> char& { return forwarded[static_cast<std::size_t>(stage * microbatches + mb)]; };
  PipelineOrder order(lists.size());
  std::vector<std::size_t> next(lists.size(), 0);
  for (bool going = true; going;) {
    going = false;
    std::vector<std::pair<int, int>> now;
    for (std::size_t r = 0; r < lists.size(); ++r) {
      if (next[r] == lists[r].size()) continue;
      going = true;
      const std::optional<Action>& a = lists[r][next[r]];
      const bool waits = a && a->computation_type == ComputationType::FORWARD && a->stage_index > 0 &&
                         !ran(a->stage_index - 1, *a->microbatch_index);
      if (waits) {
        order[r].push_back(std::nullopt);
        continue;
      }
      order[r].push_back(a);
      if (a && a->computation_type == ComputationType::FORWARD) now.emplace_back(a->stage_index, *a->microbatch_index);
      ++next[r];
    }
    for (const auto& [stage, mb] : now) ran(stage, mb) = 1;
  }
  return order;
}

// ZBV zero bubble (arXiv 2401.10241's V schedule): two stages per rank in a
// V, rank r holding stages r and 2p - 1 - r, the backward split into I and W
// (torch's ScheduleZBVZeroBubble: its phases run as if there were at least
// 2p - 1 micro-batches, the actions of those past m left as empty slots).
inline PipelineOrder zbv_zero_bubble_order(int ranks, int microbatches) {
  check_order_sizes("ScheduleZBVZeroBubble", ranks, 2, microbatches);
  const int planned = std::max(2 * ranks - 1, microbatches), last_stage = 2 * ranks - 1;
  PipelineOrder order;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::optional<Action>> row;
    wait_steps(row, r);
    const int first = r, second = last_stage - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto add = [&](int stage, ComputationType type, int mb) {
      row.push_back(mb < microbatches ? std::optional<Action>(Action{stage, type, mb}) : std::nullopt);
    };
    using enum ComputationType;
    for (int i = 0; i < 2 * (ranks - r) - 1; ++i) add(first, FORWARD, f0++);
    for (int i = 0; i < r; ++i) {
      add(second, FORWARD, f1++);
      add(first, FORWARD, f0++);
    }
    for (int i = 0; i < ranks - r; ++i) {
      add(second, FORWARD, f1++);
      add(second, BACKWARD_INPUT, b1);
      add(second, BACKWARD_WEIGHT, b1++);
    }
    while (f1 < f0 || f0 < planned) {
      if (f0 < planned) add(first, FORWARD, f0++);
      add(first, BACKWARD_INPUT, b0);
      add(first, BACKWARD_WEIGHT, b0++);
      add(second, FORWARD, f1++);
      add(second, BACKWARD_INPUT, b1);
      add(second, BACKWARD_WEIGHT, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int i = 0; i < r; ++i) {
      add(first, BACKWARD_INPUT, b0++);
      add(second, BACKWARD_INPUT, b1++);
    }
    for (int i = 0; i < ranks - r; ++i) {
      add(first, BACKWARD_INPUT, b0++);
      add(first, BACKWARD_WEIGHT, w0++);
    }
    while (w1 < b1) add(second, BACKWARD_WEIGHT, w1++);
    while (w0 < b0) add(first, BACKWARD_WEIGHT, w0++);
    order.push_back(std::move(row));
  }
  return order;
}

}  // namespace detail::pp

ACCEL_NAMESPACE_END

// == accel/core/pipeline_lowering.hpp =========================================
// accel/core/pipeline_lowering.hpp: a compute-only pipeline order lowered for running: each rank's sends and receives of activations and gradients put in its list, as torch's _add_send_recv puts them.
//
// A compute-only order (core/pipeline_orders.hpp) says what each rank
// computes; running it needs the messages between ranks too. After a
// forward whose next stage lives on another rank, that rank sends the
// activation on (SEND_F) and the next stage's rank posts its receive
// (RECV_F); after a backward (B or I) whose stage before lives elsewhere, the
// input's gradient goes back (SEND_B, RECV_B). A receive is put in the
// receiver's list when its sender's computation is, never earlier, and a
// computation that needs a receive waits in its list until that receive is
// in it: so on every pair of ranks the sends and receives appear in the
// same order on both sides, and no rank waits on a message nobody is yet
// to send. Adjacent stages on one rank (ZBV's V) pass their tensors without
// a message. This is torch 2.15's _add_send_recv, step for step (tests:
// "pipeline lowering", and python_pp_orders against torch's live); the
// gather and free of sharded parameters and the gradients' reduction that
// torch also adds are the runtime's business here (training/pp/), not
// actions.

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// Per rank, its actions in the order it runs them: computations, sends and
// receives, no empty slots.
using LoweredOrder = std::vector<std::vector<Action>>;

inline LoweredOrder add_send_recv(const PipelineOrder& compute, int stages_per_rank, StageStyle style) {
  const int ranks = static_cast<int>(compute.size()), stages = ranks * stages_per_rank;
  auto rank_of = [&](int stage) { return stage_rank(stage, ranks, style); };
  using T = ComputationType;
  // Whether an action sends to another rank: a forward to the next stage, a
  // backward (B or I: the input's gradient) to the stage before.
  auto has_comms = [&](const Action& a) {
    if (a.computation_type == T::FORWARD)
      return a.stage_index != stages - 1 && rank_of(a.stage_index + 1) != rank_of(a.stage_index);
    if (a.computation_type == T::FULL_BACKWARD || a.computation_type == T::BACKWARD_INPUT)
      return a.stage_index != 0 && rank_of(a.stage_index - 1) != rank_of(a.stage_index);
    return false;
  };
  LoweredOrder lowered(static_cast<std::size_t>(ranks));
  // What each rank's list holds so far, as (stage, type, micro-batch) keys.
  std::vector<std::set<std::tuple<int, T, int>>> done(static_cast<std::size_t>(ranks));
  auto key = [](int stage, T type, int mb) { return std::tuple{stage, type, mb}; };
  auto append = [&](int rank, const Action& a) {
    lowered[static_cast<std::size_t>(rank)].push_back(a);
    done[static_cast<std::size_t>(rank)].insert(
        key(a.stage_index, a.computation_type, a.microbatch_index.value_or(-1)));
  };
  // A computation can join its rank's list once what it consumes from another
  // stage is there: its receive, or (the neighbouring stage on this rank)
  // that stage's computation.
  auto ready = [&](const std::optional<Action>& a, int rank) {
    if (!a) return true;
    const auto& seen = done[static_cast<std::size_t>(rank)];
    const int s = a->stage_index, mb = a->microbatch_index.value_or(-1);
    if (a->computation_type == T::FORWARD && s != 0)
      return seen.contains(key(s, T::RECV_F, mb)) || seen.contains(key(s - 1, T::FORWARD, mb));
    if ((a->computation_type == T::BACKWARD_INPUT || a->computation_type == T::FULL_BACKWARD) && s != stages - 1)
      return seen.contains(key(s, T::RECV_B, mb)) || seen.contains(key(s + 1, T::BACKWARD_INPUT, mb)) ||
             seen.contains(key(s + 1, T::FULL_BACKWARD, mb));
    return true;
  };
  std::vector<std::size_t> next(static_cast<std::size_t>(ranks), 0);
  for (;;) {
    bool left = false, progress = false;
    for (int r = 0; r < ranks; ++r) {  // (in rank order, as torch's sweep)
      const auto& row = compute[static_cast<std::size_t>(r)];
      std::size_t& at = next[static_cast<std::size_t>(r)];
      if (at == row.size()) continue;
      left = true;
      const std::optional<Action>& a = row[at];
      if (!ready(a, r)) continue;
      if (a) {
        append(r, *a);
        if (has_comms(*a)) {
          const bool fwd = a->computation_type == T::FORWARD;
          const int to = fwd ? a->stage_index + 1 : a->stage_index - 1;
          append(r, {a->stage_index, fwd ? T::SEND_F : T::SEND_B, a->microbatch_index});
          append(rank_of(to), {to, fwd ? T::RECV_F : T::RECV_B, a->microbatch_index});
        }
      }
      ++at;
      progress = true;
    }
    if (!left) return lowered;
    if (!progress) {
      std::string waiting;
      for (int r = 0; r < ranks; ++r)
        if (next[static_cast<std::size_t>(r)] < compute[static_cast<std::size_t>(r)].size())
          waiting += (waiting.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " at " +
                     to_string(compute[static_cast<std::size_t>(r)][next[static_cast<std::size_t>(r)]]);
      throw InvalidArgument(
          "accel::pp: the order cannot be lowered to sends and receives: every rank waits for a "
          "message no rank is yet to send (" +
          waiting + ")");
    }
  }
}

// torch's CSV of a lowered order (_dump_csv(format="compute_comms")): the
// same form as a compute-only one, without empty slots.
inline PipelineOrder as_order(const LoweredOrder& lowered) {
  PipelineOrder order;
  for (const auto& row : lowered) order.emplace_back(row.begin(), row.end());
  return order;
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END

#endif  // ACCEL_HPP

// Everything below needs LibTorch. ACCEL_CORE_ONLY stops here: the enums,
// the environment and the strategy validation above build without LibTorch
// (for launchers, configuration tools and the fuzz targets).
#if !defined(ACCEL_CORE_ONLY) && !defined(ACCEL_HPP_TORCH)
#define ACCEL_HPP_TORCH

// == accel/distributed/torch.hpp ==============================================
// accel/distributed/torch.hpp: feature detection and the LibTorch headers the collectives need.

// c10d's ProcessGroupGloo.hpp declares nothing unless USE_C10D_GLOO is
// defined; LibTorch itself is built with it, so a program only has to see the
// Gloo headers (Debian: libgloo-dev; PyPI's wheels ship none). Gloo's types
// are reached only through pointers here, so the headers of a Gloo version
// other than the one inside LibTorch will do (the pip leg uses Debian's).
// Whether the gloo backend is compiled follows the headers (ACCEL_HAS_GLOO),
// not that macro: some LibTorch packages (torch 2.11's CMake config) define
// it for every consumer, though their wheels ship no Gloo headers.
#if __has_include(<gloo/algorithm.h>)
#define ACCEL_HAS_GLOO 1
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#else
#define ACCEL_HAS_GLOO 0
#endif

// ProcessGroupNCCL.hpp declares nothing unless USE_C10D_NCCL is defined. Its
// inclusion follows ACCEL_WITH_NCCL, not that macro: some LibTorch packages
// (torch 2.11's CMake config) define it for every consumer, also where the
// CUDA headers it pulls in cannot compile (ACCEL_WITH_NCCL=0).
#if ACCEL_WITH_NCCL && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL 1
#endif

// Debian installs torch/version.h under the C++ API's own include root.
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#elif __has_include(<torch/csrc/api/include/torch/version.h>)
#include <torch/csrc/api/include/torch/version.h>
#else
#error "accel.hpp: cannot find LibTorch's torch/version.h"
#endif

#define ACCEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <ATen/core/ivalue.h>
#include <c10/macros/Export.h>
#if ACCEL_HAS_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if ACCEL_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

// LibTorch's pickler (the format of torch.save), declared here exactly as
// torch/csrc/jit/serialization/pickle.h declares it in 1.13 and 2.x: that
// header pulls in the whole pickler and unpickler, about 40% of ATen's own
// compile time at -O2, for these two functions.
namespace torch {
namespace jit {
TORCH_API std::vector<char> pickle_save(const c10::IValue& ivalue);
TORCH_API c10::IValue pickle_load(const std::vector<char>& data);
}  // namespace jit
}  // namespace torch

ACCEL_NAMESPACE_BEGIN

using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

ACCEL_NAMESPACE_END

// == accel/distributed/devices.hpp ============================================
// accel/distributed/devices.hpp: devices: which accelerator a process uses, binding and synchronising it.
//
// Everything goes through c10's device-guard registry, so a CPU-only LibTorch
// compiles and links without CUDA, MPS or XPU symbols.

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline int guard_device_count(c10::DeviceType type) {
  if (!c10::impl::hasDeviceGuardImpl(type)) return 0;
  try {
    return static_cast<int>(c10::impl::getDeviceGuardImpl(type)->deviceCount());
  } catch (const std::exception&) {
    return 0;  // a registered backend without a usable driver
  }
}

inline c10::DeviceType to_c10(DeviceType type) {
  switch (type) {
    case DeviceType::CPU: return c10::DeviceType::CPU;
    case DeviceType::CUDA: return c10::DeviceType::CUDA;
    case DeviceType::META: return c10::DeviceType::Meta;
    case DeviceType::MPS: return c10::DeviceType::MPS;
    case DeviceType::NPU: return c10::DeviceType::PrivateUse1;
    case DeviceType::XPU: return c10::DeviceType::XPU;
  }
  return c10::DeviceType::CPU;
}
inline DeviceType from_c10(c10::DeviceType type) {
  for (auto t :
       {DeviceType::CPU, DeviceType::CUDA, DeviceType::META, DeviceType::MPS, DeviceType::NPU, DeviceType::XPU})
    if (to_c10(t) == type) return t;
  throw InvalidArgument(std::string("accel: device type ") + c10::DeviceTypeName(type) + " is not one accel.hpp knows");
}
}  // namespace detail

inline bool is_torch_cuda_available() { return detail::guard_device_count(c10::DeviceType::CUDA) > 0; }
inline bool is_torch_mps_available() { return detail::guard_device_count(c10::DeviceType::MPS) > 0; }
inline bool is_torch_xpu_available() { return detail::guard_device_count(c10::DeviceType::XPU) > 0; }
inline bool is_torch_npu_available() {
#if ACCEL_TORCH_AT_LEAST(2, 1)
  // Ascend registers itself as the PrivateUse1 backend named "npu".
  return c10::get_privateuse1_backend() == "npu" && detail::guard_device_count(c10::DeviceType::PrivateUse1) > 0;
#else
  return false;
#endif
}

inline bool is_available(DeviceType type) {
  switch (type) {
    case DeviceType::CPU:
    case DeviceType::META: return true;
    case DeviceType::CUDA: return is_torch_cuda_available();
    case DeviceType::MPS: return is_torch_mps_available();
    case DeviceType::NPU: return is_torch_npu_available();
    case DeviceType::XPU: return is_torch_xpu_available();
  }
  return false;
}

// The accelerator this process uses, without an index. ACCEL_DEVICE forces a
// type; with check_available, forcing an unavailable one is an error.
namespace detail {
// A device type asked for (by `who`), checked to be usable.
inline c10::Device forced_device(DeviceType type, const std::string& who, bool check_available = true) {
  if (check_available && !is_available(type))
    throw RuntimeError("accel: " + who + ", but this LibTorch has no usable " + std::string(to_string(type)) +
                       " device (CPU-only build, or no device visible)");
  return c10::Device(to_c10(type));
}
}  // namespace detail

inline c10::Device get_current_accelerator(bool check_available = true) {
  if (auto forced = detail::getenv_str("ACCEL_DEVICE")) {
    DeviceType type;
    try {
      type = from_string<DeviceType>(*forced);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string("accel: ACCEL_DEVICE: ") + e.what());
    }
    return detail::forced_device(type, "ACCEL_DEVICE=" + *forced, check_available);
  }
  for (auto type : {DeviceType::CUDA, DeviceType::NPU, DeviceType::XPU, DeviceType::MPS})
    if (is_available(type)) return c10::Device(detail::to_c10(type));
  return c10::Device(c10::DeviceType::CPU);
}

// Devices of the current accelerator on this host; 1 for the CPU.
inline int get_device_count() {
  auto type = get_current_accelerator().type();
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return 1;
  return detail::guard_device_count(type);
}

namespace detail {
// Binds this process to device LOCAL_RANK of `type` (no-op on the CPU).
// A peer that dies mid-collective leaves its sockets closed, and writing to
// one raises SIGPIPE, whose default ends this process before c10d can report
// the failure (seen: status 141 instead of a DistributedError). Python
// ignores SIGPIPE from startup; a distributed accel.hpp process does the
// same, unless the program chose a disposition of its own. (Children that
// launch_processes starts get the default back, as Python's subprocess does.)
inline void ignore_sigpipe() {
  struct sigaction current{};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && !(current.sa_flags & SA_SIGINFO) && current.sa_handler == SIG_DFL)
    signal(SIGPIPE, SIG_IGN);
}

inline void bind_device(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return;
  int local_rank = get_local_rank();
  int count = detail::guard_device_count(type);
  if (local_rank >= count)
    throw RuntimeError("accel: LOCAL_RANK=" + std::to_string(local_rank) + " but only " + std::to_string(count) + " " +
                       c10::DeviceTypeName(type, true) + " device(s) are visible");
  c10::impl::getDeviceGuardImpl(type)->setDevice(c10::Device(type, static_cast<c10::DeviceIndex>(local_rank)));
}

// The current device of `type`, with its index.
inline c10::Device current_device_of(c10::DeviceType type) {
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return c10::Device(type);
  return c10::impl::getDeviceGuardImpl(type)->getDevice();
}
}  // namespace detail

// Binds this process to the device LOCAL_RANK (no-op on the CPU).
inline void set_device_index() { detail::bind_device(get_current_accelerator().type()); }

inline c10::Device get_current_device() { return detail::current_device_of(get_current_accelerator().type()); }

// Waits for the work queued on the local device; not a barrier.
inline void synchronize() {
  auto type = get_current_accelerator().type();
  if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(type);
  auto device = impl->getDevice();
#if ACCEL_TORCH_AT_LEAST(2, 1)
  impl->synchronizeDevice(device.index());
#else
  // 1.x has no device-wide synchronisation in the guard interface: wait for
  // the current stream, where LibTorch queues the work of this thread.
  impl->synchronizeStream(impl->getStream(device));
#endif
}

namespace detail {
// "nccl" for CUDA, "hccl" for NPU, "gloo" otherwise; ACCEL_BACKEND overrides.
inline std::string backend_for(c10::DeviceType type) {
  if (auto forced = detail::getenv_str("ACCEL_BACKEND")) {
    if (*forced == "gloo") return *forced;
    if (*forced == "nccl") {
      if (!ACCEL_WITH_NCCL)
        throw RuntimeError(
            "accel: ACCEL_BACKEND=nccl, but accel.hpp was compiled against a LibTorch "
            "without NCCL (no CUDA build or no <nccl.h>); use ACCEL_BACKEND=gloo");
      // c10d's own refusal comes later, from inside the group set-up, and
      // reads differently on each version: say it here, before the rendezvous.
      if (!is_torch_cuda_available())
        throw RuntimeError(
            "accel: ACCEL_BACKEND=nccl, but this process sees no CUDA device (no GPU, no driver, or "
            "CUDA_VISIBLE_DEVICES hides them); NCCL moves only device memory: use ACCEL_BACKEND=gloo");
      return *forced;
    }
    throw InvalidArgument("accel: ACCEL_BACKEND='" + *forced + "' is not supported (expected gloo or nccl)");
  }
  switch (type) {
    case c10::DeviceType::CUDA: return "nccl";
    case c10::DeviceType::PrivateUse1: return "hccl";
    default: return "gloo";
  }
}
}  // namespace detail

// The backend for the current accelerator (see detail::backend_for).
inline std::string get_process_group_backend() { return detail::backend_for(get_current_accelerator().type()); }

ACCEL_NAMESPACE_END

// == accel/distributed/concepts.hpp ===========================================
// accel/distributed/concepts.hpp: what the collectives take: Scalar, ScalarVector, TensorLike.
//
// A scalar travels as a 0-d tensor and a std::vector as a 1-d tensor over the
// same memory (no copy on the CPU); results come back in the caller's type.

ACCEL_NAMESPACE_BEGIN

template <class T>
concept Scalar = std::is_arithmetic_v<T> && !std::same_as<T, bool>;

namespace detail {
template <class T>
struct scalar_vector : std::false_type {};
template <Scalar T>
struct scalar_vector<std::vector<T>> : std::true_type {
  using element = T;
};
}  // namespace detail

template <class T>
concept ScalarVector = detail::scalar_vector<T>::value;

template <class T>
concept TensorLike = std::same_as<T, at::Tensor> || Scalar<T> || ScalarVector<T>;

namespace detail {
template <class T>
struct element_of {
  using type = T;
};
template <ScalarVector T>
struct element_of<T> {
  using type = typename scalar_vector<T>::element;
};
template <class T>
using element_t = typename element_of<T>::type;

// The ATen dtype that holds every value of T exactly, if there is one.
template <Scalar T>
constexpr std::optional<c10::ScalarType> exact_dtype() {
  if constexpr (std::is_same_v<T, float>) return c10::kFloat;
  else if constexpr (std::is_same_v<T, double>) return c10::kDouble;
  else if constexpr (std::is_floating_point_v<T>) return std::nullopt;  // long double
  else if constexpr (sizeof(T) == 1) return std::is_signed_v<T> ? c10::kChar : c10::kByte;
  else if constexpr (!std::is_signed_v<T>) return std::nullopt;  // no unsigned dtypes in 1.x
  else if constexpr (sizeof(T) == 2) return c10::kShort;
  else if constexpr (sizeof(T) == 4) return c10::kInt;
  else return c10::kLong;
}

// Dtypes every backend reduces natively (Gloo has no int16 kernels).
template <Scalar T>
constexpr bool travels_natively() {
  constexpr auto dtype = exact_dtype<T>();
  return dtype.has_value() && *dtype != c10::kShort;
}

// The dtype operate_tensorlike presents to its function: exact where ATen has
// one, otherwise the smallest dtype that holds the values.
template <Scalar T>
constexpr c10::ScalarType value_dtype() {
  if constexpr (exact_dtype<T>().has_value()) return *exact_dtype<T>();
  else if constexpr (std::is_floating_point_v<T>) return c10::kDouble;
  else if constexpr (sizeof(T) == 2) return c10::kInt;
  else return c10::kLong;
}
// ATen's own C++ type for that dtype: data_ptr<T>() and item<T>() exist only
// for these (int64_t, not long long; int8_t, not char).
template <Scalar T>
using value_type_t = c10::impl::ScalarTypeToCPPTypeT<value_dtype<T>()>;

template <Scalar T>
value_type_t<T> to_value(T x) {
  if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8)
    if (x > static_cast<T>(INT64_MAX))
      throw OutOfRange("accel::operate_tensorlike: uint64 value " + std::to_string(x) +
                       " does not fit LibTorch's int64 dtype");
  return static_cast<value_type_t<T>>(x);
}

inline at::TensorOptions cpu_options(c10::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(c10::kCPU);
}

// Tensors that alias the caller's memory.
template <Scalar T>
at::Tensor alias(T& value, c10::ScalarType dtype) {
  return at::from_blob(&value, {}, cpu_options(dtype));
}
template <Scalar T>
at::Tensor alias(std::vector<T>& values, c10::ScalarType dtype) {
  if (values.empty()) return at::empty({0}, cpu_options(dtype));  // (no memory to alias)
  return at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, cpu_options(dtype));
}
template <Scalar T>
at::Tensor alias_bytes(T& value) {
  return at::from_blob(&value, {static_cast<int64_t>(sizeof(T))}, cpu_options(c10::kByte));
}
template <Scalar T>
at::Tensor alias_bytes(std::vector<T>& values) {
  if (values.empty()) return at::empty({0}, cpu_options(c10::kByte));
  return at::from_blob(values.data(), {static_cast<int64_t>(values.size() * sizeof(T))}, cpu_options(c10::kByte));
}

// How data travels in a collective: a view of its own memory, in its dtype
// where every backend reduces it natively, else as raw bytes.
template <class V>
at::Tensor memory_view(V& data) {
  using E = element_t<V>;
  if constexpr (travels_natively<E>()) return alias(data, *exact_dtype<E>());
  else return alias_bytes(data);
}

template <Scalar T>
T from_value_tensor(const at::Tensor& result) {
  if (result.numel() != 1)
    throw InvalidArgument("accel::operate_tensorlike: a scalar's function returned " + std::to_string(result.numel()) +
                          " elements");
  using V = value_type_t<T>;
  return static_cast<T>(result.to(c10::kCPU).to(value_dtype<T>()).template item<V>());
}
template <Scalar T>
std::vector<T> from_value_tensor(const at::Tensor& result, std::vector<T>&& original, const void* original_data) {
  if (result.data_ptr() == original_data && result.numel() == static_cast<int64_t>(original.size()) &&
      result.scalar_type() == value_dtype<T>() && result.is_contiguous())
    return std::move(original);  // the function worked in place
  auto flat = result.to(c10::kCPU).to(value_dtype<T>()).contiguous().reshape({-1});
  const auto* data = flat.template data_ptr<value_type_t<T>>();
  return std::vector<T>(data, data + flat.numel());
}
}  // namespace detail

// Applies fn (at::Tensor -> at::Tensor) to data and returns the result in
// data's C++ type. Types without an exact ATen dtype (unsigned 16/32/64-bit,
// long double) are presented as the smallest dtype that holds their values.
template <TensorLike T, class Fn>
  requires std::invocable<Fn&, at::Tensor&>
T operate_tensorlike(Fn&& fn, T data) {
  if constexpr (std::same_as<T, at::Tensor>) {
    return std::invoke(fn, data);
  } else if constexpr (Scalar<T>) {
    auto value = detail::to_value(data);
    at::Tensor tensor = at::from_blob(&value, {}, detail::cpu_options(detail::value_dtype<T>()));
    at::Tensor result = std::invoke(fn, tensor);
    return detail::from_value_tensor<T>(result);
  } else {
    using E = detail::element_t<T>;
    if constexpr (detail::exact_dtype<E>().has_value()) {
      at::Tensor tensor = detail::alias(data, *detail::exact_dtype<E>());
      const void* original = data.data();
      at::Tensor result = std::invoke(fn, tensor);
      return detail::from_value_tensor<E>(result, std::move(data), original);
    } else {
      std::vector<detail::value_type_t<E>> values;
      values.reserve(data.size());
      for (E x : data) values.push_back(detail::to_value(x));
      at::Tensor tensor = detail::alias(values, detail::value_dtype<E>());
      at::Tensor result = std::invoke(fn, tensor);
      return detail::from_value_tensor<E>(result, {}, nullptr);  // converted back element by element
    }
  }
}

ACCEL_NAMESPACE_END

// == accel/distributed/issue.hpp ==============================================
// accel/distributed/issue.hpp: debug mode, the group registry, issuing c10d operations, their errors.
//
// A null group means the world group of DistributedInterface, or identity
// when the process is not distributed. `src` is a rank within the group.
//
// Debug mode (ACCEL_DEBUG_MODE=1, or set_debug_mode(true)) makes every
// collective first compare what each rank passes (the operation, structure,
// shapes, dtypes, devices); on a mismatch EVERY rank throws the same
// DistributedError listing each rank's call, instead of hanging or returning
// garbage. It costs one small all_gather per collective when on, and one
// relaxed atomic load when off. Set it alike on every rank.

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline std::atomic<int>& debug_state() {  // -1: not read from the environment yet
  static std::atomic<int> state{-1};
  return state;
}
}  // namespace detail

inline bool debug_mode() {
  int state = detail::debug_state().load(std::memory_order_relaxed);
  if (state < 0) [[unlikely]] {
    state = detail::env_bool("ACCEL_DEBUG_MODE", false) ? 1 : 0;
    detail::debug_state().store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

namespace detail {
struct GroupRegistry {
  // The interface owns the world group; this is only where collectives with
  // a null group find it, without a lock.
  std::atomic<c10d::ProcessGroup*> world{nullptr};
  std::mutex mutex;  // guards entries (read only to word and diagnose errors)
  struct Entry {
    std::string name;
    c10::intrusive_ptr<c10d::Store> store;  // the group's own keys, for roll calls; may be null
    int roll_calls = 0;
  };
  std::map<const c10d::ProcessGroup*, Entry> entries;
  // The text of a failed operation's error (explain_failure in
  // registration.hpp: the group's name, rank and size, and after a timeout a
  // roll call of the group's ranks through its store). failure() reaches it
  // through this pointer, which register_group sets, instead of calling it,
  // so that only the translation units that make groups compile it (a thread
  // and a store protocol), not every one that calls a collective: it was a
  // third of what one call costs to compile.
  // Debug mode's check that every rank made the same call (verify_same_call)
  // is pointed to for the same reason: set by register_group and set_debug_mode.
  std::atomic<std::string (*)(const char* op, c10d::ProcessGroup& group, const std::exception& e)> explain_failure{
      nullptr};
  std::atomic<void (*)(c10d::ProcessGroup&, const std::string&)> verify_same_call{nullptr};
  // debug_mode() itself (its parse of ACCEL_DEBUG_MODE, with its errors), for
  // collectives that meet a state not read yet (checking_calls); set with
  // verify_same_call.
  std::atomic<bool (*)()> read_debug_mode{nullptr};
};
// Never destroyed: the singleton may release its groups during static
// destruction at exit, after a registry with a destructor would be gone.
inline GroupRegistry& registry() {
  static GroupRegistry* instance = new GroupRegistry;
  return *instance;
}

// Whether a collective runs debug mode's check: debug_mode(), reached
// through the registry's pointer so that its parse of the variable is not
// compiled into every file that calls a collective. A process where
// nothing set the check up yet (only groups made with c10d directly) has no
// reader; there the variable merely being set sends the call on to
// verify_call, whose error says how to set the check up.
inline bool checking_calls() {
  const int state = debug_state().load(std::memory_order_relaxed);
  if (state >= 0) [[likely]]
    return state == 1;
  if (auto* read = registry().read_debug_mode.load(std::memory_order_acquire)) return read();
  return std::getenv("ACCEL_DEBUG_MODE") != nullptr;
}

inline std::string group_name(const c10d::ProcessGroup& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  auto it = reg.entries.find(&group);
  return it == reg.entries.end() ? std::string("unnamed") : it->second.name;
}

inline std::string describe(const c10d::ProcessGroup& group) {
  std::ostringstream text;  // (not std::string's +: each + is inlined code in every file that calls a collective)
  text << "group '" << group_name(group) << "' (" << group.getBackendName() << ", rank " << group.getRank() << " of "
       << group.getSize() << ")";
  return text.str();
}

// The group a collective runs on, not owned (the caller's group, or the
// world group the interface keeps alive); null when no launcher's
// environment is set, where collectives are the identity. No reference
// counting on the hot path.
inline c10d::ProcessGroup* resolve(const GroupPtr& group, const char* op) {
  if (group) return group.get();
  if (auto* world = registry().world.load()) return world;
  const char* launcher = launcher_in_environment();
  if (!launcher) return nullptr;
  const std::string what =
      launcher == kLaunchers[0].launcher ? "RANK is set" : launcher + std::string("'s environment is set");
  throw LogicError(std::string("accel::") + op + ": " + what +
                   " but no world group exists; call accel::DistributedInterface::instance() first or pass a group");
}

inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

// Runs `work` on a thread of its own and waits for it at most `limit`:
// true when it finished (rethrowing what it threw), false when it overran.
// An overrun thread is abandoned, still running, so `work` must own
// everything it uses (capture by value). For calls into c10d's store
// clients, which can wait for an answer with no timeout of their own (a
// stopped serving rank). Not a template, so that the thread and promise
// machinery is compiled once, not once per caller.
inline bool finished_within(std::chrono::milliseconds limit, std::function<void()> work) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread([done, work = std::move(work)] {
    try {
      work();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (finished.wait_for(limit) != std::future_status::ready) return false;
  finished.get();
  return true;
}
// The same for work with a result: the result, or nullopt when it overran.
template <class R, class Work>
std::optional<R> run_within(std::chrono::milliseconds limit, Work work) {
  auto result = std::make_shared<std::optional<R>>();  // shared with a thread that may outlive this call
  if (!finished_within(limit, [result, work = std::move(work)]() mutable { *result = work(); })) return std::nullopt;
  return std::move(*result);
}

// Issues one c10d operation (the call itself can fail: a dtype or a shape
// the backend rejects) and waits for it; any failure becomes a
// DistributedError that names the operation and the group (after a timeout,
// also the ranks that seem to be the cause: explain_failure in
// registration.hpp, which every group accel makes sets up). A process that
// never made an accel group (only groups made with c10d directly) gets the
// operation and the exception's own text (with LibTorch's backtrace).
inline DistributedError failure(const char* op, c10d::ProcessGroup& group, const std::exception& e) {
  if (auto* explain = registry().explain_failure.load(std::memory_order_acquire))
    return DistributedError(explain(op, group, e));
  return DistributedError(std::string("accel::") + op + " failed: " + e.what());
}
template <class Issue>
c10::intrusive_ptr<c10d::Work> issue(const char* op, c10d::ProcessGroup& group, Issue&& issue) {
  try {
    return issue();
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
// A Gloo group's timeout (its options'), for waits that must end by it:
// c10d waits for a Gloo point-to-point message without one unless given
// one, so a receive from a live peer that never sends would wait forever.
// None for another backend (NCCL's watchdog bounds its waits).
inline std::optional<std::chrono::milliseconds> gloo_timeout([[maybe_unused]] c10d::ProcessGroup& group) {
#if ACCEL_HAS_GLOO
#if ACCEL_TORCH_AT_LEAST(2, 0)
  if (group.getBackendName() != "gloo") return std::nullopt;
  auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.getBackend(c10::DeviceType::CPU).get());
#else
  auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(&group);
#endif
  if (gloo) return std::chrono::duration_cast<std::chrono::milliseconds>(gloo->getOptions()->timeout);
#endif
  return std::nullopt;
}

// Whether `op` is made of point-to-point messages: send, recv, and what
// accel builds from them (named "... (point to point)": the direct
// collectives of pieces.hpp, the pipeline's messages).
inline bool point_to_point(std::string_view op) {
  return op == "send" || op == "recv" || op.find("(point to point)") != std::string_view::npos;
}
// A wait for `work`, bounded where c10d would not bound it (a Gloo
// point-to-point message: by the group's timeout); c10d's result (false:
// the work was aborted).
inline bool wait_bounded(const char* op, c10d::ProcessGroup& group, c10d::Work& work) {
  const std::optional<std::chrono::milliseconds> timeout =
      point_to_point(op) ? gloo_timeout(group) : std::optional<std::chrono::milliseconds>();
  return timeout ? work.wait(*timeout) : work.wait();
}
inline void await(const char* op, c10d::ProcessGroup& group, c10d::Work& work) {
  try {
    wait_bounded(op, group, work);
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
template <class Issue>
void run(const char* op, c10d::ProcessGroup& group, Issue&& issue) {
  try {
    issue()->wait();
  } catch (const std::exception& e) {
    throw failure(op, group, e);
  }
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/pending.hpp ============================================
// accel/distributed/pending.hpp: Pending: a collective issued (its start) and not landed yet (its land), the result it gives.

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

// == accel/distributed/staging.hpp ============================================
// accel/distributed/staging.hpp: what c10d gets for a tensor: dtypes every backend moves, staged copies, the device NCCL needs, reductions checked.

ACCEL_NAMESPACE_BEGIN

namespace detail {
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
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/start_gather.hpp =======================================
// accel/distributed/start_gather.hpp: the all-gather family started: into given outputs, into rows, of CPU elements.

ACCEL_NAMESPACE_BEGIN

namespace detail {
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
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/start_reduce.hpp =======================================
// accel/distributed/start_reduce.hpp: the all-reduce family started: in place, onto one rank, and folded locally for types no backend reduces.

ACCEL_NAMESPACE_BEGIN

namespace detail {
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
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/start_broadcast.hpp ====================================
// accel/distributed/start_broadcast.hpp: the broadcast family started: a tensor from one rank, its pieces scattered from one rank, the ranks checked.

ACCEL_NAMESPACE_BEGIN

namespace detail {
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
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/pieces.hpp =============================================
// accel/distributed/pieces.hpp: a Gloo group's exchange of pieces point to point: the all-gather and reduce-scatter the sharding engine runs without staging.

ACCEL_NAMESPACE_BEGIN

namespace detail {
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
// pieces cost more than one row copied out after (see dp/unit_params.hpp).
inline constexpr const char* kDirectGather = "all_gather (point to point)";
inline bool direct_gather_fits(const c10d::ProcessGroup& group, const at::Tensor& input, const at::Tensor& rows) {
  return group.getBackendName() == "gloo" && input.device().is_cpu() && rows.device().is_cpu() &&
         input.is_contiguous() && rows.is_contiguous() && input.numel() > 0;
}
// The exchange under it (and under the sharding engine's point-to-point
// reduce-scatter, dp/scatter.hpp, named kDirectScatter): to every other
// rank `to`, `count` pieces sent(to, i); from every other rank `from`,
// count pieces received into into(from, i). Both sides must agree on each
// piece's length (an empty one is neither sent nor received).
inline constexpr const char* kDirectScatter = "reduce_scatter (point to point)";
// ... and under the all-reduce of small tensors (distributed/direct_all_reduce.hpp).
inline constexpr const char* kDirectAllReduce = "all_reduce (point to point)";
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
        wait_bounded(op_, *group_, *works_[next_]);
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
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/debug_check.hpp ========================================
// accel/distributed/debug_check.hpp: debug mode's check that every rank made the same call, and the texts that describe a call.

ACCEL_NAMESPACE_BEGIN

namespace detail {
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

// == accel/distributed/registration.hpp =======================================
// accel/distributed/registration.hpp: registering the groups accel makes, with the code that diagnoses their failures.
//
// The text of a failure (with the roll call after a timeout) and debug mode's
// check of every rank's call are reached through pointers that registering a group (or
// set_debug_mode) sets, not called directly by every collective: a
// translation unit compiles the code its calls reach, and these two were most
// of what one collective costs to compile. Only the translation units that
// make groups or switch debug mode compile them.

ACCEL_NAMESPACE_BEGIN

// Turns debug mode on or off for this process; nullopt re-reads ACCEL_DEBUG_MODE.
inline void set_debug_mode(std::optional<bool> on) {
  detail::registry().verify_same_call.store(&detail::verify_same_call, std::memory_order_release);
  detail::registry().read_debug_mode.store(&debug_mode, std::memory_order_release);
  detail::debug_state().store(on ? static_cast<int>(*on) : -1, std::memory_order_relaxed);
}

namespace detail {
// The roll call of a group's failure, through the group's store: every rank
// whose collective timed out, or lost its connection to a peer, reports in
// the group's `call`-th roll call, and a rank that timed out waits for the
// others to report. The ranks that never report are named: hung, dead, or
// stuck somewhere else. Why a rank that lost its connection reports too:
// when several ranks wait for one hung peer, the first to time out closes
// its connections, so the others fail with "Connection closed by peer"
// instead of their own timeout a moment later; unreported, they would be
// named beside the hung rank.
inline std::string roll_call_key(int call) { return "accel_roll_call/" + std::to_string(call) + "/"; }

// Reports this rank present in the `call`-th roll call (two store operations).
inline void report_in_roll_call(c10d::Store& store, int size, int rank, int call) {
  const std::string base = roll_call_key(call);
  store.set(base + std::to_string(rank), std::vector<uint8_t>{1});
  if (store.add(base + "reported", 1) == size) store.set(base + "all", std::vector<uint8_t>{1});
}

// After a collective timed out: reports, then waits up to `grace` for the
// others. A hint, as " (...)" for the error message, or "". The store may
// itself be served by the hung rank (a TCPStore on rank 0): the roll call
// runs on a thread of its own and is abandoned after grace + 1 s, so it can
// never add more than that to the error.
inline std::string roll_call_in_store(c10::intrusive_ptr<c10d::Store> store, int size, int rank, int call,
                                      std::chrono::milliseconds grace) {
  const auto answer = run_within<std::string>(grace + std::chrono::seconds(1), [store, size, rank, call, grace] {
    try {
      const std::string base = roll_call_key(call);
      report_in_roll_call(*store, size, rank, call);
      // Polled: Store::wait's own timeout cannot be shorter than the store's
      // (FileStore in 1.13 waits the store's timeout whatever it is given).
      for (const auto deadline = std::chrono::steady_clock::now() + grace; std::chrono::steady_clock::now() < deadline;
           std::this_thread::sleep_for(std::chrono::milliseconds(20)))
        if (store->check({base + "all"})) return std::string();  // everyone failed alike
      const int64_t reported = store->add(base + "reported", 0);
      std::string missing;
      int64_t named = 0;
      for (int r = 0; r < size && named < std::min<int64_t>(size - reported, 16); ++r)
        if (!store->check({base + std::to_string(r)})) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          ++named;
        }
      if (size - reported > named) missing += ", ...";
      return " (roll call: rank" + std::string(size - reported > 1 ? "s " : " ") + missing + " of the group " +
             "did not reach this timeout within " + std::to_string(grace.count()) +
             " ms of this rank: hung, or stuck elsewhere)";
    } catch (...) {
      return std::string();
    }
  });
  return answer ? *answer : " (roll call: the group's store did not answer either; is the rank serving it hung?)";
}

// The store and the number of the next roll call of a group accel made
// (registered with its store), or a null store.
inline std::pair<c10::intrusive_ptr<c10d::Store>, int> next_roll_call(c10d::ProcessGroup& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  auto it = reg.entries.find(&group);
  if (it == reg.entries.end() || !it->second.store) return {};
  return {it->second.store, ++it->second.roll_calls};
}

// The roll call of a group accel made after a timeout, or "".
inline std::string roll_call(c10d::ProcessGroup& group, std::chrono::milliseconds grace = std::chrono::seconds(2)) {
  auto [store, call] = next_roll_call(group);
  if (!store) return "";
  return roll_call_in_store(std::move(store), group.getSize(), group.getRank(), call, grace);
}

// After a lost connection: reports without waiting (a peer that died never
// reports, and waiting for it would delay every dead peer's error by the
// grace), bounded by a second in case the store's server is the rank that
// is gone. A hint for the error message.
inline std::string report_lost_connection(c10d::ProcessGroup& group) {
  auto [store, call] = next_roll_call(group);
  if (!store) return "";
  const int size = group.getSize(), rank = group.getRank();
  run_within<bool>(std::chrono::seconds(1), [store, size, rank, call] {
    try {
      report_in_roll_call(*store, size, rank, call);
    } catch (...) {  // the store's server may be the peer that is gone
    }
    return true;
  });
  return " (a peer closed the connection: it exited or failed, or it timed out first, and then its own error "
         "names the ranks it waited for)";
}

inline bool is_timeout(const std::string& text) {
  const std::string lower = lowercase(text);
  return lower.find("timed out") != std::string::npos || lower.find("timeout") != std::string::npos;
}
inline bool is_lost_connection(const std::string& text) {
  const std::string lower = lowercase(text);
  for (const char* sign : {"closed by peer", "reset by peer", "connection closed", "broken pipe", "socket closed"})
    if (lower.find(sign) != std::string::npos) return true;
  return false;
}

// The text of a failed operation's error (failure() in issue.hpp reaches it
// through the registry).
inline std::string explain_failure(const char* op, c10d::ProcessGroup& group, const std::exception& e) {
  const std::string cause = error_text(e);  // (without LibTorch's backtrace)
  std::string message = std::string("accel::") + op + " failed on " + describe(group) + ": " + cause;
  if (is_timeout(cause)) message += roll_call(group);
  else if (is_lost_connection(cause)) message += report_lost_connection(group);
  return message;
}

// Groups accel makes are named for error messages and keep their store for
// the roll call; collectives accept other groups as well.
inline void register_group(const GroupPtr& group, std::string name, c10::intrusive_ptr<c10d::Store> store = {},
                           bool is_world = false) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.entries[group.get()] = {std::move(name), std::move(store)};
  reg.verify_same_call.store(&verify_same_call, std::memory_order_release);
  reg.explain_failure.store(&explain_failure, std::memory_order_release);
  reg.read_debug_mode.store(&debug_mode, std::memory_order_release);
  if (is_world) reg.world.store(group.get());
}
inline void unregister_group(const GroupPtr& group) {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.entries.erase(group.get());
  c10d::ProcessGroup* expected = group.get();
  reg.world.compare_exchange_strong(expected, nullptr);
}

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/work.hpp ===============================================
// accel/distributed/work.hpp: accel::Work: an operation in flight, what the _async forms return.
//
// Asynchronous work. The _async forms issue the operation at once, in
// call order like every collective (so ranks must still call them in the
// same order), and return an accel::Work<R> instead of R.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What every accel::Work holds whatever its result: the operation's group
// (kept alive while it runs) and c10d Work, and how to tell completion.
class WorkCore {
 public:
  WorkCore(c10d::ProcessGroup* group, const char* op, c10::intrusive_ptr<c10d::Work> work)
      : group_(group ? GroupPtr::unsafe_reclaim_from_nonowning(group) : GroupPtr()), op_(op), work_(std::move(work)) {
    // Gloo's send and recv (also those of a direct all-gather, reduce-scatter or all-reduce, pieces.hpp)
    // report completion only from inside wait() (their isCompleted() stays
    // false until then, and a wait with a timeout that expires closes every
    // connection of the group): a thread of our own waits for them once
    // someone asks without waiting.
    watched_ = work_ && group_->getBackendName() == "gloo" && point_to_point(op);
  }
  WorkCore(const WorkCore&) = delete;
  WorkCore& operator=(const WorkCore&) = delete;
  virtual ~WorkCore() = default;  // a watcher thread is joined by its future

  bool completed() {
    if (!work_) return true;
    if (!watched_) return work_->isCompleted();
    watch();
    return watcher_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  bool wait_for(std::chrono::milliseconds timeout) {
    if (completed() || timeout <= std::chrono::milliseconds(0)) return completed();  // (c10d reads 0 as "for ever")
    if (watched_) return watcher_.wait_for(timeout) == std::future_status::ready;
    if (group_->getBackendName() == "gloo") {
      // Gloo's collectives wait on a condition variable; one that times out
      // throws "Operation timed out!" and changes nothing. A failure of the
      // operation itself is thrown again by wait().
      try {
        work_->wait(timeout);
      } catch (const std::exception&) {
      }
      return work_->isCompleted();
    }
    // Other backends (NCCL: completion of the device work) are asked until
    // the deadline, at most every millisecond.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto pause = std::chrono::microseconds(20); std::chrono::steady_clock::now() < deadline;
         pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1))) {
      if (work_->isCompleted()) return true;
      std::this_thread::sleep_for(pause);
    }
    return work_->isCompleted();
  }

  // Waits for the operation; a failure becomes the DistributedError its
  // blocking form throws.
  void wait() {
    if (!work_) return;
    if (!watched_ || !watcher_.valid()) return await(op_, *group_, *work_);
    try {
      watcher_.get();
    } catch (const std::exception& e) {
      throw failure(op_, *group_, e);
    }
  }

 private:
  void watch() {
    if (!watcher_.valid()) watcher_ = std::async(std::launch::async, &wait_on, op_, group_, work_);
  }
  // A function, not a lambda, for the reason make_group_of (rendezvous.hpp)
  // gives: the thread's body is reached from every virtual call in a file.
  // (bounded by the group's timeout: a live peer that never sends ends it too)
  static void wait_on(const char* op, GroupPtr group, c10::intrusive_ptr<c10d::Work> work) {
    wait_bounded(op, *group, *work);
  }

  GroupPtr group_;
  const char* op_;
  c10::intrusive_ptr<c10d::Work> work_;
  bool watched_ = false;
  std::future<void> watcher_;
};

template <class R>
class WorkOf : public WorkCore {
 public:
  using WorkCore::WorkCore;
  virtual R land() = 0;
};
template <class R, class Land>
class PendingWork final : public WorkOf<R> {
 public:
  explicit PendingWork(Pending<Land>&& pending)
      : WorkOf<R>(pending.group, pending.op, std::move(pending.work)), land_(std::move(pending.land)) {}
  R land() override { return land_(); }

 private:
  Land land_;
};
}  // namespace detail

// An operation in flight (torch.distributed's Work, with its result): what an
// _async form returns. It owns every buffer the operation uses, so the
// caller's data may go out of scope. Move-only; not for concurrent use from
// several threads (as std::future).
//   R wait()              waits and returns the result (as the blocking form
//                         does; a tensor passed in holds it from then on);
//                         failures throw the blocking form's DistributedError.
//                         Once, as std::future::get: a second wait() is a
//                         LogicError, and valid() is false afterwards.
//   bool wait_for(ms)     waits at most ms; true once the operation completed
//                         (wait() then returns at once, or throws its error),
//                         and after wait() (as torch's Work).
//   bool is_completed()   wait_for without waiting.
// A default-constructed or moved-from Work holds no operation: asking it
// anything is a LogicError.
// Destroying a Work that was never waited for waits for the operation (its
// buffers must outlive it) and lands it (a tensor passed in holds the
// result) but drops what wait() would return; a failure is then printed to
// stderr, as nothing else can report it.
template <class R>
class Work {
 public:
  Work() = default;
  template <class Land>
  explicit Work(detail::Pending<Land> pending)
      : flight_(std::make_unique<detail::PendingWork<R, Land>>(std::move(pending))) {}
  Work(Work&& other) noexcept : flight_(std::move(other.flight_)), waited_(std::exchange(other.waited_, false)) {}
  Work& operator=(Work&& other) noexcept {
    if (this != &other) {
      abandon();
      flight_ = std::move(other.flight_);
      waited_ = std::exchange(other.waited_, false);
    }
    return *this;
  }
  ~Work() { abandon(); }

  bool valid() const noexcept { return flight_ != nullptr; }
  R wait() {
    if (waited_)
      throw LogicError(
          "accel::Work::wait: already waited for; wait() returns the result once (as std::future::get), "
          "is_completed() and wait_for() stay true");
    std::unique_ptr<detail::WorkOf<R>> flight = std::move(flight_);
    if (!flight) throw_empty("wait");
    waited_ = true;  // also when the operation failed: it ended, and wait() reported how
    flight->wait();
    return flight->land();
  }
  bool wait_for(std::chrono::milliseconds timeout) {
    if (waited_) return true;
    if (!flight_) throw_empty("wait_for");
    return flight_->wait_for(timeout);
  }
  bool is_completed() {
    if (waited_) return true;
    if (!flight_) throw_empty("is_completed");
    return flight_->completed();
  }

 private:
  [[noreturn]] static void throw_empty(const char* member) {
    throw LogicError(std::string("accel::Work::") + member +
                     ": this Work holds no operation (default-constructed or moved from)");
  }
  void abandon() noexcept {
    if (!flight_) return;
    try {
      flight_->wait();
      flight_->land();  // in place: the caller's tensor holds the result
    } catch (const std::exception& e) {
      std::cerr << "accel: " << detail::error_text(e) << " (its accel::Work was destroyed without wait())" << std::endl;
    }
    flight_.reset();
  }

  std::unique_ptr<detail::WorkOf<R>> flight_;
  bool waited_ = false;  // wait() was called: completed from then on
};

ACCEL_NAMESPACE_END

// == accel/distributed/collectives.hpp ========================================
// accel/distributed/collectives.hpp: all_reduce, broadcast, all_gather and their _async forms.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Keeps `owner` (a boxed copy of the caller's data that c10d reads in place)
// until the operation lands.
template <class Land, class Owner>
auto keep_until_landed(Pending<Land> pending, Owner owner) {
  return then(std::move(pending), [owner = std::move(owner)](auto&&... result) { return (std::move(result), ...); });
}
template <class T>
auto copy_for_async(const T& data) {
  return std::make_unique<T>(data);
}

// The start of an in-place operation (`start`, on a tensor) on any
// TensorLike: a tensor as it is; a std::vector as a view of its elements
// (memory_view), moved into the Pending (moving a std::vector keeps its elements
// where c10d reads and writes them); a scalar as a std::vector of one.
template <TensorLike T, class Start>
auto start_in_place(T data, Start start) {
  if constexpr (std::same_as<T, at::Tensor>) {
    return start(std::move(data));
  } else if constexpr (Scalar<T>) {
    return then(start_in_place(std::vector<T>{data}, std::move(start)), [](std::vector<T> v) { return v[0]; });
  } else {
    auto pending = start(memory_view(data));
    return then(std::move(pending), [data = std::move(data)](const at::Tensor&) mutable { return std::move(data); });
  }
}
// Reductions of element types no backend reduces (see fold) gather and fold.
template <TensorLike T>
constexpr bool folded() {
  if constexpr (std::same_as<T, at::Tensor>) return false;
  else return !travels_natively<element_t<T>>();
}
template <TensorLike T>
auto start_fold_data(c10d::ProcessGroup& group, T data, ReduceOp op, const char* name) {
  if constexpr (Scalar<T>)
    return then(start_fold(group, std::vector<T>{data}, op, name), [](std::vector<T> v) { return v[0]; });
  else return start_fold(group, std::move(data), op, name);
}

template <TensorLike T>
auto start_all_reduce_data(c10d::ProcessGroup& group, T data, ReduceOp op) {
  if constexpr (folded<T>()) return start_fold_data(group, std::move(data), op, "all_reduce");
  else return start_in_place(std::move(data), [&](at::Tensor t) { return start_all_reduce(group, std::move(t), op); });
}
template <TensorLike T>
auto start_broadcast_data(c10d::ProcessGroup& group, T data, int src) {
  return start_in_place(std::move(data), [&](at::Tensor t) { return start_broadcast(group, std::move(t), src); });
}

// Reads `data` in place until it lands (the async form boxes a copy).
template <TensorLike T>
auto start_all_gather(c10d::ProcessGroup& group, const T& data) {
  if constexpr (std::same_as<T, at::Tensor>) {
    at::Tensor stacked =
        at::empty(stacked_shape(group.getSize(), data), data.options().memory_format(c10::MemoryFormat::Contiguous));
    auto pending = start_all_gather_rows(group, data, stacked);
    return then(std::move(pending), [stacked = std::move(stacked), input = data] { return stacked; });
  } else {
    std::vector<T> result(static_cast<std::size_t>(group.getSize()), data);  // slots of the right size
    std::vector<at::Tensor> outputs;
    for (auto& slot : result) outputs.push_back(memory_view(slot));
    // c10d only reads an allgather's input: a view of the caller's memory.
    auto pending = start_all_gather_into(group, memory_view(const_cast<T&>(data)), std::move(outputs));
    return then(std::move(pending), [result = std::move(result)]() mutable { return std::move(result); });
  }
}

inline auto start_send(c10d::ProcessGroup& group, const at::Tensor& tensor, int peer, int tag) {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor staged;
  if (tensor.numel() != 0) {
    const auto device = staging_device(group, tensor);
    staged = device ? tensor.to(*device).contiguous() : tensor.contiguous();
    std::vector<at::Tensor> tensors{backend_view(group, staged)};
    work = issue("send", group, [&] { return group.send(tensors, peer, tag); });
  }
  return Pending{&group, "send", std::move(work), [staged = std::move(staged)] {}};
}
inline auto start_recv(c10d::ProcessGroup& group, at::Tensor tensor, int peer, int tag) {
  InPlace s;
  c10::intrusive_ptr<c10d::Work> work;
  if (tensor.numel() != 0) {
    s = stage(group, tensor);
    std::vector<at::Tensor> tensors{s.c10d_tensor};
    work = issue("recv", group, [&] { return group.recv(tensors, peer, tag); });
  }
  return Pending{&group, "recv", std::move(work), [tensor = std::move(tensor), staged = std::move(s.staged)]() mutable {
                   land_in_place(tensor, staged, 1);
                   return std::move(tensor);
                 }};
}
// Reads `data` in place until it lands (the async form boxes a copy).
template <TensorLike T>
auto start_send_data(c10d::ProcessGroup& group, const T& data, int peer, int tag) {
  if constexpr (std::same_as<T, at::Tensor>) return start_send(group, data, peer, tag);
  else return start_send(group, memory_view(const_cast<T&>(data)), peer, tag);  // c10d only reads a send's tensor
}
template <TensorLike T>
auto start_recv_data(c10d::ProcessGroup& group, T data, int peer, int tag) {
  return start_in_place(std::move(data), [&](at::Tensor t) { return start_recv(group, std::move(t), peer, tag); });
}

// The checks every form of an operation makes before anything moves,
// ending with debug mode's; they return the group, or null where the
// operation is the identity (the process is not distributed).
template <TensorLike T>
c10d::ProcessGroup* enter_all_reduce(const T& data, ReduceOp op, const GroupPtr& group) {
  check_writable(data, "all_reduce");
  if constexpr (std::same_as<T, at::Tensor>) check_reduction(data.scalar_type(), op, "all_reduce");
  else if (op == ReduceOp::MEAN && std::is_integral_v<element_t<T>>) reject_integral_mean(value_dtype<element_t<T>>());
  c10d::ProcessGroup* g = resolve(group, "all_reduce");
  if (g) check_same_call(*g, [&] { return call_text("all_reduce", {describe_tensorlike(data), to_string(op)}); });
  return g;
}
template <TensorLike T>
c10d::ProcessGroup* enter_broadcast(const T& data, int src, const GroupPtr& group) {
  check_writable(data, "broadcast");
  c10d::ProcessGroup* g = resolve(group, "broadcast");
  check_source(g, src, "broadcast", "src");
  if (g)
    check_same_call(*g,
                    [&] { return call_text("broadcast", {describe_tensorlike(data), "src=" + std::to_string(src)}); });
  return g;
}
template <TensorLike T>
c10d::ProcessGroup* enter_all_gather(const T& data, const GroupPtr& group) {
  c10d::ProcessGroup* g = resolve(group, "all_gather");
  if (g) check_same_call(*g, [&] { return call_text("all_gather", {describe_tensorlike(data)}); });
  return g;
}
// Point-to-point: debug mode cannot compare the two sides (no collective runs).
inline c10d::ProcessGroup* enter_point_to_point(const GroupPtr& group, int peer, const char* op, const char* name) {
  c10d::ProcessGroup* g = resolve(group, op);
  if (!g)
    throw InvalidArgument(std::string("accel::") + op + ": the process is not distributed (there is no other rank)");
  check_peer(g, peer, op, name);
  return g;
}
}  // namespace detail

// Reduces data over the group. A tensor is reduced in place and returned; a
// std::vector travels as one collective. MEAN is SUM divided by the group size
// and is rejected for integral types.
template <TensorLike T>
T all_reduce(T data, ReduceOp op = ReduceOp::MEAN, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_reduce(data, op, group);
  if (!g) return data;
  if constexpr (std::same_as<T, at::Tensor>) {
    detail::all_reduce_tensor(*g, data, op);
  } else if constexpr (!detail::folded<T>()) {
    // A view of the caller's own elements, reduced where they are. It is
    // contiguous, on the CPU and in a dtype every backend reduces, so it never
    // needs the tensor path's staging (a file that calls all_reduce on a
    // number compiles none of it), except the visit to the GPU that NCCL needs.
    at::Tensor view = detail::memory_view(data);
    if (view.numel() == 0) return data;
#if ACCEL_WITH_NCCL
    if (const auto device = detail::staging_device(*g, view)) {
      at::Tensor staged = view.to(*device);
      detail::all_reduce_direct(*g, staged, op);
      view.copy_(staged);
      return data;
    }
#endif
    detail::all_reduce_direct(*g, view, op);
  } else {
    return detail::start_all_reduce_data(*g, std::move(data), op).wait();
  }
  return data;
}
template <TensorLike T>
Work<T> all_reduce_async(T data, ReduceOp op = ReduceOp::MEAN, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_reduce(data, op, group);
  if (!g) return Work<T>(detail::ready(g, "all_reduce", std::move(data)));
  return Work<T>(detail::start_all_reduce_data(*g, std::move(data), op));
}

// Copies data from rank `src` of the group (a rank within the group) to all.
template <TensorLike T>
T broadcast(T data, int src = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_broadcast(data, src, group);
  if (!g) return data;
  return detail::start_broadcast_data(*g, std::move(data), src).wait();
}
template <TensorLike T>
Work<T> broadcast_async(T data, int src = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_broadcast(data, src, group);
  if (!g) return Work<T>(detail::ready(g, "broadcast", std::move(data)));
  return Work<T>(detail::start_broadcast_data(*g, std::move(data), src));
}

// Gathers data from every rank of the group, stacked in rank order:
// a tensor of shape s gives (group_size, *s); a scalar gives std::vector<T>;
// a std::vector<T> gives std::vector<std::vector<T>>. Every rank passes the
// same shape.
template <TensorLike T>
auto all_gather(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_gather(data, group);
  if constexpr (std::same_as<T, at::Tensor>) {
    if (!g) return data.unsqueeze(0).clone();
  } else {
    if (!g) return std::vector<T>{data};
  }
  return detail::start_all_gather(*g, data).wait();
}
template <TensorLike T>
auto all_gather_async(const T& data, const GroupPtr& group = {}) {
  using R = decltype(all_gather(data, group));
  c10d::ProcessGroup* g = detail::enter_all_gather(data, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>)
      return Work<R>(detail::ready(g, "all_gather", data.unsqueeze(0).clone()));
    else return Work<R>(detail::ready(g, "all_gather", std::vector<T>{data}));
  }
  if constexpr (std::same_as<T, at::Tensor>) {
    return Work<R>(detail::start_all_gather(*g, data));
  } else {
    auto box = detail::copy_for_async(data);
    auto pending = detail::start_all_gather(*g, *box);
    return Work<R>(detail::keep_until_landed(std::move(pending), std::move(box)));
  }
}
// all_gather into a tensor the caller owns, of shape (group_size, *input's
// shape) with input's dtype and device: no allocation per call, for large
// tensors gathered again and again. Returns output.
inline at::Tensor& all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_gather_into_tensor");
  const auto expected = detail::stacked_shape(g ? g->getSize() : 1, input);
  if (output.sizes() != c10::IntArrayRef(expected) || output.scalar_type() != input.scalar_type() ||
      output.device() != input.device()) {
    std::ostringstream message;
    message << "accel::all_gather_into_tensor: output must have shape " << c10::IntArrayRef(expected) << ", dtype "
            << input.scalar_type() << " and device " << input.device() << "; got " << output.sizes() << ", "
            << output.scalar_type() << ", " << output.device();
    throw InvalidArgument(message.str());
  }
  if (!g) {
    at::NoGradGuard no_grad;
    output.select(0, 0).copy_(input);
  } else {
    detail::check_same_call(*g, [&] { return "all_gather_into_tensor(" + detail::describe_tensor(input) + ")"; });
    detail::start_all_gather_rows(*g, input, output, "all_gather_into_tensor").wait();
  }
  return output;
}

ACCEL_NAMESPACE_END

// == accel/distributed/all_to_all.hpp =========================================
// accel/distributed/all_to_all.hpp: all_to_all (even and uneven) and reduce_scatter, both on c10d's all-to-all.
//
// torch.distributed's all_to_all_single and reduce_scatter. One c10d
// all-to-all carries both: reduce_scatter sends each rank its part of
// every rank's data and folds what arrives (Gloo in LibTorch 1.13 has no
// reduce_scatter of its own). Ranks are ranks within the group; a tensor
// with zero elements moves nothing.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Folds the rows of `rows` (dim 0: one per rank) with op, in a dtype that
// holds the sum (float32 for the 16-bit and 8-bit floats, int64 for the
// integers, whose sum then wraps as the backend's would), back in rows' dtype.
// (check_reduction has rejected what is undefined.)
inline at::Tensor fold_rows(const at::Tensor& rows, ReduceOp op) {
  const c10::ScalarType dtype = rows.scalar_type();
  if (c10::isComplexType(dtype))
    return at::view_as_complex(fold_rows(at::view_as_real(rows.contiguous()), op).contiguous());
  if (dtype == c10::kBool) return op == ReduceOp::MIN ? rows.all(0) : rows.any(0);  // SUM: an or, as all_reduce
  const at::Tensor wide =
      rows.to(c10::isFloatingType(dtype) ? (dtype == c10::kDouble ? c10::kDouble : c10::kFloat) : c10::kLong);
  at::Tensor out;
  switch (op) {
    case ReduceOp::SUM: out = wide.sum(0); break;
    case ReduceOp::MEAN: out = wide.sum(0).div_(rows.size(0)); break;
    case ReduceOp::MAX: out = std::get<0>(wide.max(0)); break;
    case ReduceOp::MIN: out = std::get<0>(wide.min(0)); break;
  }
  return out.to(dtype);
}

inline std::vector<int64_t> equal_splits(int64_t rows, int parts) {
  return std::vector<int64_t>(static_cast<std::size_t>(parts), rows / parts);
}

inline void check_splits(const std::vector<int64_t>& splits, int size, const char* what, const char* op) {
  if (static_cast<int>(splits.size()) != size)
    throw InvalidArgument(std::string("accel::") + op + ": " + what + " has " + std::to_string(splits.size()) +
                          " entries; the group has " + std::to_string(size) + " ranks");
  for (int64_t s : splits)
    if (s < 0) throw InvalidArgument(std::string("accel::") + op + ": " + what + " holds a negative size");
}

// c10d's all-to-all of one tensor: all_to_all_single from LibTorch 2.15 on,
// which deprecates the older name alltoall_base (a -Werror build would fail
// on the warning). (A template, so that the requires-expression can fail.)
template <class Group>
c10::intrusive_ptr<c10d::Work> alltoall_single(Group& group, at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
  if constexpr (requires { group.all_to_all_single(out, in, out_splits, in_splits); })
    return group.all_to_all_single(out, in, out_splits, in_splits);
  else return group.alltoall_base(out, in, out_splits, in_splits);
}

// Rows of `input` (dim 0) go to the ranks in order, splits[r] rows to rank
// r; lands as the rows received, by source rank, out_splits[r] from rank r.
// One c10d all-to-all on a contiguous tensor (its bytes, for a dtype the
// backend lacks). Gloo divides by the rows of each side, so a side with no
// rows sends itself one phantom byte, removed on arrival. `into` (checked
// by the caller: the output's shape and dtype) receives the rows: directly
// where c10d can write it (contiguous, on the group's device), else
// through a staged copy.
inline auto start_all_to_all_rows(c10d::ProcessGroup& group, const at::Tensor& input, std::vector<int64_t> out_splits,
                                  std::vector<int64_t> in_splits, const char* op, const at::Tensor& into = {}) {
  at::NoGradGuard no_grad;
  const int rank = group.getRank();
  const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape[0] = out_rows;
  const auto device = staging_device(group, input);
  const c10::Device lands_on = device.value_or(input.device());
  const bool into_direct = into.defined() && into.is_contiguous() && into.device() == lands_on;
  at::Tensor output = into_direct ? into : at::empty(out_shape, input.options().device(lands_on));
  const int64_t row_bytes = c10::multiply_integers(input.sizes().slice(1)) * static_cast<int64_t>(input.element_size());
  const at::Tensor source = device ? input.to(*device).contiguous() : input.contiguous();
  const bool phantom = input.size(0) == 0 || out_rows == 0;
  const bool equal = std::all_of(in_splits.begin(), in_splits.end(), [&](int64_t s) { return s == in_splits[0]; }) &&
                     in_splits == out_splits;
  at::Tensor in_bytes, out_bytes;  // the uneven form's buffers
  int64_t out_at = 0;              // where this rank's own segment ends in the output
  c10::intrusive_ptr<c10d::Work> work;
  if (row_bytes == 0) {
    // rows of nothing, on every rank: nothing moves
  } else if (equal && !phantom) {  // the backend's plain alltoall (Gloo's alltoallv is slower), no split sizes
    std::vector<int64_t> none;
    at::Tensor in = backend_view(group, source), out = backend_view(group, output);
    work = issue(op, group, [&] { return alltoall_single(group, out, in, none, none); });
  } else {
    in_bytes = source.reshape({-1}).view(c10::kByte);
    out_bytes = output.reshape({-1}).view(c10::kByte);
    for (auto& s : in_splits) s *= row_bytes;
    for (auto& s : out_splits) s *= row_bytes;
    if (phantom) {
      int64_t in_at = 0;
      for (int r = 0; r <= rank; ++r) {
        in_at += in_splits[r];
        out_at += out_splits[r];
      }
      const at::Tensor one = at::zeros({1}, in_bytes.options());
      in_bytes = at::cat({in_bytes.narrow(0, 0, in_at), one, in_bytes.narrow(0, in_at, in_bytes.size(0) - in_at)});
      out_bytes = at::empty({out_bytes.size(0) + 1}, out_bytes.options());
      ++in_splits[rank];
      ++out_splits[rank];
    }
    work = issue(op, group, [&] { return alltoall_single(group, out_bytes, in_bytes, out_splits, in_splits); });
  }
  return Pending{
      &group, op, std::move(work),
      [output = std::move(output), source, in_bytes = std::move(in_bytes), out_bytes = std::move(out_bytes), phantom,
       out_at, home = input.device(), into] {
        at::NoGradGuard no_grad;
        if (phantom && out_bytes.defined()) {
          at::Tensor real = output.reshape({-1}).view(c10::kByte);
          real.narrow(0, 0, out_at).copy_(out_bytes.narrow(0, 0, out_at));
          real.narrow(0, out_at, real.size(0) - out_at).copy_(out_bytes.narrow(0, out_at + 1, real.size(0) - out_at));
        }
        if (into.defined()) return output.is_same(into) ? into : into.copy_(output);
        return output.device() == home ? output : output.to(home);
      }};
}

// A std::vector's bytes, split in group-size equal parts for all_to_all.
template <ScalarVector V>
auto start_all_to_all_vector(c10d::ProcessGroup& group, V data, const char* op) {
  const int size = group.getSize();
  at::Tensor bytes = alias_bytes(data).reshape({size, -1});
  auto pending = start_all_to_all_rows(group, bytes, equal_splits(size, size), equal_splits(size, size), op);
  return then(std::move(pending), [data = std::move(data)](const at::Tensor& received) mutable {
    if (!data.empty()) std::memcpy(data.data(), received.data_ptr(), data.size() * sizeof(element_t<V>));
    return std::move(data);
  });
}

// Part r of data reduced over the group, on rank r.
template <TensorLike T>
auto start_reduce_scatter(c10d::ProcessGroup& group, const T& data, ReduceOp op) {
  const int size = group.getSize();
  if constexpr (std::same_as<T, at::Tensor>) {
    const auto splits = equal_splits(data.size(0), size);
    std::vector<int64_t> rows_shape = data.sizes().vec();
    rows_shape[0] = data.size(0) / size;
    rows_shape.insert(rows_shape.begin(), size);
    return then(start_all_to_all_rows(group, data, splits, splits, "reduce_scatter"),
                [rows_shape = std::move(rows_shape), op](const at::Tensor& received) {
                  at::NoGradGuard no_grad;
                  return fold_rows(received.view(rows_shape), op);
                });
  } else {
    return then(start_all_to_all_vector(group, data, "reduce_scatter"), [op, size](const T& received) {
      const std::size_t part = received.size() / static_cast<std::size_t>(size);
      T out(part);
      for (std::size_t i = 0; i < part; ++i)
        out[i] = fold<element_t<T>>(op, received.data() + i, size, static_cast<int>(part));
      return out;
    });
  }
}

// The S rows of `rows` folded into `out`, which the caller keeps: a SUM
// of float or double in place, in the kernel fold_rows uses, so the result
// is the same; anything else as fold_rows does, copied in. (Also the fold
// of the sharding engine's point-to-point reduce-scatter, dp/scatter.hpp.)
inline void fold_rows_into(const at::Tensor& rows, at::Tensor& out, ReduceOp op) {
  at::NoGradGuard no_grad;
  const c10::ScalarType dtype = rows.scalar_type();
  const int64_t first = 0;  // (the dim folded)
  if (op == ReduceOp::SUM && (dtype == c10::kFloat || dtype == c10::kDouble))
    at::sum_out(out, rows, at::IntArrayRef(first));
  else out.copy_(fold_rows(rows, op));
}

// reduce_scatter of a 1-d tensor into buffers the caller keeps and reuses
// (the sharding engine's gradient buckets, dp/scatter.hpp): the all-to-all
// lands in `received` (data's size), and the fold of its S rows goes into
// `out` (data's size / S), by fold_rows_into.
inline auto start_reduce_scatter_into(c10d::ProcessGroup& group, const at::Tensor& data, const at::Tensor& received,
                                      const at::Tensor& out, ReduceOp op) {
  const int size = group.getSize();
  const auto splits = equal_splits(data.size(0), size);
  return then(start_all_to_all_rows(group, data, splits, splits, "reduce_scatter", received),
              [out = out, op, size](const at::Tensor& landed) mutable {
                fold_rows_into(landed.view({size, -1}), out, op);
                return out;
              });
}

template <TensorLike T>
  requires(!Scalar<T>)
c10d::ProcessGroup* enter_reduce_scatter(const T& data, ReduceOp op, const GroupPtr& group) {
  if constexpr (std::same_as<T, at::Tensor>) check_reduction(data.scalar_type(), op, "reduce_scatter");
  else if (op == ReduceOp::MEAN && std::is_integral_v<element_t<T>>)
    reject_integral_mean(value_dtype<element_t<T>>(), "reduce_scatter");
  c10d::ProcessGroup* g = resolve(group, "reduce_scatter");
  const int size = g ? g->getSize() : 1;
  if constexpr (std::same_as<T, at::Tensor>) {
    if (data.dim() == 0 || data.size(0) % size != 0)
      throw InvalidArgument("accel::reduce_scatter: dim 0 of " + describe_tensor(data) + " does not split into " +
                            std::to_string(size) + " equal parts");
  } else if (data.size() % static_cast<std::size_t>(size) != 0) {
    throw InvalidArgument("accel::reduce_scatter: " + std::to_string(data.size()) + " elements do not split into " +
                          std::to_string(size) + " equal parts");
  }
  if (g)
    check_same_call(
        *g, [&] { return "reduce_scatter(" + describe_tensorlike(data) + ", " + std::string(to_string(op)) + ")"; });
  return g;
}

template <TensorLike T>
  requires(!Scalar<T>)
c10d::ProcessGroup* enter_all_to_all(const T& data, const GroupPtr& group) {
  c10d::ProcessGroup* g = resolve(group, "all_to_all");
  const int size = g ? g->getSize() : 1;
  if constexpr (std::same_as<T, at::Tensor>) {
    if (data.dim() == 0 || data.size(0) % size != 0)
      throw InvalidArgument("accel::all_to_all: dim 0 of " + describe_tensor(data) + " does not split into " +
                            std::to_string(size) + " equal parts" + (g ? " (" + describe(*g) + ")" : std::string()));
  } else if (data.size() % static_cast<std::size_t>(size) != 0) {
    throw InvalidArgument("accel::all_to_all: " + std::to_string(data.size()) + " elements do not split into " +
                          std::to_string(size) + " equal parts" + (g ? " (" + describe(*g) + ")" : std::string()));
  }
  if (g) check_same_call(*g, [&] { return "all_to_all(" + describe_tensorlike(data) + ")"; });
  return g;
}

template <TensorLike T>
auto start_all_to_all(c10d::ProcessGroup& group, const T& data) {
  if constexpr (std::same_as<T, at::Tensor>) {
    const auto splits = equal_splits(data.size(0), group.getSize());
    return start_all_to_all_rows(group, data, splits, splits, "all_to_all");
  } else {
    return start_all_to_all_vector(group, data, "all_to_all");
  }
}

// The uneven all_to_all's checks: returns the split sizes to use.
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> check_all_to_all_splits(
    c10d::ProcessGroup* g, const at::Tensor& data, std::vector<int64_t> output_split_sizes,
    std::vector<int64_t> input_split_sizes) {
  const int size = g ? g->getSize() : 1;
  if (data.dim() == 0) throw InvalidArgument("accel::all_to_all: a 0-d tensor has no rows to split");
  if (input_split_sizes.empty()) {
    if (data.size(0) % size != 0)
      throw InvalidArgument("accel::all_to_all: dim 0 of " + describe_tensor(data) + " does not split into " +
                            std::to_string(size) + " equal parts; pass input_split_sizes");
    input_split_sizes = equal_splits(data.size(0), size);
  }
  if (output_split_sizes.empty()) output_split_sizes = equal_splits(data.size(0), size);
  check_splits(input_split_sizes, size, "input_split_sizes", "all_to_all");
  check_splits(output_split_sizes, size, "output_split_sizes", "all_to_all");
  if (const int64_t sum = std::accumulate(input_split_sizes.begin(), input_split_sizes.end(), int64_t{0});
      sum != data.size(0))
    throw InvalidArgument("accel::all_to_all: input_split_sizes add up to " + std::to_string(sum) +
                          ", but dim 0 of the input is " + std::to_string(data.size(0)));
  if (!g && output_split_sizes != input_split_sizes)
    throw InvalidArgument("accel::all_to_all: output_split_sizes differ from input_split_sizes on one process");
  if (g && checking_calls()) [[unlikely]] {
    verify_call(*g, "all_to_all(" + describe_tensor(data, 0) + ", split sizes)");
    // Every rank's sizes, so that every rank finds a disagreement alike.
    std::vector<int64_t> mine = input_split_sizes;
    mine.insert(mine.end(), output_split_sizes.begin(), output_split_sizes.end());
    std::vector<int64_t> all(mine.size() * static_cast<std::size_t>(size));
    all_gather_cpu<int64_t>(*g, mine.data(), static_cast<int64_t>(mine.size()), all.data(), "debug-mode check");
    for (int i = 0; i < size; ++i)
      for (int j = 0; j < size; ++j)
        if (const int64_t sent = all[static_cast<std::size_t>(i * 2 * size + j)],
            expected = all[static_cast<std::size_t>(j * 2 * size + size + i)];
            sent != expected)
          throw DistributedError("accel [ACCEL_DEBUG_MODE]: all_to_all on group '" + group_name(*g) + "': rank " +
                                 std::to_string(i) + " sends " + std::to_string(sent) + " rows to rank " +
                                 std::to_string(j) + ", which expects " + std::to_string(expected));
  }
  return {std::move(output_split_sizes), std::move(input_split_sizes)};
}

// all_to_all_single's output against what this rank receives: its rows,
// the input's row shape and dtype, writable, apart from the input.
inline void check_all_to_all_output(const at::Tensor& output, const at::Tensor& input,
                                    const std::vector<int64_t>& out_splits) {
  if (!output.defined()) throw InvalidArgument("accel::all_to_all_single: output is an undefined tensor");
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  if (output.sizes() != at::IntArrayRef(shape) || output.scalar_type() != input.scalar_type())
    throw InvalidArgument("accel::all_to_all_single: output is " + describe_tensor(output) +
                          ", but this rank receives " + c10::str(input.scalar_type(), at::IntArrayRef(shape)));
  check_no_overlap(output, "all_to_all_single");
  if (output.numel() > 0 && input.numel() > 0 && output.is_alias_of(input))
    throw InvalidArgument(
        "accel::all_to_all_single: output and input share memory; c10d reads one while writing the other");
}
}  // namespace detail

// Splits data along dim 0 (a std::vector: its elements) into group-size equal
// parts, reduces part r over the group and returns it on rank r. Built on
// one all_to_all and a local fold on every backend (Gloo in LibTorch 1.13
// has no reduce_scatter): each rank sends and receives (P-1)/P of the data,
// as a ring reduce_scatter does, never the whole of it.
template <TensorLike T>
  requires(!Scalar<T>)
T reduce_scatter(const T& data, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_reduce_scatter(data, op, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return data.clone();
    else return data;
  }
  return detail::start_reduce_scatter(*g, data, op).wait();
}
template <TensorLike T>
  requires(!Scalar<T>)
Work<T> reduce_scatter_async(const T& data, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_reduce_scatter(data, op, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return Work<T>(detail::ready(g, "reduce_scatter", data.clone()));
    else return Work<T>(detail::ready(g, "reduce_scatter", data));
  }
  return Work<T>(detail::start_reduce_scatter(*g, data, op));  // (its input is a copy, or a tensor kept alive)
}

// Splits data along dim 0 (a std::vector: its elements) into group-size equal
// parts and sends part r to rank r; returns the parts received, in rank order.
template <TensorLike T>
  requires(!Scalar<T>)
T all_to_all(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_to_all(data, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return data.clone();
    else return data;
  }
  return detail::start_all_to_all(*g, data).wait();
}
template <TensorLike T>
  requires(!Scalar<T>)
Work<T> all_to_all_async(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::enter_all_to_all(data, group);
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return Work<T>(detail::ready(g, "all_to_all", data.clone()));
    else return Work<T>(detail::ready(g, "all_to_all", data));
  }
  return Work<T>(detail::start_all_to_all(*g, data));
}

// Uneven all_to_all (torch's all_to_all_single with split sizes): rows
// input_split_sizes[r] of data go to rank r; output_split_sizes[r] rows come
// from rank r. An empty list means equal parts. The sizes must agree across
// ranks (rank i's input_split_sizes[j] is rank j's output_split_sizes[i]):
// debug mode checks that too.
inline at::Tensor all_to_all(const at::Tensor& data, std::vector<int64_t> output_split_sizes,
                             std::vector<int64_t> input_split_sizes, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_to_all");
  auto [out, in] =
      detail::check_all_to_all_splits(g, data, std::move(output_split_sizes), std::move(input_split_sizes));
  if (!g) return data.clone();
  return detail::start_all_to_all_rows(*g, data, std::move(out), std::move(in), "all_to_all").wait();
}
inline Work<at::Tensor> all_to_all_async(const at::Tensor& data, std::vector<int64_t> output_split_sizes,
                                         std::vector<int64_t> input_split_sizes, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_to_all");
  auto [out, in] =
      detail::check_all_to_all_splits(g, data, std::move(output_split_sizes), std::move(input_split_sizes));
  if (!g) return Work<at::Tensor>(detail::ready(g, "all_to_all", data.clone()));
  return Work<at::Tensor>(detail::start_all_to_all_rows(*g, data, std::move(out), std::move(in), "all_to_all"));
}

// torch's all_to_all_single(output, input, output_split_sizes,
// input_split_sizes): all_to_all (equal parts when the sizes are empty)
// into `output`, which the caller keeps from call to call: nothing is
// allocated for the result where c10d can write into it (contiguous, on
// the group's device). output holds the rows this rank receives, in the
// input's row shape and dtype; returns it (the _async form: its Work's
// result).
inline Work<at::Tensor> all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                                std::vector<int64_t> output_split_sizes = {},
                                                std::vector<int64_t> input_split_sizes = {},
                                                const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "all_to_all_single");
  auto [out, in] =
      detail::check_all_to_all_splits(g, input, std::move(output_split_sizes), std::move(input_split_sizes));
  detail::check_all_to_all_output(output, input, out);
  if (!g) {
    at::NoGradGuard no_grad;
    return Work<at::Tensor>(detail::ready(g, "all_to_all", output.copy_(input)));
  }
  return Work<at::Tensor>(
      detail::start_all_to_all_rows(*g, input, std::move(out), std::move(in), "all_to_all", output));
}
inline at::Tensor all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                                    std::vector<int64_t> output_split_sizes = {},
                                    std::vector<int64_t> input_split_sizes = {}, const GroupPtr& group = {}) {
  return all_to_all_single_async(output, input, std::move(output_split_sizes), std::move(input_split_sizes), group)
      .wait();
}

ACCEL_NAMESPACE_END

// == accel/distributed/direct_all_reduce.hpp ==================================
// accel/distributed/direct_all_reduce.hpp: a Gloo group's all-reduce point to point, for small tensors: a reduce-scatter then an all-gather, each one round of messages.
//
// Gloo's allreduce of a CPU tensor runs a ring: 2 (size - 1) steps, each
// waiting for a message from the rank before. For a large tensor the bytes
// are the cost and the ring moves the fewest; for a small one each step's
// latency is, and 6 steps at 4 ranks cost more than moving the bytes. Here
// the same bytes move in two rounds, every peer at once: a reduce-scatter
// (rank r receives chunk r of every rank's tensor and folds it) and an
// all-gather of the folded chunks. Each chunk is summed once, by the rank
// that owns it, in rank order (fold_rows_into), so every rank ends with the
// same bits; at 2 ranks the same bits as Gloo's (one addition, which
// commutes). The data-parallel engine takes it for its small buckets
// (dp/reducer.hpp says where the sizes cross over, measured).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The sum of `flat` (a contiguous 1-d CPU tensor, the same length on every
// rank) over a Gloo group, in place, in two phases. The first, the
// reduce-scatter, is issued here: chunk r (ceil(numel / size) elements,
// the last ones shorter or empty) goes to rank r, and this rank's chunk of
// every peer lands in its row of `rows` (size x ceil(numel / size), the
// caller's, reused across calls). Its Pending's wait() folds this rank's
// chunk into `flat` and issues the second phase, the all-gather, whose
// Pending it returns: that one's wait() gives `flat`, summed. Two phases
// so that a caller with several tensors in flight issues every second phase
// before waiting for any. `tag` as start_exchange_pieces' (every rank must
// issue the same exchanges in the same order under it).
inline auto start_all_reduce_direct(c10d::ProcessGroup& group, const at::Tensor& flat, const at::Tensor& rows,
                                    int tag) {
  const int size = group.getSize(), me = group.getRank();
  const int64_t n = flat.numel(), c = (n + size - 1) / size;
  auto chunk = [flat, n, c](int r) {
    const int64_t begin = std::min(r * c, n);
    return flat.narrow(0, begin, std::min(c, n - begin));
  };
  const int64_t mine = chunk(me).numel();
  auto scatter = start_exchange_pieces(
      group, 1, [&](int to, std::size_t) { return chunk(to); },
      [&](int from, std::size_t) { return rows[from].narrow(0, 0, mine); }, tag, kDirectAllReduce);
  return then(std::move(scatter), [g = &group, flat, rows, chunk, me, mine, tag] {
    at::Tensor own = chunk(me);
    if (mine > 0) {
      at::NoGradGuard no_grad;
      rows[me].narrow(0, 0, mine).copy_(own);
      fold_rows_into(rows.narrow(1, 0, mine), own, ReduceOp::SUM);
    }
    return then(start_exchange_pieces(
                    *g, 1, [&](int, std::size_t) { return own; }, [&](int from, std::size_t) { return chunk(from); },
                    tag, kDirectAllReduce),
                [flat] { return flat; });
  });
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/exchange.hpp ===========================================
// accel/distributed/exchange.hpp: reduce_to, gather_to, scatter, send/recv, barriers.
//
// The rest of torch.distributed: reduce_to, gather_to, scatter, send, recv,
// monitored_barrier (all_to_all and reduce_scatter: all_to_all.hpp). Ranks
// (src, dst) are ranks within the group; a tensor with zero elements moves
// nothing.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The device a group's collectives run on: the current CUDA device for an
// NCCL group, else the CPU.
inline c10::Device group_device([[maybe_unused]] const c10d::ProcessGroup& group) {
#if ACCEL_WITH_NCCL
  if (group.getBackendName() == "nccl") return get_current_device();
#endif
  return c10::Device(c10::kCPU);
}

template <TensorLike T>
auto start_reduce_data(c10d::ProcessGroup& group, T data, ReduceOp op, int dst) {
  if constexpr (folded<T>()) return start_fold_data(group, std::move(data), op, "reduce_to");  // one gather
  else return start_in_place(std::move(data), [&](at::Tensor t) { return start_reduce(group, std::move(t), op, dst); });
}
}  // namespace detail

// Reduces data over the group onto rank `dst` (a rank within the group) and
// returns it there; on the other ranks the returned value is unspecified
// (as torch.distributed.reduce leaves it). A tensor is reduced in place.
template <TensorLike T>
T reduce_to(T data, int dst, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  detail::check_writable(data, "reduce_to");
  if constexpr (std::same_as<T, at::Tensor>) detail::check_reduction(data.scalar_type(), op, "reduce_to");
  else if (op == ReduceOp::MEAN && std::is_integral_v<detail::element_t<T>>)
    detail::reject_integral_mean(detail::value_dtype<detail::element_t<T>>(), "reduce_to");
  c10d::ProcessGroup* g = detail::resolve(group, "reduce_to");
  detail::check_source(g, dst, "reduce_to", "dst");
  if (!g) return data;
  detail::check_same_call(*g, [&] {
    return "reduce_to(" + detail::describe_tensorlike(data) + ", dst=" + std::to_string(dst) + ", " +
           std::string(to_string(op)) + ")";
  });
  return detail::start_reduce_data(*g, std::move(data), op, dst).wait();
}

// Gathers data from every rank onto rank `dst`, stacked as all_gather does:
// a tensor of shape s gives (group_size, *s) on dst and an empty tensor
// elsewhere; a scalar or std::vector gives one entry per rank on dst and an
// empty std::vector elsewhere. Only dst receives anything.
template <TensorLike T>
auto gather_to(const T& data, int dst, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "gather_to");
  detail::check_source(g, dst, "gather_to", "dst");
  if (!g) return all_gather(data, group);
  detail::check_same_call(
      *g, [&] { return "gather_to(" + detail::describe_tensorlike(data) + ", dst=" + std::to_string(dst) + ")"; });
  const int size = g->getSize();
  const bool root = g->getRank() == dst;
  at::NoGradGuard no_grad;
  auto gather_into = [&](const at::Tensor& input, const std::vector<at::Tensor>& outputs) {
    if (input.numel() == 0) return;  // nothing to move
    const auto device = detail::staging_device(*g, input);
    std::vector<at::Tensor> inputs{
        detail::backend_view(*g, device ? input.to(*device).contiguous() : input.contiguous())};
    std::vector<at::Tensor> staged;
    std::vector<std::vector<at::Tensor>> lists;
    if (root) {
      for (const auto& t : outputs) staged.push_back(at::empty(t.sizes(), inputs[0].options().dtype(t.scalar_type())));
      lists.emplace_back();
      for (const auto& t : staged) lists[0].push_back(detail::backend_view(*g, t));
    }
    c10d::GatherOptions opts;
    opts.rootRank = dst;
    detail::run("gather_to", *g, [&] { return g->gather(lists, inputs, opts); });
    for (std::size_t r = 0; r < staged.size(); ++r) outputs[r].copy_(staged[r]);
  };
  if constexpr (std::same_as<T, at::Tensor>) {
    if (!root) {
      gather_into(data, {});
      return at::empty({0}, data.options());
    }
    at::Tensor stacked =
        at::empty(detail::stacked_shape(size, data), data.options().memory_format(c10::MemoryFormat::Contiguous));
    std::vector<at::Tensor> rows;
    for (int r = 0; r < size; ++r) rows.push_back(stacked.select(0, r));
    gather_into(data, rows);
    return stacked;
  } else {
    std::vector<T> result(root ? static_cast<std::size_t>(size) : 0, data);
    std::vector<at::Tensor> outputs;
    for (auto& slot : result) outputs.push_back(detail::memory_view(slot));
    gather_into(detail::memory_view(const_cast<T&>(data)), outputs);  // c10d only reads a gather's input
    return result;
  }
}

namespace detail {
// scatter's tensor form: src first broadcasts a header (dtype, rank and
// sizes, or -1 when its parts disagree), so that every rank can allocate
// its output.
inline at::Tensor scatter_tensor(c10d::ProcessGroup& group, const std::vector<at::Tensor>& parts_on_src, int src,
                                 bool root) {
  // The header: dtype, rank and sizes (or -1 and why, when the parts disagree).
  constexpr int kMaxDims = 64;
  std::array<int64_t, 2 + kMaxDims> header{};
  if (root) {
    const at::Tensor& first = parts_on_src[0];
    header[0] = static_cast<int64_t>(first.scalar_type());
    header[1] = first.dim();
    for (const auto& part : parts_on_src)
      if (!part.defined() || part.sizes() != first.sizes() || part.scalar_type() != first.scalar_type() ||
          part.device() != first.device() || first.dim() > kMaxDims)
        header[1] = -1;
    for (int64_t d = 0; d < std::min<int64_t>(first.dim(), kMaxDims); ++d) header[2 + d] = first.size(d);
  }
  at::Tensor header_view = at::from_blob(header.data(), {2 + kMaxDims}, cpu_options(c10::kLong));
  broadcast_tensor(group, header_view, src);
  if (header[1] < 0)
    throw InvalidArgument("accel::scatter: the parts on the source (rank " + std::to_string(src) + " of " +
                          describe(group) +
                          ") must all be defined and share one shape, dtype and device"
                          " (at most 64 dimensions)");
  const auto dtype = static_cast<c10::ScalarType>(header[0]);
  const std::vector<int64_t> shape(header.begin() + 2, header.begin() + 2 + header[1]);
  const c10::Device device = root ? parts_on_src[0].device() : group_device(group);
  at::Tensor output = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  if (output.numel() == 0) return output;
  const auto staging = staging_device(group, output);
  at::Tensor target = staging ? at::empty(shape, output.options().device(*staging)) : output;
  std::vector<at::Tensor> outputs{backend_view(group, target)};
  std::vector<std::vector<at::Tensor>> inputs;
  if (root) {
    inputs.emplace_back();
    for (const auto& part : parts_on_src)
      inputs[0].push_back(backend_view(group, staging ? part.to(*staging).contiguous() : part.contiguous()));
  }
  c10d::ScatterOptions opts;
  opts.rootRank = src;
  run("scatter", group, [&] { return group.scatter(outputs, inputs, opts); });
  if (staging) output.copy_(target);
  return output;
}
// scatter's scalar and std::vector forms: bytes, each part with its length.
template <TensorLike T>
T scatter_values(c10d::ProcessGroup& group, const std::vector<T>& parts_on_src, int src, bool root) {
  using E = element_t<T>;
  std::vector<std::vector<char>> pieces;
  if (root)
    for (const auto& part : parts_on_src) {
      if constexpr (Scalar<T>) {
        const auto* bytes = reinterpret_cast<const char*>(&part);
        pieces.emplace_back(bytes, bytes + sizeof(T));
      } else {
        const auto* bytes = reinterpret_cast<const char*>(part.data());
        pieces.emplace_back(bytes, bytes + part.size() * sizeof(E));
      }
    }
  std::vector<char> mine = scatter_bytes(group, src, pieces, "scatter");
  if (root) mine = pieces[static_cast<std::size_t>(src)];
  T out{};
  if constexpr (Scalar<T>) {
    std::memcpy(&out, mine.data(), sizeof(T));
  } else {
    out.resize(mine.size() / sizeof(E));
    if (!mine.empty()) std::memcpy(out.data(), mine.data(), mine.size());
  }
  return out;
}
}  // namespace detail

// Rank `src` sends parts_on_src[r] to rank r of the group; every rank returns
// its own part. Only src reads parts_on_src (the others may pass {}); src
// tells the others the shape and dtype first (tensors: one small broadcast;
// scalars and std::vectors travel with their lengths, which may differ).
template <TensorLike T>
T scatter(const std::vector<T>& parts_on_src, int src, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "scatter");
  detail::check_source(g, src, "scatter", "src");
  const int size = g ? g->getSize() : 1;
  const bool root = !g || g->getRank() == src;
  if (root && static_cast<int>(parts_on_src.size()) != size)
    throw InvalidArgument("accel::scatter: the source passes " + std::to_string(parts_on_src.size()) +
                          " parts; the group has " + std::to_string(size) + " ranks");
  if (!g) {
    if constexpr (std::same_as<T, at::Tensor>) return parts_on_src[0].clone();
    else return parts_on_src[0];
  }
  detail::check_same_call(*g, [&] {
    if constexpr (std::same_as<T, at::Tensor>) return "scatter(tensor, src=" + std::to_string(src) + ")";
    else if constexpr (Scalar<T>) return "scatter(" + detail::type_tag<T>() + ", src=" + std::to_string(src) + ")";
    else return "scatter(vector<" + detail::type_tag<detail::element_t<T>>() + ">, src=" + std::to_string(src) + ")";
  });
  at::NoGradGuard no_grad;
  if constexpr (std::same_as<T, at::Tensor>) return detail::scatter_tensor(*g, parts_on_src, src, root);
  else return detail::scatter_values(*g, parts_on_src, src, root);
}

// Sends data to rank `dst` of the group, which receives it with recv (the
// same tag, the same shape and dtype). Point-to-point: debug mode cannot
// compare the two sides (no collective runs).
template <TensorLike T>
void send(const T& data, int dst, const GroupPtr& group = {}, int tag = 0) {
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, dst, "send", "dst");
  detail::start_send_data(*g, data, dst, tag).wait();
}
template <TensorLike T>
Work<void> isend(const T& data, int dst, const GroupPtr& group = {}, int tag = 0) {
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, dst, "send", "dst");
  if constexpr (std::same_as<T, at::Tensor>) {
    return Work<void>(detail::start_send_data(*g, data, dst, tag));  // keeps a contiguous copy or the tensor itself
  } else {
    auto box = detail::copy_for_async(data);
    auto pending = detail::start_send_data(*g, *box, dst, tag);
    return Work<void>(detail::keep_until_landed(std::move(pending), std::move(box)));
  }
}

// Receives into data (which gives the shape and dtype, or the size of a
// std::vector) from rank `src` of the group, and returns it (a tensor: in place).
template <TensorLike T>
T recv(T data, int src, const GroupPtr& group = {}, int tag = 0) {
  detail::check_writable(data, "recv");
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, src, "recv", "src");
  return detail::start_recv_data(*g, std::move(data), src, tag).wait();
}
template <TensorLike T>
Work<T> irecv(T data, int src, const GroupPtr& group = {}, int tag = 0) {
  detail::check_writable(data, "recv");
  c10d::ProcessGroup* g = detail::enter_point_to_point(group, src, "recv", "src");
  return Work<T>(detail::start_recv_data(*g, std::move(data), src, tag));
}

// A barrier that names the ranks that did not arrive within the timeout
// (default: the group's), instead of waiting on them for ever: Gloo groups
// only, as in torch.distributed.
inline void monitored_barrier(const GroupPtr& group = {},
                              std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
  c10d::ProcessGroup* g = detail::resolve(group, "monitored_barrier");
  if (!g) return;
  if (g->getBackendName() != "gloo")
    throw InvalidArgument("accel::monitored_barrier: needs a Gloo group; " + detail::describe(*g) +
                          " is not (as in torch.distributed)");
  detail::check_same_call(*g, [] { return std::string("monitored_barrier()"); });
  c10d::BarrierOptions opts;
  if (timeout) opts.timeout = *timeout;
  try {
    g->monitoredBarrier(opts, /*wait_all_ranks=*/true);
  } catch (const std::exception& e) {
    throw DistributedError("accel::monitored_barrier failed on " + detail::describe(*g) +
                           " (ranks within the group): " + detail::error_text(e));
  }
}

// Blocks until every rank of the group (default: the world) arrives.
inline void barrier(const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "barrier");
  if (!g) return;
  detail::check_same_call(*g, [] { return std::string("barrier()"); });
  detail::run("barrier", *g, [&] { return g->barrier(); });
}

// Runs body on the main process (local rank 0, or global rank 0 when
// local_only is false) first, then on the others, and returns its result.
// If the main process throws, it still releases the others, which then throw
// DistributedError instead of running body on a state the main failed to make.
template <class Body>
std::invoke_result_t<Body&> main_process_first(Body&& body, bool local_only = true) {
  c10d::ProcessGroup* world = detail::resolve({}, "main_process_first");
  if (!world) return std::invoke(body);
  auto g = GroupPtr::unsafe_reclaim_from_nonowning(world);
  const bool is_main = local_only ? get_local_rank() == 0 : get_rank() == 0;
  // One all_reduce releases the others and tells them whether (and which)
  // main process failed: MAX of rank+1 over the failing mains, 0 if none.
  auto release = [&](int64_t failed_rank_plus_one) { return all_reduce(failed_rank_plus_one, ReduceOp::MAX, g); };
  using R = std::invoke_result_t<Body&>;
  if (is_main) {
    std::exception_ptr failure;
    if constexpr (std::is_void_v<R>) {
      try {
        std::invoke(body);
      } catch (...) {
        failure = std::current_exception();
      }
      release(failure ? get_rank() + 1 : 0);
      if (failure) std::rethrow_exception(failure);
    } else {
      std::optional<R> result;
      try {
        result.emplace(std::invoke(body));
      } catch (...) {
        failure = std::current_exception();
      }
      release(failure ? get_rank() + 1 : 0);
      if (failure) std::rethrow_exception(failure);
      return std::move(*result);
    }
  } else {
    if (int64_t failed = release(0); failed != 0)
      throw DistributedError("accel::main_process_first: the main process (rank " + std::to_string(failed - 1) +
                             ") threw; this rank did not run the body");
    return std::invoke(body);
  }
}

ACCEL_NAMESPACE_END

// == accel/distributed/backends.hpp ===========================================
// accel/distributed/backends.hpp: one c10d process group made on either LibTorch generation, over a store.
//
// The c10d backends' constructors and options changed between LibTorch 1.x
// and 2.x; make_group hides that, and picks the network interface Gloo
// binds (loopback when every rank is on this host).

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline std::atomic<int>& groups_created() {  // per process, for tests and benchmarks
  static std::atomic<int> count{0};
  return count;
}

// Constructs a c10d backend and returns it as a ProcessGroup: in 1.x the
// backends are ProcessGroups; from 2.0 on they are c10d::Backend, wrapped in
// a ProcessGroup bound to their device type.
template <class Impl, class Options>
GroupPtr new_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   c10::intrusive_ptr<Options> options, [[maybe_unused]] c10::DeviceType device,
                   [[maybe_unused]] std::chrono::milliseconds timeout) {
  ++groups_created();
  auto backend = c10::make_intrusive<Impl>(store, rank, size, options);
#if ACCEL_TORCH_AT_LEAST(2, 0)
  const auto type =
      device == c10::DeviceType::CUDA ? c10d::ProcessGroup::BackendType::NCCL : c10d::ProcessGroup::BackendType::GLOO;
  // 2.6 dropped ProcessGroup::Options from the constructor (the backend
  // carries its own options and timeout).
  // (Group is ProcessGroup, dependent so that only the taken branch is compiled.)
  using Group = std::conditional_t<sizeof(Impl) != 0, c10d::ProcessGroup, void>;
  c10::intrusive_ptr<Group> group;
  if constexpr (std::is_constructible_v<Group, c10::intrusive_ptr<c10d::Store>, int, int>)
    group = c10::make_intrusive<Group>(store, rank, size);
  else
    group = c10::make_intrusive<Group>(
        store, rank, size, c10::make_intrusive<typename Group::Options>(backend->getBackendName(), timeout));
  group->setBackend(device, type, backend);
  // Gloo reduces CUDA tensors too (through the host), as Python's gloo
  // groups do ("cpu:gloo,cuda:gloo"): without this, a CUDA tensor on a gloo
  // group fails with "No backend type associated with device type cuda".
  if (type == c10d::ProcessGroup::BackendType::GLOO && device != c10::DeviceType::CUDA)
    group->setBackend(c10::DeviceType::CUDA, type, backend);
  group->setDefaultBackend(type);
  return group;
#else
  return backend;
#endif
}

inline bool all_ranks_local() { return get_local_world_size() == get_world_size(); }

// The local IP address the kernel would send from to reach `host` (a UDP
// connect sends nothing); nullopt when it cannot tell.
inline std::optional<std::string> local_address_towards(const std::string& host) {
#if defined(__linux__)
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || !found) return std::nullopt;
  std::optional<std::string> result;
  for (addrinfo* a = found; a && !result; a = a->ai_next) {
    const int fd = socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char text[INET6_ADDRSTRLEN] = {};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* ip = local.ss_family == AF_INET
                           ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
                           : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, ip, text, sizeof text)) result = text;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return result;
#else
  (void)host;
  return std::nullopt;
#endif
}

inline GroupPtr make_group(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout) {
  if (backend == "gloo") {
#if ACCEL_HAS_GLOO
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    if (auto ifnames = getenv_str("GLOO_SOCKET_IFNAME")) {
      std::stringstream list(*ifnames);
      for (std::string name; std::getline(list, name, ',');)
        if (!name.empty()) options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    } else if (all_ranks_local()) {
      // Every rank on this host: loopback is always reachable and exposes
      // nothing to the network.
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else if (auto address = local_address_towards(getenv_str("MASTER_ADDR").value_or("127.0.0.1"))) {
      // The address this host uses to reach MASTER_ADDR reaches the others
      // too (the hostname Gloo would resolve by default may not).
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(*address));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    return new_group<c10d::ProcessGroupGloo>(store, rank, size, options, c10::DeviceType::CPU, timeout);
#else
    throw RuntimeError(
        "accel: the gloo backend needs the Gloo headers when compiling, and this program was compiled without "
        "them (PyPI's torch wheels and pytorch.org's zips ship none; Debian/Ubuntu: libgloo-dev)");
#endif
  }
  if (backend == "nccl") {
#if ACCEL_WITH_NCCL
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return new_group<c10d::ProcessGroupNCCL>(store, rank, size, options, c10::DeviceType::CUDA, timeout);
#else
    throw RuntimeError(
        "accel: the nccl backend is not available in this build "
        "(CPU LibTorch or no <nccl.h>); set ACCEL_BACKEND=gloo");
#endif
  }
  throw RuntimeError("accel: process-group backend '" + backend + "' is not supported by accel.hpp (use gloo or nccl)");
}

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/rendezvous.hpp =========================================
// accel/distributed/rendezvous.hpp: rendezvous: the store ranks meet on, and agreeing on the world.
//
// How ranks meet (a c10d store: FileStore, TCPStore, or torchrun's agent
// store) and agree on the world before building anything; the groups are
// made over the store afterwards (distributed/make_groups.hpp).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A c10d::TCPStore. From 2.4 on LibTorch serves it with libuv by default
// (TCPStoreOptions::useLibUV), which only builds made with libuv have
// (pytorch.org and pip: yes; Debian: no), and the check for it fails every
// rank. As in Python, USE_LIBUV=0/1 decides when set; unset, libuv where the
// build has it and the classic server where it does not (LibTorch's own
// availability check is not exported, so the first try tells). Before 2.4
// there is only the classic server.
template <class Options>
c10::intrusive_ptr<c10d::Store> tcp_store(const std::string& host, Options options) {
  const auto use = getenv_str("USE_LIBUV");
  if (use && *use != "0" && *use != "1") throw InvalidArgument("USE_LIBUV=" + *use + " (expected 0 or 1)");
  if constexpr (requires { options.useLibUV; }) {
    static std::atomic<bool> build_has_libuv{true};
    options.useLibUV = use ? *use == "1" : build_has_libuv.load();
    if (!use && options.useLibUV) {
      try {
        return c10::make_intrusive<c10d::TCPStore>(host, options);
      } catch (const std::exception& e) {
        if (std::string_view(e.what()).find("without libuv") == std::string_view::npos) throw;
        build_has_libuv = false;
        options.useLibUV = false;
      }
    }
  }
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

// The rendezvous store lives for the whole process: a later instance() after
// destroy() reuses it (with a fresh key prefix) instead of racing rank 0's
// closing and re-opening of MASTER_PORT.
//
// Where every rank is on this host and ACCEL_STORE_DIR names a directory
// (accel::spawn and accel_launch make a private one), the store is a
// c10d::FileStore in it: a local run then opens no TCP port at all. Else a
// c10d::TCPStore served by rank 0 at MASTER_ADDR:MASTER_PORT, except under
// torchrun, whose agent already serves one there and says so with
// TORCHELASTIC_USE_AGENT_STORE=True: then every rank is a client (as Python's
// _create_c10d_store), and the keys of each restart attempt
// (TORCHELASTIC_RESTART_COUNT) are kept apart in case the store outlives it.
// Where the store is, read from the environment on the calling thread (a
// malformed MASTER_PORT or ACCEL_STORE_DIR fails here, before any wait).
struct StoreAddress {
  std::optional<std::string> dir;  // a FileStore in it, else a TCPStore
  bool agent_store = false;
  std::string host;
  int port = 0;
  std::string where;  // for errors
};
inline StoreAddress store_address() {
  StoreAddress a;
  a.dir = getenv_str("ACCEL_STORE_DIR");
  if (a.dir && !all_ranks_local()) a.dir.reset();
  a.agent_store = !a.dir && getenv_str("TORCHELASTIC_USE_AGENT_STORE") == "True";
  a.host = getenv_str("MASTER_ADDR").value_or("127.0.0.1");
  a.port = a.dir ? 0 : env_int("MASTER_PORT", 29500, 0);
  if (a.port > 65535) throw InvalidArgument("accel: MASTER_PORT=" + std::to_string(a.port) + " is not a TCP port");
  a.where = a.dir ? "file store " + *a.dir + "/store" : a.host + ":" + std::to_string(a.port);
  if (a.dir) {
    struct stat info{};
    if (stat(a.dir->c_str(), &info) != 0 || !S_ISDIR(info.st_mode))
      throw InvalidArgument("ACCEL_STORE_DIR=" + *a.dir + " is not a directory");
    if (info.st_uid != geteuid() || (info.st_mode & 077) != 0)
      throw InvalidArgument("ACCEL_STORE_DIR=" + *a.dir +
                            " must be private (owned by this user, mode 0700): other users could join");
  }
  return a;
}

struct KeptStore {
  std::string where;
  int rank = 0, world = 0;
  c10::intrusive_ptr<c10d::Store> store;
  int generation = 0;  // of key prefixes handed out
  int epoch = 0;       // bumped when a store is forgotten
};
struct RendezvousState {
  std::mutex mutex;  // held for bookkeeping only, never across a store operation
  KeptStore kept;
};
inline RendezvousState& rendezvous_state() {
  static RendezvousState state;
  return state;
}
// Drops the kept store (one that stopped answering): the next rendezvous
// connects afresh, and a connection still under way is not kept.
inline void forget_rendezvous() {
  auto& state = rendezvous_state();
  std::lock_guard lock(state.mutex);
  state.kept.store.reset();
  ++state.kept.epoch;
}

// A TCPStore at the address: the server (rank 0, unless torchrun's agent
// serves) or a client. No wait for the workers here: the arrival after it
// waits, and can say who is missing.
inline c10::intrusive_ptr<c10d::Store> tcp_connection(const StoreAddress& a, bool serve, int world,
                                                      std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(a.port);
  options.isServer = serve;
  options.numWorkers = static_cast<std::size_t>(world);
  options.waitWorkers = false;
  options.timeout = timeout;
  return tcp_store(a.host, options);
}

// How long past the timeout a store call that c10d does not bound (see
// run_within) may take before it is abandoned as hung.
inline constexpr std::chrono::seconds kStoreGrace{5};

// A further client connection (a group's own, see make_groups), within the
// timeout: LibTorch 2.x's client waits for the server's answer while
// connecting, for ever if the serving rank stopped after the rendezvous.
inline c10::intrusive_ptr<c10d::Store> bounded_connection(const StoreAddress& a, int world,
                                                          std::chrono::milliseconds timeout) {
  auto store = run_within<c10::intrusive_ptr<c10d::Store>>(
      timeout + kStoreGrace, [a, world, timeout] { return tcp_connection(a, /*serve=*/false, world, timeout); });
  if (!store)
    throw DistributedError("accel: a group's connection to the store at " + a.where + " got no answer within " +
                           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()) +
                           " s (the timeout) + " + std::to_string(kStoreGrace.count()) +
                           " s: is the process serving it (rank 0, or torchrun's agent) hung or stopped?");
  return *store;
}

// The kept store, or a new connection (which LibTorch 2.x's TCPStore client
// makes by waiting for the server's answer, without a timeout), and a fresh
// key prefix.
inline c10::intrusive_ptr<c10d::Store> connect(const StoreAddress& a, int rank, int world,
                                               std::chrono::milliseconds timeout, std::string& prefix) {
  auto& state = rendezvous_state();
  std::unique_lock lock(state.mutex);
  KeptStore& kept = state.kept;
  if (!kept.store || kept.where != a.where || kept.rank != rank || kept.world != world) {
    const int epoch = kept.epoch;
    lock.unlock();
    c10::intrusive_ptr<c10d::Store> store;
    try {
      if (a.dir) {
        store = c10::make_intrusive<c10d::FileStore>(*a.dir + "/store", world);
      } else {
        store = tcp_connection(a, /*serve=*/rank == 0 && !a.agent_store, world, timeout);
      }
    } catch (const std::exception& e) {
      throw DistributedError("accel: rendezvous at " + a.where + " failed for rank " + std::to_string(rank) + " of " +
                             std::to_string(world) + (a.dir ? " (ACCEL_STORE_DIR)" : " (MASTER_ADDR/MASTER_PORT)") +
                             ": " + error_text(e));
    }
    lock.lock();
    if (kept.epoch != epoch) throw DistributedError("accel: rendezvous at " + a.where + " was abandoned");
    kept.store = std::move(store);
    kept.where = a.where;
    kept.rank = rank;
    kept.world = world;
  }
  kept.store->setTimeout(timeout);
  prefix = "accel/";
  if (a.agent_store) prefix += "attempt_" + std::to_string(env_int("TORCHELASTIC_RESTART_COUNT", 0, 0)) + "/";
  prefix += std::to_string(kept.generation++) + "/";
  return kept.store;
}
// The rendezvous protocol, on a fresh key prefix: every rank arrives before
// any creates a group, so none is still tearing down the groups of a
// previous initialisation (after destroy()) while the others connect. Every
// rank must believe in the same world size: the first to arrive records its
// own; one that disagrees tells everyone (the others find the note after the
// arrival wait) and fails at once. Debug mode must be alike on every rank
// (it adds collectives). Four store round trips; on timeout the error names
// the ranks that never arrived.
inline void wait_for_every_rank(c10d::Store& store, const std::string& prefix, int rank, int world, bool debug,
                                std::chrono::seconds timeout) {
  const std::string mine = std::to_string(world);
  const std::vector<uint8_t> bytes(mine.begin(), mine.end());
  if (const std::vector<uint8_t> first = store.compareSet(prefix + "world_size", {}, bytes); first != bytes) {
    const std::string text = "rank " + std::to_string(rank) + " believes WORLD_SIZE=" + mine +
                             " but a rank before it believes WORLD_SIZE=" + std::string(first.begin(), first.end()) +
                             "; every rank must be started with the same world size";
    store.set(prefix + "mismatch", std::vector<uint8_t>(text.begin(), text.end()));
    store.set(prefix + "all_arrived", std::vector<uint8_t>{1});
    throw InvalidArgument(text);
  }
  store.set(prefix + "arrived/" + std::to_string(rank), std::vector<uint8_t>{1});
  store.add(prefix + "debug", debug ? 1 : 0);
  if (store.add(prefix + "arrived", 1) == world) store.set(prefix + "all_arrived", std::vector<uint8_t>{1});
  try {
    store.wait({prefix + "all_arrived"});
  } catch (const std::exception& e) {
    // How many are missing is one counter read; who, the first 16 found (a
    // round trip per rank looked at, so a huge WORLD_SIZE reports at once).
    const int64_t count = world - store.add(prefix + "arrived", 0);
    std::string missing;
    int64_t named = 0;
    for (int r = 0; r < world && named < std::min<int64_t>(count, 16); ++r)
      if (!store.check({prefix + "arrived/" + std::to_string(r)})) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        ++named;
      }
    if (count > named) missing += ", ...";
    throw DistributedError("accel: rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) +
                           " s (the timeout) at the rendezvous, but " + std::to_string(count) + " of " +
                           std::to_string(world) + " ranks never arrived (rank" + (count > 1 ? "s " : " ") + missing +
                           "): were they started, with the same MASTER_ADDR/MASTER_PORT? (" + error_text(e) + ")");
  }
  if (store.check({prefix + "mismatch"})) {
    const std::vector<uint8_t> text = store.get(prefix + "mismatch");
    throw InvalidArgument(std::string(text.begin(), text.end()));
  }
  if (const int64_t in_debug = store.add(prefix + "debug", 0); in_debug != 0 && in_debug != world)
    throw InvalidArgument("debug mode is on in " + std::to_string(in_debug) + " of " + std::to_string(world) +
                          " ranks (here: " + (debug ? "on" : "off") + "); set ACCEL_DEBUG_MODE alike on every rank");
}

// The store (kept from an earlier rendezvous, or connected now) and a fresh
// key prefix, after wait_for_every_rank(): all within the timeout (plus 5 s), whatever the
// store does. c10d's store clients wait for an answer without a timeout of
// their own (a TCPStore client connecting to, or a compareSet sent to, a
// serving rank that is stopped never returns), so the work runs on a thread
// of its own (run_within), abandoned (with the kept store) when it overruns.
struct Rendezvoused {
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;
};
inline Rendezvoused rendezvous(const StoreAddress& address, int rank, int world, bool debug,
                               std::chrono::seconds timeout) {
  auto connected = std::make_shared<std::atomic<bool>>(false);
  std::optional<Rendezvoused> met =
      run_within<Rendezvoused>(timeout + kStoreGrace, [address, rank, world, debug, timeout, connected] {
        Rendezvoused made;
        made.store = connect(address, rank, world, timeout, made.prefix);
        connected->store(true);
        wait_for_every_rank(*made.store, made.prefix, rank, world, debug, timeout);
        return made;
      });
  if (!met) {
    forget_rendezvous();
    // Still connecting: an unreachable address, or (LibTorch 2.x validates
    // the connection) a server that does not answer; both are a failed
    // rendezvous. Connected: the server stopped answering.
    const std::string late = " did not answer rank " + std::to_string(rank) + " within the timeout (" +
                             std::to_string(timeout.count()) + " s + " + std::to_string(kStoreGrace.count()) + " s)";
    if (!connected->load())
      throw DistributedError("accel: rendezvous at " + address.where + " failed for rank " + std::to_string(rank) +
                             " of " + std::to_string(world) +
                             (address.dir ? " (ACCEL_STORE_DIR)" : " (MASTER_ADDR/MASTER_PORT)") + ": the store" +
                             late +
                             " while connecting: is the address reachable, and the process serving it (rank "
                             "0, or torchrun's agent) running, not hung or stopped?");
    throw DistributedError("accel: the rendezvous store at " + address.where + late +
                           ": is the process serving it (rank 0, or torchrun's agent) hung or stopped?");
  }
  return std::move(*met);
}

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/make_groups.hpp ========================================
// accel/distributed/make_groups.hpp: several c10d groups made at once over the rendezvous store, and every rank waiting until all are made.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Groups made at once. On LibTorch 1.13 making a group is mostly waiting
// for its members' store round trips, which made one after another add up
// (on 2.6 it measured no gain; README, Benchmarks part 4); so each group of
// more than one rank beyond the first is made on a thread of its own, with a
// store connection of its own (LibTorch 1.13's TCPStore client is not safe
// to share between threads, and 2.x's Store::clone is not in 1.13). A
// FileStore is not opened twice (its destructor deletes the file when its
// own count of users falls to zero, under the others' feet): with one, the
// groups are made in order. Every member asks for the same groups, each on
// keys of its own, so the order in which they are made does not matter.
struct GroupRequest {
  std::string name;  // for the registry and errors, e.g. "dp{cp=1}"
  std::string key;   // the group's prefix in the store
  int rank = 0, size = 1;
  std::vector<int> dims;  // of a mesh's root, for the mesh that asked
};
struct MadeGroup {
  GroupPtr group;
  c10::intrusive_ptr<c10d::Store> store;  // the group's own keys
};
// What make_groups is asked, and where each group's outcome goes.
struct GroupsCall {
  const std::string& backend;
  const c10::intrusive_ptr<c10d::Store>& store;
  const std::optional<StoreAddress>& address;
  const std::vector<GroupRequest>& requests;
  std::chrono::milliseconds timeout;
  std::vector<MadeGroup> made;
  std::vector<std::exception_ptr> failed;
};
// Makes group i of a call. A function, not a lambda, because a thread runs
// it: in every file that makes a virtual call (as releasing a tensor does),
// GCC analyses whatever the call's possible targets reach, and a thread's
// body is one (std::thread's state is polymorphic). Reached through a
// function pointer, this code is analysed only where groups are made, not in
// every file that calls a collective (over a quarter of the functions GCC
// took up for a file with one all_reduce).
inline void make_group_of(GroupsCall& call, std::size_t i, bool own_connection) {
  const GroupRequest& request = call.requests[i];
  try {
    call.made[i].store = c10::make_intrusive<c10d::PrefixStore>(
        request.key, own_connection ? bounded_connection(*call.address, request.size, call.timeout) : call.store);
    call.made[i].group = make_group(call.backend, call.made[i].store, request.rank, request.size, call.timeout);
  } catch (...) {
    call.failed[i] = std::current_exception();
  }
}
inline std::vector<MadeGroup> make_groups(const std::string& backend, const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::optional<StoreAddress>& address,
                                          const std::vector<GroupRequest>& requests,
                                          std::chrono::milliseconds timeout) {
  GroupsCall call{backend,
                  store,
                  address,
                  requests,
                  timeout,
                  std::vector<MadeGroup>(requests.size()),
                  std::vector<std::exception_ptr>(requests.size())};
  // Made on this thread, with the shared store: every group of one rank (no
  // round trip), and the first that talks.
  std::vector<bool> here(requests.size(), true);
  if (address && !address->dir)
    for (std::size_t i = 0, talking = 0; i < requests.size(); ++i)
      if (requests[i].size > 1) here[i] = talking++ == 0;
  std::vector<std::thread> threads;
  std::exception_ptr unstarted;
  for (std::size_t i = 0; i < requests.size() && !unstarted; ++i) {
    if (here[i]) continue;
    try {
      threads.emplace_back(&make_group_of, std::ref(call), i, /*own_connection=*/true);
    } catch (...) {  // no thread: the ones started finish before this throws
      unstarted = std::current_exception();
    }
  }
  if (!unstarted)
    for (std::size_t i = 0; i < requests.size(); ++i)
      if (here[i]) make_group_of(call, i, /*own_connection=*/false);
  for (std::thread& t : threads) t.join();
  if (unstarted) std::rethrow_exception(unstarted);
  // Every caller's failure is a DistributedError naming the group (c10d
  // throws its own c10::Error, outside accel's family).
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!call.failed[i]) continue;
    try {
      std::rethrow_exception(call.failed[i]);
    } catch (const DistributedError&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError("accel: making group '" + requests[i].name + "' (rank " +
                             std::to_string(requests[i].rank) + " of " + std::to_string(requests[i].size) +
                             ") failed: " + error_text(e));
    }
  }
  return std::move(call.made);
}

// Called on this rank when its groups are made, before it waits for the
// others' (tests hold a rank there); a no-op otherwise.
inline std::function<void()>& groups_made_hook() {
  static std::function<void()> hook = [] {};
  return hook;
}

// Waits until every rank has made its groups of this call (key: one per
// call). Only then may a rank destroy its groups or exit: a peer still
// making its own would lose the connections it makes to this rank, or the
// store this rank serves (rank 0), and fail with "Connection reset by peer".
// One store round trip each, the last rank's answering the others (Python's
// init_process_group ends with such a store-based barrier when
// TORCH_DIST_INIT_BARRIER=1, its default up to torch 2.0). A rank that
// could not make its groups answers instead (groups_failed), so the others
// fail at once rather than at the timeout.
inline void wait_for_groups_made(c10d::Store& store, const std::string& key, int rank, int world,
                                 std::chrono::seconds timeout) {
  groups_made_hook()();
  const std::vector<uint8_t> done{1};
  std::vector<uint8_t> answer;
  try {
    if (store.add(key, 1) == world) store.set(key + "/all", done);
    answer = store.get(key + "/all");  // (waits for the key)
  } catch (const std::exception& e) {
    std::string late = "some";
    try {
      late = std::to_string(world - store.add(key, 0)) + " of " + std::to_string(world);
    } catch (const std::exception&) {  // the store is gone too: the first error says so
    }
    throw DistributedError("accel: rank " + std::to_string(rank) + " made its groups and waited " +
                           std::to_string(timeout.count()) + " s (the timeout), but " + late +
                           " ranks did not make theirs: " + error_text(e));
  }
  if (answer != done)
    throw DistributedError("accel: rank " + std::to_string(rank) + " made its groups, but " +
                           std::string(answer.begin(), answer.end()));
}
inline void groups_failed(c10d::Store& store, const std::string& key, int rank, const std::string& why) {
  const std::string text = "rank " + std::to_string(rank) + " could not make its own: " + why;
  try {
    store.set(key + "/all", std::vector<uint8_t>(text.begin(), text.end()));
  } catch (const std::exception&) {  // the store is gone: the others find that out themselves
  }
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/mesh.hpp ===============================================
// accel/distributed/mesh.hpp: DeviceMesh: named dimensions, slice, flatten.
//
// init_device_mesh's layout, any number of named dimensions, seen from one
// rank. A mesh's dimension is one root dimension or several flattened into
// one (Accelerate's dp_shard_cp); slicing and flattening share the root's
// groups, and a rank creates only the groups it belongs to.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What a mesh and every mesh sliced or flattened from it share: the root
// layout arange(world).reshape(shape), this rank's coordinate in it, the
// groups made so far (keyed by their root dimensions) and the names of
// flattened dimensions, and what flatten needs to make a group later.
struct MeshRoot {
  c10::DeviceType device_type = c10::DeviceType::CPU;
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<int> coordinate;  // this rank's
  // Root dimensions of size 1 kept out of view: not in the mesh of every
  // dimension, nor in its groups' names (tp in the model and data meshes
  // when it is 1, so that they print and name their groups as without it).
  // slice() still finds them.
  std::vector<int> hidden;
  std::map<std::string, std::vector<int>, std::less<>> flattened;  // name -> root dims
  std::map<std::vector<int>, GroupPtr> groups;                     // root dims -> group (null: not distributed)
  std::vector<std::vector<int>> shared;  // root dims whose group another root made and registered (share())
  std::string backend;
  c10::intrusive_ptr<c10d::Store> store;  // null when not distributed
  std::string prefix;                     // this mesh's keys in the store
  std::chrono::milliseconds timeout{0};
  // The world group of the DistributedInterface that made this root, while
  // that interface lives (flatten's debug-mode check runs on it); expired
  // once the interface is destroyed, so a mesh that outlives it cannot
  // make groups on a store nobody serves any more.
  std::weak_ptr<const GroupPtr> world;

  MeshRoot() = default;
  MeshRoot(const MeshRoot&) = delete;
  MeshRoot& operator=(const MeshRoot&) = delete;
  ~MeshRoot() {
    for (const auto& entry : groups)
      if (entry.second && std::find(shared.begin(), shared.end(), entry.first) == shared.end())
        unregister_group(entry.second);
  }

  // Global ranks along `dims` (ascending root dimensions) through this rank,
  // row-major, the other coordinates fixed at this rank's; and this rank's
  // index among them.
  std::pair<std::vector<int>, int> line(const std::vector<int>& dims) const {
    std::vector<int> at = coordinate;
    for (int d : dims) at[static_cast<std::size_t>(d)] = 0;
    int count = 1, mine = 0;
    for (int d : dims) {
      count *= shape[static_cast<std::size_t>(d)];
      mine = mine * shape[static_cast<std::size_t>(d)] + coordinate[static_cast<std::size_t>(d)];
    }
    std::vector<int> ranks;
    ranks.reserve(static_cast<std::size_t>(count));
    for (int n = 0; n < count; ++n) {
      int rest = n;
      for (auto d = dims.rbegin(); d != dims.rend(); ++d) {
        at[static_cast<std::size_t>(*d)] = rest % shape[static_cast<std::size_t>(*d)];
        rest /= shape[static_cast<std::size_t>(*d)];
      }
      int rank = 0;
      for (std::size_t i = 0; i < shape.size(); ++i) rank = rank * shape[i] + at[i];
      ranks.push_back(rank);
    }
    return {std::move(ranks), mine};
  }

  // The group along `dims` through this rank, made on first use (every rank
  // makes its own at the same point: a collective), named e.g. "dp{cp=1}":
  // the group of `name` among the ranks whose cp coordinate is 1.
  const GroupPtr& group(const std::vector<int>& dims, const std::string& name) {
    auto it = groups.find(dims);
    if (it != groups.end()) return it->second;
    if (!store) return groups.emplace(dims, GroupPtr()).first->second;
    const GroupRequest asked = request(dims, name);
    return adopt(asked, std::move(make_groups(backend, store, std::nullopt, {asked}, timeout).front()));
  }
  // What making that group takes.
  GroupRequest request(const std::vector<int>& dims, const std::string& name) const {
    std::string fixed;
    const auto among = [](const std::vector<int>& list, std::size_t d) {
      return std::find(list.begin(), list.end(), static_cast<int>(d)) != list.end();
    };
    for (std::size_t d = 0; d < shape.size(); ++d)
      if (!among(dims, d) && !among(hidden, d))
        fixed += (fixed.empty() ? "" : ",") + names[d] + "=" + std::to_string(coordinate[d]);
    auto [members, index] = line(dims);
    GroupRequest asked;
    asked.name = fixed.empty() ? name : name + "{" + fixed + "}";
    asked.key = prefix + asked.name + "/";
    asked.rank = index;
    asked.size = static_cast<int>(members.size());
    asked.dims = dims;
    return asked;
  }
  // Every root dimension's group and every flattened dimension's known
  // already, to be made at once (make_groups).
  std::vector<GroupRequest> requests() const {
    std::vector<GroupRequest> all;
    for (std::size_t d = 0; d < shape.size(); ++d) all.push_back(request({static_cast<int>(d)}, names[d]));
    for (const auto& [name, dims] : flattened) all.push_back(request(dims, name));
    return all;
  }
  const GroupPtr& adopt(const GroupRequest& asked, MadeGroup made) {
    register_group(made.group, asked.name, made.store);
    return groups.emplace(asked.dims, std::move(made.group)).first->second;
  }
  // A group another root made and registered (the tp group both meshes
  // share): this root uses it and leaves its registration to the other.
  const GroupPtr& share(const GroupRequest& asked, const GroupPtr& group) {
    shared.push_back(asked.dims);
    return groups.emplace(asked.dims, group).first->second;
  }
};
// "init_device_mesh((2, 2), (dp, cp))", for errors and debug mode.
inline std::string describe_mesh_call(const std::vector<int>& shape, const std::vector<std::string>& names) {
  std::string text = "init_device_mesh((";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  text += "), (";
  for (std::size_t i = 0; i < names.size(); ++i) text += (i ? ", " : "") + names[i];
  return text + "))";
}
}  // namespace detail

class DeviceMesh {
 public:
  // The mesh of every dimension of a layout, in the layout's order (a
  // dimension's group not made yet is made here). DistributedInterface makes
  // the layouts (init_device_mesh, the model and data meshes); users get
  // their meshes from it.
  explicit DeviceMesh(std::shared_ptr<detail::MeshRoot> layout) : DeviceMesh(layout, every_dimension(*layout)) {}

  c10::DeviceType device_type() const { return root_->device_type; }
  int ndim() const { return static_cast<int>(dims_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& dim_names() const { return names_; }
  // Global ranks of the mesh, row-major (Python's mesh.mesh.flatten()).
  const std::vector<int>& ranks() const { return ranks_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int size(int mesh_dim) const { return shape_.at(index(mesh_dim)); }
  // This rank's coordinate in the mesh.
  const std::vector<int>& get_coordinate() const { return coordinate_; }
  // This rank's index along a dimension = its rank inside that dimension's group.
  int get_local_rank(int mesh_dim = 0) const { return coordinate_.at(index(mesh_dim)); }
  int get_local_rank(std::string_view name) const { return get_local_rank(index(name)); }
  const GroupPtr& get_group(int mesh_dim = 0) const { return groups_.at(index(mesh_dim)); }
  const GroupPtr& get_group(std::string_view name) const { return get_group(index(name)); }

  int index(std::string_view name) const {
    for (std::size_t i = 0; i < names_.size(); ++i)
      if (names_[i] == name) return static_cast<int>(i);
    throw InvalidArgument("accel::DeviceMesh: no dimension named '" + std::string(name) + "' in " + describe_names());
  }

  // The sub-mesh of the named dimensions through this rank (Python's
  // mesh["dp"], mesh["dp", "cp"]): this mesh's dimensions or dimensions
  // flattened from its root, in the root's order, none repeated. It shares
  // the groups; no communication.
  template <class... More>
    requires(std::convertible_to<const More&, std::string_view> && ...)
  DeviceMesh slice(std::string_view name, const More&... more) const {
    return select({name, std::string_view(more)...});
  }

  // This mesh's dimensions as one (Python's mesh._flatten(name); default
  // name: the dimension names joined by '_'): a 1-D mesh whose group holds
  // the ranks sharing every other root coordinate, ordered row-major. Every
  // rank of the world calls it at the same point (it creates a group; debug
  // mode checks); later the root's slice(name) finds it, and flattening the
  // same dimensions under the same name again returns it without
  // communication.
  DeviceMesh flatten(std::string name = {}) const {
    std::vector<int> dims;
    std::string joined;
    for (const Dimension& d : dims_) {
      dims.insert(dims.end(), d.root_dims.begin(), d.root_dims.end());
      joined += (joined.empty() ? "" : "_") + d.name;
    }
    if (name.empty()) name = joined;
    const std::string call = "DeviceMesh::flatten('" + name + "') of " + describe_names();
    if (auto known = root_->flattened.find(name); known != root_->flattened.end()) {
      if (known->second == dims) return DeviceMesh(root_, {{name, dims}});
      throw InvalidArgument("accel::" + call + ": '" + name + "' is already a flattened dimension of other dimensions");
    }
    if (std::find(root_->names.begin(), root_->names.end(), name) != root_->names.end())
      throw InvalidArgument("accel::" + call + ": '" + name + "' is already a dimension of the root mesh");
    if (root_->store) {
      const auto world = root_->world.lock();  // keeps the group alive through the check
      if (!world || !*world)
        throw LogicError("accel::" + call + ": the DistributedInterface that made this mesh was destroyed");
      detail::check_same_call(**world, [&] { return call; });
    }
    DeviceMesh flat(root_, {{name, dims}});  // makes the group
    root_->flattened.emplace(name, std::move(dims));
    return flat;
  }

 private:
  struct Dimension {
    std::string name;
    std::vector<int> root_dims;  // ascending
  };
  DeviceMesh(std::shared_ptr<detail::MeshRoot> root, std::vector<Dimension> dims)
      : root_(std::move(root)), dims_(std::move(dims)) {
    std::vector<int> all;
    for (const Dimension& d : dims_) {
      const auto [members, mine] = root_->line(d.root_dims);
      shape_.push_back(static_cast<int>(members.size()));
      names_.push_back(d.name);
      coordinate_.push_back(mine);
      groups_.push_back(root_->group(d.root_dims, d.name));
      all.insert(all.end(), d.root_dims.begin(), d.root_dims.end());
    }
    ranks_ = root_->line(all).first;
  }

  static std::vector<Dimension> every_dimension(const detail::MeshRoot& layout) {
    std::vector<Dimension> dims;
    for (std::size_t d = 0; d < layout.names.size(); ++d)
      if (std::find(layout.hidden.begin(), layout.hidden.end(), static_cast<int>(d)) == layout.hidden.end())
        dims.push_back({layout.names[d], {static_cast<int>(d)}});
    return dims;
  }

  DeviceMesh select(std::initializer_list<std::string_view> wanted) const {
    std::vector<Dimension> picked;
    for (std::string_view name : wanted) {
      Dimension dim{std::string(name), {}};
      for (const Dimension& own : dims_)
        if (own.name == name) dim.root_dims = own.root_dims;
      for (int d : root_->hidden)  // kept out of view, yet a dimension of the root
        if (root_->names[static_cast<std::size_t>(d)] == name) dim.root_dims = {d};
      if (dim.root_dims.empty()) {
        auto flat = root_->flattened.find(name);
        if (flat == root_->flattened.end())
          throw InvalidArgument("accel::DeviceMesh::slice: no dimension named '" + dim.name + "' in " +
                                describe_names() + " or flattened from its root");
        dim.root_dims = flat->second;
      }
      if (!picked.empty() && dim.root_dims.front() <= picked.back().root_dims.back())
        throw InvalidArgument("accel::DeviceMesh::slice: '" + dim.name + "' must come after '" + picked.back().name +
                              "': dimensions are sliced in the root mesh's order, each once (as Python's)");
      picked.push_back(std::move(dim));
    }
    return DeviceMesh(root_, std::move(picked));
  }

  std::string describe_names() const {
    std::string list = "(";
    for (std::size_t i = 0; i < names_.size(); ++i) list += (i ? ", " : "") + names_[i];
    return list + ")";
  }

  std::shared_ptr<detail::MeshRoot> root_;
  std::vector<Dimension> dims_;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coordinate_;
  std::vector<GroupPtr> groups_;
  std::vector<int> ranks_;

  int index(int mesh_dim) const {
    if (mesh_dim < 0 || mesh_dim >= ndim())
      throw OutOfRange("accel::DeviceMesh: dimension " + std::to_string(mesh_dim) + " out of range for a " +
                       std::to_string(ndim()) + "-d mesh");
    return mesh_dim;
  }
};

inline std::ostream& operator<<(std::ostream& os, const DeviceMesh& mesh) {
  os << "DeviceMesh(" << c10::DeviceTypeName(mesh.device_type(), true) << ", shape=(";
  for (int i = 0; i < mesh.ndim(); ++i) os << (i ? "," : "") << mesh.shape()[i];
  os << "), dims=(";
  for (int i = 0; i < mesh.ndim(); ++i) os << (i ? "," : "") << mesh.dim_names()[i];
  os << "), coordinate=(";
  for (int i = 0; i < mesh.ndim(); ++i) os << (i ? "," : "") << mesh.get_coordinate()[i];
  return os << "))";
}

ACCEL_NAMESPACE_END

// == accel/distributed/world.hpp ==============================================
// accel/distributed/world.hpp: World: the ranks of one initialisation, their rendezvous store and the groups made on it.
//
// DistributedInterface owns one World. Distributed, it meets the other ranks
// (rendezvous), makes the world group and the meshes' groups, and later the
// groups of new_group, split_group and init_device_mesh, each on keys of its
// own in the store. Not distributed, it is one rank with no store, and
// every group it gives is null (collectives are then the identity).

ACCEL_NAMESPACE_BEGIN

namespace detail {
class World {
 public:
  World(int rank, int size, c10::DeviceType device_type, std::chrono::seconds timeout)
      : rank_(rank), size_(size), device_type_(device_type), timeout_(timeout) {}
  World(const World&) = delete;
  World& operator=(const World&) = delete;
  ~World() { release(); }

  // Meets the other ranks at `address` (detail::store_address()).
  void connect(const StoreAddress& address, const std::string& backend, bool debug) {
    backend_ = backend;
    Rendezvoused met = rendezvous(address, rank_, size_, debug, timeout_);
    store_ = std::move(met.store);
    address_ = address;
    prefix_ = std::move(met.prefix);
  }
  bool connected() const { return store_ != nullptr; }

  // The root of a new mesh, its groups not made yet; `key` names its keys
  // in the store.
  std::shared_ptr<MeshRoot> new_root(const std::vector<int>& shape, const std::vector<std::string>& names,
                                     const std::string& key) const {
    auto root = std::make_shared<MeshRoot>();
    root->device_type = device_type_;
    root->shape = shape;
    root->names = names;
    for (std::size_t d = shape.size(), rest = static_cast<std::size_t>(rank_); d-- > 0;) {
      root->coordinate.insert(root->coordinate.begin(), static_cast<int>(rest % static_cast<std::size_t>(shape[d])));
      rest /= static_cast<std::size_t>(shape[d]);
    }
    root->world = world_token_;
    if (connected()) {
      root->backend = backend_;
      root->store = store_;
      root->prefix = prefix_ + key;
      root->timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout_);
    }
    return root;
  }

  // This rank's group along every dimension of the roots (and every
  // dimension flattened in them already), and the world group first when
  // asked: all made at once (detail::make_groups). A dimension of the same
  // name over the same ranks in two roots (tp, innermost in both the model
  // and the data mesh) is one group, made once and shared.
  void make_groups(const std::vector<MeshRoot*>& roots, bool with_world) {
    struct Asked {
      MeshRoot* root;
      GroupRequest request;
      std::optional<std::size_t> same_as;  // an earlier entry of `asked` with the same group
    };
    std::vector<Asked> asked;
    std::vector<GroupRequest> requests;  // what is made: the world first, then the entries without same_as
    if (with_world) requests.push_back({"world", prefix_ + "world", rank_, size_, {}});
    std::map<std::pair<std::string, std::vector<int>>, std::size_t> seen;  // (dimension name, ranks) -> entry
    for (MeshRoot* root : roots)
      for (GroupRequest& request : root->requests()) {
        const std::string dim_name = request.name.substr(0, request.name.find('{'));
        auto [it, first] = seen.emplace(std::pair{dim_name, root->line(request.dims).first}, asked.size());
        if (first) requests.push_back(request);
        asked.push_back({root, std::move(request), first ? std::nullopt : std::optional(it->second)});
      }
    const std::string key = next_made_key();
    std::vector<MadeGroup> made;
    try {
      made = detail::make_groups(backend_, store_, address_, requests,
                                 std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
    } catch (const std::exception& e) {
      groups_failed(*store_, key, rank_, error_text(e));
      throw;
    }
    std::size_t i = 0;
    if (with_world) {
      group_ = made[i].group;
      *world_token_ = group_;
      register_group(group_, "world", made[i].store, /*is_world=*/true);
      ++i;
    }
    std::vector<GroupPtr> groups;  // of each entry of `asked`
    for (Asked& entry : asked) {
      const GroupRequest& request = entry.request;
      if (entry.same_as) groups.push_back(entry.root->share(request, groups[*entry.same_as]));
      else groups.push_back(entry.root->adopt(request, std::move(made[i++])));
    }
    wait_for_groups_made(*store_, key, rank_, size_, timeout_);
  }

  // init_device_mesh's root, its groups made: the sizes and names checked,
  // then (distributed) debug mode's check and one group per dimension.
  std::shared_ptr<MeshRoot> mesh_root(const std::vector<int>& shape, const std::vector<std::string>& names) {
    const std::string call = describe_mesh_call(shape, names);
    if (shape.empty()) throw InvalidArgument("accel::" + call + ": a mesh needs at least one dimension");
    if (names.size() != shape.size())
      throw InvalidArgument("accel::" + call + ": " + std::to_string(shape.size()) + " sizes but " +
                            std::to_string(names.size()) + " names");
    int64_t product = 1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] < 1)
        throw InvalidArgument("accel::" + call + ": the size of '" + names[i] + "' must be positive, got " +
                              std::to_string(shape[i]));
      if (names[i].empty())
        throw InvalidArgument("accel::" + call + ": dimension " + std::to_string(i) + " has no name");
      for (std::size_t j = 0; j < i; ++j)
        if (names[j] == names[i])
          throw InvalidArgument("accel::" + call + ": the name '" + names[i] + "' is given twice");
      product = std::min<int64_t>(product * shape[i], int64_t{1} << 40);  // no overflow; still != any world size
    }
    if (product != size_)
      throw InvalidArgument("accel::" + call + ": the sizes multiply to " +
                            (product == int64_t{1} << 40 ? "2^40 or more" : std::to_string(product)) +
                            ", the world has " + std::to_string(size_) + " ranks");
    if (connected()) check_same_call(*group_, [&] { return call; });
    auto root = new_root(shape, names, "mesh/" + std::to_string(mesh_count_++) + "/");
    if (connected()) make_groups({root.get()}, /*with_world=*/false);
    return root;
  }

  // torch's new_group over world ranks (see DistributedInterface::new_group).
  GroupPtr new_group(const std::vector<int>& ranks) {
    std::vector<int> members = ranks;
    std::sort(members.begin(), members.end());
    std::string list;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] < 0 || members[i] >= size_)
        throw InvalidArgument("accel::new_group: rank " + std::to_string(members[i]) + " is not a rank of the world (" +
                              std::to_string(size_) + " ranks)");
      if (i > 0 && members[i] == members[i - 1])
        throw InvalidArgument("accel::new_group: rank " + std::to_string(members[i]) + " is given twice");
      list += (i ? ", " : "") + std::to_string(members[i]);
    }
    if (members.empty()) throw InvalidArgument("accel::new_group: no ranks given");
    if (!connected()) return {};
    const std::string name = "new_group([" + list + "])";
    check_same_call(*group_, [&] { return name; });
    return user_group(members, name, "");
  }

  // MPI_Comm_split (see DistributedInterface::split_group).
  GroupPtr split_group(int color, int key) {
    if (!connected()) return {};
    check_same_call(*group_, [] { return std::string("split_group()"); });
    const std::array<int64_t, 2> mine{color, key};
    std::vector<int64_t> all(2 * static_cast<std::size_t>(size_));
    all_gather_cpu<int64_t>(*group_, mine.data(), 2, all.data(), "split_group");
    std::vector<std::pair<int64_t, int>> order;  // (key, world rank) of this color
    if (color >= 0)
      for (int r = 0; r < size_; ++r)
        if (all[2 * static_cast<std::size_t>(r)] == color)
          order.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
    std::sort(order.begin(), order.end());
    std::vector<int> members;
    for (const auto& [k, r] : order) members.push_back(r);
    return user_group(members, "split_group(color=" + std::to_string(color) + ")",
                      "color/" + std::to_string(color) + "/");
  }

  const GroupPtr& group() const { return group_; }  // the world group; null when not distributed
  const std::string& backend() const { return backend_; }

  // Every group released (the meshes' go with the meshes); the meshes made
  // here can no longer flatten. Idempotent.
  void release() {
    world_token_.reset();
    for (const auto& group : user_groups_) unregister_group(group);
    user_groups_.clear();
    store_.reset();
    if (group_) unregister_group(group_);
    group_.reset();
  }

 private:
  // A group of `members` (world ranks, in the order of their group ranks),
  // on keys of its own in the rendezvous store; a rank outside it gets a
  // group of one. Every rank calls this in the same order (the counter).
  GroupPtr user_group(const std::vector<int>& members, const std::string& name, const std::string& subkey) {
    const std::string key = prefix_ + "user/" + std::to_string(user_group_count_++) + "/" + subkey;
    const std::string made_key = next_made_key();
    const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout_);
    const auto it = std::find(members.begin(), members.end(), rank_);
    const bool member = it != members.end();
    auto group_store = c10::make_intrusive<c10d::PrefixStore>(
        member ? key + "members" : key + "alone/" + std::to_string(rank_), store_);
    GroupPtr group;
    try {
      group = member ? make_group(backend_, group_store, static_cast<int>(it - members.begin()),
                                  static_cast<int>(members.size()), timeout)
                     : make_group(backend_, group_store, 0, 1, timeout);
    } catch (const std::exception& e) {
      groups_failed(*store_, made_key, rank_, error_text(e));
      throw DistributedError("accel::" + name + ": creating the group failed on rank " + std::to_string(rank_) + ": " +
                             error_text(e));
    }
    register_group(group, member ? name : name + " (this rank alone: not a member)", group_store);
    user_groups_.push_back(group);
    wait_for_groups_made(*store_, made_key, rank_, size_, timeout_);
    return group;
  }

  // The key of the next call's wait_for_groups_made: every rank makes its
  // groups in the same calls, in the same order.
  std::string next_made_key() { return prefix_ + "made/" + std::to_string(made_count_++); }

  int rank_, size_;
  c10::DeviceType device_type_;
  std::chrono::seconds timeout_;
  std::string backend_ = "gloo";
  c10::intrusive_ptr<c10d::Store> store_;  // the rendezvous store, for groups made later
  std::optional<StoreAddress> address_;    // its address
  std::string prefix_;                     // and this initialisation's keys in it
  GroupPtr group_;                         // the world group
  int user_group_count_ = 0;
  std::vector<GroupPtr> user_groups_;  // new_group / split_group
  int mesh_count_ = 0;                 // init_device_mesh
  int made_count_ = 0;                 // next_made_key()
  // What the meshes made here see of this world (MeshRoot::world): set once
  // the world group exists, dropped (never changed) by release().
  std::shared_ptr<GroupPtr> world_token_ = std::make_shared<GroupPtr>();
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/interface.hpp ==========================================
// accel/distributed/interface.hpp: DistributedInterface (the singleton), new_group, init_device_mesh.

ACCEL_NAMESPACE_BEGIN

class DistributedInterface {
 public:
  // The first call initialises (device, strategy, the world group by env
  // rendezvous, both meshes); later calls return the same object. Passing a
  // config that differs from the live one throws. Thread-safe.
  static DistributedInterface& instance(std::optional<DistributedConfig> config = std::nullopt) {
    std::lock_guard lock(mutex());
    auto& slot = holder();
    if (slot) {
      if (config && resolve(*config) != slot->config_) {
        std::ostringstream message;
        message << "accel::DistributedInterface::instance: already initialised with " << slot->config_ << ", asked for "
                << *config << "; call destroy() first";
        throw LogicError(message.str());
      }
      return *slot;
    }
    slot.reset(new DistributedInterface(resolve(config.value_or(DistributedConfig{}))));
    return *slot;
  }

  // Whether a live instance exists (instance() would not initialise).
  static bool is_initialized() {
    std::lock_guard lock(mutex());
    return holder() != nullptr;
  }

  DistributedInterface(const DistributedInterface&) = delete;
  DistributedInterface& operator=(const DistributedInterface&) = delete;
  ~DistributedInterface() { release(); }

  const DistributedStrategy& strategy() const { return strategy_; }
  const DistributedConfig& config() const { return config_; }  // resolved: the timeout and device in force
  c10::Device current_device() const { return current_device_; }
  c10::Device current_accelerator() const { return current_accelerator_; }
  bool distributed() const { return distributed_; }
  const std::string& backend() const { return world_.backend(); }

  // The 1-D mesh of one dimension (no dim: invalid_argument; not
  // distributed: nullptr).
  const DeviceMesh* get_device_mesh(std::optional<Dim> dim) const {
    if (!dim) throw InvalidArgument("accel::DistributedInterface::get_device_mesh: dim must be specified");
    if (!distributed_) return nullptr;
    return &dim_meshes_[static_cast<std::size_t>(*dim)];
  }
  // The whole model mesh (mp_replicate, mp_shard) or data mesh (dp, cp),
  // each with tp as an innermost dimension when tp_size is above 1 and pp
  // as an outermost one when pp_size is (the tp group and the pp group are
  // the same in both). At tp 1 and pp 1 they are 2-D, and
  // get_device_mesh(Dim::TP) or (Dim::PP) is a mesh of one rank
  // (collectives on it are the identity).
  const DeviceMesh* model_mesh() const { return distributed_ ? &*model_mesh_ : nullptr; }
  const DeviceMesh* data_mesh() const { return distributed_ ? &*data_mesh_ : nullptr; }

  // A mesh of any number of named dimensions over arange(world).reshape(shape),
  // as Python's init_device_mesh(device_type, shape, mesh_dim_names=names) on
  // this interface's device: every rank of the world calls it at the same
  // point (debug mode checks), and each creates one group per dimension, the
  // one it belongs to. Sizes must be positive and multiply to the world size;
  // names unique and not empty. Not distributed: the world is one rank, every
  // size must be 1, and the groups are null (collectives are the identity).
  DeviceMesh init_device_mesh(const std::vector<int>& shape, const std::vector<std::string>& names) {
    return DeviceMesh(world_.mesh_root(shape, names));
  }

  GroupPtr get_group(std::optional<Dim> dim = std::nullopt) const {
    if (!distributed_ || !dim) return {};
    return get_device_mesh(dim)->get_group();
  }
  GroupPtr world_group() const { return world_.group(); }

  int get_rank(std::optional<Dim> dim = std::nullopt) const {
    if (!distributed_) return 0;
    return dim ? get_device_mesh(dim)->get_local_rank() : rank_;
  }
  int get_world_size(std::optional<Dim> dim = std::nullopt) const {
    if (!distributed_) return 1;
    return dim ? get_device_mesh(dim)->size() : world_size_;
  }
  int get_local_rank() const { return local_rank_; }
  int get_local_world_size() const { return local_world_size_; }

  template <TensorLike T>
  auto all_gather(const T& data, std::optional<Dim> dim = Dim::DP) {
    return accel::all_gather(data, group_for(dim));
  }
  template <TensorLike T>
  T all_reduce(T data, ReduceOp op = ReduceOp::MEAN, std::optional<Dim> dim = Dim::DP) {
    return accel::all_reduce(std::move(data), op, group_for(dim));
  }
  template <TensorLike T>
  T broadcast(T data, int src = 0, std::optional<Dim> dim = Dim::DP) {
    return accel::broadcast(std::move(data), src, group_for(dim));
  }

  // A group of the given ranks of the world (any order; duplicates and ranks
  // outside the world are an InvalidArgument), as torch's new_group: every
  // rank of the world calls it, with the same ranks, in the same order of
  // calls (debug mode checks). Ranks within it follow the order of the world
  // ranks. A rank outside `ranks` gets a group of its own (size 1), on which
  // collectives are the identity (torch's are no-ops there). The interface
  // keeps the group alive until destroy(). Not distributed: null (the
  // identity, as every group is then).
  GroupPtr new_group(const std::vector<int>& ranks) { return world_.new_group(ranks); }

  // MPI_Comm_split: the ranks that pass the same color form a group, ordered
  // by key (then by world rank); a negative color joins no group (a group of
  // its own, as for new_group's outsiders). Every rank of the world calls
  // it; one all_gather of (color, key). Kept alive until destroy().
  GroupPtr split_group(int color, int key = 0) { return world_.split_group(color, key); }

  void sync() { synchronize(); }
  void barrier() {
    if (distributed_) accel::barrier(world_.group());
  }
  // Releases every group and resets the singleton: the next instance()
  // starts afresh. References to this object are invalid afterwards.
  void destroy() {
    std::unique_ptr<DistributedInterface> self;
    {
      std::lock_guard lock(mutex());
      if (holder().get() == this) self = std::move(holder());
    }
    if (!self) release();  // not the singleton (cannot happen through instance())
  }

 private:
  explicit DistributedInterface(const DistributedConfig& config)
      : config_(config),
        strategy_(config),
        distributed_(is_distributed()),
        rank_(accel::get_rank()),
        world_size_(accel::get_world_size()),
        local_rank_(accel::get_local_rank()),
        local_world_size_(accel::get_local_world_size()),
        current_accelerator_(detail::forced_device(
            *config.device, "DistributedConfig::device is " + std::string(to_string(*config.device)))),
        current_device_(current_accelerator_),
        world_(rank_, world_size_, current_accelerator_.type(), config.timeout) {
    if (!distributed_) {
      debug_mode();  // validates ACCEL_DEBUG_MODE
      return;
    }
    detail::ignore_sigpipe();
    detail::bind_device(current_accelerator_.type());
    current_device_ = detail::current_device_of(current_accelerator_.type());
    const std::string backend = detail::backend_for(current_accelerator_.type());
    const bool debug = debug_mode();  // a malformed ACCEL_DEBUG_MODE fails here, not mid-training
    const detail::StoreAddress address = detail::store_address();  // malformed: InvalidArgument, here
    try {
      world_.connect(address, backend, debug);
      // pp, outermost in both meshes, and tp, innermost, are kept out of
      // view at size 1 (the meshes print and name their groups as without
      // them); each one's group is made once and shared by both meshes
      // (World::make_groups). With either above 1, the data-parallel ranks
      // of one (pp, tp) coordinate (the data mesh's dp and cp, flattened as
      // "dp_cp", torchtitan's name) get their group too: what the world is
      // to a model without tensor or pipeline parallelism.
      const int tp = strategy_.tp_size(), pp = strategy_.pp_size();
      const auto seed = [&](auto shape, auto names, const char* key) {
        std::vector<int> sizes{pp};
        std::vector<std::string> dim_names{std::string(to_string(Dim::PP))};
        sizes.insert(sizes.end(), shape.begin(), shape.end());
        dim_names.insert(dim_names.end(), names.begin(), names.end());
        sizes.push_back(tp);
        dim_names.emplace_back(to_string(Dim::TP));
        auto root = world_.new_root(sizes, dim_names, key);
        if (pp == 1) root->hidden.push_back(0);
        if (tp == 1) root->hidden.push_back(3);
        return root;
      };
      auto model = seed(strategy_.model_mesh_shape(), strategy_.model_mesh_dim_names(), "model/");
      auto data = seed(strategy_.data_mesh_shape(), strategy_.data_mesh_dim_names(), "data/");
      if (tp > 1 || pp > 1) data->flattened.emplace("dp_cp", std::vector<int>{1, 2});
      world_.make_groups({model.get(), data.get()}, /*with_world=*/true);
      model_mesh_ = DeviceMesh(std::move(model));
      data_mesh_ = DeviceMesh(std::move(data));
    } catch (const DistributedError&) {
      release();
      throw;
    } catch (const std::exception& e) {
      release();
      throw DistributedError("accel: initialising rank " + std::to_string(rank_) + " of " +
                             std::to_string(world_size_) + " (" + backend +
                             " process groups) failed: " + detail::error_text(e));
    }
    for (Dim dim : {Dim::MP_REPLICATE, Dim::MP_SHARD, Dim::DP, Dim::CP, Dim::TP, Dim::PP})  // (Dim's order)
      dim_meshes_.push_back(((dim == Dim::DP || dim == Dim::CP) ? *data_mesh_ : *model_mesh_).slice(to_string(dim)));
  }

  // A config with every default filled in: the timeout, and the device
  // (ACCEL_DEVICE, else the best available), so that a config that leaves
  // them out matches a live instance that used the same.
  static DistributedConfig resolve(const DistributedConfig& config) {
    DistributedConfig out = config.resolved();
    if (!out.device) out.device = detail::from_c10(get_current_accelerator().type());
    return out;
  }

  // Borrowed from the meshes, so the hot path counts no references.
  const GroupPtr& group_for(std::optional<Dim> dim) const {
    static const GroupPtr none;
    if (!distributed_) return none;
    return dim ? dim_meshes_[static_cast<std::size_t>(*dim)].get_group() : world_.group();
  }

  void release() {
    // A mesh's groups leave the registry with the last copy of the mesh.
    dim_meshes_.clear();
    model_mesh_.reset();
    data_mesh_.reset();
    world_.release();
  }

  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unique_ptr<DistributedInterface>& holder() {
    static std::unique_ptr<DistributedInterface> slot;
    return slot;
  }

  friend std::ostream& operator<<(std::ostream& os, const DistributedInterface& d) {
    os << "DistributedInterface(" << d.strategy_ << ", is_distributed=" << std::boolalpha << d.distributed_
       << ", current_accelerator=" << d.current_accelerator_ << ", rank=" << d.rank_
       << ", world_size=" << d.world_size_;
    if (d.distributed_)
      os << ", backend=" << d.backend() << ", model_mesh=" << *d.model_mesh_ << ", data_mesh=" << *d.data_mesh_;
    return os << ")";
  }

  DistributedConfig config_;
  DistributedStrategy strategy_;
  bool distributed_;
  int rank_, world_size_, local_rank_, local_world_size_;
  c10::Device current_accelerator_;
  c10::Device current_device_;
  std::optional<DeviceMesh> model_mesh_, data_mesh_;
  std::vector<DeviceMesh> dim_meshes_;  // indexed by Dim
  detail::World world_;                 // the rendezvous and every group made on it
};

// torch.distributed's new_group and split_group, on the singleton's world.
inline GroupPtr new_group(const std::vector<int>& ranks) { return DistributedInterface::instance().new_group(ranks); }
inline GroupPtr split_group(int color, int key = 0) { return DistributedInterface::instance().split_group(color, key); }
// Python's init_device_mesh, on the singleton's world and device.
inline DeviceMesh init_device_mesh(const std::vector<int>& shape, const std::vector<std::string>& names) {
  return DistributedInterface::instance().init_device_mesh(shape, names);
}

ACCEL_NAMESPACE_END

// == accel/distributed/nested.hpp =============================================
// accel/distributed/nested.hpp: nested data (vectors, maps, tuples of tensors), packed for few collectives.
//
// Hugging Face Accelerate's distributed operations, names kept, over nested
// data: a tensor, or a std::vector, std::map / std::unordered_map with string
// keys, std::tuple or std::pair of nested data. Leaves that are not tensors
// pass through untouched, as in Accelerate's recursively_apply. Maps are
// walked in key order (unordered ones too), so every rank meets the same
// leaves in the same order. Every collective takes a group (default: the
// world), e.g. DistributedInterface::instance().get_group(Dim::DP), and moves a
// whole structure in as few collectives as its dtypes allow.

ACCEL_NAMESPACE_BEGIN

namespace detail {
template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};

template <class T>
struct is_string_map : std::false_type {};
template <class V, class C, class A>
struct is_string_map<std::map<std::string, V, C, A>> : std::true_type {};
template <class V, class H, class E, class A>
struct is_string_map<std::unordered_map<std::string, V, H, E, A>> : std::true_type {};

// Folds a property of the leaves over nested data: with All, whether every
// leaf has it; otherwise whether some leaf does. Containers are never leaves.
template <template <class> class Leaf, bool All, class T>
struct nested_fold : Leaf<T> {};
template <template <class> class Leaf, bool All, class T, class A>
struct nested_fold<Leaf, All, std::vector<T, A>> : nested_fold<Leaf, All, T> {};
template <template <class> class Leaf, bool All, class V, class C, class A>
struct nested_fold<Leaf, All, std::map<std::string, V, C, A>> : nested_fold<Leaf, All, V> {};
template <template <class> class Leaf, bool All, class V, class H, class E, class A>
struct nested_fold<Leaf, All, std::unordered_map<std::string, V, H, E, A>> : nested_fold<Leaf, All, V> {};
template <template <class> class Leaf, bool All, class... Ts>
struct nested_fold<Leaf, All, std::tuple<Ts...>>
    : std::conditional_t<All, std::conjunction<nested_fold<Leaf, All, Ts>...>,
                         std::disjunction<nested_fold<Leaf, All, Ts>...>> {};
template <template <class> class Leaf, bool All, class A, class B>
struct nested_fold<Leaf, All, std::pair<A, B>> : nested_fold<Leaf, All, std::tuple<A, B>> {};

template <class T>
using is_tensor = std::is_same<T, at::Tensor>;
// Whether T can hold a tensor somewhere (containers of plain values are
// leaves as a whole: nothing to walk).
template <class T>
using holds_tensor = nested_fold<is_tensor, false, T>;
// Nested data whose every leaf is a tensor: what collectives accept.
template <class T>
using tensor_tree = nested_fold<is_tensor, true, T>;

template <class T>
struct is_ordered_map : std::false_type {};
template <class V, class C, class A>
struct is_ordered_map<std::map<std::string, V, C, A>> : std::true_type {};

// A map's entries in key order (std::map already is; unordered_map is not,
// and its order may differ between processes).
template <class Map>
auto entries_by_key(Map& map) {
  std::vector<decltype(&*map.begin())> entries;
  entries.reserve(map.size());
  for (auto& entry : map) entries.push_back(&entry);
  if constexpr (!is_ordered_map<std::remove_const_t<Map>>::value)
    std::sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
  return entries;
}

// Calls fn(tensor) on every tensor leaf, in the fixed order; values under a
// key in `skip` are left alone. T may be const.
template <class T, class Fn>
void for_each_tensor(T& data, Fn& fn, const std::vector<std::string>* skip = nullptr) {
  using U = std::remove_const_t<T>;
  if constexpr (!holds_tensor<U>::value) {
    return;
  } else if constexpr (std::is_same_v<U, at::Tensor>) {
    fn(data);
  } else if constexpr (is_vector<U>::value) {
    for (auto& element : data) for_each_tensor(element, fn, skip);
  } else if constexpr (is_string_map<U>::value) {
    for (auto* entry : entries_by_key(data)) {
      if (skip && std::find(skip->begin(), skip->end(), entry->first) != skip->end()) continue;
      for_each_tensor(entry->second, fn, skip);
    }
  } else {
    std::apply([&](auto&... element) { (for_each_tensor(element, fn, skip), ...); }, data);
  }
}

template <class T>
std::vector<at::Tensor> tensor_leaves(const T& data) {
  std::vector<at::Tensor> leaves;
  auto collect = [&](const at::Tensor& t) { leaves.push_back(t); };
  for_each_tensor(data, collect);
  return leaves;
}

// Writes `values` into the tensor leaves of `data`, in order.
template <class T>
T with_leaves(T data, std::vector<at::Tensor>&& values) {
  std::size_t next = 0;
  auto assign = [&](at::Tensor& t) { t = std::move(values[next++]); };
  for_each_tensor(data, assign);
  return data;
}

// The structure of nested data as text; `leaf(t)` describes each tensor,
// other leaves show as '_'.
template <class T, class Leaf>
void describe_nested(std::string& out, const T& data, const Leaf& leaf) {
  if constexpr (!holds_tensor<T>::value) {
    out += '_';
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    out += leaf(data);
  } else if constexpr (is_vector<T>::value) {
    out += '[';
    for (std::size_t i = 0; i < data.size(); ++i) {
      if (i) out += ", ";
      describe_nested(out, data[i], leaf);
    }
    out += ']';
  } else if constexpr (is_string_map<T>::value) {
    out += '{';
    bool first = true;
    for (auto* entry : entries_by_key(data)) {
      out += (first ? "'" : ", '") + entry->first + "': ";
      first = false;
      describe_nested(out, entry->second, leaf);
    }
    out += '}';
  } else {
    out += '(';
    bool first = true;
    std::apply(
        [&](const auto&... element) {
          ((out += first ? "" : ", ", first = false, describe_nested(out, element, leaf)), ...);
        },
        data);
    out += ')';
  }
}

// A collective's call as debug mode compares it: the operation, every
// tensor's dtype, shape and device (`free_dim(t)`: a dimension allowed to
// differ between ranks, shown as '*'), and the other arguments.
template <class T, class FreeDim>
std::string describe_call(const char* op, const T& data, const FreeDim& free_dim, const std::string& args = {}) {
  std::string out = std::string(op) + "(";
  describe_nested(out, data, [&](const at::Tensor& t) { return describe_tensor(t, free_dim(t)); });
  return out + args + ")";
}

inline void check_defined(const std::vector<at::Tensor>& leaves, const char* op) {
  for (std::size_t i = 0; i < leaves.size(); ++i)
    if (!leaves[i].defined())
      throw InvalidArgument(std::string("accel::") + op + ": tensor leaf " + std::to_string(i) +
                            " (in walking order) is undefined");
}

// Leaves grouped by a key (device, or dtype and device), in first-seen order.
template <class Key>
std::vector<std::pair<Key, std::vector<std::size_t>>> group_leaves(const std::vector<at::Tensor>& leaves,
                                                                   Key (*key)(const at::Tensor&)) {
  std::vector<std::pair<Key, std::vector<std::size_t>>> groups;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    Key k = key(leaves[i]);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {i}});
    else it->second.push_back(i);
  }
  return groups;
}
inline c10::Device device_key(const at::Tensor& t) { return t.device(); }
inline std::pair<c10::ScalarType, c10::Device> dtype_device_key(const at::Tensor& t) {
  return {t.scalar_type(), t.device()};
}

// The one packing path: several tensors travel in one flat buffer (gather,
// broadcast, reduce, DataParallel's buckets). Parts of one dtype lie back to
// back, so that a reduction runs on the buffer as that dtype; in a byte
// buffer (collectives that only move bytes) parts of any dtypes each start at
// a 16-byte boundary, so every part's view is aligned for its dtype. Views
// share the buffer's storage, and keep it alive.
constexpr int64_t kAlign = 16;
class Packing {
 public:
  explicit Packing(c10::ScalarType dtype = c10::kByte)
      : dtype_(dtype), unit_(static_cast<int64_t>(c10::elementSize(dtype))) {}
  // Places a part; returns its index.
  std::size_t add(c10::IntArrayRef sizes, c10::ScalarType dtype) {
    TORCH_INTERNAL_ASSERT(dtype_ == c10::kByte || dtype == dtype_, "accel: a part of another dtype in a typed packing");
    const int64_t align = dtype_ == c10::kByte ? kAlign : unit_;
    end_ = (end_ + align - 1) / align * align;
    parts_.push_back(Part{end_, sizes.vec(), dtype});
    end_ += c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
    return parts_.size() - 1;
  }
  std::size_t add(const at::Tensor& t) { return add(t.sizes(), t.scalar_type()); }
  std::size_t size() const { return parts_.size(); }
  // Bytes the layout spans, rounded up to kAlign in a byte packing (so that
  // buffers laid side by side keep every part aligned).
  int64_t bytes() const { return dtype_ == c10::kByte ? (end_ + kAlign - 1) / kAlign * kAlign : end_; }
  // An uninitialised buffer of the packing's dtype, at least `bytes` long
  // (never empty: Gloo divides by the element count).
  at::Tensor buffer(const at::TensorOptions& options, int64_t bytes = 0) const {
    return at::empty({std::max(bytes / unit_, elements())}, options.dtype(dtype_));
  }
  // Elements of the packing's dtype in a buffer (at least one).
  int64_t elements() const { return std::max(bytes(), dtype_ == c10::kByte ? kAlign : unit_) / unit_; }
  // Part k of a buffer laid out as this packing (it may be a row of a larger one).
  at::Tensor view(const at::Tensor& buffer, std::size_t k) const {
    const Part& part = parts_[k];
    const auto unit = static_cast<int64_t>(c10::elementSize(part.dtype));
    const int64_t start = buffer.storage_offset() * static_cast<int64_t>(buffer.element_size()) + part.offset;
    TORCH_INTERNAL_ASSERT(start % unit == 0, "accel: a packed part is misaligned");
    std::vector<int64_t> strides(part.sizes.size(), 1);
    for (std::size_t d = part.sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<int64_t>(part.sizes[d], 1);
    return at::empty({0}, buffer.options().dtype(part.dtype)).set_(buffer.storage(), start / unit, part.sizes, strides);
  }
  // A new buffer holding copies of `tensors` (tensors[k] is part k).
  at::Tensor pack(c10::ArrayRef<at::Tensor> tensors, const at::TensorOptions& options) const {
    at::Tensor out = buffer(options);
    for (std::size_t k = 0; k < tensors.size(); ++k) view(out, k).copy_(tensors[k]);
    return out;
  }

 private:
  struct Part {
    int64_t offset;  // bytes
    std::vector<int64_t> sizes;
    c10::ScalarType dtype;
  };
  c10::ScalarType dtype_;
  int64_t unit_;
  int64_t end_ = 0;
  std::vector<Part> parts_;
};

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/distributed/operations.hpp =========================================
// accel/distributed/operations.hpp: Accelerate's operations: gather, pad_across_processes, reduce, ....

ACCEL_NAMESPACE_BEGIN

// Nested data whose every leaf is an at::Tensor (what the collectives below take).
template <class T>
concept TensorTree = detail::tensor_tree<T>::value;

// Applies fn (tensor -> tensor) to every tensor leaf; everything else is
// copied through. Values under a map key listed in skip_keys are left alone.
template <class T, class Fn>
  requires std::invocable<Fn&, const at::Tensor&>
T recursively_apply(Fn&& fn, T data, const std::vector<std::string>& skip_keys = {}) {
  auto apply = [&](at::Tensor& t) { t = std::invoke(fn, std::as_const(t)); };
  detail::for_each_tensor(data, apply, skip_keys.empty() ? nullptr : &skip_keys);
  return data;
}

// Moves every tensor leaf to `device` (values under skip_keys stay).
template <class T>
T send_to_device(T data, c10::Device device, bool non_blocking = false,
                 const std::vector<std::string>& skip_keys = {}) {
  return recursively_apply([&](const at::Tensor& t) { return t.to(device, non_blocking); }, std::move(data), skip_keys);
}

// The size along dim 0 of the first tensor leaf; nullopt when there is none.
template <class T>
std::optional<int64_t> find_batch_size(const T& data) {
  auto leaves = detail::tensor_leaves(data);
  if (leaves.empty()) return std::nullopt;
  if (leaves.front().dim() == 0)
    throw InvalidArgument("accel::find_batch_size: the first tensor is 0-d and has no batch dimension");
  return leaves.front().size(0);
}

// The device of the first tensor leaf; nullopt when there is none.
template <class T>
std::optional<c10::Device> find_device(const T& data) {
  auto leaves = detail::tensor_leaves(data);
  if (leaves.empty()) return std::nullopt;
  return leaves.front().device();
}

// Concatenates structures of the same layout leaf by leaf along `dim`;
// non-tensor leaves come from the first structure.
template <class T>
T concatenate(const std::vector<T>& data, int64_t dim = 0) {
  if (data.empty()) throw InvalidArgument("accel::concatenate: nothing to concatenate");
  auto layout = [](const T& x) {
    std::string out;
    detail::describe_nested(out, x, [](const at::Tensor&) { return std::string("tensor"); });
    return out;
  };
  const std::string expected = layout(data.front());
  std::vector<std::vector<at::Tensor>> columns;
  for (std::size_t k = 0; k < data.size(); ++k) {
    if (k > 0 && layout(data[k]) != expected)
      throw InvalidArgument("accel::concatenate: element " + std::to_string(k) + " is laid out as " + layout(data[k]) +
                            ", element 0 as " + expected);
    auto leaves = detail::tensor_leaves(data[k]);
    columns.resize(leaves.size());
    for (std::size_t i = 0; i < leaves.size(); ++i) columns[i].push_back(std::move(leaves[i]));
  }
  std::vector<at::Tensor> joined;
  joined.reserve(columns.size());
  for (auto& column : columns) joined.push_back(at::cat(column, dim));
  return detail::with_leaves(data.front(), std::move(joined));
}

// Indexes every tensor leaf along dim 0: slice_tensors(batch, 0) is the
// first sample, slice_tensors(batch, at::indexing::Slice(0, 8)) the first 8.
template <class T>
T slice_tensors(T data, int64_t index) {
  return recursively_apply([&](const at::Tensor& t) { return t.select(0, index); }, std::move(data));
}
template <class T>
T slice_tensors(T data, const at::indexing::Slice& slice) {
  return recursively_apply([&](const at::Tensor& t) { return t.index({slice}); }, std::move(data));
}

// float16 and bfloat16 leaves become float32; other leaves are unchanged.
template <class T>
T convert_to_fp32(T data) {
  return recursively_apply(
      [](const at::Tensor& t) {
        const auto dtype = t.scalar_type();
        return dtype == c10::kHalf || dtype == c10::kBFloat16 ? t.to(c10::kFloat) : t;
      },
      std::move(data));
}

namespace detail {
// Every rank's int64 values (the same count on every rank), rank-major.
inline std::vector<int64_t> exchange_counts(c10d::ProcessGroup& group, const std::vector<int64_t>& mine,
                                            const char* op) {
  std::vector<int64_t> all(mine.size() * static_cast<std::size_t>(group.getSize()));
  if (!mine.empty()) all_gather_cpu<int64_t>(group, mine.data(), static_cast<int64_t>(mine.size()), all.data(), op);
  return all;
}

inline int64_t row_bytes(const at::Tensor& t) {
  int64_t bytes = static_cast<int64_t>(t.element_size());
  for (int64_t d = 1; d < t.dim(); ++d) bytes *= t.size(d);
  return bytes;
}

inline std::vector<int64_t> with_rows(const at::Tensor& t, int64_t rows) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes[0] = rows;
  return sizes;
}
}  // namespace detail

// Gathers nested tensors from every rank of the group, concatenated along
// dim 0 in rank order (a 0-d tensor becomes 1-d), on every rank. Sizes along
// dim 0 may differ between ranks: they are exchanged first (one small
// all_gather), then every leaf of a device travels in one byte buffer padded
// to the longest rank's, and is trimmed on arrival.
template <TensorTree T>
T gather(const T& data, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "gather");
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "gather");
  for (auto& leaf : leaves)
    if (leaf.dim() == 0) leaf = leaf.reshape({1});
  if (!g) return detail::with_leaves(data, std::move(leaves));
  detail::check_same_call(*g, [&] {
    return detail::describe_call(
        "gather", data, [](const at::Tensor& t) { return t.dim() ? std::optional<int64_t>(0) : std::nullopt; });
  });
  if (leaves.empty()) return data;
  const int size = g->getSize();
  const auto n = leaves.size();
  std::vector<int64_t> my_rows;
  for (const auto& leaf : leaves) my_rows.push_back(leaf.size(0));
  const std::vector<int64_t> rows = detail::exchange_counts(*g, my_rows, "gather");
  auto rows_of = [&](int r, std::size_t i) { return rows[static_cast<std::size_t>(r) * n + i]; };

  std::vector<std::vector<at::Tensor>> pieces(n, std::vector<at::Tensor>(size));
  at::NoGradGuard no_grad;
  for (const auto& bucket : detail::group_leaves(leaves, &detail::device_key)) {
    const std::vector<std::size_t>& members = bucket.second;
    // Each rank's leaves have their own rows: one layout per rank, every
    // rank's buffer as long as the longest.
    std::vector<detail::Packing> layouts(static_cast<std::size_t>(size));
    int64_t longest = 0;
    for (int r = 0; r < size; ++r) {
      for (std::size_t i : members)
        layouts[r].add(detail::with_rows(leaves[i], rows_of(r, i)), leaves[i].scalar_type());
      longest = std::max(longest, layouts[r].bytes());
    }
    const auto options = leaves[members.front()].options();
    at::Tensor mine = layouts[g->getRank()].buffer(options, longest);
    for (std::size_t k = 0; k < members.size(); ++k) layouts[g->getRank()].view(mine, k).copy_(leaves[members[k]]);
    at::Tensor all = at::empty({size, mine.size(0)}, mine.options());
    detail::start_all_gather_rows(*g, mine, all).wait();
    for (int r = 0; r < size; ++r)
      for (std::size_t k = 0; k < members.size(); ++k) pieces[members[k]][r] = layouts[r].view(all.select(0, r), k);
    for (std::size_t i : members) leaves[i] = at::cat(pieces[i], 0);  // owns its memory
  }
  return detail::with_leaves(data, std::move(leaves));
}

namespace detail {
inline ReduceOp parse_reduction(std::string_view reduction) {
  try {
    return from_string<ReduceOp>(reduction);
  } catch (const InvalidArgument&) {
    throw InvalidArgument("accel::reduce: unknown reduction '" + std::string(reduction) +
                          "' (expected \"sum\", \"mean\", \"max\" or \"min\")");
  }
}
}  // namespace detail

// Reduces nested tensors over the group and returns the result; the input
// is left untouched. One all_reduce per dtype (and device): the leaves of a
// dtype are flattened into one buffer. MEAN is SUM divided by the group size.
template <TensorTree T>
T reduce(const T& data, ReduceOp reduction = ReduceOp::MEAN, const GroupPtr& group = {}) {
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "reduce");
  if (reduction == ReduceOp::MEAN)
    for (const auto& leaf : leaves) detail::reject_integral_mean(leaf.scalar_type(), "reduce");
  c10d::ProcessGroup* g = detail::resolve(group, "reduce");
  at::NoGradGuard no_grad;
  if (!g) {
    for (auto& leaf : leaves) leaf = leaf.clone();
    return detail::with_leaves(data, std::move(leaves));
  }
  detail::check_same_call(*g, [&] {
    return detail::describe_call(
        "reduce", data, [](const at::Tensor&) { return std::nullopt; }, ", " + std::string(to_string(reduction)));
  });
  for (const auto& bucket : detail::group_leaves(leaves, &detail::dtype_device_key)) {
    const std::vector<std::size_t>& members = bucket.second;
    detail::Packing packing(bucket.first.first);
    std::vector<at::Tensor> parts;
    for (std::size_t i : members) {
      packing.add(leaves[i]);
      parts.push_back(leaves[i]);
    }
    at::Tensor flat = packing.pack(parts, leaves[members.front()].options());
    detail::all_reduce_tensor(*g, flat, reduction);
    for (std::size_t k = 0; k < members.size(); ++k) leaves[members[k]] = packing.view(flat, k);
  }
  return detail::with_leaves(data, std::move(leaves));
}
// reduction: "sum", "mean", "max" or "min"; anything else is an error (not a
// silent sum, as in Accelerate).
template <TensorTree T>
T reduce(const T& data, std::string_view reduction, const GroupPtr& group = {}) {
  return reduce(data, detail::parse_reduction(reduction), group);
}

// Copies nested tensors from rank `from_process` of the group (a rank within
// the group) into every rank's tensors, in place; returns data. All leaves
// on a device travel as one byte buffer (a lone contiguous leaf travels as itself).
template <TensorTree T>
  requires(!TensorLike<T>)
T broadcast(T data, int from_process = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "broadcast");
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "broadcast");
  detail::check_source(g, from_process, "broadcast", "from_process");
  if (!g) return data;
  detail::check_same_call(*g, [&] {
    return detail::describe_call(
        "broadcast", data, [](const at::Tensor&) { return std::nullopt; }, ", src=" + std::to_string(from_process));
  });
  const bool source = g->getRank() == from_process;
  at::NoGradGuard no_grad;
  for (const auto& bucket : detail::group_leaves(leaves, &detail::device_key)) {
    const std::vector<std::size_t>& members = bucket.second;
    if (members.size() == 1) {
      detail::broadcast_tensor(*g, leaves[members.front()], from_process);
      continue;
    }
    detail::Packing packing;
    for (std::size_t i : members) packing.add(leaves[i]);
    at::Tensor buffer = packing.buffer(leaves[members.front()].options());
    if (source)
      for (std::size_t k = 0; k < members.size(); ++k) packing.view(buffer, k).copy_(leaves[members[k]]);
    detail::broadcast_tensor(*g, buffer, from_process);
    if (!source)
      for (std::size_t k = 0; k < members.size(); ++k) leaves[members[k]].copy_(packing.view(buffer, k));
  }
  return data;
}

// Accelerate's copy_tensor_to_devices: the tensor that exactly one process
// of the group holds (the others pass an undefined at::Tensor, Python's
// None) on every process, without the others knowing its shape or dtype:
// one small all_gather of (holds it, dtype, dimensions), one broadcast of
// its sizes, one of its values. The holder gets its own tensor back; the
// others a new one on the group's device. Accelerate sums a buffer from
// every process, so two holders would add up; here no holder or several
// is an accel::InvalidArgument on every process.
inline at::Tensor copy_tensor_to_devices(const at::Tensor& tensor = {}, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "copy_tensor_to_devices");
  const bool holds = tensor.defined();
  const char* rule = "exactly one process holds the tensor; the others pass an undefined at::Tensor";
  if (!g) {
    if (!holds) throw InvalidArgument(std::string("accel::copy_tensor_to_devices: ") + rule + " (no process does)");
    return tensor;
  }
  detail::check_same_call(*g, [] { return std::string("copy_tensor_to_devices()"); });
  const std::vector<int64_t> all = detail::exchange_counts(
      *g, {holds, holds ? static_cast<int64_t>(tensor.scalar_type()) : 0, holds ? tensor.dim() : 0},
      "copy_tensor_to_devices");
  std::vector<int> holders;
  for (int r = 0; r < g->getSize(); ++r)
    if (all[3 * static_cast<std::size_t>(r)]) holders.push_back(r);
  if (holders.size() != 1) {
    std::string which = holders.empty() ? "none does" : "processes";
    for (int r : holders) which += " " + std::to_string(r);
    if (!holders.empty()) which += " do";
    throw InvalidArgument(std::string("accel::copy_tensor_to_devices: ") + rule + " (" + which + ")");
  }
  const int from = holders.front();
  const auto dtype = static_cast<c10::ScalarType>(all[3 * static_cast<std::size_t>(from) + 1]);
  const int64_t dims = all[3 * static_cast<std::size_t>(from) + 2];
  std::vector<int64_t> sizes = holds ? tensor.sizes().vec() : std::vector<int64_t>(static_cast<std::size_t>(dims));
  at::NoGradGuard no_grad;
  if (dims > 0)
    detail::broadcast_tensor(*g, at::from_blob(sizes.data(), {dims}, detail::cpu_options(c10::kLong)), from);
  at::Tensor out =
      holds ? tensor.contiguous() : at::empty(sizes, at::TensorOptions().dtype(dtype).device(detail::group_device(*g)));
  detail::broadcast_tensor(*g, out, from);
  return holds ? tensor : out;
}

// Pads every tensor leaf along `dim` with pad_index to the largest size any
// rank of the group has there (at the end, or at the start with pad_first).
// Leaves with fewer dimensions than `dim` are left as they are. One small
// all_gather of the sizes.
template <TensorTree T>
T pad_across_processes(const T& data, int64_t dim = 0, const at::Scalar& pad_index = 0, bool pad_first = false,
                       const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "pad_across_processes");
  std::vector<at::Tensor> leaves = detail::tensor_leaves(data);
  detail::check_defined(leaves, "pad_across_processes");
  if (!g) return data;
  auto axis = [dim](const at::Tensor& t) -> std::optional<int64_t> {
    if (dim >= t.dim() || dim < -t.dim()) return std::nullopt;
    return dim < 0 ? dim + t.dim() : dim;
  };
  detail::check_same_call(*g, [&] {
    std::ostringstream args;
    args << ", dim=" << dim << ", pad_index=" << pad_index << ", pad_first=" << std::boolalpha << pad_first;
    return detail::describe_call("pad_across_processes", data, axis, args.str());
  });
  std::vector<int64_t> mine;
  for (const auto& leaf : leaves) mine.push_back(axis(leaf) ? leaf.size(*axis(leaf)) : 0);
  const std::vector<int64_t> all = detail::exchange_counts(*g, mine, "pad_across_processes");
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < leaves.size(); ++i) {
    auto d = axis(leaves[i]);
    if (!d) continue;
    int64_t longest = 0;
    for (int r = 0; r < g->getSize(); ++r) longest = std::max(longest, all[r * leaves.size() + i]);
    if (longest == mine[i]) continue;
    std::vector<int64_t> sizes(leaves[i].sizes().begin(), leaves[i].sizes().end());
    sizes[*d] = longest;
    at::Tensor padded = at::full(sizes, pad_index, leaves[i].options());
    padded.narrow(*d, pad_first ? longest - mine[i] : 0, mine[i]).copy_(leaves[i]);
    leaves[i] = std::move(padded);
  }
  return detail::with_leaves(data, std::move(leaves));
}

ACCEL_NAMESPACE_END

// == accel/distributed/objects.hpp ============================================
// accel/distributed/objects.hpp: objects through the pickler: broadcast_object_list, gather_object, ....
//
// Objects travel as c10::IValue, serialized with LibTorch's own pickler
// (torch::jit::pickle_save: the format of torch.save), framed by a header
// with the payload's length and hash, so truncated or corrupted bytes are an
// exception before the unpickler sees them. (The check is not optional:
// LibTorch 1.13's pickle_load reads past its buffer on some corrupted
// archives — a heap-buffer-overflow in its zip reader, found with ASan.)

ACCEL_NAMESPACE_BEGIN

namespace detail {
template <class T>
using picklable_leaf = std::bool_constant<std::is_arithmetic_v<T> || std::is_same_v<T, std::string> ||
                                          std::is_same_v<T, at::Tensor> || std::is_same_v<T, c10::IValue>>;
template <class T>
using picklable = nested_fold<picklable_leaf, true, T>;
}  // namespace detail

// What gather_object and broadcast_object_list move: c10::IValue, numbers,
// bool, std::string, tensors, and vectors, string-keyed maps, tuples and
// pairs of those.
template <class T>
concept Picklable = detail::picklable<T>::value;

namespace detail {
template <Picklable T>
c10::IValue to_ivalue(const T& x) {
  if constexpr (std::is_same_v<T, c10::IValue>) {
    return x;
  } else if constexpr (std::is_same_v<T, bool>) {
    return c10::IValue(x);
  } else if constexpr (std::is_integral_v<T>) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) == 8)
      if (x > static_cast<T>(INT64_MAX))
        throw OutOfRange("accel: uint64 value " + std::to_string(x) + " does not fit an IValue's int64");
    return c10::IValue(static_cast<int64_t>(x));
  } else if constexpr (std::is_floating_point_v<T>) {
    return c10::IValue(static_cast<double>(x));  // IValue holds doubles
  } else if constexpr (std::is_same_v<T, std::string>) {
    return c10::IValue(x);
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    // The pickler writes a tensor's whole storage: a view (a row of a
    // dataset, a slice of a batch) travels as a compact copy instead.
    const bool compact =
        !x.defined() || x.layout() != at::kStrided ||
        (x.is_contiguous() && x.storage_offset() == 0 && x.storage().nbytes() == static_cast<std::size_t>(x.nbytes()));
    return c10::IValue(compact ? x : x.clone(at::MemoryFormat::Contiguous));
  } else if constexpr (is_vector<T>::value) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(x.size());
    if constexpr (std::is_same_v<typename T::value_type, bool>)  // std::vector<bool> has no bool&
      for (bool element : x) list.push_back(c10::IValue(element));
    else
      for (const auto& element : x) list.push_back(to_ivalue(element));
    return list;
  } else if constexpr (is_string_map<T>::value) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (auto* entry : entries_by_key(x)) dict.insert(entry->first, to_ivalue(entry->second));
    return dict;
  } else {
    std::vector<c10::IValue> elements;
    std::apply([&](const auto&... element) { (elements.push_back(to_ivalue(element)), ...); }, x);
    return c10::ivalue::Tuple::create(std::move(elements));
  }
}

[[noreturn]] inline void wrong_object(const char* expected, const c10::IValue& v) {
  throw InvalidArgument(std::string("accel: received object is a ") + v.tagKind() + ", expected " + expected);
}

template <Picklable T>
T from_ivalue(const c10::IValue& v) {
  if constexpr (std::is_same_v<T, c10::IValue>) {
    return v;
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.isBool()) wrong_object("bool", v);
    return v.toBool();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.isInt()) wrong_object("int", v);
    const int64_t i = v.toInt();
    if (!c10::overflows<T>(i) || (std::is_unsigned_v<T> && sizeof(T) == 8 && i >= 0)) return static_cast<T>(i);
    throw OutOfRange("accel: received integer " + std::to_string(i) + " does not fit the requested type");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.isDouble()) wrong_object("float", v);
    return static_cast<T>(v.toDouble());
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.isString()) wrong_object("string", v);
    return v.toStringRef();
  } else if constexpr (std::is_same_v<T, at::Tensor>) {
    if (!v.isTensor()) wrong_object("tensor", v);
    return v.toTensor();
  } else if constexpr (is_vector<T>::value) {
    if (!v.isList()) wrong_object("list", v);
    T out;
    for (const c10::IValue& element : v.toListRef()) out.push_back(from_ivalue<typename T::value_type>(element));
    return out;
  } else if constexpr (is_string_map<T>::value) {
    if (!v.isGenericDict()) wrong_object("dict", v);
    T out;
    for (const auto& entry : v.toGenericDict()) {
      if (!entry.key().isString()) wrong_object("string key", entry.key());
      out.emplace(entry.key().toStringRef(), from_ivalue<typename T::mapped_type>(entry.value()));
    }
    return out;
  } else {
    if (!v.isTuple()) wrong_object("tuple", v);
    const c10::ArrayRef<c10::IValue> elements = v.toTupleRef().elements().asArrayRef();
    if (elements.size() != std::tuple_size_v<T>)
      throw InvalidArgument("accel: received a tuple of " + std::to_string(elements.size()) + " elements, expected " +
                            std::to_string(std::tuple_size_v<T>));
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return T{from_ivalue<std::tuple_element_t<I, T>>(elements[I])...};
    }(std::make_index_sequence<std::tuple_size_v<T>>{});
  }
}

constexpr char kObjectMagic[8] = {'A', 'C', 'C', 'E', 'L', 'O', 'B', '1'};
constexpr std::size_t kObjectHeader = 24;  // magic, payload length, payload hash

inline std::vector<char> save_object(const c10::IValue& value) {
  std::vector<char> payload = torch::jit::pickle_save(value);
  std::vector<char> framed(kObjectHeader + payload.size());
  const uint64_t length = payload.size(), hash = fnv1a(payload.data(), payload.size());
  std::memcpy(framed.data(), kObjectMagic, 8);
  std::memcpy(framed.data() + 8, &length, 8);
  std::memcpy(framed.data() + 16, &hash, 8);
  std::memcpy(framed.data() + kObjectHeader, payload.data(), payload.size());
  return framed;
}

// Throws RuntimeError on bytes that save_object did not write intact.
inline c10::IValue load_object(const char* data, std::size_t size) {
  auto corrupt = [&](const std::string& why) {
    return RuntimeError("accel: received object bytes are not intact (" + why + ", " + std::to_string(size) +
                        " bytes)");
  };
  if (size < kObjectHeader || std::memcmp(data, kObjectMagic, 8) != 0) throw corrupt("no accel object header");
  uint64_t length = 0, hash = 0;
  std::memcpy(&length, data + 8, 8);
  std::memcpy(&hash, data + 16, 8);
  if (length != size - kObjectHeader) throw corrupt("length " + std::to_string(length) + " in the header");
  if (hash != fnv1a(data + kObjectHeader, length)) throw corrupt("hash mismatch");
  try {
    return torch::jit::pickle_load(std::vector<char>(data + kObjectHeader, data + size));
  } catch (const std::exception& e) {
    throw RuntimeError("accel: cannot unpickle a received object: " + error_text(e));
  }
}
}  // namespace detail

namespace detail {
// gather_object's result: a vector's elements, or the objects themselves.
template <class T>
struct gathered_objects {
  using type = std::vector<T>;
};
template <class T>
struct gathered_objects<std::vector<T>> {
  using type = std::vector<T>;
};
}  // namespace detail

// Gathers an object from every rank of the group, in rank order, on every
// rank: a std::vector is concatenated (as Accelerate flattens lists), any
// other object becomes one element. One size exchange, one payload collective.
template <Picklable T>
auto gather_object(const T& object, const GroupPtr& group = {}) {
  using Result = typename detail::gathered_objects<T>::type;
  auto flatten_into = [](Result& out, T&& piece) {
    if constexpr (detail::is_vector<T>::value)
      out.insert(out.end(), std::make_move_iterator(piece.begin()), std::make_move_iterator(piece.end()));
    else out.push_back(std::move(piece));
  };
  Result result;
  c10d::ProcessGroup* g = detail::resolve(group, "gather_object");
  if (!g) {
    flatten_into(result, T(object));
    return result;
  }
  detail::check_same_call(*g, [] { return std::string("gather_object()"); });
  std::vector<char> mine = detail::save_object(detail::to_ivalue(object));
  const int size = g->getSize();
  const std::vector<int64_t> lengths =
      detail::exchange_counts(*g, {static_cast<int64_t>(mine.size())}, "gather_object");
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  mine.resize(static_cast<std::size_t>(longest));
  std::vector<char> all(static_cast<std::size_t>(longest) * size);
  detail::all_gather_cpu(*g, reinterpret_cast<const uint8_t*>(mine.data()), longest,
                         reinterpret_cast<uint8_t*>(all.data()), "gather_object");
  for (int r = 0; r < size; ++r)
    flatten_into(result, detail::from_ivalue<T>(
                             detail::load_object(all.data() + longest * r, static_cast<std::size_t>(lengths[r]))));
  return result;
}

// Replaces `objects` on every rank with rank `from_process`'s (a rank within
// the group; the others' lists may have any length). One size broadcast,
// one payload broadcast. Returns objects.
template <Picklable T>
std::vector<T>& broadcast_object_list(std::vector<T>& objects, int from_process = 0, const GroupPtr& group = {}) {
  c10d::ProcessGroup* g = detail::resolve(group, "broadcast_object_list");
  detail::check_source(g, from_process, "broadcast_object_list", "from_process");
  if (!g) return objects;
  detail::check_same_call(*g, [&] { return "broadcast_object_list(src=" + std::to_string(from_process) + ")"; });
  const bool source = g->getRank() == from_process;
  std::vector<char> bytes;
  if (source) bytes = detail::save_object(detail::to_ivalue(objects));
  int64_t length = static_cast<int64_t>(bytes.size());
  at::Tensor length_view = at::from_blob(&length, {1}, detail::cpu_options(c10::kLong));
  detail::broadcast_tensor(*g, length_view, from_process);
  bytes.resize(static_cast<std::size_t>(length));
  at::Tensor payload = at::from_blob(bytes.data(), {length}, detail::cpu_options(c10::kByte));
  detail::broadcast_tensor(*g, payload, from_process);
  if (!source) objects = detail::from_ivalue<std::vector<T>>(detail::load_object(bytes.data(), bytes.size()));
  return objects;
}

ACCEL_NAMESPACE_END

// == accel/distributed/process_control.hpp ====================================
// accel/distributed/process_control.hpp: process control: split_between_processes, on_main_process, ....

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

// == accel/distributed/reproducibility.hpp ====================================
// accel/distributed/reproducibility.hpp: set_seed and synchronize_rng_states.

ACCEL_NAMESPACE_BEGIN

// Seeds C's rand() and LibTorch's default generators (CPU and every CUDA
// device); with device_specific the seed is offset by the global rank.
// Returns the seed used.
inline uint64_t set_seed(uint64_t seed, bool device_specific = false) {
  if (device_specific) seed += static_cast<uint64_t>(get_rank());
  std::srand(static_cast<unsigned>(seed));
  auto seed_generator = [seed](at::Generator generator) {
    std::lock_guard lock(generator.mutex());
    generator.set_current_seed(seed);
  };
  seed_generator(at::detail::getDefaultCPUGenerator());
  for (int i = 0; i < detail::guard_device_count(c10::DeviceType::CUDA); ++i)
    seed_generator(
        at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(i))));
  return seed;
}

namespace detail {
inline void synchronize_generator(at::Generator generator, const GroupPtr& group) {
  at::Tensor state;
  {
    std::lock_guard lock(generator.mutex());
    state = generator.get_state();
  }
  state = broadcast(std::move(state), 0, group);
  std::lock_guard lock(generator.mutex());
  generator.set_state(state);
}
}  // namespace detail

// Copies rank 0's random-generator states to every rank of the group:
// "torch" (LibTorch's CPU generator), "cuda" (the current CUDA device's),
// "generator" (the one passed). No types: "torch", plus "cuda" when a CUDA
// device is present.
inline void synchronize_rng_states(const std::vector<std::string>& rng_types = {},
                                   std::optional<at::Generator> generator = std::nullopt, const GroupPtr& group = {}) {
  std::vector<std::string> types = rng_types;
  if (types.empty()) {
    types.push_back("torch");
    if (is_torch_cuda_available()) types.push_back("cuda");
  }
  for (const auto& type : types) {
    if (type == "torch") {
      detail::synchronize_generator(at::detail::getDefaultCPUGenerator(), group);
    } else if (type == "cuda") {
      if (!is_torch_cuda_available())
        throw InvalidArgument("accel::synchronize_rng_states: \"cuda\" asked for, but no CUDA device is available");
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      detail::synchronize_generator(at::globalContext().defaultGenerator(impl->getDevice()), group);
    } else if (type == "generator") {
      if (!generator)
        throw InvalidArgument("accel::synchronize_rng_states: \"generator\" asked for, but no generator passed");
      detail::synchronize_generator(*generator, group);
    } else {
      throw InvalidArgument("accel::synchronize_rng_states: unknown rng type '" + type +
                            "' (expected \"torch\", \"cuda\" or \"generator\")");
    }
  }
}

ACCEL_NAMESPACE_END

#endif  // ACCEL_HPP_TORCH

// The training helpers: Accelerate's Accelerator for torch::nn modules, with
// data-parallel training in the design of Python's DistributedDataParallel
// (gradients all-reduced in buckets as autograd produces them, overlapping
// backward) and ZeRO-2/ZeRO-3 sharding. They need torch::nn, so they are
// opt-in: `#define ACCEL_TRAINING` before including accel.hpp (the
// collectives alone never include <torch/torch.h>).
#if defined(ACCEL_TRAINING) && !defined(ACCEL_CORE_ONLY) && !defined(ACCEL_HPP_TRAINING)
#define ACCEL_HPP_TRAINING

// == accel/training/torch_nn.hpp ==============================================
// accel/training/torch_nn.hpp: the LibTorch headers the training helpers need (<torch/torch.h>).

// GCC 14 at -O2/-O3 warns (-Warray-bounds, -Wstringop-overflow) inside
// LibTorch's own autograd::Function::apply (a std::vector<bool>::reserve it
// inlines), which accel::autograd instantiates: false positives in LibTorch's
// header that would fail a -Werror build. Ignored for LibTorch's headers only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <bit>
#include <cctype>
#include <cmath>
#include <cstdio>  // renameat2
#include <filesystem>
#include <set>
#include <unistd.h>

ACCEL_NAMESPACE_BEGIN
namespace detail {
// A LibTorch module holder (torch::nn::Linear, a TORCH_MODULE of yours): what
// the Accelerator takes as a model.
template <class M>
concept module_holder = requires(M& m) { m.ptr(); };
}  // namespace detail
ACCEL_NAMESPACE_END

// == accel/training/weak_keyed_map.hpp ========================================
// accel/training/weak_keyed_map.hpp: a map keyed by a tensor's or module's address that forgets an entry once its object has gone.
//
// Some facts about a tensor or module live beside it rather than in it (the
// style a plan gave a module, the twin of a gathered activation, the version
// of a gradient already summed): LibTorch has no slot to hang them on. They
// are kept by address with a weak reference, so an entry whose object has
// gone is never found, even when a new object takes its address, and is
// dropped at the next insertion. Safe to use from several threads.

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

// == accel/training/parameters.hpp ============================================
// accel/training/parameters.hpp: a module's parameters as Python counts them: each tensor once, known by all its names.
//
// LibTorch's Module::parameters() lists a tensor registered in two modules
// (tied weights: GPT-2's token embedding and head) twice, where Python's
// parameters() removes the repeats. Stepped, reduced or counted twice, such
// a weight trains wrongly without a word, so the training helpers take each
// tensor once, by identity (its TensorImpl), in the order of its first
// appearance; and an error about a parameter names it by every name it has.
// Under sharding a parameter has a stand-in, the tensor an optimizer steps
// in its place (StandIns).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// `tensors` with each tensor once (by identity, in first-appearance order).
inline std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  out.reserve(tensors.size());
  for (const auto& t : tensors)
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  return out;
}

// Each parameter of `module` by its qualified names (state_dict's:
// "transformer.wte.weight"), all of them for a tied one, in order.
class ParameterNames {
 public:
  ParameterNames() = default;
  explicit ParameterNames(const torch::nn::Module& module) {
    for (const auto& named : module.named_parameters())
      names_[named.value().unsafeGetTensorImpl()].push_back(named.key());
  }
  // "'transformer.wte.weight'", or for a tied one
  // "'transformer.wte.weight' (tied: also 'lm_head.weight')"; a tensor
  // that is no parameter of the module by its shape.
  std::string describe(const at::Tensor& p) const {
    const auto found = names_.find(p.unsafeGetTensorImpl());
    if (found == names_.end() || found->second.empty()) return "of shape " + c10::str(p.sizes());
    std::string text = "'" + found->second.front() + "'";
    for (std::size_t i = 1; i < found->second.size(); ++i)
      text += (i == 1 ? " (tied: also '" : ", '") + found->second[i] + "'";
    if (found->second.size() > 1) text += ")";
    return text;
  }
  // Every name (none for a tensor that is no parameter of the module).
  std::vector<std::string> all(const at::Tensor& p) const {
    const auto found = names_.find(p.unsafeGetTensorImpl());
    return found == names_.end() ? std::vector<std::string>{} : found->second;
  }
  // The first name (empty for a tensor that is no parameter of the module).
  std::string first(const at::Tensor& p) const {
    const auto found = names_.find(p.unsafeGetTensorImpl());
    return found == names_.end() || found->second.empty() ? std::string() : found->second.front();
  }

 private:
  std::unordered_map<const c10::TensorImpl*, std::vector<std::string>> names_;
};

// The tensor standing in for a parameter: a sharded wrapper's shard of it
// (ZeRO-2/3, dp/shards.hpp), which the optimizer steps instead, and whose
// gradient, after the data-parallel reduction, is this rank's chunk of the
// parameter's averaged gradient. Registered here by the wrapper, so that
// what works on reduced gradients without knowing the wrapper (tensor
// parallelism's partial sums, tp/sequence_parallel.hpp) finds them; kept
// weakly (a stand-in that has gone is not found).
class StandIns {
 public:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  static StandIns& instance() {
    static StandIns stand_ins;
    return stand_ins;
  }
  void add(const at::Tensor& parameter, const at::Tensor& stand_in) {
    stand_ins_.insert(weak_tensor(parameter), Weak(stand_in.getIntrusivePtr()));
  }
  // The tensor standing in for `parameter`, else `parameter` itself.
  at::Tensor of(const at::Tensor& parameter) const {
    if (const auto found = stand_ins_.find(parameter.unsafeGetTensorImpl()))
      if (auto alive = found->lock(); alive.defined()) return at::Tensor(std::move(alive));
    return parameter;
  }

 private:
  TensorKeyedMap<Weak> stand_ins_;
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/parallel/autograd.hpp =====================================
// accel/training/parallel/autograd.hpp: autograd-aware collectives (accel::autograd).
//
// torch.distributed.nn.functional's: collectives inside model code (tensor
// and context parallelism) whose backward is the adjoint collective, so
// gradients flow across ranks. accel::autograd::
//   all_reduce(x, op = SUM, group)      backward: all_reduce of the gradient
//   all_gather(x, group)                backward: reduce_scatter (SUM) of it
//   reduce_scatter(x, op = SUM, group)  backward: all_gather of it
//   all_to_all(x, group)                backward: all_to_all of it
//   all_to_all(x, out_splits, in_splits, group)   backward: the splits swapped
// SUM and MEAN only (MEAN's adjoint divides the gradient as its forward
// divides the values); the gradient of MAX or MIN is not a collective, and
// torch's reuse of the forward op for it is wrong, so they are refused.
// Forward results are new tensors (the input is left alone). Every rank must
// run the backward too, in the same order, as with DDP.
// The backward sums what each rank's loss asks of a value: right where each
// rank's loss is its own (context parallelism's tokens). Where the ranks of
// a group compute one loss together on the same batch (tensor parallelism),
// accel::tp's region mappings are the ones to use (tp/regions.hpp says why).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The group travels through the autograd context as a capsule (c10d's
// ProcessGroup is a torch::CustomClassHolder), which keeps it alive until
// backward has run.
inline GroupPtr saved_group(torch::autograd::AutogradContext* ctx) {
  c10::intrusive_ptr<torch::CustomClassHolder> holder = ctx->saved_data["group"].toCapsule();
  return GroupPtr::reclaim(static_cast<c10d::ProcessGroup*>(holder.release()));
}
inline void save_group(torch::autograd::AutogradContext* ctx, const GroupPtr& group) {
  ctx->saved_data["group"] = c10::IValue::make_capsule(group);
}
inline GroupPtr differentiable_on(const GroupPtr& group, ReduceOp op, const char* name) {
  if (op != ReduceOp::SUM && op != ReduceOp::MEAN)
    throw InvalidArgument(std::string("accel::autograd::") + name + ": ReduceOp::" + std::string(to_string(op)) +
                          " has no collective as its gradient; SUM and MEAN do");
  c10d::ProcessGroup* g = resolve(group, name);
  return g ? GroupPtr::unsafe_reclaim_from_nonowning(g) : GroupPtr();
}

struct AllReduceFunction : torch::autograd::Function<AllReduceFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, ReduceOp op, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    return accel::all_reduce(x.clone(at::MemoryFormat::Contiguous), op, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto op = static_cast<ReduceOp>(ctx->saved_data["op"].toInt());
    return {accel::all_reduce(grads[0].clone(at::MemoryFormat::Contiguous), op, saved_group(ctx)), {}, {}};
  }
};
struct AllGatherFunction : torch::autograd::Function<AllGatherFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["sizes"] = x.sizes().vec();
    return accel::all_gather(x, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor mine = accel::reduce_scatter(grads[0].contiguous(), ReduceOp::SUM, saved_group(ctx));
    return {mine.view(ctx->saved_data["sizes"].toIntVector()), {}};
  }
};
struct ReduceScatterFunction : torch::autograd::Function<ReduceScatterFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, ReduceOp op, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    ctx->saved_data["sizes"] = x.sizes().vec();
    return accel::reduce_scatter(x, op, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const GroupPtr group = saved_group(ctx);
    at::Tensor all = accel::all_gather(grads[0], group).view(ctx->saved_data["sizes"].toIntVector());
    if (static_cast<ReduceOp>(ctx->saved_data["op"].toInt()) == ReduceOp::MEAN) all.div_(group->getSize());
    return {all, {}, {}};
  }
};
struct AllToAllFunction : torch::autograd::Function<AllToAllFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::vector<int64_t> output_split_sizes, std::vector<int64_t> input_split_sizes,
                            GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["out"] = output_split_sizes;
    ctx->saved_data["in"] = input_split_sizes;
    return accel::all_to_all(x, std::move(output_split_sizes), std::move(input_split_sizes), group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The gradient goes back the way the rows came.
    return {accel::all_to_all(grads[0], ctx->saved_data["in"].toIntVector(), ctx->saved_data["out"].toIntVector(),
                              saved_group(ctx)),
            {},
            {},
            {}};
  }
};
}  // namespace detail

namespace autograd {
inline at::Tensor all_reduce(const at::Tensor& x, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, op, "all_reduce");
  if (!g) return x.clone();
  return detail::AllReduceFunction::apply(x, op, g);
}
inline at::Tensor all_gather(const at::Tensor& x, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, ReduceOp::SUM, "all_gather");
  if (!g) return x.unsqueeze(0).clone();
  return detail::AllGatherFunction::apply(x, g);
}
inline at::Tensor reduce_scatter(const at::Tensor& x, ReduceOp op = ReduceOp::SUM, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, op, "reduce_scatter");
  if (!g) {
    detail::enter_reduce_scatter(x, op, group);  // the checks of every world size
    return x.clone();
  }
  return detail::ReduceScatterFunction::apply(x, op, g);
}
inline at::Tensor all_to_all(const at::Tensor& x, std::vector<int64_t> output_split_sizes = {},
                             std::vector<int64_t> input_split_sizes = {}, const GroupPtr& group = {}) {
  const GroupPtr g = detail::differentiable_on(group, ReduceOp::SUM, "all_to_all");
  if (!g) {
    detail::check_all_to_all_splits(nullptr, x, std::move(output_split_sizes), std::move(input_split_sizes));
    return x.clone();
  }
  return detail::AllToAllFunction::apply(x, std::move(output_split_sizes), std::move(input_split_sizes), g);
}
}  // namespace autograd

ACCEL_NAMESPACE_END

// == accel/training/tp/regions.hpp ============================================
// accel/training/tp/regions.hpp: Megatron's region mappings (accel::tp): the collectives around a tensor-parallel region.
//
// A tensor-parallel layer holds a piece of a weight; what enters and leaves
// it is replicated, split along the last (hidden) dimension, or, under
// sequence parallelism, split along the sequence dimension. Each mapping is
// an autograd function whose backward is the adjoint of its forward:
//   copy_to_parallel_region            forward: identity    backward: all-reduce
//   reduce_from_parallel_region        forward: all-reduce  backward: identity
//   scatter_to_parallel_region         forward: this rank's piece of the last dimension
//                                      backward: all-gather along it
//   gather_from_parallel_region        forward: all-gather along the last dimension
//                                      backward: this rank's piece
//   scatter_to_sequence_parallel_region        forward: this rank's piece of `dim`
//                                              backward: all-gather along it
//   gather_from_sequence_parallel_region       forward: all-gather along `dim`
//                                              backward: reduce-scatter along it
//   reduce_scatter_to_sequence_parallel_region forward: reduce-scatter along `dim`
//                                              backward: all-gather along it
// Why not accel::autograd's collectives: their all_reduce also all-reduces
// the gradient, right for outputs each rank uses differently, but a
// replicated region's gradient is already whole on every rank, and
// all-reducing it again multiplies it by the group's size.
//
// The group: the one given, else the process's tp group
// (DistributedInterface's Dim::TP). On a group of one every mapping is the
// identity and issues nothing.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// The tensor-parallel group of a layer or a mapping: `group` when given, else
// the live interface's Dim::TP group (null in one process: the identity).
// A launched process without an interface has no tp group to take: taking
// the world instead would split the model over data-parallel peers.
inline GroupPtr group_or_default(const GroupPtr& group, const char* who) {
  if (group) return group;
  if (DistributedInterface::is_initialized()) return DistributedInterface::instance().get_group(Dim::TP);
  if (!is_distributed()) return {};
  throw LogicError(std::string("accel::tp::") + who +
                   ": no group given and no DistributedInterface to take Dim::TP's from; create it first "
                   "(accel::DistributedInterface::instance({.tp_size = N}), or an Accelerator), or pass the group");
}
inline int size_of(const GroupPtr& group) { return group ? group->getSize() : 1; }
inline int rank_in(const GroupPtr& group) { return group ? group->getRank() : 0; }

inline int64_t wrap_dim(const at::Tensor& x, int64_t dim, const char* who) {
  const int64_t rank = x.dim();
  if (dim < -rank || dim >= rank)
    throw InvalidArgument(std::string("accel::tp::") + who + ": dim " + std::to_string(dim) + " is out of range for " +
                          describe_tensor(x));
  return dim < 0 ? dim + rank : dim;
}
inline void check_splits(const at::Tensor& x, int64_t dim, int parts, const char* who) {
  if (x.size(dim) % parts != 0)
    throw InvalidArgument(std::string("accel::tp::") + who + ": dim " + std::to_string(dim) + " of " +
                          describe_tensor(x) + " does not split into " + std::to_string(parts) +
                          " equal pieces (the tensor-parallel group's size)");
}

// Token ids or targets that must lie in range: `valid`, a 0-d bool tensor on
// their device, must be true. On the CPU a clear error (`message` builds
// it); on a GPU a device-side assertion, so the check does not wait for the
// values (torch's own embedding and loss assert the same way there).
inline void require_valid_ids(const at::Tensor& valid, const std::function<std::string()>& message) {
  if (!valid.is_cpu()) at::_assert_async(valid);
  else if (!valid.item<bool>()) throw InvalidArgument(message());
}

// This rank's piece of `dim` (a copy: the piece outlives the whole).
inline at::Tensor piece_of(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  const int64_t length = x.size(dim) / size_of(group);
  return x.narrow(dim, rank_in(group) * length, length).contiguous();
}
// The pieces of every rank, concatenated along `dim` in rank order.
inline at::Tensor gather_along(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  const at::Tensor stacked = accel::all_gather(x.contiguous(), group);  // (group size, *x's shape)
  return stacked.movedim(0, dim).flatten(dim, dim + 1);
}
// `dim` split into the group's pieces, piece r summed over the group and returned on rank r.
inline at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  const int parts = size_of(group);
  const at::Tensor rows = x.unflatten(dim, {parts, x.size(dim) / parts}).movedim(dim, 0).contiguous();
  return accel::reduce_scatter(rows, ReduceOp::SUM, group).squeeze(0);
}
inline at::Tensor sum_over(const at::Tensor& x, const GroupPtr& group) {
  return accel::all_reduce(x.clone(at::MemoryFormat::Contiguous), ReduceOp::SUM, group);
}

enum class Move : int64_t { identity, all_reduce, piece, gather, reduce_scatter };

inline at::Tensor apply_move(Move move, const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  switch (move) {
    case Move::identity: return x;
    case Move::all_reduce: return sum_over(x, group);
    case Move::piece: return piece_of(x, dim, group);
    case Move::gather: return gather_along(x, dim, group);
    case Move::reduce_scatter: return reduce_scatter_along(x, dim, group);
  }
  return x;
}

// One autograd function for every mapping: `forward` moves the values,
// `backward` the gradient (its adjoint), both along `dim`.
struct RegionFunction : torch::autograd::Function<RegionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t forward_move,
                            int64_t backward_move, int64_t dim, GroupPtr group) {
    save_group(ctx, group);
    ctx->saved_data["move"] = backward_move;
    ctx->saved_data["dim"] = dim;
    return apply_move(static_cast<Move>(forward_move), x, dim, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto move = static_cast<Move>(ctx->saved_data["move"].toInt());
    return {apply_move(move, grads[0], ctx->saved_data["dim"].toInt(), saved_group(ctx)), {}, {}, {}, {}};
  }
};

// `forward` then, in backward, `backward`, along `dim`; the identity (no
// collective, no autograd node) on a group of one.
inline at::Tensor map_region(const at::Tensor& x, Move forward, Move backward, int64_t dim, const GroupPtr& group,
                             const char* who) {
  const GroupPtr g = group_or_default(group, who);
  const int parts = size_of(g);
  // (copy_to and reduce_from move whole tensors, a 0-d loss included: no dimension to check)
  if (forward != Move::identity && forward != Move::all_reduce) {
    dim = wrap_dim(x, dim, who);
    if (forward != Move::gather) check_splits(x, dim, parts, who);
  }
  if (parts == 1) return x;
  return RegionFunction::apply(x, static_cast<int64_t>(forward), static_cast<int64_t>(backward), dim, g);
}
}  // namespace detail::tp

namespace tp {
inline at::Tensor copy_to_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::identity, detail::tp::Move::all_reduce, -1, group,
                                "copy_to_parallel_region");
}
inline at::Tensor reduce_from_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::all_reduce, detail::tp::Move::identity, -1, group,
                                "reduce_from_parallel_region");
}
inline at::Tensor scatter_to_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::piece, detail::tp::Move::gather, -1, group,
                                "scatter_to_parallel_region");
}
inline at::Tensor gather_from_parallel_region(const at::Tensor& x, const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::gather, detail::tp::Move::piece, -1, group,
                                "gather_from_parallel_region");
}
inline at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, int64_t dim = 1,
                                                      const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::piece, detail::tp::Move::gather, dim, group,
                                "scatter_to_sequence_parallel_region");
}
inline at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, int64_t dim = 1,
                                                       const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::gather, detail::tp::Move::reduce_scatter, dim, group,
                                "gather_from_sequence_parallel_region");
}
inline at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, int64_t dim = 1,
                                                             const GroupPtr& group = {}) {
  return detail::tp::map_region(x, detail::tp::Move::reduce_scatter, detail::tp::Move::gather, dim, group,
                                "reduce_scatter_to_sequence_parallel_region");
}
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/tp/layer.hpp ==============================================
// accel/training/tp/layer.hpp: what every tensor-parallel layer shares: its group, its piece of a whole tensor, its partial gradients.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// A parameter that is this rank's piece of a larger tensor, and the
// dimension the whole was split along (equal pieces over the group, in
// rank order).
struct SplitParameter {
  at::Tensor tensor;
  int64_t dim = 0;
};

// The base of accel::tp's layers (beside torch::nn::Module): the group the
// layer's weight is split over, this rank's place in it, and the parameters
// whose gradient leaves a backward as this rank's part of a sum over the
// group (under sequence parallelism, a replicated bias sees only this rank's
// tokens); tp::all_reduce_sequence_parallel_gradients finds them here.
class ParallelLayer {
 public:
  virtual ~ParallelLayer() = default;
  virtual std::vector<at::Tensor> partial_parameters() const { return {}; }
  // The parameters that are this rank's piece of a larger tensor (the rest
  // of the layer's are whole on every rank), with their dimension: what a
  // gradient norm sums over the group, and save_model gathers along it.
  virtual std::vector<SplitParameter> split_parameters() const = 0;
  const GroupPtr& group() const { return group_; }
  int tp_size() const { return size_of(group_); }
  int tp_rank() const { return rank_in(group_); }

 protected:
  ParallelLayer(const GroupPtr& group, const char* who) : group_(group_or_default(group, who)) {}

  // `whole` split into tp_size() equal pieces along `dim`: a clear error
  // naming the layer where it does not split.
  int64_t piece_length(int64_t whole, const char* what, const char* who) const {
    if (whole <= 0 || whole % tp_size() != 0)
      throw InvalidArgument(std::string("accel::tp::") + who + ": " + what + " " + std::to_string(whole) +
                            " does not split into " + std::to_string(tp_size()) +
                            " equal pieces (the tensor-parallel group's size)");
    return whole / tp_size();
  }
  // Copies this rank's piece (along `dim`) of a whole tensor into `mine`.
  void load_piece(at::Tensor& mine, const at::Tensor& whole, int64_t dim, c10::IntArrayRef whole_sizes,
                  const char* what, const char* who) const {
    if (!whole.defined() || whole.sizes() != whole_sizes)
      throw InvalidArgument(std::string("accel::tp::") + who + "::load_full: the whole " + what + " must have shape " +
                            c10::str(whole_sizes) + ", got " +
                            (whole.defined() ? describe_tensor(whole) : std::string("an undefined tensor")));
    const at::NoGradGuard no_grad;
    const int64_t length = mine.size(dim);
    mine.copy_(whole.narrow(dim, tp_rank() * length, length));
  }
  // A whole tensor made as `init` fills it, on every rank the same given the
  // same random state, then this rank's piece along `dim`: a layer starts
  // with the values its one-process counterpart (torch::nn::Linear,
  // Embedding) would have drawn. Costs one whole tensor for a moment.
  at::Tensor initial_piece(c10::IntArrayRef whole_sizes, int64_t dim,
                           const std::function<void(at::Tensor&)>& init) const {
    at::Tensor whole = torch::empty(whole_sizes);
    init(whole);
    const int64_t length = whole.size(dim) / tp_size();
    return whole.narrow(dim, tp_rank() * length, length).clone();
  }

 private:
  GroupPtr group_;
};
}  // namespace detail::tp

ACCEL_NAMESPACE_END

// == accel/training/tp/linear.hpp =============================================
// accel/training/tp/linear.hpp: Megatron-core's ColumnParallelLinear and RowParallelLinear as torch::nn modules.
//
// A Linear's weight [out, in] split over the tensor-parallel group:
//   ColumnParallelLinear  rows (out) split: each rank computes its piece of
//                         the output's last dimension from the whole input.
//   RowParallelLinear     columns (in) split: each rank multiplies its piece
//                         of the input's last dimension, and the partial
//                         products are summed over the group.
// Column then Row (an MLP's up and down projection, attention's q/k/v and
// output) needs one all-reduce forward and one backward for the pair.
// With sequence_parallel, activations outside the pair are split along the
// sequence dimension (`sequence_dim`, 1 for [batch, sequence, hidden] as
// torchtitan's Shard(1); Megatron's [sequence, batch, hidden] is 0): the
// Column layer all-gathers them and the Row layer reduce-scatters its sum,
// the same bytes as the all-reduce, and norms and dropout between pairs
// run on 1/tp of the tokens.
//
// A new layer draws the whole weight as torch::nn::Linear does (Kaiming
// uniform, the bias uniform in +-1/sqrt(in)) and keeps its piece: on every
// rank with the same random state, the pieces of the Linear a single process
// would have made. load_full(weight, bias) loads the pieces of given whole
// tensors instead.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// torch::nn::Linear's initial values, drawn whole.
inline void init_linear_weight(at::Tensor& weight) { torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0)); }
inline std::function<void(at::Tensor&)> init_linear_bias(int64_t in_features) {
  return [in_features](at::Tensor& bias) {
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    torch::nn::init::uniform_(bias, -bound, bound);
  };
}
}  // namespace detail::tp

namespace tp {
struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);  // the whole layer's; each rank holds out_features / tp
  TORCH_ARG(bool, bias) = true;
  // All-gather the output's pieces (a whole, replicated output) instead of
  // returning this rank's piece of the last dimension.
  TORCH_ARG(bool, gather_output) = false;
  // The input is split along sequence_dim (and all-gathered here).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(GroupPtr, group) = {};  // null: the process's Dim::TP group
};

class ColumnParallelLinearImpl : public torch::nn::Module, public detail::tp::ParallelLayer {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features)
      : ColumnParallelLinearImpl(ColumnParallelLinearOptions(in_features, out_features)) {}
  explicit ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options)
      : ParallelLayer(options.group(), "ColumnParallelLinear"), options(options) {
    if (options.gather_output() && options.sequence_parallel())
      throw InvalidArgument(
          "accel::tp::ColumnParallelLinear: gather_output and sequence_parallel exclude each other (a "
          "sequence-parallel region ends at a RowParallelLinear, which reduce-scatters along the sequence)");
    piece_length(options.out_features(), "out_features", "ColumnParallelLinear");
    weight = register_parameter(
        "weight", initial_piece({options.out_features(), options.in_features()}, 0, detail::tp::init_linear_weight));
    if (options.bias())
      bias = register_parameter(
          "bias", initial_piece({options.out_features()}, 0, detail::tp::init_linear_bias(options.in_features())));
  }

  // input [..., in_features] (under sequence_parallel, this rank's piece of
  // sequence_dim) -> [..., out_features / tp], or [..., out_features] with
  // gather_output.
  at::Tensor forward(const at::Tensor& input) {
    const at::Tensor whole_input =
        options.sequence_parallel() ? tp::gather_from_sequence_parallel_region(input, options.sequence_dim(), group())
                                    : tp::copy_to_parallel_region(input, group());
    const at::Tensor mine = torch::nn::functional::linear(whole_input, weight, bias);
    return options.gather_output() ? tp::gather_from_parallel_region(mine, group()) : mine;
  }

  // Loads this rank's rows of a whole weight [out_features, in_features] and
  // bias [out_features] (an undefined bias leaves the layer's as it is).
  void load_full(const at::Tensor& whole_weight, const at::Tensor& whole_bias = {}) {
    load_piece(weight, whole_weight, 0, {options.out_features(), options.in_features()}, "weight",
               "ColumnParallelLinear");
    if (whole_bias.defined()) {
      if (!bias.defined())
        throw InvalidArgument("accel::tp::ColumnParallelLinear::load_full: a bias was given to a layer without one");
      load_piece(bias, whole_bias, 0, {options.out_features()}, "bias", "ColumnParallelLinear");
    }
  }

  // Makes `shared` this layer's weight, registered under the same name:
  // a head tied to a VocabParallelEmbedding over the same vocabulary (one
  // tensor, the same rows on each rank: Megatron's shared embedding).
  // torch::nn::Module cannot re-register a parameter from outside.
  void tie_weight(const at::Tensor& shared) {
    if (!shared.defined() || shared.sizes() != weight.sizes())
      throw InvalidArgument("accel::tp::ColumnParallelLinear::tie_weight: the weight must have this rank's shape " +
                            c10::str(weight.sizes()) + ", got " +
                            (shared.defined() ? detail::describe_tensor(shared) : std::string("an undefined tensor")));
    parameters_["weight"] = shared;
    weight = shared;
  }

  std::vector<detail::tp::SplitParameter> split_parameters() const override {
    if (bias.defined()) return {{weight, 0}, {bias, 0}};
    return {{weight, 0}};
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "accel::tp::ColumnParallelLinear(in_features=" << options.in_features()
           << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
           << ", tp=" << tp_size() << ")";
  }

  ColumnParallelLinearOptions options;
  at::Tensor weight;  // [out_features / tp, in_features]: rows tp_rank() * out / tp onwards
  at::Tensor bias;    // [out_features / tp], or undefined
};
TORCH_MODULE(ColumnParallelLinear);

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);  // the whole layer's; each rank holds in_features / tp
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;  // whole on every rank, added after the sum
  // The input is already this rank's piece of the last dimension (a
  // ColumnParallelLinear's output); false: the whole input, split here.
  TORCH_ARG(bool, input_is_parallel) = true;
  // Reduce-scatter the output along sequence_dim instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(GroupPtr, group) = {};  // null: the process's Dim::TP group
};

class RowParallelLinearImpl : public torch::nn::Module, public detail::tp::ParallelLayer {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features)
      : RowParallelLinearImpl(RowParallelLinearOptions(in_features, out_features)) {}
  explicit RowParallelLinearImpl(const RowParallelLinearOptions& options)
      : ParallelLayer(options.group(), "RowParallelLinear"), options(options) {
    if (options.sequence_parallel() && !options.input_is_parallel())
      throw InvalidArgument(
          "accel::tp::RowParallelLinear: sequence_parallel needs input_is_parallel (the input is a "
          "ColumnParallelLinear's piece of the last dimension)");
    piece_length(options.in_features(), "in_features", "RowParallelLinear");
    weight = register_parameter(
        "weight", initial_piece({options.out_features(), options.in_features()}, 1, detail::tp::init_linear_weight));
    if (options.bias()) {
      // Whole on every rank: drawn as the whole layer's, so every rank draws the same.
      at::Tensor whole = torch::empty({options.out_features()});
      detail::tp::init_linear_bias(options.in_features())(whole);
      bias = register_parameter("bias", whole);
    }
  }

  // input [..., in_features / tp] (input_is_parallel) or [..., in_features]
  // -> [..., out_features], summed over the group; under sequence_parallel,
  // this rank's piece of sequence_dim.
  at::Tensor forward(const at::Tensor& input) {
    const at::Tensor mine = options.input_is_parallel() ? input : tp::scatter_to_parallel_region(input, group());
    const at::Tensor partial = torch::nn::functional::linear(mine, weight);
    at::Tensor output = options.sequence_parallel()
                            ? tp::reduce_scatter_to_sequence_parallel_region(partial, options.sequence_dim(), group())
                            : tp::reduce_from_parallel_region(partial, group());
    return bias.defined() ? output + bias : output;
  }

  // Loads this rank's columns of a whole weight [out_features, in_features]
  // and the whole bias [out_features] (undefined: left as it is).
  void load_full(const at::Tensor& whole_weight, const at::Tensor& whole_bias = {}) {
    load_piece(weight, whole_weight, 1, {options.out_features(), options.in_features()}, "weight", "RowParallelLinear");
    if (whole_bias.defined()) {
      if (!bias.defined())
        throw InvalidArgument("accel::tp::RowParallelLinear::load_full: a bias was given to a layer without one");
      if (whole_bias.sizes() != bias.sizes())
        throw InvalidArgument("accel::tp::RowParallelLinear::load_full: the bias must have shape " +
                              c10::str(bias.sizes()) + ", got " + detail::describe_tensor(whole_bias));
      const at::NoGradGuard no_grad;
      bias.copy_(whole_bias);
    }
  }

  std::vector<detail::tp::SplitParameter> split_parameters() const override { return {{weight, 1}}; }
  // Under sequence parallelism the bias is added to this rank's tokens only.
  std::vector<at::Tensor> partial_parameters() const override {
    if (options.sequence_parallel() && bias.defined()) return {bias};
    return {};
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "accel::tp::RowParallelLinear(in_features=" << options.in_features()
           << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha << options.bias()
           << ", tp=" << tp_size() << ")";
  }

  RowParallelLinearOptions options;
  at::Tensor weight;  // [out_features, in_features / tp]: columns tp_rank() * in / tp onwards
  at::Tensor bias;    // [out_features], whole, or undefined
};
TORCH_MODULE(RowParallelLinear);
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/tp/embedding.hpp ==========================================
// accel/training/tp/embedding.hpp: Megatron-core's VocabParallelEmbedding as a torch::nn module.
//
// The table [num_embeddings, embedding_dim] split by rows (the vocabulary)
// over the tensor-parallel group: each rank looks up the tokens in its rows,
// writes zeros for the others, and the pieces are summed over the group
// (all-reduce; under sequence_parallel a reduce-scatter along sequence_dim,
// torchtitan's rowwise embedding with a Shard(1) output). The vocabulary
// must split evenly (pad it, as Megatron does, where it does not).
// A new layer draws the whole table as torch::nn::Embedding does (N(0, 1))
// and keeps its rows; load_full loads the rows of a given whole table. Its
// weight has the shape of a ColumnParallelLinear head's over the same
// vocabulary, so the two can share one tensor (tied embeddings).

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// This rank's part of looking up `ids` in a table split by rows: the rows
// of the ids in [vocab_start, vocab_start + rows of `piece`), zeros for the
// rest (the group's sum is the whole lookup). An id outside the vocabulary
// would look up nothing on every rank and give a row of zeros:
// torch::nn::Embedding's error instead. The ids are whole on every rank, so
// the check needs no collective; on a GPU it is asynchronous (a device-side
// assertion, no wait for the values). `padding_idx` (whole-table numbering)
// gets no gradient, as torch::nn::Embedding's.
inline at::Tensor vocab_piece_lookup(const at::Tensor& ids, const at::Tensor& piece, int64_t vocab_start,
                                     int64_t num_embeddings, std::optional<int64_t> padding_idx, const char* who) {
  if (!at::isIntegralType(ids.scalar_type(), /*includeBool=*/false))
    throw InvalidArgument(std::string("accel::tp::") + who + ": token ids must be integers, got " +
                          describe_tensor(ids));
  if (ids.numel() > 0)
    require_valid_ids(ids.ge(0).logical_and(ids.lt(num_embeddings)).all(), [&] {
      return std::string("accel::tp::") + who + ": token ids must lie in [0, " + std::to_string(num_embeddings) +
             "), got ids from " + std::to_string(ids.min().item<int64_t>()) + " to " +
             std::to_string(ids.max().item<int64_t>());
    });
  const int64_t rows = piece.size(0);
  const at::Tensor outside = ids.lt(vocab_start).logical_or(ids.ge(vocab_start + rows));
  const at::Tensor local = (ids - vocab_start).masked_fill(outside, 0);
  const bool pads_here = padding_idx && *padding_idx >= vocab_start && *padding_idx < vocab_start + rows;
  // (torch::embedding itself: GCC 14's -Wmaybe-uninitialized misfires on EmbeddingFuncOptions' copies)
  return torch::embedding(piece, local, pads_here ? *padding_idx - vocab_start : -1)
      .masked_fill(outside.unsqueeze(-1), 0);
}
}  // namespace detail::tp

namespace tp {
struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // the whole vocabulary; each rank holds num_embeddings / tp rows
  TORCH_ARG(int64_t, embedding_dim);
  // Reduce-scatter the output along sequence_dim instead of all-reducing it.
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(GroupPtr, group) = {};  // null: the process's Dim::TP group
};

class VocabParallelEmbeddingImpl : public torch::nn::Module, public detail::tp::ParallelLayer {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options)
      : ParallelLayer(options.group(), "VocabParallelEmbedding"), options(options) {
    const int64_t rows = piece_length(options.num_embeddings(), "num_embeddings", "VocabParallelEmbedding");
    vocab_start_ = tp_rank() * rows;
    weight = register_parameter("weight", initial_piece({options.num_embeddings(), options.embedding_dim()}, 0,
                                                        [](at::Tensor& t) { torch::nn::init::normal_(t); }));
  }

  // token ids [...] (integers in [0, num_embeddings); whole on every rank)
  // -> [..., embedding_dim], summed over the group; under sequence_parallel,
  // this rank's piece of sequence_dim.
  at::Tensor forward(const at::Tensor& ids) {
    const at::Tensor mine = detail::tp::vocab_piece_lookup(ids, weight, vocab_start_, options.num_embeddings(),
                                                           std::nullopt, "VocabParallelEmbedding");
    return options.sequence_parallel()
               ? tp::reduce_scatter_to_sequence_parallel_region(mine, options.sequence_dim(), group())
               : tp::reduce_from_parallel_region(mine, group());
  }

  // Loads this rank's rows of a whole table [num_embeddings, embedding_dim].
  void load_full(const at::Tensor& whole_weight) {
    load_piece(weight, whole_weight, 0, {options.num_embeddings(), options.embedding_dim()}, "weight",
               "VocabParallelEmbedding");
  }
  int64_t vocab_start() const { return vocab_start_; }  // the first row this rank holds
  std::vector<detail::tp::SplitParameter> split_parameters() const override { return {{weight, 0}}; }

  void pretty_print(std::ostream& stream) const override {
    stream << "accel::tp::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
           << ", embedding_dim=" << options.embedding_dim() << ", tp=" << tp_size() << ")";
  }

  VocabParallelEmbeddingOptions options;
  at::Tensor weight;  // [num_embeddings / tp, embedding_dim]

 private:
  int64_t vocab_start_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/tp/cross_entropy.hpp ======================================
// accel/training/tp/cross_entropy.hpp: vocab_parallel_cross_entropy (torch's loss_parallel, Megatron's vocab-parallel cross entropy).
//
// The cross-entropy loss of logits split along the vocabulary (a
// ColumnParallelLinear head without gather_output) without gathering them:
// each rank holds [tokens, vocabulary / tp]; the loss needs per token only
// the largest logit, the sum of the exponentials and the target's logit,
// three numbers that cross the group (one all-reduce MAX, and one SUM of the
// other two together) instead of tokens x vocabulary. The backward is local:
// softmax minus the target's one-hot, on this rank's columns.
// Reduction as torch's cross_entropy's default: the mean over the tokens
// whose target is not ignore_index (NaN when every one is, as torch's).
// Half and bfloat16 logits are computed in float32: the loss is float32,
// their gradient in their dtype.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  // logits [tokens, vocabulary / tp], target [tokens] -> each token's loss [tokens]
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            GroupPtr group) {
    const bool reduced = logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16;
    const at::Tensor x = reduced ? logits.to(at::kFloat) : logits;
    const int64_t columns = x.size(-1);
    const int64_t start = rank_in(group) * columns;
    const bool shared = size_of(group) > 1;

    at::Tensor largest = std::get<0>(x.max(-1));
    if (shared) accel::all_reduce(largest, ReduceOp::MAX, group);
    const at::Tensor shifted = x - largest.unsqueeze(-1);
    const at::Tensor inside = target.ge(start).logical_and(target.lt(start + columns));
    const at::Tensor column = (target - start).masked_fill(inside.logical_not(), 0);
    const at::Tensor exps = shifted.exp();
    // One all-reduce for the two sums: [tokens, 2] = (sum of exp, target's shifted logit).
    at::Tensor sums = at::stack(
        {exps.sum(-1), shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1).masked_fill(inside.logical_not(), 0)}, -1);
    if (shared) accel::all_reduce(sums, ReduceOp::SUM, group);
    const at::Tensor sum_exp = sums.select(-1, 0);
    const at::Tensor loss = sum_exp.log() - sums.select(-1, 1);

    ctx->save_for_backward({exps.div_(sum_exp.unsqueeze(-1)), column, inside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax over the whole vocabulary, this rank's columns
    grad.scatter_add_(-1, saved[1].unsqueeze(-1), saved[2].to(grad.scalar_type()).neg().unsqueeze(-1));
    grad.mul_(grads[0].unsqueeze(-1));
    return {grad.to(static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt())), {}, {}};
  }
};
}  // namespace detail::tp

namespace tp {
// local_logits [..., vocabulary / tp]: this rank's columns (rank r holds
// r * vocabulary / tp onwards, as ColumnParallelLinear splits them);
// target [...] with the whole vocabulary's ids, the same on every rank.
inline at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target,
                                               int64_t ignore_index = -100, const GroupPtr& group = {}) {
  constexpr const char* who = "vocab_parallel_cross_entropy";
  const GroupPtr g = detail::tp::group_or_default(group, who);
  if (local_logits.dim() < 1 || target.sizes() != local_logits.sizes().slice(0, local_logits.dim() - 1))
    throw InvalidArgument(std::string("accel::tp::") + who +
                          ": target must have the logits' shape without its last "
                          "(vocabulary) dimension; got logits " +
                          detail::describe_tensor(local_logits) + " and target " + detail::describe_tensor(target));
  if (!at::isIntegralType(target.scalar_type(), /*includeBool=*/false))
    throw InvalidArgument(std::string("accel::tp::") + who + ": target must hold integer ids, got " +
                          detail::describe_tensor(target));
  const at::Tensor logits = local_logits.reshape({-1, local_logits.size(-1)});
  const at::Tensor ids = target.reshape({-1}).to(at::kLong);
  // A target outside the vocabulary would match no rank's column: torch's error instead (asynchronous on a GPU).
  const int64_t vocabulary = logits.size(-1) * detail::tp::size_of(g);
  if (ids.numel() > 0)
    detail::tp::require_valid_ids(
        ids.eq(ignore_index).logical_or(ids.ge(0).logical_and(ids.lt(vocabulary))).all(), [&] {
          return std::string("accel::tp::") + who + ": target ids must lie in [0, " + std::to_string(vocabulary) +
                 ") (the vocabulary: " + std::to_string(logits.size(-1)) + " columns x tp " +
                 std::to_string(detail::tp::size_of(g)) + ") or equal ignore_index " + std::to_string(ignore_index);
        });
  const at::Tensor losses = detail::tp::VocabParallelCrossEntropy::apply(logits, ids, g);
  const at::Tensor kept = ids.ne(ignore_index).to(losses.scalar_type());
  return (losses * kept).sum() / kept.sum();
}
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/tp/dropout.hpp ============================================
// accel/training/tp/dropout.hpp: tp::dropout, one random mask for the whole activation whichever piece a rank holds.
//
// Dropout inside a tensor-parallel model must draw, for each element of the
// whole activation, one decision that every rank agrees on: where the
// activation is replicated, the same mask on every rank (else the replicas
// drift apart); where it is split (a column layer's output, or under
// sequence parallelism the tokens between layers), each rank the mask of its
// own piece, and the pieces together the mask of the whole. torch's DTensor
// does this with OffsetBasedRNGTracker (each shard's offset into one shared
// random stream); Megatron with a second, per-rank stream (its masks then
// differ from one process's). Here each rank draws the whole activation's
// mask from the default generator, the same on every rank of the group
// (seed them alike: accel::set_seed(seed)), and keeps its piece: on the CPU
// the values are those of torch::dropout in one process on the whole
// activation, and every generator advances as that one would. Costs a whole
// mask for a moment (tp times the piece).

ACCEL_NAMESPACE_BEGIN

namespace tp {
// x: the whole activation (sharded_dim empty), or this rank's piece of
// dimension *sharded_dim of it (pieces in rank order, as the layers split).
// p: the probability of an element being zeroed; the rest are scaled by
// 1 / (1 - p), as torch::dropout.
inline at::Tensor dropout(const at::Tensor& x, double p, bool training, std::optional<int64_t> sharded_dim = {},
                          const GroupPtr& group = {}) {
  if (p < 0 || p > 1) throw InvalidArgument("accel::tp::dropout: p must lie in [0, 1], got " + std::to_string(p));
  const GroupPtr g = detail::tp::group_or_default(group, "dropout");
  const int parts = detail::tp::size_of(g);
  if (!training || p == 0 || p == 1 || !sharded_dim || parts == 1 || x.numel() == 0)
    return torch::dropout(x, p, training);
  // torch::dropout's own steps on the CPU (ATen's _dropout_impl: a Bernoulli
  // noise tensor of the input's shape, divided by 1 - p, multiplied in), on
  // the whole shape, of which this rank keeps its piece.
  const int64_t dim = detail::tp::wrap_dim(x, *sharded_dim, "dropout");
  std::vector<int64_t> whole(x.sizes().begin(), x.sizes().end());
  whole[dim] *= parts;
  at::Tensor noise = at::empty(whole, x.options()).bernoulli_(1 - p);
  noise = noise.narrow(dim, detail::tp::rank_in(g) * x.size(dim), x.size(dim)).contiguous();
  return x * noise.div_(1 - p);
}
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/tp/styles.hpp =============================================
// accel/training/tp/styles.hpp: torch's parallel styles (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput) and the layouts they name, as plain values for a plan.
//
// A plan (tp::parallelize_module) maps submodule names to styles. The fields
// and defaults are torch.distributed.tensor.parallel's:
//   ColwiseParallel{.input_layouts = Replicate(), .output_layouts = Shard(-1)}
//   RowwiseParallel{.input_layouts = Shard(-1), .output_layouts = Replicate()}
//   SequenceParallel{.sequence_dim = 1}
//   PrepareModuleInput{.input_layouts = {...}, .desired_input_layouts = {...}}
// A layout says how an activation lies over the tensor-parallel group:
// whole on every rank (Replicate) or split into equal pieces along a
// dimension (Shard). LibTorch has no DTensor, so every style hands on this
// rank's local tensor (torch's use_local_output=True); the next style's
// input_layouts says what that tensor is.

#include <variant>

ACCEL_NAMESPACE_BEGIN

namespace tp {
// Whole on every rank of the group.
struct Replicate {
  bool operator==(const Replicate&) const = default;
};
// This rank's equal piece along `dim` (negative: from the end).
struct Shard {
  int64_t dim = 0;
  bool operator==(const Shard&) const = default;
};
using Layout = std::variant<Replicate, Shard>;

// A Linear's weight rows (out_features) split, its bias too: the output is
// this rank's piece of the last dimension. An Embedding's columns
// (embedding_dim) split. The input is all-gathered first where it is
// sharded (input_layouts = Shard(1): sequence parallelism's all-gather);
// output_layouts = Replicate() all-gathers the output's pieces.
struct ColwiseParallel {
  Layout input_layouts = Replicate{};
  Layout output_layouts = Shard{-1};
};
// A Linear's weight columns (in_features) split, its bias whole and added
// after the sum: the input is this rank's piece of the last dimension, the
// partial products summed over the group (output_layouts = Shard(1):
// reduce-scattered along the sequence instead). An Embedding's rows (the
// vocabulary) split: each rank looks up its rows and the pieces are summed.
struct RowwiseParallel {
  Layout input_layouts = Shard{-1};
  Layout output_layouts = Replicate{};
};
// A module whose parameters stay whole (a norm, dropout) run on this rank's
// piece of the sequence: its parameters' gradients leave the backward
// partial, and tp::all_reduce_sequence_parallel_gradients sums them.
struct SequenceParallel {
  int64_t sequence_dim = 1;
};
// The module's positional tensor inputs moved from input_layouts[i] to
// desired_input_layouts[i] before its forward (an empty entry: left as it
// is): attention's input all-gathered along the sequence, torchtitan's
// PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)).
struct PrepareModuleInput {
  std::vector<std::optional<Layout>> input_layouts;
  std::vector<std::optional<Layout>> desired_input_layouts;
};
using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput>;
}  // namespace tp

namespace detail::tp {
inline std::string describe(const accel::tp::Layout& layout) {
  if (const auto* shard = std::get_if<accel::tp::Shard>(&layout)) return "Shard(" + std::to_string(shard->dim) + ")";
  return "Replicate()";
}
inline const char* style_name(const accel::tp::ParallelStyle& style) {
  static constexpr const char* names[] = {"ColwiseParallel", "RowwiseParallel", "SequenceParallel",
                                          "PrepareModuleInput"};
  return names[style.index()];
}
// The dimension a layout splits, wrapped for a tensor of `rank` dimensions (none: Replicate).
inline std::optional<int64_t> shard_dim(const accel::tp::Layout& layout, int64_t rank) {
  const auto* shard = std::get_if<accel::tp::Shard>(&layout);
  if (!shard) return std::nullopt;
  return shard->dim < 0 ? shard->dim + rank : shard->dim;
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END

// == accel/training/tp/registry.hpp ===========================================
// accel/training/tp/registry.hpp: the modules a plan styled (tp::parallelize_module), found by address when they run, and the watch that refuses a styled module called around its style.
//
// torch applies a style through forward hooks; LibTorch modules have none,
// so a styled module runs through accel::unit_forward, which finds its
// style here (tp/styled_forward.hpp). The registry keeps each styled module
// by address with a weak reference (detail::ModuleKeyedMap).

#include <mutex>

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// A module called directly (up->forward(x), up(x)) skips its style: a
// column layer's input gradient would stay this rank's part, a row layer's
// output would miss the sum. LibTorch gives no hook on the call, so the
// watch notices in the backward, where it matters for training: a styled
// call marks the module's split parameters on its output's gradient, which
// autograd computes before the gradient reaches the parameters; the
// parameters' own hooks then find a mark, or refuse the gradient.
class CallWatch {
 public:
  void watch(const at::Tensor& parameter, std::string who) {
    const std::lock_guard lock(mutex_);
    owners_.emplace(parameter.unsafeGetTensorImpl(), std::move(who));
  }
  void mark(const std::vector<at::Tensor>& parameters) {
    const std::lock_guard lock(mutex_);
    for (const auto& p : parameters) ++marks_[p.unsafeGetTensorImpl()];
  }
  // Called with each gradient of a watched parameter: passes when a styled
  // call produced it (the marks of this backward are used up), else throws.
  void take(const c10::TensorImpl* parameter) {
    const std::lock_guard lock(mutex_);
    int64_t& marks = marks_[parameter];
    if (marks > 0) {
      marks = 0;
      return;
    }
    throw LogicError("accel::tp: " + owners_[parameter] +
                     " was called directly (module->forward(x) or module(x)), around its parallel style: its "
                     "gradient would be wrong. Call it as accel::unit_forward(module, x): LibTorch modules have no "
                     "forward hooks to apply the style");
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, std::string> owners_;
  std::unordered_map<const c10::TensorImpl*, int64_t> marks_;
};

// A module a plan styled, over a group of more than one rank.
struct Styled {
  std::string name;  // its qualified name in the model the plan was applied to
  accel::tp::ParallelStyle style;
  GroupPtr group;
  std::weak_ptr<const torch::nn::Module> module;
  std::shared_ptr<CallWatch> watch;
  int64_t whole_features = 0;  // a Linear's whole in_features, an Embedding's whole num_embeddings
  int64_t vocab_start = 0;     // a rowwise Embedding: the first row this rank holds

  std::string who() const { return "'" + name + "' (" + style_name(style) + ")"; }
  bool colwise() const { return std::holds_alternative<accel::tp::ColwiseParallel>(style); }
  bool rowwise() const { return std::holds_alternative<accel::tp::RowwiseParallel>(style); }
};

// The styled modules, by address (ModuleKeyedMap: a module that has gone is
// never found, even when a new one takes its address).
class StyledRegistry {
 public:
  static StyledRegistry& instance() {
    static StyledRegistry registry;
    return registry;
  }
  void add(std::shared_ptr<const Styled> styled) { styled_.insert(styled->module, styled); }
  // The style of `module`, or null.
  std::shared_ptr<const Styled> find(const torch::nn::Module* module) const {
    return styled_.find(module).value_or(nullptr);
  }

 private:
  ModuleKeyedMap<std::shared_ptr<const Styled>> styled_;
};

// The tensors a styled module holds split (pieces of a larger tensor) and
// those whose gradient it leaves partial; read from the module itself, so
// a weight tied elsewhere is the one its forward uses.
inline std::vector<SplitParameter> styled_split_parameters(const Styled& s, const torch::nn::Module& module) {
  std::vector<SplitParameter> out;
  if (!s.colwise() && !s.rowwise()) return out;
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module)) {  // [out, in]: rows or columns
    out.push_back({linear->weight, s.colwise() ? 0 : 1});
    if (s.colwise() && linear->bias.defined()) out.push_back({linear->bias, 0});
  } else if (const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&module)) {
    out.push_back({embedding->weight, s.colwise() ? 1 : 0});  // [vocabulary, features]
  }
  return out;
}
inline std::vector<at::Tensor> styled_partial_parameters(const Styled& s, const torch::nn::Module& module) {
  if (std::holds_alternative<accel::tp::SequenceParallel>(s.style)) return module.parameters();
  const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module);
  const auto* row = std::get_if<accel::tp::RowwiseParallel>(&s.style);
  // A row layer's bias added to this rank's piece of the sequence only.
  if (linear && row && linear->bias.defined() && std::holds_alternative<accel::tp::Shard>(row->output_layouts))
    return {linear->bias};
  return {};
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END

// == accel/training/tp/pieces.hpp =============================================
// accel/training/tp/pieces.hpp: what of a module is split over a tensor-parallel group (by accel::tp's layers or by a plan), and what whole-model operations do with it.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// What one module holds split over its group, and which of its parameters'
// gradients leave a backward partial (this rank's part of a sum over the
// group): an accel::tp layer says so itself, a module a plan styled through
// the registry. None for a module of neither kind.
struct Pieces {
  GroupPtr group;
  std::vector<SplitParameter> split;
  std::vector<at::Tensor> partial;
};
inline std::optional<Pieces> pieces_of(const torch::nn::Module& module) {
  if (const auto* layer = dynamic_cast<const ParallelLayer*>(&module)) {
    if (layer->tp_size() == 1) return std::nullopt;
    return Pieces{layer->group(), layer->split_parameters(), layer->partial_parameters()};
  }
  if (const auto styled = StyledRegistry::instance().find(&module))
    return Pieces{styled->group, styled_split_parameters(*styled, module), styled_partial_parameters(*styled, module)};
  return std::nullopt;
}

// What of a module is split over a group of more than one rank (by
// accel::tp's layers or a plan): the group, the split parameters with the
// dimension each was split along (each a piece of a larger tensor;
// everything else of the module is whole on every rank), and the layers by
// qualified name ("" for the module itself), for errors. Empty (no group)
// without such layers. Layers split over different groups are an error.
struct SplitTensors {
  GroupPtr group;
  std::unordered_map<const c10::TensorImpl*, int64_t> dims;
  std::vector<std::string> layers;
  bool contains(const at::Tensor& t) const { return dims.count(t.unsafeGetTensorImpl()) > 0; }
  std::optional<int64_t> dim_of(const at::Tensor& t) const {
    const auto found = dims.find(t.unsafeGetTensorImpl());
    return found == dims.end() ? std::nullopt : std::optional<int64_t>(found->second);
  }
  // The whole tensor's shape, of a piece `t` (t's own where it is whole).
  std::vector<int64_t> whole_sizes(const at::Tensor& t) const {
    std::vector<int64_t> sizes = t.sizes().vec();
    if (const auto dim = dim_of(t)) sizes[*dim] *= size_of(group);
    return sizes;
  }
  // This rank's piece of `whole` where `t` is a piece (whole itself where t is whole).
  at::Tensor piece(const at::Tensor& t, const at::Tensor& whole) const {
    const auto dim = dim_of(t);
    if (!dim) return whole;
    const int64_t length = t.size(*dim);
    return whole.narrow(*dim, rank_in(group) * length, length);
  }
  // The whole tensor of which `values` are this rank's piece of `t`, gathered
  // from the group's pieces (`values` where t is whole): a collective on the
  // group where t is a piece.
  at::Tensor whole(const at::Tensor& t, const at::Tensor& values) const {
    const auto dim = dim_of(t);
    if (!dim) return values;
    return at::cat(accel::all_gather(values.detach().contiguous(), group).unbind(0), *dim);
  }
};
inline SplitTensors split_tensors(const torch::nn::Module& module) {
  SplitTensors split;
  const auto visit = [&](const std::string& name, const torch::nn::Module& m) {
    const auto pieces = pieces_of(m);
    if (!pieces || pieces->split.empty()) return;
    if (split.group && pieces->group != split.group)
      throw InvalidArgument("accel::tp: the layer '" + name + "' is split over another group than '" +
                            split.layers.front() + "'");
    split.group = pieces->group;
    split.layers.push_back(name);
    for (const auto& [p, dim] : pieces->split) split.dims.emplace(p.unsafeGetTensorImpl(), dim);
  };
  visit("", module);
  for (const auto& named : module.named_modules("", /*include_self=*/false)) visit(named.key(), *named.value());
  return split;
}
// Copies tp rank 0's values of the tensors of `module` that `split` does not
// hold (norms, a row layer's bias, buffers: whole on every rank) to the other
// ranks of its tp group, in one broadcast. Data parallelism starts each
// dp_cp group from its own first rank; without this, ranks of one tp group
// could start with different copies of a tensor that must be the same on all
// of them, and stay so. Nothing without split layers.
inline void broadcast_whole_tensors(const torch::nn::Module& module, const SplitTensors& split) {
  if (!split.group) return;
  std::vector<at::Tensor> whole;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto keep = [&](const at::Tensor& t) {
    if (t.defined() && !split.contains(t) && seen.insert(t.unsafeGetTensorImpl()).second) whole.push_back(t);
  };
  for (const auto& p : module.parameters()) keep(p);
  for (const auto& b : module.buffers()) keep(b);
  if (!whole.empty()) accel::broadcast(std::move(whole), 0, split.group);
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END

// == accel/training/tp/sequence_parallel.hpp ==================================
// accel/training/tp/sequence_parallel.hpp: all_reduce_sequence_parallel_gradients, the partial gradients of sequence parallelism summed in one collective.
//
// Under sequence parallelism a parameter that is whole on every rank but
// meets only this rank's tokens (a norm's weight and bias, a
// RowParallelLinear's bias) ends the backward with this rank's part of its
// gradient; the whole gradient is the sum over the tensor-parallel group.
// Megatron sums them after the backward (finalize_model_grads); torch's
// DTensor keeps them Partial and all-reduces each one (15 all-reduces for a
// 2-layer Llama's norms). Here: one all-reduce per group and dtype, of every
// such gradient packed together, called once before the optimizer step (and
// after the last backward of an accumulation: a sum is linear, so summing
// the accumulated gradient once is the same as summing each).
// The accel::tp layers name their own partial parameters, and a plan its
// SequenceParallel modules' and its row layers' (tp::parallelize_module); a
// norm no plan styled, the caller lists.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// The gradients summed last, each with its version after the sum: a second
// call before the gradient changes (the Accelerator's backward summed it, and
// the user's loop asks again) leaves it alone instead of multiplying it by
// tp. A gradient written since (a new backward, zero_grad) is summed again.
// Gradients that are views of one buffer (a sharded wrapper's shards') share
// one version counter, so writing one moves the version of all: each call
// records the versions of everything it summed or found summed at its end,
// after its own writes.
class SummedGradients {
 public:
  static SummedGradients& instance() {
    static SummedGradients summed;
    return summed;
  }
  bool unchanged_since_summed(const at::Tensor& grad) const {
    return summed_.find(grad.unsafeGetTensorImpl()) == static_cast<int64_t>(grad._version());
  }
  void record(const at::Tensor& grad) {
    summed_.insert(detail::weak_tensor(grad), static_cast<int64_t>(grad._version()));
  }

 private:
  TensorKeyedMap<int64_t> summed_;  // each gradient's version after the sum
};
}  // namespace detail::tp

namespace tp {
// Sums over their group the gradients of: the partial parameters of every
// accel::tp layer and styled module in `model` (itself included), and
// `sequence_parallel_parameters` (each once; a norm's weight and bias, over
// `group`, null: the process's Dim::TP group). Parameters without a gradient
// are skipped (every rank of a tensor-parallel group runs the same layers on
// the same batch, so the same ones everywhere), and so are gradients this
// function summed that nothing has written since: calling it twice sums
// once. Returns the number of all-reduces issued. The Accelerator calls it
// in backward on the steps that sync, for every prepared model with
// tensor-parallel pieces. List a norm only where it runs on sequence-split
// activations: on whole (replicated) ones its gradient is already whole on
// every rank, and summing it would multiply it by tp. Under sharding
// (SHARD_GRAD_OP, FULL_SHARD: FSDP + TP) the gradient summed is the
// shard's, which the optimizer steps: call it after the data-parallel
// reduction (Accelerator::backward, DataParallel::finish).
inline int all_reduce_sequence_parallel_gradients(torch::nn::Module& model,
                                                  const std::vector<at::Tensor>& sequence_parallel_parameters = {},
                                                  const GroupPtr& group = {}) {
  // The gradients summed together: one pack per (group, dtype, device), in
  // the order of their first gradient (the same on every rank: a map keyed
  // by the group's address could order them differently on each rank, and
  // their all-reduces would then wait on each other).
  struct Pack {
    GroupPtr group;
    at::ScalarType dtype;
    c10::Device device;
    std::vector<at::Tensor> grads;
  };
  std::vector<Pack> packs;
  std::vector<at::Tensor> summed_before;  // found summed by an earlier call, not written since
  std::unordered_set<const c10::TensorImpl*> seen;
  const auto add = [&](const at::Tensor& parameter, const GroupPtr& over) {
    if (!seen.insert(parameter.unsafeGetTensorImpl()).second || detail::tp::size_of(over) == 1) return;
    // (under sharding the gradient the optimizer steps is the shard's: the same chunk of the same tensor on
    // every rank of the tp group, their pieces having the same shapes, and the sum over tp of the averaged
    // chunks is the averaged chunk of the sum)
    const at::Tensor grad = detail::StandIns::instance().of(parameter).grad();
    if (!grad.defined()) return;
    if (detail::tp::SummedGradients::instance().unchanged_since_summed(grad)) {
      summed_before.push_back(grad);
      return;
    }
    auto pack = std::find_if(packs.begin(), packs.end(), [&](const Pack& p) {
      return p.group == over && p.dtype == grad.scalar_type() && p.device == grad.device();
    });
    if (pack == packs.end()) pack = packs.insert(packs.end(), Pack{over, grad.scalar_type(), grad.device(), {}});
    pack->grads.push_back(grad);
  };
  const auto visit = [&](const torch::nn::Module& module) {
    if (const auto pieces = detail::tp::pieces_of(module))
      for (const auto& p : pieces->partial) add(p, pieces->group);
  };
  visit(model);
  for (const auto& child : model.modules(/*include_self=*/false)) visit(*child);
  if (!sequence_parallel_parameters.empty()) {
    const GroupPtr over = detail::tp::group_or_default(group, "all_reduce_sequence_parallel_gradients");
    for (const auto& p : sequence_parallel_parameters) add(p, over);
  }
  const at::NoGradGuard no_grad;
  for (auto& pack : packs) {
    std::vector<at::Tensor> flat;
    for (const auto& g : pack.grads) flat.push_back(g.reshape({-1}));
    at::Tensor packed = at::cat(flat);
    accel::all_reduce(packed, ReduceOp::SUM, pack.group);
    int64_t offset = 0;
    for (auto& g : pack.grads) {
      g.copy_(packed.narrow(0, offset, g.numel()).view_as(g));
      offset += g.numel();
    }
  }
  for (const auto& pack : packs)
    for (const auto& g : pack.grads) detail::tp::SummedGradients::instance().record(g);
  for (const auto& g : summed_before) detail::tp::SummedGradients::instance().record(g);
  return static_cast<int>(packs.size());
}
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/tp/styled_forward.hpp =====================================
// accel/training/tp/styled_forward.hpp: a styled module run with its parallel style: its inputs moved to the layouts it needs, its pieces computed, its output moved to the layout the plan says.
//
// accel::unit_forward calls detail::tp::styled_forward for every module; a
// module no plan styled is simply called. Where torch's DTensor knows each
// activation's layout, here the plan's input_layouts say it, and every style
// hands on this rank's local tensor.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// PrepareModuleInput's all-gather of a sequence-split input. Its gradient
// depends on who reads the gathered tensor, as a DTensor's redistribution
// does: a column layer (whose input gradient is this rank's part of a sum)
// needs the parts reduce-scattered, any other reader (whose gradient is
// whole on every rank) needs only this rank's piece of its gradient. So the
// gather has two outputs with the same values: the one the module gets, and
// a twin that column layers take instead when they are given the first
// (SequenceGatherTwins). The backward sums both kinds right: attention's
// q, k and v projections cost one reduce-scatter together, and a reader the
// plan does not know of is still correct.
struct TwinGatherFunction : torch::autograd::Function<TwinGatherFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dim,
                                                GroupPtr group) {
    ctx->set_materialize_grads(false);
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    at::Tensor whole = gather_along(x, dim, group);
    // The twin shares the storage but is no view of `whole` (a view would hold `whole` alive, and the
    // registry, which keeps the twin while `whole` lives, would then keep both, and their graph, forever).
    at::Tensor twin = whole.detach();
    return {whole, twin};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const GroupPtr group = saved_group(ctx);
    at::Tensor grad;
    if (grads[0].defined()) grad = piece_of(grads[0], dim, group);  // whole readers: this rank's piece
    if (grads[1].defined()) {                                       // column layers: their parts summed
      at::Tensor summed = reduce_scatter_along(grads[1], dim, group);
      grad = grad.defined() ? grad + summed : summed;
    }
    return {grad, {}, {}};
  }
};

// The gathered tensors whose twin a column layer takes, by the gathered
// tensor's address (TensorKeyedMap: a freed tensor's address can be reused).
// An entry lives until the next gather after its tensor has gone.
class SequenceGatherTwins {
 public:
  static SequenceGatherTwins& instance() {
    static SequenceGatherTwins twins;
    return twins;
  }
  at::Tensor gather(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
    auto outputs = TwinGatherFunction::apply(x, dim, group);
    if (outputs[1].requires_grad()) twins_.insert(detail::weak_tensor(outputs[0]), outputs[1]);
    return outputs[0];
  }
  // How many gathered tensors are alive (their twins kept): after a backward, none should be.
  std::size_t live() const { return twins_.live(); }
  // The twin of `x` when it is such a gathered tensor, else undefined.
  at::Tensor twin_of(const at::Tensor& x) const { return twins_.find(x.unsafeGetTensorImpl()).value_or(at::Tensor()); }

 private:
  TensorKeyedMap<at::Tensor> twins_;
};

// An activation moved from one layout to another (PrepareModuleInput):
// all-gathered (with twins), split, or left; between two Shard dimensions
// (an all-to-all) refused.
inline at::Tensor move_layout(const Styled& s, std::size_t input, const at::Tensor& x, const accel::tp::Layout& from,
                              const accel::tp::Layout& to) {
  const auto from_dim = shard_dim(from, x.dim()), to_dim = shard_dim(to, x.dim());
  if (from_dim == to_dim) return x;
  const std::string which = s.who() + "'s input " + std::to_string(input);
  if (from_dim && to_dim)
    throw InvalidArgument("accel::tp: " + which + ": moving from " + describe(from) + " to " + describe(to) +
                          " (an all-to-all) is not supported");
  if (from_dim) {
    if (*from_dim < 0 || *from_dim >= x.dim())
      throw InvalidArgument("accel::tp: " + which + ": " + describe(from) + " is out of range for " +
                            describe_tensor(x));
    return SequenceGatherTwins::instance().gather(x, *from_dim, s.group);
  }
  return accel::tp::scatter_to_sequence_parallel_region(x, *to_dim, s.group);
}

// Token ids given split (input_layouts Shard(d)) are gathered: ids carry no gradient.
inline at::Tensor whole_ids(const Styled& s, const at::Tensor& ids, const accel::tp::Layout& layout) {
  const auto dim = shard_dim(layout, ids.dim());
  return dim ? gather_along(ids, *dim, s.group) : ids;
}

// A column layer's input made whole: gathered along the sequence (the
// backward reduce-scatters this rank's part of the gradient), the twin of
// a gathered tensor, or the whole input itself (the backward all-reduces).
inline at::Tensor column_input(const Styled& s, const at::Tensor& x, const accel::tp::Layout& layout) {
  if (const auto dim = shard_dim(layout, x.dim()))
    return accel::tp::gather_from_sequence_parallel_region(x, *dim, s.group);
  if (at::Tensor twin = SequenceGatherTwins::instance().twin_of(x); twin.defined()) return twin;
  return accel::tp::copy_to_parallel_region(x, s.group);
}

inline void check_last_is_sharded(const Styled& s, const accel::tp::Layout& layout, const at::Tensor& x,
                                  const char* what) {
  if (const auto dim = shard_dim(layout, x.dim()); dim && *dim != x.dim() - 1)
    throw InvalidArgument("accel::tp: " + s.who() + ": its " + what + " " + describe(layout) +
                          " must split the last dimension (Shard(-1)) or be Replicate(), for " + describe_tensor(x));
}

// Where a styled module's own tensors are read: `in_unit(compute, x)` runs
// compute(x) inside the module's FULL_SHARD unit (its parameters gathered;
// plainly compute(x) when it is none). What moves the input to the layout
// the pieces need runs before, outside it, on the tensor the caller gave
// (the twin of a gathered input is found by that tensor).
using InUnit = std::function<at::Tensor(const std::function<at::Tensor(const at::Tensor&)>&, const at::Tensor&)>;

// A styled Linear: F::linear on this rank's pieces with the collectives around it.
inline at::Tensor styled_linear(const Styled& s, const torch::nn::LinearImpl& linear, const at::Tensor& x,
                                const InUnit& in_unit) {
  const int64_t in_piece = linear.weight.size(1);
  if (const auto* col = std::get_if<accel::tp::ColwiseParallel>(&s.style)) {
    at::Tensor whole = column_input(s, x, col->input_layouts);
    if (whole.dim() == 0 || whole.size(-1) != in_piece)
      throw InvalidArgument("accel::tp: " + s.who() + " takes inputs of " + std::to_string(in_piece) +
                            " features in the last dimension, got " + describe_tensor(whole));
    at::Tensor mine = in_unit(
        [&](const at::Tensor& in) { return torch::nn::functional::linear(in, linear.weight, linear.bias); }, whole);
    check_last_is_sharded(s, col->output_layouts, mine, "output_layouts");
    if (std::holds_alternative<accel::tp::Replicate>(col->output_layouts))
      return accel::tp::gather_from_parallel_region(mine, s.group);
    return mine;
  }
  const auto& row = std::get<accel::tp::RowwiseParallel>(s.style);
  if (x.dim() > 0) check_last_is_sharded(s, row.input_layouts, x, "input_layouts");
  at::Tensor mine = std::holds_alternative<accel::tp::Replicate>(row.input_layouts)
                        ? accel::tp::scatter_to_parallel_region(x, s.group)
                        : x;
  if (mine.dim() == 0 || mine.size(-1) != in_piece) {
    const bool whole = x.dim() > 0 && x.size(-1) == s.whole_features;
    throw InvalidArgument(
        "accel::tp: " + s.who() + " takes this rank's piece of the last dimension (" + std::to_string(in_piece) +
        " of " + std::to_string(s.whole_features) + " features), got " + describe_tensor(x) +
        (whole ? ": a whole input; where the plan gives it whole, say input_layouts = Replicate()" : std::string()));
  }
  // (the sum inside the unit too: the bias, a tensor of the unit, is added after it)
  return in_unit(
      [&](const at::Tensor& in) {
        const at::Tensor partial = torch::nn::functional::linear(in, linear.weight);
        at::Tensor out = [&] {
          if (const auto dim = shard_dim(row.output_layouts, partial.dim()))
            return accel::tp::reduce_scatter_to_sequence_parallel_region(partial, *dim, s.group);
          return accel::tp::reduce_from_parallel_region(partial, s.group);
        }();
        return linear.bias.defined() ? out + linear.bias : out;
      },
      mine);
}

// A styled Embedding: columns (ColwiseParallel) or rows (RowwiseParallel) of the table.
inline at::Tensor styled_embedding(const Styled& s, const torch::nn::EmbeddingImpl& embedding, const at::Tensor& ids,
                                   const InUnit& in_unit) {
  const auto& padding = embedding.options.padding_idx();  // (c10::optional on LibTorch 1.13)
  if (const auto* col = std::get_if<accel::tp::ColwiseParallel>(&s.style)) {
    // (torch::embedding itself: GCC 14's -Wmaybe-uninitialized misfires on a chained EmbeddingFuncOptions)
    at::Tensor mine = in_unit(
        [&](const at::Tensor& whole) {
          return torch::embedding(embedding.weight, whole, padding ? *padding : -1,
                                  embedding.options.scale_grad_by_freq(), embedding.options.sparse());
        },
        whole_ids(s, ids, col->input_layouts));
    if (std::holds_alternative<accel::tp::Replicate>(col->output_layouts))
      return accel::tp::gather_from_parallel_region(mine, s.group);
    check_last_is_sharded(s, col->output_layouts, mine, "output_layouts");
    return mine;
  }
  const auto& row = std::get<accel::tp::RowwiseParallel>(s.style);
  at::Tensor mine = in_unit(
      [&](const at::Tensor& whole) {
        return vocab_piece_lookup(whole, embedding.weight, s.vocab_start, s.whole_features,
                                  padding ? std::optional<int64_t>(*padding) : std::nullopt, "RowwiseParallel");
      },
      whole_ids(s, ids, row.input_layouts));
  if (const auto dim = shard_dim(row.output_layouts, mine.dim()))
    return accel::tp::reduce_scatter_to_sequence_parallel_region(mine, *dim, s.group);
  return accel::tp::reduce_from_parallel_region(mine, s.group);
}

// A column or row style's forward, marked for the CallWatch.
inline at::Tensor styled_pieces_forward(const Styled& s, const torch::nn::Module& module, const at::Tensor& x,
                                        const InUnit& in_unit) {
  at::Tensor out;
  if (const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(&module))
    out = styled_linear(s, *linear, x, in_unit);
  else out = styled_embedding(s, dynamic_cast<const torch::nn::EmbeddingImpl&>(module), x, in_unit);
  if (out.requires_grad() && at::GradMode::is_enabled()) {
    std::vector<at::Tensor> split;
    for (const auto& piece : styled_split_parameters(s, module))
      if (piece.tensor.requires_grad()) split.push_back(piece.tensor);
    if (!split.empty())
      out.register_hook([watch = s.watch, split = std::move(split)](const at::Tensor& grad) {
        watch->mark(split);
        return grad;
      });
  }
  return out;
}

// The module's forward with its style applied, if a plan gave it one.
// `unit(fn, args...)` runs fn(args...) inside the module's FULL_SHARD unit
// (plainly when it is none); `forward(args...)` is the module's forward.
// An unstyled module, a SequenceParallel one (its style is in the layouts
// around it) and PrepareModuleInput's (its inputs moved first) run their
// forward in the unit; a column or row style computes its pieces in it.
template <class Unit, class Forward, class... Args>
auto styled_forward(const torch::nn::Module& module, Unit&& unit, Forward&& forward, Args&&... args) {
  using Out = decltype(unit(forward, std::forward<Args>(args)...));
  const std::shared_ptr<const Styled> styled = StyledRegistry::instance().find(&module);
  if (!styled || std::holds_alternative<accel::tp::SequenceParallel>(styled->style))
    return unit(forward, std::forward<Args>(args)...);
  if (const auto* prepare = std::get_if<accel::tp::PrepareModuleInput>(&styled->style)) {
    const auto enter = [&]<std::size_t I, class A>(A&& a) -> decltype(auto) {
      if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
        if (I < prepare->input_layouts.size() && prepare->input_layouts[I] && prepare->desired_input_layouts[I])
          return move_layout(*styled, I, a, *prepare->input_layouts[I], *prepare->desired_input_layouts[I]);
        return at::Tensor(a);
      } else {
        return std::forward<A>(a);
      }
    };
    return [&]<std::size_t... I>(std::index_sequence<I...>) -> Out {
      return unit(forward, enter.template operator()<I>(std::forward<Args>(args))...);
    }(std::index_sequence_for<Args...>{});
  }
  // Column and row styles apply to a Linear or an Embedding (parallelize_module checked): one tensor in, one out.
  if constexpr (sizeof...(Args) == 1 && (std::is_same_v<std::decay_t<Args>, at::Tensor> && ...) &&
                std::is_same_v<Out, at::Tensor>) {
    const InUnit in_unit = [&unit](const std::function<at::Tensor(const at::Tensor&)>& compute, const at::Tensor& x) {
      return unit(compute, x);
    };
    return styled_pieces_forward(*styled, module, args..., in_unit);
  } else {
    throw LogicError("accel::tp: " + styled->who() + " takes one tensor and returns one");
  }
}
}  // namespace detail::tp

ACCEL_NAMESPACE_END

// == accel/training/tp/plan.hpp ===============================================
// accel/training/tp/plan.hpp: tp::parallelize_module, torch's plan of parallel styles applied to a plain model's Linear and Embedding layers, norms and blocks.
//
//     accel::tp::parallelize_module(*model, {
//         {"embed", accel::tp::RowwiseParallel{.input_layouts = accel::tp::Replicate{},
//                                              .output_layouts = accel::tp::Shard{1}}},
//         {"layers.*.attention_norm", accel::tp::SequenceParallel{}},
//         {"layers.*.attention", accel::tp::PrepareModuleInput{{accel::tp::Shard{1}}, {accel::tp::Replicate{}}}},
//         {"layers.*.attention.wq", accel::tp::ColwiseParallel{}},
//         {"layers.*.attention.wo", accel::tp::RowwiseParallel{.output_layouts = accel::tp::Shard{1}}},
//     });
//
// Each key names submodules as torch's do (dotted names; `*` within a part
// matches any characters of that part); each matched module takes its style:
// a column or row style narrows a torch::nn::Linear's or Embedding's
// parameters to this rank's piece, in place (the same tensors, so tied
// weights stay tied: narrow them the same way), and a SequenceParallel
// module's parameters are listed for the partial-gradient sum. The model's
// forward then calls each styled module through accel::unit_forward (the
// call FULL_SHARD's units already take), which applies its style.
// Everything is checked before anything changes; every mistake is an
// InvalidArgument naming the plan's key or the module.

ACCEL_NAMESPACE_BEGIN

namespace detail::tp {
// torch's plan keys: the same number of dotted parts, each matched with `*`
// standing for any characters.
inline bool part_matches(std::string_view pattern, std::string_view part) {
  if (pattern.empty()) return part.empty();
  if (pattern.front() == '*')
    for (std::size_t skip = 0; skip <= part.size(); ++skip)
      if (part_matches(pattern.substr(1), part.substr(skip))) return true;
  return !part.empty() && pattern.front() == part.front() && pattern.front() != '*' &&
         part_matches(pattern.substr(1), part.substr(1));
}
inline bool name_matches(const std::string& pattern, const std::string& name) {
  const auto split = [](const std::string& s) {
    std::vector<std::string_view> parts;
    std::size_t from = 0;
    for (std::size_t dot; (dot = s.find('.', from)) != std::string::npos; from = dot + 1)
      parts.emplace_back(s.data() + from, dot - from);
    parts.emplace_back(s.data() + from, s.size() - from);
    return parts;
  };
  const auto p = split(pattern), n = split(name);
  if (p.size() != n.size()) return false;
  for (std::size_t i = 0; i < p.size(); ++i)
    if (!part_matches(p[i], n[i])) return false;
  return true;
}

enum class ModuleKind { linear, embedding, other };

// One matched module and its style, checked; the tensors it narrows with their dimensions.
struct PlannedModule {
  std::string key, name;
  std::shared_ptr<torch::nn::Module> module;
  accel::tp::ParallelStyle style;
  ModuleKind kind = ModuleKind::other;
  std::vector<std::pair<at::Tensor, int64_t>> narrowed;
  int64_t whole_features = 0;
};

inline void check_plan_entry(PlannedModule& m, int parts) {
  const std::string who =
      "accel::tp::parallelize_module: '" + m.name + "' (" + style_name(m.style) + ", key '" + m.key + "')";
  if (dynamic_cast<const ParallelLayer*>(m.module.get()))
    throw InvalidArgument(who + " is an accel::tp layer, already split over its group");
  if (StyledRegistry::instance().find(m.module.get()))
    throw InvalidArgument(who + " already has a parallel style (parallelize_module was applied to it before)");
  if (const auto* prepare = std::get_if<accel::tp::PrepareModuleInput>(&m.style)) {
    if (prepare->input_layouts.size() != prepare->desired_input_layouts.size())
      throw InvalidArgument(who + ": input_layouts has " + std::to_string(prepare->input_layouts.size()) +
                            " entries and desired_input_layouts " +
                            std::to_string(prepare->desired_input_layouts.size()) + "; give both for each input");
    return;
  }
  if (std::holds_alternative<accel::tp::SequenceParallel>(m.style)) return;
  const bool col = std::holds_alternative<accel::tp::ColwiseParallel>(m.style);
  // The layout that meets the split dimension: Colwise's output, Rowwise's input.
  const accel::tp::Layout& last = col ? std::get<accel::tp::ColwiseParallel>(m.style).output_layouts
                                      : std::get<accel::tp::RowwiseParallel>(m.style).input_layouts;
  if (const auto* shard = std::get_if<accel::tp::Shard>(&last); shard && shard->dim != -1)
    throw InvalidArgument(who + ": its " + (col ? "output_layouts " : "input_layouts ") + describe(last) +
                          " must be Shard(-1) (the last dimension, split by the layer) or Replicate()");
  const auto piece = [&](int64_t whole, const char* what) {
    if (whole % parts != 0)
      throw InvalidArgument(who + ": " + what + " " + std::to_string(whole) + " does not split into " +
                            std::to_string(parts) + " equal pieces (the tensor-parallel group's size)");
  };
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(m.module.get())) {
    m.kind = ModuleKind::linear;
    const int64_t out = linear->weight.size(0), in = linear->weight.size(1);
    m.whole_features = in;
    if (col) {
      piece(out, "out_features");
      m.narrowed.emplace_back(linear->weight, 0);
      if (linear->bias.defined()) m.narrowed.emplace_back(linear->bias, 0);
    } else {
      piece(in, "in_features");
      m.narrowed.emplace_back(linear->weight, 1);
    }
  } else if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(m.module.get())) {
    m.kind = ModuleKind::embedding;
    if (embedding->options.max_norm())
      throw InvalidArgument(who + ": max_norm renormalizes whole rows in place; a split table cannot");
    m.whole_features = embedding->weight.size(0);
    if (col) {
      piece(embedding->weight.size(1), "embedding_dim");
      m.narrowed.emplace_back(embedding->weight, 1);
    } else {
      if (embedding->options.scale_grad_by_freq())
        throw InvalidArgument(who + ": scale_grad_by_freq counts the ids a rank's rows do not hold");
      piece(embedding->weight.size(0), "num_embeddings");
      m.narrowed.emplace_back(embedding->weight, 0);
    }
  } else {
    throw InvalidArgument(who + " applies to a torch::nn::Linear or Embedding; this module is " + m.module->name());
  }
  // Whatever already holds a tensor's gradient slot holds it with the whole shape: a graph kept from an
  // earlier forward (its backward would fail), a data-parallel wrapper (its buckets and its view of which
  // tensors are split would be wrong: Accelerator::prepare or DataParallel made before the plan).
  for (const auto& [tensor, dim] : m.narrowed)
    if (torch::autograd::impl::try_get_grad_accumulator(tensor))
      throw InvalidArgument(who +
                            ": its weight's gradient is already wired: an autograd graph of an earlier "
                            "forward still alive, or a data-parallel wrapper (Accelerator::prepare, "
                            "DataParallel) made before the plan; apply the plan first");
}
}  // namespace detail::tp

namespace tp {
// Applies `plan` to `model` over `group` (null: the process's Dim::TP
// group): see this part's opening comment. Call it before making the
// optimizer (the narrowed parameters change shape), and with the same
// random state on every rank of the group where the layers' initial values
// matter (each keeps its piece of the same whole tensor). On a group of one
// the plan is checked and nothing else changes.
inline void parallelize_module(torch::nn::Module& model, const std::map<std::string, ParallelStyle>& plan,
                               const GroupPtr& group = {}) {
  const GroupPtr g = detail::tp::group_or_default(group, "parallelize_module");
  const int parts = detail::tp::size_of(g), rank = detail::tp::rank_in(g);
  const auto named = model.named_modules("", /*include_self=*/false);
  std::vector<detail::tp::PlannedModule> planned;
  std::unordered_map<const torch::nn::Module*, std::string> styled_by;  // module -> the key that styled it
  for (const auto& [key, style] : plan) {
    bool matched = false;
    for (const auto& item : named) {
      if (!detail::tp::name_matches(key, item.key())) continue;
      matched = true;
      const auto [at, fresh] = styled_by.emplace(item.value().get(), key);
      if (!fresh)
        throw InvalidArgument("accel::tp::parallelize_module: '" + item.key() + "' is matched by the keys '" +
                              at->second + "' and '" + key + "'; give each module one style");
      planned.push_back({key, item.key(), item.value(), style, detail::tp::ModuleKind::other, {}, 0});
    }
    if (!matched) {
      std::string names;
      for (std::size_t i = 0; i < named.size() && i < 8; ++i) names += (i ? ", '" : "'") + named[i].key() + "'";
      throw InvalidArgument("accel::tp::parallelize_module: the plan's key '" + key +
                            "' matches no submodule of the model (" +
                            (named.is_empty() ? std::string("it has none")
                                              : "its submodules: " + names + (named.size() > 8 ? ", ..." : "")) +
                            ")");
    }
  }
  for (auto& m : planned) detail::tp::check_plan_entry(m, parts);
  // A tensor two styles narrow (a tied embedding and head) must be split the same way by both.
  std::unordered_map<const c10::TensorImpl*, std::pair<int64_t, std::string>> split_dim_of;
  for (const auto& m : planned)
    for (const auto& [tensor, dim] : m.narrowed) {
      const auto [at, fresh] = split_dim_of.emplace(tensor.unsafeGetTensorImpl(), std::pair{dim, m.name});
      if (!fresh && at->second.first != dim)
        throw InvalidArgument("accel::tp::parallelize_module: '" + m.name + "' and '" + at->second.second +
                              "' share a weight and split it along different dimensions (" + std::to_string(dim) +
                              " and " + std::to_string(at->second.first) + ")");
    }
  if (parts == 1) return;

  const auto watch = std::make_shared<detail::tp::CallWatch>();
  std::unordered_set<const c10::TensorImpl*> narrowed, watched;
  for (auto& m : planned) {
    {
      const at::NoGradGuard no_grad;
      for (auto& [tensor, dim] : m.narrowed) {
        if (!narrowed.insert(tensor.unsafeGetTensorImpl()).second) continue;  // tied: narrowed once
        const int64_t length = tensor.size(dim) / parts;
        tensor.set_data(tensor.detach().narrow(dim, rank * length, length).clone());
      }
    }
    auto styled = std::make_shared<detail::tp::Styled>();
    styled->name = m.name;
    styled->style = m.style;
    styled->group = g;
    styled->module = m.module;
    styled->watch = watch;
    styled->whole_features = m.whole_features;
    if (m.kind == detail::tp::ModuleKind::embedding && std::holds_alternative<RowwiseParallel>(m.style))
      styled->vocab_start = rank * (m.whole_features / parts);
    for (auto [p, dim] : detail::tp::styled_split_parameters(*styled, *m.module)) {
      if (!p.requires_grad() || !watched.insert(p.unsafeGetTensorImpl()).second) continue;  // (tied: once)
      watch->watch(p, styled->who());
      p.register_hook([watch, impl = p.unsafeGetTensorImpl()](const at::Tensor&) { watch->take(impl); });
    }
    detail::tp::StyledRegistry::instance().add(std::move(styled));
  }
}
}  // namespace tp

ACCEL_NAMESPACE_END

// == accel/training/pp/microbatches.hpp =======================================
// accel/training/pp/microbatches.hpp: a batch cut into a pipeline's micro-batches along its first dimension, and the last stage's outputs put back together.
//
// torch's schedules cut step()'s inputs and target with
// split_args_kwargs_into_chunks (torch.tensor_split along dimension 0) and
// merge the last stage's outputs with torch.cat. torch.tensor_split accepts
// a batch that does not divide evenly and makes micro-batches of two sizes;
// here that is an error naming the numbers, before anything is sent: every
// micro-batch of a step has one shape, so a stage's activation can be
// received into a buffer sized once per step (training/pp/messages.hpp),
// and the loss of each micro-batch weighs the same in the step's mean
// (docs/differences.md).

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
inline std::vector<at::Tensor> split_microbatches(const at::Tensor& batch, int microbatches, const char* what) {
  if (!batch.defined())
    throw InvalidArgument(std::string("accel::pp: step() needs the ") + what +
                          " here (this rank holds the pipeline's " +
                          (std::string_view(what) == "inputs" ? "first" : "last") + " stage)");
  if (batch.dim() == 0 || batch.size(0) % microbatches != 0 || batch.size(0) == 0)
    throw InvalidArgument(std::string("accel::pp: the ") + what + "' batch of " +
                          (batch.dim() == 0 ? std::string("a 0-dimensional tensor") : std::to_string(batch.size(0))) +
                          " rows does not cut into " + std::to_string(microbatches) +
                          " micro-batches of equal size (dimension 0 must be a positive multiple of " +
                          std::to_string(microbatches) + ")");
  return batch.chunk(microbatches, 0);
}
}  // namespace detail::pp

ACCEL_NAMESPACE_END

// == accel/training/pp/messages.hpp ===========================================
// accel/training/pp/messages.hpp: the activations and gradients a pipeline step sends between ranks, the receives posted in the order the senders send, and each stage's input shape told once per step.
//
// A stage's activation goes to the next stage's rank, and its input's
// gradient back to the stage before's, point to point on the pipeline
// group (torch's PipelineStage does the same with isend/irecv). A receive
// needs a buffer of the right shape before the message arrives; torch infers
// the shapes once by running the stages on meta tensors. Here the sender
// tells them instead: with a stage's first activation of each step goes a
// header (its shape and dtype), so a receiver learns its input's shape from
// the data, whatever the batch this step, without running anything twice.
// Every micro-batch of a step has that shape (training/pp/microbatches.hpp;
// the sender checks each of its outputs against it). A gradient has the
// shape of the receiving stage's own output, known from its forward.
//
// The receives are posted in the order the lowered schedule lists them
// (core/pipeline_lowering.hpp), which is the order the senders send them:
// messages between two ranks then match in order whatever the backend (NCCL
// ignores tags). A receive whose shape is not known yet (its header has not
// arrived) holds the ones after it back; they are posted when a
// computation needs one of them, after waiting for the headers before it,
// which their senders sent earlier in the schedule, so the wait ends. Gloo's
// messages carry tags too, one per message, so a mistake shows as a wrong
// match nowhere.

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
inline constexpr const char* kPipelineSend = "pipeline send (point to point)";
inline constexpr const char* kPipelineReceive = "pipeline receive (point to point)";

// What a message holds: its shape and dtype, sent ahead of a stage's first
// activation of a step as kHeaderLength int64s (the number of dimensions,
// the sizes, the dtype).
struct TensorMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
};
inline TensorMeta meta_of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type()}; }
inline std::string to_string(const TensorMeta& m) {
  std::string text = std::string(c10::toString(m.dtype)) + "[";
  for (std::size_t i = 0; i < m.sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(m.sizes[i]);
  return text + "]";
}
inline constexpr int64_t kHeaderLength = 16;
inline at::Tensor header_of(const TensorMeta& m, c10::Device device) {
  if (static_cast<int64_t>(m.sizes.size()) > kHeaderLength - 2)
    throw InvalidArgument("accel::pp: a stage's output has " + std::to_string(m.sizes.size()) +
                          " dimensions; what passes between stages may have at most " +
                          std::to_string(kHeaderLength - 2));
  std::vector<int64_t> fields(kHeaderLength, 0);
  fields[0] = static_cast<int64_t>(m.sizes.size());
  std::copy(m.sizes.begin(), m.sizes.end(), fields.begin() + 1);
  fields[static_cast<std::size_t>(kHeaderLength - 1)] = static_cast<int64_t>(m.dtype);
  return at::tensor(fields, at::kLong).to(device);
}
inline TensorMeta meta_of_header(const at::Tensor& header) {
  const at::Tensor h = header.cpu();
  const int64_t* f = h.data_ptr<int64_t>();
  return {std::vector<int64_t>(f + 1, f + 1 + f[0]), static_cast<at::ScalarType>(f[kHeaderLength - 1])};
}

// A message's tag on a Gloo group: one per (kind, receiving stage, micro-batch).
enum class Message { activation, gradient, header };
inline int tag_of(Message kind, int receiving_stage, int microbatch, int num_stages) {
  return ((microbatch * num_stages + receiving_stage) * 3 + static_cast<int>(kind)) + 1;
}

// Messages of failed steps, never waited for (~Mailbox says why); never
// freed either, not even at exit, where a Work's destructor could wait.
inline void abandon(c10::intrusive_ptr<c10d::Work> work) {
  static auto* mutex = new std::mutex;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>;
  const std::lock_guard<std::mutex> lock(*mutex);
  kept->push_back(std::move(work));
}

// One step's messages on this rank.
class Mailbox {
 public:
  Mailbox(c10d::ProcessGroup& group, c10::Device device, int num_stages)
      : group_(group), device_(device), num_stages_(num_stages) {}
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;
  // A failed step leaves messages in flight: a receive its peer will never
  // send (the peer failed too, or waits on this rank), sends nobody receives.
  // Waiting for each would take the group's timeout per message, so they are
  // abandoned (training/pp's failed steps only): their Work, which holds the
  // tensor the message reads or fills, is kept for the rest of the process,
  // so a message that lands late writes into memory still owned by nobody
  // else. The group is not usable for pipeline messages after that; the
  // error the step throws says which message failed.
  ~Mailbox() {
    for (auto* list : {&sends_, &receives_})
      for (auto& e : *list)
        if (e.work && !e.work->isCompleted()) abandon(std::move(e.work));
  }

  void send(Message kind, const at::Tensor& t, int to, int receiving_stage, int microbatch) {
    Entry e{kind, receiving_stage, microbatch, to, t.contiguous(), {}, {}};
    std::vector<at::Tensor> tensors{e.tensor};
    const int tag = tag_of(kind, receiving_stage, microbatch, num_stages_);
    e.work = issue(kPipelineSend, group_, [&] { return group_.send(tensors, to, tag); });
    sends_.push_back(std::move(e));
  }
  // The receives, listed in schedule order: a stage's header, an activation
  // (its shape from the stage's header this step), a gradient (its shape
  // given).
  void receive_header(int stage, int from) { enqueue({Message::header, stage, 0, from, {}, {}, TensorMeta{}}); }
  void receive_activation(int stage, int microbatch, int from) {
    enqueue({Message::activation, stage, microbatch, from, {}, {}, std::nullopt});
  }
  void receive_gradient(int stage, int microbatch, int from, const TensorMeta& meta) {
    enqueue({Message::gradient, stage, microbatch, from, {}, {}, meta});
  }
  // What a stage received this step, waited for (each message taken once).
  at::Tensor take(Message kind, int stage, int microbatch) {
    for (std::size_t i = 0; i < receives_.size(); ++i) {
      if (receives_[i].kind != kind || receives_[i].stage != stage || receives_[i].microbatch != microbatch ||
          receives_[i].taken)
        continue;
      while (next_ <= i) post_next(/*waiting=*/true);
      Entry& e = receives_[i];
      wait(kPipelineReceive, *e.work);  // (a failed one stays: ~Mailbox abandons it)
      e.work.reset();
      e.taken = true;
      return std::move(e.tensor);
    }
    throw LogicError("accel::pp: stage " + std::to_string(stage) + " takes a message for micro-batch " +
                     std::to_string(microbatch) + " it never listed");
  }
  // The shape a stage's input has this step, once its header came.
  std::optional<TensorMeta> input_meta(int stage) const {
    const auto it = input_meta_.find(stage);
    return it == input_meta_.end() ? std::nullopt : std::optional<TensorMeta>(it->second);
  }
  // Every send landed (the step's last act).
  void finish() {
    for (auto& e : sends_) {
      wait(kPipelineSend, *e.work);
      e.work.reset();
    }
    sends_.clear();
  }

 private:
  struct Entry {
    Message kind;
    int stage, microbatch, peer;
    at::Tensor tensor;
    c10::intrusive_ptr<c10d::Work> work;
    std::optional<TensorMeta> meta;  // an activation's: from its stage's header
    bool taken = false;
  };
  void enqueue(Entry e) {
    receives_.push_back(std::move(e));
    while (next_ < receives_.size() && post_next(/*waiting=*/false)) {
    }
  }
  // Posts the first receive not posted yet; an activation's shape from its
  // stage's header, waited for only when `waiting`. Whether it posted.
  bool post_next(bool waiting) {
    Entry* e = &receives_[next_];
    if (!e->meta) e->meta = input_meta(e->stage);
    if (!e->meta) {
      if (!waiting) return false;
      const int stage = e->stage;
      input_meta_[stage] = meta_of_header(take(Message::header, stage, 0));  // (posts what is before it)
      e = &receives_[next_];
      e->meta = input_meta_[stage];
    }
    const bool header = e->kind == Message::header;
    e->tensor = at::empty(header ? std::vector<int64_t>{kHeaderLength} : e->meta->sizes,
                          at::TensorOptions(header ? at::kLong : e->meta->dtype).device(device_));
    std::vector<at::Tensor> tensors{e->tensor};
    const int tag = tag_of(e->kind, e->stage, e->microbatch, num_stages_);
    e->work = issue(kPipelineReceive, group_, [&] { return group_.recv(tensors, e->peer, tag); });
    ++next_;
    return true;
  }

  // A message waited for, by the group's timeout on Gloo (a peer that failed
  // and lives on never sends; one that died fails the wait at once).
  void wait(const char* op, c10d::Work& work) {
    bool done = false;
    try {
      done = wait_bounded(op, group_, work);
    } catch (const std::exception& e) {
      throw failure(op, group_, e);
    }
    if (!done) throw failure(op, group_, std::runtime_error("the message was aborted"));
  }

  c10d::ProcessGroup& group_;
  c10::Device device_;
  int num_stages_;
  std::vector<Entry> sends_;
  std::vector<Entry> receives_;  // every receive of the step, in schedule order
  std::size_t next_ = 0;         // the first not posted yet
  std::map<int, TensorMeta> input_meta_;
};
}  // namespace detail::pp

ACCEL_NAMESPACE_END

// == accel/training/precision/autocast.hpp ====================================
// accel/training/precision/autocast.hpp: AutocastGuard: LibTorch's autocast on for a scope, in the configured precision.
//
// Accelerator::autocast() returns one (Accelerator::AutocastGuard is this
// type); accel::checkpoint restores a forward's autocast state for its
// recomputation through AutocastScope. LibTorch's autocast switches changed
// names in 2.4; this is the one place that knows both.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// LibTorch's autocast switches for one device type. LibTorch 2.4 took the
// device type as an argument (and deprecated the per-device functions that
// 1.x and 2.0-2.3 have).
#if ACCEL_TORCH_AT_LEAST(2, 4)
inline bool autocast_enabled(c10::DeviceType type) { return at::autocast::is_autocast_enabled(type); }
inline at::ScalarType autocast_dtype(c10::DeviceType type) { return at::autocast::get_autocast_dtype(type); }
inline void set_autocast(c10::DeviceType type, bool on, at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, on);
}
#else
inline bool autocast_enabled(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline at::ScalarType autocast_dtype(c10::DeviceType type) {
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
}
inline void set_autocast(c10::DeviceType type, bool on, at::ScalarType dtype) {
  if (type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(on);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(on);
  }
}
#endif

// Autocast on one device type set to `on` in `dtype` for a scope, and put
// back as it was after (its cache of cast weights cleared where this scope
// turned it on, as torch.autocast's exit does).
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType type, bool on, at::ScalarType dtype)
      : type_(type), saved_enabled_(autocast_enabled(type)), saved_dtype_(autocast_dtype(type)) {
    set_autocast(type_, on, dtype);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;
  ~AutocastScope() {
    if (!saved_enabled_ && autocast_enabled(type_)) at::autocast::clear_cache();
    set_autocast(type_, saved_enabled_, saved_dtype_);
  }

 private:
  c10::DeviceType type_;
  bool saved_enabled_;
  at::ScalarType saved_dtype_;
};

// RAII autocast for the configured mixed precision: bf16 on the CPU
// through LibTorch's autocast; a no-op for "no".
class AutocastGuard {
 public:
  explicit AutocastGuard(const std::string& mixed_precision, c10::Device device) {
    if (mixed_precision != "no")
      scope_.emplace(device.type(), true, mixed_precision == "fp16" ? at::kHalf : at::kBFloat16);
  }

 private:
  std::optional<AutocastScope> scope_;
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/precision/grad_scaler.hpp =================================
// accel/training/precision/grad_scaler.hpp: GradScaler: dynamic loss scaling for fp16 training, as torch.amp.GradScaler.
//
// fp16 holds numbers down to about 6e-8; small gradients underflow to zero
// in it. Loss scaling multiplies the loss by a large factor before the
// backward (so the gradients are large enough for fp16), divides the
// gradients by it again before the optimizer sees them, skips the step when
// any gradient overflowed to inf or NaN (and halves the factor), and grows
// the factor after a run of good steps. LibTorch's C++ API has the kernels
// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_) but no
// GradScaler; this is Python's, with its defaults and its order of calls.
// The Accelerator makes one for mixed_precision "fp16" (Accelerate does the
// same), and it can be used alone.

ACCEL_NAMESPACE_BEGIN

// Accelerate's GradScalerKwargs: the loss scaler's settings, with
// torch.amp.GradScaler's defaults (AcceleratorConfig::grad_scaler).
struct GradScalerKwargs {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;   // the scale is multiplied by this after growth_interval good steps in a row
  double backoff_factor = 0.5;  // ... and by this after a step with an inf or NaN gradient (which is skipped)
  int64_t growth_interval = 2000;
  bool enabled = true;  // false: scale() and unscale_() do nothing, step() always steps
};

class GradScaler {
 public:
  // device: where the scale lives (the gradients' device); group: when
  // given, a step is skipped on every process if any process saw an inf or
  // NaN (needed where processes hold different gradients, as under
  // sharding: FSDP's ShardedGradScaler does the same).
  explicit GradScaler(GradScalerKwargs kwargs = {}, c10::Device device = c10::kCPU, GroupPtr group = {})
      : kwargs_(kwargs), group_(std::move(group)) {
    if (!(kwargs.init_scale > 0) || !(kwargs.growth_factor > 1) || !(kwargs.backoff_factor > 0) ||
        !(kwargs.backoff_factor < 1) || kwargs.growth_interval < 1)
      throw InvalidArgument(
          "accel::GradScaler: needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= "
          "1 (torch.amp.GradScaler's rules)");
#if !ACCEL_TORCH_AT_LEAST(2, 4)
    // LibTorch 1.13 has the two _amp_ kernels for CUDA only (2.6 and 2.15
    // have CPU ones too; 2.4 is the oldest this is allowed on, unchecked).
    if (kwargs.enabled && device.is_cpu())
      throw InvalidArgument("accel::GradScaler: on the CPU it needs LibTorch 2.4 or newer; this is " +
                            std::string(TORCH_VERSION));
#endif
    const auto options = at::TensorOptions().device(device);
    scale_ = at::full({1}, kwargs.init_scale, options.dtype(at::kFloat));
    growth_tracker_ = at::zeros({1}, options.dtype(at::kInt));
  }

  bool is_enabled() const { return kwargs_.enabled; }
  // The loss times the current scale (the loss itself when disabled).
  at::Tensor scale(const at::Tensor& loss) const {
    if (!kwargs_.enabled) return loss;
    return loss * scale_.to(loss.device(), /*non_blocking=*/true).reshape({});
  }
  // Divides the gradients of `optimizer`'s parameters by the scale, in
  // place, and notes whether any is inf or NaN. At most once per optimizer
  // between two update() calls (call it before clipping gradients).
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!kwargs_.enabled) return;
    auto& state = states_[&optimizer];
    if (state.unscaled)
      throw LogicError("accel::GradScaler::unscale_: already called on this optimizer since the last update()");
    at::NoGradGuard no_grad;
    const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    state.found_inf = at::zeros({1}, scale_.options().dtype(at::kFloat));
    // The kernel takes gradients of one device and dtype at a time (Python groups them the same way).
    std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
    for (auto& group : optimizer.param_groups())
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        if (p.grad().is_sparse())
          throw InvalidArgument("accel::GradScaler::unscale_: sparse gradients are not supported");
        if (p.grad().scalar_type() == at::kHalf)
          throw InvalidArgument(
              "accel::GradScaler::unscale_: a gradient is fp16 (Python: \"Attempting to unscale FP16 gradients\"); "
              "keep the parameters in fp32 and let autocast compute in fp16");
        groups[{p.grad().device().str(), static_cast<int>(p.grad().scalar_type())}].push_back(p.grad());
      }
    for (auto& [key, grads] : groups) {
      at::Tensor found = at::zeros({1}, grads.front().options().dtype(at::kFloat));
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(grads.front().device()));
      state.found_inf.add_(found.to(state.found_inf.device()));
    }
    if (group_) accel::all_reduce(state.found_inf, ReduceOp::MAX, group_);
    state.unscaled = true;
  }
  // Unscales (unless unscale_ was called) and steps the optimizer unless a
  // gradient was inf or NaN. Returns whether it stepped. Reads one number
  // from the device, as Python's does.
  bool step(torch::optim::Optimizer& optimizer) {
    if (!kwargs_.enabled) {
      optimizer.step();
      return true;
    }
    auto& state = states_[&optimizer];
    if (state.stepped)
      throw LogicError("accel::GradScaler::step: already called on this optimizer since the last update()");
    if (!state.unscaled) unscale_(optimizer);
    state.stepped = true;
    if (state.found_inf.item<float>() != 0) return false;
    optimizer.step();
    return true;
  }
  // After the steps of an iteration: halves (backoff_factor) the scale if
  // any stepped optimizer saw an inf or NaN, else counts a good step and
  // grows the scale after growth_interval of them in a row.
  void update() {
    if (!kwargs_.enabled) return;
    at::Tensor found_inf = at::zeros({1}, scale_.options());
    bool any = false;
    for (auto& [optimizer, state] : states_)
      if (state.unscaled) {
        found_inf.add_(state.found_inf.to(scale_.device()));
        any = true;
      }
    states_.clear();
    if (!any) return;  // nothing was unscaled since the last update: nothing to learn from (Python asserts)
    at::_amp_update_scale_(scale_, growth_tracker_, found_inf, kwargs_.growth_factor, kwargs_.backoff_factor,
                           kwargs_.growth_interval);
  }

  double get_scale() const { return kwargs_.enabled ? scale_.item<double>() : 1.0; }
  // The good steps in a row since the scale last changed.
  int64_t growth_tracker() const { return growth_tracker_.item<int64_t>(); }
  // For checkpoints (Accelerate saves the scaler's state_dict: scale and
  // growth tracker).
  void load_state(double scale, int64_t growth_tracker) {
    scale_.fill_(scale);
    growth_tracker_.fill_(growth_tracker);
    states_.clear();
  }

 private:
  struct OptimizerState {
    bool unscaled = false, stepped = false;
    at::Tensor found_inf;  // > 0: some gradient was inf or NaN
  };
  GradScalerKwargs kwargs_;
  GroupPtr group_;
  at::Tensor scale_, growth_tracker_;
  std::map<const torch::optim::Optimizer*, OptimizerState> states_;
};

ACCEL_NAMESPACE_END

// == accel/training/precision/policy.hpp ======================================
// accel/training/precision/policy.hpp: MixedPrecisionPolicy: the dtypes fully sharded units compute and reduce in, as FSDP2's.
//
// FSDP2's MixedPrecisionPolicy (fully_shard's mp_policy; Accelerate's
// FullyShardedDataParallelPlugin.mixed_precision_policy). The parameters,
// their shards, gradients and optimizer state keep their own dtype (fp32
// masters); what changes is what travels and computes:
// - param_dtype: each unit's parameters are all-gathered in this dtype (half
//   the bytes of fp32 for bf16) and hold it while the unit runs, so its
//   forward and backward compute in it; between units and between steps the
//   parameters are at rest in their own dtype.
// - reduce_dtype: the gradients are reduce-scattered in this dtype, then
//   added to the shards' gradients in theirs. Unset: param_dtype, as FSDP2
//   (set it to the parameters' dtype, e.g. kFloat, for full-precision
//   reductions).
// - output_dtype: a unit's floating-point output is cast to this dtype
//   (FSDP2's output_dtype). Unset: it stays in the dtype the unit computed
//   in.
// - cast_forward_inputs: a unit's floating-point input tensors are cast to
//   the dtype its parameters hold (FSDP2's default).
// It applies to the units of FULL_SHARD and HYBRID_SHARD. Parameters in no
// unit (the root's own, a tied weight, which FSDP2 keeps in the root's
// group) are whole while the model runs and compute in their own dtype, as
// under FSDP2 a root given no policy of its own: a module there that meets
// a unit's bf16 output (GPT-2's tied head after the last unit) needs
// output_dtype = at::kFloat, or a cast of its own. The gradients of every
// parameter are reduced in reduce_dtype. Elsewhere mixed precision is
// mixed_precision = "bf16" (autocast). Where nothing is sharded (one
// process, mp_shard_size == 1) there is no gather to cast in, and the model
// trains in its own dtype.

ACCEL_NAMESPACE_BEGIN

struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype{};
  std::optional<c10::ScalarType> reduce_dtype{};
  std::optional<c10::ScalarType> output_dtype{};
  bool cast_forward_inputs = true;

  // Whether it changes anything (a dtype set).
  bool active() const { return param_dtype.has_value() || reduce_dtype.has_value() || output_dtype.has_value(); }
};

ACCEL_NAMESPACE_END

// == accel/training/optim/fused_adam.hpp ======================================
// accel/training/optim/fused_adam.hpp: Adam and AdamW stepped by LibTorch's fused kernels.
//
// torch::optim::Adam and AdamW step a parameter with about six tensor
// operations, each a pass over its memory, and a temporary the size of the
// parameter (the denominator); Python's Adam(fused=True) steps a group's
// parameters with one kernel (at::_fused_adam_, at::_fused_adamw_): one pass
// over each parameter, its gradient and its two moments, no temporary. The
// kernels run on CPUs since LibTorch 2.4 (on CUDA before). accel::FusedAdam
// and accel::FusedAdamW are LibTorch's optimizers with that step: the same
// options, the same state per parameter (AdamParamState, AdamWParamState:
// prepare(), sharding, checkpoints and torch::save see the originals), and the
// arithmetic of Python's fused=True, which rounds in another order than
// torch::optim::Adam (its parameters agree with Adam's to rounding, not bit
// for bit). Dense gradients of the parameter's own floating dtype. On
// LibTorch before 2.4 the constructor refuses, as Python's fused=True does on
// a CPU tensor there.

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline constexpr bool has_fused_adam = TORCH_VERSION_MAJOR > 2 ||
                                       (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4);

// A fused optimizer's first member: on a LibTorch without the kernels its
// construction fails, so no such optimizer exists to step.
struct FusedAdamSupport {
  explicit FusedAdamSupport(const char* name) {
    if (!has_fused_adam)
      throw RuntimeError(std::string(name) + " needs LibTorch 2.4 or newer (its fused Adam kernels); this is " +
                         std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
                         ": use torch::optim::" + (std::string_view(name).ends_with('W') ? "AdamW" : "Adam"));
  }
};

// One step of a fused Adam (decoupled: AdamW) over every group of
// `optimizer`, creating each parameter's state as LibTorch's own step does.
// Parameters are stepped in one kernel call per device, dtype and step count
// (a parameter that joined later has its own count); the kernel reads the
// count from a tensor on the parameter's device, kept in `steps` (one per
// device, refilled before each call: nothing is allocated per step).
template <bool decoupled, class Options, class ParamState>
void fused_adam_step(torch::optim::Optimizer& optimizer, std::vector<at::Tensor>& steps, const char* name) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  struct Call {
    c10::Device device;
    at::ScalarType dtype;
    int64_t step;
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  };
  auto step_tensor = [&](c10::Device device) -> at::Tensor& {
    for (auto& t : steps)
      if (t.device() == device) return t;
    return steps.emplace_back(at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device)));
  };
  // Every gradient of every group checked before anything steps: a refused step leaves it all as it was.
  for (const auto& group : optimizer.param_groups())
    for (std::size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (grad.is_sparse()) throw InvalidArgument(std::string(name) + " does not support sparse gradients");
      if (!p.is_floating_point() || grad.scalar_type() != p.scalar_type() || grad.device() != p.device())
        throw InvalidArgument(std::string(name) + ": parameter " + std::to_string(i) + " of its group is " +
                              std::string(c10::toString(p.scalar_type())) + " on " + p.device().str() +
                              " with a gradient of " + std::string(c10::toString(grad.scalar_type())) + " on " +
                              grad.device().str() +
                              " (the fused kernel takes floating parameters with gradients of their dtype and device)");
    }
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    std::vector<Call> calls;
    for (const at::Tensor& p : group.params()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      auto found = state.find(p.unsafeGetTensorImpl());
      if (found == state.end()) {  // as LibTorch's Adam::step makes it
        auto fresh = std::make_unique<ParamState>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (options.amsgrad()) fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        found = state.emplace(p.unsafeGetTensorImpl(), std::move(fresh)).first;
      }
      auto& s = static_cast<ParamState&>(*found->second);
      s.step(s.step() + 1);
      auto call = std::find_if(calls.begin(), calls.end(), [&](const Call& c) {
        return c.device == p.device() && c.dtype == p.scalar_type() && c.step == s.step();
      });
      if (call == calls.end())
        call = calls.insert(calls.end(), Call{p.device(), p.scalar_type(), s.step(), {}, {}, {}, {}, {}});
      call->params.push_back(p);
      call->grads.push_back(grad);
      call->exp_avgs.push_back(s.exp_avg());
      call->exp_avg_sqs.push_back(s.exp_avg_sq());
      if (options.amsgrad()) call->max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
    }
    const auto [beta1, beta2] = options.betas();
    for (auto& call : calls) {
      at::Tensor& step = step_tensor(call.device);
      step.fill_(static_cast<double>(call.step));
      const std::vector<at::Tensor> counts(call.params.size(), step);
      if constexpr (decoupled)
        at::_fused_adamw_(call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.max_exp_avg_sqs, counts,
                          options.lr(), beta1, beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                          /*maximize=*/false);
      else
        at::_fused_adam_(call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.max_exp_avg_sqs, counts,
                         options.lr(), beta1, beta2, options.weight_decay(), options.eps(), options.amsgrad(),
                         /*maximize=*/false);
    }
  }
#else
  (void)optimizer, (void)steps, (void)name;  // (the constructor has refused)
#endif
}

// LibTorch's optimizer Base (Adam; AdamW: decoupled) with the fused step.
template <class Base, bool decoupled>
class FusedAdamOf : public Base {
 public:
  using Base::Base;
  torch::Tensor step(typename Base::LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    using Options = std::conditional_t<decoupled, torch::optim::AdamWOptions, torch::optim::AdamOptions>;
    using ParamState = std::conditional_t<decoupled, torch::optim::AdamWParamState, torch::optim::AdamParamState>;
    fused_adam_step<decoupled, Options, ParamState>(*this, steps_, name);
    return loss;
  }

 private:
  static constexpr const char* name = decoupled ? "accel::FusedAdamW" : "accel::FusedAdam";
  FusedAdamSupport support_{name};
  std::vector<at::Tensor> steps_;  // the step count the kernel reads, one tensor per device
};
}  // namespace detail

// torch::optim::Adam with Python's fused step (above), constructed as Adam:
// accel::FusedAdam adam(model->parameters(), torch::optim::AdamOptions(1e-3)).
class FusedAdam : public detail::FusedAdamOf<torch::optim::Adam, false> {
 public:
  using FusedAdamOf::FusedAdamOf;
};
// torch::optim::AdamW (decoupled weight decay) with Python's fused step.
class FusedAdamW : public detail::FusedAdamOf<torch::optim::AdamW, true> {
 public:
  using FusedAdamOf::FusedAdamOf;
};

ACCEL_NAMESPACE_END

// == accel/training/data/sampler.hpp ==========================================
// accel/training/data/sampler.hpp: data loading: ShardSampler, which deals out each process's share of a dataset.
//
// A prepared loader gives each process of the data-parallel group its share
// of a dataset, in one of two layouts:
//   BATCHES (default, Accelerate's BatchSamplerShard): the one-process batch
//     sequence (the dataset in order, or permuted with randperm under a
//     generator seeded with seed + epoch, cut into batches) is dealt out
//     whole: process p gets batches p, p + P, p + 2P, ... (with
//     split_batches, every process gets its 1/P slice of every batch). So
//     without shuffle a gathered pass is the dataset in order. even_batches
//     completes the last round by cycling from the start of the sequence;
//     without it the last round may leave some processes a batch short.
//   SAMPLES (torch's DistributedSampler, for the same seed and epoch):
//     process p gets samples p, p + P, ... of the permutation, batched
//     locally; even_batches repeats samples from the start so that every
//     process gets as many.
// drop_last drops the incomplete last batch (BATCHES: of the sequence, and
// then any round that is not complete; SAMPLES: of each process).
// Every slot knows whether it repeats a sample (even_batches padding), so
// gather_for_metrics counts each sample exactly once.
//
// Why not LibTorch's DistributedRandomSampler? It shuffles with std::shuffle,
// whose output differs between standard libraries (ranks built against
// libstdc++ and libc++ would read overlapping shards), and it scatters the
// repeated samples through the shards, so they could not be told apart.

ACCEL_NAMESPACE_BEGIN

enum class ShardLayout { BATCHES, SAMPLES };
namespace detail {
template <>
struct enum_names<ShardLayout> {
  static constexpr std::string_view type = "ShardLayout";
  static constexpr std::array<std::string_view, 2> names{"BATCHES", "SAMPLES"};
};
}  // namespace detail

// The one-process batch sequence of an epoch, as lists of sample indices:
// a custom sampler or batch sampler for prepare_data_loader.
using BatchSamplerFn = std::function<std::vector<std::vector<size_t>>(size_t epoch)>;

namespace detail {
struct Slot {
  size_t index;
  bool real;  // false: a repeat that fills the last batches (even_batches)
};
using SlotBatch = std::vector<Slot>;

// v += v: v followed by itself, as Python's list doubling (a vector
// cannot insert its own range).
template <class T>
void append_self(std::vector<T>& v) {
  const std::vector<T> copy = v;
  v.insert(v.end(), copy.begin(), copy.end());
}

inline SlotBatch slots(const std::vector<size_t>& indices, bool real, size_t from = 0, size_t to = SIZE_MAX) {
  SlotBatch out;
  for (size_t i = from; i < std::min(to, indices.size()); ++i) out.push_back({indices[i], real});
  return out;
}

// Accelerate's BatchSamplerShard, line by line (src/accelerate/data_loader.py),
// over the one-process batch sequence `batches`: this process's batches.
// batch_size is the sampler's (nullopt: batches of varying size).
inline std::vector<SlotBatch> shard_batches(const std::vector<std::vector<size_t>>& batches,
                                            std::optional<size_t> batch_size, size_t processes, size_t process,
                                            bool split_batches, bool even_batches, bool drop_last) {
  std::vector<SlotBatch> out;
  if (processes == 1) {  // Accelerate does not shard for one process: the plain batches
    for (const auto& batch : batches) out.push_back(slots(batch, true));
    return out;
  }
  if (batches.empty()) return out;
  if (split_batches) {  // _iter_with_split
    const size_t size = *batch_size, part = size / processes;
    for (const auto& batch : batches)
      if (batch.size() == size) out.push_back(slots(batch, true, part * process, part * (process + 1)));
    const std::vector<size_t>& last = batches.back();
    if (drop_last || last.size() >= size) return out;
    if (!even_batches) {
      if (last.size() > part * process) out.push_back(slots(last, true, part * process, part * (process + 1)));
      return out;
    }
    std::vector<size_t> initial = batches.front();
    while (initial.size() < size) append_self(initial);
    SlotBatch full = slots(last, true);
    for (size_t i : initial) full.push_back({i, false});
    out.emplace_back(full.begin() + static_cast<std::ptrdiff_t>(part * process),
                     full.begin() + static_cast<std::ptrdiff_t>(std::min(full.size(), part * (process + 1))));
    return out;
  }
  // _iter_with_no_split
  auto full = [&](const std::vector<size_t>& batch) { return !batch_size || batch.size() == *batch_size; };
  std::vector<std::vector<size_t>> initial;  // the first `processes` batches, to cycle through at the end
  std::optional<std::vector<size_t>> to_yield;
  for (size_t idx = 0; idx < batches.size(); ++idx) {
    if (!drop_last && idx < processes) initial.push_back(batches[idx]);
    if (idx % processes == process) to_yield = batches[idx];
    if (idx % processes == processes - 1 && full(batches[idx])) {
      out.push_back(slots(*to_yield, true));
      to_yield.reset();
    }
  }
  if (drop_last) return out;
  if (!even_batches) {
    if (to_yield && !to_yield->empty()) out.push_back(slots(*to_yield, true));
    return out;
  }
  if (to_yield && !to_yield->empty() && full(*to_yield)) out.push_back(slots(*to_yield, true));
  size_t idx = batches.size() - 1;
  SlotBatch batch = slots(batches.back(), true);
  if (full(batches.back())) {
    batch.clear();
    ++idx;
  }
  if (!batch_size) {  // cycle through whole batches
    while (initial.size() < processes) append_self(initial);
    for (size_t cycle = 0; idx % processes != 0 || !batch.empty(); ++cycle, ++idx) {
      batch = slots(initial[cycle], false);
      if (idx % processes == process) out.push_back(batch);
      batch.clear();
    }
    return out;
  }
  std::vector<size_t> flat;
  for (const auto& b : initial) flat.insert(flat.end(), b.begin(), b.end());
  while (flat.size() < processes * *batch_size) append_self(flat);
  for (size_t cycle = 0; idx % processes != 0 || !batch.empty(); ++idx) {
    const size_t end = cycle + *batch_size - batch.size();
    for (size_t i = cycle; i < end; ++i) batch.push_back({flat[i], false});
    if (idx % processes == process) out.push_back(batch);
    cycle = end;
    batch.clear();
  }
  return out;
}
}  // namespace detail

// A batch sampler for LibTorch's data loader that yields this process's
// batches (in the layouts at the top of this part); it ignores the loader's batch size.
class ShardSampler : public torch::data::samplers::Sampler<> {
 public:
  struct Options {
    size_t size = 0;  // of the dataset
    size_t num_replicas = 1, rank = 0;
    size_t batch_size = 1;  // the one-process batch (BATCHES with split_batches: the global batch)
    bool shuffle = false;
    uint64_t seed = 0;
    bool even_batches = true, drop_last = false, split_batches = false;
    ShardLayout layout = ShardLayout::BATCHES;
    BatchSamplerFn batch_sampler{};  // BATCHES only: replaces shuffle and batch_size
    // The batch size the custom batch sampler states (Python's
    // batch_sampler.batch_size): every batch but the last holds this many,
    // the last at most as many, and even_batches fills a short last batch up
    // to it (as Accelerate fills a BatchSampler's). Unset: its batches may
    // vary, and the last round is completed with whole batches.
    std::optional<size_t> batch_sampler_batch_size{};
  };
  // What the loader learns at the start of each pass: the number of real
  // (non-repeated) samples of each of this process's batches, in order.
  struct Record {
    std::vector<size_t> real_per_batch;
    size_t epoch = 0;
    size_t skip = 0;  // the next reset() starts after this many batches (then 0)
    // Replaces Options::even_batches from the next reset() on, while set
    // (Accelerator::join_uneven_inputs' even_batches).
    std::optional<bool> even_batches{};
  };

  explicit ShardSampler(Options options, std::shared_ptr<Record> record = std::make_shared<Record>())
      : options_(std::move(options)), record_(std::move(record)) {
    const Options& o = options_;
    auto fail = [](const std::string& why) { throw InvalidArgument("accel::ShardSampler: " + why); };
    if (o.num_replicas == 0 || o.rank >= o.num_replicas)
      fail("rank " + std::to_string(o.rank) + " of " + std::to_string(o.num_replicas) + " replicas");
    if (o.batch_size == 0) fail("batch_size must be at least 1");
    if (o.batch_sampler && o.layout != ShardLayout::BATCHES)
      fail("a custom batch sampler needs ShardLayout::BATCHES (SAMPLES deals out single samples)");
    if (o.batch_sampler_batch_size && !o.batch_sampler)
      fail("batch_sampler_batch_size states the size of a custom batch sampler's batches; there is none");
    if (o.batch_sampler_batch_size == size_t{0}) fail("batch_sampler_batch_size must be at least 1");
    if (o.batch_sampler && o.split_batches && !o.batch_sampler_batch_size)
      fail(
          "split_batches needs a fixed batch size; a custom batch sampler's batches may vary (state its size in "
          "batch_sampler_batch_size)");
    const size_t batch = o.batch_sampler ? o.batch_sampler_batch_size.value_or(0) : o.batch_size;
    if (o.split_batches && o.layout == ShardLayout::BATCHES && batch % o.num_replicas != 0)
      fail("with split_batches the batch size (" + std::to_string(batch) + ") must be a multiple of the " +
           std::to_string(o.num_replicas) + " processes");
    reset();
  }

  void reset(torch::optional<size_t> new_size = torch::nullopt) override {
    if (new_size) options_.size = *new_size;
    const Options& o = options_;
    const bool even_batches = record_->even_batches.value_or(o.even_batches);
    epoch_ = record_->epoch;
    next_ = 0;
    std::vector<size_t> order;  // the dataset's order for this epoch (not needed with a batch sampler)
    if (!o.batch_sampler) {
      order.resize(o.size);
      std::iota(order.begin(), order.end(), size_t{0});
    }
    if (o.shuffle && o.size > 0 && !o.batch_sampler) {  // torch's RandomSampler / DistributedSampler permutation
      at::Generator generator = at::detail::createCPUGenerator(o.seed + epoch_);
      const at::Tensor permutation = at::randperm(static_cast<int64_t>(o.size), generator, at::kLong).contiguous();
      std::copy_n(permutation.data_ptr<int64_t>(), o.size, order.begin());
    }
    batches_.clear();
    if (o.layout == ShardLayout::SAMPLES) {
      const size_t total =
          even_batches && o.size > 0 ? (o.size + o.num_replicas - 1) / o.num_replicas * o.num_replicas : o.size;
      const size_t local = o.split_batches ? o.batch_size / o.num_replicas : o.batch_size;
      detail::SlotBatch mine;
      for (size_t position = o.rank; position < total; position += o.num_replicas)
        mine.push_back({order[position % o.size], position < o.size});
      for (size_t i = 0; i < mine.size(); i += std::max<size_t>(local, 1))
        batches_.emplace_back(mine.begin() + static_cast<std::ptrdiff_t>(i),
                              mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), i + local)));
      if (o.drop_last && !batches_.empty() && batches_.back().size() < local) batches_.pop_back();
    } else {
      std::vector<std::vector<size_t>> sequence;
      if (o.batch_sampler) {
        sequence = o.batch_sampler(epoch_);
        for (size_t b = 0; b < sequence.size(); ++b) {
          for (size_t i : sequence[b])
            if (i >= o.size)
              throw OutOfRange("accel::ShardSampler: the batch sampler's batch " + std::to_string(b) + " holds index " +
                               std::to_string(i) + ", past the dataset's " + std::to_string(o.size) + " samples");
          const std::optional<size_t> stated = o.batch_sampler_batch_size;
          const bool last = b + 1 == sequence.size();
          if (stated && (sequence[b].size() > *stated || (!last && sequence[b].size() != *stated)))
            throw InvalidArgument("accel::ShardSampler: the batch sampler's batch " + std::to_string(b) + " holds " +
                                  std::to_string(sequence[b].size()) + " indices, but it states batches of " +
                                  std::to_string(*stated) + " (only the last may hold fewer)");
        }
      } else {
        for (size_t i = 0; i < order.size(); i += o.batch_size)
          if (i + o.batch_size <= order.size() || !o.drop_last)
            sequence.emplace_back(
                order.begin() + static_cast<std::ptrdiff_t>(i),
                order.begin() + static_cast<std::ptrdiff_t>(std::min(order.size(), i + o.batch_size)));
      }
      batches_ = detail::shard_batches(sequence, o.batch_sampler ? o.batch_sampler_batch_size : o.batch_size,
                                       o.num_replicas, o.rank, o.split_batches, even_batches, o.drop_last);
    }
    record_->real_per_batch.clear();
    for (const auto& batch : batches_)
      record_->real_per_batch.push_back(
          static_cast<size_t>(std::count_if(batch.begin(), batch.end(), [](const detail::Slot& s) { return s.real; })));
    next_ = std::min(std::exchange(record_->skip, 0), batches_.size());
  }

  torch::optional<std::vector<size_t>> next(size_t) override {
    if (next_ >= batches_.size()) return torch::nullopt;
    std::vector<size_t> indices;
    for (const auto& slot : batches_[next_]) indices.push_back(slot.index);
    ++next_;
    return indices;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("epoch", at::tensor(static_cast<int64_t>(epoch_)), true);
    archive.write("next", at::tensor(static_cast<int64_t>(next_)), true);
  }
  void load(torch::serialize::InputArchive& archive) override {
    at::Tensor epoch, next;
    archive.read("epoch", epoch, true);
    archive.read("next", next, true);
    record_->epoch = static_cast<size_t>(epoch.item<int64_t>());
    reset();
    next_ = std::min(batches_.size(), static_cast<size_t>(next.item<int64_t>()));
  }

  // This process's batches for the current epoch, in order (repeats included).
  std::vector<std::vector<size_t>> batches() const {
    std::vector<std::vector<size_t>> out;
    for (const auto& batch : batches_) {
      out.emplace_back();
      for (const auto& slot : batch) out.back().push_back(slot.index);
    }
    return out;
  }
  // The same, as one list.
  std::vector<size_t> indices() const {
    std::vector<size_t> out;
    for (const auto& batch : batches_)
      for (const auto& slot : batch) out.push_back(slot.index);
    return out;
  }
  size_t batch_count() const { return batches_.size(); }
  // How many samples this process reads per pass (repeats included).
  size_t local_count() const {
    size_t n = 0;
    for (const auto& batch : batches_) n += batch.size();
    return n;
  }
  // How many of them are real samples, not repeats.
  size_t real_count() const {
    return std::accumulate(record_->real_per_batch.begin(), record_->real_per_batch.end(), size_t{0});
  }

 private:
  Options options_;
  std::shared_ptr<Record> record_;
  std::vector<detail::SlotBatch> batches_;
  size_t epoch_ = 0, next_ = 0;
};

ACCEL_NAMESPACE_END

// == accel/training/data/loader_state.hpp =====================================
// accel/training/data/loader_state.hpp: what a prepared loader is configured with and shares: DataLoaderConfig, its place in its passes, Accelerate's GradientState.
//
// A prepared loader (data/loaders.hpp) reads its DataLoaderConfig; its
// LoaderPosition is shared with the Accelerator, whose checkpoints save and
// restore it; and the GradientState is shared by the Accelerator and every
// prepared optimizer, scheduler and loader, so that each knows whether this
// step syncs and which pass is under way.

ACCEL_NAMESPACE_BEGIN

struct DataLoaderConfig {
  size_t batch_size = 1;  // per process, or global with AcceleratorConfig::split_batches
  bool shuffle = false;
  uint64_t seed = 0;         // shuffled order: randperm under seed + epoch
  bool even_batches = true;  // complete the last round from the start, so every process gets as many batches
  bool drop_last = false;    // drop the incomplete last batch (and, BATCHES, an incomplete last round)
  size_t workers = 0;        // LibTorch's loader threads
  ShardLayout layout = ShardLayout::BATCHES;
  BatchSamplerFn batch_sampler{};  // a custom one-process batch sequence (BATCHES)
  // The size of the custom batch sampler's batches, where it has one (see
  // ShardSampler::Options); split_batches needs it unless dispatching.
  std::optional<size_t> batch_sampler_batch_size{};
  // The main process reads every global batch and sends each process its
  // rows (accel/training/data/dispatch.hpp); unset: on for iterable datasets only,
  // as Accelerate. even_batches does not apply (every process gets rows of
  // every global batch).
  std::optional<bool> dispatch_batches{};
};

namespace detail {
// Where a prepared loader's pass stands.
struct LoaderState {
  const void* loader = nullptr;       // the loader whose pass this is (Accelerator::active_dataloader)
  std::optional<size_t> real_rows{};  // real samples of the current batch
  bool end_of_dataloader = false;     // the current batch is the pass's last
};
// Where a prepared loader is in its passes, shared with the Accelerator for
// save_state / load_state: the epoch the next pass uses, the pass under way
// and how many of its batches were handed out, and how many batches the
// next pass skips (load_state, skip_first_batches); and the even_batches
// that join_uneven_inputs sets for its block.
struct LoaderPosition {
  size_t next_epoch = 0, epoch = 0, handed_out = 0, skip = 0;
  bool in_pass = false;
  // Samples per batch over all the data-parallel processes (0: not known),
  // by which a checkpoint's place carries over to another number of
  // processes or batch size (checkpoint/world.hpp).
  size_t samples_per_batch = 0;
  std::optional<bool> even_batches{};
  // The point a resumed run starts from: (epoch, batches to skip). Between
  // passes, the next one and the batches it is to skip (a place that
  // load_state or skip_first_batches set, kept by a save before the pass).
  std::pair<size_t, size_t> resume_point() const {
    return in_pass ? std::pair{epoch, handed_out} : std::pair{next_epoch, skip};
  }
  // The next pass resumes from there (load_state, load_state_dict).
  void resume_at(size_t resume_epoch, size_t batches) {
    next_epoch = resume_epoch;
    skip = batches;
    in_pass = false;
  }
  // A prepared loader's state_dict: {"epoch": the pass to resume,
  // "batches_handed_out": how many of its batches were handed out}, inside
  // a pass that pass and its batches so far, after it the next pass and the
  // batches it is to skip (what save_state keeps). A c10::Dict, so that torch::pickle_save or an
  // OutputArchive (as a c10::IValue) stores it.
  c10::Dict<std::string, int64_t> state_dict() const {
    const auto [resume_epoch, batches] = resume_point();
    c10::Dict<std::string, int64_t> out;
    out.insert("epoch", static_cast<int64_t>(resume_epoch));
    out.insert("batches_handed_out", static_cast<int64_t>(batches));
    return out;
  }
  // The next pass resumes where state_dict() was taken (the loader's own or
  // another prepared loader's over the same data and processes).
  void load_state_dict(const c10::Dict<std::string, int64_t>& state) {
    auto field = [&](const char* key) {
      const auto found = state.find(key);
      if (found == state.end() || found->value() < 0 || state.size() != 2)
        throw InvalidArgument(
            "accel: a prepared loader's load_state_dict takes what its state_dict() returns: {\"epoch\": n, "
            "\"batches_handed_out\": k}, both at least 0");
      return static_cast<size_t>(found->value());
    };
    resume_at(field("epoch"), field("batches_handed_out"));
  }
  // After each read: a batch was handed out; after the last one (or none)
  // the pass is over, and a resumed run starts with the next epoch.
  template <class Portion>  // a detail::RankBatch
  void count(const std::optional<Portion>& share) {
    if (share) ++handed_out;
    if (!share || share->last) in_pass = false;
  }
  // Starts a pass; returns the batches it skips.
  size_t begin() {
    epoch = next_epoch++;
    in_pass = true;
    handed_out = 0;
    return std::exchange(skip, 0);
  }
};
// What an Accelerator shares with its prepared optimizers, schedulers and
// loaders (Accelerate's GradientState): whether this step syncs gradients,
// and the loaders whose passes are under way, innermost last.
struct GradientState {
  bool sync_gradients = true;
  std::vector<const LoaderState*> active;
  const LoaderState* loader() const { return active.empty() ? nullptr : active.back(); }
  const void* active_dataloader() const { return loader() ? loader()->loader : nullptr; }
  bool end_of_dataloader() const { return loader() && loader()->end_of_dataloader; }
  void remove(const LoaderState* state) { std::erase(active, state); }
};

// A pass over a prepared loader as the GradientState sees it: the innermost
// pass from its start until end() or destruction (a loop left with break).
class Pass {
 public:
  Pass() = default;
  Pass(std::shared_ptr<GradientState> gradient_state, std::shared_ptr<LoaderState> state, const void* loader)
      : gradient_state_(std::move(gradient_state)), state_(std::move(state)) {
    gradient_state_->remove(state_.get());
    gradient_state_->active.push_back(state_.get());
    *state_ = {.loader = loader};
  }
  Pass(Pass&& other) noexcept : gradient_state_(std::move(other.gradient_state_)), state_(std::move(other.state_)) {}
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;
  Pass& operator=(Pass&&) = delete;
  ~Pass() { end(); }

  // The batch being handed out: its real (non-repeated) rows, and whether it is the pass's last.
  void at(size_t real_rows, bool last) const {
    if (!state_) return;
    state_->real_rows = real_rows;
    state_->end_of_dataloader = last;
  }
  void end() const {
    if (!state_) return;
    *state_ = {};
    gradient_state_->remove(state_.get());
    state_.reset();
  }

 private:
  std::shared_ptr<GradientState> gradient_state_;
  mutable std::shared_ptr<LoaderState> state_;
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/accelerator_config.hpp ====================================
// accel/training/accelerator_config.hpp: AcceleratorConfig, AcceleratedOptimizer, AcceleratedScheduler.

ACCEL_NAMESPACE_BEGIN

enum class DistributedType { NO, MULTI_CPU, MULTI_GPU };

// Accelerate's ProjectConfiguration: where save_state() without a path puts
// checkpoints, and the experiment log its files (accelerator/trackers.hpp). With
// automatic_checkpoint_naming, each save_state() writes
// project_dir/checkpoints/checkpoint_<iteration> and then counts iteration
// up; total_limit keeps the newest that many (the oldest are removed once
// the new one is whole); load_state() without a path loads the newest.
struct ProjectConfiguration {
  std::filesystem::path project_dir{};
  std::filesystem::path logging_dir{};  // where log_with's files go; empty: project_dir (as Accelerate)
  bool automatic_checkpoint_naming = false;
  std::optional<int> total_limit{};  // automatic naming only; at least 1
  int iteration = 0;                 // the number the next save_state() takes
};

// FSDP's sharding strategies, along the model mesh (Dim::MP_SHARD; see
// DataParallel). NO_SHARD: every rank holds everything (DDP). SHARD_GRAD_OP
// (ZeRO-2): gradients reduce-scattered, optimizer state and the update
// sharded, parameters all-gathered after the step; with mp_replicate_size > 1
// the shards are averaged along Dim::MP_REPLICATE too (FSDP's
// _HYBRID_SHARD_ZERO2). FULL_SHARD (ZeRO-3): the parameters of each unit
// (auto_wrap_policy) are sharded at rest too and gathered only while the unit
// runs (accel::unit_forward) and for its backward; on a model mesh that
// replicates (mp_replicate_size > 1) the shards are averaged along
// Dim::MP_REPLICATE too, as FSDP2's fully_shard on a 2-D mesh: the mesh
// decides. HYBRID_SHARD: another name for that (FSDP1's HSDP). With
// mp_shard_size == 1 every strategy is NO_SHARD.
enum class ShardingStrategy { NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD };

// Accelerate's DDPCommunicationHookType (DistributedDataParallelKwargs'
// comm_hook): the built-in communication hook of every prepared model (see
// accel::comm_hooks; POWER_SGD with PowerSGDState's defaults, as Accelerate
// with an empty comm_state_option: plain all-reduces for the first 1000
// steps).
enum class DDPCommunicationHookType { NO, FP16, BF16, POWER_SGD };

// Their string forms, as Accelerate and FSDP spell them: to_string,
// from_string and operator<< (core/enums.hpp) take every public enum.
namespace detail {
template <>
struct enum_names<DistributedType> {
  static constexpr std::string_view type = "DistributedType";
  static constexpr std::array<std::string_view, 3> names{"NO", "MULTI_CPU", "MULTI_GPU"};
};
template <>
struct enum_names<ShardingStrategy> {
  static constexpr std::string_view type = "ShardingStrategy";
  static constexpr std::array<std::string_view, 4> names{"NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD"};
};
template <>
struct enum_names<DDPCommunicationHookType> {
  static constexpr std::string_view type = "DDPCommunicationHookType";
  static constexpr std::array<std::string_view, 4> names{"no", "fp16", "bf16", "power_sgd"};
};
}  // namespace detail

// Accelerate's ParallelismConfig: the sizes of DistributedConfig in
// Accelerate's terms, its mesh (dp_replicate, dp_shard, cp, tp). The
// Accelerator maps it field by field when it starts (ParallelismConfig::
// distributed_config): mp_replicate = dp_replicate; mp_shard = dp_shard * cp
// (Accelerate's FSDP shards over dp_shard and cp flattened, "dp_shard_cp");
// dp = dp_replicate * dp_shard; cp and tp as they are. The layouts are the
// same groups as Accelerate's (docs/differences.md). dp_shard_size unset:
// what the world leaves, world / (dp_replicate * cp * tp).
struct ParallelismConfig {
  int dp_replicate_size = 1;
  std::optional<int> dp_shard_size{};
  int tp_size = 1;
  int cp_size = 1;
  bool operator==(const ParallelismConfig&) const = default;

  // The same sizes as a DistributedConfig (timeout and device left at their
  // defaults), checked against `world` (the number of processes) with
  // Accelerate's messages.
  DistributedConfig distributed_config(int world) const {
    check_signs();
    const int64_t rest = int64_t{dp_replicate_size} * tp_size * cp_size;
    int64_t shard = dp_shard_size.value_or(0);
    if (!dp_shard_size && world % rest != 0)
      throw InvalidArgument("accel::ParallelismConfig: dp_replicate_size * tp_size * cp_size (" + std::to_string(rest) +
                            ") does not divide num_processes (" + std::to_string(world) +
                            "), so no dp_shard_size fits; please adjust dp_replicate_size/tp_size/cp_size");
    if (!dp_shard_size) shard = world / rest;
    if (rest * shard != world)
      throw InvalidArgument("accel::ParallelismConfig: total_size (" + std::to_string(rest * shard) +
                            ") does not match num_processes (" + std::to_string(world) +
                            "). Please adjust dp_replicate_size/dp_shard_size/tp_size/cp_size.");
    DistributedConfig out;
    out.mp_replicate_size = dp_replicate_size;
    out.mp_shard_size = static_cast<int>(shard) * cp_size;
    out.dp_size = dp_replicate_size * static_cast<int>(shard);
    out.cp_size = cp_size;
    out.tp_size = tp_size;
    return out;
  }
  // Each size at least 1 (Accelerate's message), whatever the world.
  void check_signs() const {
    const std::pair<const char*, int> sizes[] = {{"dp_replicate_size", dp_replicate_size},
                                                 {"dp_shard_size", dp_shard_size.value_or(1)},
                                                 {"tp_size", tp_size},
                                                 {"cp_size", cp_size}};
    for (const auto& [name, size] : sizes)
      if (size < 1)
        throw InvalidArgument(std::string("accel::ParallelismConfig: ") + name + " must be at least 1, but got " +
                              std::to_string(size));
  }
};

struct AcceleratorConfig {
  int gradient_accumulation_steps = 1;
  std::string mixed_precision = "no";  // "no", "bf16", or "fp16" (CUDA only, with loss scaling: grad_scaler)
  GradScalerKwargs grad_scaler{};      // "fp16": the loss scaler's settings (Accelerate's GradScalerKwargs)
  bool cpu = false;                    // train on the CPU even where an accelerator exists (distributed.device)
  bool split_batches = false;          // prepare_data_loader: batch_size is the global batch, split among ranks
  // Accelerate's GradientAccumulationPlugin: the end of a prepared loader's
  // pass is a sync step (and restarts the count); sync_each_batch all-reduces
  // gradients on every micro-step (the optimizer still steps every k-th).
  bool sync_with_dataloader = true;
  bool sync_each_batch = false;
  int64_t bucket_cap_mb = 25;
  DDPCommunicationHookType comm_hook = DDPCommunicationHookType::NO;  // NO_SHARD only
  bool gradient_as_bucket_view = false;                               // DDP's (see DataParallel); NO_SHARD only
  ShardingStrategy sharding_strategy = ShardingStrategy::NO_SHARD;
  // FULL_SHARD and HYBRID_SHARD: which submodules are units (FSDP's
  // auto_wrap_policy), asked of each submodule by its dotted name, parents
  // first (a unit's own submodules are not asked). Empty: every submodule
  // with parameters of its own (Linear, Conv, Embedding, LayerNorm, ...).
  std::function<bool(const std::string& name, const torch::nn::Module& module)> auto_wrap_policy{};
  // FULL_SHARD and HYBRID_SHARD: FSDP2's MixedPrecisionPolicy (Accelerate's
  // FullyShardedDataParallelPlugin.mixed_precision_policy): units gathered
  // and computed in param_dtype, gradients reduced in reduce_dtype, the
  // parameters, shards and optimizer state kept in their own dtype (see
  // precision/policy.hpp). Empty: everything in the parameters' dtype.
  MixedPrecisionPolicy mixed_precision_policy{};
  // FULL_SHARD and HYBRID_SHARD: whether a unit's all-gather is issued
  // early, while the unit before it computes: in the forward the unit that
  // came next in the last forward (FSDP's forward_prefetch; FSDP2 prefetches
  // one unit ahead as well), in the backward the unit before (FSDP's
  // BACKWARD_PRE); small units further ahead, up to 4 MiB of them, and with
  // backward_prefetch the last 4 MiB of units of a forward stay gathered
  // for their backward (dp/state.hpp's kAheadBytes). Off: each unit is
  // gathered when it runs (less memory: one unit's parameters at a time).
  bool forward_prefetch = true;
  bool backward_prefetch = true;
  DistributedConfig distributed{};
  // Accelerate's spelling of distributed's sizes (ParallelismConfig above);
  // given, distributed's sizes must be left at their defaults.
  std::optional<ParallelismConfig> parallelism_config{};
  ProjectConfiguration project_config{};
  // Accelerate's log_with: the trackers Accelerator::log writes to, "jsonl",
  // "csv" or "all" (files under project_config's logging_dir; accelerator/trackers.hpp).
  std::vector<std::string> log_with{};
};

// A prepared optimizer, as Accelerate's AcceleratedOptimizer: step() and
// zero_grad() do nothing on the micro-steps of gradient accumulation that do
// not sync (so loops written for Accelerate call them unconditionally
// inside accumulate()). Under fp16 mixed precision step() goes through the
// Accelerator's GradScaler: the gradients are unscaled (unless
// clip_grad_norm_ did it), the step is skipped when one is inf or NaN
// (step_was_skipped()), and the scale is updated. A handle: copies share the
// optimizer.
class AcceleratedOptimizer {
 public:
  // after_step: run after each real step (under sharding: the parameters
  // gathered from the shards the optimizer stepped); scaler: fp16's.
  AcceleratedOptimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<const detail::GradientState> state,
                       std::function<void()> after_step = {}, std::shared_ptr<GradScaler> scaler = {})
      : optimizer_(&optimizer),
        state_(std::move(state)),
        after_step_(std::move(after_step)),
        scaler_(std::move(scaler)),
        skipped_(std::make_shared<bool>(false)) {}

  void step() {
    if (!state_->sync_gradients) return;
    if (scaler_) {
      *skipped_ = !scaler_->step(*optimizer_);
      scaler_->update();
    } else {
      optimizer_->step();
    }
    if (after_step_ && !*skipped_) after_step_();
  }
  // Whether the last step() was skipped because fp16's loss scaler found an
  // inf or NaN gradient (Accelerate's step_was_skipped).
  bool step_was_skipped() const { return *skipped_; }
  // set_to_none: the optimizer's own default when not given (LibTorch 1.x
  // zeroes the gradients, 2.x resets them, as Python's).
  void zero_grad(std::optional<bool> set_to_none = std::nullopt) {
    if (!state_->sync_gradients) return;
    if (!set_to_none) return optimizer_->zero_grad();
    for (auto& group : optimizer_->param_groups())
      for (auto& p : group.params()) {
        if (*set_to_none) {
          p.mutable_grad().reset();
        } else if (p.grad().defined()) {
          p.mutable_grad().detach_();
          p.mutable_grad().zero_();
        }
      }
  }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  std::vector<torch::optim::OptimizerParamGroup>& param_groups() { return optimizer_->param_groups(); }

 private:
  torch::optim::Optimizer* optimizer_;
  std::shared_ptr<const detail::GradientState> state_;
  std::function<void()> after_step_;
  std::shared_ptr<GradScaler> scaler_;
  std::shared_ptr<bool> skipped_;
};

// A prepared learning-rate scheduler, as Accelerate's AcceleratedScheduler:
// step() does nothing on micro-steps that do not sync, and otherwise steps
// the scheduler once per data-parallel process (the schedule was written in
// one-process batches; each step consumed one batch on every process),
// once with split_batches. Any scheduler with step() (torch::optim::StepLR,
// LRScheduler subclasses, your own). A handle: copies share the scheduler,
// and the count of its steps, which checkpoints keep.
class AcceleratedScheduler {
 public:
  template <class Scheduler>
    requires requires(Scheduler& s) { s.step(); }
  AcceleratedScheduler(Scheduler& scheduler, std::shared_ptr<const detail::GradientState> state, int steps_per_call,
                       std::shared_ptr<int64_t> steps = std::make_shared<int64_t>(0))
      : step_([&scheduler] { scheduler.step(); }),
        state_(std::move(state)),
        steps_per_call_(steps_per_call),
        steps_(std::move(steps)) {}

  void step() {
    if (!state_->sync_gradients) return;
    for (int i = 0; i < steps_per_call_; ++i) {
      step_();
      ++*steps_;
    }
  }

 private:
  std::function<void()> step_;
  std::shared_ptr<const detail::GradientState> state_;
  int steps_per_call_;
  std::shared_ptr<int64_t> steps_;  // the scheduler's own step() calls
};

ACCEL_NAMESPACE_END

// == accel/training/data/dispatch.hpp =========================================
// accel/training/data/dispatch.hpp: dispatch_batches: one rank reads, the others receive their slices.
//
// With dispatch_batches the main process of the data-parallel group reads
// every global batch (P one-process batches concatenated, or one batch of
// the global size with split_batches) and sends each process its rows, as
// Accelerate's DataLoaderDispatcher: of a global batch of R rows, process p
// gets rows [p n, (p + 1) n) with n = R / P. When R does not divide by P (the
// last batch, or any batch of a batch sampler's varying sizes) every process
// gets n + 1 rows, completed from the first global batch (cycled if that one
// is short); those repeats are marked, so gather_for_metrics drops them. The
// other processes never read the dataset. Accelerate broadcasts the whole
// batch and every process slices it; here each process receives only its
// own rows (detail::scatter_bytes), pickled as gather_object's objects.
// A batch that can be dispatched is either
//   - a std::vector of samples (what LibTorch's datasets return without a
//     Stack transform, and an iterable loader's batches): rows are elements;
//     a sample is a torch::data::Example or any Picklable value; or
//   - batched tensors: a torch::data::Example (e.g. after Stack<>) whose data
//     and target are nested tensors, or nested tensors (TensorTree): rows
//     along dim 0, the same number in every tensor.

ACCEL_NAMESPACE_BEGIN

namespace detail {
template <class T>
struct is_example : std::false_type {};
template <class D, class T>
struct is_example<torch::data::Example<D, T>> : std::true_type {};
template <class T>
constexpr bool no_target = std::is_same_v<T, torch::data::example::NoTarget>;

template <class T>
struct sample_travels : std::bool_constant<Picklable<T>> {};
template <class D, class T>
struct sample_travels<torch::data::Example<D, T>> : std::bool_constant<Picklable<D> && (Picklable<T> || no_target<T>)> {
};

template <class B>
struct batched_tensors : std::bool_constant<TensorTree<B> && !is_vector<B>::value> {};
template <class D, class T>
struct batched_tensors<torch::data::Example<D, T>>
    : std::bool_constant<TensorTree<D> && (TensorTree<T> || no_target<T>)> {};

template <class B>
concept SampleList = is_vector<B>::value && sample_travels<typename B::value_type>::value;
template <class B>
concept TensorBatch = batched_tensors<B>::value;
template <class B>
concept Dispatchable = SampleList<B> || TensorBatch<B>;

template <class B, class Fn>
void for_each_batch_tensor(B& batch, Fn& fn) {
  if constexpr (is_example<std::remove_const_t<B>>::value) {
    for_each_tensor(batch.data, fn);
    if constexpr (!no_target<decltype(batch.target)>) for_each_tensor(batch.target, fn);
  } else {
    for_each_tensor(batch, fn);
  }
}

template <Dispatchable B>
size_t batch_rows(const B& batch) {
  if constexpr (SampleList<B>) {
    return batch.size();
  } else {
    std::optional<int64_t> rows;
    size_t leaf = 0;
    auto check = [&](const at::Tensor& t) {
      auto fail = [&](const std::string& what) {
        throw InvalidArgument("accel::prepare_data_loader (dispatch_batches): tensor " + std::to_string(leaf) +
                              " of the batch is " + what +
                              "; every tensor of a dispatched batch holds the batch along dim 0");
      };
      if (!t.defined() || t.dim() == 0) fail("undefined or 0-d");
      if (!rows) rows = t.size(0);
      if (t.size(0) != *rows)
        fail("of " + std::to_string(t.size(0)) + " rows where the first has " + std::to_string(*rows));
      ++leaf;
    };
    for_each_batch_tensor(batch, check);
    if (!rows) throw InvalidArgument("accel::prepare_data_loader (dispatch_batches): the batch holds no tensor");
    return static_cast<size_t>(*rows);
  }
}

// Rows [from, to) of a batch.
template <Dispatchable B>
B batch_slice(const B& batch, size_t from, size_t to) {
  if constexpr (SampleList<B>) {
    return B(batch.begin() + static_cast<std::ptrdiff_t>(from), batch.begin() + static_cast<std::ptrdiff_t>(to));
  } else {
    B out = batch;
    auto cut = [&](at::Tensor& t) { t = t.slice(0, static_cast<int64_t>(from), static_cast<int64_t>(to)); };
    for_each_batch_tensor(out, cut);
    return out;
  }
}

// The batches' rows one after another.
template <Dispatchable B>
B batch_cat(std::vector<B>&& parts) {
  if (parts.size() == 1) return std::move(parts.front());
  if constexpr (SampleList<B>) {
    B out;
    for (auto& part : parts)
      out.insert(out.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    return out;
  } else if constexpr (is_example<B>::value) {
    using Data = decltype(B::data);
    using Target = decltype(B::target);
    std::vector<Data> data;
    std::vector<Target> targets;
    for (auto& part : parts) {
      data.push_back(std::move(part.data));
      targets.push_back(std::move(part.target));
    }
    if constexpr (no_target<Target>) return B{accel::concatenate(data), {}};
    else return B{accel::concatenate(data), accel::concatenate(targets)};
  } else {
    return accel::concatenate(parts);
  }
}

inline c10::IValue tuple_of(std::vector<c10::IValue> elements) {
  return c10::ivalue::Tuple::create(std::move(elements));
}

template <class S>
c10::IValue sample_to_ivalue(const S& sample) {
  if constexpr (is_example<S>::value) {
    c10::IValue target;  // None for NoTarget
    if constexpr (!no_target<decltype(sample.target)>) target = to_ivalue(sample.target);
    return tuple_of({to_ivalue(sample.data), std::move(target)});
  } else {
    return to_ivalue(sample);
  }
}
template <class S>
S sample_from_ivalue(const c10::IValue& v) {
  if constexpr (is_example<S>::value) {
    if (!v.isTuple() || v.toTupleRef().elements().size() != 2) wrong_object("(data, target) tuple", v);
    const c10::ArrayRef<c10::IValue> elements = v.toTupleRef().elements().asArrayRef();
    S sample;
    sample.data = from_ivalue<decltype(sample.data)>(elements[0]);
    if constexpr (!no_target<decltype(sample.target)>)
      sample.target = from_ivalue<decltype(sample.target)>(elements[1]);
    return sample;
  } else {
    return from_ivalue<S>(v);
  }
}
template <Dispatchable B>
c10::IValue batch_to_ivalue(const B& batch) {
  if constexpr (SampleList<B>) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(batch.size());
    for (const auto& sample : batch) list.push_back(sample_to_ivalue(sample));
    return list;
  } else {
    return sample_to_ivalue(batch);
  }
}
template <Dispatchable B>
B batch_from_ivalue(const c10::IValue& v) {
  if constexpr (SampleList<B>) {
    if (!v.isList()) wrong_object("list", v);
    B out;
    for (const c10::IValue& element : v.toListRef()) out.push_back(sample_from_ivalue<typename B::value_type>(element));
    return out;
  } else {
    return sample_from_ivalue<B>(v);
  }
}

// One batch of a pass, as a prepared loader hands it out.
template <class Batch>
struct RankBatch {
  Batch batch;
  size_t real;  // rows that are not repeats
  bool last;    // the pass's last batch
};

// The dispatching side of a prepared loader (see the top of this part). read() is a
// collective over the group: every process calls it once per batch; the
// main process (rank 0 of the group) reads one global batch ahead, so every
// share knows whether it is the pass's last.
template <class Batch>  // Dispatchable (named unconstrained by loaders of other batches, never made)
class Dispatcher {
 public:
  using Source = std::function<std::optional<Batch>()>;  // the next global batch; nullopt: the pass is over

  explicit Dispatcher(GroupPtr group) : group_(std::move(group)) {}
  bool main() const { return group_->getRank() == 0; }

  // A new pass; `source` is called on the main process only, from read()
  // (whose failures the others hear of).
  void begin(Source source) {
    source_ = std::move(source);
    first_.reset();
    ahead_.reset();
    starting_ = true;
  }

  std::optional<RankBatch<Batch>> read() {
    enum : int64_t { END = 0, BATCH = 1, LAST = 2, FAILED = 3 };
    c10d::ProcessGroup& group = *group_;
    const int processes = group.getSize();
    if (!main()) {
      const std::vector<char> bytes = scatter_bytes(group, 0, {}, "dispatch_batches");
      const c10::IValue message = load_object(bytes.data(), bytes.size());
      const c10::ArrayRef<c10::IValue> fields = message.toTupleRef().elements().asArrayRef();
      const int64_t status = fields[0].toInt();
      if (status == FAILED)
        throw DistributedError("accel: the main process could not make this process's batch (dispatch_batches): " +
                               fields[1].toStringRef());
      if (status == END) return std::nullopt;
      return RankBatch<Batch>{batch_from_ivalue<Batch>(fields[2]), static_cast<size_t>(fields[1].toInt()),
                              status == LAST};
    }
    std::vector<std::vector<char>> pieces(static_cast<std::size_t>(processes));
    auto to_all = [&](const c10::IValue& message) {
      const std::vector<char> bytes = save_object(message);
      for (int p = 1; p < processes; ++p) pieces[p] = bytes;
    };
    std::optional<RankBatch<Batch>> mine;
    try {
      if (std::exchange(starting_, false)) ahead_ = source_();
      if (!ahead_) {
        to_all(tuple_of({c10::IValue(int64_t{END})}));
      } else {
        Batch global = std::move(*ahead_);
        ahead_ = source_();
        const bool last = !ahead_;
        const size_t observed = batch_rows(global);
        if (observed == 0) throw InvalidArgument("accel::prepare_data_loader (dispatch_batches): a batch of 0 rows");
        if (!first_) first_ = global;
        const auto P = static_cast<size_t>(processes);
        const size_t rows = (observed + P - 1) / P;  // per process
        if (rows * P > observed) {                   // completed from the first global batch, cycled if it is short
          std::vector<Batch> parts{std::move(global)};
          const size_t first_rows = batch_rows(*first_);
          for (size_t have = observed; have < rows * P; have += std::min(first_rows, rows * P - have))
            parts.push_back(batch_slice(*first_, 0, std::min(first_rows, rows * P - have)));
          global = batch_cat(std::move(parts));
        }
        for (size_t p = 0; p < P; ++p) {
          Batch piece = batch_slice(global, p * rows, (p + 1) * rows);
          const size_t real = observed > p * rows ? std::min(rows, observed - p * rows) : 0;
          if (p == 0) {
            mine = RankBatch<Batch>{std::move(piece), real, last};
          } else {
            pieces[p] = save_object(tuple_of({c10::IValue(int64_t{last ? LAST : BATCH}),
                                              c10::IValue(static_cast<int64_t>(real)), batch_to_ivalue(piece)}));
          }
        }
      }
    } catch (const std::exception& e) {  // the others are waiting for their rows: tell them, then throw here
      to_all(tuple_of({c10::IValue(int64_t{FAILED}), c10::IValue(error_text(e))}));
      scatter_bytes(group, 0, pieces, "dispatch_batches");
      throw;
    }
    scatter_bytes(group, 0, pieces, "dispatch_batches");
    return mine;
  }

 private:
  GroupPtr group_;
  Source source_;
  std::optional<Batch> ahead_, first_;
  bool starting_ = false;
};

// The iterator of a prepared loader: an input iterator over the shares its
// loader's next() hands out; it tells the GradientState where the pass is.
// After the pass's last batch it reads nothing more.
template <class Loader, class Batch>
class PassIterator {
 public:
  Batch& operator*() {
    pass_.at(current_->real, current_->last);
    return current_->batch;
  }
  Batch* operator->() { return &**this; }
  PassIterator& operator++() {
    if (current_->last) current_.reset();
    else current_ = loader_->next();
    return *this;
  }
  bool operator==(const PassIterator& other) const {
    const bool equal = !current_ && !other.current_;
    if (equal) {  // the pass is over
      pass_.end();
      other.pass_.end();
    }
    return equal;
  }

 private:
  friend Loader;
  PassIterator() = default;  // end()
  PassIterator(Loader* loader, Pass pass) : loader_(loader), pass_(std::move(pass)) { current_ = loader_->next(); }
  Loader* loader_ = nullptr;
  std::optional<RankBatch<Batch>> current_;
  Pass pass_;
};

// The group a prepared loader dispatches over; null when it does not
// (dispatch_batches off, or one process). Unset, dispatch_batches is on for
// iterable datasets whose elements can travel.
template <class Batch>
GroupPtr dispatch_group(const DataLoaderConfig& config, bool iterable, const GroupPtr& group) {
  if (!config.dispatch_batches.value_or(iterable && Dispatchable<Batch>)) return {};
  if (!Dispatchable<Batch>)
    throw InvalidArgument(
        "accel::prepare_data_loader: dispatch_batches sends batches with LibTorch's pickler: a std::vector of "
        "samples (Examples or Picklable values) or batched tensors (an Example or nested tensors); this loader's "
        "batches are neither");
  if (config.layout != ShardLayout::BATCHES)
    throw InvalidArgument(
        "accel::prepare_data_loader: dispatch_batches deals out rows of global batches; ShardLayout::SAMPLES does "
        "not apply");
  if (!group || group->getSize() == 1) return {};
  return group;
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/data/loaders.hpp ==========================================
// accel/training/data/loaders.hpp: PreparedDataLoader and PreparedIterableDataLoader.

ACCEL_NAMESPACE_BEGIN

// A LibTorch data loader over this process's share. Iterating it starts a
// new epoch each pass (a different shuffle, the same on every rank, as
// Accelerate's prepared loaders do) and tells the Accelerator where the pass
// is (end_of_dataloader) and which rows of each batch are repeats, so that
// gather_for_metrics drops them. A pass left early (break) ends with its
// iterator. With dispatch_batches only the main process reads (accel/training/data/dispatch.hpp).
template <class Dataset>
class PreparedDataLoader {
 public:
  using Loader = torch::data::StatelessDataLoader<Dataset, ShardSampler>;
  using Batch = typename Dataset::BatchType;
  using Iterator = detail::PassIterator<PreparedDataLoader, Batch>;

  // `group`: the data-parallel group (null: one process).
  PreparedDataLoader(Dataset dataset, const DataLoaderConfig& config, GroupPtr group, bool split_batches,
                     std::shared_ptr<detail::GradientState> gradient_state,
                     std::shared_ptr<detail::LoaderPosition> position = std::make_shared<detail::LoaderPosition>())
      : record_(std::make_shared<ShardSampler::Record>()),
        state_(std::make_shared<detail::LoaderState>()),
        gradient_state_(std::move(gradient_state)),
        position_(std::move(position)) {
    const torch::optional<size_t> size = dataset.size();
    if (!size) throw InvalidArgument("accel::prepare_data_loader: the dataset must have a size()");
    const size_t processes = group ? static_cast<size_t>(group->getSize()) : 1;
    const size_t rank = group ? static_cast<size_t>(group->getRank()) : 0;
    GroupPtr dispatch = detail::dispatch_group<Batch>(config, false, group);
    // Dispatching, the main process reads the unsharded one-process batches
    // (global ones with split_batches); every process plans the pass from them.
    ShardSampler::Options options{*size,
                                  dispatch ? 1 : processes,
                                  dispatch ? 0 : rank,
                                  config.batch_size,
                                  config.shuffle,
                                  config.seed,
                                  config.even_batches,
                                  config.drop_last,
                                  dispatch ? false : split_batches,
                                  config.layout,
                                  config.batch_sampler,
                                  config.batch_sampler_batch_size};
    ShardSampler sampler(std::move(options), record_);
    if (!dispatch) {
      batches_ = sampler.batch_count();
    } else {
      if constexpr (detail::Dispatchable<Batch>) {
        const size_t per_step = split_batches ? 1 : processes;
        batches_ =
            config.drop_last ? sampler.batch_count() / per_step : (sampler.batch_count() + per_step - 1) / per_step;
        dispatcher_ = std::make_unique<detail::Dispatcher<Batch>>(dispatch);
        per_step_ = per_step;
        drop_last_ = config.drop_last;
        if (!dispatcher_->main()) return;  // the others never read
      }
    }
    // The sampler makes the batches (and drops what drop_last drops).
    loader_ = torch::data::make_data_loader(std::move(dataset), std::move(sampler),
                                            torch::data::DataLoaderOptions(1).workers(config.workers));
  }

  // Starts a pass: epoch 0, 1, 2, ... unless set_epoch says otherwise.
  Iterator begin() {
    const size_t skip = position_->begin();
    record_->epoch = position_->epoch;
    index_ = 0;
    started_ = exhausted_ = false;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) {
        if (loader_) it_.emplace(loader_->begin());  // the main process reads
        dispatcher_->begin([this] { return global_batch(); });
        for (size_t i = 0; i < skip && next(); ++i) {
        }  // every process reads and drops the same batches
        return Iterator(this, detail::Pass(gradient_state_, state_, this));
      }
    // The sampler starts after the skipped batches: none is read. It plans
    // the pass when LibTorch's loader begins (with the even_batches of
    // join_uneven_inputs, where one is set), which gives the pass's length.
    record_->skip = skip;
    record_->even_batches = position_->even_batches;
    it_.emplace(loader_->begin());
    batches_ = record_->real_per_batch.size();
    index_ = std::min(skip, batches_);
    position_->handed_out = index_;
    return Iterator(this, detail::Pass(gradient_state_, state_, this));
  }
  Iterator end() { return Iterator(); }

  // The epoch the next pass uses (to resume a run mid-way).
  void set_epoch(size_t epoch) { position_->next_epoch = epoch; }
  size_t next_epoch() const { return position_->next_epoch; }
  size_t epoch() const { return record_->epoch; }
  // The next pass starts after its first n batches, without reading them
  // where the sampler can skip (Accelerate's skip_first_batches).
  void skip_first_batches(size_t n) { position_->skip = n; }
  // Batches per pass on this process (the same on every process with
  // even_batches or dispatch_batches); during a pass, that pass's.
  size_t batches() const { return batches_; }
  // Where the loader stands, as torchdata's StatefulDataLoader (Accelerate's
  // use_stateful_dataloader): {"epoch", "batches_handed_out"} (inside a
  // pass: that pass and the batches handed out so far; after it: the next
  // pass and the batches it is to skip, 0 unless a load or
  // skip_first_batches set them), a c10::Dict that torch::pickle_save stores.
  // load_state_dict makes the next pass resume right after those batches.
  c10::Dict<std::string, int64_t> state_dict() const { return position_->state_dict(); }
  void load_state_dict(const c10::Dict<std::string, int64_t>& state) { position_->load_state_dict(state); }

 private:
  friend Iterator;
  // The next one-process batch from LibTorch's loader, and how many of its rows are real.
  std::optional<std::pair<Batch, size_t>> local_batch() {
    if (exhausted_) return std::nullopt;
    if (std::exchange(started_, true)) ++*it_;
    if (*it_ == loader_->end()) {
      exhausted_ = true;
      return std::nullopt;
    }
    const size_t real = record_->real_per_batch.at(index_++);
    return std::pair<Batch, size_t>(std::move(**it_), real);
  }
  // Dispatching: the next global batch (on the main process).
  std::optional<Batch> global_batch() {
    if constexpr (detail::Dispatchable<Batch>) {
      std::vector<Batch> parts;
      while (parts.size() < per_step_)
        if (auto batch = local_batch()) parts.push_back(std::move(batch->first));
        else break;
      if (parts.empty() || (drop_last_ && parts.size() < per_step_)) return std::nullopt;
      return detail::batch_cat(std::move(parts));
    } else {
      return std::nullopt;
    }
  }
  std::optional<detail::RankBatch<Batch>> next() {
    std::optional<detail::RankBatch<Batch>> share;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) share = dispatcher_->read();
    if (!dispatcher_)
      if (auto batch = local_batch())
        share = detail::RankBatch<Batch>{std::move(batch->first), batch->second, index_ == batches_};
    position_->count(share);
    return share;
  }

  std::shared_ptr<ShardSampler::Record> record_;
  std::shared_ptr<detail::LoaderState> state_;
  std::shared_ptr<detail::GradientState> gradient_state_;
  std::unique_ptr<Loader> loader_;  // null on the processes a dispatcher sends to
  std::optional<torch::data::Iterator<Batch>> it_;
  std::unique_ptr<detail::Dispatcher<Batch>> dispatcher_;
  std::shared_ptr<detail::LoaderPosition> position_;
  size_t batches_ = 0, index_ = 0, per_step_ = 1;  // index_: the next batch's, in this process's pass
  bool drop_last_ = false, exhausted_ = false, started_ = false;
};

// A prepared loader over an iterable dataset: a LibTorch StatefulDataset
// (e.g. ChunkDataset) whose get_batch(n) yields up to n elements, nullopt at
// the end of the stream. Batches are std::vector of the elements; each pass
// resets the dataset; read on the calling thread (LibTorch's loader workers
// are not used). Of each global batch (batch_size elements per process, or
// batch_size in all with split_batches) a process gets its slice:
//   - dispatch_batches (the default for iterable datasets, as Accelerate):
//     the main process reads the stream and sends every process its rows
//     (accel/training/data/dispatch.hpp);
//   - otherwise every process reads the whole stream and keeps its slice,
//     as Accelerate's IterableDatasetShard: unless drop_last the last global
//     batch is completed to full size from the first one.
// Either way the repeats are dropped by gather_for_metrics.
template <class Dataset>
class PreparedIterableDataLoader {
 public:
  using Element = typename std::remove_cvref_t<decltype(*std::declval<typename Dataset::BatchType>())>::value_type;
  using Batch = std::vector<Element>;
  using Iterator = detail::PassIterator<PreparedIterableDataLoader, Batch>;

  PreparedIterableDataLoader(
      Dataset dataset, const DataLoaderConfig& config, GroupPtr group, bool split_batches,
      std::shared_ptr<detail::GradientState> gradient_state,
      std::shared_ptr<detail::LoaderPosition> position = std::make_shared<detail::LoaderPosition>())
      : dataset_(std::move(dataset)),
        processes_(group ? static_cast<size_t>(group->getSize()) : 1),
        rank_(group ? static_cast<size_t>(group->getRank()) : 0),
        global_(split_batches ? config.batch_size : config.batch_size * processes_),
        local_(split_batches ? config.batch_size / processes_ : config.batch_size),
        drop_last_(config.drop_last),
        state_(std::make_shared<detail::LoaderState>()),
        gradient_state_(std::move(gradient_state)),
        position_(std::move(position)) {
    if (config.shuffle || config.batch_sampler || config.layout != ShardLayout::BATCHES)
      throw InvalidArgument(
          "accel::prepare_data_loader: an iterable dataset is read in its own order (no shuffle, batch_sampler or "
          "SAMPLES layout)");
    if (GroupPtr dispatch = detail::dispatch_group<Batch>(config, true, group))
      if constexpr (detail::Dispatchable<Batch>)
        dispatcher_ = std::make_unique<detail::Dispatcher<Batch>>(std::move(dispatch));
  }

  // Starts a pass. A stream cannot seek: skipped batches are read and dropped.
  Iterator begin() {
    const size_t skip = position_->begin();
    first_.clear();
    done_ = false;
    ahead_.reset();
    bool dispatching = false;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) {
        dispatching = true;
        if (dispatcher_->main()) dataset_.reset();
        dispatcher_->begin([this] { return global_batch(); });
      }
    if (!dispatching) {
      dataset_.reset();
      ahead_ = slice();
    }
    for (size_t i = 0; i < skip && next(); ++i) {
    }
    return Iterator(this, detail::Pass(gradient_state_, state_, this));
  }
  Iterator end() { return Iterator(); }
  // The next pass starts after its first n batches (Accelerate's
  // skip_first_batches; they are read and dropped).
  void skip_first_batches(size_t n) { position_->skip = n; }
  size_t next_epoch() const { return position_->next_epoch; }
  // As PreparedDataLoader's (a resumed stream reads and drops the batches already handed out).
  c10::Dict<std::string, int64_t> state_dict() const { return position_->state_dict(); }
  void load_state_dict(const c10::Dict<std::string, int64_t>& state) { position_->load_state_dict(state); }

 private:
  friend Iterator;
  std::optional<detail::RankBatch<Batch>> next() {
    std::optional<detail::RankBatch<Batch>> current;
    if constexpr (detail::Dispatchable<Batch>)
      if (dispatcher_) current = dispatcher_->read();
    if (!dispatcher_) {
      current = std::move(ahead_);  // one ahead: end_of_dataloader is known
      ahead_ = current ? slice() : std::nullopt;
      if (current) current->last = !ahead_;
    }
    position_->count(current);
    return current;
  }

  // The next global batch of the stream: global_ elements, fewer at its end
  // (nullopt when nothing is left, or with drop_last when it is incomplete).
  std::optional<Batch> global_batch() {
    if (done_) return std::nullopt;
    Batch global;
    while (global.size() < global_) {
      auto more = dataset_.get_batch(global_ - global.size());
      if (!more) break;
      for (auto& element : *more) global.push_back(std::move(element));
    }
    if (global.size() > global_) global.resize(global_);  // a dataset that returned more than asked
    if (global.size() < global_) {
      done_ = true;
      if (drop_last_ || global.empty()) return std::nullopt;
    }
    return global;
  }

  // This process's slice of the next global batch (IterableDatasetShard.__iter__).
  std::optional<detail::RankBatch<Batch>> slice() {
    std::optional<Batch> global = global_batch();
    if (!global) return std::nullopt;
    const size_t real_size = global->size();
    if (processes_ == 1)
      return detail::RankBatch<Batch>{std::move(*global), real_size, false};  // not sharded, as Accelerate
    if (first_.empty()) first_ = *global;
    while (global->size() < global_) global->insert(global->end(), first_.begin(), first_.end());
    const size_t begin = rank_ * local_;
    return detail::RankBatch<Batch>{Batch(global->begin() + static_cast<std::ptrdiff_t>(begin),
                                          global->begin() + static_cast<std::ptrdiff_t>(begin + local_)),
                                    real_size > begin ? std::min(local_, real_size - begin) : 0, false};
  }

  Dataset dataset_;
  size_t processes_, rank_, global_, local_;
  bool drop_last_;
  Batch first_;
  bool done_ = false;
  std::optional<detail::RankBatch<Batch>> ahead_;
  std::unique_ptr<detail::Dispatcher<Batch>> dispatcher_;
  std::shared_ptr<detail::LoaderState> state_;
  std::shared_ptr<detail::GradientState> gradient_state_;
  std::shared_ptr<detail::LoaderPosition> position_;
};

namespace detail {
// torch::optional<std::vector<T>> (c10::optional before LibTorch 2.4, std::optional since).
template <class B>
concept optional_vector = requires(B& b) {
  { b.has_value() } -> std::convertible_to<bool>;
  *b;
} && is_vector<std::remove_cvref_t<decltype(*std::declval<B&>())>>::value;
}  // namespace detail

// An iterable dataset as LibTorch has them: a StatefulDataset whose batches
// are optional vectors of elements (nullopt: the stream ended).
template <class D>
concept IterableDataset = requires(D& d) {
  d.reset();
  { d.get_batch(std::size_t{1}) } -> std::same_as<typename D::BatchType>;
} && detail::optional_vector<typename D::BatchType>;

ACCEL_NAMESPACE_END

// == accel/training/dp/comm_hooks.hpp =========================================
// accel/training/dp/comm_hooks.hpp: communication hooks: GradBucket, CommHook, PowerSGD.

ACCEL_NAMESPACE_BEGIN

// Communication hooks (DDP's register_comm_hook, Accelerate's comm_hook): a
// hook replaces the all-reduce of each gradient bucket of a DataParallel.
// It gets the bucket flattened (torch's GradBucket: this process's
// gradients in the bucket's order, then one used-flag per parameter; not yet
// divided) and returns the operation whose result is the bucket averaged
// over the group, in any floating dtype: the result is cast back to the
// bucket's, so a compressing hook need not decompress.
struct GradBucket {
  at::Tensor buffer{};
  std::size_t index = 0;
  bool is_last = false;  // the last bucket of this backward
  std::vector<at::Tensor> parameters{};
  std::vector<at::Tensor> gradients{};  // views of buffer, shaped as the parameters (the flags follow them)
};
using CommHook = std::function<Work<at::Tensor>(const GroupPtr& group, GradBucket& bucket)>;

// torch.distributed.algorithms.ddp_comm_hooks.default_hooks'.
namespace comm_hooks {
// The default: divided first (as DDP), then all-reduced in place.
inline CommHook allreduce_hook() {
  return [](const GroupPtr& group, GradBucket& bucket) {
    bucket.buffer.div_(group->getSize());
    return all_reduce_async(bucket.buffer, ReduceOp::SUM, group);
  };
}
// Cast to float16 (bfloat16), divided, all-reduced: half the bytes on the
// wire. Gloo reduces float16 natively; bfloat16 it does not know, so
// accel.hpp reduces it in float32 there (the rounding stays bfloat16's, the
// bytes do not halve: use it with NCCL).
inline CommHook fp16_compress_hook() {
  return [](const GroupPtr& group, GradBucket& bucket) {
    return all_reduce_async(bucket.buffer.to(at::kHalf).div_(group->getSize()), ReduceOp::SUM, group);
  };
}
inline CommHook bf16_compress_hook() {
  return [](const GroupPtr& group, GradBucket& bucket) {
    return all_reduce_async(bucket.buffer.to(at::kBFloat16).div_(group->getSize()), ReduceOp::SUM, group);
  };
}
}  // namespace comm_hooks

// torch's PowerSGDState: the options of powerSGD_hook, and its memory.
struct PowerSGDState {
  int64_t matrix_approximation_rank = 1;
  int64_t start_powerSGD_iter = 1000;  // plain all-reduces until this many steps
  int64_t min_compression_rate = 2;    // compress a matrix only when it shrinks more than this
  bool use_error_feedback = true;
  bool warm_start = true;
  double orthogonalization_epsilon = 0;
  uint64_t random_seed = 0;
  // The hook's memory (per bucket), and the steps taken.
  int64_t iter = 0;
  std::map<std::size_t, at::Tensor> error_dict{}, p_memory_dict{}, q_memory_dict{};
  std::optional<std::mt19937_64> rng{};  // seeds of Q's random starts, from random_seed
};

namespace detail {
// PowerSGD's Gram-Schmidt over the columns (torch 1.13's _orthogonalize).
inline void orthogonalize(const at::Tensor& matrix, double epsilon) {
  const int64_t columns = matrix.size(1);
  for (int64_t i = 0; i < columns; ++i) {
    const at::Tensor column = matrix.narrow(1, i, 1);
    column.div_(epsilon == 0 ? column.norm() : column.norm() + epsilon);
    if (i + 1 < columns) {
      const at::Tensor rest = matrix.narrow(1, i + 1, columns - i - 1);
      rest.sub_((column * rest).sum(0) * column);
    }
  }
}

// Which of a bucket's gradients PowerSGD compresses: the matrices (each
// gradient viewed as n x m) whose rank-r factors, r = min(n, m,
// matrix_approximation_rank), are smaller than the matrix by
// min_compression_rate; the rest, and the used-flags after the gradients'
// `length` elements, travel uncompressed.
struct PowerSGDSplit {
  std::vector<at::Tensor> matrices, plain;
};
inline PowerSGDSplit split_for_powerSGD(const GradBucket& bucket, const at::Tensor& input, int64_t length,
                                        const PowerSGDState& state) {
  PowerSGDSplit split;
  for (const auto& g : bucket.gradients) {
    if (g.dim() >= 2) {
      const at::Tensor m = g.view({g.size(0), -1});
      const int64_t n = m.size(0), k = m.size(1), r = std::min({n, k, state.matrix_approximation_rank});
      if ((n + k) * r * state.min_compression_rate < n * k) {
        split.matrices.push_back(m);
        continue;
      }
    }
    split.plain.push_back(g);
  }
  split.plain.push_back(input.narrow(0, length, input.numel() - length));
  return split;
}
// The factors P (n x r) and Q (m x r) of each matrix: views into bucket b's
// P and Q memory (one tensor each, so that each is all-reduced at once). Q is
// drawn at random where there is no memory to start from (the first step, or
// always without warm_start), then orthogonalised.
inline std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> powerSGD_factors(
    PowerSGDState& state, std::size_t b, const std::vector<at::Tensor>& matrices, const at::TensorOptions& options) {
  auto rank_of = [&](const at::Tensor& m) { return std::min({m.size(0), m.size(1), state.matrix_approximation_rank}); };
  const bool randomize = !state.warm_start || !state.p_memory_dict.count(b);
  if (randomize) {
    int64_t ps = 0, qs = 0;
    for (const auto& m : matrices) {
      ps += m.size(0) * rank_of(m);
      qs += m.size(1) * rank_of(m);
    }
    state.p_memory_dict[b] = at::empty({ps}, options);
    state.q_memory_dict[b] = at::empty({qs}, options);
  }
  std::vector<at::Tensor> p, q;
  for (int64_t i = 0, pi = 0, qi = 0; i < static_cast<int64_t>(matrices.size()); ++i) {
    const at::Tensor& m = matrices[static_cast<std::size_t>(i)];
    const int64_t n = m.size(0), k = m.size(1), r = rank_of(m);
    p.push_back(state.p_memory_dict[b].narrow(0, pi, n * r).view({n, r}));
    q.push_back(state.q_memory_dict[b].narrow(0, qi, k * r).view({k, r}));
    pi += n * r;
    qi += k * r;
  }
  if (randomize) {
    at::Generator generator = at::detail::createCPUGenerator((*state.rng)() % 1'000'000'000);
    for (auto& qm : q) qm.copy_(at::randn(qm.sizes(), generator, at::TensorOptions(at::kFloat)));
  }
  for (auto& qm : q) orthogonalize(qm, state.orthogonalization_epsilon);
  return {std::move(p), std::move(q)};
}
// With error feedback: adds to bucket b's gradients what compression lost
// at this process's last step, and returns them as they then are (what the
// compressed result will be subtracted from); else an undefined tensor.
inline at::Tensor add_error_feedback(PowerSGDState& state, std::size_t b, const at::Tensor& body) {
  if (!state.use_error_feedback) return {};
  at::Tensor& error = state.error_dict[b];
  if (error.defined()) body.add_(error);
  else error = at::zeros_like(body);
  return body.clone();
}
}  // namespace detail

namespace comm_hooks {
// torch's powerSGD_hook (Vogels et al., 2019): each gradient matrix M (n x m,
// a parameter viewed as rows x the rest) of rank-r compression worth it,
// (n + m) r * min_compression_rate < n m, travels as two thin matrices:
// P = M Q all-reduced and orthogonalised, Q = M^T P all-reduced, and M
// becomes P Q^T / world size; vectors and small matrices are all-reduced as
// they are, in one buffer. With error feedback each process adds what
// compression lost at its last step; with warm start Q is kept from step to
// step (the first Q is random, the same on every process: std::mt19937_64
// seeded with random_seed draws a seed per start, where torch draws it from
// NumPy). The first start_powerSGD_iter steps all-reduce plainly. The
// uncompressed all-reduce is issued at once; P's and Q's run when the
// bucket is waited for (at the end of backward).
inline CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  if (!state) throw InvalidArgument("accel::comm_hooks::powerSGD_hook: no state");
  if (state->matrix_approximation_rank < 1 || state->min_compression_rate < 1 || state->start_powerSGD_iter < 0)
    throw InvalidArgument(
        "accel::comm_hooks::powerSGD_hook: matrix_approximation_rank and min_compression_rate "
        "must be at least 1, start_powerSGD_iter at least 0");
  if (!state->rng) state->rng.emplace(state->random_seed);
  return [state](const GroupPtr& group, GradBucket& bucket) -> Work<at::Tensor> {
    const bool last = bucket.is_last;
    if (state->iter < state->start_powerSGD_iter) {
      if (last) ++state->iter;
      return allreduce_hook()(group, bucket);
    }
    const std::size_t b = bucket.index;
    const int64_t world = group->getSize();
    at::Tensor input = bucket.buffer;
    int64_t length = 0;  // of the gradients (the used-flags follow: never compressed, no error feedback)
    for (const auto& g : bucket.gradients) length += g.numel();
    const at::Tensor body = input.narrow(0, 0, length);
    const at::Tensor before = detail::add_error_feedback(*state, b, body);
    detail::PowerSGDSplit split = detail::split_for_powerSGD(bucket, input, length, *state);
    std::vector<at::Tensor> matrices = std::move(split.matrices), plain = std::move(split.plain);
    std::vector<at::Tensor> flat;
    for (const auto& t : plain) flat.push_back(t.reshape({-1}));
    const at::Tensor uncompressed = at::cat(flat);
    auto factors = detail::powerSGD_factors(*state, b, matrices, input.options());
    std::vector<at::Tensor> p = std::move(factors.first), q = std::move(factors.second);
    for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(p[i], matrices[i], q[i]);
    c10d::ProcessGroup* g = detail::enter_all_reduce(uncompressed, ReduceOp::SUM, group);
    return Work<at::Tensor>(detail::then(
        detail::start_all_reduce_data(*g, uncompressed, ReduceOp::SUM),
        [state, group, b, world, last, input, body, before, matrices, plain, p, q](at::Tensor reduced) mutable {
          reduced.div_(world);
          int64_t at = 0;
          for (const auto& t : plain) {
            t.copy_(reduced.narrow(0, at, t.numel()).view(t.sizes()));
            at += t.numel();
          }
          if (!matrices.empty()) {
            accel::all_reduce(state->p_memory_dict[b], ReduceOp::SUM, group);  // no division: P is orthogonalised
            for (const auto& pm : p) detail::orthogonalize(pm, state->orthogonalization_epsilon);
            for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(q[i], matrices[i].t(), p[i]);
            accel::all_reduce(state->q_memory_dict[b], ReduceOp::SUM, group);  // in place
            state->q_memory_dict[b].div_(world);
            for (std::size_t i = 0; i < matrices.size(); ++i) at::matmul_out(matrices[i], p[i], q[i].t());
          }
          if (state->use_error_feedback) state->error_dict[b] = before - body;
          if (!state->warm_start) {
            state->p_memory_dict.clear();
            state->q_memory_dict.clear();
          }
          if (last) ++state->iter;
          return input;
        }));
  };
}
}  // namespace comm_hooks

ACCEL_NAMESPACE_END

// == accel/training/dp/buckets.hpp ============================================
// accel/training/dp/buckets.hpp: which gradients share a bucket (DDP's assignment, with FSDP units).
//
// DataParallel averages gradients a bucket at a time, as backward produces
// them. Which gradients share a bucket is decided once, here, by a pure
// function of their dtypes, devices and sizes, so it can be tested in one
// process against DDP's own cases (tests: "bucket assignment").

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

// == accel/training/dp/buffers.hpp ============================================
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

// == accel/training/dp/timeline.hpp ===========================================
// accel/training/dp/timeline.hpp: when each gradient bucket of the last synced backward was ready, issued, waited for and landed.
//
// Whether communication hides behind compute is a question of times: a
// bucket's reduction can only overlap the backward if it is issued well
// before the backward ends and lands before anyone waits for it. The
// engine stamps four moments per bucket in every synced backward (a clock
// read each, nothing else), and DataParallel::bucket_timeline() returns
// those of the last one, for benchmarks and profiling
// (tests/bench/bench_sharding.cpp plots them: docs/benchmarks.md).

#include <chrono>

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// One bucket's moments, in ms since the backward was armed
// (DataParallel::prepare_for_backward, just before autograd starts):
//   ready:   its last gradient arrived;
//   issued:  its reduction was handed to the backend (every bucket before
//            it too: ranks issue in the same order);
//   waiting: the engine began to wait for it (in finish(), or under
//            sharding when one more bucket in flight would be too many);
//   landed:  that wait returned: the reduction was complete, at the latest
//            then (where waiting and landed are equal it had landed before
//            anyone waited: the communication was hidden).
// A moment that did not happen stays -1: `ready` of a bucket that finish()
// issued because some gradient never arrived (a parameter no loss used).
// A backward under no_sync arms nothing and leaves the last synced one's.
struct BucketTimes {
  double ready = -1, issued = -1, waiting = -1, landed = -1;
  int64_t bytes = 0;  // what it reduces: its gradients and used-flags
};
struct BackwardTimeline {
  std::vector<BucketTimes> buckets;
  double finish_began = -1, finished = -1;  // DataParallel::finish(): called, returned
};

// The stamps, kept in the State: the clock's zero and the times so far.
struct TimelineClock {
  using Clock = std::chrono::steady_clock;
  Clock::time_point armed{};
  BackwardTimeline times{};
  void arm(std::size_t buckets) {
    armed = Clock::now();
    times.buckets.assign(buckets, BucketTimes{});
    times.finish_began = times.finished = -1;
  }
  double now() const { return std::chrono::duration<double, std::milli>(Clock::now() - armed).count(); }
  // (a bucket index past what arm() laid out: a backward that was never armed, not recorded)
  void stamp(std::size_t b, double BucketTimes::* moment) {
    if (b < times.buckets.size()) times.buckets[b].*moment = now();
  }
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/strategy.hpp ===========================================
// accel/training/dp/strategy.hpp: Strategy, what NO_SHARD and the sharded strategies do differently: the one place DataParallel branches on its mode.
//
// DataParallel's constructor makes one strategy (dp/state.hpp's Replicated
// or Sharded, each holding its own state) and every operation whose work
// depends on the mode is a call through this interface; no other code tests
// which mode it runs (the strategies' own code knows). Why an interface and
// not a std::variant visited at each call: the operations are many, and a
// new strategy (one that takes pieces of tensor-parallel parameters, say) is
// then one class listing them all, checked by the compiler, instead of a
// case added to every visit. The strategies define these in
// dp/strategies.hpp, after the engine's parts they call into.
//
// Every operation that reads or changes the engine's state takes the lock
// token (dp/state.hpp's Locked); the defaults are what a strategy that
// keeps no shards does: nothing, or the whole tensor.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
struct State;
class Locked;

// For sharded checkpoints (checkpoint/shards.hpp), which neither gather
// nor load whole what a rank keeps in pieces: elements [begin, begin +
// values.numel()) of a parameter flattened, `values` a flat view (see
// Sharded's piece_of in dp/sharded_state_dict.hpp).
struct Piece {
  at::Tensor values;
  int64_t begin = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  // Whether parameters are cut into shards here (SHARD_GRAD_OP, FULL_SHARD,
  // HYBRID_SHARD), and along which group (null when they are not).
  virtual bool shards() const { return false; }
  virtual const GroupPtr& shard_group() const;

  // -- building (DataParallel's constructor, in this order) --
  // The FULL_SHARD unit each of `params` belongs to (-1: none).
  virtual std::vector<int64_t> assign_units(State& s, const torch::nn::Module& module,
                                            const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                            const std::vector<at::Tensor>& params) = 0;
  // The strategy's own state for the common layout just made (bucket_unit:
  // each bucket's unit, -1 for none).
  virtual void lay_out(State& s, const std::vector<int64_t>& bucket_unit) = 0;
  // A MixedPrecisionPolicy, its dtypes already checked (see check_policy).
  virtual void take_policy(State& s, const MixedPrecisionPolicy& policy) = 0;
  // The modules that are FULL_SHARD units, in order (none elsewhere).
  virtual std::size_t unit_count() const { return 0; }
  virtual std::vector<const torch::nn::Module*> unit_modules() const { return {}; }

  // -- a synced backward --
  // Before it: whatever the last step's reductions still hold handed back.
  virtual void arm(const Locked&) {}
  // Bucket b's reduction started, its gradients all ready (all-reduce or reduce-scatter).
  virtual void issue(const Locked& held, std::size_t b) = 0;
  // Every reduction waited for and its result written where the optimizer reads it.
  virtual void finish(const Locked& held) = 0;
  // The end of a forward and backward pass: FULL_SHARD's units freed.
  virtual void end_unit_pass(const Locked&) {}
  // A joined rank standing in for the others' backward (DDP's join).
  virtual void shadow_backward(const Locked& held) = 0;

  // -- NO_SHARD's options (refused by the sharded strategies) --
  virtual void register_comm_hook(const Locked& held, CommHook hook) = 0;
  virtual void gradient_as_bucket_view(const Locked& held, bool on) = 0;

  // -- the shards and the optimizers that step them --
  virtual at::Tensor shard_of(const State&, const at::Tensor&) const { return {}; }
  virtual void shard_optimizer(const Locked&, torch::optim::Optimizer&) {}
  virtual bool steps_with(const Locked&, const torch::optim::Optimizer&) const { return false; }
  virtual void check_shards(const Locked&) {}
  virtual void gather_shards(const Locked&) {}
  // DataParallel::release_module: the module whole again, the optimizers
  // given its parameters back.
  virtual void release_module(const Locked&) {}

  // -- FULL_SHARD's units --
  // summon_full_params: every unit gathered until the returned count of holders drops.
  virtual void summon_units(const Locked&) {}
  virtual void set_prefetch(const Locked&, bool /*forward*/, bool /*backward*/) {}
  // For the destructor: the units' parameters given memory of their own. Never throws.
  virtual void let_go_of_units(const Locked&) noexcept {}

  // -- what a checkpoint reads and writes (ShardedStateDict) --
  virtual std::optional<Piece> piece_of(const Locked&, const at::Tensor&) const { return std::nullopt; }
  virtual bool writes_pieces() const { return false; }
  virtual std::pair<int64_t, int64_t> load_range(const Locked&, const at::Tensor& p) const { return {0, p.numel()}; }
  virtual void load_values(const Locked&, const std::function<at::Tensor(const at::Tensor&)>&) {}
  virtual void open_for_load(const Locked&) {}
  virtual void reshard(const Locked&) {}
};
inline const GroupPtr& Strategy::shard_group() const {
  static const GroupPtr none;
  return none;
}

// A MixedPrecisionPolicy's dtypes are floating-point, whatever the strategy.
inline void check_policy(const MixedPrecisionPolicy& policy) {
  for (const auto& dtype : {policy.param_dtype, policy.reduce_dtype, policy.output_dtype})
    if (dtype && !c10::isFloatingType(*dtype))
      throw InvalidArgument(
          std::string("accel::DataParallel: a MixedPrecisionPolicy's dtypes are floating-point; got ") +
          c10::toString(*dtype));
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/state.hpp ==============================================
// accel/training/dp/state.hpp: DataParallel's state: the buckets' common layout and the strategy's own (Replicated, or Sharded with FULL_SHARD's Units), shared with its autograd hooks.
//
// A DataParallel keeps everything in one State behind a shared_ptr: the
// autograd hooks it registers outlive it inside the graph, and see
// `alive` turn false when it goes. The reducer (dp/reducer.hpp), the
// ZeRO-3 units (dp/units.hpp), the sharded reduce-scatter (dp/scatter.hpp)
// and DataParallel itself work on it, always under its mutex: only
// DataParallel's public methods, the handles it returns, unit_forward and
// the autograd hooks take it, each by making a Locked, and every engine
// function that reads or changes the State after its construction takes
// that Locked (below), so the compiler checks the rule.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// DataParallel's state is one common layout of buckets (below) and the
// strategy's own state, held in State::mode by one of the two strategies
// (dp/strategy.hpp's interface; their operations are in dp/strategies.hpp):
//   Replicated (NO_SHARD): each bucket all-reduced, through a communication hook;
//   Sharded (SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD): each parameter cut in
//     chunks, each bucket reduce-scattered into this rank's shards; with
//     Units (FULL_SHARD, HYBRID_SHARD) the parameters of each unit also
//     gathered only while the unit runs.
// FULL_SHARD is no third type: it is ZeRO-2 for every bucket (its root's
// parameters are sharded exactly as SHARD_GRAD_OP's) plus Units, which
// SHARD_GRAD_OP has none of; the units' code runs over the units' buckets
// only, so it needs no test of the mode. The mode is chosen once, in
// DataParallel's constructor; the engine's functions of one strategy reach
// its state through replicated() / sharded().

// A bucket as every strategy lays it out: its parameters (one dtype and
// device), the flags of which had a gradient, and its reduction in flight.
struct Bucket {
  // Every member has an initializer: GCC 14's -Wextra flags designated
  // initializers that leave out members without one.
  std::vector<at::Tensor> params{};
  std::vector<uint8_t> used{};  // per parameter: a gradient arrived since the last sync
  std::vector<uint8_t> seen{};  // per parameter: ... in the armed backward
  c10::ScalarType dtype;
  c10::Device device;
  detail::Packing packing;  // of the reduced buffer: the gradients, then one used-flag per parameter
  std::size_t ready = 0;
  Work<at::Tensor> work{};  // its all-reduce (Replicated) or reduce-scatter (Sharded) in flight
};

// NO_SHARD's per bucket: the buffer being reduced (`persistent`, or what
// the communication hook returned), the buffer kept across steps (under
// gradient_as_bucket_view the gradients' storage too), and without a
// registered hook the group's size, the gradients' divisor (dp/reducer.hpp).
// A small bucket all-reduced point to point (dp/reducer.hpp's
// all_reduces_directly) has its reduce-scatter in `scattering` until
// finish issues the all-gather (then Bucket::work), and the peers' chunks
// land in `rows`, kept across steps as `persistent` is.
struct ReplicatedBucket {
  at::Tensor flat{}, persistent{}, divisor{}, rows{};
  Work<Work<at::Tensor>> scattering{};
};
struct Replicated final : Strategy {
  std::vector<ReplicatedBucket> buckets{};       // (State::buckets' order)
  CommHook hook = comm_hooks::allreduce_hook();  // (see register_comm_hook)
  bool hooked = false;
  bool bucket_view = false;  // (see gradient_as_bucket_view)

  std::vector<int64_t> assign_units(State& s, const torch::nn::Module& module,
                                    const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                    const std::vector<at::Tensor>& params) override;
  void lay_out(State& s, const std::vector<int64_t>& bucket_unit) override;
  void take_policy(State& s, const MixedPrecisionPolicy& policy) override;
  void issue(const Locked& held, std::size_t b) override;
  void finish(const Locked& held) override;
  void shadow_backward(const Locked& held) override;
  void register_comm_hook(const Locked& held, CommHook hook) override;
  void gradient_as_bucket_view(const Locked& held, bool on) override;
};

// Sharding's per bucket. A rank's segment holds its chunk of each
// parameter (chunks[i] elements at offsets[i]), then the used-flags;
// `segment` elements in all.
struct ShardedBucket {
  std::vector<int64_t> offsets{}, chunks{};
  int64_t segment = 0;
  // This rank's shards, one after another in `owned` (segment - n
  // elements): shards[i] is a leaf standing on its piece, so the
  // all-gather's input is `owned` itself, never a copy made per step.
  // Their gradients likewise live in `owned_grads` once a reduction wrote
  // them (kept between steps: 1/S of the gradients, as FSDP's sharded
  // gradients; `segment` elements, so that a reduction can fold its
  // used-flags in there too).
  at::Tensor owned{}, owned_grads{};
  at::Tensor used_anywhere{};  // (CPU bools, one per parameter: a reduction's used-flags read back)
  std::vector<at::Tensor> shards{};
  std::vector<uint8_t> in_optimizer{};
  std::vector<at::Tensor> sums{};  // each shard's sum at the last gather (see check_shards)
  // The reduce-scatter's pooled buffers: its laid-out input, what its
  // all-to-all received, and where the chunks fold when they cannot fold
  // straight into the shards' gradients.
  Lease laid_out{}, received{}, folded{};
  int64_t unit = -1;  // the unit whose parameters these are (-1: none, whole while the model runs)
};

// A unit's bucket (FULL_SHARD): which bucket, whether its parameters hold
// their values now, and a gather in flight. `full` is the pooled buffer
// its gather lands in, the parameters' memory while it is resident. Under
// a MixedPrecisionPolicy's param_dtype: whether `full` holds the parameters
// in that dtype (gathered for compute), the shards cast to it while their
// gather is in flight (`cast`, pooled), each parameter as it is at rest
// (`rest`: its own dtype and storage, which it takes back when released),
// and as it computes (`compute`: that dtype, on a storage of its own that
// points into `full` while the unit holds its values and at nothing
// otherwise; dp/unit_params.hpp says why).
struct UnitBucket {
  std::size_t bucket = 0;  // into State::buckets
  bool resident = true;
  Lease full{};
  bool low = false;
  Lease cast{};
  std::vector<at::Tensor> rest{}, compute{};
  std::vector<std::string> at_rest{};  // per parameter: what a kernel that reads it at rest throws
  Work<at::Tensor> gathering{};
};
struct Unit {
  const torch::nn::Module* module = nullptr;
  std::vector<UnitBucket> buckets{};
};
// FULL_SHARD's units; the order they ran in this forward and the last
// (prefetching follows it); summon_full_params() objects alive. Under a
// MixedPrecisionPolicy: the dtype units compute in (gathered in; none: the
// parameters' own), and the one outputs are cast to; cast_inputs: a unit's
// floating-point inputs are cast to the dtype its parameters hold.
struct Units {
  std::vector<Unit> list{};
  std::vector<std::size_t> order{}, last_order{};
  bool new_pass = true;
  bool prefetch_forward = true, prefetch_backward = true;  // (see AcceleratorConfig::forward_prefetch)
  int held = 0;
  std::optional<c10::ScalarType> param_dtype{}, output_dtype{};
  bool cast_inputs = true;
};
struct Sharded final : Strategy {
  Sharded(GroupPtr shard_group, GroupPtr replicate_group)
      : shard(std::move(shard_group)), replicate(std::move(replicate_group)) {}

  GroupPtr shard{}, replicate{};         // sharded along shard, averaged along replicate too (HSDP)
  std::vector<ShardedBucket> buckets{};  // (State::buckets' order)
  // Where each parameter's shard is, and the optimizers stepping them.
  std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, std::size_t>> shard_index{};  // (bucket, i)
  std::vector<torch::optim::Optimizer*> optimizers{};
  std::optional<c10::ScalarType> reduce_dtype{};  // a MixedPrecisionPolicy's: the dtype gradients reduce in
  Units units{};                                  // none under SHARD_GRAD_OP

  bool shards() const override { return true; }
  const GroupPtr& shard_group() const override { return shard; }
  std::vector<int64_t> assign_units(State& s, const torch::nn::Module& module,
                                    const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                    const std::vector<at::Tensor>& params) override;
  void lay_out(State& s, const std::vector<int64_t>& bucket_unit) override;
  void take_policy(State& s, const MixedPrecisionPolicy& policy) override;
  std::size_t unit_count() const override;
  std::vector<const torch::nn::Module*> unit_modules() const override;
  void arm(const Locked& held) override;
  void issue(const Locked& held, std::size_t b) override;
  void finish(const Locked& held) override;
  void end_unit_pass(const Locked& held) override;
  void shadow_backward(const Locked& held) override;
  void register_comm_hook(const Locked& held, CommHook hook) override;
  void gradient_as_bucket_view(const Locked& held, bool on) override;
  at::Tensor shard_of(const State& s, const at::Tensor& p) const override;
  void shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) override;
  bool steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) const override;
  void check_shards(const Locked& held) override;
  void gather_shards(const Locked& held) override;
  void release_module(const Locked& held) override;
  void summon_units(const Locked& held) override;
  void set_prefetch(const Locked& held, bool forward, bool backward) override;
  void let_go_of_units(const Locked& held) noexcept override;
  std::optional<Piece> piece_of(const Locked& held, const at::Tensor& p) const override;
  bool writes_pieces() const override;
  std::pair<int64_t, int64_t> load_range(const Locked& held, const at::Tensor& p) const override;
  void load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) override;
  void open_for_load(const Locked& held) override;
  void reshard(const Locked& held) override;
};

// Every parameter of the bucket had a gradient here since the last sync:
// then each was used on some rank, and the reduced flags need not be read
// back (on a GPU that read would make the host wait for the reduction).
inline bool used_by_all_here(const Bucket& bucket) {
  return std::all_of(bucket.used.begin(), bucket.used.end(), [](uint8_t u) { return u != 0; });
}

// Writes the bucket's used-flags (host bytes) into `to`, a view of the
// buffer about to be reduced (repeated along its rows where it has rows).
// On a device, copying from ordinary host memory would make the host wait
// for everything queued before it, once per bucket in the middle of the
// backward; instead every flag set (the usual case) is a fill, and other
// flags travel from page-locked memory without waiting (the caching host
// allocator keeps it until the copy ends), as DDP copies its used map.
inline void write_used_flags(const at::Tensor& to, const Bucket& bucket) {
  const auto n = static_cast<int64_t>(bucket.used.size());
  const at::Tensor flags = at::from_blob(const_cast<uint8_t*>(bucket.used.data()), {n}, at::TensorOptions(c10::kByte));
  if (to.is_cpu()) {
    to.copy_(flags);
  } else if (used_by_all_here(bucket)) {
    to.fill_(1);
  } else if (to.is_cuda()) {
    const at::Tensor staged = at::empty({n}, at::TensorOptions(to.scalar_type()).pinned_memory(true)).copy_(flags);
    to.copy_(staged.to(to.device(), /*non_blocking=*/true));
  } else {
    to.copy_(flags);
  }
}

struct State {
  // The sharded steps' working buffers, reused (dp/buffers.hpp). First, so
  // that it is destroyed last: a bucket's Work still in flight when the
  // state goes lands into the pool as it is destroyed.
  BufferPool pool;
  std::mutex mutex;
  ParameterNames names;  // the module's parameters by name, for errors that name one
  GroupPtr group;
  int64_t replicas = 1;  // gradients are averaged over this many ranks
  std::vector<Bucket> buckets;
  std::size_t next = 0;   // buckets launch strictly in order: the same on every rank
  std::size_t fired = 0;  // parameters whose gradient arrived in the armed backward
  bool armed = false, alive = true;
  std::function<void(std::size_t)> on_issued;
  TimelineClock timeline;  // the last synced backward's moments per bucket (dp/timeline.hpp)
  // The strategy and its state (Replicated when not distributed).
  std::unique_ptr<Strategy> mode = std::make_unique<Replicated>();
};
// The strategy's state, for the engine's functions of that strategy (each
// is called only through it: a wrong one is a bug of ours, said so).
inline Sharded& sharded(State& s) {
  if (!s.mode->shards()) throw LogicError("accel::DataParallel: a sharded operation on a model that is not sharded");
  return static_cast<Sharded&>(*s.mode);
}
inline const Sharded& sharded(const State& s) { return sharded(const_cast<State&>(s)); }
inline Replicated& replicated(State& s) {
  if (s.mode->shards()) throw LogicError("accel::DataParallel: a NO_SHARD operation on a sharded model");
  return static_cast<Replicated&>(*s.mode);
}
inline const Replicated& replicated(const State& s) { return replicated(const_cast<State&>(s)); }
// Unit u's part of bucket b (b is one of the unit's buckets).
inline const UnitBucket& unit_bucket(const Units& units, int64_t u, std::size_t b) {
  for (const auto& ub : units.list[static_cast<std::size_t>(u)].buckets)
    if (ub.bucket == b) return ub;
  throw LogicError("accel::DataParallel: bucket " + std::to_string(b) + " is not unit " + std::to_string(u) + "'s");
}

// The common layout: `params` (each tensor once, in the order backward
// produces their gradients) put in buckets by DDP's assignment (dp/buckets.hpp;
// size_limits: the first bucket's, then every other's; a unit's parameters
// in buckets of their own), each with room for its used-flags after the
// gradients. Returns each bucket's unit (-1: none).
inline std::vector<int64_t> lay_out(State& s, const std::vector<at::Tensor>& params,
                                    const std::vector<int64_t>& unit_of, const std::vector<int64_t>& size_limits) {
  std::vector<BucketInput> inputs;
  for (std::size_t k = 0; k < params.size(); ++k)
    inputs.push_back(
        {params[k].scalar_type(), params[k].device(), params[k].numel() * params[k].element_size(), unit_of[k]});
  std::vector<int64_t> bucket_unit;
  for (const auto& indices : compute_bucket_assignment_by_size(inputs, size_limits).buckets) {
    const at::Tensor& first = params[indices.front()];
    Bucket bucket{.dtype = first.scalar_type(), .device = first.device(), .packing = Packing(first.scalar_type())};
    bucket_unit.push_back(unit_of[indices.front()]);
    for (std::size_t k : indices) {
      bucket.params.push_back(params[k]);
      bucket.used.push_back(0);
      bucket.seen.push_back(0);
      bucket.packing.add(params[k]);
    }
    bucket.packing.add({static_cast<int64_t>(bucket.params.size())}, bucket.dtype);  // the used-flags
    s.buckets.push_back(std::move(bucket));
  }
  return bucket_unit;
}

// Proof that a State's mutex is held, and the way to the State for the
// engine's functions: made (locking) by DataParallel's public methods, the
// handles it returns (FullParameters, UnitByUnit), unit_forward and the
// autograd hooks, and passed down. No engine function locks: one that
// needs the state takes a `const Locked&`, so none can be called without
// the lock, nor lock it again (the mutex is not recursive: a second lock
// would deadlock).
class Locked {
 public:
  explicit Locked(State& state) : state_(state), lock_(state.mutex) {}
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
  State& state() const { return state_; }

 private:
  State& state_;
  std::lock_guard<std::mutex> lock_;
};

// What a hook gets for bucket b laid out in `buffer`. The parameters and
// the gradients' views only for a registered hook: the default needs the
// buffer alone, and this runs for every bucket of every step.
inline GradBucket grad_bucket(const Locked& held, std::size_t b, const at::Tensor& buffer) {
  const State& s = held.state();
  const Bucket& bucket = s.buckets[b];
  GradBucket out{.buffer = buffer, .index = b, .is_last = b + 1 == s.buckets.size()};
  if (replicated(s).hooked) {
    out.parameters = bucket.params;
    for (std::size_t i = 0; i < bucket.params.size(); ++i) out.gradients.push_back(bucket.packing.view(buffer, i));
  }
  return out;
}

// On Gloo with CPU tensors the engine's all-gathers and reduce-scatters
// run point to point (dp/unit_params.hpp, dp/scatter.hpp), with a tag no caller
// is likely to pick for sends of its own. A bucket whose pieces are large,
// kPieceBytes per parameter and rank on average, moves each parameter's
// chunk as a message of its own, straight between the parameters (or
// gradients) and the shards; a smaller one moves one message per peer
// through a buffer laid out rank after rank, copied in or out: a Gloo
// message costs about what copying kPieceBytes does, and a model of many
// small parameters would pay it per parameter.
inline constexpr int kGatherTag = 0x61636365;
inline constexpr int64_t kPieceBytes = int64_t{256} << 10;
inline bool large_pieces(const ShardedBucket& bucket, int64_t element_size) {
  return bucket.owned.numel() * element_size >= kPieceBytes * static_cast<int64_t>(bucket.shards.size());
}
// How far a fully sharded model's collectives run ahead of its compute
// where units are small: the reduce-scatters in flight together
// (dp/scatter.hpp's room_in_flight) and the units gathered ahead of the one
// computing (dp/units.hpp's prefetch_ahead) hold at most this many bytes,
// beyond the one that is always allowed. A large unit (at least this size)
// thus keeps one of each, as FSDP2 does; small units, whose collectives
// each cost a round trip to every peer whatever their size, do not wait
// for one another. 4 MiB: measured with run_llama_bench.sh's `small` set
// (units of about 200 KiB) and run_sharding_bench.sh (16 MiB units, which
// it leaves as they were); docs/benchmarks.md has the figures.
inline constexpr int64_t kAheadBytes = int64_t{4} << 20;
// The dtype bucket b's gradients are reduce-scattered in.
inline c10::ScalarType reduce_dtype(const State& s, std::size_t b) {
  return sharded(s).reduce_dtype.value_or(s.buckets[b].dtype);
}

}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/chunks.hpp =============================================
// accel/training/dp/chunks.hpp: the chunk layout sharding cuts every parameter into: S equal chunks, the last padded.
//
// Under sharding (dp/shards.hpp) a parameter of n elements is cut into S
// chunks of c = ceil(n / S) elements of it flattened, rank r keeping chunk
// r; a bucket's gradients travel laid out rank after rank, chunk r of each
// gradient in row r. These functions move tensors in and out of that
// layout; they know nothing of buckets or groups.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// The chunk layout: t flattened and zero-padded to S chunks of c, chunk r
// being row r. read_rows copies t's rows into columns [off, off + c) of
// rows, zeros where t ends before them (so rows need not start zeroed: a
// pass over the whole buffer saved); write_rows copies them back into t;
// read_chunk copies row r alone into `out`.
inline void read_rows(const at::Tensor& t, const at::Tensor& rows, int64_t off, int64_t c) {
  const at::Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel(), full = c ? n / c : 0, rest = n - full * c;
  const at::Tensor columns = rows.narrow(1, off, c);
  if (full) columns.narrow(0, 0, full).copy_(flat.narrow(0, 0, full * c).view({full, c}));
  if (rest) {
    columns[full].narrow(0, 0, rest).copy_(flat.narrow(0, full * c, rest));
    columns[full].narrow(0, rest, c - rest).zero_();
  }
  const int64_t filled = full + (rest ? 1 : 0);
  if (filled < rows.size(0)) columns.narrow(0, filled, rows.size(0) - filled).zero_();
}
inline void write_rows(const at::Tensor& rows, int64_t off, int64_t c, at::Tensor& t) {
  const int64_t n = t.numel(), full = c ? n / c : 0, rest = n - full * c;
  const at::Tensor columns = rows.narrow(1, off, c);
  if (!t.is_contiguous()) {
    t.copy_(columns.reshape({-1}).narrow(0, 0, n).view(t.sizes()));
    return;
  }
  const at::Tensor flat = t.view({-1});
  if (full) flat.narrow(0, 0, full * c).view({full, c}).copy_(columns.narrow(0, 0, full));
  if (rest) flat.narrow(0, full * c, rest).copy_(columns[full].narrow(0, 0, rest));
}
// Rank r's chunk of a tensor of n elements cut in chunks of c: (begin,
// length), the last chunks short or empty.
inline std::pair<int64_t, int64_t> chunk_range(int64_t r, int64_t c, int64_t n) {
  const int64_t begin = std::min(r * c, n);
  return {begin, std::min(c, n - begin)};
}
inline void read_chunk(const at::Tensor& t, int64_t r, int64_t c, const at::Tensor& out) {
  const at::Tensor flat = t.reshape({-1});
  const auto [begin, length] = chunk_range(r, c, flat.numel());
  if (length) out.narrow(0, 0, length).copy_(flat.narrow(0, begin, length));
  if (length < c) out.narrow(0, length, c - length).zero_();
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/scatter.hpp ============================================
// accel/training/dp/scatter.hpp: ZeRO's gradient reduce-scatter: issued from reused buffers, landed in the shards' gradients.
//
// Under sharding a bucket's gradients are laid out rank after rank (each
// rank's chunk of every gradient, then one used-flag per parameter) and
// reduce-scattered over the shard group, so that each rank receives the
// sum of its own chunks; along a replicate group (HSDP) that is all-reduced
// too. issue_scatter starts it as soon as the bucket is complete;
// land_scatter waits for it and gives the averaged chunks to the shards'
// gradients. The buffers are leases from the state's pool (dp/buffers.hpp) and
// few buckets are in flight (room_in_flight): issuing one more lands the
// oldest first, so the pool holds one or two large buckets' buffers, or
// small ones' up to a few MiB, never the whole model's. A bucket
// of large parameters on Gloo skips the laying out: its reduce-scatter runs
// point to point from the gradients themselves (start_direct_scatter).

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// Whether one more bucket (`bytes`) may join the `count` reduce-scatters
// in flight (holding `in_flight` bytes of gradients) without landing the
// oldest first. Each holds its gradients (whole until reduced) and what it
// receives: about twice the bucket's size. Without units (SHARD_GRAD_OP,
// whose whole parameters stay resident anyway) two, so a bucket's
// messages also overlap the next layer's backward: one measured up to 6 %
// slower there. With fully sharded units (FULL_SHARD, HYBRID_SHARD:
// chosen to save memory) as many as together hold at most kAheadBytes
// (dp/state.hpp), and at least one: a large unit's bucket lands the one
// before it, as FSDP2 keeps one reduce-scatter outstanding (measured on
// the sharding benchmark, tests/bench/run_sharding_bench.sh, 16 MiB units
// at 2 and 4 processes: the same step time as two, the peak 32 MiB lower);
// small units' buckets stay in flight together instead of each waiting for
// the one before, which made every small unit's backward wait for a round
// trip to every peer (the small LLaMA of run_llama_bench.sh's `small` set).
inline bool room_in_flight(const Sharded& z, std::size_t count, int64_t in_flight, int64_t bytes) {
  if (z.units.list.empty()) return count < 2;
  return count == 0 || in_flight + bytes <= kAheadBytes;
}

// A bucket's pooled buffers given back (after its reduce-scatter landed, or
// was waited for and dropped).
inline void give_back(ShardedBucket& bucket) {
  bucket.laid_out.reset();
  bucket.received.reset();
  bucket.folded.reset();
}

// The bucket's owned_grads, made on first use: the shards' gradients, then
// room for the used-flags (`segment` elements), so a reduction can fold
// straight into it.
inline const at::Tensor& owned_grads(ShardedBucket& bucket, const at::TensorOptions& options) {
  if (!bucket.owned_grads.defined()) bucket.owned_grads = at::empty({bucket.segment}, options);
  return bucket.owned_grads;
}

// Waits for bucket b's reduce-scatter (and its all-reduce along the
// replicate group), then gives each used parameter's shard its averaged
// chunk as gradient. Where the reduction folded straight into owned_grads
// (every shard's gradient was none: the first use, or zero_grad() set them
// to none) each gradient becomes its piece of it, kept across steps;
// otherwise the chunks are added into the gradients there, as a
// parameter's gradient accumulates. The parameters' own gradients were
// released when the bucket was issued.
inline void land_scatter(const Locked& held, std::size_t b) {
  State& s = held.state();
  Sharded& z = sharded(s);
  Bucket& layout = s.buckets[b];
  ShardedBucket& bucket = z.buckets[b];
  at::Tensor reduced;
  try {
    s.timeline.stamp(b, &BucketTimes::waiting);
    reduced = layout.work.wait();  // (owned_grads, or the pooled buffer it folded into)
    if (z.replicate) reduced = all_reduce_async(reduced, ReduceOp::SUM, z.replicate).wait();
    s.timeline.stamp(b, &BucketTimes::landed);
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: a gradient bucket's reduction failed: ") +
                           detail::error_text(e));
  }
  const auto n = static_cast<int64_t>(layout.params.size());
  const bool all_used = used_by_all_here(layout);  // (then the reduced flags need not be read)
  if (!all_used) {
    const at::Tensor flags = reduced.narrow(0, bucket.segment - n, n);
    if (flags.is_cpu()) at::gt_out(bucket.used_anywhere, flags, 0);  // (no allocation per step)
    else bucket.used_anywhere.copy_(flags.gt(0));
  }
  const bool* used = all_used ? nullptr : bucket.used_anywhere.data_ptr<bool>();
  const bool in_place = bucket.owned_grads.defined() && reduced.is_alias_of(bucket.owned_grads);
  for (int64_t i = 0; i < n; ++i) {
    if (all_used || used[i]) {
      at::Tensor& shard = bucket.shards[static_cast<std::size_t>(i)];
      const at::Tensor averaged = reduced.narrow(0, bucket.offsets[i], bucket.chunks[i]);
      if (in_place) {
        shard.mutable_grad() = averaged.detach();  // (a leaf's gradient, not an autograd view)
      } else if (shard.grad().defined()) {
        shard.mutable_grad().add_(averaged);
      } else {
        shard.mutable_grad() =
            owned_grads(bucket, bucket.owned.options()).narrow(0, bucket.offsets[i], bucket.chunks[i]).detach();
        shard.mutable_grad().copy_(averaged);
      }
    }
    layout.used[static_cast<std::size_t>(i)] = 0;
  }
  give_back(bucket);
}

// Bucket b's reduce-scatter point to point, straight from the gradients
// (Gloo with CPU tensors, and pieces as large as gather_params wants them,
// dp/unit_params.hpp): to each peer its chunk of every gradient, a message each,
// and this rank's used-flags; what arrives lands in the rows of `received`
// by sender, this rank's own row copied in from its gradients, and the
// rows are folded as the all-to-all's would be (the same sum in the same
// order; the division by the replicas follows the fold, since the
// gradients are not ours to change). No laid-out copy of the bucket is
// made: each gradient is sent from where autograd left it, and kept alive
// until the bucket lands. Every rank must take the same path, so the
// choice rests on what all ranks share (the backend, the device, the
// bucket's sizes), never on this rank's gradients: one that is none here
// (a parameter this rank did not use) sends zeros, as the rows path lays
// them out.
inline bool scatters_directly(const State& s, std::size_t b) {
  return sharded(s).shard->getBackendName() == "gloo" && s.buckets[b].device.is_cpu() &&
         large_pieces(sharded(s).buckets[b], static_cast<int64_t>(c10::elementSize(reduce_dtype(s, b))));
}
inline Work<at::Tensor> start_direct_scatter(const State& s, std::size_t b, const at::Tensor& out) {
  const Sharded& z = sharded(s);
  const Bucket& layout = s.buckets[b];
  const ShardedBucket& bucket = z.buckets[b];
  const std::size_t n = layout.params.size();
  const int64_t S = z.shard->getSize(), me = z.shard->getRank(), flags = bucket.segment - static_cast<int64_t>(n);
  const at::Tensor rows = bucket.received.tensor().view({S, bucket.segment});
  std::vector<at::Tensor> grads;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& p = layout.params[i];
    // (in the reduction's dtype: a policy's reduce_dtype casts)
    grads.push_back(p.grad().defined() ? p.grad().reshape({-1}).to(rows.scalar_type())
                                       : at::zeros({p.numel()}, rows.options()));
    p.mutable_grad().reset();  // the shard's gradient accumulates it from here
    const auto [begin, length] = chunk_range(me, bucket.chunks[i], grads[i].numel());
    rows[me].narrow(0, bucket.offsets[i], length).copy_(grads[i].narrow(0, begin, length));
    if (length < bucket.chunks[i]) rows.narrow(1, bucket.offsets[i] + length, bucket.chunks[i] - length).zero_();
  }
  write_used_flags(rows[me].narrow(0, flags, static_cast<int64_t>(n)), layout);
  auto sent = [&](int to, std::size_t i) {
    if (i == n) return rows[me].narrow(0, flags, static_cast<int64_t>(n));
    const auto [begin, length] = chunk_range(to, bucket.chunks[i], grads[i].numel());
    return grads[i].narrow(0, begin, length);
  };
  auto into = [&](int from, std::size_t i) {
    if (i == n) return rows[from].narrow(0, flags, static_cast<int64_t>(n));
    return rows[from].narrow(0, bucket.offsets[i], chunk_range(me, bucket.chunks[i], grads[i].numel()).second);
  };
  auto pending = detail::start_exchange_pieces(*z.shard, n + 1, sent, into, kGatherTag, detail::kDirectScatter);
  // (grads moved into the landing only now: `sent` reads them above, and a
  // function's arguments may be evaluated in any order)
  return Work<at::Tensor>(detail::then(
      std::move(pending), [rows, out = at::Tensor(out), grads = std::move(grads), replicas = s.replicas]() mutable {
        detail::fold_rows_into(rows, out, ReduceOp::SUM);
        if (replicas != 1) out.div_(replicas);
        return out;
      }));
}

// Lays bucket b's gradients out rank after rank (pre-divided by the number
// of replicas, as DDP does) and starts its reduce-scatter without waiting,
// first landing the oldest buckets in flight while room_in_flight says no.
// Large buckets on Gloo go point to point instead (start_direct_scatter).
inline void issue_scatter(const Locked& held, std::size_t b) {
  State& s = held.state();
  Sharded& z = sharded(s);
  std::size_t count = 0;
  int64_t in_flight = 0;
  for (std::size_t e = 0; e < b; ++e)
    if (s.buckets[e].work.valid()) {
      ++count;
      in_flight += s.buckets[e].packing.bytes();
    }
  for (std::size_t e = 0; e < b && !room_in_flight(z, count, in_flight, s.buckets[b].packing.bytes()); ++e)
    if (s.buckets[e].work.valid()) {
      land_scatter(held, e);
      --count;
      in_flight -= s.buckets[e].packing.bytes();
    }
  Bucket& layout = s.buckets[b];
  ShardedBucket& bucket = z.buckets[b];
  at::NoGradGuard no_grad;
  const std::size_t n = layout.params.size();
  const int64_t S = z.shard->getSize();
  // (the shards' options, in the reduction's dtype: a parameter may hold a
  // policy's param_dtype now, while its unit runs)
  const c10::TensorOptions options = bucket.owned.options().dtype(reduce_dtype(s, b));
  // Where the folded chunks land: straight in the shards' gradients when
  // every one is none (the usual step, after zero_grad()) and the reduction
  // is in their dtype, so that landing copies nothing; else in a pooled
  // buffer, added into them when it lands.
  const bool into_grads =
      options.dtype() == bucket.owned.dtype() &&
      std::none_of(bucket.shards.begin(), bucket.shards.end(), [](const at::Tensor& t) { return t.grad().defined(); });
  try {
    bucket.received = s.pool.take(S * bucket.segment, options);
    c10d::ProcessGroup* g = detail::enter_reduce_scatter(bucket.received.tensor(), ReduceOp::SUM, z.shard);
    if (!into_grads) bucket.folded = s.pool.take(bucket.segment, options);
    const at::Tensor out = into_grads ? owned_grads(bucket, options) : bucket.folded.tensor();
    if (scatters_directly(s, b)) {
      layout.work = start_direct_scatter(s, b, out);
      return;
    }
    bucket.laid_out = s.pool.take(S * bucket.segment, options);  // (every element written below)
    const at::Tensor& laid_out = bucket.laid_out.tensor();
    const at::Tensor rows = laid_out.view({S, bucket.segment});
    for (std::size_t i = 0; i < n; ++i)
      if (layout.params[i].grad().defined()) {
        read_rows(layout.params[i].grad(), rows, bucket.offsets[i], bucket.chunks[i]);
        layout.params[i].mutable_grad().reset();  // the shard's gradient accumulates it from here
      } else {
        rows.narrow(1, bucket.offsets[i], bucket.chunks[i]).zero_();
      }
    write_used_flags(rows.narrow(1, bucket.segment - static_cast<int64_t>(n), static_cast<int64_t>(n)), layout);
    if (s.replicas != 1) laid_out.div_(s.replicas);
    layout.work =
        Work<at::Tensor>(detail::start_reduce_scatter_into(*g, laid_out, bucket.received.tensor(), out, ReduceOp::SUM));
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: issuing a gradient bucket's reduce_scatter failed: ") +
                           detail::error_text(e));
  }
}

// The end of a sharded backward: every bucket still in flight landed, in order.
inline void finish_sharded(const Locked& held) {
  State& s = held.state();
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    if (s.buckets[b].work.valid()) land_scatter(held, b);
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/reducer.hpp ============================================
// accel/training/dp/reducer.hpp: DataParallel's reducer: a bucket issued as soon as its gradients are ready.
//
// A ReadyHook on each parameter's gradient accumulator marks the gradient
// ready; when a bucket is complete (and every bucket before it issued, so
// that every rank issues the same sequence) issue_bucket flattens it and
// starts its all-reduce (through a registered communication hook, or the
// default's division made by the flattening copy) or, sharded, its
// reduce-scatter (dp/scatter.hpp), without waiting; without a hook, a
// small bucket on Gloo is all-reduced point to point instead
// (all_reduces_directly). finish_unsharded waits for the all-reduces and
// writes the averaged gradients back.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// Whether bucket b's default all-reduce runs point to point
// (distributed/direct_all_reduce.hpp: a reduce-scatter and an all-gather,
// one round of messages each) rather than as Gloo's ring, whose 2 (P - 1)
// steps each wait for the rank before: for a small bucket those waits are
// the cost. Measured on 2 cores, torch 2.15, one thread per rank
// (run_all_reduce_paths_bench.sh; docs/benchmarks.md, part 8), both paths
// alone from 4 KiB to 16 MiB: point to point is 1.3-1.9x faster up to
// 256 KiB at 2 ranks, 1.53x alone and 0.84x with four in flight at
// 512 KiB, 0.72x from 1 MiB on; at 4 ranks 1.1-1.9x up to 2 MiB (four in
// flight), 0.89x from 4 MiB on. In a step, the GPT benchmark's one 0.9 MiB
// bucket (run_sharding_bench.sh's gpt set) point to point took a NO_SHARD
// step from 56.4 to 54.2 ms at 4 processes and left it as it was at 2
// (24.9 against 24.8; medians of 3 rounds). Hence up to 512 KiB per peer,
// at most 2 MiB (beyond 4 ranks an extrapolation: the ring's steps grow
// with the ranks, its bytes do not). Every rank takes the same path: the
// choice rests on the backend, the device, the group's size and the
// bucket's, never on this rank's gradients.
inline constexpr int64_t kDirectAllReducePeerBytes = int64_t{512} << 10;
inline constexpr int64_t kDirectAllReduceMaxBytes = int64_t{2} << 20;
inline bool all_reduces_directly(const State& state, std::size_t b) {
  const int64_t peers = state.group->getSize() - 1;
  const Bucket& bucket = state.buckets[b];
  return peers > 0 && !replicated(state).hooked && state.group->getBackendName() == "gloo" && bucket.device.is_cpu() &&
         bucket.packing.bytes() <= std::min(kDirectAllReducePeerBytes * peers, kDirectAllReduceMaxBytes);
}
// Starts the default all-reduce (a sum) of bucket b's `flat`: Gloo's into
// Bucket::work, or point to point's first phase into `scattering`
// (issue_second_phases issues the second).
inline void start_default_all_reduce(State& state, std::size_t b, const at::Tensor& flat) {
  ReplicatedBucket& reduced = replicated(state).buckets[b];
  if (!all_reduces_directly(state, b)) {
    state.buckets[b].work = all_reduce_async(flat, ReduceOp::SUM, state.group);
    return;
  }
  const int64_t P = state.group->getSize(), columns = (flat.numel() + P - 1) / P;
  if (!reduced.rows.defined() || reduced.rows.scalar_type() != flat.scalar_type() || reduced.rows.size(1) != columns)
    reduced.rows = at::empty({P, columns}, flat.options());
  reduced.scattering =
      Work<Work<at::Tensor>>(detail::then(detail::start_all_reduce_direct(*state.group, flat, reduced.rows, kGatherTag),
                                          [](auto gather) { return Work<at::Tensor>(std::move(gather)); }));
}
// Every bucket's second phase issued, in bucket order on every rank, before
// any bucket is waited for: its all-gather becomes Bucket::work.
inline void issue_second_phases(State& state) {
  for (std::size_t b = 0; b < state.buckets.size(); ++b) {
    ReplicatedBucket& reduced = replicated(state).buckets[b];
    if (reduced.scattering.valid()) state.buckets[b].work = reduced.scattering.wait();
  }
}

// Bucket b's all-reduce (NO_SHARD): its gradients and used-flags
// flattened (pre-divided by the group size, as DDP does) and the
// all-reduce issued without waiting.
inline void issue_all_reduce(const Locked& held, std::size_t b) {
  State& state = held.state();
  Bucket& bucket = state.buckets[b];
  Replicated& mode = replicated(state);
  ReplicatedBucket& reduced = mode.buckets[b];
  const std::size_t n = bucket.params.size();
  // The bucket persists across steps, as DDP's: a buffer this large allocated
  // per step would come back from the kernel as fresh pages each time (page
  // faults and zeroing, a tenth of a CPU step's time). Under
  // gradient_as_bucket_view the gradients are its views; otherwise they are
  // copied in here and the averages copied back out in finish. (Made
  // anew only if the module moved to another device since.)
  const at::TensorOptions options = bucket.params.front().options();
  if (!reduced.persistent.defined() || reduced.persistent.device() != options.device())
    reduced.persistent = bucket.packing.buffer(options);
  reduced.flat = reduced.persistent;
  // Without a registered hook the default one's work is done here: the
  // gradients divided by the group's size, then all-reduced. Where they are
  // copied in anyway (not gradient_as_bucket_view) the copy itself divides,
  // as DDP's copy_grad_to_bucket does: one pass over the bucket instead of
  // two, with div_'s kernel and divisor, so the same bits. The used-flags
  // stay undivided there: finish reads only whether they are above zero.
  const bool by_default = !mode.hooked, divide_in_copy = by_default && !mode.bucket_view;
  if (by_default && !reduced.divisor.defined()) {
    // A wrapped number, as div_(Scalar) makes of its argument, made once: in
    // the bucket's dtype, so that no division casts it (and allocates); in
    // float for bfloat16 and float16, whose kernels read the divisor as
    // float (so a world size they cannot hold exactly still divides exactly).
    const bool half_width = bucket.dtype == at::kBFloat16 || bucket.dtype == at::kHalf;
    reduced.divisor =
        at::scalar_tensor(static_cast<double>(state.group->getSize()), half_width ? at::kFloat : bucket.dtype);
    reduced.divisor.unsafeGetTensorImpl()->set_wrapped_number(true);
  }
  for (std::size_t i = 0; i < n; ++i) {
    at::Tensor& p = bucket.params[i];
    at::Tensor view = bucket.packing.view(reduced.flat, i);
    if (!p.grad().defined()) {
      view.zero_();
    } else if (divide_in_copy) {
      at::div_out(view, p.grad().is_sparse() ? p.grad().to_dense() : p.grad(),
                  reduced.divisor);  // (sparse: into dense)
    } else if (!mode.bucket_view || !p.grad().is_alias_of(view)) {
      view.copy_(p.grad());
      if (mode.bucket_view) p.mutable_grad() = view;  // (a gradient set to none, or the first backward)
    }
  }
  write_used_flags(bucket.packing.view(reduced.flat, n), bucket);
  try {
    if (by_default) {
      if (!divide_in_copy) reduced.flat.div_(reduced.divisor);  // (the views: divided where they lie)
      start_default_all_reduce(state, b, reduced.flat);
    } else {
      GradBucket hooked = grad_bucket(held, b, reduced.flat);
      bucket.work = mode.hook(state.group, hooked);
    }
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: issuing a gradient bucket's all_reduce failed: ") +
                           detail::error_text(e));
  }
}
// Issues bucket b's reduction, now that its gradients are ready: the
// strategy's (issue_all_reduce above, or dp/scatter.hpp's issue_scatter).
inline void issue_bucket(const Locked& held, std::size_t b) {
  State& state = held.state();
  at::NoGradGuard no_grad;
  state.mode->issue(held, b);
  state.timeline.stamp(b, &BucketTimes::issued);
  if (state.on_issued) state.on_issued(b);
}

// finish() of a model that is not sharded: waits for each bucket's
// all-reduce (through the communication hook) and writes the averaged
// gradients of the parameters used on any rank back into their .grad.
inline void finish_unsharded(const Locked& held) {
  State& state = held.state();
  Replicated& mode = replicated(state);
  try {
    issue_second_phases(state);
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: a gradient bucket's all_reduce failed: ") +
                           detail::error_text(e));
  }
  for (std::size_t b = 0; b < state.buckets.size(); ++b) {
    Bucket& bucket = state.buckets[b];
    ReplicatedBucket& reduced = mode.buckets[b];
    try {
      state.timeline.stamp(b, &BucketTimes::waiting);
      reduced.flat = bucket.work.wait();
      state.timeline.stamp(b, &BucketTimes::landed);
    } catch (const DistributedError& e) {
      throw DistributedError(std::string("accel::DataParallel: a gradient bucket's all_reduce failed: ") +
                             detail::error_text(e));
    }
    if (!reduced.flat.defined() || reduced.flat.numel() != bucket.packing.elements())
      throw RuntimeError("accel::DataParallel: the communication hook returned " +
                         (reduced.flat.defined() ? std::to_string(reduced.flat.numel()) + " elements" : "nothing") +
                         " for bucket " + std::to_string(b) + " of " + std::to_string(bucket.packing.elements()));
    if (reduced.flat.scalar_type() != bucket.dtype) reduced.flat = reduced.flat.to(bucket.dtype);  // decompressed
    reduced.flat = reduced.flat.reshape({-1});
    if (mode.bucket_view && !reduced.flat.is_alias_of(reduced.persistent))
      reduced.flat = reduced.persistent.copy_(reduced.flat);
    const std::size_t n = bucket.params.size();
    // Which parameters some rank used: known here when this rank used them all.
    const bool all_used = used_by_all_here(bucket);
    const at::Tensor used_anywhere = all_used ? at::Tensor() : bucket.packing.view(reduced.flat, n).gt(0).to(c10::kCPU);
    const bool* used = all_used ? nullptr : used_anywhere.data_ptr<bool>();
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor& p = bucket.params[i];
      if (all_used || used[i]) {
        at::Tensor averaged = bucket.packing.view(reduced.flat, i);
        if (mode.bucket_view) p.mutable_grad() = averaged;  // (already there when it was a view)
        else if (p.grad().defined()) p.mutable_grad().copy_(averaged);
        else p.mutable_grad() = averaged.clone();
      }
      bucket.used[i] = 0;
    }
  }
}

// DataParallel::shadow_backward's collectives: every bucket's all-reduce,
// in order, with zero gradients and no used-flags, on the path the others'
// take (the hook's, or the default's: Gloo's or point to point, phase by
// phase).
inline void shadow_backward(const Locked& held) {
  State& state = held.state();
  Replicated& mode = replicated(state);
  try {
    for (std::size_t b = 0; b < state.buckets.size(); ++b) {
      Bucket& bucket = state.buckets[b];
      const at::Tensor zeros = bucket.packing.buffer(bucket.params.front().options()).zero_();
      if (!mode.hooked) {
        start_default_all_reduce(state, b, zeros);  // (zeros need no division)
      } else {
        GradBucket hooked = grad_bucket(held, b, zeros);
        bucket.work = mode.hook(state.group, hooked);
      }
    }
    issue_second_phases(state);
    for (auto& bucket : state.buckets) bucket.work.wait();
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: a joined rank's gradient all_reduce failed: ") +
                           detail::error_text(e));
  }
}

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::shared_ptr<State> state, std::size_t bucket, std::size_t index)
      : state_(std::move(state)), bucket_(bucket), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    const Locked held(*state_);
    State& s = held.state();
    if (!s.alive) return outputs;
    Bucket& bucket = s.buckets[bucket_];
    bucket.used[index_] = 1;  // also under no_sync: the accumulated gradient counts at the next sync
    if (!s.armed || bucket.seen[index_]) return outputs;
    bucket.seen[index_] = 1;
    ++s.fired;
    if (++bucket.ready == bucket.params.size()) {
      s.timeline.stamp(bucket_, &BucketTimes::ready);
      while (s.next < s.buckets.size() && s.buckets[s.next].ready == s.buckets[s.next].params.size())
        issue_bucket(held, s.next++);
    }
    return outputs;
  }
  std::shared_ptr<State> state_;
  std::size_t bucket_, index_;
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/unit_plan.hpp ==========================================
// accel/training/dp/unit_plan.hpp: ZeRO-3's units planned: which unit holds each parameter, the registry accel::unit_forward finds a unit in, the policy's dtypes, the names a read at rest reports.
//
// FULL_SHARD's units hold no parameter memory at rest (dp/unit_params.hpp
// gathers and frees it, dp/units.hpp runs a unit). This part is what is
// decided once, in DataParallel's constructor: every module that is a unit,
// the parameters each holds (a tied one belongs to the unit holding every
// module that registers it, else to the root), and what a MixedPrecisionPolicy
// changes.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
using Registry = std::unordered_map<const torch::nn::Module*, std::pair<std::weak_ptr<State>, std::size_t>>;
inline Registry& unit_registry() {
  static Registry units;  // every live DataParallel's units, for accel::unit_forward
  return units;
}
inline std::mutex& unit_registry_mutex() {
  static std::mutex mutex;
  return mutex;
}
// The live DataParallel state whose unit `module` is, and the unit's index (null: no unit).
inline std::pair<std::shared_ptr<State>, std::size_t> find_unit(const torch::nn::Module* module) {
  std::lock_guard lock(unit_registry_mutex());
  const auto found = unit_registry().find(module);
  if (found == unit_registry().end()) return {nullptr, 0};
  return {found->second.first.lock(), found->second.second};
}

// For DataParallel's constructor: which unit each of `params` (each tensor
// once) belongs to (-1: none), with state.units made for the units that
// hold a parameter. A parameter belongs to the unit whose modules include
// every module that registers it. One registered outside units too, or in
// two of them (a tied weight: GPT-2's token embedding and its head), belongs
// to none: it is sharded as the root's own parameters are (whole while the
// model runs, ZeRO-2's way), so every module that reads it finds its values,
// as FSDP2 keeps a tied weight in the root's group. Errors name the
// parameter or unit: units inside units, and a unit's parameter that shares
// its storage with another (it cannot be freed alone). A unit's parameter
// that is a view of a larger tensor gets a storage of its own (below).
// For assign_units: the unit (an index into `units`) each parameter of
// `module` belongs to, over every module that registers it; -1 for none.
inline std::unordered_map<const c10::TensorImpl*, int64_t> unit_of_parameters(
    const torch::nn::Module& module, const std::vector<std::shared_ptr<torch::nn::Module>>& units,
    std::unordered_map<const torch::nn::Module*, std::string>& name_of) {
  std::unordered_set<const torch::nn::Module*> chosen;
  for (const auto& unit : units) chosen.insert(unit.get());
  // The unit each module lies in; -1 where a module lies in two (shared by both).
  std::unordered_map<const torch::nn::Module*, int64_t> unit_of_module;
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const auto& inner : units[u]->modules(/*include_self=*/false))
      if (chosen.count(inner.get()))
        throw InvalidArgument("accel::DataParallel: the fully sharded unit '" + name_of[inner.get()] +
                              "' lies inside the unit '" + name_of[units[u].get()] +
                              "'; units must not nest (auto_wrap_policy: a unit's own submodules are not asked)");
    for (const auto& inner : units[u]->modules(/*include_self=*/true)) {
      const auto [at, fresh] = unit_of_module.emplace(inner.get(), static_cast<int64_t>(u));
      if (!fresh && at->second != static_cast<int64_t>(u)) at->second = -1;
    }
  }
  std::unordered_map<const c10::TensorImpl*, int64_t> owner;
  for (const auto& named : module.named_modules()) {
    const auto found = unit_of_module.find(named.value().get());
    const int64_t u = found == unit_of_module.end() ? -1 : found->second;
    for (const auto& p : named.value()->parameters(/*recurse=*/false)) {
      const auto [at, fresh] = owner.emplace(p.unsafeGetTensorImpl(), u);
      if (!fresh && at->second != u) at->second = -1;
    }
  }
  return owner;
}

inline std::vector<int64_t> assign_units(State& state, const torch::nn::Module& module,
                                         const std::vector<std::shared_ptr<torch::nn::Module>>& units,
                                         const std::vector<at::Tensor>& params) {
  std::unordered_map<const torch::nn::Module*, std::string> name_of;
  for (const auto& named : module.named_modules()) name_of.emplace(named.value().get(), named.key());
  const auto owner = unit_of_parameters(module, units, name_of);
  // Units that hold a parameter, numbered in the order given.
  std::vector<int64_t> renumbered(units.size(), -1);
  for (const auto& p : params) {
    const int64_t u = owner.at(p.unsafeGetTensorImpl());
    if (u >= 0) renumbered[static_cast<std::size_t>(u)] = 0;
  }
  for (std::size_t u = 0; u < units.size(); ++u)
    if (renumbered[u] == 0) {
      renumbered[u] = static_cast<int64_t>(sharded(state).units.list.size());
      sharded(state).units.list.push_back(Unit{.module = units[u].get()});
    }
  std::unordered_map<const void*, int64_t> storages;  // parameters on each storage, the whole model's
  for (const auto& p : unique_tensors(module.parameters())) ++storages[p.storage().unsafeGetStorageImpl()];
  std::vector<int64_t> out;
  for (const auto& p : params) {
    const int64_t u = owner.at(p.unsafeGetTensorImpl());
    out.push_back(u < 0 ? -1 : renumbered[static_cast<std::size_t>(u)]);
    if (u < 0) continue;
    if (storages[p.storage().unsafeGetStorageImpl()] > 1)
      throw InvalidArgument(
          "accel::DataParallel: under FULL_SHARD every parameter of a unit must have its storage "
          "to itself; " +
          state.names.describe(p) + " of unit '" + name_of[units[static_cast<std::size_t>(u)].get()] +
          "' shares its storage with another parameter (share the tensor itself to tie weights: a "
          "tensor registered in several modules is one parameter)");
    // A piece of a larger tensor (a tensor-parallel shard narrowed from the
    // whole, a view): its storage holds more than the parameter, so freeing
    // it at rest would free the rest too. It takes a copy as a storage of
    // its own, as FSDP2 replaces the parameters it shards; the tensor it
    // was cut from keeps its values and no longer sees the parameter's.
    if (p.storage_offset() != 0 || !p.is_contiguous() ||
        p.storage().nbytes() != static_cast<std::size_t>(p.numel()) * p.element_size())
      p.unsafeGetTensorImpl()->shallow_copy_from(p.detach().clone(at::MemoryFormat::Contiguous).getIntrusivePtr());
  }
  return out;
}
// Each bucket given to its unit (bucket_unit[b], as lay_out returned it;
// -1: none), once the shards are made.
inline void make_units(Sharded& z, const std::vector<int64_t>& bucket_unit) {
  for (std::size_t b = 0; b < bucket_unit.size(); ++b) {
    z.buckets[b].unit = bucket_unit[b];
    if (bucket_unit[b] >= 0)
      z.units.list[static_cast<std::size_t>(bucket_unit[b])].buckets.push_back(UnitBucket{.bucket = b});
  }
}
// A MixedPrecisionPolicy taken on (DataParallel's constructor, after the
// shards are made): its dtypes checked and kept, and each unit parameter's
// tensor at rest kept for release() to give back (see Use). The policy is
// the units': a parameter in no unit (the root's own, a tied weight) is
// whole while the model runs, in its own dtype, and computes in it (a unit's
// output_dtype hands such modules the activations in theirs).
inline void apply_policy(State& s, const MixedPrecisionPolicy& policy) {
  Sharded& z = sharded(s);
  z.reduce_dtype = policy.reduce_dtype ? policy.reduce_dtype : policy.param_dtype;  // (FSDP2's default)
  z.units.param_dtype = policy.param_dtype;
  z.units.output_dtype = policy.output_dtype;
  z.units.cast_inputs = policy.cast_forward_inputs;
  if (!policy.param_dtype) return;
  for (Unit& unit : z.units.list)
    for (UnitBucket& ub : unit.buckets) {
      const Bucket& layout = s.buckets[ub.bucket];
      if (!c10::isFloatingType(layout.dtype) || layout.dtype == *policy.param_dtype) continue;
      for (const auto& p : layout.params) {
        ub.rest.push_back(p.variable_data());
        // The parameter's shape in param_dtype, on a storage of no bytes of its own (materialize points it).
        at::Tensor compute = at::empty({0}, p.options().dtype(*policy.param_dtype).requires_grad(false));
        compute.unsafeGetTensorImpl()->set_sizes_contiguous(p.sizes());
        ub.compute.push_back(std::move(compute));
      }
    }
}

// What a kernel that reads a unit's parameter at rest throws (where
// LibTorch lets it refuse; see refuses_at_rest below): its name, its unit's,
// and the way out.
inline void name_at_rest(State& state, const torch::nn::Module& module) {
  std::unordered_map<const torch::nn::Module*, std::string> modules;
  for (const auto& named : module.named_modules()) modules[named.value().get()] = named.key();
  for (Unit& unit_of : sharded(state).units.list)
    for (UnitBucket& ub : unit_of.buckets) {
      const std::string unit = modules[unit_of.module];
      for (const auto& p : state.buckets[ub.bucket].params)
        ub.at_rest.push_back(
            "accel: the parameter '" + state.names.first(p) + "' is sharded at rest (fully sharded unit '" + unit +
            "'): it holds its values only while its unit runs through accel::unit_forward. Call the unit as "
            "accel::unit_forward(unit, ...), not unit->forward(...); read parameters under summon_full_params(); "
            "a module outside the unit that reads it (a tied head) must register it too (register_parameter): a "
            "weight registered in several modules is kept whole at the root");
    }
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/unit_params.hpp ========================================
// accel/training/dp/unit_params.hpp: ZeRO-3's parameters gathered into a pooled buffer for a unit's forward and backward, and put back at rest after.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// A parameter at rest has no memory; its shape stays. Where LibTorch lets a
// storage refuse every access with a message of its own (StorageImpl's
// custom data-pointer error, with a way to lift it: newer LibTorch, such as
// the pip wheel's), a parameter at rest keeps its size in bytes and any
// kernel that reads it throws that message: this parameter is sharded at
// rest, call its unit through accel::unit_forward. Without it the storage's
// size is 0 too, so that a view or a checked read is LibTorch's own error,
// and an element-wise kernel, which checks neither, reads a null pointer.
template <class Storage = c10::StorageImpl>
inline constexpr bool refuses_at_rest = requires(Storage& s, std::optional<std::string> m) {
  s.release_data_and_set_meta_custom_data_ptr_error_msg_(m);
  s.clear_data_ptr_access_error_msg_();
};
template <class Storage>
inline void refuse_access(Storage& storage, const std::string& why) {
  if constexpr (refuses_at_rest<Storage>) storage.release_data_and_set_meta_custom_data_ptr_error_msg_(why);
}
template <class Storage>
inline void allow_access(Storage& storage) {
  if constexpr (refuses_at_rest<Storage>) storage.clear_data_ptr_access_error_msg_();
}

// The all-gather of a bucket's shards (`source`: `owned` as it is, or cast
// to a policy's param_dtype) into its parameters' places: once the Work
// lands, into[i] holds parameter i's values. On Gloo with CPU tensors the gather is point to point
// (distributed/pieces.hpp), without a buffer of c10d's per step: where the bucket's
// pieces are large (large_pieces, dp/state.hpp) and every into[i]
// contiguous, each peer's chunk of each parameter is received straight
// into into[i] (nothing copied after: the values are written once);
// otherwise each peer's whole segment is one message into rows from the
// pool, copied out when it lands. (Every rank takes the same path: the
// sizes and the layout of the parameters are the same everywhere.) Elsewhere c10d's all-gather into the
// rows (NCCL's is the fast one), copied out likewise.
inline Work<at::Tensor> gather_params(const Locked& held, std::size_t b, const at::Tensor& source,
                                      std::vector<at::Tensor> into) {
  State& s = held.state();
  const Sharded& z = sharded(s);
  const ShardedBucket& bucket = z.buckets[b];
  const int64_t S = z.shard->getSize(), width = source.numel(), r = z.shard->getRank();
  c10d::ProcessGroup* g = detail::enter_all_gather(source, z.shard);  // (a shard group has 2 ranks or more)
  const bool direct = detail::direct_gather_fits(*g, source, source);
  const bool pieces =
      direct && large_pieces(bucket, static_cast<int64_t>(source.element_size())) &&
      std::all_of(into.begin(), into.end(), [](const at::Tensor& t) { return t.is_cpu() && t.is_contiguous(); });
  if (pieces) {
    std::vector<at::Tensor> mine;
    for (std::size_t i = 0; i < into.size(); ++i)
      mine.push_back(source.narrow(0, bucket.offsets[i], chunk_range(r, bucket.chunks[i], into[i].numel()).second));
    auto place = [&](int from, std::size_t i) {
      const auto [begin, length] = chunk_range(from, bucket.chunks[i], into[i].numel());
      return into[i].view({-1}).narrow(0, begin, length);
    };
    return Work<at::Tensor>(
        detail::then(detail::start_all_gather_pieces(*g, mine, place, kGatherTag), [] { return at::Tensor(); }));
  }
  Lease lease = s.pool.take(S * width, source.options());
  const at::Tensor rows = lease.tensor().view({S, width});
  // (the lease goes with the landing: the rows return to the pool once copied out, or with the Work)
  auto copy_out = [lease = std::move(lease), rows, into = std::move(into), offsets = bucket.offsets,
                   chunks = bucket.chunks]() mutable {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < into.size(); ++i) write_rows(rows, offsets[i], chunks[i], into[i]);
    return at::Tensor();
  };
  if (direct)
    return Work<at::Tensor>(
        detail::then(detail::start_all_gather_direct(*g, source, rows, kGatherTag), std::move(copy_out)));
  return Work<at::Tensor>(detail::then(detail::start_all_gather_rows(*g, source, rows), std::move(copy_out)));
}

// A unit's parameters: fetch() takes one pooled buffer per bucket, the
// parameters one after another in it (each starting 64 bytes aligned), and
// issues the all-gather of their shards into it (asynchronously, unless it
// holds them or one is in flight); materialize() waits for it and points
// the parameters' storage into the buffer; release() takes the storage away
// again (the buffer goes back to the pool, and the next unit of about its
// size takes it).
//
// What autograd saved in the forward (a Linear saves its weight, W.t(), a
// view) refers to the parameter's storage object, never to the pool's
// buffer: the storage object stays the parameter's for good, and only
// where it points changes. So the unit's backward, which gathers the
// parameters again first (the hook on its output), reads its own values
// wherever they landed that time, and a saved tensor read while the unit
// is at rest finds no memory (an error), never the values of the unit that
// took the buffer after it. The storage object stays, and with it the
// version counter: autograd accepts the values it saved in forward.
//
// Under a MixedPrecisionPolicy's param_dtype (FSDP2's), a gather for
// compute (Use::compute: a unit's forward and backward) sends the shards
// cast to that dtype, and the parameters take it while the unit runs: each
// parameter's tensor is given its `compute` tensor (that dtype, its own
// storage object pointed into the buffer as above, for the same reason;
// TensorImpl::shallow_copy_from, what Tensor::set_data does, without
// set_data's reset of the gradient accumulator: the accumulator made at
// wrapping, in the parameter's own dtype, stays, and autograd casts the
// gradient to that dtype before it accumulates, so gradients and shards
// keep the parameters' dtype); release() gives each its tensor at rest
// back. Every other gather (summon_full_params, save_model, free_memory)
// is in the parameters' own dtype (Use::full), as FSDP's full-precision
// state dict.
enum class Use { compute, full };
inline int64_t aligned(int64_t elements, int64_t element_size) {
  const int64_t per_line = std::max<int64_t>(1, 64 / element_size);
  return (elements + per_line - 1) / per_line * per_line;
}
// Where each parameter of a unit's bucket starts in its buffer of elements
// of element_size bytes, and the buffer's length (the last entry).
inline std::vector<int64_t> places_in_full(const Bucket& layout, int64_t element_size) {
  std::vector<int64_t> at{0};
  for (const auto& p : layout.params) at.push_back(at.back() + aligned(p.numel(), element_size));
  return at;
}
// Whether a gather for `use` is in the policy's param_dtype. Not while
// summon_full_params() holds the units: they stay in full precision, and a
// unit called then computes in it.
inline bool gathers_low(const Units& units, const UnitBucket& ub, Use use) {
  return use == Use::compute && !ub.rest.empty() && units.held == 0;
}
inline c10::ScalarType gathered_dtype(const Units& units, const Bucket& layout, const UnitBucket& ub) {
  return ub.low ? *units.param_dtype : layout.dtype;
}
inline void release_bucket(const Bucket& layout, UnitBucket& ub);
// Waits for the bucket's gather in flight. A failed one has ended every
// message of it (distributed/pieces.hpp's Outstanding), so its buffers go back to the
// pool, and the collective's own error (operation, group, rank) goes on to
// the caller under what the engine was doing.
inline void wait_gathering(const Bucket& layout, UnitBucket& ub) {
  try {
    ub.gathering.wait();
  } catch (const DistributedError& e) {
    ub.gathering = {};
    release_bucket(layout, ub);  // (not resident: the buffers only)
    throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                           detail::error_text(e));
  }
  ub.gathering = {};
}
// The storage parameter i of the bucket computes on: its own, or under a
// policy's param_dtype its `compute` tensor's.
inline c10::StorageImpl* computing_storage(const Bucket& layout, const UnitBucket& ub, std::size_t i) {
  return (ub.low ? ub.compute[i] : layout.params[i]).storage().unsafeGetStorageImpl();
}
// A bucket's parameters back at rest, and its buffers back in the pool.
inline void release_bucket(const Bucket& layout, UnitBucket& ub) {
  if (ub.resident)
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      if (ub.low)  // (its own storage never left rest)
        layout.params[i].unsafeGetTensorImpl()->shallow_copy_from(ub.rest[i].getIntrusivePtr());
      c10::StorageImpl* storage = computing_storage(layout, ub, i);
      storage->set_data_ptr_noswap(c10::DataPtr(nullptr, layout.params[i].device()));
      if constexpr (refuses_at_rest<>) refuse_access(*storage, ub.at_rest[i]);
      else storage->set_nbytes(0);
    }
  ub.full.reset();
  ub.cast.reset();
  ub.resident = false;
  ub.low = false;
}
inline void fetch(const Locked& held, std::size_t u, Use use) {
  State& s = held.state();
  Sharded& z = sharded(s);
  at::NoGradGuard no_grad;
  for (UnitBucket& ub : z.units.list[u].buckets) {
    const Bucket& layout = s.buckets[ub.bucket];
    const at::Tensor& owned = z.buckets[ub.bucket].owned;
    const bool low = gathers_low(z.units, ub, use);
    if (ub.resident || ub.gathering.valid()) {
      if (ub.low == low) continue;
      if (ub.gathering.valid()) wait_gathering(layout, ub);  // (a collective cannot be taken back)
      release_bucket(layout, ub);                            // in the other precision: gathered again
    }
    ub.low = low;
    const c10::ScalarType dtype = gathered_dtype(z.units, layout, ub);
    const std::vector<int64_t> at = places_in_full(layout, static_cast<int64_t>(c10::elementSize(dtype)));
    ub.full = s.pool.take(at.back(), owned.options().dtype(dtype));
    if (low) {
      ub.cast = s.pool.take(owned.numel(), ub.full.tensor().options());
      ub.cast.tensor().copy_(owned);
    }
    std::vector<at::Tensor> into;
    for (std::size_t i = 0; i < layout.params.size(); ++i)
      into.push_back(ub.full.tensor().narrow(0, at[i], layout.params[i].numel()));
    try {
      ub.gathering = gather_params(held, ub.bucket, low ? ub.cast.tensor() : owned, std::move(into));
    } catch (const DistributedError& e) {
      release_bucket(layout, ub);  // (not resident: the buffers only)
      throw DistributedError(std::string("accel::DataParallel: gathering a unit's parameters failed: ") +
                             detail::error_text(e));
    }
  }
}
inline void materialize(const Locked& held, std::size_t u, Use use) {
  State& s = held.state();
  fetch(held, u, use);
  for (UnitBucket& ub : sharded(s).units.list[u].buckets) {
    const Bucket& layout = s.buckets[ub.bucket];
    if (ub.resident) continue;
    wait_gathering(layout, ub);
    ub.cast.reset();
    const auto element_size = static_cast<int64_t>(ub.full.tensor().element_size());
    const std::vector<int64_t> at = places_in_full(layout, element_size);
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      const at::Tensor& p = layout.params[i];
      c10::StorageImpl* storage = computing_storage(layout, ub, i);
      allow_access(*storage);
      // Borrowed from the lease: the buffer is not taken again while this pointer lives (release() drops it).
      storage->set_data_ptr_noswap(ub.full.borrow(static_cast<std::size_t>(at[i] * element_size), layout.device));
      storage->set_nbytes(static_cast<std::size_t>(p.numel() * element_size));
      if (ub.low) p.unsafeGetTensorImpl()->shallow_copy_from(ub.compute[i].getIntrusivePtr());
    }
    ub.resident = true;
  }
}
inline void release(const Locked& held, std::size_t u) {
  State& s = held.state();
  Units& units = sharded(s).units;
  if (units.held > 0) return;  // summon_full_params() keeps them
  for (UnitBucket& ub : units.list[u].buckets)
    if (ub.resident) release_bucket(s.buckets[ub.bucket], ub);
}
// The dtype unit u's parameters hold now, where a policy changed it (for
// cast_inputs); none otherwise.
inline std::optional<c10::ScalarType> computes_in(const Locked& held, std::size_t u) {
  const Units& units = sharded(held.state()).units;
  for (const UnitBucket& ub : units.list[u].buckets)
    if (ub.low) return units.param_dtype;
  return std::nullopt;
}
// Unit u left so that its module works without the engine, whose pool
// goes (release_module, ~DataParallel): a resident unit's parameters get
// memory of their own (copied out of the pool's buffer); a unit gathered
// for compute in a policy's param_dtype goes back to rest instead (what it
// holds is not the parameters' values in their dtype), and so does one
// that holds nothing (at rest, or a gather that failed or is still in
// flight: waited for first, its failure ignored, so that no message still
// writes into the buffers given back). Nothing here reads a parameter at
// rest: the only values copied are those the pool's buffer holds.
inline void own_storage(const Locked& held, std::size_t u) {
  State& s = held.state();
  for (UnitBucket& ub : sharded(s).units.list[u].buckets) {
    const Bucket& layout = s.buckets[ub.bucket];
    if (ub.gathering.valid()) {
      try {
        ub.gathering.wait();
      } catch (const std::exception&) {  // (see above)
      }
      ub.gathering = {};
    }
    if (!ub.resident || ub.low) {
      release_bucket(layout, ub);
      continue;
    }
    if (!ub.full) continue;  // (its parameters hold memory of their own already)
    for (const auto& p : layout.params) {
      const at::Tensor copy = p.detach().clone();  // its own memory, on p's device
      c10::DataPtr own = copy.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, p.device()));
      p.storage().unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(own));
    }
    ub.full.reset();
  }
}
// Every unit left as own_storage leaves it, for a DataParallel going away:
// never throws (a destructor calls it, perhaps while an error of the
// caller's unwinds). A unit whose copy fails (out of memory) goes back to
// rest: its parameters then point at nothing, never at a freed buffer.
inline void let_go_of_units(const Locked& held) noexcept {
  State& s = held.state();
  Units& units = sharded(s).units;
  for (std::size_t u = 0; u < units.list.size(); ++u) {
    try {
      own_storage(held, u);
    } catch (const std::exception& e) {
      std::cerr << "accel: a fully sharded unit's parameters could not be kept as the engine went ("
                << detail::error_text(e) << "); they are at rest (no values)" << std::endl;
      for (UnitBucket& ub : units.list[u].buckets) release_bucket(s.buckets[ub.bucket], ub);
    }
  }
}
// The end of a backward: prefetches that found no use are waited for (a
// collective cannot be taken back) and dropped, every unit is freed, and
// the next forward records the order anew. Nothing without units.
inline void end_unit_pass(const Locked& held) {
  State& s = held.state();
  Units& units = sharded(s).units;
  if (units.list.empty()) return;
  for (Unit& unit : units.list)
    for (UnitBucket& ub : unit.buckets)
      if (ub.gathering.valid()) {
        wait_gathering(s.buckets[ub.bucket], ub);
        release_bucket(s.buckets[ub.bucket], ub);  // (not resident: the buffers only)
      }
  for (std::size_t u = 0; u < units.list.size(); ++u) release(held, u);
  units.new_pass = true;
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/units.hpp ==============================================
// accel/training/dp/units.hpp: ZeRO-3's units: parameters gathered from their shards for a unit's forward and backward, freed after.
//
// FULL_SHARD's units hold no parameter memory at rest. accel::unit_forward
// calls unit_call, which gathers a unit's parameters (waiting for a prefetch
// where one was issued, prefetching the unit that came next in the last
// forward), runs the forward and frees them; hooks on the unit's output and
// inputs gather them again for its backward and free them after it.
// FullParameters (summon_full_params) keeps every unit gathered.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// FSDP's summon_full_params: every unit's parameters gathered for as long
// as the returned object lives (a collective on the shard group: every
// rank makes one, in the same order). With writeback, what the
// parameters hold then goes back into the shards. Nothing to do unless
// fully sharded.
class FullParameters {
 public:
  FullParameters(FullParameters&& other) noexcept : state_(std::move(other.state_)), writeback_(other.writeback_) {}
  FullParameters(const FullParameters&) = delete;
  FullParameters& operator=(const FullParameters&) = delete;
  FullParameters& operator=(FullParameters&&) = delete;
  ~FullParameters() {
    if (!state_) return;
    const Locked held(*state_);
    Sharded& z = sharded(*state_);
    if (--z.units.held > 0) return;
    at::NoGradGuard no_grad;
    for (std::size_t u = 0; u < z.units.list.size(); ++u) {
      if (writeback_)
        for (const UnitBucket& ub : z.units.list[u].buckets) {
          const Bucket& layout = state_->buckets[ub.bucket];
          ShardedBucket& bucket = z.buckets[ub.bucket];
          for (std::size_t i = 0; i < layout.params.size(); ++i)
            read_chunk(layout.params[i], z.shard->getRank(), bucket.chunks[i], bucket.shards[i]);
        }
      release(held, u);
    }
  }

  // (made by DataParallel::summon_full_params, which has gathered them)
  FullParameters(std::shared_ptr<State> state, bool writeback) : state_(std::move(state)), writeback_(writeback) {}

 private:
  std::shared_ptr<State> state_;
  bool writeback_;
};

// Whole parameters one unit at a time, for an export that must not hold
// every unit at once (Accelerator::save_model): whole(p) gathers the unit
// of parameter p (a collective on the shard group: every rank asks for the
// same parameters in the same order), releasing the unit it gathered
// before, and returns p, which holds its values until the next call; a
// tensor in no unit comes back as it is (every tensor, where nothing is
// sharded). Units gathered for other reasons (a prefetch, a forward left
// half done) are released first.
class UnitByUnit {
 public:
  // state: a fully sharded model's (one with units); null otherwise.
  explicit UnitByUnit(std::shared_ptr<State> state) : state_(std::move(state)) {
    if (!state_) return;
    const Locked held(*state_);
    if (sharded(*state_).units.held == 0) end_unit_pass(held);
  }
  UnitByUnit(const UnitByUnit&) = delete;
  UnitByUnit& operator=(const UnitByUnit&) = delete;
  ~UnitByUnit() {
    if (!state_) return;
    const Locked held(*state_);
    if (current_) release(held, *current_);
  }
  const at::Tensor& whole(const at::Tensor& p) {
    if (!state_) return p;
    const Locked held(*state_);
    const Sharded& z = sharded(*state_);
    const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
    if (found == z.shard_index.end() || z.buckets[found->second.first].unit < 0) return p;
    const auto u = static_cast<std::size_t>(z.buckets[found->second.first].unit);
    if (current_ != u) {
      if (current_) release(held, *current_);
      current_ = u;
      materialize(held, u, Use::full);
    }
    return p;
  }

 private:
  std::shared_ptr<State> state_;
  std::optional<std::size_t> current_;
};

// True on a thread while accel::checkpoint (recompute.hpp) runs a forward
// again inside the backward. A unit called then keeps its parameters
// gathered after its forward, because the backward of that forward follows
// at once (its input hook frees them after it), and prefetches nothing: the
// next unit of the forward has had its backward already.
inline bool& recomputing() {
  static thread_local bool on = false;
  return on;
}

// The bytes unit u's buckets hold, gathered (what running ahead counts).
inline int64_t unit_bytes(const State& s, std::size_t u) {
  int64_t bytes = 0;
  for (const UnitBucket& ub : sharded(s).units.list[u].buckets) bytes += s.buckets[ub.bucket].packing.bytes();
  return bytes;
}

// Prefetching: the units in [from, to) (the ones after this in the last
// forward, or before it in this one for the backward) gathered ahead, at
// least the first, and more while those gathered ahead hold less than
// kAheadBytes (dp/state.hpp: small units do not wait for each other's
// gathers; a large one keeps one prefetch, as FSDP2's). The same on every
// rank: it reads only the order and the units' sizes.
template <class It>
inline void prefetch_ahead(const Locked& held, It from, It to) {
  const State& s = held.state();
  int64_t ahead = 0;
  for (It it = from; it != to && ahead < kAheadBytes; ++it) {
    fetch(held, *it, Use::compute);
    ahead += unit_bytes(s, *it);
  }
}

// A unit's forward begins: the forward's order recorded (the first unit of
// a forward starts a new one; the last guides prefetching), the unit's
// parameters gathered, and the units after it in the last forward
// prefetched (prefetch_ahead). Returns the dtype its floating-point inputs are cast to (a
// policy's cast_forward_inputs) and the one its output is (output_dtype).
struct UnitDtypes {
  std::optional<c10::ScalarType> inputs, output;
  bool keep = false;  // the parameters stay gathered after the forward (keeps_for_backward)
};
// Whether unit u keeps its parameters gathered from its forward to its
// backward instead of being gathered again: where it and the units after
// it in the last forward (whose backwards come before its own) together
// hold at most kAheadBytes (dp/state.hpp). The last units of a forward are
// the first of the backward, so regathering them right after freeing them
// only costs a collective per unit (FSDP2 likewise keeps the root's
// parameters after the forward); small units are latency-bound, and a
// model's last few MiB are cheap to hold. Only where a backward follows
// (grad mode on), never while a recomputation runs, nor with
// backward_prefetch off (which asks for one unit's parameters at a time),
// and the same on every rank (the order and the sizes).
inline bool keeps_for_backward(const Locked& held, std::size_t u) {
  const State& s = held.state();
  const Units& units = sharded(s).units;
  if (!at::GradMode::is_enabled() || recomputing() || !units.prefetch_backward) return false;
  const auto at = std::find(units.last_order.begin(), units.last_order.end(), u);
  if (at == units.last_order.end()) return false;  // (the first forward: no order yet)
  int64_t bytes = 0;
  for (auto it = at; it != units.last_order.end(); ++it) bytes += unit_bytes(s, *it);
  return bytes <= kAheadBytes;
}
inline UnitDtypes begin_unit_forward(const Locked& held, std::size_t u) {
  Units& units = sharded(held.state()).units;
  if (units.new_pass) {
    if (!units.order.empty()) units.last_order = std::move(units.order);
    units.order.clear();
    units.new_pass = false;
  }
  if (std::find(units.order.begin(), units.order.end(), u) == units.order.end()) units.order.push_back(u);
  materialize(held, u, Use::compute);
  const auto at = std::find(units.last_order.begin(), units.last_order.end(), u);
  if (units.prefetch_forward && !recomputing() && at != units.last_order.end())
    prefetch_ahead(held, at + 1, units.last_order.end());
  return {units.cast_inputs ? computes_in(held, u) : std::nullopt, units.output_dtype, keeps_for_backward(held, u)};
}
// One tensor input of unit u, cast where the policy says, and, where it
// needs a gradient, a node of our own whose gradient means the unit's
// backward is done: its hook frees the parameters.
inline at::Tensor unit_input(const at::Tensor& a, std::optional<c10::ScalarType> cast, const std::weak_ptr<State>& weak,
                             std::size_t u) {
  const bool casts = cast && a.is_floating_point() && a.scalar_type() != *cast;
  if (!a.requires_grad() || !at::GradMode::is_enabled()) return casts ? a.to(*cast) : a;
  at::Tensor in = casts ? a.to(*cast) : a.view_as(a);
  in.register_hook([weak, u](const at::Tensor&) {
    if (const auto s = weak.lock()) {
      const Locked held(*s);
      if (s->alive) release(held, u);
    }
  });
  return in;
}
// Before unit u's backward (a hook on its output): its parameters gathered
// again, and the units before it in this forward prefetched (prefetch_ahead).
inline void gather_before_backward(at::Tensor& out, const std::weak_ptr<State>& weak, std::size_t u) {
  out.register_hook([weak, u](const at::Tensor&) {
    if (const auto s = weak.lock()) {
      const Locked held(*s);
      if (!s->alive) return;
      materialize(held, u, Use::compute);
      const Units& units = sharded(*s).units;
      const auto at = std::find(units.order.begin(), units.order.end(), u);
      if (units.prefetch_backward && at != units.order.end())
        prefetch_ahead(held, std::make_reverse_iterator(at), units.order.rend());
    }
  });
}

// accel::unit_forward's machinery: fn(args...) with the parameters of the
// unit `module` gathered (plainly fn(args...) when it is not a unit).
template <class Fn, class... Args>
inline auto unit_call(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
  auto found = find_unit(module);  // (no structured binding: lambdas below capture these; clang 14)
  const std::shared_ptr<State> state = std::move(found.first);
  const std::size_t u = found.second;
  if (!state) return std::forward<Fn>(fn)(std::forward<Args>(args)...);
  const UnitDtypes dtypes = begin_unit_forward(Locked(*state), u);
  struct Release {  // after the forward, also when it throws
    State& state;
    std::size_t unit;
    bool now;
    ~Release() {
      if (!now) return;
      const Locked held(state);
      release(held, unit);
    }
  } release_after{*state, u, !recomputing() && !dtypes.keep};
  const std::weak_ptr<State> weak = state;
  auto enter = [&]<class A>(A&& a) -> decltype(auto) {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) return unit_input(a, dtypes.inputs, weak, u);
    else return std::forward<A>(a);
  };
  auto out = std::forward<Fn>(fn)(enter(std::forward<Args>(args))...);
  if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
    if (out.requires_grad() && at::GradMode::is_enabled()) gather_before_backward(out, weak, u);
    if (dtypes.output && out.is_floating_point() && out.scalar_type() != *dtypes.output) return out.to(*dtypes.output);
  } else {
    static_assert(std::is_same_v<decltype(out), at::Tensor>,
                  "accel::unit_forward: a fully sharded unit's forward returns one at::Tensor");
  }
  return out;
}
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/recompute.hpp =============================================
// accel/training/recompute.hpp: accel::checkpoint, activation checkpointing as torch.utils.checkpoint.
//
// accel::checkpoint(fn, args...) returns fn(args...) without keeping the
// activations inside fn: the forward runs under no_grad, only the inputs
// are saved, and the backward runs fn again (with the random-number state
// and the autocast state the forward had, so dropout draws the same mask
// and the same kernels run in the same precision), then back-propagates
// through that recomputation. Memory for a stack of blocks falls from every
// block's activations to the blocks' inputs plus one block's activations,
// for a second forward of each block in the backward.
//
// This is torch.utils.checkpoint's reentrant form (use_reentrant=True): a
// custom autograd Function whose backward runs a backward of its own. The
// non-reentrant form rests on saved-tensor hooks, which LibTorch's C++ API
// does not offer. One difference on purpose: torch's reentrant form gives
// the parameters inside fn no gradient when no input requires one (it
// warns); here an empty leaf that requires grad joins the inputs in that
// case, so the parameters get theirs, as with use_reentrant=False.
//
// It composes with unit_forward: under FULL_SHARD
//     x = accel::checkpoint([block](const at::Tensor& h) { return accel::unit_forward(block, h); }, x);
// gathers the block's parameters for the forward and frees them at once;
// the recomputation in the backward gathers them again and keeps them
// through the block's backward (detail::dp::recomputing()).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What the forward saw and the recomputation needs back: fn with its
// non-tensor arguments bound, the random-number states of the CPU and of
// each CUDA device the inputs are on, and the autocast state.
struct Recompute : torch::CustomClassHolder {
  std::function<at::Tensor(const std::vector<at::Tensor>&)> fn;
  std::vector<std::pair<at::Generator, at::Tensor>> rng;      // each generator and its state before the forward
  std::array<std::pair<bool, at::ScalarType>, 2> autocast{};  // CPU's and CUDA's (enabled, dtype)

  void capture(const std::vector<at::Tensor>& inputs) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto& x : inputs)
      if (x.defined() && x.is_cuda() && std::find(devices.begin(), devices.end(), x.device()) == devices.end())
        devices.push_back(x.device());
    for (const auto& device : devices) {
      at::Generator generator = at::globalContext().defaultGenerator(device);
      std::lock_guard lock(generator.mutex());
      rng.emplace_back(generator, generator.get_state());
    }
    for (std::size_t i = 0; i < 2; ++i) autocast[i] = {autocast_enabled(types[i]), autocast_dtype(types[i])};
  }
  static constexpr std::array<c10::DeviceType, 2> types{c10::DeviceType::CPU, c10::DeviceType::CUDA};
};

// The random-number states of a forward put in place for its
// recomputation, and the states of now put back after it (torch's
// fork_rng), so that the recomputation draws what the forward drew and the
// rest of the program draws on as if it had not run.
class ReplayRandomness {
 public:
  explicit ReplayRandomness(const Recompute& run) {
    for (const auto& [generator, state] : run.rng) {
      at::Generator g = generator;
      std::lock_guard lock(g.mutex());
      now_.emplace_back(g, g.get_state());
      g.set_state(state);
    }
  }
  ReplayRandomness(const ReplayRandomness&) = delete;
  ReplayRandomness& operator=(const ReplayRandomness&) = delete;
  ~ReplayRandomness() {
    for (auto& [generator, state] : now_) {
      std::lock_guard lock(generator.mutex());
      generator.set_state(state);
    }
  }

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> now_;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // (Function::apply runs this under no_grad: nothing inside fn is kept.)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<Recompute>& run,
                            at::TensorList inputs) {
    run->capture(inputs.vec());
    at::Tensor out = run->fn(inputs.vec());
    ctx->save_for_backward(inputs.vec());  // (version-checked: an input changed in place since is an error)
    ctx->saved_data["run"] = c10::IValue::make_capsule(run);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::intrusive_ptr<torch::CustomClassHolder> holder = ctx->saved_data["run"].toCapsule();
    const auto run = c10::intrusive_ptr<Recompute>::reclaim(static_cast<Recompute*>(holder.release()));
    std::vector<at::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables())
      inputs.push_back(saved.defined() ? saved.detach().requires_grad_(saved.requires_grad()) : saved);
    at::Tensor out;
    {
      const ReplayRandomness replay(*run);
      const AutocastScope cpu(c10::DeviceType::CPU, run->autocast[0].first, run->autocast[0].second);
      const AutocastScope cuda(c10::DeviceType::CUDA, run->autocast[1].first, run->autocast[1].second);
      const at::AutoGradMode grad(true);
      dp::recomputing() = true;
      struct Done {
        ~Done() { dp::recomputing() = false; }
      } done;
      out = run->fn(inputs);
    }
    // (Nothing in fn requires grad, or the output was not used: no gradients.)
    if (out.requires_grad() && grads[0].defined()) torch::autograd::backward({out}, {grads[0]});
    torch::autograd::variable_list result{at::Tensor()};  // (none for the Recompute)
    for (const auto& x : inputs) result.push_back(x.defined() && x.requires_grad() ? x.grad() : at::Tensor());
    return result;
  }
};

// Which of Args are tensors, and the index among the tensors of each.
template <class... Args>
inline constexpr std::array<bool, sizeof...(Args)> is_tensor_arg{
    std::is_same_v<std::remove_cvref_t<Args>, at::Tensor>...};
template <class... Args>
inline constexpr std::size_t tensor_index(std::size_t position) {
  std::size_t k = 0;
  for (std::size_t i = 0; i < position; ++i) k += is_tensor_arg<Args...>[i] ? 1 : 0;
  return k;
}
}  // namespace detail

// fn(args...) with its activations recomputed in the backward instead of
// kept (see above). fn returns one at::Tensor; the at::Tensor arguments are
// its differentiable inputs, any other argument is copied and passed again
// as it was. fn runs again in the backward, after the caller's forward has
// returned: what it captures must live that long (capture locals by value).
// Under no_grad (evaluation) it is fn(args...).
template <class Fn, class... Args>
at::Tensor checkpoint(Fn&& fn, Args&&... args) {
  static_assert(std::is_same_v<std::invoke_result_t<Fn&, Args&...>, at::Tensor>,
                "accel::checkpoint: fn returns one at::Tensor");
  if (!at::GradMode::is_enabled()) return std::invoke(fn, args...);
  std::vector<at::Tensor> inputs;
  bool any_requires_grad = false;
  auto collect = [&]<class A>(const A& a) {
    if constexpr (std::is_same_v<A, at::Tensor>) {
      inputs.push_back(a);
      any_requires_grad = any_requires_grad || (a.defined() && a.requires_grad());
    }
  };
  (collect(args), ...);
  // The inputs travel through `inputs` (saved, version-checked); the other
  // arguments are kept here. A tensor's place holds an empty tensor, so
  // that the Recompute does not keep a second reference to it.
  auto kept = std::make_tuple([]<class A>(A&& a) {
    if constexpr (std::is_same_v<std::remove_cvref_t<A>, at::Tensor>) return at::Tensor();
    else return std::decay_t<A>(std::forward<A>(a));
  }(args)...);
  auto run = c10::make_intrusive<detail::Recompute>();
  run->fn = [fn = std::decay_t<Fn>(std::forward<Fn>(fn)),
             kept = std::move(kept)](const std::vector<at::Tensor>& in) mutable {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      auto pick = [&]<std::size_t Position>(std::integral_constant<std::size_t, Position>) -> decltype(auto) {
        if constexpr (detail::is_tensor_arg<Args...>[Position])
          return static_cast<const at::Tensor&>(in[detail::tensor_index<Args...>(Position)]);
        else return std::get<Position>(kept);
      };
      return std::invoke(fn, pick(std::integral_constant<std::size_t, I>{})...);
    }(std::index_sequence_for<Args...>{});
  };
  // torch's reentrant form would leave the parameters inside fn without
  // gradients here; an empty leaf that requires grad makes the output
  // require grad, so the backward (and the recomputation) runs.
  if (!any_requires_grad) inputs.push_back(at::empty({0}).requires_grad_());
  return detail::CheckpointFunction::apply(run, at::TensorList(inputs));
}

ACCEL_NAMESPACE_END

// == accel/training/dp/shards.hpp =============================================
// accel/training/dp/shards.hpp: ZeRO-2's shards: each parameter cut in S chunks, this rank's kept and stepped.
//
// Given a shard group of S ranks, every parameter is cut into S equal
// chunks (the last padded with zeros) and rank r keeps chunk r as its
// shard, a tensor of its own that the optimizer steps instead of the
// parameter, so optimizer state is 1/S. A bucket's gradients are
// reduce-scattered (dp/reducer.hpp) so that each rank receives its chunk of
// every parameter, averaged along a replicate group too where there is one
// (HSDP); finish_sharded writes them to the shards' gradients. After the
// optimizer steps the shards, gather_shards all-gathers them into every
// parameter. ZeRO-3's units (dp/units.hpp) gather theirs at each use instead.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// The shard standing in for parameter p; undefined when p is not one of
// this module's sharded parameters.
inline at::Tensor shard_of(const State& s, const at::Tensor& p) {
  const Sharded& z = sharded(s);
  const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
  return found == z.shard_index.end() ? at::Tensor() : z.buckets[found->second.first].shards[found->second.second];
}

// Puts the shards in place of this module's parameters in the optimizer's
// groups (so it steps, and keeps state for, the shards only). Before its
// first step; not an LBFGS (its line search needs whole-vector products).
inline void shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) {
  Sharded& z = sharded(held.state());
  bool touched = false;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
      if (found == z.shard_index.end()) continue;
      if (!optimizer.state().empty())
        throw InvalidArgument(
            "accel::Accelerator::prepare: the optimizer has already stepped; under sharding "
            "prepare it before its first step (its state becomes per-shard)");
      if (dynamic_cast<torch::optim::LBFGS*>(&optimizer))
        throw InvalidArgument(
            "accel::Accelerator::prepare: LBFGS cannot step shards (its line search needs "
            "products over whole parameters); use NO_SHARD");
      ShardedBucket& bucket = z.buckets[found->second.first];
      p = bucket.shards[found->second.second];
      bucket.in_optimizer[found->second.second] = 1;
      touched = true;
    }
  if (touched && std::find(z.optimizers.begin(), z.optimizers.end(), &optimizer) == z.optimizers.end())
    z.optimizers.push_back(&optimizer);
}

inline bool steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) {
  const Sharded& z = sharded(held.state());
  return std::find(z.optimizers.begin(), z.optimizers.end(), &optimizer) != z.optimizers.end();
}

// Before a backward, each shard against its chunk of the parameter
// (LibTorch's optimizers write through .data(), which version counters do
// not see, so values are compared; one pass over 1/S of the parameters
// and one device sync). A shard that changed since the last gather_shards()
// means its optimizer was stepped directly, not through the handle
// prepare() returned, and this forward used stale parameters: an error.
// A parameter changed since then (by hand, Module::load) is taken into its
// shard. Every shard must be in a prepared optimizer.
inline void check_shards(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  at::NoGradGuard no_grad;
  const int64_t r = z.shard->getRank();
  // Per shard that may differ: [differs from its chunk, differs from its sum at the gather]. On the CPU
  // at::equal compares without allocating or a device sync, so only a shard that differs is looked at.
  std::vector<std::pair<std::size_t, std::size_t>> looked;
  std::vector<at::Tensor> differs;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const Bucket& layout = s.buckets[b];
    ShardedBucket& bucket = z.buckets[b];
    for (std::size_t i = 0; i < layout.params.size(); ++i) {
      if (!bucket.in_optimizer[i])
        throw InvalidArgument("accel::Accelerator::backward: the parameter " + s.names.describe(layout.params[i]) +
                              " of a sharded model is in no prepared optimizer; under sharding its optimizer "
                              "steps the shards, so prepare it (accelerator.prepare(model, optimizer))");
      if (bucket.unit >= 0) continue;  // gathered from the shards at each use: never stale
      const at::Tensor flat = layout.params[i].reshape({-1});
      const auto [begin, length] = chunk_range(r, bucket.chunks[i], flat.numel());
      const at::Tensor shard = bucket.shards[i].narrow(0, 0, length), chunk = flat.narrow(0, begin, length);
      if (flat.is_cpu() && at::equal(shard, chunk)) continue;
      looked.emplace_back(b, i);
      differs.push_back(shard.ne(chunk).any());
      differs.push_back(bucket.shards[i].sum().ne(bucket.sums[i]));
    }
  }
  if (differs.empty()) return;
  const at::Tensor found = at::stack(differs).to(c10::kCPU);
  const bool* flag = found.data_ptr<bool>();
  for (const auto& [b, i] : looked) {
    const bool changed = flag[0], stepped = flag[1];
    flag += 2;
    if (!changed) continue;
    if (stepped)
      throw InvalidArgument(
          "accel::Accelerator::backward: under sharding, step the optimizer through the "
          "handle accelerator.prepare() returned (its step() gathers the updated shards "
          "into the parameters); the parameters this forward used are stale");
    ShardedBucket& bucket = z.buckets[b];
    read_chunk(s.buckets[b].params[i], r, bucket.chunks[i], bucket.shards[i]);
    bucket.sums[i] = bucket.shards[i].sum();
  }
}

// How many of gather_shards' all-gathers may be in flight at once: two, so
// that one bucket's messages travel while the next is issued. (They land
// in the parameters themselves, so this bounds the pool only where a
// bucket of small parameters lands in rows.)
inline constexpr std::size_t kGathersInFlight = 2;

// After the optimizer stepped the shards: every parameter all-gathered
// from them (one all_gather per bucket, straight into the parameters where
// it can: gather_params), and the parameters' gradients released (the
// shards' hold this step's).
inline void gather_shards(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  end_unit_pass(held);  // a prefetch made before this step holds old values
  at::NoGradGuard no_grad;
  // At most kGathersInFlight all-gathers at once (where they land in rows, those come from the pool).
  std::deque<std::pair<std::size_t, Work<at::Tensor>>> works;
  auto land = [&] {
    const std::size_t b = works.front().first;
    works.front().second.wait();
    works.pop_front();
    for (std::size_t i = 0; i < s.buckets[b].params.size(); ++i) {
      // The values were written through variable_data(), which no version
      // counter sees; this is an in-place change of the parameter.
      at::Tensor& p = s.buckets[b].params[i];
      p.unsafeGetTensorImpl()->bump_version();
      p.mutable_grad().reset();
      at::sum_out(z.buckets[b].sums[i], z.buckets[b].shards[i]);
    }
  };
  try {
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {
      if (z.buckets[b].unit >= 0) continue;  // FULL_SHARD: gathered when the unit runs
      if (works.size() >= kGathersInFlight) land();
      std::vector<at::Tensor> into;
      for (const auto& p : s.buckets[b].params) into.push_back(p.variable_data());
      works.emplace_back(b, gather_params(held, b, z.buckets[b].owned, std::move(into)));
    }
    while (!works.empty()) land();
  } catch (const DistributedError& e) {
    throw DistributedError(std::string("accel::DataParallel: gathering the parameters from their shards failed: ") +
                           detail::error_text(e));
  }
}

// An optimizer's key for one parameter's state (LibTorch 1.x keys it by the
// parameter's address as text, c10::guts::to_string's, 2.x by the address).
template <class StateMap>
typename StateMap::key_type state_key(const StateMap&, c10::TensorImpl* parameter) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream key;
    key << static_cast<const void*>(parameter);
    return key.str();
  } else {
    return parameter;
  }
}
// Drops an optimizer's state for one parameter.
template <class StateMap>
void erase_state(StateMap& state, c10::TensorImpl* parameter) {
  state.erase(state_key(state, parameter));
}

// The module given back for local use (Accelerator::free_memory): every
// unit's parameters gathered for good (a collective on the shard group),
// and every optimizer that stepped the shards given the parameters back in
// their place, its state for the shards dropped (the optimizer starts
// afresh: LibTorch's per-parameter state types are its own, so 1/S of each
// cannot be put back together here). DataParallel then makes its hooks inert.
inline void release_module(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  end_unit_pass(held);
  for (std::size_t u = 0; u < z.units.list.size(); ++u) {
    materialize(held, u, Use::full);
    own_storage(held, u);  // the module outlives the pool
  }
  ++z.units.held;  // (release() frees nothing while held)
  // Each shard's parameter, to put back in its place.
  std::unordered_map<const c10::TensorImpl*, const at::Tensor*> parameter_of;
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (std::size_t i = 0; i < z.buckets[b].shards.size(); ++i)
      parameter_of[z.buckets[b].shards[i].unsafeGetTensorImpl()] = &s.buckets[b].params[i];
  for (torch::optim::Optimizer* optimizer : z.optimizers)
    for (auto& group : optimizer->param_groups())
      for (auto& p : group.params()) {
        const auto found = parameter_of.find(p.unsafeGetTensorImpl());
        if (found == parameter_of.end()) continue;
        erase_state(optimizer->state(), p.unsafeGetTensorImpl());
        p = *found->second;
      }
  z.optimizers.clear();
}

// Cuts every parameter into its chunks and makes this rank's shards.
inline void make_shards(State& s) {
  Sharded& z = sharded(s);
  const int64_t S = z.shard->getSize(), r = z.shard->getRank();
  at::NoGradGuard no_grad;
  z.buckets.resize(s.buckets.size());
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    const std::vector<at::Tensor>& params = s.buckets[b].params;
    ShardedBucket& bucket = z.buckets[b];
    int64_t at = 0;
    for (const auto& p : params) {
      const int64_t c = (p.numel() + S - 1) / S;
      bucket.offsets.push_back(at);
      bucket.chunks.push_back(c);
      at += c;
    }
    bucket.owned = at::empty({at}, params.front().options().requires_grad(false));
    for (std::size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      // detach(): a leaf of its own on owned's memory, not an autograd view
      // of it (optimizers step it in place, as they step a parameter).
      at::Tensor shard = bucket.owned.narrow(0, bucket.offsets[i], bucket.chunks[i]).detach();
      read_chunk(p, r, bucket.chunks[i], shard);
      shard.set_requires_grad(true);  // a leaf with a gradient, as the parameter it stands for
      bucket.shards.push_back(shard);
      bucket.in_optimizer.push_back(0);
      bucket.sums.push_back(shard.sum());
      z.shard_index.emplace(p.unsafeGetTensorImpl(), std::make_pair(b, i));
      StandIns::instance().add(p, shard);
    }
    bucket.segment = at + static_cast<int64_t>(params.size());
    bucket.used_anywhere = at::empty({static_cast<int64_t>(params.size())}, at::TensorOptions(c10::kBool));
  }
}

}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/sharded_state_dict.hpp =================================
// accel/training/dp/sharded_state_dict.hpp: what checkpoints ask of a sharded DataParallel: each rank's pieces, written and loaded without gathering.
//
// The checkpoint family (checkpoint/shards.hpp, checkpoint/state.hpp) reads
// and writes a sharded model through one ShardedStateDict, which
// DataParallel::sharded_state_dict() returns: this rank's piece of each
// parameter, whether this rank writes pieces (under HSDP the first replica
// does), what a load reads for each parameter and putting it in place, and
// the two steps around a Module::load. Every method takes the engine's lock
// for its call (dp/state.hpp's Locked); on a model that is not sharded
// each one does nothing, and the pieces are whole tensors.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// Before Module::load: it replaces each parameter's storage (set_), which
// reads the old storage's data pointer, so a unit's parameter at rest
// stops refusing access (it still holds nothing); reshard() afterwards takes
// the shards from what was loaded and puts the units at rest again.
inline void open_for_load(const Locked& held) {
  const State& s = held.state();
  for (const Unit& unit : sharded(s).units.list)
    for (const UnitBucket& ub : unit.buckets)
      if (!ub.resident)
        for (const auto& p : s.buckets[ub.bucket].params) allow_access(*p.storage().unsafeGetStorageImpl());
}
// Every shard taken again from its parameter (after Module::load, which
// gives every parameter storage of its own); units' parameters are freed
// again.
inline void reshard(const Locked& held) {
  State& s = held.state();
  Sharded& z = sharded(s);
  at::NoGradGuard no_grad;
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (std::size_t i = 0; i < s.buckets[b].params.size(); ++i) {
      ShardedBucket& bucket = z.buckets[b];
      read_chunk(s.buckets[b].params[i], z.shard->getRank(), bucket.chunks[i], bucket.shards[i]);
      bucket.sums[i] = bucket.shards[i].sum();
    }
  for (std::size_t u = 0; u < z.units.list.size(); ++u) {
    for (UnitBucket& ub : z.units.list[u].buckets) ub.resident = true;
    release(held, u);
  }
}

// This rank's Piece of parameter p (dp/strategy.hpp): a unit's parameter
// holds nothing at rest, so its shard's; any other's own chunk, which
// check_shards treats as the truth. None when p is not sharded here.
inline std::optional<Piece> piece_of(const Locked& held, const at::Tensor& p) {
  const Sharded& z = sharded(held.state());
  const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
  if (found == z.shard_index.end()) return std::nullopt;
  const auto [b, i] = found->second;
  const ShardedBucket& bucket = z.buckets[b];
  const auto [begin, length] = chunk_range(z.shard->getRank(), bucket.chunks[i], p.numel());
  const bool whole = bucket.unit < 0 || [&] {
    const UnitBucket& ub = unit_bucket(z.units, bucket.unit, b);
    return ub.resident && !ub.low;  // (low: in a policy's param_dtype)
  }();
  return Piece{whole ? p.detach().reshape({-1}).narrow(0, begin, length) : bucket.shards[i].narrow(0, 0, length),
               begin};
}
// What a load reads for parameter p, as (begin, length) of p flattened: a
// unit's parameter only its piece (its shard is all it keeps), unless
// summon_full_params() holds the units gathered; every other one whole.
inline std::pair<int64_t, int64_t> load_range(const Locked& held, const at::Tensor& p) {
  const Sharded& z = sharded(held.state());
  const auto found = z.shard_index.find(p.unsafeGetTensorImpl());
  if (found == z.shard_index.end() || z.units.held > 0 || z.buckets[found->second.first].unit < 0)
    return {0, p.numel()};
  return chunk_range(z.shard->getRank(), z.buckets[found->second.first].chunks[found->second.second], p.numel());
}
// Puts what a load read in place: values(p) holds load_range(p)'s elements
// of each sharded parameter. Prefetches and gathered units are dropped
// first (they hold the old values); a parameter read whole gives its shard
// its chunk.
inline void load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) {
  State& s = held.state();
  Sharded& z = sharded(s);
  if (z.units.held == 0) end_unit_pass(held);
  at::NoGradGuard no_grad;
  const int64_t r = z.shard->getRank();
  for (std::size_t b = 0; b < s.buckets.size(); ++b)
    for (std::size_t i = 0; i < s.buckets[b].params.size(); ++i) {
      at::Tensor& p = s.buckets[b].params[i];
      ShardedBucket& bucket = z.buckets[b];
      const at::Tensor v = values(p).reshape({-1});
      if (bucket.unit < 0 || z.units.held > 0) {
        p.detach().copy_(v.view(p.sizes()));
        read_chunk(p, r, bucket.chunks[i], bucket.shards[i]);
      } else {
        bucket.shards[i].narrow(0, 0, v.numel()).copy_(v);
        bucket.shards[i].narrow(0, v.numel(), bucket.chunks[i] - v.numel()).zero_();
      }
      bucket.sums[i] = bucket.shards[i].sum();
    }
}

class ShardedStateDict {
 public:
  explicit ShardedStateDict(std::shared_ptr<State> state) : state_(std::move(state)) {}

  // This rank's piece of parameter p (see Piece); none: p is not sharded here.
  std::optional<Piece> piece_of(const at::Tensor& p) const { return state_->mode->piece_of(Locked(*state_), p); }
  bool writes_pieces() const { return state_->mode->writes_pieces(); }
  std::pair<int64_t, int64_t> load_range(const at::Tensor& p) const {
    return state_->mode->load_range(Locked(*state_), p);
  }
  void load_values(const std::function<at::Tensor(const at::Tensor&)>& values) {
    state_->mode->load_values(Locked(*state_), values);
  }
  // Module::load into the parameters, then every shard taken again from
  // its parameter: open_for_load() before the load, reshard() after it.
  void open_for_load() { state_->mode->open_for_load(Locked(*state_)); }
  void reshard() { state_->mode->reshard(Locked(*state_)); }

 private:
  std::shared_ptr<State> state_;
};
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/strategies.hpp =========================================
// accel/training/dp/strategies.hpp: the two strategies' operations (Replicated: NO_SHARD; Sharded: ZeRO-2, ZeRO-3, HSDP), each a call into the engine's part that does it.
//
// dp/strategy.hpp declares what a strategy does, dp/state.hpp each
// strategy's state; here each operation of each one is defined, after the
// parts that do the work (the reducer, the shards, the units, the
// checkpoints' pieces). Reading one strategy top to bottom says what a
// step of it runs. Calls into the engine's functions are written dp::name:
// several have the name of the operation calling them, which would find the
// member instead.

ACCEL_NAMESPACE_BEGIN

namespace detail::dp {
// -- Replicated (NO_SHARD): buckets all-reduced, gradients written back whole --

inline std::vector<int64_t> Replicated::assign_units(State&, const torch::nn::Module&,
                                                     const std::vector<std::shared_ptr<torch::nn::Module>>&,
                                                     const std::vector<at::Tensor>& params) {
  return std::vector<int64_t>(params.size(), -1);  // (units are a sharded strategy's)
}
inline void Replicated::lay_out(State& s, const std::vector<int64_t>&) { buckets.resize(s.buckets.size()); }
inline void Replicated::take_policy(State&, const MixedPrecisionPolicy&) {
  throw InvalidArgument(
      "accel::DataParallel: a MixedPrecisionPolicy is for sharded training (FULL_SHARD or HYBRID_SHARD); "
      "this model is not sharded (use mixed_precision = \"bf16\", autocast)");
}
inline void Replicated::issue(const Locked& held, std::size_t b) { issue_all_reduce(held, b); }
inline void Replicated::finish(const Locked& held) { finish_unsharded(held); }
inline void Replicated::shadow_backward(const Locked& held) { dp::shadow_backward(held); }
inline void Replicated::register_comm_hook(const Locked& held, CommHook to_register) {
  if (hooked)
    throw LogicError(
        "accel::DataParallel::register_comm_hook: a communication hook is already registered (as "
        "DDP, once per model)");
  if (held.state().armed)
    throw LogicError("accel::DataParallel::register_comm_hook: inside a backward; register before training");
  hook = std::move(to_register);
  hooked = true;
}
inline void Replicated::gradient_as_bucket_view(const Locked& held, bool on) {
  State& s = held.state();
  if (s.armed) throw LogicError("accel::DataParallel::gradient_as_bucket_view: inside a backward");
  bucket_view = on;
  if (!on)
    for (std::size_t b = 0; b < s.buckets.size(); ++b) {  // the gradients become tensors of their own again
      const at::Tensor& persistent = buckets[b].persistent;
      for (auto& p : s.buckets[b].params)
        if (p.grad().defined() && persistent.defined() && p.grad().is_alias_of(persistent))
          p.mutable_grad() = p.grad().clone();
    }
}

// -- Sharded (SHARD_GRAD_OP, FULL_SHARD, HYBRID_SHARD): buckets reduce-scattered into shards --

inline std::vector<int64_t> Sharded::assign_units(State& s, const torch::nn::Module& module,
                                                  const std::vector<std::shared_ptr<torch::nn::Module>>& unit_list,
                                                  const std::vector<at::Tensor>& params) {
  return dp::assign_units(s, module, unit_list, params);  // (dp/unit_plan.hpp)
}
inline void Sharded::lay_out(State& s, const std::vector<int64_t>& bucket_unit) {
  make_shards(s);                  // (dp/shards.hpp)
  make_units(*this, bucket_unit);  // (dp/unit_plan.hpp)
}
inline void Sharded::take_policy(State& s, const MixedPrecisionPolicy& policy) { apply_policy(s, policy); }
inline std::size_t Sharded::unit_count() const { return units.list.size(); }
inline std::vector<const torch::nn::Module*> Sharded::unit_modules() const {
  std::vector<const torch::nn::Module*> modules;
  for (const Unit& unit : units.list) modules.push_back(unit.module);
  return modules;
}
inline void Sharded::arm(const Locked&) {
  for (auto& bucket : buckets) give_back(bucket);  // (the last step's pooled buffers)
}
inline void Sharded::issue(const Locked& held, std::size_t b) { issue_scatter(held, b); }
inline void Sharded::finish(const Locked& held) { finish_sharded(held); }
inline void Sharded::end_unit_pass(const Locked& held) { dp::end_unit_pass(held); }
inline void Sharded::shadow_backward(const Locked&) {
  throw LogicError(
      "accel::DataParallel::shadow_backward: a sharded model cannot be stood in for (a joined process "
      "would have to step its shard too); use NO_SHARD, or even batches");
}
inline void Sharded::register_comm_hook(const Locked&, CommHook) {
  throw InvalidArgument(
      "accel::DataParallel::register_comm_hook: the buckets of a sharded model are "
      "reduce-scattered, not all-reduced; communication hooks need NO_SHARD");
}
inline void Sharded::gradient_as_bucket_view(const Locked&, bool on) {
  if (on)
    throw InvalidArgument(
        "accel::DataParallel::gradient_as_bucket_view: a sharded model's gradients are "
        "reduce-scattered into its shards");
}
inline at::Tensor Sharded::shard_of(const State& s, const at::Tensor& p) const { return dp::shard_of(s, p); }
inline void Sharded::shard_optimizer(const Locked& held, torch::optim::Optimizer& optimizer) {
  dp::shard_optimizer(held, optimizer);
}
inline bool Sharded::steps_with(const Locked& held, const torch::optim::Optimizer& optimizer) const {
  return dp::steps_with(held, optimizer);
}
inline void Sharded::check_shards(const Locked& held) { dp::check_shards(held); }
inline void Sharded::gather_shards(const Locked& held) { dp::gather_shards(held); }
inline void Sharded::release_module(const Locked& held) { dp::release_module(held); }
inline void Sharded::summon_units(const Locked& held) {
  for (std::size_t u = 0; u < units.list.size(); ++u) materialize(held, u, Use::full);
  ++units.held;
}
inline void Sharded::set_prefetch(const Locked&, bool forward, bool backward) {
  units.prefetch_forward = forward;
  units.prefetch_backward = backward;
}
inline void Sharded::let_go_of_units(const Locked& held) noexcept { dp::let_go_of_units(held); }
inline std::optional<Piece> Sharded::piece_of(const Locked& held, const at::Tensor& p) const {
  return dp::piece_of(held, p);
}
inline bool Sharded::writes_pieces() const { return !replicate || replicate->getRank() == 0; }  // (HSDP: one replica)
inline std::pair<int64_t, int64_t> Sharded::load_range(const Locked& held, const at::Tensor& p) const {
  return dp::load_range(held, p);
}
inline void Sharded::load_values(const Locked& held, const std::function<at::Tensor(const at::Tensor&)>& values) {
  dp::load_values(held, values);
}
inline void Sharded::open_for_load(const Locked& held) { dp::open_for_load(held); }
inline void Sharded::reshard(const Locked& held) { dp::reshard(held); }
}  // namespace detail::dp

ACCEL_NAMESPACE_END

// == accel/training/dp/data_parallel.hpp ======================================
// accel/training/dp/data_parallel.hpp: DataParallel, the class: data parallelism for one module (buckets, ZeRO-2 shards, ZeRO-3 units).

ACCEL_NAMESPACE_BEGIN

// Data parallelism for one module on one group, the DistributedDataParallel
// design: parameters and buffers are broadcast from the group's rank 0;
// gradients are averaged in buckets (DDP's assignment: one dtype and device
// each, the first at least 1 MiB, then at least bucket_bytes, in reverse
// parameter order, roughly the order backward produces them; see
// accel/training/dp/buckets.hpp). A
// post-hook on each parameter's gradient accumulator marks it ready; a full
// bucket is flattened and its all-reduce issued at once, asynchronously,
// while backward goes on; finish() waits for them and writes the averages
// back into the gradients, before the optimizer step.
//
// Unused parameters are handled as DDP with find_unused_parameters, without
// its extra collective: each bucket carries, after the gradients, one flag
// per parameter (did this rank produce its gradient since the last sync?),
// summed with the gradients. A parameter no rank used keeps its .grad as it
// was (undefined stays undefined, as in local training); one used anywhere
// gets the average, zeros counted for the ranks that did not use it.
// A backward in which none of the module's parameters got a gradient (the
// loss came from another model) issues nothing and leaves the module alone.
//
// Sharded (ZeRO-2, FSDP's SHARD_GRAD_OP), given a shard group of S ranks:
// every parameter is cut into S equal chunks (the last padded with zeros)
// and rank r keeps chunk r as its shard, a tensor of its own that the
// optimizer steps instead of the parameter (Accelerator::prepare puts the
// shards into the optimizer's groups), so optimizer state is 1/S. A
// bucket's gradients are reduce-scattered instead of all-reduced, laid out
// rank after rank so that each rank receives its chunk of every parameter
// (and every used-flag), averaged along a replicate group too where there
// is one (HSDP), and written to the shards' gradients. After the optimizer
// steps the shards, gather_shards() all-gathers them into every parameter and
// releases the parameters' gradients.
//
// Fully sharded (ZeRO-3, FSDP's FULL_SHARD), given units as well: the
// parameters of each unit (a submodule) hold no memory at rest. LibTorch
// modules have no forward hooks, so a unit runs through accel::unit_forward
// (dp/unit_forward.hpp), which gathers its parameters from the shards (waiting for a
// prefetch where one was issued, and prefetching the unit that came next in
// the last forward), runs its forward and frees them again. Autograd hooks
// on the unit's output and inputs gather them once more before the unit's
// backward (prefetching the unit before it) and free them after it; each
// unit is a bucket of its own, reduce-scattered as soon as its gradients
// are complete, and the parameters' gradients are released right then (the
// shards' gradients accumulate instead). Parameters in no unit (the root's
// own) are sharded as under ZeRO-2. Freed storage is LibTorch's error on use
// ("storage of size 0", "data is not allocated"), never stale values;
// summon_full_params() gathers everything for as long as it lives
// (checkpoints, exports, inspection).
//
// The class owns the state (dp/state.hpp) and keeps the API. It chooses
// the strategy once, in its constructor, and calls it for everything that
// differs by mode (dp/strategy.hpp, defined in dp/strategies.hpp); the work
// is in dp/reducer.hpp (the buckets), dp/shards.hpp (ZeRO-2) and
// dp/unit_plan.hpp, dp/unit_params.hpp, dp/units.hpp (ZeRO-3), on that
// state.
//
// On a GPU, streams as DDP: a bucket is flattened on the stream its
// gradients were made on, and c10d runs its collective on a stream of its
// own (NCCL's; Gloo's copies to and from the host) once that stream has
// reached it; finish() makes the current stream wait for the reduction,
// and the host waits for nothing: the used-flags are written without it,
// and read back only where this rank left a parameter unused (dp/state.hpp;
// the cuda case "gpu: DataParallel's backward ..." proves it under CUDA's
// sync debug mode).
//
// Why not LibTorch's own c10d::Reducer (the engine of Python's DDP)? Its
// header includes torch/csrc/distributed/autograd/context/context.h, which
// Debian's libtorch-dev does not ship, so it cannot be included there.
class DataParallel {
 public:
  static constexpr int64_t kFirstBucketBytes = 1 << 20;  // as torch's DDP

  // group: where parameters are broadcast from, and gradients averaged over
  // when not sharded. shard (of more than one rank): shard along it, and
  // average along replicate as well when given. units (sharded only):
  // submodules whose parameters are sharded at rest (FULL_SHARD). policy
  // (sharded only): the dtypes units compute and gradients reduce in (see
  // MixedPrecisionPolicy). A tensor registered in several modules (tied
  // weights) is one parameter, as in Python's parameters().
  DataParallel(const std::shared_ptr<torch::nn::Module>& module, GroupPtr group, int64_t bucket_bytes,
               GroupPtr shard = {}, GroupPtr replicate = {},
               const std::vector<std::shared_ptr<torch::nn::Module>>& units = {}, MixedPrecisionPolicy policy = {})
      : module_(module), state_(std::make_shared<detail::dp::State>()) {
    state_->group = std::move(group);
    if (!state_->group) return;  // not distributed: plain local training
    // The strategy, chosen here once (the only test of the mode; dp/strategy.hpp):
    // sharded along a shard group of more than one rank.
    if (shard && shard->getSize() > 1) {
      if (replicate && replicate->getSize() == 1) replicate.reset();
      state_->replicas = shard->getSize() * (replicate ? replicate->getSize() : 1);
      state_->mode = std::make_unique<detail::dp::Sharded>(std::move(shard), std::move(replicate));
    } else {
      state_->replicas = state_->group->getSize();
    }
    detail::dp::Strategy& mode = *state_->mode;
    state_->names = detail::ParameterNames(*module_);
    sync_module_states();
    std::vector<at::Tensor> params;
    for (const auto& p : detail::unique_tensors(module_->parameters()))
      if (p.requires_grad()) params.push_back(p);
    std::reverse(params.begin(), params.end());
    const std::vector<int64_t> unit_of = mode.assign_units(*state_, *module_, units, params);
    const std::vector<int64_t> bucket_unit =
        detail::dp::lay_out(*state_, params, unit_of, {kFirstBucketBytes, bucket_bytes});
    accumulators_.resize(params.size());
    mode.lay_out(*state_, bucket_unit);
    if (policy.active()) {
      detail::dp::check_policy(policy);
      mode.take_policy(*state_, policy);
    }
    if constexpr (detail::dp::refuses_at_rest<>)
      if (unit_count() > 0) detail::dp::name_at_rest(*state_, *module_);
    {
      const detail::dp::Locked held(*state_);
      for (std::size_t u = 0; u < unit_count(); ++u) detail::dp::release(held, u);  // at rest: the shards only
    }
    const std::vector<const torch::nn::Module*> unit_modules = mode.unit_modules();
    for (std::size_t u = 0; u < unit_modules.size(); ++u) {
      std::lock_guard lock(detail::dp::unit_registry_mutex());
      detail::dp::unit_registry()[unit_modules[u]] = {state_, u};
    }
    hook_accumulators();
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  ~DataParallel() {
    {
      std::lock_guard lock(detail::dp::unit_registry_mutex());
      for (const auto* unit : state_->mode->unit_modules()) detail::dp::unit_registry().erase(unit);
    }
    const detail::dp::Locked held(*state_);
    state_->alive = false;  // the hooks outlive us inside the autograd graph: make them inert
    // A unit gathered now (a forward interrupted, summon_full_params alive) points into the pool, which
    // dies with the state: its parameters get memory of their own, as the model outlives us. Also after an
    // error (a failed gather, a peer gone): nothing here throws.
    state_->mode->let_go_of_units(held);
  }

  // Copies the parameters and buffers of the group's rank `src` to every
  // rank of the group.
  void sync_module_states(int src = 0) {
    if (!state_->group) return;
    std::vector<at::Tensor> states = module_->parameters();
    for (const auto& b : module_->buffers()) states.push_back(b);
    broadcast(detail::unique_tensors(states), src, state_->group);
  }

  // Arms the hooks for the next backward; without it, backward accumulates
  // gradients locally (no_sync). Nothing while gradient sync is off (below).
  void prepare_for_backward() {
    if (!state_->group || !requires_sync_) return;
    hook_accumulators();
    const detail::dp::Locked held(*state_);
    state_->armed = true;
    state_->next = 0;
    state_->fired = 0;
    state_->timeline.arm(state_->buckets.size());
    for (std::size_t b = 0; b < state_->buckets.size(); ++b) {
      auto& bucket = state_->buckets[b];
      state_->timeline.times.buckets[b].bytes = bucket.packing.bytes();
      bucket.ready = 0;
      std::fill(bucket.seen.begin(), bucket.seen.end(), 0);
      bucket.work = {};  // (a Work left from a backward that never finished is waited for)
    }
    state_->mode->arm(held);
  }

  // FSDP2's set_requires_gradient_sync (DDP's require_backward_grad_sync):
  // while off, prepare_for_backward() arms nothing, so each backward adds
  // its gradients to the parameters' own (under FULL_SHARD too: whole
  // gradients, as FSDP2's no-sync micro-batches keep), and the first
  // backward with it on again reduces their sum. A pipeline stage runs its
  // micro-batches so, reducing on the last; Accelerator::no_sync and
  // accumulate() switch it for the models they name.
  void set_requires_gradient_sync(bool on) { requires_sync_ = on; }
  bool requires_gradient_sync() const { return requires_sync_; }

  // Waits for every bucket's all-reduce and writes the averaged gradients
  // back. Buckets with parameters that got no gradient in this backward are
  // reduced here, in the same order on every rank. Returns whether the
  // module took part (false: no parameter of it got a gradient, nothing was
  // communicated; with `always`, it takes part regardless).
  bool finish(bool always = false) {
    const detail::dp::Locked held(*state_);
    state_->mode->end_unit_pass(held);
    if (!state_->armed) return false;
    state_->armed = false;
    if (state_->fired == 0 && !always) return false;
    state_->timeline.times.finish_began = state_->timeline.now();
    for (std::size_t b = state_->next; b < state_->buckets.size(); ++b) detail::dp::issue_bucket(held, b);
    state_->next = state_->buckets.size();
    at::NoGradGuard no_grad;
    state_->mode->finish(held);
    state_->timeline.times.finished = state_->timeline.now();
    return true;
  }

  // A rank that has run out of inputs stands in for one backward of the
  // others (DDP's join): every bucket's all-reduce, in order, with zero
  // gradients and no used-flags; its own gradients are left alone.
  void shadow_backward() {
    if (!state_->group) return;
    const detail::dp::Locked held(*state_);
    state_->mode->shadow_backward(held);
  }

  // DDP's register_comm_hook (see CommHook): once, as DDP allows, and not
  // between a backward and its finish(); not under sharding.
  void register_comm_hook(CommHook hook) {
    if (!hook) throw InvalidArgument("accel::DataParallel::register_comm_hook: an empty hook");
    const detail::dp::Locked held(*state_);
    state_->mode->register_comm_hook(held, std::move(hook));
  }
  // DDP's gradient_as_bucket_view: each parameter's .grad becomes a view
  // into its (persistent) bucket, so the gradients are not copied into the
  // bucket and back, nor held twice (as gradients and bucket). Keep the
  // gradients (zero_grad with set_to_none = false: LibTorch 2.x's default
  // sets them to none): a gradient set to none is copied into its view at
  // the next sync, as DDP does. NO_SHARD only.
  void gradient_as_bucket_view(bool on) {
    const detail::dp::Locked held(*state_);
    state_->mode->gradient_as_bucket_view(held, on);
  }

  // -- sharded (ZeRO-2 and ZeRO-3: see the top of this part) --

  bool sharded() const { return state_->mode->shards(); }
  // The group parameters are sharded along (null when not sharded).
  const GroupPtr& shard_group() const { return state_->mode->shard_group(); }
  // The shard standing in for parameter p; undefined when p is not one of
  // this module's sharded parameters.
  at::Tensor shard_of(const at::Tensor& p) const { return state_->mode->shard_of(*state_, p); }
  // Puts the shards in place of this module's parameters in the optimizer's
  // groups (see detail::dp::shard_optimizer).
  void shard_optimizer(torch::optim::Optimizer& optimizer) {
    state_->mode->shard_optimizer(detail::dp::Locked(*state_), optimizer);
  }
  bool steps_with(const torch::optim::Optimizer& optimizer) const {
    return state_->mode->steps_with(detail::dp::Locked(*state_), optimizer);
  }
  // Before a backward: every shard checked against its parameter (an
  // optimizer stepped directly, not through prepare()'s handle, is an error).
  void check_shards() { state_->mode->check_shards(detail::dp::Locked(*state_)); }
  // After the optimizer stepped the shards: every parameter all-gathered
  // from them, and the parameters' gradients released.
  void gather_shards() { state_->mode->gather_shards(detail::dp::Locked(*state_)); }
  // The former name of gather_shards(), kept for the programs that call it
  // (it read like accel::gather, which gathers data from every rank).
  void gather() { gather_shards(); }
  // Gives the module back for plain local use, for good (see
  // detail::dp::release_module): under FULL_SHARD its parameters gathered
  // (every rank of the shard group calls it); optimizers that stepped the
  // shards step the parameters again, from a fresh state. Afterwards this
  // DataParallel does nothing; destroy it.
  void release_module() {
    const detail::dp::Locked held(*state_);
    state_->mode->release_module(held);
    state_->alive = false;  // the hooks do nothing from now on
  }
  // What checkpoints read and write of this model (detail::dp::ShardedStateDict:
  // this rank's pieces, written and loaded without gathering).
  detail::dp::ShardedStateDict sharded_state_dict() const { return detail::dp::ShardedStateDict(state_); }

  // FSDP's summon_full_params: every unit's parameters gathered for as long
  // as the returned object lives (a collective on the shard group: every
  // rank makes one, in the same order). With writeback, what the
  // parameters hold then goes back into the shards. Nothing to do unless
  // fully sharded.
  using FullParameters = detail::dp::FullParameters;
  [[nodiscard]] FullParameters summon_full_params(bool writeback = false) {
    if (unit_count() == 0) return FullParameters(nullptr, false);
    state_->mode->summon_units(detail::dp::Locked(*state_));
    return FullParameters(state_, writeback);
  }
  // Whole parameters one unit at a time (detail::dp::UnitByUnit: at most
  // one unit gathered while it lives; every rank of the shard group in the
  // same order).
  detail::dp::UnitByUnit unit_by_unit() { return detail::dp::UnitByUnit(unit_count() > 0 ? state_ : nullptr); }
  // FULL_SHARD: whether a unit's gather is issued while the unit before it
  // computes, in the forward and in the backward (AcceleratorConfig's
  // forward_prefetch and backward_prefetch).
  void set_prefetch(bool forward, bool backward) {
    state_->mode->set_prefetch(detail::dp::Locked(*state_), forward, backward);
  }
  // Whether parameters are sharded at rest (FULL_SHARD), and in how many units.
  std::size_t unit_count() const { return state_->mode->unit_count(); }

  // Sharded: the working buffers the engine keeps from step to step
  // (dp/buffers.hpp), in bytes, as torch.cuda.memory_reserved() counts what
  // the caching allocator keeps; release_buffers() frees those not in use
  // now (as torch.cuda.empty_cache()), and the next step allocates afresh.
  int64_t buffer_bytes() const {
    const detail::dp::Locked held(*state_);
    return state_->pool.bytes();
  }
  void release_buffers() {
    const detail::dp::Locked held(*state_);
    state_->pool.clear();
  }
  // Whether `module` is a unit of a live fully sharded DataParallel.
  static bool is_unit(const torch::nn::Module* module) { return detail::dp::find_unit(module).first != nullptr; }

  // accel::unit_forward's machinery (detail::dp::unit_call).
  template <class Fn, class... Args>
  static auto unit_call(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
    return detail::dp::unit_call(module, std::forward<Fn>(fn), std::forward<Args>(args)...);
  }

  bool distributed() const { return state_->group != nullptr; }
  // The module this DataParallel keeps in sync.
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  std::size_t bucket_count() const { return state_->buckets.size(); }
  const GroupPtr& group() const { return state_->group; }
  // Called (on the autograd thread, under a lock) as each bucket's
  // all-reduce is issued: for logging, profiling and tests.
  void on_bucket_issued(std::function<void(std::size_t bucket)> callback) {
    const detail::dp::Locked held(*state_);
    state_->on_issued = std::move(callback);
  }
  // When each bucket of the last synced backward was ready, issued, waited
  // for and landed, and when finish() ran (ms since prepare_for_backward;
  // detail::dp::BucketTimes says what each moment is): whether the
  // communication hid behind the backward, for benchmarks and profiling.
  detail::dp::BackwardTimeline bucket_timeline() const {
    const detail::dp::Locked held(*state_);
    return state_->timeline.times;
  }

 private:
  // Puts a ReadyHook on each parameter's gradient accumulator. Run again
  // before each synced backward: an operation that replaces a parameter's
  // storage (Module::load's set_, set_data) gives it a new accumulator,
  // which must be hooked too.
  void hook_accumulators() {
    std::size_t k = 0;
    for (std::size_t b = 0; b < state_->buckets.size(); ++b)
      for (std::size_t i = 0; i < state_->buckets[b].params.size(); ++i, ++k) {
        auto accumulator = torch::autograd::impl::grad_accumulator(state_->buckets[b].params[i]);
        if (accumulator == accumulators_[k]) continue;
        accumulator->add_post_hook(std::make_unique<detail::dp::ReadyHook>(state_, b, i));
        accumulators_[k] = std::move(accumulator);  // hooks live as long as their node
      }
  }

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<detail::dp::State> state_;
  // (LibTorch 2.15 holds autograd nodes by intrusive_ptr, earlier versions by shared_ptr.)
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> accumulators_;
  bool requires_sync_ = true;
};

ACCEL_NAMESPACE_END

// == accel/training/pp/stage.hpp ==============================================
// accel/training/pp/stage.hpp: accel::pp::PipelineStage, this rank's part of a model in a pipeline: its forward and backward one micro-batch at a time, the backward whole or split into the input's gradient and the weights'.
//
// torch.distributed.pipelining's PipelineStage(submodule, stage_index,
// num_stages, device, group): a schedule (training/pp/schedules.hpp) runs
// it, micro-batch by micro-batch, and moves what passes between stages. One
// tensor passes from a stage to the next (hidden states; the first stage
// takes the batch's inputs, the last one's output goes to the loss), as in
// torchtitan's models. A stage keeps, per micro-batch in flight, its input
// (a leaf that collects the gradient sent back) and its output with the
// autograd graph, until that micro-batch's backward.
//
// The zero-bubble schedules split a backward in two: I computes only the
// input's gradient (sent back at once, so the stage before can go on) and
// keeps the graph; W, later, the weights' gradients (torch's
// stage_backward_input and stage_backward_weight). W runs the graph again
// from the output with the parameters as its only inputs, so the
// activations' gradients are computed twice; torch keeps them from I
// instead. The gradients are the same; the cost is W's.
//
// Data parallelism composes as torch's does when the submodule is wrapped in
// DDP or FSDP: given the stage module's DataParallel (set_data_parallel), the
// micro-batches' gradients add up locally (no sync) and the last backward of
// the step that makes weight gradients (B, or W under zero bubble) reduces
// their sum over the data-parallel group once: all-reduced, or
// reduce-scattered into the shards (ZeRO-2/3), where scale_grads then divides
// them. A fully sharded (ZeRO-3) unit is gathered again for each
// micro-batch's forward and backward, as FSDP2's reshard_after_forward does:
// a stage holds at rest only its shards, whatever the micro-batches in flight.

ACCEL_NAMESPACE_BEGIN

namespace pp {
class PipelineStage {
 public:
  // The computation: this stage's input to its output.
  using Forward = std::function<at::Tensor(const at::Tensor&)>;

  // A module with a forward of one tensor (torch::nn::Sequential, a
  // TORCH_MODULE of one's own).
  template <class M>
  PipelineStage(torch::nn::ModuleHolder<M> module, int stage_index, int num_stages,
                c10::Device device = c10::Device(c10::kCPU), GroupPtr group = {})
      : PipelineStage(
            module.ptr(), [m = module.ptr()](const at::Tensor& x) -> at::Tensor { return m->forward(x); }, stage_index,
            num_stages, device, std::move(group)) {}
  // Any module, with the call that runs it. `group`: the pipeline group
  // (null: the DistributedInterface's Dim::PP group; none in one process).
  PipelineStage(std::shared_ptr<torch::nn::Module> module, Forward forward, int stage_index, int num_stages,
                c10::Device device = c10::Device(c10::kCPU), GroupPtr group = {})
      : module_(std::move(module)),
        forward_(std::move(forward)),
        stage_index_(stage_index),
        num_stages_(num_stages),
        device_(device),
        group_(std::move(group)) {
    if (!module_ || !forward_) throw InvalidArgument("accel::pp::PipelineStage: no module or no forward");
    if (num_stages < 1 || stage_index < 0 || stage_index >= num_stages)
      throw InvalidArgument("accel::pp::PipelineStage: stage_index " + std::to_string(stage_index) +
                            " is not one of num_stages " + std::to_string(num_stages) + " (0.." +
                            std::to_string(num_stages - 1) + ")");
    // The pipeline group: `group`, else the live interface's Dim::PP group (as
    // tp's layers take Dim::TP's). torch's default is the world group, which is
    // the pp group only when pp is the whole world.
    if (!group_ && DistributedInterface::is_initialized()) group_ = DistributedInterface::instance().get_group(Dim::PP);
    if (!group_ && is_distributed())
      throw LogicError(
          "accel::pp::PipelineStage: no group given and no DistributedInterface to take Dim::PP's "
          "from; create it first (accel::DistributedInterface::instance({.pp_size = N}), or pass the "
          "group)");
  }

  int stage_index() const { return stage_index_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_index_ == 0; }
  bool is_last() const { return stage_index_ == num_stages_ - 1; }
  torch::nn::Module& submodule() const { return *module_; }  // torch's submod
  c10::Device device() const { return device_; }
  // The pipeline group (null: one process, every stage here).
  c10d::ProcessGroup* group() const { return group_.get(); }

  // The stage's data parallelism: `dp` keeps this stage's module in sync over
  // its data-parallel (or shard) group, and the stage drives its reduction,
  // once per step (see the top). `dp` must outlive the stage's schedule; with
  // it sharded, step the optimizer on the shards (dp.shard_optimizer) and
  // gather them after (dp.gather_shards), as without a pipeline. A step run
  // with dp.set_requires_gradient_sync(false) reduces nothing (gradient
  // accumulation over steps).
  void set_data_parallel(DataParallel& dp) {
    if (dp.module() != module_)
      throw InvalidArgument("accel::pp::PipelineStage::set_data_parallel: stage " + std::to_string(stage_index_) +
                            " was given the DataParallel of another module; give the one made for this stage's "
                            "submodule");
    dp_ = &dp;
  }
  DataParallel* data_parallel() const { return dp_; }

  // --- a step's bounds (the schedule calls them around its actions) ---

  // A step of `microbatches` begins: gradient sync off until the last
  // weight backward; the peak of micro-batches held counts anew.
  void begin_step(int microbatches) {
    peak_ = chunks_.size();
    step_microbatches_ = microbatches;
    weight_passes_ = 0;
    synced_ = false;
    if (!dp_) return;
    wants_sync_ = dp_->requires_gradient_sync();
    dp_->set_requires_gradient_sync(false);
  }
  // The step ended (or failed): the caller's gradient sync setting back.
  void end_step() {
    if (dp_) dp_->set_requires_gradient_sync(wants_sync_);
  }

  // --- what a schedule calls, one micro-batch at a time (torch's
  // forward_one_chunk, backward_one_chunk, backward_weight_one_chunk) ---

  // Runs the forward of micro-batch `mb` on `input` (the batch's piece on the
  // first stage; the activation received, or handed over by the stage before
  // on this rank); returns the output.
  at::Tensor forward_one_chunk(int mb, const at::Tensor& input) {
    Chunk& c = fresh_chunk(mb);
    peak_ = std::max(peak_, chunks_.size());
    c.input = input.to(device_);
    if (!is_first()) {
      if (!c10::isFloatingType(c.input.scalar_type()))
        throw InvalidArgument("accel::pp: stage " + std::to_string(stage_index_) + " receives a " +
                              std::string(c10::toString(c.input.scalar_type())) +
                              " tensor; what passes between stages must be floating point (its gradient goes back)");
      c.input = c.input.detach().requires_grad_(true);
    }
    c.output = forward_(c.input);
    if (!c.output.defined())
      throw InvalidArgument("accel::pp: stage " + std::to_string(stage_index_) + "'s forward returned no tensor");
    return c.output;
  }
  // The backward of micro-batch `mb` from `loss` (the last stage) or from the
  // gradient of the output (`grad_output`, the others). Whole (B: every
  // gradient, the graph freed) or its first half (I: only the input's, the
  // graph kept for backward_weight_one_chunk). Returns the input's gradient
  // to send back (undefined on the first stage).
  at::Tensor backward_one_chunk(int mb, const at::Tensor& loss, const at::Tensor& grad_output, bool full) {
    Chunk& c = chunk(mb, "backward");
    c.root = is_last() ? loss : c.output;
    c.grad_output = is_last() ? at::Tensor() : grad_output;
    if (!c.root.defined()) throw LogicError("accel::pp: a backward with no loss");
    const at::Tensor input = c.input;
    at::Tensor input_grad;
    if (full) {
      weight_pass([&] { torch::autograd::backward({c.root}, grads(c)); });
      if (!is_first()) input_grad = input.grad();
      chunks_.erase(mb);
    } else if (!is_first()) {
      input_grad = torch::autograd::grad({c.root}, {input}, grads(c), /*retain_graph=*/true,
                                         /*create_graph=*/false, /*allow_unused=*/true)[0];
      c.input = at::Tensor();
    }
    // (an input the output does not depend on: its gradient is zeros, still sent)
    if (!is_first() && !input_grad.defined()) input_grad = at::zeros_like(input);
    return input_grad;
  }
  // W: the weights' gradients of a micro-batch whose I has run.
  void backward_weight_one_chunk(int mb) {
    Chunk& c = chunk(mb, "weight backward");
    std::vector<at::Tensor> params;  // (each tensor once: LibTorch lists a tied one under each of its names)
    for (const auto& p : detail::unique_tensors(module_->parameters()))
      if (p.requires_grad()) params.push_back(p);
    weight_pass([&] {
      if (!params.empty())
        torch::autograd::backward({c.root}, grads(c), /*retain_graph=*/false, /*create_graph=*/false, params);
    });
    chunks_.erase(mb);
  }
  // Divides the gradients by `factor` (the schedule's scale_grads: the
  // micro-batches' mean, not their sum): the parameters', or, after a step
  // that reduced into shards, the shards' (where the gradients are then).
  void scale_grads(double factor) {
    at::NoGradGuard no_grad;
    const bool in_shards = synced_ && dp_->sharded();
    for (auto& p : detail::unique_tensors(module_->parameters())) {  // (a tied tensor divided once)
      at::Tensor shard = in_shards ? dp_->shard_of(p) : at::Tensor();
      at::Tensor& holder = shard.defined() ? shard : p;
      if (holder.grad().defined()) holder.mutable_grad().div_(factor);
    }
  }
  // Drops every micro-batch kept (after a step, or a failed one).
  void clear() { chunks_.clear(); }
  // The micro-batches whose activations the stage holds now, and the most it
  // held at once in the last step (what a schedule costs in memory: GPipe all
  // m, 1F1B at most the stages from this one to the last).
  std::size_t microbatches_in_flight() const { return chunks_.size(); }
  std::size_t peak_microbatches_in_flight() const { return peak_; }

 private:
  // A backward that adds to the weights' gradients (B, or W): under data
  // parallelism the step's last one reduces them (if the caller's setting
  // syncs), the others accumulate locally.
  template <class Fn>
  void weight_pass(Fn&& fn) {
    if (!dp_) return fn();
    const bool reduce = ++weight_passes_ == step_microbatches_ && wants_sync_;
    dp_->set_requires_gradient_sync(reduce);
    if (dp_->sharded()) dp_->check_shards();
    dp_->prepare_for_backward();  // (nothing while sync is off)
    fn();
    dp_->finish();  // (the reduction, or, without sync, only the end of the units' pass)
    dp_->set_requires_gradient_sync(false);
    synced_ = synced_ || reduce;
  }

  struct Chunk {
    at::Tensor input, output, root, grad_output;
  };
  Chunk& fresh_chunk(int mb) {
    auto [it, added] = chunks_.try_emplace(mb);
    if (!added)
      throw LogicError("accel::pp: stage " + std::to_string(stage_index_) + " runs micro-batch " + std::to_string(mb) +
                       "'s forward twice");
    return it->second;
  }
  Chunk& chunk(int mb, const char* what) {
    const auto it = chunks_.find(mb);
    if (it == chunks_.end())
      throw LogicError("accel::pp: stage " + std::to_string(stage_index_) + " runs micro-batch " + std::to_string(mb) +
                       "'s " + what + " before its forward");
    return it->second;
  }
  std::vector<at::Tensor> grads(const Chunk& c) const {
    return c.grad_output.defined() ? std::vector<at::Tensor>{c.grad_output} : std::vector<at::Tensor>{};
  }

  std::shared_ptr<torch::nn::Module> module_;
  Forward forward_;
  int stage_index_, num_stages_;
  c10::Device device_;
  GroupPtr group_;
  std::map<int, Chunk> chunks_;
  std::size_t peak_ = 0;
  DataParallel* dp_ = nullptr;
  // This step's: its micro-batches, the weight backwards run, whether the
  // gradients were reduced; the caller's gradient sync setting.
  int step_microbatches_ = 0, weight_passes_ = 0;
  bool synced_ = false, wants_sync_ = true;
};
}  // namespace pp

ACCEL_NAMESPACE_END

// == accel/training/pp/runtime.hpp ============================================
// accel/training/pp/runtime.hpp: one pipeline step on this rank: its lowered list of actions run in order, the stages' forwards and backwards between the messages.
//
// A schedule (training/pp/schedules.hpp) gives each rank its list: the
// compute-only order lowered with its sends and receives
// (core/pipeline_lowering.hpp), torch's _PipelineScheduleRuntime's input.
// Run in order, a receive is posted when listed and waited for by the
// computation that needs it; a send is issued when listed and waited for at
// the step's end (torch's runtime waits for its sends later too), so a rank
// never waits on a send while its peer waits on it. Adjacent stages on this
// rank (ZBV's V) hand their tensors over directly. The last stage computes
// each micro-batch's loss right after its forward, keeps it for the
// backward, and the step returns the losses and the outputs.

ACCEL_NAMESPACE_BEGIN

namespace pp {
// A schedule's loss: the last stage's output of a micro-batch and that
// micro-batch's target, to a scalar.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
}  // namespace pp

namespace detail::pp {
// What a step runs on this rank.
struct RankPlan {
  std::map<int, accel::pp::PipelineStage*> stages;  // this rank's, by stage index
  std::vector<Action> actions;                      // its lowered list
  std::function<int(int)> rank_of;                  // the rank holding a stage
  int rank = 0, num_stages = 1;
};
struct StepResult {
  std::vector<at::Tensor> outputs, losses;  // the last stage's, per micro-batch (else empty)
  double compute_seconds = 0;               // in F, B, I and W (the rest of the step: waiting, messages)
};

class StepRun {
 public:
  StepRun(const RankPlan& plan, std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets,
          const accel::pp::LossFn& loss_fn, int microbatches)
      : plan_(plan), inputs_(std::move(inputs)), targets_(std::move(targets)), loss_fn_(loss_fn) {
    result_.outputs.resize(static_cast<std::size_t>(microbatches));
    result_.losses.resize(static_cast<std::size_t>(microbatches));
    auto* any = plan.stages.begin()->second;
    if (any->group()) mailbox_.emplace(*any->group(), any->device(), plan.num_stages);
  }

  StepResult run() {
    for (const Action& a : plan_.actions) {
      const int s = a.stage_index, mb = a.microbatch_index.value_or(0);
      switch (a.computation_type) {
        case ComputationType::FORWARD: forward(s, mb); break;
        case ComputationType::FULL_BACKWARD: backward(s, mb, true); break;
        case ComputationType::BACKWARD_INPUT: backward(s, mb, false); break;
        case ComputationType::BACKWARD_WEIGHT: timed([&] { stage(s).backward_weight_one_chunk(mb); }); break;
        case ComputationType::SEND_F: send_activation(s, mb); break;
        case ComputationType::RECV_F: receive_activation(s, mb); break;
        case ComputationType::SEND_B:
          box().send(Message::gradient, take(sent_grads_, s, mb), plan_.rank_of(s - 1), s - 1, mb);
          break;
        case ComputationType::RECV_B: box().receive_gradient(s, mb, plan_.rank_of(s + 1), output_meta_.at(s)); break;
        default: throw LogicError("accel::pp: the runtime has no action " + to_string(a));
      }
    }
    if (mailbox_) mailbox_->finish();
    return std::move(result_);
  }

 private:
  // A stage's computation, its time counted (not the waits for its messages, before it).
  template <class Fn>
  auto timed(Fn&& fn) -> decltype(fn()) {
    struct Count {
      double& total;
      std::chrono::steady_clock::time_point began = std::chrono::steady_clock::now();
      ~Count() { total += std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(); }
    } count{result_.compute_seconds};
    return fn();
  }
  accel::pp::PipelineStage& stage(int s) { return *plan_.stages.at(s); }
  bool here(int s) const { return plan_.stages.contains(s); }
  Mailbox& box() { return *mailbox_; }
  static at::Tensor take(std::map<std::pair<int, int>, at::Tensor>& kept, int s, int mb) {
    auto node = kept.extract({s, mb});
    if (node.empty())
      throw LogicError("accel::pp: stage " + std::to_string(s) + " has nothing for micro-batch " + std::to_string(mb));
    return std::move(node.mapped());
  }

  void forward(int s, int mb) {
    accel::pp::PipelineStage& st = stage(s);
    const at::Tensor input = st.is_first() ? inputs_.at(static_cast<std::size_t>(mb))
                             : here(s - 1) ? take(handed_inputs_, s, mb)
                                           : box().take(Message::activation, s, mb);
    const at::Tensor output = timed([&] { return st.forward_one_chunk(mb, input); });
    if (st.is_last()) {
      result_.outputs[static_cast<std::size_t>(mb)] = output.detach();
      const at::Tensor loss = timed([&] { return loss_fn_(output, targets_.at(static_cast<std::size_t>(mb))); });
      if (!loss.defined() || loss.numel() != 1)
        throw InvalidArgument("accel::pp: loss_fn returned " +
                              (loss.defined() ? to_string(meta_of(loss)) : std::string("no tensor")) +
                              " for micro-batch " + std::to_string(mb) + "; a loss is one number");
      result_.losses[static_cast<std::size_t>(mb)] = loss;
      return;
    }
    check_output_shape(s, mb, output);
    if (here(s + 1)) handed_inputs_[{s + 1, mb}] = output.detach();
    else sent_outputs_[{s, mb}] = output.detach();
  }
  // Every output of a stage in a step has the shape of its first: the next
  // stage receives them into buffers of that shape.
  void check_output_shape(int s, int mb, const at::Tensor& output) {
    const TensorMeta meta = meta_of(output);
    const auto [it, first] = output_meta_.try_emplace(s, meta);
    if (!first && it->second != meta)
      throw InvalidArgument("accel::pp: stage " + std::to_string(s) + "'s output for micro-batch " +
                            std::to_string(mb) + " is " + to_string(meta) + ", its first this step " +
                            to_string(it->second) + ": every micro-batch of a step must give one shape");
  }
  void send_activation(int s, int mb) {
    const int to = plan_.rank_of(s + 1);
    if (headers_sent_.insert(s).second)
      box().send(Message::header, header_of(output_meta_.at(s), stage(s).device()), to, s + 1, 0);
    box().send(Message::activation, take(sent_outputs_, s, mb), to, s + 1, mb);
  }
  void receive_activation(int s, int mb) {
    if (headers_listed_.insert(s).second) box().receive_header(s, plan_.rank_of(s - 1));
    box().receive_activation(s, mb, plan_.rank_of(s - 1));
  }
  void backward(int s, int mb, bool full) {
    accel::pp::PipelineStage& st = stage(s);
    const at::Tensor grad_output = st.is_last()  ? at::Tensor()
                                   : here(s + 1) ? take(handed_grads_, s, mb)
                                                 : box().take(Message::gradient, s, mb);
    const at::Tensor loss = st.is_last() ? result_.losses[static_cast<std::size_t>(mb)] : at::Tensor();
    const at::Tensor input_grad = timed([&] { return st.backward_one_chunk(mb, loss, grad_output, full); });
    if (st.is_first()) return;
    (here(s - 1) ? handed_grads_[{s - 1, mb}] : sent_grads_[{s, mb}]) = input_grad;
  }

  const RankPlan& plan_;
  std::vector<at::Tensor> inputs_, targets_;
  const accel::pp::LossFn& loss_fn_;
  std::optional<Mailbox> mailbox_;  // (none without a group: every stage here)
  StepResult result_;
  std::map<int, TensorMeta> output_meta_;  // each stage's outputs' shape this step
  std::set<int> headers_sent_, headers_listed_;
  // Activations and gradients between a computation and its send, or handed
  // to the adjacent stage on this rank; by (stage, micro-batch).
  std::map<std::pair<int, int>, at::Tensor> sent_outputs_, sent_grads_, handed_inputs_, handed_grads_;
};
}  // namespace detail::pp

ACCEL_NAMESPACE_END

// == accel/training/pp/schedules.hpp ==========================================
// accel/training/pp/schedules.hpp: torch.distributed.pipelining's schedules (ScheduleGPipe, Schedule1F1B, ScheduleLoopedBFS, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble): step() over this rank's stages, and the order as torch's CSV.
//
// Each rank of the pipeline group makes the same schedule over its own
// stages (one for GPipe and 1F1B, several for the others) and calls step()
// with the whole batch: the first stage's rank passes the inputs, the last
// stage's the target (and gets the merged output and, through `losses`,
// each micro-batch's loss); a rank with neither passes nothing. The batch
// is cut into n_microbatches along dimension 0; every stage runs each
// micro-batch's forward and backward in the schedule's order, the
// gradients adding up in the parameters' .grad over the micro-batches and,
// with scale_grads (torch's default), divided by their number at the end:
// the gradient of the micro-batches' mean loss, what one process gets for
// the whole batch with a loss that averages over it.
//
// The order is made once, from the arguments alone (core/pipeline_orders.hpp),
// checked (core/pipeline_rules.hpp) and lowered with its messages
// (core/pipeline_lowering.hpp); load_csv replaces it with a user's, in
// torch's compute-only CSV, checked by the same rules; dump_csv writes it.

ACCEL_NAMESPACE_BEGIN

namespace pp {
// What every schedule shares (torch's _PipelineSchedule).
class PipelineSchedule {
 public:
  virtual ~PipelineSchedule() = default;
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  // One step: every micro-batch's forward and backward. `inputs` on the
  // first stage's rank, `target` on the last's; returns the last stage's
  // outputs merged along dimension 0 there (undefined elsewhere) and fills
  // `losses` (when given) with each micro-batch's loss, detached.
  at::Tensor step(const at::Tensor& inputs = {}, const at::Tensor& target = {},
                  std::vector<at::Tensor>* losses = nullptr) {
    std::vector<at::Tensor> input_mbs, target_mbs;
    if (plan_.stages.contains(0)) input_mbs = detail::pp::split_microbatches(inputs, n_microbatches_, "inputs");
    if (plan_.stages.contains(plan_.num_stages - 1))
      target_mbs = detail::pp::split_microbatches(target, n_microbatches_, "target");
    for (auto& [index, stage] : plan_.stages) stage->begin_step(n_microbatches_);
    detail::pp::StepResult result;
    try {
      result = detail::pp::StepRun(plan_, std::move(input_mbs), std::move(target_mbs), loss_fn_, n_microbatches_).run();
    } catch (...) {
      for (auto& [index, stage] : plan_.stages) {
        stage->clear();
        stage->end_step();
      }
      throw;
    }
    for (auto& [index, stage] : plan_.stages) stage->end_step();
    compute_seconds_ = result.compute_seconds;
    if (scale_grads_)
      for (auto& [index, stage] : plan_.stages) stage->scale_grads(n_microbatches_);
    if (!plan_.stages.contains(plan_.num_stages - 1)) return {};
    if (losses) {
      losses->clear();
      for (const auto& loss : result.losses) losses->push_back(loss.detach());
    }
    return at::cat(result.outputs, 0);
  }

  int n_microbatches() const { return n_microbatches_; }
  // The time this rank spent in its stages' forwards, backwards and losses
  // in the last step; the rest of the step it waited (the bubble) or moved
  // messages.
  double compute_seconds() const { return compute_seconds_; }
  // The compute-only order, a row per rank (torch's pipeline_order).
  const detail::pp::PipelineOrder& pipeline_order() const { return order_; }
  // torch's _dump_csv(format="compute_only") and _load_csv: the order as a
  // CSV row per rank; a loaded one must keep the rules for this schedule's
  // stages and micro-batches (every rank loads the same file).
  void dump_csv(const std::string& path) const {
    std::ofstream out(path, std::ios::binary);
    detail::pp::write_csv(out, order_);
    if (!out.flush()) throw RuntimeError("accel::pp::" + name_ + "::dump_csv: cannot write " + path);
  }
  void load_csv(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw InvalidArgument("accel::pp::" + name_ + "::load_csv: cannot read " + path);
    set_order(detail::pp::read_csv(in), path);
  }

 protected:
  PipelineSchedule(std::string name, std::vector<PipelineStage*> stages, int n_microbatches, LossFn loss_fn,
                   bool scale_grads, detail::pp::StageStyle style)
      : name_(std::move(name)),
        n_microbatches_(n_microbatches),
        loss_fn_(std::move(loss_fn)),
        scale_grads_(scale_grads),
        style_(style) {
    const std::string who = "accel::pp::" + name_ + ": ";
    if (stages.empty()) throw InvalidArgument(who + "no stage");
    const PipelineStage& first = *stages.front();
    ranks_ = first.group() ? first.group()->getSize() : 1;
    plan_.rank = first.group() ? first.group()->getRank() : 0;
    plan_.num_stages = first.num_stages();
    stages_per_rank_ = static_cast<int>(stages.size());
    if (n_microbatches < 1)
      throw InvalidArgument(who + "n_microbatches " + std::to_string(n_microbatches) + " (at least 1)");
    for (PipelineStage* s : stages)
      if (s->num_stages() != plan_.num_stages || s->group() != first.group() || s->device() != first.device())
        throw InvalidArgument(who + "stages " + std::to_string(first.stage_index()) + " and " +
                              std::to_string(s->stage_index()) +
                              " differ in num_stages, group or device; a rank's stages share all three");
    if (plan_.num_stages != ranks_ * stages_per_rank_)
      throw InvalidArgument(who + std::to_string(plan_.num_stages) + " stages over a pipeline group of " +
                            std::to_string(ranks_) + " ranks with " + std::to_string(stages_per_rank_) +
                            " stage(s) on each: num_stages must be " + std::to_string(ranks_ * stages_per_rank_));
    for (PipelineStage* s : stages) {
      const int holder = detail::pp::stage_rank(s->stage_index(), ranks_, style_);
      if (holder != plan_.rank)
        throw InvalidArgument(who + "stage " + std::to_string(s->stage_index()) + " belongs on rank " +
                              std::to_string(holder) + " of the pipeline group (" +
                              (style_ == detail::pp::StageStyle::v ? "a V" : "a loop") + " of " +
                              std::to_string(plan_.num_stages) + " stages over " + std::to_string(ranks_) +
                              " ranks), not on rank " + std::to_string(plan_.rank));
      if (!plan_.stages.emplace(s->stage_index(), s).second)
        throw InvalidArgument(who + "stage " + std::to_string(s->stage_index()) + " given twice");
    }
    if (plan_.stages.contains(plan_.num_stages - 1) && !loss_fn_)
      throw InvalidArgument(who +
                            "this rank holds the last stage and no loss_fn was given (step() trains: "
                            "its backward starts from each micro-batch's loss)");
    plan_.rank_of = [ranks = ranks_, style](int stage) { return detail::pp::stage_rank(stage, ranks, style); };
  }
  // The order made, checked and lowered (`source`: where it came from, for errors).
  void set_order(detail::pp::PipelineOrder order, const std::string& source = {}) {
    const std::string who = "accel::pp::" + name_ + ": ";
    if (static_cast<int>(order.size()) != ranks_)
      throw InvalidArgument(who + "the order " + (source.empty() ? "" : "in " + source + " ") + "has " +
                            std::to_string(order.size()) + " rows; the pipeline group has " + std::to_string(ranks_) +
                            " ranks (a row per rank)");
    if (auto error = detail::pp::order_error(order, stages_per_rank_, n_microbatches_, style_))
      throw InvalidArgument(who + "the order " + (source.empty() ? "" : "in " + source + " ") +
                            "breaks a rule: " + *error);
    plan_.actions = detail::pp::add_send_recv(order, stages_per_rank_, style_)[static_cast<std::size_t>(plan_.rank)];
    order_ = std::move(order);
  }
  static std::vector<PipelineStage*> pointers(const std::vector<std::reference_wrapper<PipelineStage>>& stages) {
    std::vector<PipelineStage*> out;
    for (auto& s : stages) out.push_back(&s.get());
    return out;
  }
  int ranks() const { return ranks_; }
  int stages_per_rank() const { return stages_per_rank_; }

 private:
  std::string name_;
  int n_microbatches_;
  LossFn loss_fn_;
  bool scale_grads_;
  detail::pp::StageStyle style_;
  int ranks_ = 1, stages_per_rank_ = 1;
  detail::pp::RankPlan plan_;
  detail::pp::PipelineOrder order_;
  double compute_seconds_ = 0;
};

// One stage per rank (torch's PipelineScheduleSingle family).
class ScheduleGPipe : public PipelineSchedule {
 public:
  ScheduleGPipe(PipelineStage& stage, int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleGPipe", {&stage}, n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::gpipe_order(ranks(), n_microbatches));
  }
};
class Schedule1F1B : public PipelineSchedule {
 public:
  Schedule1F1B(PipelineStage& stage, int n_microbatches, LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("Schedule1F1B", {&stage}, n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::one_f_one_b_order(ranks(), n_microbatches));
  }
};

// Several stages per rank, in a loop (torch's PipelineScheduleMulti family).
class ScheduleLoopedBFS : public PipelineSchedule {
 public:
  ScheduleLoopedBFS(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches, LossFn loss_fn = {},
                    bool scale_grads = true)
      : PipelineSchedule("ScheduleLoopedBFS", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::looped_bfs_order(ranks(), stages_per_rank(), n_microbatches));
  }
};
class ScheduleInterleaved1F1B : public PipelineSchedule {
 public:
  ScheduleInterleaved1F1B(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches,
                          LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleInterleaved1F1B", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::loop) {
    set_order(detail::pp::interleaved_1f1b_order(ranks(), stages_per_rank(), n_microbatches));
  }
};
class ScheduleInterleavedZeroBubble : public PipelineSchedule {
 public:
  ScheduleInterleavedZeroBubble(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches,
                                LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleInterleavedZeroBubble", pointers(stages), n_microbatches, std::move(loss_fn),
                         scale_grads, detail::pp::StageStyle::loop) {
    set_order(detail::pp::interleaved_zero_bubble_order(ranks(), stages_per_rank(), n_microbatches));
  }
};
// Two stages per rank in a V: rank r holds stages r and 2p - 1 - r.
class ScheduleZBVZeroBubble : public PipelineSchedule {
 public:
  ScheduleZBVZeroBubble(std::vector<std::reference_wrapper<PipelineStage>> stages, int n_microbatches,
                        LossFn loss_fn = {}, bool scale_grads = true)
      : PipelineSchedule("ScheduleZBVZeroBubble", pointers(stages), n_microbatches, std::move(loss_fn), scale_grads,
                         detail::pp::StageStyle::v) {
    if (stages_per_rank() != 2)
      throw InvalidArgument("accel::pp::ScheduleZBVZeroBubble: " + std::to_string(stages_per_rank()) +
                            " stages on this rank; ZBV runs two per rank (stages r and 2p - 1 - r)");
    set_order(detail::pp::zbv_zero_bubble_order(ranks(), n_microbatches));
  }
};
}  // namespace pp

ACCEL_NAMESPACE_END

// == accel/training/dp/unit_forward.hpp =======================================
// accel/training/dp/unit_forward.hpp: accel::unit_forward, the call that runs a FULL_SHARD unit with its parameters gathered and a styled module with its tensor-parallel style.

ACCEL_NAMESPACE_BEGIN

// The call that stands for a forward hook. LibTorch modules have none, so
// in a model's forward a module that FULL_SHARD makes a unit, or that a
// tensor-parallel plan styles (tp::parallelize_module), is called as
//     x = accel::unit_forward(fc1, x);        // instead of fc1->forward(x)
// which gathers the unit's parameters from their shards, runs its forward
// and frees them (see DataParallel), and applies the module's parallel
// style (tp/styled_forward.hpp): its input moved to the layout the style
// needs before the unit, the pieces computed inside it (FSDP + TP: a
// styled Linear may be a unit of its own). The same code runs under every
// strategy and plan: any other module is simply called. On a Sequential
// that is not a unit itself, each child is called in turn, through
// unit_forward. A unit's forward returns one tensor.
template <class ModuleHolder, class... Args>
  requires detail::module_holder<ModuleHolder>
auto unit_forward(ModuleHolder& unit, Args&&... args) {
  const torch::nn::Module* module = unit.ptr().get();
  return detail::tp::styled_forward(
      *unit.ptr(),
      [module](auto&& fn, auto&&... a) {
        return DataParallel::unit_call(module, std::forward<decltype(fn)>(fn), std::forward<decltype(a)>(a)...);
      },
      [&unit](auto&&... a) { return unit->forward(std::forward<decltype(a)>(a)...); }, std::forward<Args>(args)...);
}
inline at::Tensor unit_forward(torch::nn::Sequential& sequential, at::Tensor x) {
  if (DataParallel::is_unit(sequential.ptr().get()))
    return DataParallel::unit_call(
        sequential.ptr().get(), [&sequential](const at::Tensor& in) { return sequential->forward(in); }, x);
  for (auto& child : *sequential) {
    const torch::nn::Module* module = child.ptr().get();
    x = detail::tp::styled_forward(
        *child.ptr(), [module](auto&& fn, const at::Tensor& in) { return DataParallel::unit_call(module, fn, in); },
        [&child](const at::Tensor& in) { return child.forward(in); }, x);
  }
  return x;
}

ACCEL_NAMESPACE_END

// == accel/training/io/json.hpp ===============================================
// accel/training/io/json.hpp: JSON: a reader that checks everything it is given, and the quoting of a string.
//
// The JSON accel.hpp reads (a safetensors header, Hugging Face's
// model.safetensors.index.json) and writes (the trackers' metrics.jsonl and
// config.json, an index). LibTorch has no JSON reader or writer in its
// public headers, so these few lines are ours.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A JSON value: what the safetensors header and index hold.
struct Json {
  enum class Kind { Null, Bool, Number, String, Array, Object } kind = Kind::Null;
  std::string text;  // a string's value, a number's digits
  std::vector<Json> items;
  std::vector<std::string> keys;  // an object's, in order, with values[i] (not pairs:
  std::vector<Json> values;       // std::pair<std::string, Json> needs Json complete)
  const Json* find(std::string_view key) const {
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (keys[i] == key) return &values[i];
    return nullptr;
  }
};

class JsonReader {
 public:
  JsonReader(std::string_view text, std::string where) : text_(text), where_(std::move(where)) {}
  Json document() {
    Json value = parse(0);
    skip_space();
    if (i_ != text_.size()) fail("text after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw RuntimeError(where_ + ": bad JSON at byte " + std::to_string(i_) + ": " + what);
  }
  void skip_space() {
    while (i_ < text_.size() && (text_[i_] == ' ' || text_[i_] == '\n' || text_[i_] == '\r' || text_[i_] == '\t')) ++i_;
  }
  bool take(char c) {
    skip_space();
    if (i_ < text_.size() && text_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= text_.size()) fail("unterminated string");
      const char c = text_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= text_.size()) fail("unterminated escape");
      const char e = text_[i_++];
      switch (e) {
        case '"':
        case '\\':
        case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > text_.size()) fail("short \\u escape");
          unsigned code = 0;
          const auto [end, ec] = std::from_chars(text_.data() + i_, text_.data() + i_ + 4, code, 16);
          if (ec != std::errc() || end != text_.data() + i_ + 4) fail("bad \\u escape");
          i_ += 4;
          if (code >= 0xD800 && code < 0xE000) fail("a surrogate \\u escape (names are expected to be plain)");
          if (code < 0x80) out += static_cast<char>(code);  // UTF-8
          else if (code < 0x800)
            out += {static_cast<char>(0xC0 | (code >> 6)), static_cast<char>(0x80 | (code & 0x3F))};
          else
            out += {static_cast<char>(0xE0 | (code >> 12)), static_cast<char>(0x80 | ((code >> 6) & 0x3F)),
                    static_cast<char>(0x80 | (code & 0x3F))};
          break;
        }
        default: fail("bad escape");
      }
    }
  }
  Json parse(int depth) {
    if (depth > 32) fail("nested too deep");
    skip_space();
    if (i_ >= text_.size()) fail("unexpected end");
    Json v;
    const char c = text_[i_];
    if (c == '{') {
      ++i_;
      v.kind = Json::Kind::Object;
      if (take('}')) return v;
      do {
        skip_space();
        std::string key = string();
        expect(':');
        v.keys.push_back(std::move(key));
        v.values.push_back(parse(depth + 1));
      } while (take(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = Json::Kind::Array;
      if (take(']')) return v;
      do v.items.push_back(parse(depth + 1));
      while (take(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Json::Kind::String;
      v.text = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::Kind::Number;
      const std::size_t start = i_;
      while (i_ < text_.size() && std::strchr("+-0123456789.eE", text_[i_])) ++i_;
      v.text = std::string(text_.substr(start, i_ - start));
    } else {
      for (const auto& [word, kind] : {std::pair{"true", Json::Kind::Bool}, std::pair{"false", Json::Kind::Bool},
                                       std::pair{"null", Json::Kind::Null}})
        if (text_.substr(i_, std::strlen(word)) == word) {
          i_ += std::strlen(word);
          v.kind = kind;
          v.text = word;
          return v;
        }
      fail("unexpected character");
    }
    return v;
  }

  std::string_view text_;
  std::string where_;
  std::size_t i_ = 0;
};

inline std::string json_quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') out += {'\\', c};
    else if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += escape;
    } else out += c;
  }
  return out + "\"";
}

inline int64_t json_uint(const Json& v, const std::string& what) {
  int64_t value = -1;
  if (v.kind == Json::Kind::Number) {
    const auto [end, ec] = std::from_chars(v.text.data(), v.text.data() + v.text.size(), value);
    if (ec != std::errc() || end != v.text.data() + v.text.size()) value = -1;
  }
  if (value < 0) throw RuntimeError(what + " is not a non-negative integer");
  return value;
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/io/file_digest.hpp ========================================
// accel/training/io/file_digest.hpp: XXH64 and a file's digest (size and hash), by which a checkpoint knows its own files.
//
// A checkpoint lists every file it wrote with its size and XXH64 hash
// (checkpoint/files.hpp), and a load checks each file it reads against that
// list: a flipped bit, a file cut short, or a file of another run put in
// its place is refused, naming the file, before anything is loaded.
// LibTorch's own archives carry zip CRC32s, but LibTorch reads them without
// checking (its miniz is built without the reader's CRC checks), and
// safetensors has none. XXH64 (Yann Collet's, the hash of xxHash's
// XXH64 and Python's xxhash.xxh64) runs at memory speed on one core in
// portable C++; the test vectors in the tests are xxhash's own.

#include <fcntl.h>

#include <semaphore>
#include <thread>

ACCEL_NAMESPACE_BEGIN

namespace detail {
// XXH64 with seed 0, fed in pieces of any size.
class Xxh64 {
 public:
  void update(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += n;
    if (held_ + n < kStripe) {
      if (n) std::memcpy(buffer_ + held_, p, n);
      held_ += n;
      return;
    }
    if (held_) {
      const std::size_t fill = kStripe - held_;
      std::memcpy(buffer_ + held_, p, fill);
      consume(buffer_);
      p += fill;
      n -= fill;
      held_ = 0;
    }
    // The lanes in locals: the input (bytes, which may alias anything) would
    // otherwise make the compiler store and reload them every stripe (a
    // third of the speed).
    uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
    for (; n >= kStripe; p += kStripe, n -= kStripe) {
      v0 = round(v0, read64(p));
      v1 = round(v1, read64(p + 8));
      v2 = round(v2, read64(p + 16));
      v3 = round(v3, read64(p + 24));
    }
    v_[0] = v0, v_[1] = v1, v_[2] = v2, v_[3] = v3;
    if (n) std::memcpy(buffer_, p, n);
    held_ = n;
  }
  uint64_t digest() const noexcept {
    uint64_t h = total_ >= kStripe
                     ? std::rotl(v_[0], 1) + std::rotl(v_[1], 7) + std::rotl(v_[2], 12) + std::rotl(v_[3], 18)
                     : kP5;  // (seed 0)
    if (total_ >= kStripe)
      for (const uint64_t v : v_) h = (h ^ round(0, v)) * kP1 + kP4;
    h += total_;
    const unsigned char* p = buffer_;
    std::size_t n = held_;
    for (; n >= 8; p += 8, n -= 8) h = std::rotl(h ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (n >= 4) {
      h = std::rotl(h ^ (read32(p) * kP1), 23) * kP2 + kP3;
      p += 4;
      n -= 4;
    }
    for (; n > 0; ++p, --n) h = std::rotl(h ^ (*p * kP5), 11) * kP1;
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    return h ^ (h >> 32);
  }

 private:
  static constexpr uint64_t kP1 = 11400714785074694791ull, kP2 = 14029467366897019727ull, kP3 = 1609587929392839161ull,
                            kP4 = 9650029242287828579ull, kP5 = 2870177450012600261ull;
  static constexpr std::size_t kStripe = 32;
  static uint64_t round(uint64_t acc, uint64_t input) noexcept { return std::rotl(acc + input * kP2, 31) * kP1; }
  // (little-endian, as XXH64 reads; so is every host LibTorch runs on: io/safetensors.hpp asserts it)
  static uint64_t read64(const unsigned char* p) noexcept {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static uint64_t read32(const unsigned char* p) noexcept {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  void consume(const unsigned char* p) noexcept {
    for (int lane = 0; lane < 4; ++lane) v_[lane] = round(v_[lane], read64(p + 8 * lane));
  }

  uint64_t v_[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  unsigned char buffer_[kStripe] = {};
  std::size_t held_ = 0;
  uint64_t total_ = 0;
};

// An Xxh64 fed on a thread of its own, beside the caller's work on the
// same bytes (a write(2) into the page cache takes about as long as
// hashing them: on a machine with a core to spare the digest costs
// nothing): start(p, n) begins on a piece, wait() returns once it is
// hashed, and only then may the caller reuse the piece or start another.
// The thread is made on the first start(); if it cannot be, start() hashes
// on the caller's thread.
class HashBeside {
 public:
  explicit HashBeside(Xxh64& hash) : hash_(hash) {}
  HashBeside(const HashBeside&) = delete;
  HashBeside& operator=(const HashBeside&) = delete;
  ~HashBeside() {
    if (!thread_.joinable()) return;
    piece_ = nullptr;  // (stop)
    go_.release();
    thread_.join();
  }
  void start(const void* data, std::size_t n) noexcept {
    piece_ = data;
    size_ = n;
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { run(); });
      } catch (...) {
        hash_.update(data, n);
        done_.release();
        return;
      }
    }
    go_.release();
  }
  void wait() noexcept { done_.acquire(); }

 private:
  void run() noexcept {
    for (;;) {
      go_.acquire();
      if (!piece_) return;
      hash_.update(piece_, size_);
      done_.release();
    }
  }

  Xxh64& hash_;
  const void* piece_ = nullptr;
  std::size_t size_ = 0;
  std::binary_semaphore go_{0}, done_{0};
  std::thread thread_;
};

inline uint64_t xxh64(const void* data, std::size_t n) {
  Xxh64 h;
  h.update(data, n);
  return h.digest();
}

// Whether files are hashed as they are written and checked as a checkpoint
// is read: always, but for the sharding benchmark, which turns it off for
// its baseline, to measure what the digests cost beside the I/O, side by
// side in one run (tests/bench/bench_sharding.cpp, mode checkpoint).
inline bool& file_digests_on() {
  static bool on = true;
  return on;
}

// What a checkpoint records of each file: its size and its bytes' XXH64.
struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
  bool operator==(const FileDigest&) const = default;
};
// The hash as 16 hexadecimal digits (how the manifest writes it); and back
// (none: not 16 of them).
inline std::string hex64(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}
inline std::optional<uint64_t> from_hex64(const std::string& text) {
  if (text.size() != 16 || !std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isxdigit(c); }))
    return std::nullopt;
  return std::stoull(text, nullptr, 16);
}

// A file's digest, read in pieces of 1 MiB through read(2); an error names
// the file and the cause.
inline FileDigest digest_of_file(const std::filesystem::path& path) {
  constexpr std::size_t kPiece = std::size_t{1} << 20;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw RuntimeError("accel: cannot open " + path.string() + ": " + std::strerror(errno));
  std::unique_ptr<char[]> buffer(new char[kPiece]);
  Xxh64 hash;
  FileDigest digest;
  for (;;) {
    const ssize_t got = ::read(fd, buffer.get(), kPiece);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      throw RuntimeError("accel: cannot read " + path.string() + ": " + std::strerror(error));
    }
    if (got == 0) break;
    hash.update(buffer.get(), static_cast<std::size_t>(got));
    digest.bytes += static_cast<uint64_t>(got);
  }
  ::close(fd);
  digest.xxh64 = hash.digest();
  return digest;
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/io/checked_file.hpp =======================================
// accel/training/io/checked_file.hpp: files written with every error checked: CheckedFile, atomic writes, archives.
//
// Checkpoints and weights are written here, never through std::ofstream or
// LibTorch's OutputArchive::save_to(path): a stream says only that it failed,
// not why (a full disk, a quota, an I/O error), and LibTorch's archive
// writer, when a write fails, throws from its destructor, which ends the
// process with std::terminate (pytorch#156955). Here the first error is kept
// with its errno, nothing is thrown while LibTorch's writer runs, and the
// caller gets an accel::RuntimeError naming the file and the cause; a file
// that could not be written whole is removed.

ACCEL_NAMESPACE_BEGIN

namespace detail {
[[noreturn]] inline void throw_errno(const std::string& what, const std::filesystem::path& path, int error = errno) {
  throw RuntimeError("accel: " + what + " " + path.string() + ": " + std::strerror(error));
}

// open + fsync + close: a file's bytes, or a directory's entries, on disk.
inline void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("cannot open", path);
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) throw_errno("cannot fsync", path, error);
}

inline std::filesystem::path sibling(const std::filesystem::path& dir, const char* suffix) {
  return dir.string() + suffix;
}

// A new file (created or truncated) written through write(2). write() never
// throws: it keeps the first error and drops what follows, so that it can
// serve LibTorch's archive writer. finish() puts the bytes on disk (fsync)
// and throws that first error, naming the file; a CheckedFile not finished,
// or whose finish() failed, removes its file. The bytes are hashed as they
// go (XXH64, a large piece on a thread of its own beside its write(2):
// HashBeside), and finish() returns the file's digest for a checkpoint's
// manifest.
class CheckedFile {
 public:
  explicit CheckedFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw_errno("cannot create", path_);
  }
  CheckedFile(const CheckedFile&) = delete;
  CheckedFile& operator=(const CheckedFile&) = delete;
  ~CheckedFile() {
    if (fd_ < 0) return;
    ::close(fd_);
    ::unlink(path_.c_str());
  }

  void write(const void* data, std::size_t n) noexcept {
    if (n >= kBuffer) {  // large (a tensor's bytes): straight to the file
      flush();
      put(data, n);
      return;
    }
    if (buffer_.size() + n > kBuffer) flush();
    buffer_.append(static_cast<const char*>(data), n);
  }
  void write(std::string_view text) noexcept { write(text.data(), text.size()); }

  FileDigest finish() {
    flush();
    if (error_ == 0 && ::fsync(fd_) != 0) error_ = errno;
    if (::close(fd_) != 0 && error_ == 0) error_ = errno;
    fd_ = -1;
    if (error_ != 0) {
      ::unlink(path_.c_str());
      throw_errno("cannot write", path_, error_);
    }
    return {bytes_, hash_.digest()};
  }

 private:
  // LibTorch's archive writer hands over many small pieces (zip headers, names):
  // gathered here into writes of up to kBuffer bytes.
  static constexpr std::size_t kBuffer = std::size_t{1} << 20;
  // From this size a piece is hashed on another thread (below it, the handover costs more than it saves).
  static constexpr std::size_t kBeside = std::size_t{256} << 10;

  void flush() noexcept {
    put(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void put(const void* data, std::size_t n) noexcept {
    // A large piece is hashed beside its write(2), a small one before it.
    const bool beside = file_digests_on() && n >= kBeside;
    if (beside) beside_.start(data, n);
    else if (file_digests_on()) hash_.update(data, n);
    write_out(data, n);
    if (beside) beside_.wait();
  }
  void write_out(const void* data, std::size_t n) noexcept {
    bytes_ += n;
    const char* p = static_cast<const char*>(data);
    while (n > 0 && error_ == 0) {
      const ssize_t wrote = ::write(fd_, p, n);
      if (wrote < 0) {
        if (errno != EINTR) error_ = errno;
        continue;
      }
      p += wrote;
      n -= static_cast<std::size_t>(wrote);
    }
  }

  std::filesystem::path path_;
  int fd_ = -1;
  int error_ = 0;
  std::string buffer_;
  Xxh64 hash_;
  HashBeside beside_{hash_};
  uint64_t bytes_ = 0;
};

// A whole file's bytes written to `path` through a temporary name and a
// rename: a reader finds the old file or the whole new one. On an error the
// temporary file is removed and the old file stays. Returns its digest.
inline FileDigest write_file_atomically(const std::filesystem::path& path,
                                        const std::function<void(CheckedFile&)>& body) {
  const std::filesystem::path tmp = sibling(path, ".tmp");
  FileDigest digest;
  {
    CheckedFile out(tmp);
    body(out);
    digest = out.finish();
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    throw_errno("cannot rename " + tmp.string() + " to", path, error);
  }
  return digest;
}

// One archive written and flushed to disk. The writer returns every size as
// written, whatever happened: a short count would make LibTorch's writer
// throw from its destructor (pytorch#156955); finish() reports the error.
inline FileDigest save_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path) {
  CheckedFile out(path);
  archive.save_to([&](const void* data, std::size_t n) -> std::size_t {
    out.write(data, n);
    return n;
  });
  return out.finish();
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/io/safetensors.hpp ========================================
// accel/training/io/safetensors.hpp: safetensors: Hugging Face's weight format, written and read.
//
// Hugging Face's weight format (huggingface.co/docs/safetensors), so that
// weights trained here load in Python and the reverse: an 8-byte
// little-endian header length, a JSON header {"__metadata__": {...},
// "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// ...} padded with spaces to a multiple of 8, then the tensors' bytes,
// little-endian and row-major, offsets counted from the end of the header.
// LibTorch reads and writes neither the format nor JSON in its public
// headers, so the few lines here are ours: a writer, and a reader
// (its JSON header through io/json.hpp), which checks everything it is given.

ACCEL_NAMESPACE_BEGIN

namespace detail {
namespace fs = std::filesystem;

inline constexpr std::array<std::pair<at::ScalarType, std::string_view>, 10> safetensors_dtypes{{
    {at::kDouble, "F64"},
    {at::kFloat, "F32"},
    {at::kHalf, "F16"},
    {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},
    {at::kInt, "I32"},
    {at::kShort, "I16"},
    {at::kChar, "I8"},
    {at::kByte, "U8"},
    {at::kBool, "BOOL"},
}};

// The header of a safetensors file of `tensors` (from their names, dtypes
// and shapes alone), with `metadata`'s (key, text) pairs in its
// "__metadata__" beside "format", padded with spaces to a multiple of 8.
inline std::string safetensors_header(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                      const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string header = R"({"__metadata__":{"format":"pt")";
  for (const auto& [key, text] : metadata) {  // (appended piece by piece: GCC 12's -Wrestrict misfires on "," + ...)
    header += ',';
    header += json_quote(key);
    header += ':';
    header += json_quote(text);
  }
  header += "}";
  uint64_t offset = 0;
  for (const auto& named : tensors) {  // (not a structured binding: clang 14 cannot capture one)
    const std::string& name = named.first;
    const at::Tensor& tensor = named.second;
    const auto dtype = std::find_if(safetensors_dtypes.begin(), safetensors_dtypes.end(),
                                    [&](const auto& d) { return d.first == tensor.scalar_type(); });
    if (dtype == safetensors_dtypes.end())
      throw InvalidArgument("accel: safetensors has no dtype for " + name + " (" + c10::toString(tensor.scalar_type()) +
                            ")");
    std::string shape;
    for (const int64_t d : tensor.sizes()) {
      if (!shape.empty()) shape += ',';  // (not "" or "," + to_string(d): GCC 12's -Wrestrict misfires on it)
      shape += std::to_string(d);
    }
    const uint64_t bytes = tensor.numel() * tensor.element_size();
    header += ',';  // (then the rest: GCC 12's -Wrestrict misfires on "," + ...)
    header += json_quote(name) + R"(:{"dtype":")" + std::string(dtype->second) + R"(","shape":[)" + shape +
              R"(],"data_offsets":[)" + std::to_string(offset) + ',' + std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  return header;
}

// One safetensors file of the named tensors (CPU copies, contiguous), with
// `metadata` as above. Where `values` is given, values(i) gives tensor i's
// values as the file reaches it, in order (an export that gathers them one
// at a time); `tensors` then only gives names, dtypes and shapes.
inline FileDigest write_safetensors(const fs::path& path,
                                    const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                    const std::vector<std::pair<std::string, std::string>>& metadata = {},
                                    const std::function<at::Tensor(std::size_t)>& values = {}) {
  static_assert(std::endian::native == std::endian::little,
                "safetensors is little-endian; so is every host LibTorch runs on");
  const std::string header = safetensors_header(tensors, metadata);
  return write_file_atomically(path, [&](CheckedFile& out) {
    const uint64_t length = header.size();
    out.write(&length, 8);
    out.write(header);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor t = (values ? values(i) : tensors[i].second).detach().to(at::kCPU).contiguous();
      TORCH_INTERNAL_ASSERT(
          t.sizes() == tensors[i].second.sizes() && t.scalar_type() == tensors[i].second.scalar_type(),
          "write_safetensors: values of ", tensors[i].first, " unlike its header's");
      out.write(t.data_ptr(), t.numel() * t.element_size());
    }
  });
}

// A safetensors file's header, checked: each tensor's dtype, shape and
// byte range (inside the file, matching the size, no two overlapping), and
// the "__metadata__" texts. `data_start`: where the tensors' bytes begin.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // bytes, from data_start
};
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, std::string> metadata;
  int64_t data_start = 0;
};
inline SafetensorsHeader read_safetensors_header(std::istream& in, const fs::path& path) {
  const std::string where = path.string();
  const uint64_t file_size = fs::file_size(path);
  uint64_t length = 0;
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(&length), 8))
    throw RuntimeError(where + " is not a safetensors file (shorter than its 8-byte header length)");
  if (length > file_size - 8 || length > (uint64_t{100} << 20))
    throw RuntimeError(where + " is not a safetensors file (a header of " + std::to_string(length) +
                       " bytes in a file of " + std::to_string(file_size) + ")");
  std::string text(length, '\0');
  in.read(text.data(), static_cast<std::streamsize>(length));
  const Json doc = JsonReader(text, where).document();
  if (doc.kind != Json::Kind::Object) throw RuntimeError(where + ": the header is not a JSON object");
  const uint64_t data_size = file_size - 8 - length;
  SafetensorsHeader header;
  header.data_start = static_cast<int64_t>(8 + length);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (std::size_t field = 0; field < doc.keys.size(); ++field) {
    const std::string& name = doc.keys[field];
    const Json& entry = doc.values[field];
    if (name == "__metadata__") {
      if (entry.kind != Json::Kind::Object) throw RuntimeError(where + ": __metadata__ is not a JSON object");
      for (std::size_t k = 0; k < entry.keys.size(); ++k) {
        if (entry.values[k].kind != Json::Kind::String)
          throw RuntimeError(where + ": __metadata__'s " + entry.keys[k] + " is not a string");
        header.metadata[entry.keys[k]] = entry.values[k].text;
      }
      continue;
    }
    const std::string what = where + ": tensor " + name;
    const Json* dtype = entry.find("dtype");
    const Json* shape = entry.find("shape");
    const Json* offsets = entry.find("data_offsets");
    if (!dtype || !shape || !offsets || dtype->kind != Json::Kind::String || shape->kind != Json::Kind::Array ||
        offsets->kind != Json::Kind::Array || offsets->items.size() != 2)
      throw RuntimeError(what + " lacks dtype, shape or data_offsets");
    const auto known = std::find_if(safetensors_dtypes.begin(), safetensors_dtypes.end(),
                                    [&](const auto& d) { return d.second == dtype->text; });
    if (known == safetensors_dtypes.end())
      throw RuntimeError(what + " has dtype " + dtype->text + ", which accel.hpp does not read");
    SafetensorsEntry e{.name = name, .dtype = known->first, .shape = {}};
    int64_t numel = 1;
    for (const Json& d : shape->items) {
      e.shape.push_back(json_uint(d, what + "'s shape"));
      numel *= e.shape.back();
    }
    e.begin = json_uint(offsets->items[0], what + "'s data_offsets");
    e.end = json_uint(offsets->items[1], what + "'s data_offsets");
    const auto bytes = static_cast<int64_t>(numel * c10::elementSize(e.dtype));
    if (e.end < e.begin || static_cast<uint64_t>(e.end) > data_size || e.end - e.begin != bytes)
      throw RuntimeError(what + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                         ") do not hold its " + std::to_string(bytes) + " bytes within the file's " +
                         std::to_string(data_size));
    ranges.emplace_back(e.begin, e.end);
    header.entries.push_back(std::move(e));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) throw RuntimeError(where + ": two tensors' data overlap");
  return header;
}

// The tensors a safetensors file holds, checked as above, read whole.
inline std::vector<std::pair<std::string, at::Tensor>> read_safetensors(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RuntimeError("missing " + path.string());
  const SafetensorsHeader header = read_safetensors_header(in, path);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const SafetensorsEntry& e : header.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    in.seekg(static_cast<std::streamoff>(header.data_start + e.begin));
    if (!in.read(static_cast<char*>(t.data_ptr()), e.end - e.begin))
      throw RuntimeError("cannot read " + path.string() + ": tensor " + e.name);
    out.emplace_back(e.name, std::move(t));
  }
  return out;
}

// What keeps a model's tensors (`expected`, state_dict's names, looked up
// as prefix + name) from fitting those a file holds (`held`: name -> dtype
// and shape, only names that are the model's to consider): "" when they
// fit, else " missing a, b. not in the model: c. w is Float[16, 4] there,
// Float[8, 4] in the model." (load_model and sharded checkpoints).
inline std::string misfit(const std::vector<std::pair<std::string, at::Tensor>>& expected,
                          const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>>& held,
                          const std::string& prefix = "") {
  std::string missing, wrong, unexpected;
  std::set<std::string> names;
  for (const auto& [unprefixed, tensor] : expected) {
    const std::string name = prefix + unprefixed;
    names.insert(name);
    const auto found = held.find(name);
    if (found == held.end()) missing += (missing.empty() ? "" : ", ") + name;
    else if (found->second.first != tensor.scalar_type() || found->second.second != tensor.sizes().vec())
      wrong += (wrong.empty() ? "" : "; ") + name + " is " + c10::toString(found->second.first) +
               c10::str(at::IntArrayRef(found->second.second)) + " there, " + c10::toString(tensor.scalar_type()) +
               c10::str(tensor.sizes()) + " in the model";
  }
  for (const auto& entry : held)
    if (!names.count(entry.first)) unexpected += (unexpected.empty() ? "" : ", ") + entry.first;
  return (missing.empty() ? "" : " missing " + missing + ".") +
         (unexpected.empty() ? "" : " not in the model: " + unexpected + ".") +
         (wrong.empty() ? "" : " " + wrong + ".");
}

// A model's state_dict as Python makes it: dotted names, in its order (each
// module's parameters, then its buffers, then its children's).
inline std::vector<std::pair<std::string, at::Tensor>> state_dict(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& m : module.named_modules()) {
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) out.emplace_back(prefix + p.key(), p.value());
    for (const auto& b : m.value()->named_buffers(/*recurse=*/false)) out.emplace_back(prefix + b.key(), b.value());
  }
  return out;
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/file_names.hpp =================================
// accel/training/checkpoint/file_names.hpp: the name of every file save_state and save_model write, in one place.
//
// A checkpoint directory (save_state) holds model.pt, model_1.pt, ... (a
// sharded model: each process's pieces instead), optimizer.pt, ... (sharded:
// each process's optimizer_rank<r>.pt, ...), scheduler.pt, ..., random_states_<rank>.pt,
// loaders.pt, scaler.pt, custom_checkpoint_<i>.pt and last the manifest. A
// weights directory (save_model) holds model.safetensors, or Hugging Face's
// model-<k>-of-<n>.safetensors with model.safetensors.index.json. The names
// are Accelerate's and Hugging Face's where they have one, so that their
// tools find the files.

#include <cstdio>

ACCEL_NAMESPACE_BEGIN

namespace detail::file_names {
// The manifest: its presence marks a checkpoint complete (checkpoint/files.hpp).
inline constexpr const char* manifest = "accel_checkpoint.txt";
// stem.pt, stem_1.pt, ... for the i-th of its kind.
inline std::string numbered(const std::string& stem, std::size_t i) {
  return i == 0 ? stem + ".pt" : stem + "_" + std::to_string(i) + ".pt";
}
inline std::string model(std::size_t i) { return numbered("model", i); }
inline std::string scheduler(std::size_t i) { return numbered("scheduler", i); }
// Optimizer i's: optimizer.pt, optimizer_1.pt, ...; under sharding each
// process's own, optimizer_rank<r>.pt, optimizer_1_rank<r>.pt, ... (rank -1:
// the whole one).
inline std::string optimizer(std::size_t i, int rank) {
  const std::string name = numbered("optimizer", i);
  if (rank < 0) return name;
  return name.substr(0, name.size() - 3) + "_rank" + std::to_string(rank) + ".pt";
}
// A process's RNG states and accumulation step, as Accelerate's.
inline std::string random_states(int64_t process) { return "random_states_" + std::to_string(process) + ".pt"; }
inline constexpr const char* loaders = "loaders.pt";
inline constexpr const char* scaler = "scaler.pt";
// The i-th object of register_for_checkpointing, as Accelerate's.
inline std::string custom_object(std::size_t i) { return "custom_checkpoint_" + std::to_string(i) + ".pt"; }
// A sharded model's piece j written by process `process` (checkpoint/shards.hpp).
inline std::string piece(int process, std::size_t j) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-part-%zu.safetensors", process, j);
  return name;
}

// save_model's: one file, or Hugging Face's shards and their index.
inline constexpr const char* weights = "model.safetensors";
inline constexpr const char* weights_index = "model.safetensors.index.json";
inline std::string weights_shard(std::size_t k, std::size_t count) {
  if (count == 1) return weights;
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, count);
  return name;
}
// Whether `file` is one save_model writes (an earlier save's are removed).
inline bool is_weights_file(const std::string& file) {
  return file == weights || file == weights_index || (file.starts_with("model-") && file.ends_with(".safetensors"));
}
}  // namespace detail::file_names

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/prepared.hpp ===================================
// accel/training/checkpoint/prepared.hpp: what an Accelerator has prepared (models, optimizers, schedulers, loaders, objects).
//
// The Accelerator adds to a PreparedSet as it prepares things and
// registers objects; the checkpoint functions (checkpoint/state.hpp) save
// and restore what it lists. Plain data, a few lookups, and SyncGuard, the
// RAII switch of a prepared model's gradient sync.

ACCEL_NAMESPACE_BEGIN

namespace detail {
struct PreparedModel {
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<DataParallel> data_parallel;  // (its requires_gradient_sync: whether backward() reduces)
  tp::SplitTensors split{};                     // its tensor-parallel pieces, found once at prepare
};

// A prepared scheduler in checkpoints: its step count, and its own
// save/load where it has them. LibTorch's LRScheduler has neither (its
// step count is protected): load_state replays the missing steps on it,
// before the optimizers' learning rates are restored.
struct PreparedScheduler {
  const void* address;
  std::shared_ptr<int64_t> steps;
  std::function<void()> step;
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

// An object registered for checkpointing (Accelerate's
// register_for_checkpointing): how to save and load it.
struct CheckpointedObject {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

struct PreparedSet {
  std::deque<PreparedModel> models;  // (a deque: references to its elements stay valid as it grows)
  // The sharded models' DataParallels (shared with the optimizers' handles,
  // which gather after a step).
  std::shared_ptr<std::vector<DataParallel*>> sharded = std::make_shared<std::vector<DataParallel*>>();
  std::vector<torch::optim::Optimizer*> optimizers;
  std::vector<PreparedScheduler> schedulers;
  std::vector<std::shared_ptr<LoaderPosition>> loaders;  // prepared loaders' places, in prepare order
  std::vector<CheckpointedObject> objects;               // in the order registered
  std::shared_ptr<GradScaler> scaler;                    // mixed_precision "fp16"'s (scaler.pt in checkpoints)

  PreparedModel* find(const torch::nn::Module* module) {
    for (auto& m : models)
      if (m.module.get() == module) return &m;
    return nullptr;
  }
  // The fully sharded parameters of every prepared model (or of `module`)
  // gathered for as long as the result lives (a collective: every process).
  std::vector<DataParallel::FullParameters> full_parameters(const torch::nn::Module* module = nullptr,
                                                            bool writeback = false) {
    std::vector<DataParallel::FullParameters> out;
    for (auto& m : models)
      if (!module || m.module.get() == module) out.push_back(m.data_parallel->summon_full_params(writeback));
    return out;
  }
  // The gradients of `parameters` by what each is a piece of: a sharded
  // parameter's gradient is its shard's (a chunk along the shard group), a
  // tensor-parallel piece's (an accel::tp layer's or a plan's split
  // parameter) a piece along the tp group, and under FSDP + TP both.
  // Parameters without a gradient are left out.
  struct Gradients {
    std::vector<at::Tensor> sharded_pieces, sharded, pieces, whole;
    GroupPtr shard_group, tp_group;  // null where nothing is sharded, or split
  };
  Gradients gradients_of(const std::vector<at::Tensor>& parameters) const {
    Gradients out;
    if (!sharded->empty()) out.shard_group = sharded->front()->shard_group();
    const PreparedModel* split = nullptr;
    for (const auto& m : models) {
      if (!m.split.group) continue;
      if (split && m.split.group != split->split.group)
        throw InvalidArgument(
            "accel::Accelerator: the prepared models' accel::tp layers are split over different "
            "groups ('" +
            split->split.layers.front() + "' and '" + m.split.layers.front() + "')");
      split = &m;
    }
    if (split) out.tp_group = split->split.group;
    for (const auto& p : parameters) {
      const at::Tensor stand_in = StandIns::instance().of(p);  // (a sharded wrapper's shard of p, else p)
      const bool shard = !stand_in.is_same(p);
      const at::Tensor& grad = stand_in.grad();
      if (!grad.defined()) continue;
      const bool piece =
          split && std::any_of(models.begin(), models.end(), [&](const auto& m) { return m.split.contains(p); });
      (shard ? (piece ? out.sharded_pieces : out.sharded) : (piece ? out.pieces : out.whole)).push_back(grad);
    }
    return out;
  }
};

// An optimizer's groups with each parameter once, for prepare(optimizer):
// an optimizer made from LibTorch's model->parameters() holds a tied weight
// twice (Python's parameters() would have given it once) and would step it
// twice. A tensor in two groups is an error, as in Python's optimizers
// ("some parameters appear in more than one parameter group"), named by the
// prepared models' names for it.
inline void take_parameters_once(torch::optim::Optimizer& optimizer, const PreparedSet& set) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (auto& group : optimizer.param_groups()) {
    std::vector<at::Tensor> kept;
    std::unordered_set<const c10::TensorImpl*> in_group;
    for (const auto& p : group.params()) {
      if (!in_group.insert(p.unsafeGetTensorImpl()).second) continue;
      if (!seen.insert(p.unsafeGetTensorImpl()).second) {
        std::string name = "of shape " + c10::str(p.sizes());
        for (const auto& m : set.models)
          if (const std::string n = ParameterNames(*m.module).first(p); !n.empty()) name = "'" + n + "'";
        throw InvalidArgument("accel::Accelerator::prepare: the parameter " + name +
                              " is in more than one of the optimizer's parameter groups (as in Python, a parameter "
                              "belongs to one group)");
      }
      kept.push_back(p);
    }
    if (kept.size() != group.params().size()) group.params() = std::move(kept);
  }
}

// Accelerator::clip_grad_norm_ and clip_grad_value_: torch's on unsharded
// models. After the all-reduce every rank holds the same averaged
// gradients, so the norm computed here is the global one, identical on
// every rank. A gradient that is a piece of a larger one counts over the
// ranks holding the other pieces: a shard's over the shard group, a
// tensor-parallel piece's over the tp group, a shard of a tp piece (FSDP +
// TP) over both; every other gradient once. Then every gradient is scaled.
inline double clip_grad_norm(const PreparedSet& set, const std::vector<at::Tensor>& listed, double max_norm,
                             double norm_type) {
  const std::vector<at::Tensor> parameters = unique_tensors(listed);  // (a tied weight counts once, as in Python)
  PreparedSet::Gradients g = set.gradients_of(parameters);
  if (!g.shard_group && !g.tp_group) return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
  at::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  const ReduceOp op = inf ? ReduceOp::MAX : ReduceOp::SUM;
  // The p-th powers of the norms (or the largest element for inf) of each kind, summed here in one stacked
  // tensor read once (on a GPU each read makes the host wait for the device), then over the groups: two
  // scalar all-reduces at most.
  at::TensorOptions options = at::TensorOptions(at::kDouble);
  for (const auto* grads : {&g.sharded_pieces, &g.sharded, &g.pieces, &g.whole})
    if (!grads->empty()) {
      options = options.device(grads->front().device());
      break;
    }
  auto part = [&](const std::vector<at::Tensor>& grads) {
    if (grads.empty()) return at::zeros({}, options);
    std::vector<at::Tensor> norms;
    for (const auto& grad : grads) norms.push_back(grad.norm(norm_type).to(options));
    const at::Tensor all = at::stack(norms);
    return inf ? all.max() : all.pow(norm_type).sum();
  };
  const at::Tensor parts = at::stack({part(g.sharded_pieces), part(g.sharded), part(g.pieces), part(g.whole)}).cpu();
  const auto combine = [&](double a, double b) { return inf ? std::max(a, b) : a + b; };
  // Over the shard group: the shards of pieces, and the shards of whole tensors; then over tp: the pieces.
  at::Tensor sharded = parts.slice(0, 0, 2).clone();
  if (g.shard_group) sharded = accel::all_reduce(sharded, op, g.shard_group);
  const auto summed = sharded.accessor<double, 1>();
  const auto local = parts.accessor<double, 1>();
  double from_pieces = combine(summed[0], local[2]);
  if (g.tp_group) from_pieces = accel::all_reduce(from_pieces, op, g.tp_group);
  const double total = combine(combine(from_pieces, summed[1]), local[3]);
  const double norm = inf ? total : std::pow(total, 1.0 / norm_type);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1)
    for (const auto* grads : {&g.sharded_pieces, &g.sharded, &g.pieces, &g.whole})
      for (const auto& grad : *grads) grad.mul_(coefficient);
  return norm;
}
inline void clip_grad_value(const PreparedSet& set, const std::vector<at::Tensor>& listed, double clip_value) {
  const std::vector<at::Tensor> parameters = unique_tensors(listed);
  if (set.sharded->empty()) return torch::nn::utils::clip_grad_value_(parameters, clip_value);
  const PreparedSet::Gradients g = set.gradients_of(parameters);  // (element by element: pieces as any gradient)
  at::NoGradGuard no_grad;
  for (const auto* grads : {&g.sharded_pieces, &g.sharded, &g.pieces, &g.whole})
    for (const auto& grad : *grads) grad.clamp_(-clip_value, clip_value);
}

// RAII: restores the models' gradient sync (DataParallel's
// requires_gradient_sync) as it was when the guard goes out of scope
// (Accelerator::no_sync, trigger_sync_in_backward and accumulate return one).
class SyncGuard {
 public:
  SyncGuard() = default;
  SyncGuard(SyncGuard&& other) noexcept : saved_(std::exchange(other.saved_, {})) {}
  SyncGuard(const SyncGuard&) = delete;
  SyncGuard& operator=(const SyncGuard&) = delete;
  SyncGuard& operator=(SyncGuard&&) = delete;
  ~SyncGuard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) it->first->set_requires_gradient_sync(it->second);
  }

  // Sets the model's gradient sync to `on` now, and back when the guard goes.
  void set(DataParallel& model, bool on) {
    saved_.emplace_back(&model, model.requires_gradient_sync());
    model.set_requires_gradient_sync(on);
  }

 private:
  std::vector<std::pair<DataParallel*, bool>> saved_;
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/accelerator/join.hpp ======================================
// accel/training/accelerator/join.hpp: Join: training on uneven inputs, as DDP's Join (Accelerator::join_uneven_inputs), and the block's even_batches.
//
// A rank whose loop ends first stands in for the others' gradient
// all-reduces (with zeros: gradients are still divided by the whole group)
// until every rank's loop has ended; then every rank takes the weights of a
// rank that ran the most steps (DDP's final model sync). Every backward
// inside the loop first sends one small all_reduce, matched on the joined
// ranks, that says which models to shadow.

ACCEL_NAMESPACE_BEGIN

namespace detail {
class Join {
 public:
  // models: the prepared models joined ranks stand in for (at least one).
  explicit Join(std::vector<PreparedModel*> models)
      : models_(std::move(models)), group_(models_.front()->data_parallel->group()) {}

  // The group the models average over; null when not distributed.
  const GroupPtr& group() const { return group_; }
  bool includes(const PreparedModel* m) const { return std::find(models_.begin(), models_.end(), m) != models_.end(); }
  // On a rank still training, before its backward.
  void before_backward() { signal(1); }
  // This rank's loop has ended: shadows the others' backwards until every
  // loop has ended, then takes the weights of a rank that ran the most steps.
  void finish() {
    for (;;) {
      const std::vector<int64_t> counts = signal(0);
      if (counts[0] == 0) break;  // every rank has joined
      for (std::size_t i = 0; i < models_.size(); ++i)
        if (counts[i + 1] > 0) models_[i]->data_parallel->shadow_backward();
    }
    const std::vector<int64_t> steps = all_gather(steps_, group_);
    const int src = static_cast<int>(std::max_element(steps.begin(), steps.end()) - steps.begin());
    for (PreparedModel* m : models_) m->data_parallel->sync_module_states(src);
  }

 private:
  // The all_reduce of [ranks still training, then per model the ranks
  // syncing it].
  std::vector<int64_t> signal(int64_t active) {
    std::vector<int64_t> out{active};
    for (const PreparedModel* m : models_) out.push_back(active && m->data_parallel->requires_gradient_sync() ? 1 : 0);
    steps_ += active;
    return all_reduce(std::move(out), ReduceOp::SUM, group_);
  }

  std::vector<PreparedModel*> models_;
  GroupPtr group_;
  int64_t steps_ = 0;  // backwards this rank ran
};

// Runs body (the training loop) joined: `current` holds the Join while body
// runs (the Accelerator's backward reads it), and every rank finishes it
// after body, also when it ran out of batches first. Not distributed: body
// alone.
template <class Body>
void run_joined(std::optional<Join>& current, Join join, Body&& body) {
  if (!join.group()) return static_cast<void>(std::invoke(body));
  current.emplace(std::move(join));
  try {
    std::invoke(body);
    current->finish();
  } catch (...) {
    current.reset();
    throw;
  }
  current.reset();
}

// RAII: every prepared loader's even_batches set for the passes that start
// while it lives (join_uneven_inputs' even_batches), then put back.
class EvenBatchesOverride {
 public:
  EvenBatchesOverride(const std::vector<std::shared_ptr<LoaderPosition>>& loaders, bool even_batches) {
    for (const auto& loader : loaders) saved_.emplace_back(loader, std::exchange(loader->even_batches, even_batches));
  }
  EvenBatchesOverride(const EvenBatchesOverride&) = delete;
  EvenBatchesOverride& operator=(const EvenBatchesOverride&) = delete;
  ~EvenBatchesOverride() {
    for (auto& [loader, value] : saved_) loader->even_batches = value;
  }

 private:
  std::vector<std::pair<std::shared_ptr<LoaderPosition>, std::optional<bool>>> saved_;
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/manifest.hpp ===================================
// accel/training/checkpoint/manifest.hpp: a checkpoint's manifest (every file with its size and XXH64, the checkpoint's id) and the checks a load makes against it.
//
// The manifest, accel_checkpoint.txt, is written last: its presence (whole:
// it ends with "end") marks a checkpoint complete. It carries a serial, one
// more than the checkpoint it replaces, the checkpoint's id (random, its
// own: every piece file carries it too), and every other file of the
// checkpoint with its size and XXH64 hash (io/file_digest.hpp), which a
// load checks for each file it reads before anything changes
// (CheckpointFiles): a damaged file, one cut short, one of another
// checkpoint or one the manifest does not list is refused, naming it. The
// manifest ends with a hash of its own lines. A manifest of the first
// format (before digests) is read, its files unchecked.

#include <future>
#include <random>

ACCEL_NAMESPACE_BEGIN

namespace detail {
namespace fs = std::filesystem;

inline constexpr const char* checkpoint_format = "accel.hpp checkpoint 2";
inline constexpr const char* checkpoint_format_1 = "accel.hpp checkpoint 1";  // (no id, no digests)

// The files one process wrote into a checkpoint, by name, with their digests.
using FileLog = std::vector<std::pair<std::string, FileDigest>>;

struct CheckpointManifest {
  int format = 2;
  int64_t serial = 0;
  int64_t processes = 0;
  int64_t models = 0;
  int64_t optimizers = 0;
  int64_t loaders = 0;
  int64_t objects = 0;
  int64_t schedulers = 0;
  int64_t shards = 1;  // the ways optimizer state is sharded (one file per process when more than 1)
  int64_t tp = 1;      // the tensor-parallel size (one optimizer file per process when more than 1)
  std::string id{};    // 32 hexadecimal digits, this save's own
  std::map<std::string, FileDigest> files{};  // every file of the checkpoint but the manifest
};

// The manifest's text: its lines, then `check` with the XXH64 of all the
// bytes before that line, then `end`.
inline std::string manifest_text(const CheckpointManifest& m) {
  std::ostringstream out;
  out << checkpoint_format << "\nserial " << m.serial << "\nprocesses " << m.processes << "\nmodels " << m.models
      << "\noptimizers " << m.optimizers << "\nloaders " << m.loaders << "\nobjects " << m.objects << "\nschedulers "
      << m.schedulers << "\nshards " << m.shards << "\n";
  if (m.tp > 1) out << "tp " << m.tp << "\n";  // (absent at 1: the manifests of runs without tp stay as they were)
  out << "id " << m.id << "\n";
  for (const auto& [name, digest] : m.files)
    out << "file " << name << ' ' << digest.bytes << ' ' << hex64(digest.xxh64) << '\n';
  std::string text = std::move(out).str();
  return text + "check " + hex64(xxh64(text.data(), text.size())) + "\nend\n";
}

// A complete manifest, or none (missing, cut short, or its own hash wrong).
inline std::optional<CheckpointManifest> read_manifest(const fs::path& dir) {
  std::ifstream file(dir / file_names::manifest, std::ios::binary);
  if (!file) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::istringstream in(text);
  std::string line;
  CheckpointManifest m;
  if (!std::getline(in, line)) return std::nullopt;
  if (line == checkpoint_format_1) m.format = 1;
  else if (line != checkpoint_format) return std::nullopt;
  bool checked = false;
  std::string key;
  while (in >> key) {
    if (key == "end") return m.format == 1 || checked ? std::optional(m) : std::nullopt;
    if (key == "check") {
      const auto at = static_cast<std::size_t>(in.tellg()) - key.size();
      std::string hash;
      in >> hash;
      checked = from_hex64(hash) == xxh64(text.data(), at);
      if (!checked) return std::nullopt;
      continue;
    }
    if (key == "id") {
      in >> m.id;
      continue;
    }
    if (key == "file") {
      std::string name, hash;
      FileDigest digest;
      if (!(in >> name >> digest.bytes >> hash) || !from_hex64(hash)) return std::nullopt;
      digest.xxh64 = *from_hex64(hash);
      m.files[name] = digest;
      continue;
    }
    int64_t value = 0;
    if (!(in >> value)) return std::nullopt;
    if (key == "serial") m.serial = value;
    else if (key == "processes") m.processes = value;
    else if (key == "models") m.models = value;
    else if (key == "optimizers") m.optimizers = value;
    else if (key == "loaders") m.loaders = value;
    else if (key == "objects") m.objects = value;
    else if (key == "schedulers") m.schedulers = value;
    else if (key == "shards") m.shards = value;
    else if (key == "tp") m.tp = value;  // other keys: a newer writer's, ignored
  }
  return std::nullopt;  // cut short
}

inline void write_manifest(const fs::path& dir, const CheckpointManifest& m) {
  write_file_atomically(dir / file_names::manifest, [&](CheckedFile& file) { file.write(manifest_text(m)); });
}

// A new checkpoint's id: 128 random bits, as hexadecimal digits.
inline std::string new_checkpoint_id() {
  std::random_device random;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    char part[9];
    std::snprintf(part, sizeof part, "%08x", static_cast<unsigned>(random()));
    id += part;
  }
  return id;
}

// A checkpoint's files as a load reads them, each checked against the
// manifest's record (size and XXH64): check(name) refuses at once a file
// that is missing or not listed, and starts reading and hashing it on a
// thread of its own (one file at a time, in order), beside the caller's own
// reading of it (both from the page cache: with a core to spare, the check
// costs nothing); wait() returns once every check begun is done, throwing
// the first that failed, naming the file. The load applies nothing before
// wait() (read_checkpoint), and a check's error comes before any other (a
// damaged file's parse may fail first). Only the files a process reads are
// checked by it; every file is read by some process, and load_state fails
// on every process when one refuses. A manifest of the first format has no
// records: its files are read unchecked.
class CheckpointFiles {
 public:
  CheckpointFiles(fs::path dir, CheckpointManifest manifest) : dir_(std::move(dir)), manifest_(std::move(manifest)) {}
  CheckpointFiles(const CheckpointFiles&) = delete;
  CheckpointFiles& operator=(const CheckpointFiles&) = delete;
  ~CheckpointFiles() { wait_quietly(); }

  // The file's path; its check begun.
  fs::path check(const std::string& name) {
    const fs::path path = dir_ / name;
    if (!fs::exists(path)) throw RuntimeError("missing " + path.string());
    if (manifest_.format < 2 || !file_digests_on() || !begun_.insert(name).second) return path;
    const auto recorded = manifest_.files.find(name);
    if (recorded == manifest_.files.end())
      throw RuntimeError(path.string() + " is not one of this checkpoint's files (" +
                         (dir_ / file_names::manifest).string() + " does not list it)");
    std::shared_future<void> before = checks_.empty() ? std::shared_future<void>() : checks_.back();
    checks_.push_back(std::async(std::launch::async, [path, expected = recorded->second, before] {
                        if (before.valid()) before.wait();  // (one at a time)
                        const FileDigest found = digest_of_file(path);
                        if (found != expected)
                          throw RuntimeError(path.string() + " is damaged or is not this checkpoint's: " +
                                             std::to_string(found.bytes) + " bytes of XXH64 " + hex64(found.xxh64) +
                                             ", where the checkpoint recorded " + std::to_string(expected.bytes) +
                                             " bytes of " + hex64(expected.xxh64));
                      }).share());
    return path;
  }
  // Every check begun, done; the first that failed, thrown.
  void wait() {
    wait_quietly();
    for (const auto& check : checks_) check.get();
  }
  // Whether the manifest records the files (and an id), so that they are checked.
  bool recorded() const { return manifest_.format >= 2; }
  const std::string& id() const { return manifest_.id; }
  // The listed files whose names end with `suffix`, in order.
  std::vector<fs::path> listed(std::string_view suffix) const {
    std::vector<fs::path> out;
    for (const auto& entry : manifest_.files)
      if (entry.first.ends_with(suffix)) out.push_back(dir_ / entry.first);
    return out;
  }

 private:
  void wait_quietly() const noexcept {
    for (const auto& check : checks_) check.wait();
  }

  fs::path dir_;
  CheckpointManifest manifest_;
  std::set<std::string> begun_;
  std::vector<std::shared_future<void>> checks_;
};

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/files.hpp ======================================
// accel/training/checkpoint/files.hpp: a checkpoint's directory: atomic install, recovery, rotation, and the checks every load shares.
//
// (Every file's name is checkpoint/file_names.hpp's; the manifest that
// lists them is checkpoint/manifest.hpp's.)
// A checkpoint is a directory: model.pt, model_1.pt, ... (sharded models:
// each process's pieces, rank-<k>-part-<j>.safetensors;
// checkpoint/shards.hpp), optimizer.pt, ... (sharded:
// optimizer_rank<k>.pt, ...),
// random_states_<rank>.pt (that rank's CPU RNG, its CUDA device's on a GPU,
// and the accumulation step, as Accelerate's), loaders.pt (each prepared loader's epoch and batches handed
// out), custom_checkpoint_<i>.pt (register_for_checkpointing), and last the
// manifest accel_checkpoint.txt, whose presence (whole: it ends with "end")
// marks the directory complete.
//
// save_state writes DIR.tmp, fsyncs every file, writes the manifest, fsyncs
// the directory, then swaps DIR.tmp and DIR in one step (renameat2's
// RENAME_EXCHANGE) and removes the old one. Where the filesystem cannot
// exchange, two renames with the old one at DIR.old between them. Whatever
// moment a process dies at, one of DIR, DIR.tmp and DIR.old is complete, and
// the next save_state or load_state first recovers: the complete one with the
// highest serial becomes DIR and the others are removed. A save never removes
// the newest complete checkpoint before its own is complete.

ACCEL_NAMESPACE_BEGIN

namespace detail {
namespace fs = std::filesystem;

// Called at each step of the save protocol (tests kill the process there);
// a no-op otherwise. Steps: "files written", "manifest written", "exchanged",
// "between renames", "renamed".
inline std::function<void(const char*)>& checkpoint_hook() {
  static std::function<void(const char*)> hook = [](const char*) {};
  return hook;
}
// Tests turn RENAME_EXCHANGE off to run the two-rename path.
inline bool& checkpoint_use_exchange() {
  static bool use = true;
  return use;
}

// The manifest goes first, so a removal cut short never leaves a directory
// that looks complete.
inline void discard_checkpoint(const fs::path& dir) {
  if (!fs::exists(dir)) return;
  fs::remove(dir / file_names::manifest);
  fs::remove_all(dir);
}

// A checkpoint's serial, from its manifest; none for anything incomplete.
inline std::optional<int64_t> checkpoint_serial(const fs::path& dir) {
  if (auto m = read_manifest(dir)) return m->serial;
  return std::nullopt;
}

// Makes the complete directory `from` the directory `to` (whose content, if
// any, is older or incomplete); `from` is gone afterwards.
inline void install_checkpoint(const fs::path& from, const fs::path& to) {
  const fs::path parent = to.parent_path();
  if (!fs::exists(to)) {
    fs::rename(from, to);
    fsync_path(parent);
    return;
  }
#ifdef RENAME_EXCHANGE
  if (checkpoint_use_exchange()) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_path(parent);
      checkpoint_hook()("exchanged");
      discard_checkpoint(from);  // now the older one
      return;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) throw_errno("cannot exchange with", to);
  }
#endif
  const fs::path old = sibling(to, ".old");
  if (from == old) {  // recovering DIR.old: what is under DIR is incomplete
    fs::remove_all(to);
    fs::rename(from, to);
    fsync_path(parent);
    return;
  }
  discard_checkpoint(old);
  fs::rename(to, old);
  fsync_path(parent);
  checkpoint_hook()("between renames");
  fs::rename(from, to);
  fsync_path(parent);
  checkpoint_hook()("renamed");
  discard_checkpoint(old);
}

// The newest complete checkpoint among DIR, DIR.tmp and DIR.old becomes DIR;
// the others are removed. Returns DIR's serial (none: no checkpoint).
inline std::optional<int64_t> recover_checkpoint(const fs::path& dir) {
  const fs::path tmp = sibling(dir, ".tmp"), old = sibling(dir, ".old");
  const std::optional<int64_t> at_dir = checkpoint_serial(dir), at_tmp = checkpoint_serial(tmp),
                               at_old = checkpoint_serial(old);
  std::optional<int64_t> newest = at_dir;
  if (at_tmp && (!newest || *at_tmp > *newest) && (!at_old || *at_tmp >= *at_old)) {
    install_checkpoint(tmp, dir);
    newest = at_tmp;
  } else if (at_old && (!newest || *at_old > *newest)) {
    install_checkpoint(old, dir);
    newest = at_old;
  }
  discard_checkpoint(tmp);
  discard_checkpoint(old);
  return newest;
}

// "dir/", "./dir" and "dir" are one checkpoint.
inline fs::path checkpoint_path(const fs::path& dir, const char* op) {
  if (dir.empty()) throw InvalidArgument(std::string("accel::Accelerator::") + op + ": an empty checkpoint path");
  fs::path path = fs::absolute(dir).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();
  if (path == path.root_path())
    throw InvalidArgument(std::string("accel::Accelerator::") + op + ": " + dir.string() + " is not a checkpoint path");
  return path;
}

// Accelerate's ProjectConfiguration, checked where it is used (the
// Accelerator hands it out to change).
inline void check_project(const ProjectConfiguration& project, const std::string& where) {
  if (project.automatic_checkpoint_naming && project.project_dir.empty())
    throw InvalidArgument(where + ": automatic_checkpoint_naming needs a project_config.project_dir");
  if (project.total_limit && !project.automatic_checkpoint_naming)
    throw InvalidArgument(where + ": project_config.total_limit applies to automatic_checkpoint_naming, which is off");
  if (project.total_limit && *project.total_limit < 1)
    throw InvalidArgument(where + ": project_config.total_limit must be at least 1, got " +
                          std::to_string(*project.total_limit));
  if (project.iteration < 0)
    throw InvalidArgument(where + ": project_config.iteration must not be negative, got " +
                          std::to_string(project.iteration));
}

// Automatic naming's directories are ROOT/checkpoint_<n>. The number of
// `name` when it is one of them, or one's .tmp/.old leftover, written as
// save_state writes it; other names are not ours and are left alone.
inline std::optional<int> checkpoint_number(std::string name) {
  for (const std::string_view suffix : {".tmp", ".old"})
    if (name.ends_with(suffix)) {
      name.resize(name.size() - suffix.size());
      break;
    }
  constexpr std::string_view prefix = "checkpoint_";
  if (!name.starts_with(prefix)) return std::nullopt;
  const std::string digits = name.substr(prefix.size());
  const bool canonical = !digits.empty() && digits.size() <= 9 && (digits.size() == 1 || digits[0] != '0') &&
                         std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); });
  if (!canonical) return std::nullopt;
  return std::stoi(digits);
}

// The complete numbered checkpoints under root, by number, each first
// recovered from a half-done save.
inline std::map<int, fs::path> numbered_checkpoints(const fs::path& root) {
  std::set<int> numbers;
  if (fs::is_directory(root))
    for (const auto& entry : fs::directory_iterator(root))
      if (const auto n = checkpoint_number(entry.path().filename().string())) numbers.insert(*n);
  std::map<int, fs::path> complete;
  for (const int n : numbers) {
    const fs::path dir = root / ("checkpoint_" + std::to_string(n));
    if (recover_checkpoint(dir)) complete.emplace(n, dir);
  }
  return complete;
}

// total_limit: removes the lowest-numbered checkpoints, never `keep` (the one
// just saved), until `limit` are left.
inline void rotate_checkpoints(const fs::path& root, int limit, int keep) {
  std::map<int, fs::path> others = numbered_checkpoints(root);
  others.erase(keep);
  while (!others.empty() && others.size() + 1 > static_cast<std::size_t>(limit)) {
    discard_checkpoint(others.begin()->second);
    others.erase(others.begin());
  }
}

// What `step` threw, as text; "" when it returned.
template <class Step>
std::string error_of(Step&& step) {
  try {
    step();
    return {};
  } catch (const std::exception& e) {
    return error_text(e);
  }
}

// Every rank passes its error ("" if none); if any rank has one, every rank
// throws the same RuntimeError listing them. A collective: it also orders
// what comes before it on every rank before what comes after.
inline void fail_together(const std::string& error, std::string_view function) {
  const std::vector<std::string> errors = accel::gather_object(error);
  std::string message;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      message +=
          (message.empty() ? "" : "; ") + (errors.size() > 1 ? "rank " + std::to_string(r) + ": " : "") + errors[r];
  if (!message.empty()) throw RuntimeError(std::string(function) + ": " + message);
}

// A model's checkpoint archive against the model, before anything is loaded:
// every parameter and buffer Module::load will read is there with the
// model's shape and dtype, and the archive holds nothing the model lacks.
inline void check_module_archive(torch::nn::Module& module, torch::serialize::InputArchive& archive,
                                 const std::string& prefix, const std::string& file) {
  std::set<std::string> expected{"training"};  // every TorchScript module has it
  auto check = [&](const std::string& name, const at::Tensor& value, bool buffer) {
    expected.insert(name);
    at::Tensor saved;
    if (!archive.try_read(name, saved, buffer))
      throw RuntimeError(file + " has no " + (buffer ? "buffer " : "parameter ") + prefix + name +
                         " (saved from another model?)");
    if (saved.sizes() != value.sizes() || saved.scalar_type() != value.scalar_type())
      throw RuntimeError(file + ": " + prefix + name + " is " + c10::toString(saved.scalar_type()) +
                         c10::str(saved.sizes()) + " there, " + c10::toString(value.scalar_type()) +
                         c10::str(value.sizes()) + " in the model");
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) check(p.key(), p.value(), false);
  for (const auto& b : module.named_buffers(/*recurse=*/false)) check(b.key(), b.value(), true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    expected.insert(child.key());
    torch::serialize::InputArchive nested;
    if (!archive.try_read(child.key(), nested))
      throw RuntimeError(file + " has no submodule " + prefix + child.key() + " (saved from another model?)");
    check_module_archive(*child.value(), nested, prefix + child.key() + ".", file);
  }
  for (const std::string& key : archive.keys())
    if (!expected.count(key))
      throw RuntimeError(file + " has " + prefix + key + ", which the model lacks (saved from another model?)");
}

// LibTorch's Optimizer::load restores the per-parameter state but not the
// groups' options (learning rate, momentum, ...), which Python's
// load_state_dict restores: a resumed run would silently go on with the
// learning rate it started with. They are in the same archive
// (param_groups/<i>/options, torch/optim/serialize.h's layout): read into a
// clone of each group's options, which has the optimizer's own options type.
inline void load_group_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive groups;
  archive.read("param_groups", groups);
  for (std::size_t i = 0; i < optimizer.param_groups().size(); ++i) {
    auto& group = optimizer.param_groups()[i];
    if (!group.has_options()) continue;
    torch::serialize::InputArchive saved_group, saved;
    groups.read("param_groups/" + std::to_string(i), saved_group);
    saved_group.read("options", saved);
    std::unique_ptr<torch::optim::OptimizerOptions> options = group.options().clone();
    options->serialize(saved);
    group.set_options(std::move(options));
  }
}

// An optimizer's state as bytes, to put it back if a load fails.
inline std::string optimizer_snapshot(torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return std::move(bytes).str();
}
inline void restore_optimizer(torch::optim::Optimizer& optimizer, const std::string& snapshot) {
  torch::serialize::InputArchive archive;
  archive.load_from(snapshot.data(), snapshot.size());
  optimizer.state().clear();  // load() only sets the entries it finds
  optimizer.load(archive);
  load_group_options(optimizer, archive);
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/world.hpp ======================================
// accel/training/checkpoint/world.hpp: a checkpoint loaded by another number of processes: loader positions in samples, RNG states for new processes.
//
// A checkpoint loads at any number of processes: a job moved from 4
// processes to 2, or an elastic restart with fewer, goes on (a sharded
// optimizer state is cut again for the new pieces: checkpoint/reshard.hpp).
// Two more things in it belong to the saving run's layout, and these are
// the rules for them:
// - A prepared loader's place is kept in samples: the saving run read
//   `batches` batches of the pass, each of `samples_per_batch` samples over
//   all its processes (the batch size times the data-parallel processes,
//   or the global batch with split_batches). This run skips as many of its
//   own batches as cover them; where they do not come out whole, it skips
//   the whole ones only (the rest is read again) and warns, naming how many
//   samples. Where either run's batch size is not known (a custom batch
//   sampler without batch_sampler_batch_size), a place mid-pass carries
//   over to as many processes only, in batches as saved, and is an error
//   at another number.
// - RNG states: process p loads the saving run's process p's. A process the
//   saving run did not have seeds its generators from the state of process
//   p mod N (N saving processes) and p, so that each new process draws a
//   stream of its own, the same at every such resume.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The saving run's process whose RNG state (and accumulation step) process
// p loads: its own where the saving run had it.
inline int saved_process_for(int p, int saved_processes) { return p % saved_processes; }

// The seed of a process the saving run did not have (see above): the
// saved state's bytes and p, through FNV-1a and splitmix64's finaliser.
inline uint64_t derived_seed(const at::Tensor& saved_state, int p) {
  const at::Tensor bytes = saved_state.cpu().contiguous();
  const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < bytes.numel() * static_cast<int64_t>(bytes.element_size()); ++i)
    h = (h ^ data[i]) * 1099511628211ULL;
  uint64_t z = h ^ (static_cast<uint64_t>(p) + 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// How many of this run's batches loader `index` skips to resume a pass of
// which the saving run read `batches` batches of `saved_per_batch` samples
// (0: not known), this run's batches being of `per_batch` (0: not known)
// and its processes as many as the saving run's or not; and, where the
// samples do not come out in whole batches, the warning that says so
// (empty otherwise; load_state gives it once the load is committed).
struct ResumedBatches {
  size_t batches = 0;
  std::string warning{};
};
inline ResumedBatches resumed_batches(std::size_t index, size_t batches, int64_t saved_per_batch, size_t per_batch,
                                      bool same_processes) {
  if (batches == 0) return {};
  if (saved_per_batch <= 0 || per_batch == 0) {
    if (same_processes) return {batches};  // as saved (the batch size is the program's to keep)
    throw RuntimeError("prepared loader " + std::to_string(index) + " stopped after " + std::to_string(batches) +
                       " batches of its pass, and the samples per batch of " +
                       (saved_per_batch <= 0 ? std::string("the saving run") : std::string("this run")) +
                       " are not known (a custom batch sampler: set batch_sampler_batch_size), so its place "
                       "cannot be carried over to another number of processes");
  }
  if (saved_per_batch == static_cast<int64_t>(per_batch)) return {batches};
  const auto samples = static_cast<size_t>(saved_per_batch) * batches;
  const size_t whole = samples / per_batch, again = samples % per_batch;
  if (again == 0) return {whole};
  return {whole, c10::str("accel::Accelerator::load_state: prepared loader ", index, " read ", samples,
                          " samples of its pass in the saving run (", batches, " batches of ", saved_per_batch,
                          "); this run reads ", per_batch, " per batch, so it skips ", whole,
                          " batches and reads the last ", again, " of those samples again")};
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/context.hpp ====================================
// accel/training/checkpoint/context.hpp: where this process stands, as a checkpoint records and checks it, and which files are its own.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Where this process stands, as the checkpoint records and checks it.
struct CheckpointContext {
  int process_index = 0;
  int num_processes = 1;
  int64_t shards = 1;  // ways the optimizer state is sharded (1: not sharded)
  int64_t tp = 1;      // the tensor-parallel size (above 1: each process's optimizers step their own pieces)
  c10::Device device{c10::kCPU};
};

// Whether each process writes its own optimizer state: under sharding (its
// shards) and under tensor parallelism (its pieces); else process 0 writes
// the whole state, the same on every process.
inline bool optimizers_per_process(const PreparedSet& set, const CheckpointContext& ctx) {
  return !set.sharded->empty() || ctx.tp > 1;
}
// Optimizer i's checkpoint file: this process's own, or the whole one.
inline std::string optimizer_file(const PreparedSet& set, const CheckpointContext& ctx, std::size_t i) {
  return file_names::optimizer(i, optimizers_per_process(set, ctx) ? ctx.process_index : -1);
}

// Whether model i is saved in pieces, every process its own
// (checkpoint/shards.hpp), rather than whole in model.pt by process 0:
// a sharded model, and one holding tensor-parallel pieces.
inline bool saved_in_pieces(const PreparedSet& set, std::size_t i) {
  const PreparedModel& m = set.models[i];
  return (m.data_parallel && m.data_parallel->sharded()) || m.split.group;
}

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/shards.hpp =====================================
// accel/training/checkpoint/shards.hpp: a sharded model in a checkpoint: each process writes its own pieces, as Python's DCP reads them (checkpoint/sharded_weights.hpp reads them back).
//
// Under SHARD_GRAD_OP, FULL_SHARD and HYBRID_SHARD no process gathers the
// model to save it. Process k of a shard group of S holds elements
// [k*c, (k+1)*c) of every parameter flattened (c = ceil(n/S);
// dp/shards.hpp) and writes them; under HSDP the first replica writes.
// Process 0 writes what is not sharded (buffers, frozen parameters) whole.
// Under tensor parallelism a process holds pieces of the split parameters
// (tp rank t: the t-th slice along the split dimension) and writes its
// piece, or its shard of it, placed in the whole tensor: tensor-parallel
// pieces are not gathered either.
// Beside them go the optimizers' state for those pieces where Python's
// optimizer of the same kind keeps it (Adam's and AdamW's moments and step,
// SGD's momentum buffer: python_state), under Python's names. The files are
// safetensors in the checkpoint's directory, and each one's "__metadata__"
// has "DCP_SHARDING_INFO": {name: {"saved_offsets": [...]}} as JSON text,
// the place of each of its tensors in the whole. That is what
// torch.distributed.checkpoint's HuggingFaceStorageReader reads (torch's
// distributed/checkpoint/hf_storage.py; read with torch 2.15 in CTest
// checkpoint_resize), so Python loads them at any number of processes:
//
//     dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader("ckpt"))
//     dcp.load({"optimizer": {"state": ...}}, storage_reader=HuggingFaceStorageReader("ckpt"))
//
// (names: model_prefix and optimizer_prefix below). The optimizers' state
// is also in LibTorch's archives, optimizer_rank<k>.pt, which is what C++
// loads (any optimizer; checkpoint/reshard.hpp): those tensors are on disk
// twice.
//
// A piece of a flattened tensor need not be a box of the whole (it can
// start and end inside rows): it is written as the fewest boxes that tile
// it, at most 2d-1 for d dimensions. A file holds each name once, so box j
// of each of a process's pieces goes into that process's file j:
// rank-<process>-part-<j>.safetensors.
//
// Each file's metadata also carries the checkpoint's id
// ("accel_checkpoint_id"; Python's reader takes only DCP_SHARDING_INFO).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A box of a tensor: offsets and sizes per dimension. Boxes made by
// boxes_of_range cover a contiguous run of the row-major elements, the
// first at flat index `begin`.
struct TensorBox {
  std::vector<int64_t> offsets, sizes;
  int64_t begin = 0;
  int64_t numel() const { return std::accumulate(sizes.begin(), sizes.end(), int64_t{1}, std::multiplies<>()); }
};

// Elements [begin, end) of the part of a tensor of `shape` from dimension
// `dim` on, whose outer indices are `at` (its first element at flat index
// `base`), as boxes in order: a partial first row, the whole rows, a
// partial last row, partial rows cut the same way one dimension down.
inline void add_boxes(const std::vector<int64_t>& shape, std::size_t dim, int64_t begin, int64_t end,
                      std::vector<int64_t>& at, int64_t base, std::vector<TensorBox>& out) {
  if (begin >= end) return;
  const auto ones = [&] { return std::vector<int64_t>(at.size(), 1); };
  if (dim == shape.size()) {  // a 0-d tensor: its one element
    out.push_back({at, ones(), base});
    return;
  }
  const int64_t inner = std::accumulate(shape.begin() + static_cast<std::ptrdiff_t>(dim) + 1, shape.end(), int64_t{1},
                                        std::multiplies<>());
  const int64_t first_whole = (begin + inner - 1) / inner, last_whole = end / inner;  // whole rows [first, last)
  auto within_row = [&](int64_t row, int64_t from, int64_t to) {
    at.push_back(row);
    add_boxes(shape, dim + 1, from, to, at, base + row * inner, out);
    at.pop_back();
  };
  if (first_whole > last_whole) return within_row(begin / inner, begin % inner, end % inner);  // one row, no edge
  if (begin % inner) within_row(begin / inner, begin % inner, inner);
  if (last_whole > first_whole) {
    TensorBox box{at, ones(), base + first_whole * inner};
    box.offsets.push_back(first_whole);
    box.sizes.push_back(last_whole - first_whole);
    for (std::size_t d = dim + 1; d < shape.size(); ++d) {
      box.offsets.push_back(0);
      box.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(box));
  }
  if (end % inner) within_row(last_whole, 0, end % inner);
}
inline std::vector<TensorBox> boxes_of_range(at::IntArrayRef shape, int64_t begin, int64_t end) {
  std::vector<TensorBox> out;
  std::vector<int64_t> at;
  add_boxes(shape.vec(), 0, begin, end, at, 0, out);
  return out;
}

// The names in a checkpoint's safetensors: model 0's tensors under their
// state_dict names (as Hugging Face's files), model i's under "model_<i>.",
// optimizer i's state under "optimizer.state." ("optimizer_<i>.state.")
// then the parameter's name and the state's, as Python's
// get_optimizer_state_dict() nests them.
inline std::string model_prefix(std::size_t i) { return i == 0 ? "" : "model_" + std::to_string(i) + "."; }
inline std::string optimizer_prefix(std::size_t i) {
  return (i == 0 ? std::string("optimizer") : "optimizer_" + std::to_string(i)) + ".state.";
}
// Whether a name starting with `stem` goes on with digits and a dot (model_1., optimizer_2.).
inline bool numbered(const std::string& name, const char* stem) {
  if (!name.starts_with(stem)) return false;
  const std::size_t digits = std::strlen(stem), dot = name.find('.', digits);
  return dot != std::string::npos && dot > digits &&
         std::all_of(name.begin() + static_cast<std::ptrdiff_t>(digits),
                     name.begin() + static_cast<std::ptrdiff_t>(dot), [](char c) { return c >= '0' && c <= '9'; });
}
// Whether a saved name is an optimizer's state (optimizer_prefix's names).
inline bool optimizer_state_name(const std::string& name) {
  return name.starts_with("optimizer.state.") ||
         (numbered(name, "optimizer_") && name.find(".state.") == name.find('.'));
}
// Whether a saved name is in the namespace of `prefix` (model 0's: every
// name not in another's).
inline bool in_namespace(const std::string& name, const std::string& prefix) {
  if (!prefix.empty()) return name.starts_with(prefix);
  return !name.starts_with("optimizer.state.") && !numbered(name, "model_") && !numbered(name, "optimizer_");
}

// What one process writes: box j of each of its pieces goes into its file
// j, with the place DCP_SHARDING_INFO gives it.
class PieceFiles {
 public:
  // Elements [begin, begin + values.numel()) of a tensor of `shape`,
  // flattened (`values`: a flat view); that tensor is itself the box at
  // `origin` of the whole (a tensor-parallel piece), or the whole (`origin`
  // empty).
  void add_piece(const std::string& name, at::IntArrayRef shape, const at::Tensor& values, int64_t begin,
                 const std::vector<int64_t>& origin = {}) {
    std::size_t j = 0;
    for (TensorBox box : boxes_of_range(shape, begin, begin + values.numel())) {
      for (std::size_t d = 0; d < origin.size(); ++d) box.offsets[d] += origin[d];
      add(j++, name, values.narrow(0, box.begin - begin, box.numel()).view(box.sizes), box.offsets);
    }
  }
  void add_whole(const std::string& name, const at::Tensor& tensor, const std::vector<int64_t>& origin = {}) {
    add(0, name, tensor, origin.empty() ? std::vector<int64_t>(tensor.dim(), 0) : origin);
  }
  // Into dir, with the checkpoint's id; each file and its digest into `log`.
  void write(const fs::path& dir, int process, const std::string& id, FileLog& log) const {
    for (std::size_t j = 0; j < parts_.size(); ++j) {
      const std::string file = file_names::piece(process, j);
      log.emplace_back(file,
                       write_safetensors(dir / file, parts_[j],
                                         {{"DCP_SHARDING_INFO", "{" + places_[j] + "}"}, {kCheckpointIdKey, id}}));
    }
  }
  static constexpr const char* kCheckpointIdKey = "accel_checkpoint_id";

 private:
  void add(std::size_t j, const std::string& name, const at::Tensor& values, const std::vector<int64_t>& at) {
    if (parts_.size() <= j) {
      parts_.resize(j + 1);
      places_.resize(j + 1);
    }
    parts_[j].emplace_back(name, values);
    // (appended piece by piece: GCC 12's -Wrestrict misfires on "" or "," + std::to_string(o))
    std::string& place = places_[j];
    if (!place.empty()) place += ',';
    place += json_quote(name);
    place += ":{\"saved_offsets\":[";
    for (std::size_t d = 0; d < at.size(); ++d) {
      if (d) place += ',';
      place += std::to_string(at[d]);
    }
    place += "]}";
  }
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> parts_;
  std::vector<std::string> places_;
};

// The state Python's optimizer of the same kind keeps per parameter, under
// its names: Adam's and AdamW's moments (and amsgrad's maximum) and step
// (a float32 scalar, as Python's), SGD's momentum buffer. Nothing for other
// optimizers (their state is in LibTorch's archives only).
inline std::vector<std::pair<std::string, at::Tensor>> python_state(const torch::optim::OptimizerParamState* state) {
  auto step = [](int64_t n) { return at::scalar_tensor(static_cast<double>(n), at::kFloat); };
  std::vector<std::pair<std::string, at::Tensor>> out;
  auto adam_like = [&](const auto& s) {
    out = {{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
    if (s.max_exp_avg_sq().defined()) out.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
    out.emplace_back("step", step(s.step()));
  };
  if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state)) adam_like(*adam);
  else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) adam_like(*adamw);
  else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state))
    if (sgd->momentum_buffer().defined()) out = {{"momentum_buffer", sgd->momentum_buffer()}};
  return out;
}
// An optimizer's state for one parameter; null if none.
inline const torch::optim::OptimizerParamState* state_for(torch::optim::Optimizer& optimizer,
                                                          const at::Tensor& parameter) {
  auto& state = optimizer.state();
  const auto found = state.find(dp::state_key(state, parameter.unsafeGetTensorImpl()));
  return found == state.end() ? nullptr : found->second.get();
}

// Where the tensor a process holds sits in the whole: a tensor-parallel
// piece split along `dim` at this rank's place, else at the origin (empty:
// the tensor is whole).
inline std::vector<int64_t> place_in_whole(const tp::SplitTensors& split, const at::Tensor& tensor) {
  const auto dim = split.dim_of(tensor);
  if (!dim) return {};
  std::vector<int64_t> origin(static_cast<std::size_t>(tensor.dim()), 0);
  origin[static_cast<std::size_t>(*dim)] = tp::rank_in(split.group) * tensor.size(*dim);
  return origin;
}

// Writes this process's pieces into dir (see the top): of every model saved
// in pieces, and of its optimizers' state where Python's optimizer of the
// same kind has it (python_state); each file into `log`. Each tensor is
// written once in all: a shard of a piece by its shard group's first
// replica, a shard of a whole tensor by that replica at tp rank 0 (every tp
// rank holds the same shards of it); a tensor-parallel piece that is not
// sharded by the first process of its data-parallel group (its replicas
// hold the same); the rest whole, by process 0.
inline void write_pieces(PreparedSet& set, int process, const fs::path& dir, const std::string& id, FileLog& log) {
  PieceFiles files;
  // What each tensor an optimizer steps (a shard, else the parameter) is of the whole: its name, the shape of
  // what this process holds of it, that tensor's place in the whole, and which of its flattened elements.
  struct Place {
    std::string name;
    std::vector<int64_t> shape, origin;  // (origin empty: the tensor is whole)
    int64_t begin = 0, length = 0;
    bool writes = false;
  };
  std::unordered_map<const c10::TensorImpl*, Place> places;
  for (std::size_t i = 0; i < set.models.size(); ++i) {
    if (!saved_in_pieces(set, i)) continue;
    const PreparedModel& m = set.models[i];
    const DataParallel* dp = m.data_parallel.get();
    const bool sharded = dp && dp->sharded();
    const bool writes_shards = sharded && dp->sharded_state_dict().writes_pieces();
    const bool first_replica = !dp || !dp->group() || dp->group()->getRank() == 0;
    const bool first_tp = tp::rank_in(m.split.group) == 0;  // (the shards of whole tensors: alike over tp)
    for (const auto& [name, tensor] : state_dict(*m.module)) {
      if (!in_namespace(model_prefix(i) + name, model_prefix(i)))
        throw InvalidArgument("accel::Accelerator::save_state: model " + std::to_string(i) + "'s tensor " + name +
                              " would be read as another model's or an optimizer's in a sharded checkpoint; rename "
                              "its module");
      const std::vector<int64_t> origin = place_in_whole(m.split, tensor);
      auto piece = sharded ? dp->sharded_state_dict().piece_of(tensor) : std::nullopt;
      Place place{name, tensor.sizes().vec(), origin, 0, tensor.numel(), false};
      if (piece) {
        place.writes = writes_shards && (!origin.empty() || first_tp);
        place.begin = piece->begin;
        place.length = piece->values.numel();
        if (place.writes) files.add_piece(model_prefix(i) + name, tensor.sizes(), piece->values, piece->begin, origin);
        places[dp->shard_of(tensor).unsafeGetTensorImpl()] = std::move(place);
        continue;
      }
      place.writes = origin.empty() ? process == 0 : first_replica;
      if (place.writes) files.add_whole(model_prefix(i) + name, tensor, origin);
      places[tensor.unsafeGetTensorImpl()] = std::move(place);
    }
  }
  for (std::size_t k = 0; k < set.optimizers.size(); ++k)
    for (const auto& group : set.optimizers[k]->param_groups())
      for (const auto& p : group.params()) {
        const auto found = places.find(p.unsafeGetTensorImpl());
        if (found == places.end() || !found->second.writes) continue;
        const Place& place = found->second;
        const bool holds_first =
            place.begin == 0 && std::all_of(place.origin.begin(), place.origin.end(), [](int64_t o) { return o == 0; });
        for (const auto& [key, value] : python_state(state_for(*set.optimizers[k], p))) {
          const std::string name = optimizer_prefix(k) + place.name + "." + key;
          if (value.dim() == 0) {
            if (holds_first) files.add_whole(name, value);  // (once: by the process of the whole's first element)
          } else {
            files.add_piece(name, place.shape, value.reshape({-1}).narrow(0, 0, place.length), place.begin,
                            place.origin);
          }
        }
      }
  files.write(dir, process, id, log);
}

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/sharded_weights.hpp ============================
// accel/training/checkpoint/sharded_weights.hpp: a sharded model's pieces read back: every file's boxes checked to tile each tensor, this process's part read.
//
// Loading (ShardedWeights) reads the header of every file the manifest
// lists, refuses a file of another checkpoint (its id), checks that each
// name's boxes tile its whole tensor exactly (nothing missing, nothing
// twice) and that the model has the same names, dtypes and shapes, then
// reads for each tensor only what the process keeps (its piece, or the
// whole), and of each saved box that overlaps it only the bytes spanning
// the overlap; a file it reads from is first checked whole against the
// manifest's digest (CheckpointFiles), so a process reads each of those
// files once more in full: where the layout is the saving run's, its own
// files and the first process's first one (the buffers).

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Whether dir holds safetensors files and each places its tensors with
// DCP_SHARDING_INFO: pieces, as accel's sharded checkpoints and Python's
// dcp.save through HuggingFaceStorageWriter write them. A file that is not
// safetensors throws, naming it.
inline bool holds_dcp_pieces(const fs::path& dir) {
  bool any = false;
  if (!fs::is_directory(dir)) return false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    if (!in) return false;
    const auto metadata = read_safetensors_header(in, entry.path()).metadata;
    if (!metadata.count("DCP_SHARDING_INFO")) return false;
    any = true;
  }
  return any;
}

// A sharded model's files in a checkpoint, read and checked (see checkpoint/shards.hpp's top):
// those its manifest lists (`checked`), each checked against its digest
// before its data is read; without records (a checkpoint of the first
// format), every *.safetensors in dir, unchecked.
class ShardedWeights {
 public:
  ShardedWeights(const fs::path& dir, CheckpointFiles& checked) : dir_(dir), checked_(&checked) {
    if (!fs::is_directory(dir)) throw RuntimeError("missing " + dir.string());
    if (checked.recorded()) {
      files_ = checked.listed(".safetensors");
    } else {
      for (const auto& entry : fs::directory_iterator(dir))
        if (entry.path().extension() == ".safetensors") files_.push_back(entry.path());
      std::sort(files_.begin(), files_.end());
    }
    for (std::size_t f = 0; f < files_.size(); ++f) read_header(f);
    for (auto& [name, whole] : tensors_) check_tiling(name, whole);
  }

  // The model's parameters and buffers (state_dict's names) against the
  // files: the same names, dtypes and shapes, or an error naming them.
  void check_fits(const std::vector<std::pair<std::string, at::Tensor>>& expected,
                  const std::string& prefix = "") const {
    std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> held;
    for (const auto& [name, whole] : tensors_)  // (another model's names and the optimizers' are theirs)
      if (in_namespace(name, prefix)) held[name] = {whole.dtype, whole.shape};
    if (const std::string why = misfit(expected, held, prefix); !why.empty())
      throw RuntimeError(dir_.string() + ": its pieces do not fit the model:" + why);
  }

  // Whether the files hold tensor `name` (model or optimizer state).
  bool holds(const std::string& name) const { return tensors_.count(name) > 0; }

  // Every tensor's name, in order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& named : tensors_) out.push_back(named.first);
    return out;
  }

  // Every tensor whole, on the CPU, by name.
  std::map<std::string, at::Tensor> read_all() const {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, whole] : tensors_) {
      const int64_t n = std::accumulate(whole.shape.begin(), whole.shape.end(), int64_t{1}, std::multiplies<>());
      out.emplace(name, read(name, 0, n).view(whole.shape));
    }
    return out;
  }

  // Elements [begin, begin + length) of tensor `name` flattened, on the
  // CPU; or, given `origin`, of the box of `sizes` there in it (a
  // tensor-parallel piece).
  at::Tensor read(const std::string& name, int64_t begin, int64_t length, const std::vector<int64_t>& sizes = {},
                  const std::vector<int64_t>& origin = {}) const {
    const Whole& whole = tensors_.at(name);
    at::Tensor out = at::empty({length}, at::TensorOptions(whole.dtype));
    for (TensorBox want : boxes_of_range(origin.empty() ? whole.shape : sizes, begin, begin + length)) {
      at::Tensor into = out.narrow(0, want.begin - begin, want.numel()).view(want.sizes);
      for (std::size_t d = 0; d < origin.size(); ++d) want.offsets[d] += origin[d];
      for (const Saved& saved : whole.boxes) {
        // The overlap, and the span of the saved box's bytes that holds it.
        std::vector<int64_t> low(want.sizes.size()), size(want.sizes.size()), stride(want.sizes.size());
        int64_t first = 0, last = 0, step = 1;
        bool empty = false;
        for (std::size_t d = want.sizes.size(); d-- > 0;) {
          low[d] = std::max(want.offsets[d], saved.box.offsets[d]);
          const int64_t high = std::min(want.offsets[d] + want.sizes[d], saved.box.offsets[d] + saved.box.sizes[d]);
          size[d] = high - low[d];
          empty = empty || size[d] <= 0;
          stride[d] = step;
          first += (low[d] - saved.box.offsets[d]) * step;
          last += (high - 1 - saved.box.offsets[d]) * step;
          step *= saved.box.sizes[d];
        }
        if (empty) continue;
        at::Tensor span = at::empty({last - first + 1}, at::TensorOptions(whole.dtype));
        read_bytes(saved, first, span);
        at::Tensor target = into;
        for (std::size_t d = 0; d < size.size(); ++d)
          target = target.narrow(static_cast<int64_t>(d), low[d] - want.offsets[d], size[d]);
        target.copy_(span.as_strided(size, stride));
      }
    }
    return out;
  }

 private:
  struct Saved {
    std::size_t file;
    TensorBox box;
    int64_t at = 0;  // its bytes' place in the file
  };
  struct Whole {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    std::vector<Saved> boxes;
  };

  void read_header(std::size_t f) {
    const fs::path& path = files_[f];
    std::ifstream in(path, std::ios::binary);
    if (!in) throw RuntimeError("cannot read " + path.string());
    const SafetensorsHeader header = read_safetensors_header(in, path);
    if (checked_->recorded()) {
      const auto id = header.metadata.find(PieceFiles::kCheckpointIdKey);
      if (id == header.metadata.end() || id->second != checked_->id())
        throw RuntimeError(path.string() + " is a piece of another checkpoint (its id " +
                           (id == header.metadata.end() ? std::string("none") : id->second) + ", this one's " +
                           checked_->id() + ")");
    }
    const auto info = header.metadata.find("DCP_SHARDING_INFO");
    const Json places = info == header.metadata.end()
                            ? Json{}
                            : JsonReader(info->second, path.string() + "'s DCP_SHARDING_INFO").document();
    for (const SafetensorsEntry& e : header.entries) {
      std::vector<int64_t> offsets(e.shape.size(), 0);
      if (info != header.metadata.end()) {
        const Json* place = places.find(e.name);
        const Json* saved = place ? place->find("saved_offsets") : nullptr;
        if (!saved || saved->kind != Json::Kind::Array || saved->items.size() != e.shape.size())
          throw RuntimeError(path.string() + ": DCP_SHARDING_INFO gives " + e.name + " no saved_offsets of " +
                             std::to_string(e.shape.size()) + " dimensions");
        for (std::size_t d = 0; d < offsets.size(); ++d)
          offsets[d] = json_uint(saved->items[d], path.string() + ": " + e.name + "'s saved_offsets");
      }
      auto [it, added] = tensors_.try_emplace(e.name, Whole{e.dtype, {}, {}});
      Whole& whole = it->second;
      if (whole.dtype != e.dtype || (!added && whole.shape.size() != e.shape.size()))
        throw RuntimeError(path.string() + ": " + e.name + " is " + c10::toString(e.dtype) +
                           c10::str(at::IntArrayRef(e.shape)) + " here, of another dtype or rank in another file");
      whole.shape.resize(e.shape.size(), 0);
      for (std::size_t d = 0; d < e.shape.size(); ++d)
        whole.shape[d] = std::max(whole.shape[d], offsets[d] + e.shape[d]);
      whole.boxes.push_back({f, TensorBox{offsets, e.shape, 0}, header.data_start + e.begin});
    }
  }

  // Each name's boxes tile its whole: as many elements, and no two overlap.
  void check_tiling(const std::string& name, const Whole& whole) const {
    const int64_t total = std::accumulate(whole.shape.begin(), whole.shape.end(), int64_t{1}, std::multiplies<>());
    int64_t covered = 0;
    for (std::size_t a = 0; a < whole.boxes.size(); ++a) {
      covered += whole.boxes[a].box.numel();
      for (std::size_t b = 0; b < a; ++b) {
        bool overlap = whole.boxes[a].box.numel() > 0 && whole.boxes[b].box.numel() > 0;
        for (std::size_t d = 0; overlap && d < whole.shape.size(); ++d) {
          const TensorBox &x = whole.boxes[a].box, &y = whole.boxes[b].box;
          overlap = x.offsets[d] < y.offsets[d] + y.sizes[d] && y.offsets[d] < x.offsets[d] + x.sizes[d];
        }
        if (overlap)
          throw RuntimeError(dir_.string() + ": " + name + " has overlapping pieces in " +
                             files_[whole.boxes[a].file].filename().string() + " and " +
                             files_[whole.boxes[b].file].filename().string());
      }
    }
    if (covered != total)
      throw RuntimeError(dir_.string() + ": the pieces of " + name + " hold " + std::to_string(covered) + " of its " +
                         std::to_string(total) + " elements (a file missing?)");
  }

  // Elements [first, first + into.numel()) of a saved box, into `into`.
  void read_bytes(const Saved& saved, int64_t first, const at::Tensor& into) const {
    const fs::path& path = files_[saved.file];
    checked_->check(path.filename().string());
    std::ifstream in(path, std::ios::binary);
    const auto element = static_cast<int64_t>(into.element_size());
    in.seekg(static_cast<std::streamoff>(saved.at + first * element));
    if (!in || !in.read(static_cast<char*>(into.data_ptr()), static_cast<std::streamsize>(into.numel() * element)))
      throw RuntimeError("cannot read " + path.string());
  }

  fs::path dir_;
  CheckpointFiles* checked_;
  std::vector<fs::path> files_;
  std::map<std::string, Whole> tensors_;
};

// A model saved in pieces, for load_state's read step: the files checked
// against the model (its names under `prefix`; a tensor-parallel piece
// against its whole shape), and what this process keeps of each parameter
// and buffer read (dp's load_range under sharding, else everything this
// process holds: a tensor-parallel piece's box of the whole, or the whole).
inline std::map<std::string, at::Tensor> read_model_pieces(const torch::nn::Module& module, DataParallel* dp,
                                                           const tp::SplitTensors& split, const ShardedWeights& weights,
                                                           const std::string& prefix) {
  const auto held = state_dict(module);
  std::vector<std::pair<std::string, at::Tensor>> expected;  // (the whole shapes, of no memory)
  for (const auto& [name, tensor] : held)
    expected.emplace_back(name, split.contains(tensor)
                                    ? at::empty(split.whole_sizes(tensor), tensor.options().device(at::kMeta))
                                    : tensor);
  weights.check_fits(expected, prefix);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, tensor] : held) {
    const auto [begin, length] =
        dp ? dp->sharded_state_dict().load_range(tensor) : std::pair{int64_t{0}, tensor.numel()};
    out[name] = weights.read(prefix + name, begin, length, tensor.sizes().vec(), place_in_whole(split, tensor))
                    .to(tensor.device());
  }
  return out;
}
// ... and for its commit step, which cannot fail: the sharded parameters
// through dp (their shards, and the parameters where they are whole), the
// rest copied in.
inline void commit_model_pieces(const torch::nn::Module& module, DataParallel* dp,
                                const std::map<std::string, at::Tensor>& pieces) {
  const bool sharded = dp && dp->sharded();
  std::unordered_map<const c10::TensorImpl*, const at::Tensor*> by_tensor;
  at::NoGradGuard no_grad;
  for (const auto& [name, tensor] : state_dict(module)) {
    const at::Tensor& values = pieces.at(name);
    if (sharded && dp->shard_of(tensor).defined()) by_tensor[tensor.unsafeGetTensorImpl()] = &values;
    else tensor.detach().copy_(values.view(tensor.sizes()));
  }
  if (sharded)
    dp->sharded_state_dict().load_values([&](const at::Tensor& p) { return *by_tensor.at(p.unsafeGetTensorImpl()); });
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/optimizer_slots.hpp ============================
// accel/training/checkpoint/optimizer_slots.hpp: what each position of an optimizer's parameter list is in this run (a shard, a tensor-parallel piece, its names), and its state read from the piece files across tensor-parallel layouts.
//
// Loading an optimizer's state saved in another layout
// (checkpoint/reshard.hpp) cuts each tensor of the state to what this
// process keeps of the parameter at that position: OptimizerSlot says
// what that is. Across tensor-parallel layouts the tensors come from the
// piece files, where the saving processes placed them in the whole tensors
// under Python's names (checkpoint/shards.hpp): PlacedState reads them.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A position of an optimizer's parameter list (group after group), as this
// run holds it: the parameter (whole, or this process's tensor-parallel
// piece of it) and, where sharded, which piece of how many elements this
// process keeps of that (piece -1: all of it); its names in its model, and
// a tensor-parallel piece's place in the whole tensor (empty: whole).
struct OptimizerSlot {
  at::Tensor whole;
  int64_t piece = -1, length = 0;
  std::vector<std::string> names{};
  std::vector<int64_t> origin{};
  // The elements [begin, end) of the flattened parameter this process keeps.
  int64_t begin() const { return piece < 0 ? 0 : std::min(whole.numel(), piece * length); }
  int64_t end() const { return piece < 0 ? whole.numel() : std::min(whole.numel(), begin() + length); }
};

inline std::vector<OptimizerSlot> optimizer_slots(const PreparedSet& set, torch::optim::Optimizer& optimizer) {
  std::map<const c10::TensorImpl*, OptimizerSlot> known;  // by what the optimizer steps: a shard, or the parameter
  for (const auto& m : set.models) {
    const ParameterNames names(*m.module);
    const bool sharded = m.data_parallel && m.data_parallel->sharded();
    for (const auto& p : m.module->parameters()) {
      OptimizerSlot slot{p, -1, p.numel(), names.all(p), place_in_whole(m.split, p)};
      const at::Tensor shard = sharded ? m.data_parallel->shard_of(p) : at::Tensor();
      if (!shard.defined()) {
        known.emplace(p.unsafeGetTensorImpl(), std::move(slot));
        continue;
      }
      slot.piece = m.data_parallel->shard_group()->getRank();
      slot.length = shard.numel();
      known[shard.unsafeGetTensorImpl()] = std::move(slot);
    }
  }
  std::vector<OptimizerSlot> slots;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      const auto found = known.find(p.unsafeGetTensorImpl());
      slots.push_back(found != known.end() ? found->second : OptimizerSlot{p, -1, p.numel()});
    }
  return slots;
}

// Where a load across tensor-parallel layouts reads optimizer `index`'s
// tensor state (see the top): the piece files (null: the checkpoint has
// none).
struct PlacedState {
  const ShardedWeights* pieces = nullptr;
  std::size_t index = 0;

  // The saved name of field `field` of the parameter named `parameter`.
  std::string name(const std::string& parameter, const std::string& field) const {
    return optimizer_prefix(index) + parameter + "." + field;
  }
  // Field `field` of the slot's parameter as this process keeps it (like
  // `first`, the first file's: its dtype and device), or an error naming
  // `file` where the piece files do not hold it.
  at::Tensor cut(const OptimizerSlot& slot, const std::string& field, const at::Tensor& first,
                 const std::string& file) const {
    const int64_t begin = slot.begin(), length = slot.end() - slot.begin();
    at::Tensor values;
    for (const std::string& parameter : slot.names)
      if (const std::string saved = name(parameter, field); pieces && pieces->holds(saved)) {
        values = pieces->read(saved, begin, length, slot.whole.sizes().vec(), slot.origin).to(first.options());
        break;
      }
    if (!values.defined())
      throw RuntimeError(
          file + ": the optimizer's " + field + " of " +
          (slot.names.empty() ? "parameter of shape " + c10::str(slot.whole.sizes()) : "'" + slot.names.front() + "'") +
          " cannot move to another tensor-parallel layout: the piece files do not place it in the "
          "whole tensor (they do for Adam, AdamW and SGD); resume in the saving layout");
    if (slot.piece < 0) return values.view(slot.whole.sizes());
    at::Tensor padded = at::zeros({slot.length}, first.options());  // (a shard: the last one padded, as saved)
    padded.narrow(0, 0, length).copy_(values);
    return padded;
  }
};

}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/reshard.hpp ====================================
// accel/training/checkpoint/reshard.hpp: an optimizer's saved state cut again for this run's shards (4 -> 2, ZeRO <-> NO_SHARD).
//
// Under sharding each process saves its own optimizer state
// (optimizer_rank<k>.pt): for every sharded parameter of n elements, piece
// k of its flattened values, ceil(n / S) elements (S: the shard group's
// size; the last piece padded with zeros), as DataParallel shards it. With
// the model mesh row-major (mp_replicate, mp_shard), process k holds piece
// k mod S, so processes 0 .. S-1 hold every piece once. A run that shards
// another way (another S, another number of processes, NO_SHARD or one
// process, whose optimizer.pt is whole) needs other pieces: this part
// builds this process's from the saved ones, reading only the first file
// and those whose pieces overlap its own, and gives it to Optimizer::load as the archive it
// would have saved (torch/optim/serialize.h's layout).
//
// The rule for a tensor of a parameter's state (Adam's exp_avg, SGD's
// momentum_buffer, ...): one of the saved piece's size is a piece, one of
// the parameter's shape is whole; anything else (a step count, a scalar)
// is the same on every process and is taken from the first file as saved.
// Where this run does not shard a parameter, its state comes back whole, in
// the parameter's shape.
//
// Across tensor-parallel layouts (another tp, or tp on one side only) a
// process's optimizer file holds the state of its own pieces, which this
// cut cannot place; there each tensor of the state comes instead from the
// piece files, where every process wrote it placed in the whole tensor
// under Python's names (Adam's, AdamW's and SGD's: checkpoint/shards.hpp):
// this process reads its box of the whole (a tensor-parallel piece, or the
// whole) and of that its range. The rest (step counts, the groups' options)
// comes from the first file as saved.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// A checkpoint file read as an archive (checked and parsed by the caller),
// with its path for errors.
struct OpenedArchive {
  std::string file;
  torch::serialize::InputArchive archive;
};

// One saved optimizer file, read: its archive, and for each position its
// state's archive (none where the parameter had no state yet).
struct SavedOptimizer {
  std::string file;
  torch::serialize::InputArchive archive;
  std::vector<std::optional<torch::serialize::InputArchive>> states;
};

inline SavedOptimizer read_saved_optimizer(OpenedArchive opened, std::size_t slots) {
  SavedOptimizer saved{.file = std::move(opened.file), .archive = std::move(opened.archive), .states = {}};
  try {
    torch::serialize::InputArchive state, groups;
    saved.archive.read("state", state);
    saved.archive.read("param_groups", groups);
    at::Tensor count;
    groups.read("param_groups/size", count);
    for (int64_t g = 0; g < count.item<int64_t>(); ++g) {
      torch::serialize::InputArchive group;
      groups.read("param_groups/" + std::to_string(g), group);
      at::Tensor size;
      group.read("params/size", size);
      for (int64_t j = 0; j < size.item<int64_t>(); ++j) {
        c10::IValue key;
        group.read("params/" + std::to_string(j), key);
        torch::serialize::InputArchive own;
        saved.states.push_back(state.try_read(key.toStringRef(), own) ? std::optional(std::move(own)) : std::nullopt);
      }
    }
  } catch (const std::exception& e) {
    throw RuntimeError("cannot read " + saved.file + " as an optimizer's state: " + error_text(e));
  }
  if (saved.states.size() != slots)
    throw RuntimeError(saved.file + " holds the state of " + std::to_string(saved.states.size()) +
                       " parameters; this run's optimizer has " + std::to_string(slots));
  return saved;
}

// Elements [begin, end) of a parameter's flattened values into `out` (from
// its offset 0), out of the saved pieces (each `stride` elements: piece k
// starts at k * stride; undefined: not read, as not overlapping) or one
// whole tensor (stride n).
inline void copy_range(const std::vector<at::Tensor>& pieces, int64_t stride, int64_t begin, int64_t end,
                       at::Tensor& out) {
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    if (!pieces[k].defined()) continue;
    const int64_t from = std::max(begin, static_cast<int64_t>(k) * stride),
                  to = std::min(end, (static_cast<int64_t>(k) + 1) * stride);
    if (from < to)
      out.narrow(0, from - begin, to - from)
          .copy_(pieces[k].reshape({-1}).narrow(0, from - static_cast<int64_t>(k) * stride, to - from));
  }
}

// The saved pieces this process needs: those overlapping its own, and the
// first (the layout, step counts).
inline std::set<int64_t> pieces_needed(const std::vector<OptimizerSlot>& slots, int64_t saved_shards) {
  std::set<int64_t> needed{0};
  for (const auto& slot : slots) {
    const int64_t stride = (slot.whole.numel() + saved_shards - 1) / saved_shards;
    for (int64_t k = stride ? slot.begin() / stride : 0; stride && k * stride < slot.end() && k < saved_shards; ++k)
      needed.insert(k);
  }
  return needed;
}

using SavedFiles = std::vector<std::optional<SavedOptimizer>>;  // (by saved piece; empty: not needed)

// The state of parameter `position` as this process keeps it, into `own`:
// each field the size of the whole parameter, or of a saved piece, cut to
// this process's range out of the saved files that hold it; any other field
// (a step count) as the first file has it.
inline void reshard_state(SavedFiles& files, std::size_t position, const OptimizerSlot& slot, int64_t saved_shards,
                          torch::serialize::OutputArchive& own, const PlacedState* placed) {
  SavedOptimizer& first = *files[0];
  const int64_t n = slot.whole.numel(), stride = (n + saved_shards - 1) / saved_shards;
  torch::serialize::InputArchive& saved_state = *first.states[position];
  for (const std::string& field : saved_state.keys()) {
    c10::IValue value;
    saved_state.read(field, value);
    const at::Tensor t = value.isTensor() ? value.toTensor() : at::Tensor();
    if (placed && t.defined() && t.dim() > 0) {  // (across tensor-parallel layouts: placed in the whole)
      own.write(field, placed->cut(slot, field, t, first.file));
      continue;
    }
    const bool whole = t.defined() && t.sizes() == slot.whole.sizes();
    const bool piece = t.defined() && saved_shards > 1 && t.dim() == 1 && t.numel() == stride && !whole;
    if (!whole && !piece) {  // the same on every process: as saved
      own.write(field, value);
      continue;
    }
    std::vector<at::Tensor> sources(piece ? files.size() : 1);
    for (std::size_t k = 0; k < sources.size(); ++k) {
      if (!files[k]) continue;
      c10::IValue other;
      if (k == 0) other = value;
      else if (!files[k]->states[position] || !files[k]->states[position]->try_read(field, other) ||
               !other.isTensor() || other.toTensor().numel() != stride)
        throw RuntimeError(files[k]->file + " has no " + field + " of " + std::to_string(stride) +
                           " elements for parameter " + std::to_string(position) + " (as " + first.file + " has)");
      sources[k] = other.toTensor();
    }
    at::Tensor mine = at::zeros({slot.piece < 0 ? n : slot.length}, t.options());
    copy_range(sources, piece ? stride : n, slot.begin(), slot.end(), mine);
    own.write(field, slot.piece < 0 ? mine.view(slot.whole.sizes()) : mine);
  }
}

// Parameter group g as the first file has it (its keys name the states,
// written into `state`), its options through the optimizer's own options
// type (what they are is the optimizer's business). `position` counts the
// parameters of the groups before it.
inline torch::serialize::OutputArchive reshard_group(torch::optim::Optimizer& optimizer, std::size_t g,
                                                     torch::serialize::InputArchive& saved_groups, SavedFiles& files,
                                                     const std::vector<OptimizerSlot>& slots, int64_t saved_shards,
                                                     std::size_t& position, torch::serialize::OutputArchive& state,
                                                     const PlacedState* placed) {
  const SavedOptimizer& first = *files[0];
  torch::serialize::InputArchive saved_group, saved_options;
  saved_groups.read("param_groups/" + std::to_string(g), saved_group);
  torch::serialize::OutputArchive group(state.compilation_unit()), options(state.compilation_unit());
  at::Tensor size;
  saved_group.read("params/size", size);
  if (size.item<int64_t>() != static_cast<int64_t>(optimizer.param_groups()[g].params().size()))
    throw RuntimeError(first.file + ": parameter group " + std::to_string(g) + " holds " +
                       std::to_string(size.item<int64_t>()) + " parameters; this run's has " +
                       std::to_string(optimizer.param_groups()[g].params().size()));
  group.write("params/size", size);
  for (int64_t j = 0; j < size.item<int64_t>(); ++j, ++position) {
    c10::IValue key;
    saved_group.read("params/" + std::to_string(j), key);
    group.write("params/" + std::to_string(j), key);
    if (!first.states[position]) continue;  // no state yet (never stepped)
    torch::serialize::OutputArchive own(state.compilation_unit());
    reshard_state(files, position, slots[position], saved_shards, own, placed);
    state.write(key.toStringRef(), own);
  }
  saved_group.read("options", saved_options);
  const auto& current = optimizer.param_groups()[g];
  std::unique_ptr<torch::optim::OptimizerOptions> copy =
      (current.has_options() ? current.options() : optimizer.defaults()).clone();
  copy->serialize(saved_options);
  copy->serialize(options);
  group.write("options", options);
  return group;
}

// The saved state of optimizer `index` as this process's optimizer takes it
// (an archive for Optimizer::load and load_group_options). `saved_shards`:
// how many pieces the saving run cut each parameter into (1: whole, in
// `open(0)`); `open(k)`: the file of the process that held piece k. With
// `placed` (across tensor-parallel layouts) only the first file is read,
// the tensors of the state from the piece files.
inline std::unique_ptr<torch::serialize::InputArchive> resharded_optimizer(
    const PreparedSet& set, std::size_t index, int64_t saved_shards, c10::Device device,
    const std::function<OpenedArchive(int64_t)>& open, const PlacedState* placed = nullptr) {
  torch::optim::Optimizer& optimizer = *set.optimizers[index];
  const std::vector<OptimizerSlot> slots = optimizer_slots(set, optimizer);
  SavedFiles files(static_cast<std::size_t>(saved_shards));
  for (const int64_t k : placed ? std::set<int64_t>{0} : pieces_needed(slots, saved_shards))
    files[static_cast<std::size_t>(k)] = read_saved_optimizer(open(k), slots.size());
  SavedOptimizer& first = *files[0];

  torch::serialize::OutputArchive out, state(out.compilation_unit()), groups(out.compilation_unit());
  c10::IValue version;
  first.archive.read("pytorch_version", version);
  out.write("pytorch_version", version);
  torch::serialize::InputArchive saved_groups;
  first.archive.read("param_groups", saved_groups);
  at::Tensor group_count;
  saved_groups.read("param_groups/size", group_count);
  if (group_count.item<int64_t>() != static_cast<int64_t>(optimizer.param_groups().size()))
    throw RuntimeError(first.file + " holds " + std::to_string(group_count.item<int64_t>()) +
                       " parameter groups; this run's optimizer has " +
                       std::to_string(optimizer.param_groups().size()));
  groups.write("param_groups/size", group_count);
  std::size_t position = 0;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    torch::serialize::OutputArchive group =
        reshard_group(optimizer, g, saved_groups, files, slots, saved_shards, position, state, placed);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  if (position != slots.size())
    throw RuntimeError(first.file + " holds the state of " + std::to_string(position) +
                       " parameters; this run's optimizer has " + std::to_string(slots.size()));
  out.write("state", state);
  out.write("param_groups", groups);
  std::ostringstream bytes;
  out.save_to(bytes);
  const std::string held = std::move(bytes).str();
  auto archive = std::make_unique<torch::serialize::InputArchive>();
  archive->load_from(held.data(), held.size(), device);
  return archive;
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/item.hpp =======================================
// accel/training/checkpoint/item.hpp: what one artifact of a checkpoint does in each phase of a save and a load, and what each phase hands it.
//
// A checkpoint is a list of items, one per artifact (a model, the sharded
// pieces, each optimizer, scheduler and registered object, the loaders'
// places, the loss scaler, this process's RNG states); the driver
// (checkpoint/state.hpp) runs each phase over the whole list, with the
// collectives between phases, and writes the manifest last. An item does
// its own artifact only, and every phase but write_* is optional:
//
//   write_own     every process: files of its own (RNG states, its pieces)
//   write_shared  process 0: the files of all (whole models, ...)
//   read          read and check what it will load; changes nothing
//   keep          before any item applies: what roll_back puts back
//   apply         load what can refuse as it loads
//   roll_back     some process refused: put back what keep kept
//   commit        load what read checked, and cannot fail

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What a write phase hands an item: where it writes (the checkpoint's DIR.tmp)
// and the log of files written, which goes into the manifest.
struct ItemWriter {
  const CheckpointContext& ctx;
  const std::filesystem::path& dir;
  const std::string& id;  // the checkpoint's, which every piece file carries
  FileLog& log;

  void save(torch::serialize::OutputArchive& archive, const std::string& name) const {
    log.emplace_back(name, save_archive(archive, dir / name));
  }
};

// The saving run's layout, read off the manifest: the number of processes
// and the ways the optimizer state was sharded may differ from this run's
// (checkpoint/world.hpp, checkpoint/reshard.hpp).
struct SavedLayout {
  int processes = 1;
  int64_t shards = 1;  // ways its optimizer state is sharded (1: whole, in optimizer.pt)
  CheckpointManifest manifest;
};

// What the read phase hands an item: the files (each checked against its
// digest, in the background, by `files`), the saving run's layout, and
// where to leave warnings that are given once the load is committed.
class ItemReader {
 public:
  ItemReader(const CheckpointContext& context, const std::filesystem::path& directory, const SavedLayout& layout,
             CheckpointFiles& files)
      : ctx(context), dir(directory), saved(layout), files_(files) {}

  const CheckpointContext& ctx;
  const std::filesystem::path& dir;
  const SavedLayout& saved;
  std::vector<std::string> warnings;  // (a loader's place, checkpoint_world)

  // The archive `name`, checked against the manifest's record.
  std::unique_ptr<torch::serialize::InputArchive> read(const std::string& name) {
    const std::filesystem::path file = files_.check(name);
    auto archive = std::make_unique<torch::serialize::InputArchive>();
    try {
      archive->load_from(file.string(), ctx.device);
    } catch (const std::exception& e) {
      throw RuntimeError("cannot read " + file.string() + ": " + error_text(e));
    }
    return archive;
  }
  // A tensor of the given dtype and shape under `key`, or an error naming the file.
  static at::Tensor tensor(torch::serialize::InputArchive& archive, const char* key, at::ScalarType dtype,
                           at::IntArrayRef sizes, const std::string& file) {
    at::Tensor value;
    if (!archive.try_read(key, value) || value.scalar_type() != dtype || value.sizes() != sizes)
      throw RuntimeError(file + " has no " + key + " of " + c10::toString(dtype) + c10::str(sizes));
    return value;
  }
  // The sharded models' pieces (*.safetensors), indexed once for every model read from them.
  const ShardedWeights& pieces(const std::string& missing_whole) {
    if (const ShardedWeights* found = pieces_if_any()) return *found;
    throw RuntimeError("missing " + missing_whole + " (and no sharded model's pieces, *.safetensors, beside it)");
  }
  // ... or none where the checkpoint has no piece files.
  const ShardedWeights* pieces_if_any() {
    namespace fs = std::filesystem;
    if (!pieces_) {
      const auto found = fs::directory_iterator(dir);
      if (std::none_of(fs::begin(found), fs::end(found),
                       [](const auto& entry) { return entry.path().extension() == ".safetensors"; }))
        return nullptr;
      pieces_.emplace(dir, files_);
    }
    return &*pieces_;
  }

 private:
  CheckpointFiles& files_;
  std::optional<ShardedWeights> pieces_;
};

// One artifact of a checkpoint (the phases at the top of this part).
class CheckpointItem {
 public:
  virtual ~CheckpointItem() = default;
  virtual void write_own(const ItemWriter&) {}
  virtual void write_shared(const ItemWriter&) {}
  virtual void read(ItemReader&) {}
  virtual void keep() {}
  virtual void apply() {}
  virtual void roll_back() {}
  virtual void commit() {}
};
using CheckpointItems = std::vector<std::unique_ptr<CheckpointItem>>;

// An item's apply step: where the artifact itself refuses what was read (a
// file saved from another optimizer, scheduler or object), the error names
// the file and what it was meant for.
template <class Apply>
void apply_or_name_file(const std::string& file, const char* artifact, Apply&& apply) {
  try {
    apply();
  } catch (const std::exception& e) {
    throw RuntimeError(file + " does not fit the " + artifact + ": " + error_text(e));
  }
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/model_items.hpp ================================
// accel/training/checkpoint/model_items.hpp: the models in a checkpoint: each model whole (model_<i>.pt), or the sharded models' pieces every process writes.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Prepared model i. Written whole by process 0 unless it is saved in
// pieces (ShardedPiecesItem writes those); read back from whichever the
// checkpoint holds, so that a model saved sharded loads unsharded and the
// other way round (checkpoint/sharded_weights.hpp).
class ModelItem final : public CheckpointItem {
 public:
  ModelItem(PreparedSet& set, std::size_t i) : model_(set.models[i]), i_(i), in_pieces_(saved_in_pieces(set, i)) {}

  void write_shared(const ItemWriter& out) override {
    if (in_pieces_) return;
    torch::serialize::OutputArchive archive;
    model_.module->save(archive);
    out.save(archive, file_names::model(i_));
  }
  void read(ItemReader& in) override {
    const std::filesystem::path whole = in.dir / file_names::model(i_);
    if (std::filesystem::exists(whole)) {
      archive_ = in.read(file_names::model(i_));
      check_module_archive(*model_.module, *archive_, "", whole.string());
    } else {
      pieces_ = read_model_pieces(*model_.module, model_.data_parallel.get(), model_.split, in.pieces(whole.string()),
                                  model_prefix(i_));
    }
  }
  void commit() override {
    DataParallel* dp = model_.data_parallel.get();
    if (!archive_) return commit_model_pieces(*model_.module, dp, pieces_);
    const bool sharded = dp && dp->sharded();
    if (sharded) dp->sharded_state_dict().open_for_load();
    model_.module->load(*archive_);
    if (sharded) dp->sharded_state_dict().reshard();
  }

 private:
  PreparedModel& model_;
  std::size_t i_;
  bool in_pieces_;
  std::unique_ptr<torch::serialize::InputArchive> archive_;  // read whole,
  std::map<std::string, at::Tensor> pieces_;                 // else what this process keeps of each piece
};

// The pieces of the models saved in pieces (sharded, or holding
// tensor-parallel pieces) and their optimizers' state, as Python's DCP
// reads them (checkpoint/shards.hpp): every process writes its own. C++
// reads them back through ModelItem (the models) and OptimizerItem (its
// own archives, which hold the optimizer state too).
class ShardedPiecesItem final : public CheckpointItem {
 public:
  explicit ShardedPiecesItem(PreparedSet& set) : set_(set) {}
  void write_own(const ItemWriter& out) override {
    for (std::size_t i = 0; i < set_.models.size(); ++i)
      if (saved_in_pieces(set_, i)) return write_pieces(set_, out.ctx.process_index, out.dir, out.id, out.log);
  }

 private:
  PreparedSet& set_;
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/state_items.hpp ================================
// accel/training/checkpoint/state_items.hpp: the training state in a checkpoint, an item each: optimizers, schedulers, registered objects, the loaders' places, the loss scaler, this process's RNG states.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Prepared optimizer i: written whole by process 0, or under sharding or
// tensor parallelism each process its own state; read as saved where this
// run shards it the same way (or keeps it whole), else cut again from the
// saved pieces, piece k in process k's file; across tensor-parallel
// layouts from the state the piece files place in the whole tensors
// (checkpoint/reshard.hpp). It can refuse as it loads, and is put back if
// any process refuses anything.
class OptimizerItem final : public CheckpointItem {
 public:
  OptimizerItem(PreparedSet& set, const CheckpointContext& ctx, std::size_t i)
      : set_(set), optimizer_(*set.optimizers[i]), i_(i), name_(optimizer_file(set, ctx, i)) {}

  void write_own(const ItemWriter& out) override {
    if (optimizers_per_process(set_, out.ctx)) save(out);
  }
  void write_shared(const ItemWriter& out) override {
    if (!optimizers_per_process(set_, out.ctx)) save(out);
  }
  void read(ItemReader& in) override {
    const SavedLayout& saved = in.saved;
    file_ = (in.dir / name_).string();
    const bool same_processes = saved.processes == in.ctx.num_processes;
    const bool tp = saved.manifest.tp > 1 || in.ctx.tp > 1;
    const bool as_saved = saved.shards == in.ctx.shards && saved.manifest.tp == in.ctx.tp &&
                          ((saved.shards == 1 && !tp) || same_processes);
    if (as_saved) {
      archive_ = in.read(name_);
      return;
    }
    const bool per_process = saved.shards > 1 || saved.manifest.tp > 1;  // (the saving run's files)
    const PlacedState placed{tp ? in.pieces_if_any() : nullptr, i_};
    archive_ = resharded_optimizer(
        set_, i_, tp ? 1 : saved.shards, in.ctx.device,
        [&](int64_t k) {
          const std::string name = file_names::optimizer(i_, per_process ? static_cast<int>(k) : -1);
          return OpenedArchive{(in.dir / name).string(), std::move(*in.read(name))};
        },
        tp ? &placed : nullptr);
  }
  void keep() override { snapshot_ = optimizer_snapshot(optimizer_); }
  void apply() override {
    apply_or_name_file(file_, "optimizer", [&] {
      optimizer_.load(*archive_);
      load_group_options(optimizer_, *archive_);
    });
  }
  void roll_back() override {
    if (snapshot_) restore_optimizer(optimizer_, *snapshot_);
  }

 private:
  void save(const ItemWriter& out) {
    torch::serialize::OutputArchive archive;
    optimizer_.save(archive);
    out.save(archive, name_);
  }

  PreparedSet& set_;
  torch::optim::Optimizer& optimizer_;
  std::size_t i_;
  std::string name_, file_;  // the file's name, and its path once read
  std::unique_ptr<torch::serialize::InputArchive> archive_;
  std::optional<std::string> snapshot_;  // what it had before the load
};

// Prepared scheduler i: its step count, and its own state where it has a
// save() of its own. A scheduler with a load() of its own checks what it
// loads as it loads it; the others replay their missing steps, which sets
// the optimizers' learning rates the way the saved run did (the
// optimizers' own state comes after). Neither can be put back.
class SchedulerItem final : public CheckpointItem {
 public:
  SchedulerItem(PreparedScheduler& scheduler, std::size_t i) : scheduler_(scheduler), name_(file_names::scheduler(i)) {}

  void write_shared(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    archive.write("steps", at::scalar_tensor(*scheduler_.steps, at::kLong));
    if (scheduler_.save) {
      torch::serialize::OutputArchive own;
      scheduler_.save(own);
      archive.write("own", own);
    }
    out.save(archive, name_);
  }
  void read(ItemReader& in) override {
    archive_ = in.read(name_);
    file_ = (in.dir / name_).string();
    steps_ = ItemReader::tensor(*archive_, "steps", at::kLong, {}, file_).item<int64_t>();
    torch::serialize::InputArchive own;
    if (scheduler_.load && !archive_->try_read("own", own))
      throw RuntimeError(file_ + " has no state of the scheduler's own save()");
    if (!scheduler_.load && steps_ < *scheduler_.steps)
      throw RuntimeError(file_ + ": the scheduler took " + std::to_string(steps_) +
                         " steps; this one has already taken " + std::to_string(*scheduler_.steps) +
                         " (load the checkpoint before stepping it)");
  }
  void apply() override {
    apply_or_name_file(file_, "scheduler", [&] {
      if (scheduler_.load) {
        torch::serialize::InputArchive own;
        archive_->read("own", own);
        scheduler_.load(own);
      } else {
        for (int64_t k = *scheduler_.steps; k < steps_; ++k) scheduler_.step();
      }
      *scheduler_.steps = steps_;
    });
  }

 private:
  PreparedScheduler& scheduler_;
  std::string name_, file_;
  std::unique_ptr<torch::serialize::InputArchive> archive_;
  int64_t steps_ = 0;
};

// Registered object i (register_for_checkpointing): its own save and load,
// which checks what it loads as it loads it.
class ObjectItem final : public CheckpointItem {
 public:
  ObjectItem(CheckpointedObject& object, std::size_t i) : object_(object), name_(file_names::custom_object(i)) {}

  void write_shared(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    object_.save(archive);
    out.save(archive, name_);
  }
  void read(ItemReader& in) override {
    archive_ = in.read(name_);
    file_ = (in.dir / name_).string();
  }
  void apply() override {
    apply_or_name_file(file_, "registered object", [&] { object_.load(*archive_); });
  }

 private:
  CheckpointedObject& object_;
  std::string name_, file_;
  std::unique_ptr<torch::serialize::InputArchive> archive_;
};

// Every prepared loader's resume point (epoch, batches to skip) and samples
// per batch, one file for all; read back converted to this run's batches
// (checkpoint/world.hpp).
class LoadersItem final : public CheckpointItem {
 public:
  explicit LoadersItem(std::vector<std::shared_ptr<LoaderPosition>>& loaders) : loaders_(loaders) {}

  void write_shared(const ItemWriter& out) override {
    if (loaders_.empty()) return;
    std::vector<int64_t> points, per_batch;
    for (const auto& loader : loaders_) {
      const auto [epoch, skip] = loader->resume_point();
      points.insert(points.end(), {static_cast<int64_t>(epoch), static_cast<int64_t>(skip)});
      per_batch.push_back(static_cast<int64_t>(loader->samples_per_batch));
    }
    torch::serialize::OutputArchive archive;
    archive.write("resume_points", at::tensor(points).reshape({static_cast<int64_t>(loaders_.size()), 2}));
    archive.write("samples_per_batch", at::tensor(per_batch));  // (0: not known) by which a place carries over
    out.save(archive, file_names::loaders);
  }
  void read(ItemReader& in) override;
  void commit() override {
    for (std::size_t i = 0; i < loaders_.size(); ++i) {
      const auto row = static_cast<int64_t>(i);  // (the place in this run's batches: read converted it)
      loaders_[i]->resume_at(static_cast<size_t>(points_[row][0].item<int64_t>()),
                             static_cast<size_t>(points_[row][1].item<int64_t>()));
    }
  }

 private:
  std::vector<std::shared_ptr<LoaderPosition>>& loaders_;
  at::Tensor points_;
};

inline void LoadersItem::read(ItemReader& in) {
  if (loaders_.empty()) return;
  const std::string file = (in.dir / file_names::loaders).string();
  auto archive = in.read(file_names::loaders);
  const auto n = static_cast<int64_t>(loaders_.size());
  points_ = ItemReader::tensor(*archive, "resume_points", at::kLong, {n, 2}, file);
  at::Tensor saved_per_batch;
  const bool same_processes = in.saved.processes == in.ctx.num_processes;
  if (archive->try_read("samples_per_batch", saved_per_batch))
    saved_per_batch = ItemReader::tensor(*archive, "samples_per_batch", at::kLong, {n}, file);
  else if (!same_processes)
    throw RuntimeError(file +
                       " does not say how many samples its loaders read per batch (an older accel.hpp saved it): "
                       "load it with as many processes as saved it (" +
                       std::to_string(in.saved.processes) + ")");
  for (int64_t i = 0; saved_per_batch.defined() && i < n; ++i) {
    ResumedBatches resumed = resumed_batches(
        static_cast<std::size_t>(i), static_cast<size_t>(points_[i][1].item<int64_t>()),
        saved_per_batch[i].item<int64_t>(), loaders_[static_cast<std::size_t>(i)]->samples_per_batch, same_processes);
    points_[i][1].fill_(static_cast<int64_t>(resumed.batches));
    if (!resumed.warning.empty()) in.warnings.push_back(std::move(resumed.warning));
  }
}

// mixed_precision "fp16"'s loss scaler: the scale and growth tracker, the
// same on every process (each step's overflow check is agreed).
class ScalerItem final : public CheckpointItem {
 public:
  explicit ScalerItem(std::shared_ptr<GradScaler> scaler) : scaler_(std::move(scaler)) {}

  void write_shared(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    archive.write("scale", at::scalar_tensor(scaler_->get_scale(), at::kDouble));
    archive.write("growth_tracker", at::scalar_tensor(scaler_->growth_tracker(), at::kLong));
    out.save(archive, file_names::scaler);
  }
  void read(ItemReader& in) override {
    const std::string file = (in.dir / file_names::scaler).string();
    if (!std::filesystem::exists(in.dir / file_names::scaler))
      throw RuntimeError("missing " + file + " (this run has fp16's loss scaler; the saving run had none)");
    auto archive = in.read(file_names::scaler);
    scale_ = ItemReader::tensor(*archive, "scale", at::kDouble, {}, file).item<double>();
    growth_tracker_ = ItemReader::tensor(*archive, "growth_tracker", at::kLong, {}, file).item<int64_t>();
  }
  void commit() override { scaler_->load_state(scale_, growth_tracker_); }

 private:
  std::shared_ptr<GradScaler> scaler_;
  double scale_ = 0;
  int64_t growth_tracker_ = 0;
};

// This process's RNG states and the accumulation step (Accelerate's
// random_states_<i>), or where the saving run had fewer processes, one to
// seed a stream of its own from (checkpoint/world.hpp).
class RandomStatesItem final : public CheckpointItem {
 public:
  explicit RandomStatesItem(int64_t step) : step_(step) {}
  // The accumulation step: the one saved, once read.
  int64_t step() const { return step_; }

  void write_own(const ItemWriter& out) override {
    torch::serialize::OutputArchive archive;
    archive.write("cpu", at::detail::getDefaultCPUGenerator().get_state());
    if (out.ctx.device.is_cuda())
      archive.write("cuda", at::globalContext().defaultGenerator(out.ctx.device).get_state());
    archive.write("step", at::scalar_tensor(step_, at::kLong));
    out.save(archive, file_names::random_states(out.ctx.process_index));
  }
  void read(ItemReader& in) override;
  void commit() override;

 private:
  int64_t step_;
  c10::Device device_{c10::kCPU};
  int process_index_ = 0;
  at::Tensor rng_, device_rng_;  // device_rng_: the CUDA generator's, where both runs had one
  bool derived_ = false;         // the saving run had no process of this index: seed from rng_
};

inline void RandomStatesItem::read(ItemReader& in) {
  device_ = in.ctx.device;
  process_index_ = in.ctx.process_index;
  const int saved_process = saved_process_for(process_index_, in.saved.processes);
  derived_ = saved_process != process_index_;
  const std::string name = file_names::random_states(saved_process), file = (in.dir / name).string();
  if (!std::filesystem::exists(in.dir / name)) throw RuntimeError("missing " + file);
  auto archive = in.read(name);
  const at::Tensor current = at::detail::getDefaultCPUGenerator().get_state();
  rng_ = ItemReader::tensor(*archive, "cpu", current.scalar_type(), current.sizes(), file);
  step_ = ItemReader::tensor(*archive, "step", at::kLong, {}, file).item<int64_t>();
  at::Tensor saved_device_rng;
  if (device_.is_cuda() && archive->try_read("cuda", saved_device_rng)) {
    const at::Tensor now = at::globalContext().defaultGenerator(device_).get_state();
    device_rng_ = ItemReader::tensor(*archive, "cuda", now.scalar_type(), now.sizes(), file);
  }
}

// A generator's state is a CPU byte tensor, the CUDA generator's too; the
// archives were read onto the training device, so it comes back first.
inline void RandomStatesItem::commit() {
  auto set_state = [](at::Generator generator, const at::Tensor& state) {
    std::lock_guard lock(generator.mutex());
    generator.set_state(state.cpu());
  };
  if (!derived_) {
    set_state(at::detail::getDefaultCPUGenerator(), rng_);
    if (device_rng_.defined()) set_state(at::globalContext().defaultGenerator(device_), device_rng_);
    return;
  }
  const uint64_t seed = derived_seed(rng_, process_index_);
  auto reseed = [seed](at::Generator generator) {
    std::lock_guard lock(generator.mutex());
    generator.set_current_seed(seed);
  };
  reseed(at::detail::getDefaultCPUGenerator());
  if (device_.is_cuda()) reseed(at::globalContext().defaultGenerator(device_));
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/from_python.hpp ================================
// accel/training/checkpoint/from_python.hpp: load_state of a checkpoint Python's dcp.save wrote through HuggingFaceStorageWriter: the models, and the optimizers' state under Python's names.
//
// A run started in Python (FSDP2, DTensor tensor parallelism, at any
// number of processes) goes on in C++ from what Python saves with
//
//     dcp.save({**get_model_state_dict(model),
//               "optimizer": {"state": get_optimizer_state_dict(model, optimizer)["state"]}},
//              storage_writer=HuggingFaceStorageWriter(DIR, save_distributed=True))
//
// consolidated or not (but torch 2.15's consolidation writes every 0-d
// tensor as zero, Adam's step counts among them: a step of 0 is refused,
// naming the pieces it consolidated). DCP flattens those names as our own
// piece files name their tensors (checkpoint/shards.hpp): the model's
// under its state_dict names, then "optimizer.state.<parameter>.<field>" in
// Python's fields (Adam's and AdamW's exp_avg, exp_avg_sq, max_exp_avg_sq
// and step; SGD's momentum_buffer). So the files are read through the same
// ShardedWeights, each tensor cut to what this process keeps (its shard,
// its tensor-parallel piece), into LibTorch's state types.
//
// What such a directory cannot hold is not loaded: HuggingFaceStorageWriter
// stores tensors only (anything else, such as the optimizer's param_groups,
// it pickles into a file it still names .safetensors, which Python's own
// reader cannot read back either: torch 2.15), so the optimizers' options
// (learning rate, ...) stay this run's, and the schedulers, the loaders'
// places, registered objects, the loss scaler and the RNG states are not
// in it: they stay as they are, and process 0 warns, naming them.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// Whether dir is a checkpoint written outside accel.hpp: no manifest, and
// safetensors files none of which is accel's (Python's dcp.save, or a
// model's weights as Hugging Face and save_model write them). A file named
// .safetensors that is a zip archive throws: what the writer pickles.
inline bool written_outside_accel(const fs::path& dir) {
  if (!fs::is_directory(dir) || fs::exists(dir / file_names::manifest)) return false;
  bool any = false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    char magic[4] = {};
    if (!in.read(magic, 4)) return false;
    if (std::string_view(magic, 4) == std::string_view("PK\x03\x04", 4))
      throw RuntimeError(entry.path().string() +
                         " is a zip archive (torch.save's), not safetensors: Python's HuggingFaceStorageWriter "
                         "pickles what is not a tensor (an optimizer's param_groups, ...) into such a file, which "
                         "neither Python's reader nor accel.hpp reads back. Save the tensors alone: "
                         "{\"optimizer\": {\"state\": get_optimizer_state_dict(model, optimizer)[\"state\"]}}");
    in.seekg(0);
    try {
      if (read_safetensors_header(in, entry.path()).metadata.count(PieceFiles::kCheckpointIdKey)) return false;
    } catch (const std::exception&) {  // (damaged: the plain error of a missing manifest)
      return false;
    }
    any = true;
  }
  return any;
}

// What a load from such a directory reads it as: no digests recorded (the
// files are read unchecked), this run's layout.
inline SavedLayout outside_layout(const CheckpointContext& ctx) {
  CheckpointManifest unrecorded;
  unrecorded.format = 1;
  unrecorded.processes = ctx.num_processes;
  return {ctx.num_processes, 1, unrecorded};
}

// The per-parameter state Python's optimizer of the same kind keeps, read
// into LibTorch's: one state per tensor the optimizer steps (none where the
// files hold no state of that parameter: Python's optimizer had not stepped
// it), each tensor cut to what this process keeps.
class PythonOptimizerState {
 public:
  using States = std::vector<std::pair<c10::TensorImpl*, std::unique_ptr<torch::optim::OptimizerParamState>>>;

  PythonOptimizerState(const PreparedSet& set, std::size_t index, const ShardedWeights& pieces, std::string dir)
      : optimizer_(*set.optimizers[index]), pieces_(pieces), placed_{&pieces, index}, dir_(std::move(dir)) {
    const std::string prefix = optimizer_prefix(index);
    for (const std::string& name : pieces.names())
      if (name.starts_with(prefix)) unread_.insert(name);
    if (unread_.empty())
      throw RuntimeError(dir_ + " holds no state of optimizer " + std::to_string(index) + " (no tensor under " +
                         prefix +
                         "): a model's weights alone, which load_model loads (Accelerator::load_model for a "
                         "prepared model); to go on with Python's optimizer, save " +
                         "get_optimizer_state_dict(model, optimizer)[\"state\"] under \"" +
                         prefix.substr(0, prefix.size() - 7) + "\" beside the model");
    const std::vector<OptimizerSlot> slots = optimizer_slots(set, optimizer_);
    std::size_t position = 0;
    for (const auto& group : optimizer_.param_groups())
      for (const auto& p : group.params()) {
        auto state = read(slots[position++], p, group);
        if (state) states_.emplace_back(p.unsafeGetTensorImpl(), std::move(state));
      }
    if (!unread_.empty())
      throw RuntimeError(dir_ + " holds " + *unread_.begin() + ", which this run's optimizer (" + kind() +
                         ") does not keep for any of its parameters: saved from another kind of optimizer, or "
                         "another model?");
  }

  // The states, taken once (they move into the optimizer).
  States take() { return std::move(states_); }

 private:
  std::unique_ptr<torch::optim::OptimizerParamState> read(const OptimizerSlot& slot, const at::Tensor& p,
                                                          const torch::optim::OptimizerParamGroup& group) {
    const auto& options = group.has_options() ? group.options() : optimizer_.defaults();
    if (dynamic_cast<torch::optim::Adam*>(&optimizer_))
      return adam_like<torch::optim::AdamParamState>(slot, p,
                                                     static_cast<const torch::optim::AdamOptions&>(options).amsgrad());
    if (dynamic_cast<torch::optim::AdamW*>(&optimizer_))
      return adam_like<torch::optim::AdamWParamState>(
          slot, p, static_cast<const torch::optim::AdamWOptions&>(options).amsgrad());
    if (dynamic_cast<torch::optim::SGD*>(&optimizer_)) {
      const std::optional<std::string> buffer = saved(slot, "momentum_buffer");
      if (!buffer) return nullptr;  // (Python's SGD without momentum keeps none)
      auto state = std::make_unique<torch::optim::SGDParamState>();
      state->momentum_buffer(cut(slot, "momentum_buffer", p));
      return state;
    }
    throw RuntimeError(dir_ +
                       ": load_state reads the state of Adam, AdamW and SGD from Python's checkpoints (the "
                       "fields Python's optimizers of those kinds keep); this run's optimizer is " +
                       kind());
  }

  template <class State>
  std::unique_ptr<torch::optim::OptimizerParamState> adam_like(const OptimizerSlot& slot, const at::Tensor& p,
                                                               bool amsgrad) {
    std::vector<const char*> fields{"step", "exp_avg", "exp_avg_sq"};
    if (amsgrad) fields.push_back("max_exp_avg_sq");
    std::size_t found = 0;
    for (const char* field : fields) found += saved(slot, field).has_value();
    if (found == 0) return nullptr;  // never stepped
    for (const char* field : fields)
      if (!saved(slot, field))
        throw RuntimeError(
            dir_ + " holds part of the state of '" + slot.names.front() + "' and not its " + field +
            (std::string_view(field) == "max_exp_avg_sq" ? " (this run's optimizer has amsgrad on)" : ""));
    const std::string step = *saved(slot, "step");
    const double count = pieces_.read(step, 0, 1).item<double>();
    if (count < 0 || count != std::floor(count))
      throw RuntimeError(dir_ + ": " + step + " is " + std::to_string(count) + ", not a count of steps");
    if (count == 0)  // (Python makes the state as it takes the first step: 1 at least)
      throw RuntimeError(dir_ + ": " + step +
                         " is 0 beside its moments: torch's consolidation (HuggingFaceStorageWriter's "
                         "enable_consolidation, torch 2.15) writes every 0-d tensor as zero. Load the pieces it "
                         "consolidated instead (" +
                         dir_ + "/sharded where the save gave no consolidation_output_path)");
    auto state = std::make_unique<State>();
    state->step(static_cast<int64_t>(count));
    state->exp_avg(cut(slot, "exp_avg", p));
    state->exp_avg_sq(cut(slot, "exp_avg_sq", p));
    if (amsgrad) state->max_exp_avg_sq(cut(slot, "max_exp_avg_sq", p));
    return state;
  }

  // The saved name of the slot's field (under any of its parameter's names),
  // marked read; none if the files lack it.
  std::optional<std::string> saved(const OptimizerSlot& slot, const std::string& field) {
    for (const std::string& name : slot.names)
      if (const std::string full = placed_.name(name, field); pieces_.holds(full)) {
        unread_.erase(full);
        return full;
      }
    return std::nullopt;
  }
  at::Tensor cut(const OptimizerSlot& slot, const std::string& field, const at::Tensor& stepped) const {
    return placed_.cut(slot, field, stepped, dir_);
  }
  std::string kind() const { return c10::demangle(typeid(optimizer_).name()); }

  torch::optim::Optimizer& optimizer_;
  const ShardedWeights& pieces_;
  PlacedState placed_;
  std::string dir_;
  std::set<std::string> unread_;  // the files' names of this optimizer not yet read
  States states_;
};

// Prepared optimizer i, from a directory Python's dcp.save wrote: read and
// checked in the read phase, put in place at commit (which cannot fail).
class PythonOptimizerItem final : public CheckpointItem {
 public:
  PythonOptimizerItem(PreparedSet& set, std::size_t i) : set_(set), i_(i) {}
  void read(ItemReader& in) override {
    states_ = PythonOptimizerState(set_, i_, in.pieces(in.dir.string()), in.dir.string()).take();
  }
  void commit() override {
    auto& state = set_.optimizers[i_]->state();
    state.clear();  // (a parameter without saved state has none, as in Python's)
    for (auto& [parameter, saved] : states_) state[dp::state_key(state, parameter)] = std::move(saved);
    states_.clear();
  }

 private:
  PreparedSet& set_;
  std::size_t i_;
  PythonOptimizerState::States states_;
};

// Every tensor of such a directory is taken by something this run
// prepared (a model, by its namespace; an optimizer, by its index), or the
// load is refused: nothing in it is left out without a word.
class PythonNamesItem final : public CheckpointItem {
 public:
  explicit PythonNamesItem(const PreparedSet& set) : set_(set) {}
  void read(ItemReader& in) override {
    for (const std::string& name : in.pieces(in.dir.string()).names()) {
      bool taken = false;
      if (optimizer_state_name(name))
        for (std::size_t i = 0; i < set_.optimizers.size() && !taken; ++i)
          taken = name.starts_with(optimizer_prefix(i));
      else
        for (std::size_t i = 0; i < set_.models.size() && !taken; ++i) taken = in_namespace(name, model_prefix(i));
      if (!taken)
        throw RuntimeError(in.dir.string() + " holds " + name + ", which nothing this run prepared takes (" +
                           std::to_string(set_.models.size()) + " model(s), " + std::to_string(set_.optimizers.size()) +
                           " optimizer(s))");
    }
  }

 private:
  const PreparedSet& set_;
};

// The items of a load from such a directory: the models and optimizers.
inline CheckpointItems python_checkpoint_items(PreparedSet& set) {
  CheckpointItems items;
  items.push_back(std::make_unique<PythonNamesItem>(set));
  for (std::size_t i = 0; i < set.models.size(); ++i) items.push_back(std::make_unique<ModelItem>(set, i));
  for (std::size_t i = 0; i < set.optimizers.size(); ++i)
    items.push_back(std::make_unique<PythonOptimizerItem>(set, i));
  return items;
}

// What such a load leaves as it was (see the top), for process 0's warning.
inline std::string left_by_python_checkpoint(const PreparedSet& set, const fs::path& dir) {
  std::vector<std::string> left;
  auto count = [&](std::size_t n, const char* what) {
    if (n) left.push_back(std::to_string(n) + " " + what);
  };
  count(set.schedulers.size(), "scheduler(s)");
  count(set.loaders.size(), "data loader(s)' place");
  count(set.objects.size(), "registered object(s)");
  if (set.scaler) left.push_back("the loss scaler");
  left.push_back("the RNG states");
  std::string list;
  for (std::size_t k = 0; k < left.size(); ++k) list += (k == 0 ? "" : k + 1 == left.size() ? " and " : ", ") + left[k];
  return "accel::Accelerator::load_state: " + dir.string() +
         " is Python's dcp.save checkpoint: the model(s) and the optimizer(s)' state loaded; its files hold tensors "
         "only, so the optimizers' options (learning rate, ...) are this run's, and " +
         list + " stay as they were" + (set.schedulers.empty() ? "" : " (step a scheduler to Python's step yourself)");
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/state.hpp ======================================
// accel/training/checkpoint/state.hpp: save_state's and load_state's driver: the phases of a checkpoint's items, with the collectives between them.
//
// A checkpoint is a list of items, one per artifact (checkpoint/item.hpp
// says what each phase does; the items are in model_items.hpp and
// state_items.hpp). Saving: every process writes its own files, then
// process 0 the files of all and, last, the manifest listing every file
// with its digest; all of it goes into DIR.tmp, installed as DIR at once
// (checkpoint/files.hpp). Loading is transactional, each step a
// collective: every item reads and checks its files, changing nothing;
// then the items that can refuse as they load apply, and all are put back
// on every process if any refuses; then every item commits what was
// checked and cannot fail. An error on any process is thrown on every
// process, naming the file.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The items of a checkpoint of `set`, in the order of every phase: the
// schedulers and registered objects apply before the optimizers (a
// replayed scheduler sets learning rates, which the optimizers' own state
// then overrides). The RNG states' comes last.
inline CheckpointItems checkpoint_items(PreparedSet& set, const CheckpointContext& ctx, int64_t step = 0) {
  CheckpointItems items;
  for (std::size_t i = 0; i < set.models.size(); ++i) items.push_back(std::make_unique<ModelItem>(set, i));
  items.push_back(std::make_unique<ShardedPiecesItem>(set));
  for (std::size_t i = 0; i < set.schedulers.size(); ++i)
    items.push_back(std::make_unique<SchedulerItem>(set.schedulers[i], i));
  for (std::size_t i = 0; i < set.objects.size(); ++i) items.push_back(std::make_unique<ObjectItem>(set.objects[i], i));
  for (std::size_t i = 0; i < set.optimizers.size(); ++i) items.push_back(std::make_unique<OptimizerItem>(set, ctx, i));
  items.push_back(std::make_unique<LoadersItem>(set.loaders));
  if (set.scaler) items.push_back(std::make_unique<ScalerItem>(set.scaler));
  items.push_back(std::make_unique<RandomStatesItem>(step));
  return items;
}
inline const RandomStatesItem& random_states_of(const CheckpointItems& items) {
  for (const auto& item : items)  // (found by type, so that reordering the list cannot pick another item)
    if (const auto* states = dynamic_cast<const RandomStatesItem*>(item.get())) return *states;
  throw LogicError("accel::Accelerator::load_state: no RNG states among the checkpoint's items");
}

// The manifest's counts for this run (its serial, id and files come later).
inline CheckpointManifest manifest_for(const PreparedSet& set, const CheckpointContext& ctx) {
  return {.serial = 0,
          .processes = ctx.num_processes,
          .models = static_cast<int64_t>(set.models.size()),
          .optimizers = static_cast<int64_t>(set.optimizers.size()),
          .loaders = static_cast<int64_t>(set.loaders.size()),
          .objects = static_cast<int64_t>(set.objects.size()),
          .schedulers = static_cast<int64_t>(set.schedulers.size()),
          .shards = ctx.shards,
          .tp = ctx.tp};
}
// Every process's files and digests, into the manifest process 0 writes
// (a collective: every process calls it with its own log).
inline void add_every_process_files(const FileLog& log, CheckpointManifest& manifest) {
  std::ostringstream mine;
  for (const auto& [name, digest] : log) mine << name << ' ' << digest.bytes << ' ' << digest.xxh64 << '\n';
  for (const std::string& theirs : accel::gather_object(mine.str())) {
    std::istringstream in(theirs);
    std::string name;
    FileDigest digest;
    while (in >> name >> digest.bytes >> digest.xxh64) manifest.files[name] = digest;
  }
}

// Writes the checkpoint into dir (through dir.tmp and an atomic install);
// every process calls it, and an error anywhere is thrown everywhere.
inline void write_checkpoint(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                             const std::filesystem::path& dir) {
  const CheckpointItems items = checkpoint_items(set, ctx, step);
  const std::filesystem::path tmp = sibling(dir, ".tmp");
  CheckpointManifest manifest = manifest_for(set, ctx);
  // An error anywhere is thrown everywhere. The last checkpoint stays as it
  // was, and an incomplete DIR.tmp is removed (a full disk gets its space
  // back): once fail_together returns, no process writes into it any more.
  auto fail_on_every_process = [&](const std::string& error) {
    try {
      fail_together(error, "accel::Accelerator::save_state");
    } catch (...) {
      std::error_code ignored;
      if (ctx.process_index == 0 && !read_manifest(tmp)) std::filesystem::remove_all(tmp, ignored);
      throw;
    }
  };
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      manifest.serial = recover_checkpoint(dir).value_or(0) + 1;
      manifest.id = new_checkpoint_id();
      std::filesystem::create_directories(tmp);
    });
  fail_on_every_process(error);
  {  // (every piece carries the id)
    std::vector<std::string> id{manifest.id};
    accel::broadcast_object_list(id);
    manifest.id = id[0];
  }
  FileLog log;
  fail_on_every_process(error_of([&] {
    for (const auto& item : items) item->write_own({ctx, tmp, manifest.id, log});
  }));
  add_every_process_files(log, manifest);
  if (ctx.process_index == 0)
    error = error_of([&] {
      FileLog shared;
      for (const auto& item : items) item->write_shared({ctx, tmp, manifest.id, shared});
      for (const auto& [name, digest] : shared) manifest.files[name] = digest;
      checkpoint_hook()("files written");
      write_manifest(tmp, manifest);
      fsync_path(tmp);
      checkpoint_hook()("manifest written");
      install_checkpoint(tmp, dir);
    });
  fail_on_every_process(error);
}
// The manifest against this run: as many models, optimizers, schedulers,
// loaders and registered objects. Returns the saving run's layout.
inline SavedLayout check_manifest(const std::filesystem::path& dir, const PreparedSet& set) {
  const auto manifest = read_manifest(dir);
  if (!manifest)
    throw RuntimeError("no complete checkpoint: " + (dir / file_names::manifest).string() +
                       ", which save_state writes last, is missing, cut short or damaged");
  const std::array<std::pair<const char*, std::pair<int64_t, std::size_t>>, 5> counts{
      {{"model(s)", {manifest->models, set.models.size()}},
       {"optimizer(s)", {manifest->optimizers, set.optimizers.size()}},
       {"scheduler(s)", {manifest->schedulers, set.schedulers.size()}},
       {"data loader(s)", {manifest->loaders, set.loaders.size()}},
       {"registered object(s)", {manifest->objects, set.objects.size()}}}};
  for (const auto& count : counts)
    if (count.second.first != static_cast<int64_t>(count.second.second))
      throw RuntimeError("it holds " + std::to_string(count.second.first) + " " + count.first + "; this run has " +
                         std::to_string(count.second.second));
  if (manifest->shards < 1 || manifest->processes < 1 || manifest->shards > manifest->processes)
    throw RuntimeError((dir / file_names::manifest).string() + " says " + std::to_string(manifest->processes) +
                       " processes and " + std::to_string(manifest->shards) + " shards");
  if (manifest->tp < 1 || manifest->processes % manifest->tp != 0)
    throw RuntimeError((dir / file_names::manifest).string() + " says " + std::to_string(manifest->processes) +
                       " processes and tp " + std::to_string(manifest->tp));
  return {static_cast<int>(manifest->processes), manifest->shards, *manifest};
}

// Recovers a half-done save of dir; then whether dir is a checkpoint
// Python's dcp.save wrote (checkpoint/from_python.hpp), as process 0 sees
// it.
inline bool recover_or_find_python(const CheckpointContext& ctx, const std::filesystem::path& dir) {
  int64_t python = 0;
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      recover_checkpoint(dir);
      python = written_outside_accel(dir);
    });
  fail_together(error, "accel::Accelerator::load_state");
  if (!std::filesystem::is_directory(dir))
    throw InvalidArgument("accel::Accelerator::load_state: no checkpoint directory " + dir.string());
  return accel::broadcast(python, 0) != 0;
}

// 1. Every item reads and checks its files against the prepared set;
// nothing changes. Each file is checked against its digest in the
// background; a failed check is the error, before any other (a damaged
// file's parse may fail first). Returns the warnings to give once the load
// is committed.
inline std::vector<std::string> read_checkpoint(const CheckpointItems& items, const PreparedSet& set,
                                                const CheckpointContext& ctx, const std::filesystem::path& dir,
                                                bool python) {
  std::vector<std::string> warnings;
  const std::string error = error_of([&] {
    const SavedLayout saved = python ? outside_layout(ctx) : check_manifest(dir, set);
    CheckpointFiles files(dir, saved.manifest);
    ItemReader reader(ctx, dir, saved, files);
    try {
      for (const auto& item : items) item->read(reader);
    } catch (...) {
      files.wait();
      throw;
    }
    files.wait();
    warnings = std::move(reader.warnings);
  });
  fail_together(error, "accel::Accelerator::load_state");
  return warnings;
}

// 2. The items that can refuse as they load apply (each first keeps what
// it would put back), and every item is put back on every process if any
// one refuses. 3. Then every item commits. Returns the saved accumulation
// step (0 from Python's checkpoint, which has none).
inline int64_t load_checkpoint(PreparedSet& set, const CheckpointContext& ctx, const std::filesystem::path& dir) {
  const bool python = recover_or_find_python(ctx, dir);
  const CheckpointItems items = python ? python_checkpoint_items(set) : checkpoint_items(set, ctx);
  std::vector<std::string> warnings = read_checkpoint(items, set, ctx, dir, python);
  if (python) warnings.push_back(left_by_python_checkpoint(set, dir));
  const std::string error = error_of([&] {
    for (const auto& item : items) item->keep();
    for (const auto& item : items) item->apply();
  });
  try {
    fail_together(error, "accel::Accelerator::load_state");
  } catch (...) {
    for (const auto& item : items) item->roll_back();
    throw;
  }
  for (const auto& item : items) item->commit();
  if (ctx.process_index == 0)
    for (const auto& warning : warnings) TORCH_WARN(warning);
  return python ? 0 : random_states_of(items).step();
}

// Accelerator::save_state: into `path`, or with automatic_checkpoint_naming
// into project_dir/checkpoints/checkpoint_<iteration> (counting iteration
// up, and rotating under total_limit). Returns the checkpoint's directory.
inline std::filesystem::path save_checkpoint_state(PreparedSet& set, const CheckpointContext& ctx, int64_t step,
                                                   ProjectConfiguration& config, const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const ProjectConfiguration& project = config;
  check_project(project, "accel::Accelerator::save_state");
  if (!project.automatic_checkpoint_naming) {
    if (path.empty())
      throw InvalidArgument(
          "accel::Accelerator::save_state: no checkpoint path (pass one, or turn on "
          "project_config.automatic_checkpoint_naming)");
    const fs::path dir = checkpoint_path(path, "save_state");
    write_checkpoint(set, ctx, step, dir);
    return dir;
  }
  if (!path.empty())
    throw InvalidArgument(
        "accel::Accelerator::save_state: automatic_checkpoint_naming names the checkpoint "
        "(project_dir/checkpoints/checkpoint_<iteration>); call save_state() without " +
        path.string());
  const fs::path root = checkpoint_path(project.project_dir / "checkpoints", "save_state");
  const int number = project.iteration;
  const fs::path dir = root / ("checkpoint_" + std::to_string(number));
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      fs::create_directories(root);
      if (recover_checkpoint(dir) || fs::exists(dir))
        throw RuntimeError(dir.string() + " (iteration " + std::to_string(number) +
                           ") already exists: set project_configuration().iteration to the number to go on with, "
                           "or load_state() first (which sets it past the newest)");
    });
  fail_together(error, "accel::Accelerator::save_state");
  write_checkpoint(set, ctx, step, dir);
  ++config.iteration;
  if (project.total_limit) {
    if (ctx.process_index == 0) error = error_of([&] { rotate_checkpoints(root, *project.total_limit, number); });
    fail_together(error, "accel::Accelerator::save_state");
  }
  return dir;
}

// Accelerator::load_state: from `path`, or with automatic_checkpoint_naming
// the newest numbered checkpoint (and iteration set past it). Returns the
// saved accumulation step.
inline int64_t load_checkpoint_state(PreparedSet& set, const CheckpointContext& ctx, ProjectConfiguration& config,
                                     const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  const ProjectConfiguration& project = config;
  check_project(project, "accel::Accelerator::load_state");
  if (!project.automatic_checkpoint_naming) {
    if (path.empty())
      throw InvalidArgument(
          "accel::Accelerator::load_state: no checkpoint path (pass one, or turn on "
          "project_config.automatic_checkpoint_naming to load the newest)");
    return load_checkpoint(set, ctx, checkpoint_path(path, "load_state"));
  }
  const fs::path root = checkpoint_path(project.project_dir / "checkpoints", "load_state");
  int64_t newest = -1;  // none
  std::string error;
  if (ctx.process_index == 0)
    error = error_of([&] {
      const std::map<int, fs::path> complete = numbered_checkpoints(root);
      if (!complete.empty()) newest = complete.rbegin()->first;
    });
  fail_together(error, "accel::Accelerator::load_state");
  newest = accel::broadcast(newest, 0);
  if (path.empty() && newest < 0)
    throw InvalidArgument("accel::Accelerator::load_state: no checkpoint under " + root.string());
  const fs::path dir =
      path.empty() ? root / ("checkpoint_" + std::to_string(newest)) : checkpoint_path(path, "load_state");
  const int64_t step = load_checkpoint(set, ctx, dir);
  config.iteration = std::max<int>(project.iteration, static_cast<int>(newest + 1));
  return step;
}
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/checkpoint/weights.hpp ====================================
// accel/training/checkpoint/weights.hpp: save_model and load_model: a module's weights as Hugging Face's safetensors.
//
// Usable without an Accelerator: every process calls them (each is a
// collective over the world when distributed), global rank 0 writes, and
// an error on any process is thrown on every process.

ACCEL_NAMESPACE_BEGIN

// A tensor and its name (one state_dict entry).
using NamedTensor = std::pair<std::string, at::Tensor>;

// A state-dict adapter (torchtitan's StateDictAdapter, to_hf / from_hf),
// tensor by tensor: how save_model writes the model's tensors in another
// layout, such as a Hugging Face model's (other names; GPT-2's Conv1D
// weights, [in, out] where a Linear holds [out, in]), and how load_model
// reads them back. An empty function takes each tensor as it is.
struct StateDictAdapter {
  // save_model: one of the model's state_dict entries (its name, its whole
  // values) as the file holds it, or nullopt to leave it out (a tied copy
  // Hugging Face does not store). The name and the result's dtype and shape
  // must follow from the name, dtype and shape alone: save_model learns
  // them by calling it on a meta tensor before any values are gathered.
  std::function<std::optional<NamedTensor>(const std::string& name, const at::Tensor& value)> to_file{};
  // load_model: one of the file's tensors as the model holds it (the
  // inverse), or nullopt for a tensor the model has no place for.
  std::function<std::optional<NamedTensor>(const std::string& name, const at::Tensor& value)> from_file{};
};

struct SaveModelOptions {
  // Above this many bytes, several files and an index (Accelerate's default, 10 GB).
  uint64_t max_shard_bytes = 10'000'000'000;
  StateDictAdapter adapter{};
};
struct LoadModelOptions {
  StateDictAdapter adapter{};
};

namespace detail {
// A tensor with `t`'s dtype and shape (or `sizes`) and no storage (the device "meta").
inline at::Tensor meta_like(const at::Tensor& t, c10::IntArrayRef sizes) {
  return at::empty(sizes, at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
}
inline at::Tensor meta_like(const at::Tensor& t) { return meta_like(t, t.sizes()); }

// What save_model writes for each of the model's state_dict entries: the
// file's name and a meta tensor of the file's dtype and shape, with the
// model's entry the values come from. A tensor-parallel piece (`split`) is
// written whole: the file's shape is the whole tensor's.
struct PlannedTensor {
  NamedTensor file;
  NamedTensor model;
};
inline std::vector<PlannedTensor> planned_tensors(const torch::nn::Module& module, const StateDictAdapter& adapter,
                                                  const tp::SplitTensors& split) {
  std::vector<PlannedTensor> out;
  std::map<std::string, std::string> from;  // a file name -> the model's name it came from
  for (auto& named : state_dict(module)) {
    const at::Tensor meta = meta_like(named.second, split.whole_sizes(named.second));
    std::optional<NamedTensor> file;
    if (!adapter.to_file) {
      file = NamedTensor(named.first, meta);
    } else {
      try {
        file = adapter.to_file(named.first, meta);
      } catch (const std::exception& e) {
        throw InvalidArgument("accel::save_model: the adapter's to_file failed for '" + named.first +
                              "' on a meta tensor (it is called on one first, to learn the file's names, dtypes and "
                              "shapes before any values are gathered; it must not read values): " +
                              e.what());
      }
      if (!file) continue;
      if (file->first.empty())
        throw InvalidArgument("accel::save_model: the adapter's to_file gave '" + named.first +
                              "' an empty name (nullopt leaves a tensor out)");
    }
    if (const auto [at, fresh] = from.emplace(file->first, named.first); !fresh)
      throw InvalidArgument("accel::save_model: the adapter's to_file gives '" + at->second + "' and '" + named.first +
                            "' the same name, '" + file->first + "'");
    out.push_back({std::move(*file), std::move(named)});
  }
  return out;
}

// save_weights' files: the tensors of each (names, dtypes and shapes:
// meta tensors), the model's entry each comes from (whose values whole()
// gives), and their bytes in all. A file takes tensors until the next
// would pass max_shard_bytes.
struct WeightFiles {
  std::vector<std::vector<NamedTensor>> files = std::vector<std::vector<NamedTensor>>(1);  // (one file, to start)
  std::vector<std::vector<NamedTensor>> sources = std::vector<std::vector<NamedTensor>>(1);
  uint64_t total = 0;
};
inline WeightFiles plan_weight_files(const torch::nn::Module& module, const SaveModelOptions& options,
                                     const tp::SplitTensors& split) {
  WeightFiles plan;
  uint64_t in_file = 0;
  for (auto& planned : planned_tensors(module, options.adapter, split)) {
    const at::Tensor& t = planned.file.second;
    const uint64_t bytes = t.numel() * t.element_size();
    if (in_file > 0 && in_file + bytes > options.max_shard_bytes) {
      plan.files.emplace_back();
      plan.sources.emplace_back();
      in_file = 0;
    }
    plan.files.back().push_back(std::move(planned.file));
    plan.sources.back().push_back(std::move(planned.model));
    in_file += bytes;
    plan.total += bytes;
  }
  return plan;
}
// The values a file holds for the model's tensor `name` (values: its whole
// values), through the adapter, checked against the planned name, dtype
// and shape.
inline at::Tensor adapted_values(const SaveModelOptions& options, const std::string& name, const at::Tensor& values,
                                 const NamedTensor& planned) {
  if (!options.adapter.to_file) return values;
  const std::optional<NamedTensor> file = options.adapter.to_file(name, values);
  if (!file || file->first != planned.first || file->second.scalar_type() != planned.second.scalar_type() ||
      file->second.sizes() != planned.second.sizes())
    throw RuntimeError(
        "the adapter's to_file gave '" + name + "' " +  // (fail_together names save_model)
        (file ? "'" + file->first + "', " + c10::toString(file->second.scalar_type()) + c10::str(file->second.sizes())
              : std::string("nullopt")) +
        " on its values, and '" + planned.first + "', " + c10::toString(planned.second.scalar_type()) +
        c10::str(planned.second.sizes()) +
        " on a meta tensor of its dtype and shape: name, dtype and shape must follow from those alone");
  return file->second;
}
// After the files: Hugging Face's index where there are several (sorted by
// tensor name), an earlier save's other weight files removed, the directory
// synced.
inline void finish_weights_dir(const std::filesystem::path& path, const WeightFiles& plan,
                               const std::map<std::string, std::string>& weight_map, std::set<std::string> written) {
  namespace fs = std::filesystem;
  if (plan.files.size() > 1) {
    std::string index =
        "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(plan.total) + "\n  },\n  \"weight_map\": {";
    for (const auto& [tensor, file] : weight_map)
      index += std::string(index.back() == '{' ? "\n" : ",\n") + "    " + json_quote(tensor) + ": " + json_quote(file);
    index += "\n  }\n}\n";
    write_file_atomically(path / file_names::weights_index, [&](CheckedFile& out) { out.write(index); });
    written.insert(file_names::weights_index);
  }
  for (const auto& entry : fs::directory_iterator(path)) {
    const std::string file = entry.path().filename().string();
    if (file_names::is_weights_file(file) && !written.count(file)) fs::remove(entry.path());
  }
  fsync_path(path);
}

// save_model's work on `module`'s state_dict. local(t) gives a tensor's
// values on this process when its turn comes (an Accelerator's FULL_SHARD
// model gathers them unit by unit there, a collective); a tensor-parallel
// piece is then gathered whole over its group (accel::tp layers, a plan:
// Hugging Face's layout has whole tensors). Every process calls both for
// every tensor in the same order, the main process writes, and an error
// there (a full disk) still lets the others finish their calls before every
// process throws it.
inline void save_weights(const torch::nn::Module& module, const std::filesystem::path& path,
                         const SaveModelOptions& options, const std::function<at::Tensor(const at::Tensor&)>& local) {
  namespace fs = std::filesystem;
  if (options.max_shard_bytes == 0) throw InvalidArgument("accel::save_model: max_shard_bytes must be positive");
  const tp::SplitTensors split = tp::split_tensors(module);
  const auto whole = [&](const at::Tensor& t) { return split.whole(t, local(t)); };
  const WeightFiles plan = plan_weight_files(module, options, split);
  const std::size_t count = plan.files.size();
  const bool writes = accel::get_rank() == 0;
  std::string error;
  if (writes)
    error = error_of([&] {
      fs::create_directories(path);
      if (count == 1) fs::remove(path / file_names::weights_index);  // it would be read first
    });
  std::set<std::string> written;
  std::map<std::string, std::string> weight_map;  // sorted by name, as Hugging Face writes it
  for (std::size_t k = 0; k < count; ++k) {
    const std::string name = file_names::weights_shard(k, count);
    std::size_t next = 0;  // the file's tensors whose values were asked for
    auto values = [&](std::size_t i) {
      next = i + 1;
      const auto& [source, tensor] = plan.sources[k][i];
      return adapted_values(options, source, whole(tensor), plan.files[k][i]);
    };
    if (writes && error.empty())
      error = error_of([&] {
        write_safetensors(path / name, plan.files[k], {}, values);
        written.insert(name);
        for (const auto& named : plan.files[k]) weight_map[named.first] = name;
      });
    // The other processes, and the main one after an error: the gathers only (whole() is a collective where
    // the model is sharded; the adapter is the writer's).
    for (; next < plan.files[k].size(); ++next) whole(plan.sources[k][next].second);
  }
  if (writes && error.empty()) error = error_of([&] { finish_weights_dir(path, plan, weight_map, written); });
  fail_together(error, "accel::save_model");
}
}  // namespace detail

// Writes the model's weights as Hugging Face does, for Python (and
// load_model) to read: dir/model.safetensors with the state_dict's names as
// keys ("body.0.weight"; parameters and buffers; a tied tensor under each of
// its names, as Python's state_dict), or, above options.max_shard_bytes
// (Accelerate's default, 10 GB), dir/model-0000k-of-0000n.safetensors plus
// dir/model.safetensors.index.json. options.adapter renames, transforms or
// leaves out tensors on the way (a Hugging Face layout). The main process
// writes; every process calls it (and gets any error). Each file is written
// whole under a temporary name, then renamed; the other layout's files of
// an earlier save in dir are removed. It writes the parameters as they
// are: a model sharded by an Accelerator goes through
// Accelerator::save_model, which gathers them unit by unit (or hold a
// DataParallel::summon_full_params() around this).
template <class ModuleHolder>
void save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options = {}) {
  detail::save_weights(*model.ptr(), detail::checkpoint_path(dir, "save_model"), options,
                       [](const at::Tensor& t) { return t; });
}
// (the same, options.max_shard_bytes given alone)
template <class ModuleHolder>
void save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes) {
  save_model(model, dir, SaveModelOptions{.max_shard_bytes = max_shard_bytes});
}

namespace detail {
// The whole tensors of a directory Python's dcp.save wrote through
// HuggingFaceStorageWriter without consolidating: each rank's pieces in a
// safetensors file of its own (shard-<rank>-model-<k>-of-<n>.safetensors),
// each piece placed in its whole tensor by the header's DCP_SHARDING_INFO,
// and no model.safetensors or index. Read as accel's own sharded
// checkpoints are (ShardedWeights: the pieces must tile every tensor);
// nullopt where the directory has no safetensors files or one lacks
// DCP_SHARDING_INFO (then it is not such a directory).
inline std::optional<std::map<std::string, at::Tensor>> read_dcp_pieces(const std::filesystem::path& dir) {
  if (!holds_dcp_pieces(dir)) return std::nullopt;
  CheckpointManifest unrecorded;  // (Python records no digests: the files are read unchecked)
  unrecorded.format = 1;
  CheckpointFiles unchecked(dir, unrecorded);
  return ShardedWeights(dir, unchecked).read_all();
}

// Every tensor of a safetensors model directory (one file, or shards and an
// index, as save_model and Hugging Face write it; or the pieces of Python's
// dcp.save, read_dcp_pieces), by name; `where` gets the file that names
// them, for errors.
inline std::map<std::string, at::Tensor> read_all_weights(const std::filesystem::path& path, std::string& where) {
  namespace fs = std::filesystem;
  std::map<std::string, at::Tensor> loaded;
  auto take = [&](const fs::path& file, const std::map<std::string, std::string>* weight_map) {
    for (auto& [name, tensor] : read_safetensors(file)) {
      if (weight_map) {
        const auto mapped = weight_map->find(name);
        if (mapped == weight_map->end() || mapped->second != file.filename().string())
          throw RuntimeError(file.string() + " holds " + name + ", which the index does not place there");
      }
      if (!loaded.emplace(name, std::move(tensor)).second)
        throw RuntimeError(file.string() + ": " + name + " is in two files");
    }
  };
  const fs::path index_file = path / file_names::weights_index;
  where = (path / file_names::weights).string();
  if (!fs::exists(index_file)) {
    if (!fs::exists(path / file_names::weights))
      if (auto pieces = read_dcp_pieces(path)) {
        // (their whole shapes are where the pieces reach: a rank's file missing can leave a tensor short)
        where = path.string() +
                " (the pieces Python's dcp.save wrote; a tensor smaller there than in the model may "
                "be a file missing)";
        return std::move(*pieces);
      }
    take(path / file_names::weights, nullptr);
    return loaded;
  }
  where = index_file.string();
  std::ifstream in(index_file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const Json doc = JsonReader(text, where).document();
  const Json* map = doc.find("weight_map");
  if (!map || map->kind != Json::Kind::Object) throw RuntimeError(where + " has no weight_map object");
  std::map<std::string, std::string> weight_map;
  for (std::size_t field = 0; field < map->keys.size(); ++field) {
    const std::string& name = map->keys[field];
    const Json& file = map->values[field];
    if (file.kind != Json::Kind::String || file.text.find('/') != std::string::npos || file.text == "..")
      throw RuntimeError(where + ": the file of " + name + " is not a file name in " + path.string());
    weight_map[name] = file.text;
  }
  std::set<std::string> files;
  for (const auto& entry : weight_map) files.insert(entry.second);
  for (const std::string& file : files) take(path / file, &weight_map);
  for (const auto& entry : weight_map)
    if (!loaded.count(entry.first))
      throw RuntimeError(where + " places " + entry.first + " in " + entry.second + ", which lacks it");
  return loaded;
}
// ... but an optimizer's state (which Python's dcp.save keeps beside the
// model, under optimizer.state.: checkpoint/from_python.hpp): the model's.
inline std::map<std::string, at::Tensor> read_weights_dir(const std::filesystem::path& path, std::string& where) {
  std::map<std::string, at::Tensor> loaded = read_all_weights(path, where);
  std::erase_if(loaded, [](const auto& named) { return optimizer_state_name(named.first); });
  return loaded;
}

// The file's tensors under the model's names, through the adapter's from_file.
inline std::map<std::string, at::Tensor> adapted_from_file(std::map<std::string, at::Tensor> file,
                                                           const StateDictAdapter& adapter) {
  if (!adapter.from_file) return file;
  std::map<std::string, at::Tensor> out;
  std::map<std::string, std::string> from;  // a model name -> the file's name it came from
  for (auto& [name, tensor] : file) {
    std::optional<NamedTensor> model = adapter.from_file(name, tensor);
    if (!model) continue;
    if (const auto [at, fresh] = from.emplace(model->first, name); !fresh)
      throw RuntimeError("the adapter's from_file gives '" + at->second + "' and '" + name + "' the same name, '" +
                         model->first + "'");
    out.emplace(std::move(model->first), std::move(model->second));
  }
  return out;
}

// The model's state_dict entries that `loaded` must fill: a tied tensor
// (one tensor under several names, GPT-2's wte and lm_head) needs one of
// its names there, as Hugging Face stores it once; where it has several,
// their values must agree.
inline std::vector<NamedTensor> entries_to_fill(const torch::nn::Module& module,
                                                const std::map<std::string, at::Tensor>& loaded,
                                                const std::string& where) {
  std::vector<NamedTensor> out;
  std::map<const c10::TensorImpl*, std::string> filled;  // a tied tensor -> the name that fills it
  std::set<const c10::TensorImpl*> tied;
  {
    std::set<const c10::TensorImpl*> seen;
    for (const auto& [name, t] : state_dict(module))
      if (!seen.insert(t.unsafeGetTensorImpl()).second) tied.insert(t.unsafeGetTensorImpl());
  }
  for (auto& [name, t] : state_dict(module)) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    const auto found = loaded.find(name);
    if (!tied.count(impl)) {
      out.emplace_back(name, t);
    } else if (found != loaded.end()) {
      if (const auto [first, fresh] = filled.emplace(impl, name); !fresh) {
        const at::Tensor& other = loaded.at(first->second);
        if (other.sizes() == found->second.sizes() && other.scalar_type() == found->second.scalar_type() &&
            !at::equal(other, found->second))
          throw RuntimeError(where + ": " + first->second + " and " + name +
                             " are one tensor in the model (tied), and differ there");
      }
      out.emplace_back(name, t);
    }
  }
  for (auto& [name, t] : state_dict(module))  // a tied tensor with none of its names there: each is missing
    if (tied.count(t.unsafeGetTensorImpl()) && !filled.count(t.unsafeGetTensorImpl())) out.emplace_back(name, t);
  return out;
}
}  // namespace detail

// Reads weights written by save_model or by Python (safetensors' save_file,
// save_pretrained / save_model, sharded or not; dcp.save through
// HuggingFaceStorageWriter, consolidated or not, by any number of
// processes) into the model, on every process. options.adapter's from_file
// renames and transforms the file's tensors first (the inverse of
// save_model's to_file). Everything is read and checked before anything is
// copied: each of the model's parameters and buffers must be there with its
// dtype and shape (a tied one under one of its names at least), and nothing
// else; otherwise every process throws, naming the file and the tensors. A tensor-parallel piece
// (accel::tp layers, a plan) takes its piece of the whole tensor the file
// holds. A sharded model: Accelerator::load_model.
template <class ModuleHolder>
void load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options = {}) {
  const std::filesystem::path path = detail::checkpoint_path(dir, "load_model");
  std::vector<NamedTensor> expected;
  std::map<std::string, at::Tensor> loaded;
  detail::tp::SplitTensors split;
  const std::string error = detail::error_of([&] {
    std::string where;
    loaded = detail::adapted_from_file(detail::read_weights_dir(path, where), options.adapter);
    expected = detail::entries_to_fill(*model.ptr(), loaded, where);
    split = detail::tp::split_tensors(*model.ptr());
    std::vector<NamedTensor> whole;  // (the file holds a piece's whole tensor)
    for (const auto& [name, tensor] : expected)
      whole.emplace_back(name, detail::meta_like(tensor, split.whole_sizes(tensor)));
    std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> held;
    for (const auto& [name, tensor] : loaded) held[name] = {tensor.scalar_type(), tensor.sizes().vec()};
    if (const std::string why = detail::misfit(whole, held); !why.empty())
      throw RuntimeError(where + " does not fit the model:" + why);
  });
  detail::fail_together(error, "accel::load_model");
  torch::NoGradGuard no_grad;
  for (const auto& [name, tensor] : expected) tensor.copy_(split.piece(tensor, loaded.at(name)));
}

ACCEL_NAMESPACE_END

// == accel/training/accelerator/trackers.hpp ==================================
// accel/training/accelerator/trackers.hpp: Accelerate's experiment tracking (log_with, init_trackers, log) into JSON-lines and CSV files.
//
// Accelerate sends accelerator.log(values, step) to the trackers named in
// log_with (TensorBoard, W&B, ...). Those are services or Python packages;
// the trackers here are files that any plotting tool reads, written by the
// main process only (Accelerate's main_process_only default):
//   "jsonl": metrics.jsonl, one JSON object per log call: {"step": 3, "loss": 0.25}
//   "csv":   metrics.csv, a header of "step" and every key logged so far, one row per call
//   "all":   both
// in logging_dir/<project_name> (init_trackers' name; logging_dir defaults
// to project_dir, as Accelerate's ProjectConfiguration; both as configured
// when the Accelerator is made), appended to, so
// a run resumed from a checkpoint continues the same files. Numbers are
// written in the fewest digits that read back the same; NaN and infinities
// as Python's json and csv modules write them (NaN, Infinity; nan, inf), so
// pandas and Python read the files back as they are.

ACCEL_NAMESPACE_BEGIN

namespace detail {
inline constexpr std::array<std::string_view, 2> kTrackers{"jsonl", "csv"};

// The tracker names of log_with, "all" expanded; an unknown name is an error naming the known ones.
inline std::vector<std::string> tracker_names(const std::vector<std::string>& log_with) {
  std::vector<std::string> out;
  auto add = [&](std::string_view name) {
    if (std::find(out.begin(), out.end(), name) == out.end()) out.emplace_back(name);
  };
  for (const auto& name : log_with) {
    if (name == "all") {
      for (const auto known : kTrackers) add(known);
    } else if (std::find(kTrackers.begin(), kTrackers.end(), name) != kTrackers.end()) {
      add(name);
    } else {
      throw InvalidArgument("accel::Accelerator: log_with names '" + name +
                            "', which accel.hpp does not have (it writes files: jsonl, csv, or all; TensorBoard, W&B "
                            "and the other services of Accelerate are not built in)");
    }
  }
  return out;
}
inline std::filesystem::path logging_root(const ProjectConfiguration& project) {
  return project.logging_dir.empty() ? project.project_dir : project.logging_dir;
}
// Before the rendezvous (AcceleratorSetup::checked): names known, and a place for the files.
inline void check_trackers(const AcceleratorConfig& config) {
  if (!tracker_names(config.log_with).empty() && logging_root(config.project_config).empty())
    throw InvalidArgument(
        "accel::Accelerator: log_with writes files, and needs project_config.project_dir (or logging_dir) "
        "for them");
}

// A number as Python's json (csv: true, as its csv module) writes it.
inline std::string tracked_number(double value, bool csv) {
  if (std::isnan(value)) return csv ? "nan" : "NaN";
  if (std::isinf(value)) return std::string(value < 0 ? "-" : "") + (csv ? "inf" : "Infinity");
  std::ostringstream out;
  print_one(out, value);
  return out.str();
}
// A CSV field, quoted where it holds a comma, a quote or a line break (RFC 4180, Python's csv).
inline std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string out = "\"";
  for (const char c : text) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}
inline void append_line(const std::filesystem::path& file, const std::string& line) {
  std::ofstream out(file, std::ios::app | std::ios::binary);
  out << line << '\n';
  out.flush();
  if (!out) throw RuntimeError("accel::Accelerator::log: cannot write " + file.string());
}
// One CSV record of `in` (RFC 4180, as Python's csv module reads it): a
// physical line, and while a quoted field is open (a key holding a line
// break), the lines that follow, joined by the '\n' that ended them. None at
// the end of the file.
inline std::optional<std::string> read_csv_record(std::istream& in) {
  std::string record, line;
  if (!std::getline(in, record)) return std::nullopt;
  // (a quote opens or closes a field; a doubled one inside it does both, so the count's parity says)
  while (std::count(record.begin(), record.end(), '"') % 2 != 0 && std::getline(in, line)) record += '\n' + line;
  return record;
}
// The keys of a metrics.csv header record (the columns after "step").
inline std::vector<std::string> csv_columns(const std::string& header) {
  std::vector<std::string> columns;
  std::string cell;
  bool quoted = false;
  for (std::size_t i = 0; i < header.size(); ++i) {
    const char c = header[i];
    if (quoted) {
      if (c == '"' && i + 1 < header.size() && header[i + 1] == '"') cell += header[++i];
      else if (c == '"') quoted = false;
      else cell += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      columns.push_back(std::move(cell));
      cell.clear();
    } else {
      cell += c;
    }
  }
  columns.push_back(std::move(cell));
  if (!columns.empty()) columns.erase(columns.begin());  // "step"
  return columns;
}

// The Accelerator's experiment log: init_trackers, log and end_training
// (an Accelerator holds one; the settings are its AcceleratorSetup's).
class ExperimentLog {
 public:
  // The trackers and their place are the configuration's as the
  // Accelerator is made (a copy: an Accelerator may be moved).
  ExperimentLog(const AcceleratorConfig& config, bool main_process)
      : names_(tracker_names(config.log_with)), root_(logging_root(config.project_config)), main_(main_process) {}

  // Accelerate's init_trackers: the files go to logging_dir/<project_name>,
  // and `config` (the run's hyperparameters, as text) to config.json there.
  // Every process calls it; the main process writes.
  void init_trackers(const std::string& project_name, const std::map<std::string, std::string>& config = {}) {
    if (project_name.empty() || project_name.find('/') != std::string::npos || project_name == "." ||
        project_name == "..")
      throw InvalidArgument("accel::Accelerator::init_trackers: the project name '" + project_name +
                            "' is not a plain directory name");
    project_ = project_name;
    finished_ = false;
    csv_header_.reset();  // another directory: its own metrics.csv
    if (!writes()) return;
    std::filesystem::create_directories(directory());
    std::string text = "{";
    for (const auto& [key, value] : config)
      text.append(text.size() > 1 ? ", " : "").append(json_quote(key)).append(": ").append(json_quote(value));
    std::ofstream out(directory() / "config.json", std::ios::trunc | std::ios::binary);
    out << text << "}\n";
    out.flush();
    if (!out)
      throw RuntimeError("accel::Accelerator::init_trackers: cannot write " + (directory() / "config.json").string());
  }

  // Accelerate's log: `values` at `step` to every tracker (main process only).
  void log(const std::map<std::string, double>& values, std::optional<int64_t> step = {}) {
    if (finished_) throw InvalidArgument("accel::Accelerator::log: called after end_training()");
    if (!writes()) return;
    std::filesystem::create_directories(directory());
    if (std::find(names_.begin(), names_.end(), "jsonl") != names_.end()) {
      std::string line = "{";
      if (step) line += "\"step\": " + std::to_string(*step);
      for (const auto& [key, value] : values)
        line.append(line.size() > 1 ? ", " : "")
            .append(json_quote(key))
            .append(": ")
            .append(tracked_number(value, false));
      append_line(directory() / "metrics.jsonl", line + "}");
    }
    if (std::find(names_.begin(), names_.end(), "csv") != names_.end()) log_csv(values, step);
  }

  // Accelerate's end_training: the trackers finish (these files are
  // complete after every log call already); log() after it is an error.
  void end_training() { finished_ = true; }

  // Where this run's files go (logging_dir, or project_dir, / project name).
  std::filesystem::path logging_dir() const { return directory(); }

 private:
  bool writes() const { return main_ && !names_.empty(); }
  std::filesystem::path directory() const { return project_.empty() ? root_ : root_ / project_; }
  // A key not in the header yet rewrites the file with a wider header
  // (earlier rows get empty cells there): columns never shift under a reader.
  // The header is read from the file once (a resumed run's), then kept here;
  // the rows are read only for such a rewrite.
  void log_csv(const std::map<std::string, double>& values, std::optional<int64_t> step) {
    const std::filesystem::path file = directory() / "metrics.csv";
    const bool exists = std::filesystem::exists(file);
    if (!csv_header_) {
      csv_header_.emplace();
      std::ifstream in(file, std::ios::binary);
      if (const auto header = read_csv_record(in)) *csv_header_ = csv_columns(*header);
    }
    std::vector<std::string>& columns = *csv_header_;
    const std::size_t known = columns.size();
    for (const auto& entry : values)
      if (std::find(columns.begin(), columns.end(), entry.first) == columns.end()) columns.push_back(entry.first);
    if (columns.size() != known || !exists) {
      std::vector<std::string> rows;
      if (std::ifstream in(file, std::ios::binary); in) {
        read_csv_record(in);  // (the old header: records, not lines, as a key may hold a line break)
        while (auto row = read_csv_record(in)) rows.push_back(std::move(*row));
      }
      const std::filesystem::path temporary = file.string() + ".tmp";
      {
        std::ofstream out(temporary, std::ios::trunc | std::ios::binary);
        out << "step";
        for (const auto& column : columns) out << ',' << csv_field(column);
        out << '\n';
        for (const auto& row : rows) out << row << std::string(columns.size() - known, ',') << '\n';
        out.flush();
        if (!out) throw RuntimeError("accel::Accelerator::log: cannot write " + temporary.string());
      }
      std::filesystem::rename(temporary, file);
    }
    std::string row = step ? std::to_string(*step) : std::string();
    for (const auto& column : columns) {
      const auto found = values.find(column);
      row.append(",").append(found == values.end() ? std::string() : tracked_number(found->second, true));
    }
    append_line(file, row);
  }

  std::vector<std::string> names_;
  std::filesystem::path root_;
  bool main_;
  std::string project_;
  bool finished_ = false;
  std::optional<std::vector<std::string>> csv_header_;  // metrics.csv's columns after "step", once known
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/accelerator/setup.hpp =====================================
// accel/training/accelerator/setup.hpp: what an Accelerator runs on: its checked configuration, the world, the device, and the DataParallel a model gets.
//
// The Accelerator (accelerator/accelerator.hpp) holds one AcceleratorSetup,
// which holds no training state: it checks the configuration before the
// rendezvous, joins the world, and decides how a model is wrapped (the
// DataParallel the strategy calls for). The Accelerator's properties
// (accelerator/properties.hpp) are read off it.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// The Accelerator's settings, checked; the world and the device; the
// DataParallel a model gets.
class AcceleratorSetup {
 public:
  // Every setting is checked before the rendezvous: a configuration one rank
  // refuses, every rank refuses, and none leaves while its peers connect.
  explicit AcceleratorSetup(AcceleratorConfig config) : config_(checked(std::move(config))) {
    interface_ = &DistributedInterface::instance(config_.distributed);
    device_ = interface_->current_device();
  }

  const AcceleratorConfig& config() const { return config_; }
  ProjectConfiguration& project() { return config_.project_config; }  // (its iteration counts the saves)
  const DistributedInterface& world() const { return *interface_; }
  c10::Device device() const { return device_; }
  // Whether the configured strategy has something to shard along (else it is NO_SHARD).
  bool sharded() const { return shards(config_.sharding_strategy, interface_->strategy(), interface_->distributed()); }

  // The DataParallel that wraps `module` (already on the device) under the
  // configured strategy: sharded along the model mesh, with FULL_SHARD's
  // units; else over the data mesh, with the configured communication hook.
  std::unique_ptr<DataParallel> data_parallel_for(const std::shared_ptr<torch::nn::Module>& module) const {
    const int64_t bucket_bytes = config_.bucket_cap_mb * 1024 * 1024;
    if (!sharded()) {
      auto dp = std::make_unique<DataParallel>(module, gradient_group(), bucket_bytes);
      if (config_.comm_hook == DDPCommunicationHookType::FP16) dp->register_comm_hook(comm_hooks::fp16_compress_hook());
      if (config_.comm_hook == DDPCommunicationHookType::BF16) dp->register_comm_hook(comm_hooks::bf16_compress_hook());
      if (config_.comm_hook == DDPCommunicationHookType::POWER_SGD)
        dp->register_comm_hook(comm_hooks::powerSGD_hook(std::make_shared<PowerSGDState>()));
      if (config_.gradient_as_bucket_view) dp->gradient_as_bucket_view(true);
      return dp;
    }
    std::vector<std::shared_ptr<torch::nn::Module>> units;
    if (config_.sharding_strategy == ShardingStrategy::FULL_SHARD ||
        config_.sharding_strategy == ShardingStrategy::HYBRID_SHARD) {
      choose_units(*module, "", units);
      if (units.empty())
        throw InvalidArgument(
            "accel::Accelerator::prepare: " + std::string(to_string(config_.sharding_strategy)) +
            " found no unit in the model (" +
            (config_.auto_wrap_policy ? "auto_wrap_policy chose none" : "no submodule holds parameters of its own") +
            "); use SHARD_GRAD_OP, or register the layers as submodules");
    }
    // (the parameters broadcast over the ranks holding the same pieces: beside tp, dp_cp)
    auto dp = std::make_unique<DataParallel>(
        module, interface_->strategy().tp_size() > 1 ? gradient_group() : interface_->world_group(), bucket_bytes,
        interface_->get_group(Dim::MP_SHARD), interface_->get_group(Dim::MP_REPLICATE), units,
        config_.mixed_precision_policy);
    dp->set_prefetch(config_.forward_prefetch, config_.backward_prefetch);
    return dp;
  }

 private:
  // Gradients are averaged over the whole data mesh (dp x cp): context-
  // parallel peers see different parts of the same sequences and must stay
  // identical (LLaMA-Factory's trainers do so). Without tp that spans the
  // world; with it, the ranks of one tp coordinate (dp_cp), which hold the
  // same pieces of the model. (Sharded, the same ranks: the model mesh's
  // mp_replicate x mp_shard at one tp coordinate, tp being innermost in
  // both meshes.) With tensor parallelism clipping sums the pieces' norms
  // over tp as well. (pp, outermost, likewise: a stage's ranks, dp_cp.)
  GroupPtr gradient_group() const {
    const DistributedStrategy& s = interface_->strategy();
    if (s.tp_size() > 1 || s.pp_size() > 1) return interface_->data_mesh()->slice("dp_cp").get_group();
    return s.cp_size() > 1 ? interface_->world_group() : interface_->get_group(Dim::DP);
  }
  static AcceleratorConfig checked(AcceleratorConfig config) {
    if (config.gradient_accumulation_steps < 1)
      throw InvalidArgument("accel::Accelerator: gradient_accumulation_steps must be at least 1, got " +
                            std::to_string(config.gradient_accumulation_steps));
    if (config.bucket_cap_mb < 1)
      throw InvalidArgument("accel::Accelerator: bucket_cap_mb must be at least 1, got " +
                            std::to_string(config.bucket_cap_mb));
    const auto& mp = config.mixed_precision;
    if (mp != "no" && mp != "bf16" && mp != "fp16")
      throw InvalidArgument("accel::Accelerator: mixed_precision '" + mp + "' (expected no, bf16 or fp16)");
    detail::check_project(config.project_config, "accel::Accelerator");
    detail::check_trackers(config);
    if (config.cpu) {
      if (config.distributed.device && *config.distributed.device != DeviceType::CPU)
        throw InvalidArgument("accel::Accelerator: cpu = true, but distributed.device is " +
                              std::string(to_string(*config.distributed.device)));
      config.distributed.device = DeviceType::CPU;  // the interface's device and backend (gloo)
    }
    if (config.parallelism_config) config.distributed = from_parallelism_config(config);
    // What instance() will choose, known without it: the mesh sizes and the device.
    const DistributedStrategy strategy(config.distributed);
    // The pp dimension and its groups exist (DistributedInterface, Dim::PP),
    // the pipeline stages and schedules that would train over it not yet: a
    // model prepared here would be trained whole on every stage's ranks.
    if (strategy.pp_size() > 1)
      throw InvalidArgument("accel::Accelerator: pp_size " + std::to_string(strategy.pp_size()) +
                            ": pipeline stages and schedules are not in accel.hpp yet, so the Accelerator would "
                            "train the whole model on every stage; use pp_size 1 (the pp groups exist: "
                            "DistributedInterface::get_group(Dim::PP))");
    if ((config.comm_hook != DDPCommunicationHookType::NO || config.gradient_as_bucket_view) &&
        shards(config.sharding_strategy, strategy, is_distributed()))
      throw InvalidArgument(std::string("accel::Accelerator: ") +
                            (config.gradient_as_bucket_view ? "gradient_as_bucket_view" : "comm_hook") +
                            " is about the all-reduce of NO_SHARD's buckets; under " +
                            std::string(to_string(config.sharding_strategy)) + " they are reduce-scattered");
    if (config.mixed_precision_policy.active() && config.sharding_strategy != ShardingStrategy::FULL_SHARD &&
        config.sharding_strategy != ShardingStrategy::HYBRID_SHARD)
      throw InvalidArgument(
          "accel::Accelerator: mixed_precision_policy is FSDP2's, for parameters sharded at rest (FULL_SHARD or "
          "HYBRID_SHARD); under " +
          std::string(to_string(config.sharding_strategy)) + " use mixed_precision = \"bf16\" (autocast)");
    for (const auto& dtype : {config.mixed_precision_policy.param_dtype, config.mixed_precision_policy.reduce_dtype,
                              config.mixed_precision_policy.output_dtype})
      if (dtype && !c10::isFloatingType(*dtype))
        throw InvalidArgument(
            std::string("accel::Accelerator: mixed_precision_policy's dtypes are floating-point; got ") +
            c10::toString(*dtype));
    if (mp == "fp16" &&
        (config.distributed.device ? *config.distributed.device : detail::from_c10(get_current_accelerator().type())) !=
            DeviceType::CUDA)
      throw InvalidArgument("accel::Accelerator: mixed_precision 'fp16' needs CUDA; use 'bf16' on the CPU");
    return config;
  }
  // distributed with the sizes parallelism_config gives (its timeout and
  // device kept). In one process every size is 1 whatever is given, as for
  // DistributedConfig's own sizes (a program runs unchanged as one process).
  static DistributedConfig from_parallelism_config(const AcceleratorConfig& config) {
    DistributedConfig sizes = config.distributed;
    sizes.timeout = {};
    sizes.device.reset();
    if (sizes != DistributedConfig{})
      throw InvalidArgument(
          "accel::Accelerator: parallelism_config and distributed's sizes both given; give the sizes once (distributed "
          "keeps its timeout and device)");
    const ParallelismConfig& p = *config.parallelism_config;
    p.check_signs();  // (one process: every size is 1, the defaults)
    DistributedConfig out = is_distributed() ? p.distributed_config(accel::get_world_size()) : DistributedConfig{};
    out.timeout = config.distributed.timeout;
    out.device = config.distributed.device;
    return out;
  }
  // Whether the strategy has something to shard along (else it is NO_SHARD).
  static bool shards(ShardingStrategy s, const DistributedStrategy& mesh, bool distributed) {
    return s != ShardingStrategy::NO_SHARD && distributed && mesh.mp_shard_size() > 1;
  }
  // FULL_SHARD's units under `module` (see auto_wrap_policy).
  void choose_units(torch::nn::Module& module, const std::string& prefix,
                    std::vector<std::shared_ptr<torch::nn::Module>>& units) const {
    for (const auto& child : module.named_children()) {
      const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
      const bool unit = config_.auto_wrap_policy ? config_.auto_wrap_policy(name, *child.value())
                                                 : !child.value()->parameters(/*recurse=*/false).empty();
      if (unit) units.push_back(child.value());
      else choose_units(*child.value(), name, units);
    }
  }

  AcceleratorConfig config_;
  DistributedInterface* interface_ = nullptr;
  c10::Device device_{c10::kCPU};
};
}  // namespace detail

ACCEL_NAMESPACE_END

// == accel/training/accelerator/accelerator.hpp ===============================
// accel/training/accelerator/accelerator.hpp: the Accelerator, declared: every public method in one place, and the state it holds.
//
// The class is declared here whole and defined after, part by part, as
// c10d declares a ProcessGroup in one header: a reader finds every method
// below with what it does, and the part that defines each family is named
// above it. Include accel.hpp or accel/training.hpp, which hold them all.
//
// The state is held in members, each a small type of its own: the checked
// configuration with the world and the device (AcceleratorSetup), what was
// prepared (PreparedSet, which checkpoints save and load), the accumulation
// count and the join of uneven inputs (the step's sync control), and the
// experiment log.

ACCEL_NAMESPACE_BEGIN

namespace detail {
// What prepare() takes for a scheduler: anything that steps and is not an
// optimizer (LibTorch's LRScheduler, or a scheduler of yours).
template <class S>
concept scheduler_like = !std::derived_from<S, torch::optim::Optimizer> && requires(S& s) { s.step(); };
// What register_for_checkpointing takes: an object with LibTorch's save and load.
template <class T>
concept checkpointable =
    requires(T& t, const T& c, torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
      c.save(out);
      t.load(in);
    };
// What skip_first_batches takes: a prepared loader.
template <class L>
concept skips_batches = requires(L& l) { l.skip_first_batches(size_t{1}); };
}  // namespace detail

class Accelerator {
 public:
  // Every setting is checked before the rendezvous (AcceleratorSetup); under
  // mixed_precision "fp16" the Accelerator holds a loss scaler (as
  // Accelerate's), whose overflow check under sharding is agreed over the
  // world, since each process then holds other gradients.
  explicit Accelerator(AcceleratorConfig config = {});

  // -- what it runs on (accelerator/properties.hpp) ------------------------------

  c10::Device device() const;
  bool is_main_process() const;
  bool is_local_main_process() const;
  bool is_last_process() const;
  int process_index() const;
  int local_process_index() const;
  int num_processes() const;
  DistributedType distributed_type() const;
  const std::string& mixed_precision() const;
  int gradient_accumulation_steps() const;
  // The strategy in effect: NO_SHARD when the configured one has nothing to
  // shard along (mp_shard_size == 1, or one process).
  ShardingStrategy sharding_strategy() const;
  // Accelerate's use_distributed: more than one process.
  bool use_distributed() const;
  // Accelerate's is_fsdp2: whether parameters are sharded at rest
  // (FULL_SHARD or HYBRID_SHARD with something to shard along).
  bool is_fsdp2() const;
  // Accelerate's should_save_model: true on every process, which all call
  // save_model (a collective; the main process writes).
  bool should_save_model() const;
  // This process's rank along each kind of parallelism, as Accelerate names
  // them: data along Dim::DP, context along Dim::CP, tensor along Dim::TP,
  // pipeline along Dim::PP (0 for a dimension of size 1, as Accelerate for
  // one not enabled; the Accelerator refuses pp_size above 1 until pipeline
  // stages exist).
  int data_parallel_rank() const;
  int context_parallel_rank() const;
  int tensor_parallel_rank() const;
  int pipeline_parallel_rank() const;
  // Accelerate's state (PartialState): the facts of this process that every
  // Accelerator in it shares: the distributed interface (rank, world size,
  // device, meshes).
  const DistributedInterface& state() const;
  // Accelerate's fp8_backend: the FP8 backend in use; none here
  // (mixed_precision takes no "fp8"), so nullopt, Accelerate's None.
  std::optional<std::string> fp8_backend() const;
  // Accelerate's verify_device_map: whether the model is spread over devices
  // by a device map (big-model inference). accel.hpp places whole models: false.
  template <class ModuleHolder>
  bool verify_device_map(const ModuleHolder&) const;
  // Accelerate's project_dir, project_configuration and save_iteration (the
  // number the next automatically named checkpoint takes; set it through
  // project_configuration().iteration).
  const std::filesystem::path& project_dir() const;
  ProjectConfiguration& project_configuration();
  int save_iteration() const;

  // -- prepare (accelerator/preparing.hpp) ---------------------------------------

  // A model: moved to the device, its parameters and buffers broadcast from
  // rank 0, and bucketed gradient all-reduce armed over the data mesh (see
  // DataParallel). Any number of models may be prepared; each keeps its own
  // gradient sync. Returns the model itself (accel.hpp does not wrap).
  template <class ModuleHolder>
    requires detail::module_holder<ModuleHolder>
  ModuleHolder& prepare(ModuleHolder& model);
  // An optimizer (any torch::optim::Optimizer): see AcceleratedOptimizer.
  // Under sharding its groups then hold the shards of the prepared models'
  // parameters (prepare it before it steps), and step it through the handle
  // returned, whose step() gathers the parameters from the updated shards.
  // A tensor listed twice in it (LibTorch's model->parameters() lists a
  // tied weight under each of its names) is stepped once.
  AcceleratedOptimizer prepare(torch::optim::Optimizer& optimizer);
  // A learning-rate scheduler: see AcceleratedScheduler.
  template <detail::scheduler_like Scheduler>
  AcceleratedScheduler prepare(Scheduler& scheduler);
  // Several at once, as Accelerate's prepare(model, optimizer, scheduler):
  //   auto [model, optimizer, scheduler] = accelerator.prepare(net, adam, step_lr);
  template <class First, class Second, class... Rest>
  auto prepare(First& first, Second& second, Rest&... rest);
  // Accelerate's single-object forms of prepare.
  template <class ModuleHolder>
    requires detail::module_holder<ModuleHolder>
  ModuleHolder& prepare_model(ModuleHolder& model);
  AcceleratedOptimizer prepare_optimizer(torch::optim::Optimizer& optimizer);
  template <detail::scheduler_like Scheduler>
  AcceleratedScheduler prepare_scheduler(Scheduler& scheduler);

  // A data loader over this process's share of `dataset` on the data-parallel
  // group (see ShardSampler for the layouts). With split_batches,
  // config.batch_size is the global batch and must divide evenly among the
  // processes. config.dispatch_batches: the main process reads and sends.
  // An IterableDataset (a LibTorch StatefulDataset) gives a
  // PreparedIterableDataLoader instead.
  template <class Dataset>
  auto prepare_data_loader(Dataset dataset, DataLoaderConfig config = {});
  // The loader's next pass starts after its first n batches (Accelerate's
  // skip_first_batches, for a run resumed by hand; load_state does it for
  // prepared loaders). Returns the loader.
  template <detail::skips_batches Loader>
  Loader& skip_first_batches(Loader& loader, size_t n);

  // Anything with save(torch::serialize::OutputArchive&) and
  // load(torch::serialize::InputArchive&) (a LibTorch scheduler or sampler
  // of yours, a step counter) joins every checkpoint, as Accelerate's
  // register_for_checkpointing: custom_checkpoint_<i>.pt, in the order
  // registered, written by the main process. The object must outlive the
  // Accelerator's checkpoints.
  template <detail::checkpointable T>
  void register_for_checkpointing(T& object);

  // The DataParallel of the first prepared model, or of `model`; nullptr
  // when it was not prepared.
  DataParallel* data_parallel();
  template <class ModuleHolder>
  DataParallel* data_parallel(ModuleHolder& model);
  // The model itself: accel.hpp does not wrap modules.
  template <class ModuleHolder>
  ModuleHolder& unwrap_model(ModuleHolder& model) const;

  // Accelerate's free_memory, for a second training run in the same
  // process: the Accelerator lets go of every model, optimizer, scheduler
  // and loader it prepared and every object registered for checkpointing
  // (Accelerate keeps those; here they are references that may not outlive
  // the run), and its step count restarts. Each prepared model is a plain
  // module again: under FULL_SHARD its whole parameters gathered back into
  // it, and an optimizer that stepped shards steps the parameters again,
  // with its state started afresh (see DataParallel::release_module).
  // Every process calls it. Loaders keep working on their own.
  void free_memory();
  // Accelerate's other name for free_memory.
  void clear();

  // -- the training step (accelerator/training_step.hpp) -------------------------

  // loss.backward(), scaled by 1/gradient_accumulation_steps (and under
  // fp16 by the loss scaler's scale), with the
  // gradient all-reduce armed on every prepared model that syncs now (not
  // inside no_sync or a non-sync accumulate step). A model none of whose
  // parameters gets a gradient from this loss is left alone.
  void backward(const at::Tensor& loss);
  // Accelerate's lomo_backward runs the fused backward-and-step of a
  // prepared LOMO optimizer (lomo-optim's Lomo, AdaLomo). LibTorch has none,
  // so no prepared optimizer can be one: Accelerate's error for that case.
  void lomo_backward(const at::Tensor& loss, double learning_rate);

  // RAII: restores the models' gradient sync when it goes out of scope.
  using SyncGuard = detail::SyncGuard;
  // While the guard lives, backward() accumulates these models' gradients
  // locally (DDP's no_sync). A model that was never prepared never syncs.
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard no_sync(ModuleHolders&... models);
  // While the guard lives, backward() syncs these models' gradients, also
  // inside no_sync (Accelerate's trigger_sync_in_backward).
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard trigger_sync_in_backward(ModuleHolders&... models);
  // One micro-step of gradient accumulation, as Accelerate's accumulate():
  // counts the step and sets sync_gradients(), true on every
  // gradient_accumulation_steps-th call and on the last batch of a prepared
  // loader's pass (which also restarts the count, so no accumulated gradient
  // is carried into the next pass). On the other steps the given models
  // accumulate locally while the guard lives (unless sync_each_batch).
  // sync_gradients() keeps its value after the guard, for the loop to read.
  template <class... ModuleHolders>
  [[nodiscard]] SyncGuard accumulate(ModuleHolders&... models);
  // Whether the current step syncs gradients (and prepared optimizers step).
  bool sync_gradients() const;
  // Whether the batch being processed is the last of the innermost prepared
  // loader's pass.
  bool end_of_dataloader() const;
  // The innermost prepared loader whose pass is under way, as Accelerate's
  // gradient_state.active_dataloader: its address (compare with &loader),
  // nullptr outside every pass.
  const void* active_dataloader() const;

  // Training on uneven inputs (even_batches = false), as Accelerate's
  // join_uneven_inputs over DDP's Join: runs body (the training loop); a
  // rank whose loop ends first stands in for the others' gradient
  // all-reduces (with zeros: gradients are still divided by the whole group)
  // until every rank's loop has ended, and then every rank takes the
  // weights of a rank that ran the most steps (DDP's final model sync).
  // Inside body, each backward() first tells the joined ranks what to shadow
  // (one small all_reduce), and every listed model that syncs is reduced on
  // every backward; other collectives inside body would have no partner on a
  // joined rank (as with DDP's Join).
  template <class Body, class... ModuleHolders>
    requires(detail::module_holder<ModuleHolders> && ...)
  void join_uneven_inputs(Body&& body, ModuleHolders&... models);
  // The same, with the prepared loaders' even_batches set to even_batches
  // for the block (Accelerate's join_uneven_inputs(..., even_batches)): it
  // applies to each pass that starts inside the block. Loaders that
  // dispatch batches, and iterable ones, have no even_batches (Accelerate
  // warns about them, and also leaves them as they are).
  template <class Body, class... ModuleHolders>
    requires(detail::module_holder<ModuleHolders> && ...)
  void join_uneven_inputs(Body&& body, bool even_batches, ModuleHolders&... models);

  // torch's clip_grad_norm_ and clip_grad_value_, over every rank's shards
  // under sharding (detail::clip_grad_norm). Under fp16 the gradients are
  // unscaled first (unscale_gradients), as Accelerate does: call them once
  // per optimizer step, on the steps that sync.
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0);
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value);
  // Under fp16: divides the prepared optimizers' gradients (or `optimizer`'s)
  // by the loss scale, once per step (GradScaler::unscale_); else nothing.
  void unscale_gradients();
  void unscale_gradients(AcceleratedOptimizer& optimizer);
  // The loss scaler of mixed_precision "fp16" (AcceleratorConfig::grad_scaler),
  // as Accelerate's accelerator.scaler; nullptr otherwise.
  GradScaler* scaler() const;

  // RAII autocast for the configured mixed precision: bf16 on the CPU
  // through LibTorch's autocast; a no-op for "no".
  using AutocastGuard = detail::AutocastGuard;
  [[nodiscard]] AutocastGuard autocast() const;

  // -- over every process (accelerator/process_operations.hpp) -------------------

  // Accelerate's operations as methods (accelerator.gather(x),
  // accelerator.print(...)): each calls the free function of the same name
  // over the world (accel/distributed/operations.hpp, process_control.hpp).
  template <TensorTree T>
  T gather(const T& data) const;
  template <TensorTree T>
  T reduce(const T& data, ReduceOp reduction = ReduceOp::SUM) const;  // Accelerate's default: sum
  template <TensorTree T>
  T reduce(const T& data, std::string_view reduction) const;  // "sum", "mean", "max", "min", as accel::reduce
  template <TensorTree T>
  T pad_across_processes(const T& data, int64_t dim = 0, const at::Scalar& pad_index = 0, bool pad_first = false) const;
  template <class T>
  T split_between_processes(const T& inputs, bool apply_padding = false) const;
  template <class... Args>
  void print(const Args&... args) const;
  void wait_for_everyone() const;
  template <class Body>
  std::invoke_result_t<Body&> main_process_first(Body&& body) const;
  template <class Body>
  std::invoke_result_t<Body&> local_main_process_first(Body&& body) const;
  template <class Fn>
  auto on_main_process(Fn fn) const;
  template <class Fn>
  auto on_local_main_process(Fn fn) const;
  template <class Fn>
  auto on_last_process(Fn fn) const;
  template <class Fn>
  auto on_process(Fn fn, int process_index) const;

  // Any process can ask every process to stop at the same step: set_trigger()
  // on one, then check_trigger() on all (one all_reduce) is true on all, and
  // resets the trigger.
  void set_trigger();
  bool check_trigger();

  // Every rank's tensors concatenated along dim 0 in rank order (uneven sizes
  // welcome), over the data-parallel group. Inside a pass over a prepared
  // loader, the rows that repeat samples (even_batches padding) are dropped
  // first, so every sample of the dataset is counted exactly once.
  // num_samples instead keeps the first num_samples rows of the result (for
  // data that did not come from a prepared loader).
  template <TensorTree T>
  T gather_for_metrics(const T& data, std::optional<int64_t> num_samples = std::nullopt);

  // -- the experiment log (accelerator/process_operations.hpp; files: trackers.hpp)

  // Accelerate's init_trackers: the files go to logging_dir/<project_name>,
  // and `config` (the run's hyperparameters, as text) to config.json there.
  // Every process calls it; the main process writes.
  void init_trackers(const std::string& project_name, const std::map<std::string, std::string>& config = {});
  // Accelerate's log: `values` at `step` to every tracker (main process only).
  void log(const std::map<std::string, double>& values, std::optional<int64_t> step = {});
  // Accelerate's end_training: the trackers finish (these files are
  // complete after every log call already); log() after it is an error.
  void end_training();
  // Where this run's files go (logging_dir, or project_dir, / project name).
  std::filesystem::path logging_dir() const;

  // -- checkpoints and weights (accelerator/checkpoints.hpp) ---------------------

  // Saves every prepared model and optimizer (model.pt, model_1.pt, ...,
  // optimizer.pt, optimizer_1.pt, ...), every rank's RNG state and the
  // accumulation step, where each prepared loader is in its pass, and the
  // registered objects under `path`, atomically: it is always the previous or the whole new
  // checkpoint, even when a process dies halfway (see "Checkpoint files").
  // Every process calls it; the path must be on a filesystem they all see. An
  // error on any process (a full disk) is thrown on every process. With
  // project_config.automatic_checkpoint_naming, call it without a path: it
  // writes project_dir/checkpoints/checkpoint_<iteration> (an error if that
  // exists), counts iteration up, and with total_limit then removes the
  // oldest beyond the limit. Returns the checkpoint's directory.
  std::filesystem::path save_state(const std::filesystem::path& path = {});
  // Loads what save_state saved into the prepared models, optimizers,
  // registered objects and this rank's RNG and step, after a half-done save
  // is recovered. Each prepared loader's next pass resumes where the saved
  // one was: its epoch, after the batches already handed out (a save after
  // a pass's last batch resumes with the next epoch); loop over epochs from
  // loader.next_epoch(). Transactional:
  // every file is read and checked first (parameter and buffer names, shapes
  // and dtypes against the models), on every process; another number of
  // processes or another sharding strategy is fine (checkpoint/world.hpp,
  // checkpoint/reshard.hpp; across tensor-parallel layouts the optimizer
  // state of Adam, AdamW and SGD only); on any error
  // nothing is modified anywhere and every process throws, naming the file.
  // With project_config.automatic_checkpoint_naming, no path loads the
  // newest numbered checkpoint, and any load sets iteration past the newest
  // (Accelerate leaves it, and the next save_state() finds its number taken).
  void load_state(const std::filesystem::path& path = {});

  // accel::save_model and accel::load_model (accel/training/checkpoint/weights.hpp) on a
  // prepared model. Under FULL_SHARD save_model gathers the parameters one
  // unit at a time as the files reach them (beside its shards no process
  // holds more than one unit's whole parameters and the rows its
  // all-gather lands in); load_model gathers them all for the call and
  // writes them back into the shards.
  template <class ModuleHolder>
  void save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options = {});
  // (the same, options.max_shard_bytes given alone)
  template <class ModuleHolder>
  void save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes);
  template <class ModuleHolder>
  void load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options = {});

 private:
  template <class ModuleHolder>
  detail::PreparedModel* find_prepared(ModuleHolder& model, const char* op);
  // Forgets everything prepared (free_memory, once the models are plain modules again).
  void let_go_of_prepared();
  template <class... ModuleHolders>
  SyncGuard with_sync(bool sync, ModuleHolders&... models);
  detail::CheckpointContext checkpoint_context() const;

  // The checked configuration, the world and the device.
  detail::AcceleratorSetup setup_;
  // What was prepared, and what the prepared optimizers, schedulers and
  // loaders share (Accelerate's GradientState).
  detail::PreparedSet prepared_;
  std::shared_ptr<detail::GradientState> state_ = std::make_shared<detail::GradientState>();
  // The step's sync control: accumulate()'s count of micro-steps, and the
  // join of uneven inputs while join_uneven_inputs runs its body.
  int64_t step_ = 0;
  std::optional<detail::Join> join_;
  // check_trigger()'s flag, and the experiment log's files.
  int64_t trigger_ = 0;
  detail::ExperimentLog log_;
};

ACCEL_NAMESPACE_END

// == accel/training/accelerator/properties.hpp ================================
// accel/training/accelerator/properties.hpp: the Accelerator's constructor and properties: what it runs on, read off its setup.

ACCEL_NAMESPACE_BEGIN

inline Accelerator::Accelerator(AcceleratorConfig config)
    : setup_(std::move(config)), log_(setup_.config(), is_main_process()) {
  // Whether a gradient overflowed is agreed over the world where processes
  // hold different gradients (shards, or tensor-parallel pieces): else one
  // would skip a step its peers take.
  const bool pieces = setup_.sharded() || setup_.world().strategy().tp_size() > 1;
  if (mixed_precision() == "fp16" && setup_.config().grad_scaler.enabled)
    prepared_.scaler = std::make_shared<GradScaler>(setup_.config().grad_scaler, device(),
                                                    pieces ? setup_.world().world_group() : GroupPtr{});
}

inline c10::Device Accelerator::device() const { return setup_.device(); }
inline bool Accelerator::is_main_process() const { return setup_.world().get_rank() == 0; }
inline bool Accelerator::is_local_main_process() const { return setup_.world().get_local_rank() == 0; }
inline bool Accelerator::is_last_process() const { return process_index() == num_processes() - 1; }
inline int Accelerator::process_index() const { return setup_.world().get_rank(); }
inline int Accelerator::local_process_index() const { return setup_.world().get_local_rank(); }
inline int Accelerator::num_processes() const { return setup_.world().get_world_size(); }
inline DistributedType Accelerator::distributed_type() const {
  if (!setup_.world().distributed() || num_processes() == 1) return DistributedType::NO;
  return device().is_cuda() ? DistributedType::MULTI_GPU : DistributedType::MULTI_CPU;
}
inline const std::string& Accelerator::mixed_precision() const { return setup_.config().mixed_precision; }
inline int Accelerator::gradient_accumulation_steps() const { return setup_.config().gradient_accumulation_steps; }
inline ShardingStrategy Accelerator::sharding_strategy() const {
  return setup_.sharded() ? setup_.config().sharding_strategy : ShardingStrategy::NO_SHARD;
}
inline bool Accelerator::use_distributed() const { return distributed_type() != DistributedType::NO; }
inline bool Accelerator::is_fsdp2() const {
  const ShardingStrategy s = sharding_strategy();
  return s == ShardingStrategy::FULL_SHARD || s == ShardingStrategy::HYBRID_SHARD;
}
inline bool Accelerator::should_save_model() const { return true; }
inline int Accelerator::data_parallel_rank() const { return setup_.world().get_rank(Dim::DP); }
inline int Accelerator::context_parallel_rank() const { return setup_.world().get_rank(Dim::CP); }
inline int Accelerator::tensor_parallel_rank() const { return setup_.world().get_rank(Dim::TP); }
inline int Accelerator::pipeline_parallel_rank() const { return setup_.world().get_rank(Dim::PP); }
inline const DistributedInterface& Accelerator::state() const { return setup_.world(); }
inline std::optional<std::string> Accelerator::fp8_backend() const { return std::nullopt; }
template <class ModuleHolder>
bool Accelerator::verify_device_map(const ModuleHolder&) const {
  return false;
}
inline const std::filesystem::path& Accelerator::project_dir() const {
  return setup_.config().project_config.project_dir;
}
inline ProjectConfiguration& Accelerator::project_configuration() { return setup_.project(); }
inline int Accelerator::save_iteration() const { return setup_.config().project_config.iteration; }

ACCEL_NAMESPACE_END

// == accel/training/accelerator/preparing.hpp =================================
// accel/training/accelerator/preparing.hpp: the Accelerator's prepare() in all its forms, and letting go of what it prepared.
//
// Each prepared thing is listed in the PreparedSet, which the training step
// reads and checkpoints save and load; the optimizers, schedulers and
// loaders share the GradientState.

ACCEL_NAMESPACE_BEGIN

template <class ModuleHolder>
  requires detail::module_holder<ModuleHolder>
ModuleHolder& Accelerator::prepare(ModuleHolder& model) {
  auto module = std::static_pointer_cast<torch::nn::Module>(model.ptr());
  if (prepared_.find(module.get()))
    throw InvalidArgument("accel::Accelerator::prepare: this model is already prepared");
  model->to(device());
  // Beside tp the whole tensors first agree across each tp group (before a FULL_SHARD wrapper takes the
  // parameters' memory); the wrapper then starts every dp_cp group from its first rank.
  detail::tp::SplitTensors split = detail::tp::split_tensors(*module);
  detail::tp::broadcast_whole_tensors(*module, split);
  prepared_.models.push_back(detail::PreparedModel{module, setup_.data_parallel_for(module), std::move(split)});
  if (setup_.sharded()) {
    prepared_.sharded->push_back(prepared_.models.back().data_parallel.get());
    for (auto* optimizer : prepared_.optimizers) prepared_.sharded->back()->shard_optimizer(*optimizer);
  }
  return model;
}

inline AcceleratedOptimizer Accelerator::prepare(torch::optim::Optimizer& optimizer) {
  detail::take_parameters_once(optimizer, prepared_);
  if (std::find(prepared_.optimizers.begin(), prepared_.optimizers.end(), &optimizer) == prepared_.optimizers.end())
    prepared_.optimizers.push_back(&optimizer);
  if (!setup_.sharded()) return AcceleratedOptimizer(optimizer, state_, {}, prepared_.scaler);
  for (DataParallel* dp : *prepared_.sharded) dp->shard_optimizer(optimizer);
  return AcceleratedOptimizer(
      optimizer, state_,
      [sharded = prepared_.sharded, &optimizer] {
        for (DataParallel* dp : *sharded)
          if (dp->steps_with(optimizer)) dp->gather_shards();
      },
      prepared_.scaler);
}

template <detail::scheduler_like Scheduler>
AcceleratedScheduler Accelerator::prepare(Scheduler& scheduler) {
  auto found = std::find_if(prepared_.schedulers.begin(), prepared_.schedulers.end(),
                            [&](const detail::PreparedScheduler& p) { return p.address == &scheduler; });
  if (found == prepared_.schedulers.end()) {
    detail::PreparedScheduler p{&scheduler, std::make_shared<int64_t>(0), [&scheduler] { scheduler.step(); }, {}, {}};
    if constexpr (detail::checkpointable<Scheduler>) {
      p.save = [&scheduler](torch::serialize::OutputArchive& out) { scheduler.save(out); };
      p.load = [&scheduler](torch::serialize::InputArchive& in) { scheduler.load(in); };
    }
    prepared_.schedulers.push_back(std::move(p));
    found = std::prev(prepared_.schedulers.end());
  }
  return AcceleratedScheduler(scheduler, state_,
                              setup_.config().split_batches ? 1 : setup_.world().get_world_size(Dim::DP), found->steps);
}

template <class First, class Second, class... Rest>
auto Accelerator::prepare(First& first, Second& second, Rest&... rest) {
  return std::tuple<decltype(prepare(first)), decltype(prepare(second)), decltype(prepare(rest))...>{
      prepare(first), prepare(second), prepare(rest)...};  // braces: prepared left to right
}

template <class ModuleHolder>
  requires detail::module_holder<ModuleHolder>
ModuleHolder& Accelerator::prepare_model(ModuleHolder& model) {
  return prepare(model);
}
inline AcceleratedOptimizer Accelerator::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  return prepare(optimizer);
}
template <detail::scheduler_like Scheduler>
AcceleratedScheduler Accelerator::prepare_scheduler(Scheduler& scheduler) {
  return prepare(scheduler);
}

template <class Dataset>
auto Accelerator::prepare_data_loader(Dataset dataset, DataLoaderConfig config) {
  const int replicas = setup_.world().get_world_size(Dim::DP);
  const bool split_batches = setup_.config().split_batches;
  if (config.batch_size == 0) throw InvalidArgument("accel::prepare_data_loader: batch_size must be at least 1");
  if (split_batches && config.batch_size % static_cast<size_t>(replicas) != 0)
    throw InvalidArgument("accel::prepare_data_loader: with split_batches the batch size (" +
                          std::to_string(config.batch_size) + ") must be a multiple of the " +
                          std::to_string(replicas) + " data-parallel processes");
  using Loader =
      std::conditional_t<IterableDataset<Dataset>, PreparedIterableDataLoader<Dataset>, PreparedDataLoader<Dataset>>;
  auto position = std::make_shared<detail::LoaderPosition>();  // its place in its passes goes into checkpoints
  const size_t batch = config.batch_sampler ? config.batch_sampler_batch_size.value_or(0) : config.batch_size;
  position->samples_per_batch = split_batches ? batch : batch * static_cast<size_t>(replicas);
  prepared_.loaders.push_back(position);
  return Loader(std::move(dataset), config, setup_.world().get_group(Dim::DP), split_batches, state_,
                prepared_.loaders.back());
}

template <detail::skips_batches Loader>
Loader& Accelerator::skip_first_batches(Loader& loader, size_t n) {
  loader.skip_first_batches(n);
  return loader;
}

template <detail::checkpointable T>
void Accelerator::register_for_checkpointing(T& object) {
  prepared_.objects.push_back({[&object](torch::serialize::OutputArchive& out) { object.save(out); },
                               [&object](torch::serialize::InputArchive& in) { object.load(in); }});
}

inline DataParallel* Accelerator::data_parallel() {
  return prepared_.models.empty() ? nullptr : prepared_.models.front().data_parallel.get();
}
template <class ModuleHolder>
DataParallel* Accelerator::data_parallel(ModuleHolder& model) {
  detail::PreparedModel* p = prepared_.find(model.ptr().get());
  return p ? p->data_parallel.get() : nullptr;
}
template <class ModuleHolder>
ModuleHolder& Accelerator::unwrap_model(ModuleHolder& model) const {
  return model;
}

inline void Accelerator::free_memory() {
  if (join_) throw LogicError("accel::Accelerator::free_memory: inside join_uneven_inputs");
  detail::every_process_calls("accel::Accelerator::free_memory", [&] {
    for (auto& m : prepared_.models) m.data_parallel->release_module();
  });
  let_go_of_prepared();
  step_ = 0;
  state_->sync_gradients = true;
}
inline void Accelerator::clear() { free_memory(); }

template <class ModuleHolder>
detail::PreparedModel* Accelerator::find_prepared(ModuleHolder& model, const char* op) {
  if (detail::PreparedModel* p = prepared_.find(model.ptr().get())) return p;
  throw InvalidArgument(std::string("accel::Accelerator::") + op + ": the model was not prepared");
}
inline void Accelerator::let_go_of_prepared() {
  prepared_.sharded->clear();                 // the optimizers' handles stop gathering
  auto scaler = std::move(prepared_.scaler);  // (the scaler is the Accelerator's, as Accelerate's)
  prepared_ = {};
  prepared_.scaler = std::move(scaler);
}

ACCEL_NAMESPACE_END

// == accel/training/accelerator/training_step.hpp =============================
// accel/training/accelerator/training_step.hpp: the Accelerator's training step: backward, gradient sync and accumulation, uneven inputs, clipping, the loss scale.

ACCEL_NAMESPACE_BEGIN

inline void Accelerator::backward(const at::Tensor& loss) {
  auto step = [&] {
    const int steps = gradient_accumulation_steps();
    at::Tensor scaled = prepared_.scaler ? prepared_.scaler->scale(loss) : loss;
    if (steps > 1) scaled = scaled / steps;
    if (join_) join_->before_backward();
    for (DataParallel* dp : *prepared_.sharded) dp->check_shards();
    for (auto& m : prepared_.models) m.data_parallel->prepare_for_backward();  // (a model not syncing now: nothing)
    scaled.backward();
    for (auto& m : prepared_.models) m.data_parallel->finish(/*always=*/join_ && join_->includes(&m));
    // Sequence parallelism's partial gradients (those accel::tp layers and a plan know of) summed over tp, on
    // the steps that sync: the accumulated parts once (summing on the others would count earlier parts again).
    // (under sharding, the shards' gradients: FSDP + TP)
    if (sync_gradients())
      for (auto& m : prepared_.models)
        if (m.split.group) tp::all_reduce_sequence_parallel_gradients(*m.module);
  };
  if (join_) step();  // (a joined process stands in for it without calling it)
  else detail::every_process_calls("accel::Accelerator::backward", step);
}

inline void Accelerator::lomo_backward(const at::Tensor&, double) {
  throw InvalidArgument(
      "accel::Accelerator::lomo_backward: Backward pass not properly called on LOMO optimizers. Are you sure you "
      "passed a LOMO optimizer in accelerator.prepare()? (LibTorch has no LOMO optimizer: call backward(loss) and "
      "step the optimizer)");
}

template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::no_sync(ModuleHolders&... models) {
  return with_sync(false, models...);
}
template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::trigger_sync_in_backward(ModuleHolders&... models) {
  return with_sync(true, models...);
}
template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::accumulate(ModuleHolders&... models) {
  if (setup_.config().sync_with_dataloader && state_->end_of_dataloader()) {
    step_ = 0;
    state_->sync_gradients = true;
  } else {
    ++step_;
    state_->sync_gradients = step_ % gradient_accumulation_steps() == 0;
  }
  return with_sync(state_->sync_gradients || setup_.config().sync_each_batch, models...);
}
inline bool Accelerator::sync_gradients() const { return state_->sync_gradients; }
inline bool Accelerator::end_of_dataloader() const { return state_->end_of_dataloader(); }
inline const void* Accelerator::active_dataloader() const { return state_->active_dataloader(); }

template <class... ModuleHolders>
Accelerator::SyncGuard Accelerator::with_sync([[maybe_unused]] bool sync, ModuleHolders&... models) {
  SyncGuard guard;  // (no models: sync unused)
  (
      [&] {
        if (detail::PreparedModel* p = prepared_.find(models.ptr().get())) guard.set(*p->data_parallel, sync);
      }(),
      ...);
  return guard;
}

template <class Body, class... ModuleHolders>
  requires(detail::module_holder<ModuleHolders> && ...)
void Accelerator::join_uneven_inputs(Body&& body, ModuleHolders&... models) {
  static_assert(sizeof...(ModuleHolders) > 0, "accel::Accelerator::join_uneven_inputs: name the prepared models");
  if (join_) throw LogicError("accel::Accelerator::join_uneven_inputs: already inside one");
  if (const int tp = setup_.world().strategy().tp_size(); tp > 1)
    throw InvalidArgument("accel::Accelerator::join_uneven_inputs: tp_size " + std::to_string(tp) +
                          ": a joined process would leave its tensor-parallel peers waiting in the model's own "
                          "collectives; use even batches");
  if (!prepared_.sharded->empty())
    throw InvalidArgument(
        "accel::Accelerator::join_uneven_inputs: not under sharding yet (a joined process would "
        "have to step its shard too); use NO_SHARD, or even batches");
  detail::run_joined(join_, detail::Join({find_prepared(models, "join_uneven_inputs")...}), std::forward<Body>(body));
}
template <class Body, class... ModuleHolders>
  requires(detail::module_holder<ModuleHolders> && ...)
void Accelerator::join_uneven_inputs(Body&& body, bool even_batches, ModuleHolders&... models) {
  const detail::EvenBatchesOverride for_the_block(prepared_.loaders, even_batches);
  join_uneven_inputs(std::forward<Body>(body), models...);
}

inline double Accelerator::clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                                           double norm_type) {
  unscale_gradients();
  return detail::clip_grad_norm(prepared_, parameters, max_norm, norm_type);
}
inline void Accelerator::clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) {
  unscale_gradients();
  detail::clip_grad_value(prepared_, parameters, clip_value);
}
inline void Accelerator::unscale_gradients() {
  if (prepared_.scaler)
    for (auto* optimizer : prepared_.optimizers) prepared_.scaler->unscale_(*optimizer);
}
inline void Accelerator::unscale_gradients(AcceleratedOptimizer& optimizer) {
  if (prepared_.scaler) prepared_.scaler->unscale_(optimizer.optimizer());
}
inline GradScaler* Accelerator::scaler() const { return prepared_.scaler.get(); }

inline Accelerator::AutocastGuard Accelerator::autocast() const { return AutocastGuard(mixed_precision(), device()); }

ACCEL_NAMESPACE_END

// == accel/training/accelerator/process_operations.hpp ========================
// accel/training/accelerator/process_operations.hpp: the Accelerator's work over every process: Accelerate's operations as methods, metrics, the trigger, the experiment log.
//
// Each operation calls the free function of the same name over the world
// (accel/distributed/operations.hpp, process_control.hpp);
// gather_for_metrics also reads the prepared loaders' passes, and the log
// methods hand over to the ExperimentLog (accelerator/trackers.hpp).

ACCEL_NAMESPACE_BEGIN

template <TensorTree T>
T Accelerator::gather(const T& data) const {
  return accel::gather(data);
}
template <TensorTree T>
T Accelerator::reduce(const T& data, ReduceOp reduction) const {
  return accel::reduce(data, reduction);
}
template <TensorTree T>
T Accelerator::reduce(const T& data, std::string_view reduction) const {
  return accel::reduce(data, reduction);
}
template <TensorTree T>
T Accelerator::pad_across_processes(const T& data, int64_t dim, const at::Scalar& pad_index, bool pad_first) const {
  return accel::pad_across_processes(data, dim, pad_index, pad_first);
}
template <class T>
T Accelerator::split_between_processes(const T& inputs, bool apply_padding) const {
  return accel::split_between_processes(inputs, apply_padding);
}
template <class... Args>
void Accelerator::print(const Args&... args) const {
  accel::print(args...);
}
inline void Accelerator::wait_for_everyone() const {
  detail::every_process_calls("accel::Accelerator::wait_for_everyone", [] { accel::wait_for_everyone(); });
}
template <class Body>
std::invoke_result_t<Body&> Accelerator::main_process_first(Body&& body) const {
  return accel::main_process_first(std::forward<Body>(body), /*local_only=*/false);
}
template <class Body>
std::invoke_result_t<Body&> Accelerator::local_main_process_first(Body&& body) const {
  return accel::main_process_first(std::forward<Body>(body), /*local_only=*/true);
}
template <class Fn>
auto Accelerator::on_main_process(Fn fn) const {
  return accel::on_main_process(std::move(fn));
}
template <class Fn>
auto Accelerator::on_local_main_process(Fn fn) const {
  return accel::on_local_main_process(std::move(fn));
}
template <class Fn>
auto Accelerator::on_last_process(Fn fn) const {
  return accel::on_last_process(std::move(fn));
}
template <class Fn>
auto Accelerator::on_process(Fn fn, int process_index) const {
  return accel::on_process(std::move(fn), process_index);
}

inline void Accelerator::set_trigger() { trigger_ = 1; }
inline bool Accelerator::check_trigger() {
  if (accel::all_reduce(trigger_, ReduceOp::SUM) == 0) return false;
  trigger_ = 0;
  return true;
}

template <TensorTree T>
T Accelerator::gather_for_metrics(const T& data, std::optional<int64_t> num_samples) {
  return detail::every_process_calls("accel::Accelerator::gather_for_metrics", [&]() -> T {
    const GroupPtr group = setup_.world().get_group(Dim::DP);
    auto first_rows = [](int64_t rows) {
      return [rows](const at::Tensor& t) { return t.dim() ? t.narrow(0, 0, std::min(rows, t.size(0))) : t; };
    };
    if (num_samples) return recursively_apply(first_rows(*num_samples), accel::gather(data, group));
    const detail::LoaderState* loader = state_->loader();
    if (loader && loader->real_rows)
      return accel::gather(recursively_apply(first_rows(static_cast<int64_t>(*loader->real_rows)), data), group);
    return accel::gather(data, group);
  });
}

inline void Accelerator::init_trackers(const std::string& project_name,
                                       const std::map<std::string, std::string>& config) {
  log_.init_trackers(project_name, config);
}
inline void Accelerator::log(const std::map<std::string, double>& values, std::optional<int64_t> step) {
  log_.log(values, step);
}
inline void Accelerator::end_training() { log_.end_training(); }
inline std::filesystem::path Accelerator::logging_dir() const { return log_.logging_dir(); }

ACCEL_NAMESPACE_END

// == accel/training/accelerator/checkpoints.hpp ===============================
// accel/training/accelerator/checkpoints.hpp: the Accelerator's checkpoints (save_state, load_state) and exported weights (save_model, load_model).
//
// The checkpoint functions (checkpoint/state.hpp) do the work on the
// PreparedSet; this part says where this process stands and runs them on
// every process.

ACCEL_NAMESPACE_BEGIN

inline std::filesystem::path Accelerator::save_state(const std::filesystem::path& path) {
  return detail::every_process_calls("accel::Accelerator::save_state", [&] {
    return detail::save_checkpoint_state(prepared_, checkpoint_context(), step_, project_configuration(), path);
  });
}

inline void Accelerator::load_state(const std::filesystem::path& path) {
  step_ = detail::every_process_calls("accel::Accelerator::load_state", [&] {
    return detail::load_checkpoint_state(prepared_, checkpoint_context(), project_configuration(), path);
  });
}

template <class ModuleHolder>
void Accelerator::save_model(ModuleHolder& model, const std::string& dir, const SaveModelOptions& options) {
  detail::every_process_calls("accel::Accelerator::save_model", [&] {
    const detail::PreparedModel* prepared = prepared_.find(model.ptr().get());
    DataParallel* dp = prepared ? prepared->data_parallel.get() : nullptr;
    if (!dp || dp->unit_count() == 0) return accel::save_model(model, dir, options);
    auto units = dp->unit_by_unit();
    detail::save_weights(*model.ptr(), detail::checkpoint_path(dir, "save_model"), options,
                         [&](const at::Tensor& t) { return units.whole(t); });
  });
}
template <class ModuleHolder>
void Accelerator::save_model(ModuleHolder& model, const std::string& dir, uint64_t max_shard_bytes) {
  save_model(model, dir, SaveModelOptions{.max_shard_bytes = max_shard_bytes});
}
template <class ModuleHolder>
void Accelerator::load_model(ModuleHolder& model, const std::string& dir, const LoadModelOptions& options) {
  detail::every_process_calls("accel::Accelerator::load_model", [&] {
    const auto full = prepared_.full_parameters(model.ptr().get(), /*writeback=*/true);
    accel::load_model(model, dir, options);
  });
}

inline detail::CheckpointContext Accelerator::checkpoint_context() const {
  return {.process_index = process_index(),
          .num_processes = num_processes(),
          .shards = prepared_.sharded->empty() ? 1 : setup_.world().get_world_size(Dim::MP_SHARD),
          .tp = setup_.world().strategy().tp_size(),
          .device = device()};
}

ACCEL_NAMESPACE_END

#endif  // ACCEL_HPP_TRAINING
