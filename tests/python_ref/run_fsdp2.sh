#!/usr/bin/env bash
# accel.hpp's data-parallel and sharded training against Python's DDP and
# FSDP2 (fully_shard on a CPU init_device_mesh, Gloo) on the same start, the
# same batches and Adam: tests/python_ref/fsdp2_ref.py makes the data, trains
# Python on WORLD ranks in every MODE, then the test binary trains in every
# MODE (suite python_fsdp2) and fsdp2_ref.py compares each with one process
# on the global batch. Each side runs all the modes in one launch: starting
# a Python process with torch costs more than training this model (a mode
# per launch took 21-32 s, most of it the imports). Skipped (77) where
# Python's torch has no CPU FSDP2 (before 2.7: bookworm's 1.13, trixie's 2.6).
#
#     run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY WORLD MODE...
#     MODE: no_shard | shard_grad_op | full_shard | hybrid_shard | full_shard_bf16 | gpt_full_shard_bf16 |
#           gpt_tied_full_shard_bf16 | gpt_tied_full_shard  (fsdp2_ref.py says what each is)
set -euo pipefail
usage="usage: run_fsdp2.sh ACCEL_LAUNCH TEST_BINARY WORLD MODE..."
launch=${1:?$usage}
binary=${2:?$usage}
world=${3:?$usage}
shift 3
(($#)) || { echo "$usage"; exit 2; }
modes=("$@")
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
"$launch" --timeout 240 "$world" python3 "$here/fsdp2_ref.py" train "$out" "${modes[@]}"
# FSDP2's own average, without the force-sum work-around: printed only, so
# only on request (ACCEL_FSDP2_SHOW_AVG=1; pytorch#162338: on Gloo it sums).
if [[ ${ACCEL_FSDP2_SHOW_AVG:-0} == 1 ]]; then
  sharded=()
  for mode in "${modes[@]}"; do [[ $mode == no_shard ]] || sharded+=("$mode"); done
  ((${#sharded[@]} == 0)) || "$launch" --timeout 240 "$world" python3 "$here/fsdp2_ref.py" train "$out" --avg "${sharded[@]}"
fi
echo "== accel.hpp (${modes[*]}) on $world processes"
ACCEL_FSDP2_DIR=$out ACCEL_FSDP2_MODES="${modes[*]}" "$launch" --timeout 240 "$world" "$binary" --no-skip \
  -ts=python_fsdp2 --abort-after=1 --no-intro=true
python3 "$here/fsdp2_ref.py" compare "$out" "$world" "${modes[@]}"
