// accel/core/strategy.hpp: DistributedConfig and DistributedStrategy: the parallel sizes, validated.
//
// The parallelism sizes, validated against the world size.
#pragma once

#include "accel/core/environment.hpp"

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
