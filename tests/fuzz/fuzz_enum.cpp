// libFuzzer: from_string for the three enums. Success must round-trip
// through to_string; failure must be std::invalid_argument, never a crash.
#include "accel.hpp"

#include <cstdlib>
#include <string_view>

template <class E>
void check(std::string_view text) {
  try {
    E value = accel::from_string<E>(text);
    if (accel::to_string(value) != text) std::abort();
  } catch (const std::invalid_argument& e) {
    if (std::string_view(e.what()).rfind("accel::from_string<", 0) != 0) std::abort();
  }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  check<accel::Dim>(text);
  check<accel::ReduceOp>(text);
  check<accel::DeviceType>(text);
  return 0;
}
