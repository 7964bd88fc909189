// accel/distributed/mesh.hpp: DeviceMesh: named dimensions, slice, flatten.
//
// init_device_mesh's layout, any number of named dimensions, seen from one
// rank. A mesh's dimension is one root dimension or several flattened into
// one (Accelerate's dp_shard_cp); slicing and flattening share the root's
// groups, and a rank creates only the groups it belongs to.
#pragma once

#include "accel/distributed/registration.hpp"
#include "accel/distributed/debug_check.hpp"
#include "accel/distributed/make_groups.hpp"

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
