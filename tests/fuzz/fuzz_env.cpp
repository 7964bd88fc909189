// libFuzzer: the environment parsing. The input is split at '\n' into
// RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, ACCEL_DEBUG_MODE and
// SLURM_TASKS_PER_NODE (an empty field unsets it).
// Every outcome must be valid values or std::invalid_argument naming a
// variable; nothing else, and never a crash.
#include "accel.hpp"

#include <cctype>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* names[] = {"RANK",          "WORLD_SIZE",      "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "ACCEL_DEBUG_MODE", "SLURM_TASKS_PER_NODE"};
  std::string text(reinterpret_cast<const char*>(data), size);
  text = text.substr(0, text.find('\0'));  // environment values end at NUL
  std::size_t start = 0;
  for (const char* name : names) {
    std::size_t end = std::min(text.find('\n', start), text.size());
    std::string value = start <= text.size() ? text.substr(start, end - start) : "";
    if (value.empty()) unsetenv(name);
    else setenv(name, value.c_str(), 1);
    start = end + 1;
  }
  try {
    const int world = accel::get_world_size();
    const int rank = accel::get_rank();
    const int local_world = accel::get_local_world_size();
    const int local_rank = accel::get_local_rank();
    if (world < 1 || rank < 0 || rank >= world || local_world < 1 || local_world > world || local_rank < 0 ||
        local_rank >= local_world)
      std::abort();  // accepted an inconsistent environment
    if (accel::is_distributed() != (std::getenv("RANK") != nullptr)) std::abort();
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    bool named = false;
    for (const char* name : names) named = named || message.find(name) != std::string::npos;
    if (message.rfind("accel: ", 0) != 0 || !named) std::abort();
  }
  // The debug-mode switch: one of the eight spellings, or an error naming it.
  const char* raw = std::getenv("ACCEL_DEBUG_MODE");
  try {
    const bool on = accel::detail::env_bool("ACCEL_DEBUG_MODE", false);
    std::string lower = raw ? raw : "";
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool known_on = lower == "1" || lower == "true" || lower == "yes" || lower == "on";
    const bool known_off = lower.empty() || lower == "0" || lower == "false" || lower == "no" || lower == "off";
    if (on ? !known_on : !known_off) std::abort();
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find("ACCEL_DEBUG_MODE") == std::string::npos) std::abort();
  }
  // Slurm's task list: a count of at least 1 for this node, or an error
  // naming the variable (SLURM_NODEID unset: every node must agree).
  try {
    if (auto local = accel::detail::slurm_local_size())
      if (*local < 1 || !std::getenv("SLURM_TASKS_PER_NODE")) std::abort();
  } catch (const std::invalid_argument& e) {
    if (std::string(e.what()).find("SLURM_TASKS_PER_NODE") == std::string::npos) std::abort();
  }
  return 0;
}
