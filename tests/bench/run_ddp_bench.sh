#!/usr/bin/env bash
# Data-parallel training, side by side in one run: the same MLP (256-1024-
# 1024-1024-1, 2.4 M parameters, batch 64 per rank, SGD with momentum) trained
# with accel::Accelerator and with Python's DistributedDataParallel (Debian's
# python3-torch: 1.13 on bookworm, 2.6 in the trixie root; Gloo), interleaved,
# at 2 and 4 ranks, one intra-op thread per rank on both sides. Writes ddp.csv
# and ddp.md (step time, samples/s, ratio) to ACCEL_BENCH_OUT (default
# tests/bench/results). Never part of the test command.
#
#     bash tests/bench/run_ddp_bench.sh [rounds (3)] [steps per trial (30)]
#     # on LibTorch 2.6:
#     bash tests/trixie/in_root.sh build/trixie-root env ACCEL_BUILD_DIR=build/trixie-gcc \
#       ACCEL_BENCH_OUT=tests/bench/results/libtorch-2.6 bash tests/bench/run_ddp_bench.sh 3 20
set -euo pipefail
rounds=${1:-3}
steps=${2:-30}
source "$(dirname "$0")/common.sh"
bench_prepare ddp.csv python3-torch accel_bench_ddp
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for world in 2 4; do
  for ((round = 1; round <= rounds; ++round)); do  # interleaved: accel, Python, accel, Python, ...
    run $world "$build/tests/accel_bench_ddp" 3 "$steps"
    run $world /usr/bin/python3 "$root/tests/bench/bench_ddp.py" 3 "$steps"
  done
done
/usr/bin/python3 - "$csv" "$out/ddp.md" <<'PY'
import collections, csv, os, statistics, sys
rows = collections.defaultdict(list)
params = {}
for r in csv.DictReader(open(sys.argv[1])):
    rows[(int(r["world"]), r["variant"])].append(float(r["value"]))
    params[int(r["world"])] = int(r["size"])
lines = [f"Data-parallel training step, {os.cpu_count()} cores, one thread per rank; medians of "
         f"{len(rows[next(iter(rows))])} trials per side, interleaved. Batch 64 per rank, {params[2]:,} parameters.",
         "", "| ranks | accel.hpp ms/step | Python DDP ms/step | accel samples/s | DDP samples/s | ratio (DDP time / accel time) |",
         "|---|---|---|---|---|---|"]
for world in sorted({w for w, _ in rows}):
    a = statistics.median(rows[(world, "accel_accelerator")])
    p = statistics.median(rows[(world, "python_ddp")])
    lines.append(f"| {world} | {a:.2f} | {p:.2f} | {64 * world / a * 1e3:.0f} | {64 * world / p * 1e3:.0f} | {p / a:.2f} |")
lines += ["", "A ratio of 1 or more means accel.hpp is no slower than Python's DDP."]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
