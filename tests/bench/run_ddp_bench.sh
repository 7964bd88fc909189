#!/usr/bin/env bash
# Data-parallel training, side by side in one run: the same MLP (256-1024-
# 1024-1024-1, 2.4 M parameters, batch 64 per rank, SGD with momentum) trained
# with accel::Accelerator and with Python's DistributedDataParallel (Debian's
# python3-torch: 1.13 on bookworm, 2.6 in the trixie root; with
# ACCEL_BENCH_LEG=pip the pip leg's torch, common.sh; Gloo), interleaved,
# at 2 and 4 ranks, one intra-op thread per rank on both sides. Writes ddp.csv
# and ddp.md (step time, samples/s, ratio) to ACCEL_BENCH_OUT (default
# tests/bench/results). Never part of the test command.
#
#     bash tests/bench/run_ddp_bench.sh [rounds (3)] [steps per trial (30)] [hooks ("none fp16 powersgd")]
#     # on LibTorch 2.6:
#     bash tests/trixie/in_root.sh build/trixie-root env ACCEL_BUILD_DIR=build/trixie-gcc \
#       ACCEL_BENCH_OUT=tests/bench/results/libtorch-2.6 bash tests/bench/run_ddp_bench.sh 3 20
#     # on the pip leg's (results in tests/bench/results/pip):
#     ACCEL_BENCH_LEG=pip bash tests/bench/run_ddp_bench.sh 3 20 none
set -euo pipefail
rounds=${1:-3}
steps=${2:-30}
hooks=${3:-none fp16 powersgd}  # communication hooks: none, fp16 (fp16_compress_hook), powersgd (rank 1 from step 2)
source "$(dirname "$0")/common.sh"
bench_prepare ddp.csv python3-torch accel_bench_ddp
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for world in 2 4; do
  for ((round = 1; round <= rounds; ++round)); do  # interleaved: accel, Python, accel, Python, ...
    for hook in $hooks; do
      run $world "$build/tests/accel_bench_ddp" 3 "$steps" $hook
      # Python's powerSGD_hook aborts on Gloo here (1.13 and 2.6: gloo::EnforceNotMet "op.preamble.length <=
      # op.nbytes"): ours is compared with our plain step only.
      [[ $hook == powersgd ]] || run $world "$python" "$root/tests/bench/bench_ddp.py" 3 "$steps" $hook
    done
  done
done
"$python" - "$csv" "$out/ddp.md" <<'PY'
import collections, csv, os, statistics, sys
rows = collections.defaultdict(list)
params = {}
for r in csv.DictReader(open(sys.argv[1])):
    rows[(r["part"], int(r["world"]), r["variant"])].append(float(r["value"]))
    params[int(r["world"])] = int(r["size"])
trials = len(rows[next(k for k in rows if k[0] == "ddp_step")])
lines = [f"Data-parallel training step, {os.cpu_count()} cores, one thread per rank; medians of {trials} trials per "
         f"side, interleaved. Batch 64 per rank, {params[2]:,} parameters. Loss: rank 0's mse after the last step of "
         "a run (the same data and start on both sides: compare each side's hooked loss with its unhooked one).",
         "", "| ranks | hook | accel.hpp ms/step | Python DDP ms/step | accel samples/s | DDP samples/s | ratio (DDP time / accel time) | accel: hooked / unhooked time | accel loss | Python loss |",
         "|---|---|---|---|---|---|---|---|---|---|"]
med = lambda part, w, v: statistics.median(rows[(part, w, v)]) if rows.get((part, w, v)) else None
for world in sorted({w for _, w, _ in rows}):
    for hook in ("none", "fp16", "powersgd"):
        suffix = "" if hook == "none" else "_" + hook
        a, p = med("ddp_step", world, "accel_accelerator" + suffix), med("ddp_step", world, "python_ddp" + suffix)
        if a is None:
            continue
        base = med("ddp_step", world, "accel_accelerator")
        la, lp = med("ddp_loss", world, "accel_accelerator" + suffix), med("ddp_loss", world, "python_ddp" + suffix)
        py = lambda x, f: "-" if x is None else f.format(x)
        lines.append(f"| {world} | {hook} | {a:.2f} | {py(p, '{:.2f}')} | {64 * world / a * 1e3:.0f} | "
                     f"{py(p and 64 * world / p * 1e3, '{:.0f}')} | {py(p and p / a, '{:.2f}')} | {a / base:.2f} | "
                     f"{la:.6g} | {py(lp, '{:.6g}')} |")
lines += ["", "A ratio of 1 or more means accel.hpp is no slower than Python's DDP."]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
