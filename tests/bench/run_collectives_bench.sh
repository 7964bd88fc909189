#!/usr/bin/env bash
# reduce_scatter, all_to_all and send/recv through accel.hpp against raw c10d
# doing the same (in one process, interleaved) and Python torch.distributed
# (separate runs, interleaved with ours), at 2 and 4 ranks, with whatever
# LibTorch and python3-torch this machine (or root) has (ACCEL_BENCH_LEG=pip:
# the pip leg's, common.sh). Writes
# collectives.csv and collectives.md to ACCEL_BENCH_OUT (default
# tests/bench/results). Slow and noisy: never part of the test command.
#
#     bash tests/bench/run_collectives_bench.sh [trials (2)]
set -euo pipefail
trials=${1:-2}
source "$(dirname "$0")/common.sh"
bench_prepare collectives.csv python3-torch accel_bench
for world in 2 4; do
  for ((trial = 1; trial <= trials; ++trial)); do
    run $world "$build/tests/accel_bench" collectives
    run $world "$python" "$root/tests/bench/bench_torch.py" collectives
  done
done
"$python" - "$csv" "$out/collectives.md" <<'PY'
import collections, csv, statistics, sys
import torch
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(r["part"], int(r["world"]), int(r["size"]), r["variant"])].append(float(r["value"]))
med = {k: statistics.median(v) for k, v in rows.items()}
refs = {"reduce_scatter": "raw_c10d_alltoall_sum", "all_to_all": "raw_c10d", "all_to_all_out": "raw_c10d",
        "send_recv": "raw_c10d"}
python_of = {"all_to_all_out": "all_to_all"}  # Python's all_to_all rows reuse their output: the out= form's
lines = [f"Second-wave collectives, LibTorch/torch {torch.__version__}, Gloo; µs per call (send_recv: per round trip "
         "between ranks 0 and 1); medians over interleaved trials and runs. Ratios: time of the reference / accel.hpp "
         "(above 1: accel.hpp is faster).", "",
         "| op | ranks | bytes per rank | accel.hpp µs | raw c10d µs | ratio | Python µs | ratio | other |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
names = {"all_to_all": "all_to_all (a new output)", "all_to_all_out": "all_to_all_single (out=, kept)"}
for part in ("reduce_scatter", "all_to_all", "all_to_all_out", "send_recv"):
    for world, size in sorted({(w, s) for p, w, s, _ in med if p == part}):
        a = med.get((part, world, size, "accel_tensor"))
        raw = med.get((part, world, size, refs[part]))
        py = None if part in python_of.values() else med.get((python_of.get(part, part), world, size, "python_torch"))
        other = med.get((part, world, size, "raw_c10d_allreduce"))
        cell = lambda x: f"{x:.0f}" if x is not None else "—"
        ratio = lambda x: f"{x / a:.2f}" if x is not None and a else "—"
        lines.append(f"| {names.get(part, part)} | {world} | {size} | {cell(a)} | {cell(raw)} | {ratio(raw)} | {cell(py)} | {ratio(py)} | "
                     + (f"raw all_reduce of the whole: {other:.0f} µs" if other is not None else "") + " |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
