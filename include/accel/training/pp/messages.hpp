// accel/training/pp/messages.hpp: the activations and gradients a pipeline step sends between ranks, the receives posted in the order the senders send, and each stage's input shape told once per step.
//
// A stage's activation goes to the next stage's rank, and its input's
// gradient back to the stage before's, point to point on the pipeline
// group (torch's PipelineStage does the same with isend/irecv). A receive
// needs a buffer of the right shape before the message arrives; torch infers
// the shapes once, on its first step, by running the stages. Here the sender
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
#pragma once

#include "accel/distributed/backends.hpp"
#include "accel/distributed/exchange.hpp"
#include "accel/training/torch_nn.hpp"

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
