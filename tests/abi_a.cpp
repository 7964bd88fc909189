// One half of the abi_namespace test: this translation unit configures the
// header differently from abi_b.cpp. Without the configuration in the inline
// namespace, the linker would keep one body of accel::default_timeout() for
// both (an ODR violation nothing reports) and one of them would read the
// other's default. Built without inlining, so that the linker decides.
#define ACCEL_DEFAULT_TIMEOUT_SECONDS 100
#define ACCEL_CORE_ONLY
#include "accel.hpp"

long timeout_in_a() { return static_cast<long>(accel::default_timeout().count()); }
