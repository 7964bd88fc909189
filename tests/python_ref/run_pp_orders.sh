#!/usr/bin/env bash
# accel.hpp's pipeline schedule orders (core/pipeline_orders.hpp) against
# torch.distributed.pipelining's for 416 cases (GPipe, 1F1B, Looped BFS,
# Interleaved 1F1B, Interleaved zero bubble, ZBV, DualPipeV; 1-4 ranks, 1-3 stages per
# rank, 1-16 micro-batches): torch dumps its orders
# (tests/python_ref/pp_orders.py), the test binary (suite python_pp) writes
# ours beside them and reads torch's back byte for byte, and pp_orders.py
# compares. One process, no process group. Skipped (77) where
# Python's torch is older than 2.15 (the orders were checked on 2.15; older
# schedules.py made others).
#
#     run_pp_orders.sh TEST_BINARY
set -euo pipefail
binary=${1:?usage: run_pp_orders.sh TEST_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import sys, torch; import torch.distributed.pipelining.schedules; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 15))' 2>/dev/null; then
  echo "SKIP: Python's torch here is not 2.15 or later with torch.distributed.pipelining (this leg's is $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo absent))"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 "$here/pp_orders.py" dump "$out"
ACCEL_PP_DIR=$out "$binary" --no-skip -ts=python_pp --abort-after=1 --no-intro=true
python3 "$here/pp_orders.py" compare "$out"
