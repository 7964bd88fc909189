// accel/distributed/world.hpp: World: the ranks of one initialisation, their rendezvous store and the groups made on it.
//
// DistributedInterface owns one World. Distributed, it meets the other ranks
// (rendezvous), makes the world group and the meshes' groups, and later the
// groups of new_group, split_group and init_device_mesh, each on keys of its
// own in the store. Not distributed, it is one rank with no store, and
// every group it gives is null (collectives are then the identity).
#pragma once

#include "accel/distributed/exchange.hpp"
#include "accel/distributed/mesh.hpp"
#include "accel/distributed/registration.hpp"

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
