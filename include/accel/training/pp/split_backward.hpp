// accel/training/pp/split_backward.hpp: zero bubble's split backward: I (the input's gradient) keeps the gradients reaching the weights' branches, W runs from them to the weights only (torch's stage_backward_input / stage_backward_weight).
//
// I runs the backward from the stage's output to its input only. A node
// that takes a weight and an activation (a Linear's addmm) computes the
// activation's gradient there and not the weight's. Before I runs, this
// finds those nodes (the "intermediates": where each weight's branch meets
// the path from the output to the input, as torch's get_param_groups does)
// and hooks them, keeping the gradients that flow into them during I. W
// then starts autograd's engine at the intermediates with the kept
// gradients and runs it to the weights only, one call per group of weights
// sharing intermediates. The weights' gradients accumulate into .grad
// through their AccumulateGrad nodes, so a DataParallel's hooks on them fire
// as in a whole backward. The activations' gradients are computed once, in
// I; running the graph again from the output for W computed them twice
// (about half as much work again in every backward).
//
// Where this does not apply, W runs the graph again from the output (what
// usable() says): a weight whose branch never meets the path to the input,
// or a stage with no input gradient (the first).
#pragma once

#include "accel/training/torch_nn.hpp"

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <vector>

ACCEL_NAMESPACE_BEGIN

namespace detail::pp {
// How many W this thread ran from what I kept (tests count them).
inline uint64_t& split_weight_passes() {
  static thread_local uint64_t count = 0;
  return count;
}

class SplitBackward {
 public:
  // Before I: the graph from `root` (the stage's output or loss), the stage's
  // input (a leaf that requires grad) and its weights.
  SplitBackward(const at::Tensor& root, const at::Tensor& input, const std::vector<at::Tensor>& weights) {
    namespace impl = torch::autograd::impl;
    if (!root.grad_fn() || !input.requires_grad()) return;
    build_reverse_graph(root.grad_fn());
    const Node* input_node = impl::gradient_edge(input).function.get();
    if (!consumers_.count(input_node)) return;  // (the output does not depend on the input)
    const std::set<const Node*> on_input_path = closure({input_node}, {}).first;
    // Each weight's branch and the intermediates it meets; weights that share one are one group.
    std::vector<std::pair<torch::autograd::Edge, std::set<const Node*>>> branches;
    for (const at::Tensor& weight : weights) {
      if (!weight.requires_grad()) continue;
      torch::autograd::Edge edge = impl::gradient_edge(weight);
      if (!edge.function || !consumers_.count(edge.function.get())) continue;  // (not used in this forward)
      std::set<const Node*> meets = closure({edge.function.get()}, on_input_path).second;
      if (meets.empty()) return;  // (a branch that never meets the input's path: W runs whole)
      branches.emplace_back(std::move(edge), std::move(meets));
    }
    std::vector<std::size_t> parent(branches.size());
    for (std::size_t i = 0; i < parent.size(); ++i) parent[i] = i;
    const auto root_of = [&](std::size_t i) {
      while (parent[i] != i) i = parent[i] = parent[parent[i]];
      return i;
    };
    std::map<const Node*, std::size_t> first_branch;  // an intermediate -> the first branch meeting it
    for (std::size_t i = 0; i < branches.size(); ++i)
      for (const Node* node : branches[i].second)
        if (const auto [at, fresh] = first_branch.emplace(node, i); !fresh) parent[root_of(i)] = root_of(at->second);
    std::map<std::size_t, std::size_t> group_of;  // a set's root branch -> its group
    const auto group = [&](std::size_t branch) -> Group& {
      const auto [at, fresh] = group_of.emplace(root_of(branch), groups_.size());
      if (fresh) groups_.emplace_back();
      return groups_[at->second];
    };
    for (std::size_t i = 0; i < branches.size(); ++i) group(i).weights.push_back(std::move(branches[i].first));
    for (const auto& [node, branch] : first_branch) group(branch).intermediates.push_back({owner_.at(node), {}});
    for (Group& g : groups_)
      for (Intermediate& at : g.intermediates) at.node->add_pre_hook(std::make_unique<Keep>(&at.grads));
    hooked_ = true;
    usable_ = true;
  }
  SplitBackward(const SplitBackward&) = delete;
  SplitBackward& operator=(const SplitBackward&) = delete;
  ~SplitBackward() { remove_hooks(); }

  // Whether W can run from the intermediates (else it runs the graph again from the output).
  bool usable() const { return usable_; }
  // After I: its hooks go (the gradients are kept).
  void input_done() { remove_hooks(); }
  // W: each group's weights' gradients from what its intermediates received in I, accumulated into .grad.
  void weights() {
    remove_hooks();
    ++split_weight_passes();
    for (Group& group : groups_) {
      if (group.weights.empty()) continue;
      torch::autograd::edge_list roots;
      torch::autograd::variable_list grads;
      for (Intermediate& at : group.intermediates)
        for (std::size_t i = 0; i < at.grads.size(); ++i)
          if (at.grads[i].defined()) {
            roots.emplace_back(at.node, static_cast<uint32_t>(i));
            grads.push_back(at.grads[i]);
          }
      if (roots.empty()) continue;
      // An intermediate below another of the group would receive its kept gradient again through it: each takes
      // what it received in I, as torch's stage_backward_weight clamps them.
      if (group.intermediates.size() > 1)
        for (Intermediate& at : group.intermediates) at.node->add_pre_hook(std::make_unique<Replace>(at.grads));
      torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                            /*create_graph=*/false, /*accumulate_grad=*/true,
                                                            group.weights);
      if (group.intermediates.size() > 1)
        for (Intermediate& at : group.intermediates) at.node->pre_hooks().pop_back();
    }
    groups_.clear();
  }

 private:
  using Node = torch::autograd::Node;
  using NodePtr = decltype(torch::autograd::Edge::function);  // (std::shared_ptr, or c10::intrusive_ptr since 2.x)
  struct Intermediate {
    NodePtr node;
    torch::autograd::variable_list grads;  // what flowed into it in I
  };
  struct Group {
    std::vector<torch::autograd::Edge> weights;
    std::deque<Intermediate> intermediates;  // (a deque: the hooks hold pointers into it)
  };
  // A pre-hook keeping a node's incoming gradients, and one replacing them.
  struct Keep : torch::autograd::FunctionPreHook {
    explicit Keep(torch::autograd::variable_list* to) : to_(to) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
      *to_ = grads;
      return grads;
    }
    torch::autograd::variable_list* to_;
  };
  struct Replace : torch::autograd::FunctionPreHook {
    explicit Replace(torch::autograd::variable_list with) : with_(std::move(with)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list&) override { return with_; }
    torch::autograd::variable_list with_;
  };

  // Every node from the root down, with the nodes that consume each.
  void build_reverse_graph(const NodePtr& root) {
    std::vector<Node*> todo{root.get()};
    owner_.emplace(root.get(), root);
    consumers_[root.get()];
    while (!todo.empty()) {
      Node* node = todo.back();
      todo.pop_back();
      for (const torch::autograd::Edge& edge : node->next_edges()) {
        if (!edge.function) continue;
        const Node* next = edge.function.get();
        if (owner_.emplace(next, edge.function).second) todo.push_back(edge.function.get());
        consumers_[next].push_back(node);
      }
    }
  }
  // The nodes from `from` up through their consumers, stopping at (and returning) those in `stop`.
  std::pair<std::set<const Node*>, std::set<const Node*>> closure(const std::vector<const Node*>& from,
                                                                  const std::set<const Node*>& stop) const {
    std::set<const Node*> seen(from.begin(), from.end()), met;
    std::vector<const Node*> todo(from.begin(), from.end());
    while (!todo.empty()) {
      const Node* node = todo.back();
      todo.pop_back();
      const auto found = consumers_.find(node);
      if (found == consumers_.end()) continue;
      for (const Node* up : found->second) {
        if (seen.count(up)) continue;
        if (stop.count(up)) {
          met.insert(up);
          continue;
        }
        seen.insert(up);
        todo.push_back(up);
      }
    }
    return {seen, met};
  }
  void remove_hooks() {
    if (!hooked_) return;
    hooked_ = false;
    for (Group& group : groups_)
      for (Intermediate& at : group.intermediates) {
        auto& hooks = at.node->pre_hooks();
        for (auto it = hooks.begin(); it != hooks.end(); ++it)
          if (auto* keep = dynamic_cast<Keep*>(it->get()); keep && keep->to_ == &at.grads) {
            hooks.erase(it);
            break;
          }
      }
  }

  std::map<const Node*, NodePtr> owner_;                 // every node of the graph, held
  std::map<const Node*, std::vector<Node*>> consumers_;  // a node -> the nodes whose backward feeds it
  std::vector<Group> groups_;
  bool usable_ = false;
  bool hooked_ = false;
};
}  // namespace detail::pp

ACCEL_NAMESPACE_END
