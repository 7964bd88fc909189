#!/usr/bin/env bash
# Accelerate itself as the reference (the pip leg's `accelerate`; skipped
# (77) where Python has none: Debian packages no accelerate):
#  1. its own CPU multi-process test scripts (test_script, test_ops,
#     test_sync, 2 processes through its debug_launcher, as its
#     tests/test_cpu.py runs them): the behaviour our ports claim to match
#     passes on this torch;
#  2. prepared loaders compared directly: for the same dataset and options
#     (default, split_batches, even_batches=False, dispatch_batches,
#     drop_last), the batches each process receives and what
#     gather_for_metrics returns, Accelerate's (accelerate_ref.py) against
#     ours (suite python_accelerate), line for line.
#
#     run_accelerate.sh ACCEL_LAUNCH TEST_BINARY
set -euo pipefail
launch=${1:?usage: run_accelerate.sh ACCEL_LAUNCH TEST_BINARY}
binary=${2:?usage: run_accelerate.sh ACCEL_LAUNCH TEST_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import accelerate' 2>/dev/null; then
  echo "SKIP: no Python accelerate here (Debian has no package; the pip leg installs it)"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
# A comparison on the CPU: with a GPU visible, Accelerate puts process i on
# cuda:i (invalid on a one-GPU machine for process 1) and its test_script
# casts to fp16 for the device (its tests/test_cpu.py runs these scripts only
# where no GPU is). So no GPU is shown to either side.
export CUDA_VISIBLE_DEVICES=
# A script whose process group never formed (Gloo's connectFullMesh
# "Connection closed by peer", seen once in CI while another suite ran beside
# it; no accel.hpp code runs in these scripts) is run once more, its first
# output kept in the log; any other failure, or a second one, fails the test.
run_script() {
  (cd "$out" && timeout 300 python3 -c "
from accelerate import debug_launcher
from accelerate.test_utils.scripts import $1
debug_launcher($1.main, num_processes=2)")
}
for script in test_script test_ops test_sync; do
  echo "== Accelerate's $script on 2 CPU processes"
  if ! first=$(run_script "$script" 2>&1); then
    echo "$first"
    grep -q "connectFullMesh failed" <<<"$first" || exit 1
    echo "== Accelerate's $script: its process group did not form (above); once more"
    run_script "$script"
  else
    echo "$first"
  fi
done
echo "== prepared loaders: Accelerate's against accel.hpp's"
"$launch" --timeout 240 2 python3 "$here/accelerate_ref.py" "$out"
ACCEL_ACCELERATE_DIR=$out "$launch" --timeout 240 2 "$binary" --no-skip -ts=python_accelerate --abort-after=1 \
  --no-intro=true
for r in 0 1; do  # (a binary without the suite runs no case and writes nothing)
  [[ -f $out/cpp_rank$r.txt ]] || { echo "accel.hpp's process $r wrote nothing: is the python_accelerate suite built in?"; exit 1; }
done
status=0
for r in 0 1; do
  if diff -u "$out/py_rank$r.txt" "$out/cpp_rank$r.txt"; then
    echo "process $r: $(wc -l <"$out/cpp_rank$r.txt") lines, the same as Accelerate's"
  else
    status=1
  fi
done
exit $status
