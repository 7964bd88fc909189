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
#pragma once

#include "accel/core/errors.hpp"

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
// REDUCE_GRAD, WAIT_REDUCE_GRAD). OVERLAP_F_B (DualPipeV's) is compound: a
// forward and a backward of two stages, its sub_actions, which torch's
// runtime runs one after the other unless told how to overlap them; its
// stage is -1 (torch's placeholder). Compound actions live in compute-only
// orders only: the rules and the lowering see their sub-actions
// (expand_overlaps).
struct Action {
  int stage_index = 0;
  ComputationType computation_type = ComputationType::FORWARD;
  std::optional<int> microbatch_index{};
  std::vector<Action> sub_actions{};
  friend bool operator==(const Action&, const Action&) = default;
};
inline std::string to_string(const Action& a) {
  if (!a.sub_actions.empty()) {  // (torch's text: "(0F3;3B1)OVERLAP_F_B")
    std::string text = "(";
    for (std::size_t i = 0; i < a.sub_actions.size(); ++i) text += (i ? ";" : "") + to_string(a.sub_actions[i]);
    return text + ")" + std::string(to_string(a.computation_type));
  }
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
// schedule. OVERLAP_F_B's compound form, "(0F1;1B0)OVERLAP_F_B"
// (DualPipeV's), holds simple actions separated by ';'.
inline std::optional<Action> parse_action(std::string_view text) {
  auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; };
  while (!text.empty() && blank(text.front())) text.remove_prefix(1);
  while (!text.empty() && blank(text.back())) text.remove_suffix(1);
  if (text.empty()) return std::nullopt;
  auto refuse = [&](const std::string& why) -> std::optional<Action> {
    throw InvalidArgument("accel::pp: the action \"" + std::string(text) + "\" " + why +
                          " (an action is [stage][type][micro-batch], as torch writes them: 2F0, 1UNSHARD, 3SEND_F1)");
  };
  if (text.front() == '(') {
    constexpr std::string_view overlap = ")OVERLAP_F_B";
    const std::size_t close = text.find(')');
    if (close == std::string_view::npos || text.substr(close) != overlap)
      return refuse("opens a compound action that is not \"(...)OVERLAP_F_B\", the one compound torch writes");
    Action compound{-1, ComputationType::OVERLAP_F_B};
    for (std::string_view inside = text.substr(1, close - 1);;) {
      const std::size_t semicolon = inside.find(';');
      const std::optional<Action> sub = parse_action(inside.substr(0, semicolon));
      if (!sub) return refuse("has an empty sub-action");  // (a nested "(" has no ")" here: refused above)
      compound.sub_actions.push_back(*sub);
      if (semicolon == std::string_view::npos) break;
      inside.remove_prefix(semicolon + 1);
    }
    return compound;
  }
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
        "WAIT_SEND_F, WAIT_SEND_B, REDUCE_GRAD, WAIT_REDUCE_GRAD; and \"(0F1;1B0)OVERLAP_F_B\")");
  if (type->first == ComputationType::OVERLAP_F_B)
    return refuse("is OVERLAP_F_B without its sub-actions (written \"(0F1;1B0)OVERLAP_F_B\")");
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

// The order with each compound action (OVERLAP_F_B) replaced by its
// sub-actions, one slot each, in their order: what the rules check and the
// runtime runs (torch's runtime, with no overlap function registered, runs
// them so too).
inline PipelineOrder expand_overlaps(const PipelineOrder& order) {
  PipelineOrder out;
  for (const auto& row : order) {
    auto& expanded = out.emplace_back();
    for (const auto& a : row)
      if (a && !a->sub_actions.empty()) expanded.insert(expanded.end(), a->sub_actions.begin(), a->sub_actions.end());
      else expanded.push_back(a);
  }
  return out;
}

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
