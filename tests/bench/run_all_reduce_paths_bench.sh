#!/usr/bin/env bash
# Where the data-parallel engine's small buckets cross over from Gloo's
# allreduce to the all-reduce point to point (distributed/direct_all_reduce.hpp;
# dp/reducer.hpp's all_reduces_directly takes its sizes from here): both
# paths on the same float32 tensors, 4 KiB to 16 MiB per rank, one at a time
# and four in flight, at 2 and 4 ranks, interleaved (`accel_bench
# all_reduce_paths`). Writes all_reduce_paths.csv and all_reduce_paths.md to
# ACCEL_BENCH_OUT (default tests/bench/results; the pip leg's with
# ACCEL_BENCH_LEG=pip). About 2 minutes per run. Never part of the test command.
#
#     bash tests/bench/run_all_reduce_paths_bench.sh [runs (2)]
set -euo pipefail
runs=${1:-2}
source "$(dirname "$0")/common.sh"
bench_prepare all_reduce_paths.csv python3-torch accel_bench
for ((trial = 1; trial <= runs; ++trial)); do
  for world in 2 4; do
    run $world "$build/tests/accel_bench" all_reduce_paths
  done
done
"$python" - "$csv" "$out/all_reduce_paths.md" <<'PY'
import collections, csv, statistics, sys
import torch
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(int(r["world"]), int(r["size"]), r["variant"])].append(float(r["value"]))
med = {k: statistics.median(v) for k, v in rows.items()}
lines = [f"The all-reduce of float32 tensors by Gloo's allreduce (a ring) and point to point (a reduce-scatter and an "
         f"all-gather), LibTorch/torch {torch.__version__}, one thread per rank; µs per call, medians over interleaved "
         "trials and runs. Ratio: Gloo's time / point to point's (above 1: point to point is faster).", "",
         "| ranks | bytes per rank | Gloo | point to point | ratio | four in flight: Gloo | point to point | ratio |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|"]
for world, size in sorted({(w, s) for w, s, _ in med}):
    cells = []
    for suffix in ("", "_x4"):
        g, p = med[(world, size, "gloo_allreduce" + suffix)], med[(world, size, "point_to_point" + suffix)]
        cells += [f"{g:.0f}", f"{p:.0f}", f"{g / p:.2f}"]
    lines.append(f"| {world} | {size} | " + " | ".join(cells) + " |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
