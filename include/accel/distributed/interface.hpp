// accel/distributed/interface.hpp: DistributedInterface (the singleton), new_group, init_device_mesh.
#pragma once

#include "accel/core/strategy.hpp"
#include "accel/distributed/exchange.hpp"
#include "accel/distributed/world.hpp"

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
