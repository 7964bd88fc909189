#!/usr/bin/env bash
# accel.hpp's data-parallel and sharded training against Python's DDP and
# FSDP2 (fully_shard on a CPU init_device_mesh, Gloo) on the same start, the
# same batches and Adam: tests/python_ref/fsdp2_ref.py makes the data, trains
# Python on WORLD ranks, then the test binary trains (suite python_fsdp2) and
# fsdp2_ref.py compares both with one process on the global batch. Skipped
# (77) where Python's torch has no CPU FSDP2 (before 2.7: bookworm's 1.13,
# trixie's 2.6).
#
#     run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY MODE WORLD
#     MODE: no_shard | shard_grad_op | full_shard | hybrid_shard | full_shard_bf16
set -euo pipefail
launch=${1:?usage: run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY MODE WORLD}
binary=${2:?usage: run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY MODE WORLD}
mode=${3:?usage: run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY MODE WORLD}
world=${4:?usage: run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY MODE WORLD}
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import sys, torch; from torch.distributed.fsdp import fully_shard; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 7))' 2>/dev/null; then
  echo "SKIP: Python's torch here has no FSDP2 on the CPU (fully_shard with Gloo: torch 2.7 on; this leg's is $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo absent))"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
# (A Python process that crashes prints where: faulthandler.)
export OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
python3 "$here/fsdp2_ref.py" data "$out"
echo "== Python ($mode) on $world processes"
"$launch" --timeout 240 "$world" python3 "$here/fsdp2_ref.py" train "$out" "$mode"
# FSDP2's own average, without the force-sum work-around: printed only, so
# only on request (ACCEL_FSDP2_SHOW_AVG=1; pytorch#162338: on Gloo it sums).
if [[ $mode != no_shard && ${ACCEL_FSDP2_SHOW_AVG:-0} == 1 ]]; then
  echo "== Python ($mode, FSDP2's own AVG) on $world processes"
  "$launch" --timeout 240 "$world" python3 "$here/fsdp2_ref.py" train "$out" "$mode" avg
fi
echo "== accel.hpp ($mode) on $world processes"
ACCEL_FSDP2_DIR=$out ACCEL_FSDP2_MODE=$mode "$launch" --timeout 240 "$world" "$binary" --no-skip -ts=python_fsdp2 \
  --abort-after=1 --no-intro=true
python3 "$here/fsdp2_ref.py" compare "$out" "$mode" "$world"
