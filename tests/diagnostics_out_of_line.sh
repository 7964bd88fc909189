#!/usr/bin/env bash
# diagnostics_out_of_line: the object of a file that calls one collective has
# none of the diagnostics reached through the group registry's pointers (the
# failure text with its roll call, debug mode's check, the parse of
# ACCEL_DEBUG_MODE); the object of a file that also makes the world group has
# them all. Given CMake and its build directory, builds the two objects
# first (diagnostics_probe_call and _groups, outside the default build).
#
#     diagnostics_out_of_line.sh ONE_CALL_OBJECT GROUPS_OBJECT [CMAKE BUILD_DIR]
set -euo pipefail
one_call=$1
makes_groups=$2
if (($# >= 4)); then
  "$3" --build "$4" --target diagnostics_probe_call diagnostics_probe_groups --parallel 2 >/dev/null
fi
count() { nm -C "$1" | grep -cE "detail::$2(\[abi:cxx11\])?\(" || true; }
for name in explain_failure roll_call_in_store verify_same_call env_bool; do
  in_call=$(count "$one_call" "$name")
  in_groups=$(count "$makes_groups" "$name")
  echo "$name: $in_call symbols in the one-call file, $in_groups in the group-making file"
  [[ $in_call -eq 0 && $in_groups -gt 0 ]]
done
