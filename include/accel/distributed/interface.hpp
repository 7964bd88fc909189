// accel/distributed/interface.hpp: DistributedInterface (the singleton), new_group, init_device_mesh.
#pragma once

#include "accel/core/strategy.hpp"
#include "accel/distributed/exchange.hpp"
#include "accel/distributed/mesh.hpp"

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
  const std::string& backend() const { return backend_; }

  // The 1-D mesh of one dimension (no dim: invalid_argument; not
  // distributed: nullptr).
  const DeviceMesh* get_device_mesh(std::optional<Dim> dim) const {
    if (!dim) throw InvalidArgument("accel::DistributedInterface::get_device_mesh: dim must be specified");
    if (!distributed_) return nullptr;
    return &dim_meshes_[static_cast<std::size_t>(*dim)];
  }
  // The whole 2-D model mesh (mp_replicate, mp_shard) or data mesh (dp, cp).
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
    const std::string call = detail::describe_mesh_call(shape, names);
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
    if (product != world_size_)
      throw InvalidArgument("accel::" + call + ": the sizes multiply to " +
                            (product == int64_t{1} << 40 ? "2^40 or more" : std::to_string(product)) +
                            ", the world has " + std::to_string(world_size_) + " ranks");
    if (distributed_) detail::check_same_call(*world_, [&] { return call; });
    auto root = new_root(shape, names, prefix_ + "mesh/" + std::to_string(mesh_count_++) + "/");
    if (distributed_) make_groups({root.get()}, /*with_world=*/false);
    return DeviceMesh::root(std::move(root));
  }

  GroupPtr get_group(std::optional<Dim> dim = std::nullopt) const {
    if (!distributed_ || !dim) return {};
    return get_device_mesh(dim)->get_group();
  }
  GroupPtr world_group() const { return world_; }

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
  GroupPtr new_group(const std::vector<int>& ranks) {
    std::vector<int> members = ranks;
    std::sort(members.begin(), members.end());
    std::string list;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] < 0 || members[i] >= world_size_)
        throw InvalidArgument("accel::new_group: rank " + std::to_string(members[i]) + " is not a rank of the world (" +
                              std::to_string(world_size_) + " ranks)");
      if (i > 0 && members[i] == members[i - 1])
        throw InvalidArgument("accel::new_group: rank " + std::to_string(members[i]) + " is given twice");
      list += (i ? ", " : "") + std::to_string(members[i]);
    }
    if (members.empty()) throw InvalidArgument("accel::new_group: no ranks given");
    if (!distributed_) return {};
    const std::string name = "new_group([" + list + "])";
    detail::check_same_call(*world_, [&] { return name; });
    return user_group(members, name, "");
  }
  // MPI_Comm_split: the ranks that pass the same color form a group, ordered
  // by key (then by world rank); a negative color joins no group (a group of
  // its own, as for new_group's outsiders). Every rank of the world calls
  // it; one all_gather of (color, key). Kept alive until destroy().
  GroupPtr split_group(int color, int key = 0) {
    if (!distributed_) return {};
    detail::check_same_call(*world_, [] { return std::string("split_group()"); });
    const std::array<int64_t, 2> mine{color, key};
    std::vector<int64_t> all(2 * static_cast<std::size_t>(world_size_));
    detail::all_gather_cpu<int64_t>(*world_, mine.data(), 2, all.data(), "split_group");
    std::vector<std::pair<int64_t, int>> order;  // (key, world rank) of this color
    if (color >= 0)
      for (int r = 0; r < world_size_; ++r)
        if (all[2 * static_cast<std::size_t>(r)] == color)
          order.emplace_back(all[2 * static_cast<std::size_t>(r) + 1], r);
    std::sort(order.begin(), order.end());
    std::vector<int> members;
    for (const auto& [k, r] : order) members.push_back(r);
    return user_group(members, "split_group(color=" + std::to_string(color) + ")",
                      "color/" + std::to_string(color) + "/");
  }

  void sync() { synchronize(); }
  void barrier() {
    if (distributed_) accel::barrier(world_);
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
        current_device_(current_accelerator_) {
    if (!distributed_) {
      debug_mode();  // validates ACCEL_DEBUG_MODE
      return;
    }
    detail::ignore_sigpipe();
    detail::bind_device(current_accelerator_.type());
    current_device_ = detail::current_device_of(current_accelerator_.type());
    backend_ = detail::backend_for(current_accelerator_.type());
    const bool debug = debug_mode();  // a malformed ACCEL_DEBUG_MODE fails here, not mid-training
    const detail::StoreAddress address = detail::store_address();  // malformed: InvalidArgument, here
    try {
      // (No structured binding: clang before 16 cannot capture one in the lambda below.)
      detail::Rendezvoused met = detail::rendezvous(address, rank_, world_size_, debug, config.timeout);
      store_ = met.store;
      address_ = address;
      prefix_ = met.prefix;
      const auto seed = [&](auto shape, auto names, const char* key) {
        return new_root({shape.begin(), shape.end()}, {names.begin(), names.end()}, prefix_ + key);
      };
      auto model = seed(strategy_.model_mesh_shape(), strategy_.model_mesh_dim_names(), "model/");
      auto data = seed(strategy_.data_mesh_shape(), strategy_.data_mesh_dim_names(), "data/");
      make_groups({model.get(), data.get()}, /*with_world=*/true);
      model_mesh_ = DeviceMesh::root(std::move(model));
      data_mesh_ = DeviceMesh::root(std::move(data));
    } catch (const DistributedError&) {
      release();
      throw;
    } catch (const std::exception& e) {
      release();
      throw DistributedError("accel: initialising rank " + std::to_string(rank_) + " of " +
                             std::to_string(world_size_) + " (" + backend_ +
                             " process groups) failed: " + detail::error_text(e));
    }
    for (Dim dim : {Dim::MP_REPLICATE, Dim::MP_SHARD, Dim::DP, Dim::CP})
      dim_meshes_.push_back(((dim == Dim::DP || dim == Dim::CP) ? *data_mesh_ : *model_mesh_).slice(to_string(dim)));
  }

  // The root of a new mesh, its groups not made yet.
  std::shared_ptr<detail::MeshRoot> new_root(const std::vector<int>& shape, const std::vector<std::string>& names,
                                             std::string prefix) {
    auto root = std::make_shared<detail::MeshRoot>();
    root->device_type = current_accelerator_.type();
    root->shape = shape;
    root->names = names;
    for (std::size_t d = shape.size(), rest = static_cast<std::size_t>(rank_); d-- > 0;) {
      root->coordinate.insert(root->coordinate.begin(), static_cast<int>(rest % static_cast<std::size_t>(shape[d])));
      rest /= static_cast<std::size_t>(shape[d]);
    }
    root->world = world_token_;
    if (distributed_) {
      root->backend = backend_;
      root->store = store_;
      root->prefix = std::move(prefix);
      root->timeout = std::chrono::duration_cast<std::chrono::milliseconds>(config_.timeout);
    }
    return root;
  }

  // This rank's group along every dimension of the roots, and the world
  // group first when asked: all made at once (detail::make_groups).
  void make_groups(const std::vector<detail::MeshRoot*>& roots, bool with_world) {
    std::vector<detail::GroupRequest> requests;
    if (with_world) requests.push_back({"world", prefix_ + "world", rank_, world_size_, {}});
    for (const detail::MeshRoot* root : roots)
      for (detail::GroupRequest& asked : root->requests()) requests.push_back(std::move(asked));
    auto made = detail::make_groups(backend_, store_, address_, requests,
                                    std::chrono::duration_cast<std::chrono::milliseconds>(config_.timeout));
    std::size_t i = 0;
    if (with_world) {
      world_ = made[i].group;
      *world_token_ = world_;
      detail::register_group(world_, "world", made[i].store, /*is_world=*/true);
      ++i;
    }
    for (detail::MeshRoot* root : roots)
      for (std::size_t d = 0; d < root->shape.size(); ++d, ++i) root->adopt(requests[i], std::move(made[i]));
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
    return dim ? dim_meshes_[static_cast<std::size_t>(*dim)].get_group() : world_;
  }

  // A group of `members` (world ranks, in the order of their group ranks),
  // on keys of its own in the rendezvous store; a rank outside it gets a
  // group of one. Every rank calls this in the same order (the counter).
  GroupPtr user_group(const std::vector<int>& members, const std::string& name, const std::string& subkey) {
    const std::string key = prefix_ + "user/" + std::to_string(user_group_count_++) + "/" + subkey;
    const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(config_.timeout);
    const auto it = std::find(members.begin(), members.end(), rank_);
    const bool member = it != members.end();
    auto group_store = c10::make_intrusive<c10d::PrefixStore>(
        member ? key + "members" : key + "alone/" + std::to_string(rank_), store_);
    GroupPtr group;
    try {
      group = member ? detail::make_group(backend_, group_store, static_cast<int>(it - members.begin()),
                                          static_cast<int>(members.size()), timeout)
                     : detail::make_group(backend_, group_store, 0, 1, timeout);
    } catch (const std::exception& e) {
      throw DistributedError("accel::" + name + ": creating the group failed on rank " + std::to_string(rank_) + ": " +
                             detail::error_text(e));
    }
    detail::register_group(group, member ? name : name + " (this rank alone: not a member)", group_store);
    user_groups_.push_back(group);
    return group;
  }

  void release() {
    world_token_.reset();  // meshes made here can no longer flatten
    for (const auto& group : user_groups_) detail::unregister_group(group);
    user_groups_.clear();
    store_.reset();
    // A mesh's groups leave the registry with the last copy of the mesh.
    dim_meshes_.clear();
    model_mesh_.reset();
    data_mesh_.reset();
    if (world_) detail::unregister_group(world_);
    world_.reset();
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
      os << ", backend=" << d.backend_ << ", model_mesh=" << *d.model_mesh_ << ", data_mesh=" << *d.data_mesh_;
    return os << ")";
  }

  DistributedConfig config_;
  DistributedStrategy strategy_;
  bool distributed_;
  int rank_, world_size_, local_rank_, local_world_size_;
  c10::Device current_accelerator_;
  c10::Device current_device_;
  std::string backend_ = "gloo";
  GroupPtr world_;
  std::optional<DeviceMesh> model_mesh_, data_mesh_;
  std::vector<DeviceMesh> dim_meshes_;           // indexed by Dim
  c10::intrusive_ptr<c10d::Store> store_;        // the rendezvous store, for groups made later
  std::optional<detail::StoreAddress> address_;  // its address
  std::string prefix_;                           // and this initialisation's keys in it
  int user_group_count_ = 0;
  std::vector<GroupPtr> user_groups_;  // new_group / split_group
  int mesh_count_ = 0;                 // init_device_mesh
  // What the meshes made here see of this interface (MeshRoot::world): set
  // once the world group exists, dropped (never changed) by release().
  std::shared_ptr<GroupPtr> world_token_ = std::make_shared<GroupPtr>();
};

// torch.distributed's new_group and split_group, on the singleton's world.
inline GroupPtr new_group(const std::vector<int>& ranks) { return DistributedInterface::instance().new_group(ranks); }
inline GroupPtr split_group(int color, int key = 0) { return DistributedInterface::instance().split_group(color, key); }
// Python's init_device_mesh, on the singleton's world and device.
inline DeviceMesh init_device_mesh(const std::vector<int>& shape, const std::vector<std::string>& names) {
  return DistributedInterface::instance().init_device_mesh(shape, names);
}

ACCEL_NAMESPACE_END
