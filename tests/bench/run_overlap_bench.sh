#!/usr/bin/env bash
# What overlapping communication with computation buys on this machine: an
# all_reduce and an independent 384x384 matrix multiply, run one after the
# other (blocking) or with the all_reduce in flight during the multiply
# (accel::all_reduce_async, and raw c10d's async Work as the reference), at 2
# ranks, interleaved in one process. Writes overlap.csv and overlap.md to
# ACCEL_BENCH_OUT (default tests/bench/results). Never part of the tests.
#
#     bash tests/bench/run_overlap_bench.sh [runs (3)]
set -euo pipefail
runs=${1:-3}
source "$(dirname "$0")/common.sh"
bench_prepare overlap.csv "" accel_bench
for ((i = 1; i <= runs; ++i)); do
  run 2 "$build/tests/accel_bench" overlap
done
python3 - "$csv" "$out/overlap.md" <<'PY'
import collections, csv, statistics, sys
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(int(r["world"]), int(r["size"]), r["variant"])].append(float(r["value"]))
med = {k: statistics.median(v) for k, v in rows.items()}
lines = ["all_reduce of a float32 tensor overlapped with a 384x384 matmul (one intra-op thread per rank), Gloo; "
         "µs per step, medians over interleaved trials and runs. overlap gain: blocking / accel async; "
         "vs raw: raw c10d async / accel async (1.00: no cost of its own).", "",
         "| ranks | bytes | all_reduce alone | matmul alone | blocking (one then the other) | accel async | raw c10d async | overlap gain | vs raw |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for world, size in sorted({(w, s) for w, s, _ in med}):
    g = lambda v: med[(world, size, v)]
    a = g("accel_async_overlapped")
    lines.append(f"| {world} | {size} | {g('all_reduce_only'):.0f} | {g('matmul_only'):.0f} | {g('blocking_then_matmul'):.0f} | "
                 f"{a:.0f} | {g('raw_c10d_async_overlapped'):.0f} | {g('blocking_then_matmul') / a:.2f} | "
                 f"{g('raw_c10d_async_overlapped') / a:.2f} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
