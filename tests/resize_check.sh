#!/usr/bin/env bash
# A checkpoint of a whole model (NO_SHARD) saved by 2 processes and loaded by
# 1, 3 and 4 with the same global batch, and by 3 with another: the suite
# checkpoint_resize of the test program, whose saving run records what each
# loading run must match (parameters, RNG draws, the samples after the saved
# place, the step after it).
#     bash tests/resize_check.sh ACCEL_LAUNCH ACCEL_TESTS
set -euo pipefail
launch=${1:?usage: resize_check.sh ACCEL_LAUNCH ACCEL_TESTS} tests=${2:?usage: resize_check.sh ACCEL_LAUNCH ACCEL_TESTS}
ACCEL_RESIZE_DIR=$(mktemp -d)
export ACCEL_RESIZE_DIR
trap 'rm -rf "$ACCEL_RESIZE_DIR"' EXIT
suite=(--no-skip -ts=checkpoint_resize --no-intro=true)
echo "== saved by 2 processes"
"$launch" --timeout 120 2 "$tests" "${suite[@]}" -tc='save*'
# Runs the loading case on $1 processes; its output in full where it fails.
load() {
  local out
  if ! out=$("$launch" --timeout 120 "$1" "$tests" "${suite[@]}" -tc='load*' -s 2>&1); then
    echo "$out"
    exit 1
  fi
  grep -E "processes after|test cases" <<<"$out"
}
for world in 1 3 4; do
  echo "== loaded by $world"
  load "$world"
done
echo "== loaded by 3 with 6 samples per process (a global batch of 18, not 12)"
ACCEL_RESIZE_BATCH=6 load 3
