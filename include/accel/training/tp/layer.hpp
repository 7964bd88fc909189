// accel/training/tp/layer.hpp: what every tensor-parallel layer shares: its group, its piece of a whole tensor, its partial gradients.
#pragma once

#include "accel/distributed/operations.hpp"
#include "accel/training/tp/regions.hpp"

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
