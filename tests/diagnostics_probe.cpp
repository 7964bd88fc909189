// Compiled twice for the CTest entry diagnostics_out_of_line: a user's file
// that calls one collective must not compile the failure text with the roll
// call's thread and store protocol, debug mode's check nor the parse of
// ACCEL_DEBUG_MODE (registration.hpp says why); a file that makes groups
// compiles them (the control: the symbols are looked for where they must be).
#include "accel.hpp"

int main() {
#ifdef ACCEL_PROBE_MAKES_GROUPS
  accel::DistributedInterface::instance();
#endif
  return accel::all_reduce(1) - 1;
}
