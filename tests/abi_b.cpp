// The other half of the abi_namespace test (see abi_a.cpp): the default
// configuration here, 100 s there; each must keep its own.
#define ACCEL_CORE_ONLY
#include "accel.hpp"

#include <cstdio>
#include <cstdlib>

long timeout_in_a();

int main() {
  unsetenv("ACCEL_TIMEOUT");
  const long a = timeout_in_a(), b = static_cast<long>(accel::default_timeout().count());
  std::printf("default timeout: %ld s in abi_a.cpp, %ld s in abi_b.cpp\n", a, b);
  return a == 100 && b == ACCEL_DEFAULT_TIMEOUT_SECONDS ? 0 : 1;
}
