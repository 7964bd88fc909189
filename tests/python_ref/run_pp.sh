#!/usr/bin/env bash
# accel::pp's schedules against Python's torch.distributed.pipelining (its
# PipelineStage and the same schedule, Gloo, on the CPU) on the same model
# cut into the same stages, the same start, the same batches and AdamW:
# tests/python_ref/pp_ref.py makes the data and trains Python with every
# SCHEDULE on WORLD ranks (DP > 1: pp WORLD/DP x dp_shard DP, each stage
# fully sharded, FSDP2 against accel::DataParallel), the test binary trains the same (suite
# python_pp_train), and pp_ref.py compares each with the other and with one
# process training the whole model: every micro-batch's loss and every
# trained parameter (float64, within 1e-10). Skipped (77) where Python's
# torch is older than 2.15 (the schedules were checked on 2.15).
#
#     run_pp.sh ACCEL_LAUNCH TEST_BINARY WORLD DP SCHEDULE...
#     SCHEDULE: gpipe | 1f1b | looped_bfs | interleaved_1f1b | interleaved_zero_bubble | zbv | dualpipev
set -euo pipefail
usage="usage: run_pp.sh ACCEL_LAUNCH TEST_BINARY WORLD DP SCHEDULE..."
launch=${1:?$usage}
binary=${2:?$usage}
world=${3:?$usage}
dp=${4:?$usage}
shift 4
(($#)) || { echo "$usage"; exit 2; }
schedules=("$@")
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import sys, torch; import torch.distributed.pipelining.schedules; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 15))' 2>/dev/null; then
  echo "SKIP: Python's torch here is not 2.15 or later with torch.distributed.pipelining (this leg's is $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo absent))"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
python3 "$here/pp_ref.py" data "$out"
if ((world == 2 && dp == 1)); then python3 "$here/pp_ref.py" accumulate "$out"; fi  # (once: it is one process's)
"$launch" --timeout 240 "$world" python3 "$here/pp_ref.py" train "$out" "$dp" "${schedules[@]}"
echo "== accel.hpp (${schedules[*]}) on $world processes, dp $dp"
ACCEL_PP_DIR=$out ACCEL_PP_SCHEDULES="${schedules[*]}" ACCEL_PP_DP=$dp "$launch" --timeout 240 "$world" "$binary" --no-skip \
  -ts=python_pp_train --abort-after=1 --no-intro=true
python3 "$here/pp_ref.py" compare "$out" "$((world / dp))" "$dp" "${schedules[@]}"
