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
#pragma once

#include "accel/distributed/process_control.hpp"
#include "accel/training/accelerator_config.hpp"
#include "accel/training/io/json.hpp"

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
