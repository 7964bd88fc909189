#!/usr/bin/env bash
# accel::tp's Megatron layers against Python's DTensor tensor parallelism
# (parallelize_module with torchtitan's styles on a CPU mesh, Gloo,
# loss_parallel) on the same start, the same batches and AdamW:
# tests/python_ref/tp_ref.py makes the data, trains Python on WORLD ranks in
# every MODE, then the test binary trains in every MODE (suite python_tp) and
# tp_ref.py compares each with one process training the whole model, and the
# collectives one step issues (accel.hpp's at most Python's); with
# plan_fsdp_tp_sp, Python's DCP then loads accel.hpp's checkpoint of that run
# into its own FSDP2 + TP DTensors (tp_ref.py dcp). Skipped (77)
# where Python's torch is older than 2.7 (bookworm's 1.13 has no DTensor;
# trixie's 2.6 was not checked).
#
#     run_tp.sh ACCEL_LAUNCH TEST_BINARY WORLD MODE...
#     MODE: tp | tp_sp | plan_tp | plan_tp_sp | plan_fsdp_tp_sp  (tp_ref.py says what each is)
set -euo pipefail
usage="usage: run_tp.sh ACCEL_LAUNCH TEST_BINARY WORLD MODE..."
launch=${1:?$usage}
binary=${2:?$usage}
world=${3:?$usage}
shift 3
(($#)) || { echo "$usage"; exit 2; }
modes=("$@")
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import sys, torch; from torch.distributed.tensor.parallel import loss_parallel; from torch.distributed.tensor.debug import CommDebugMode; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 7))' 2>/dev/null; then
  echo "SKIP: Python's torch here is not 2.7 or later with DTensor's tensor parallelism (this leg's is $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo absent))"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
python3 "$here/tp_ref.py" data "$out"
"$launch" --timeout 240 "$world" python3 "$here/tp_ref.py" train "$out" "${modes[@]}"
echo "== accel.hpp (${modes[*]}) on $world processes"
ACCEL_TP_DIR=$out ACCEL_TP_MODES="${modes[*]}" "$launch" --timeout 240 "$world" "$binary" --no-skip \
  -ts=python_tp --abort-after=1 --no-intro=true
python3 "$here/tp_ref.py" compare "$out" "$world" "${modes[@]}"
if [[ " ${modes[*]} " == *" plan_fsdp_tp_sp "* ]]; then
  "$launch" --timeout 240 "$world" python3 "$here/tp_ref.py" dcp "$out" plan_fsdp_tp_sp
fi
