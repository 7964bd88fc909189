#!/usr/bin/env bash
# Runs every accel.hpp benchmark side by side with its reference and writes
# tests/bench/results/{results.csv,results.md,bench.png}. Slow and noisy by
# nature: never part of the test command (CI only builds the benchmark).
set -euo pipefail
source "$(dirname "$0")/common.sh"
bench_prepare results.csv "python3-torch gnuplot-nox time" accel_bench
bench=$build/tests/accel_bench
py=("$python" "$root/tests/bench/bench_torch.py")

run 2 "$bench" overhead
run 2 "${py[@]}" latency
run 2 "$bench" alloc
for world in 2 4; do run $world "$bench" bandwidth; done
run 2 "$bench" batching
run 2 "${py[@]}" batching
for world in 2 4 8 16; do
  for trial in 1 2 3; do   # interleaved: accel, Python, accel, Python, ...
    run $world env -u ACCEL_STORE_DIR "$bench" mesh  # a TCPStore, as Python's
    run $world "${py[@]}" mesh
  done
done

# Instructions per call at world size 1, counted only inside the loop (the
# same script is the callgrind_overhead test).
ACCEL_CALLGRIND_LIMIT=1e9 bash "$root/tests/callgrind_overhead.sh" "$bench" "${CXX:-c++}" | sed -n 's/^CSV,//p' | tee -a "$csv" >&2

# Compile cost has its own script: tests/bench/run_compile_bench.sh.

"$python" "$root/tests/bench/summarize.py" "$csv" "$out"
