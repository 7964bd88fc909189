#!/usr/bin/env bash
# Pipeline parallelism, side by side in one run: accel::pp's schedules
# (bench_pipeline.cpp) against Python's torch.distributed.pipelining
# (bench_pipeline.py) on the same model (an input projection, 8 residual
# blocks of 1024 x 1024, a head; 8.5 M parameters, fp32), batch 64, SGD:
# GPipe, 1F1B, Interleaved 1F1B, ZBV and DualPipeV at pp 2 and 4 with 4, 8
# and 16 micro-batches (DualPipeV from 2p, its rule), one intra-op thread per
# rank, interleaved. Writes
# pipeline.csv and pipeline.md to ACCEL_BENCH_OUT: the step time of both and
# their ratio, accel.hpp's measured bubble (1 - a rank's time in its stages'
# computations / the pipeline's step, averaged over ranks and steps) beside GPipe's and
# 1F1B's model (p - 1) / (m + p - 1), and the most micro-batches' activations
# a stage held. The pip leg only (ACCEL_BENCH_LEG=pip is set here): its torch
# (2.15) has the schedules. Never part of the test command.
#
#     bash tests/bench/run_pipeline_bench.sh [rounds (2)] [steps per trial (10)] [worlds ("2 4")]
set -euo pipefail
rounds=${1:-2}
steps=${2:-10}
worlds=${3:-2 4}
export ACCEL_BENCH_LEG=pip
source "$(dirname "$0")/common.sh"
bench_prepare pipeline.csv "" accel_bench_pipeline
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for world in $worlds; do
  for m in 4 8 16; do
    for schedule in gpipe 1f1b interleaved_1f1b zbv dualpipev; do
      if [[ $schedule == dualpipev ]] && ((m < 2 * world)); then continue; fi
      for ((round = 1; round <= rounds; ++round)); do  # interleaved: accel, Python, accel, Python, ...
        run $world "$build/tests/accel_bench_pipeline" $schedule $m 1 "$steps"
        run $world "$python" "$root/tests/bench/bench_pipeline.py" $schedule $m 1 "$steps"
      done
    done
  done
done
"$python" - "$csv" "$out/pipeline.md" <<'PY'
import collections, csv, os, statistics, sys
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(r["part"], int(r["world"]), r["variant"], int(r["size"]))].append(float(r["value"]))
med = lambda part, w, v, m: statistics.median(rows[(part, w, v, m)]) if rows.get((part, w, v, m)) else None
lines = [f"Pipeline step, {os.cpu_count()} cores, one thread per rank; medians over interleaved trials. "
         "8.5 M parameters in 8 blocks, batch 64, SGD; stages: 1 per rank (GPipe, 1F1B), 2 (Interleaved 1F1B: "
         "a loop; ZBV, DualPipeV: a V). Bubble: 1 - time in the stages' computations / step, mean over ranks; model: "
         "(p - 1) / (m + p - 1). Ratio: Python's time / accel.hpp's (1 or more: accel.hpp no slower).", "",
         "| pp | micro-batches | schedule | accel.hpp ms | Python ms | ratio | bubble measured | bubble model | most micro-batches held |",
         "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
for world in sorted({k[1] for k in rows}):
    for m in sorted({k[3] for k in rows if k[1] == world}):
        for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"):
            a, p = med("pp_step", world, "accel_" + s, m), med("pp_step", world, "python_" + s, m)
            if a is None:
                continue
            b, held = med("pp_bubble", world, "accel_" + s, m), med("pp_in_flight", world, "accel_" + s, m)
            model = f"{(world - 1) / (m + world - 1):.2f}" if s in ("gpipe", "1f1b") else ""
            f = lambda x, spec: "-" if x is None else format(x, spec)
            lines.append(f"| {world} | {m} | {s} | {a:.1f} | {f(p, '.1f')} | {f(p and p / a, '.2f')} | "
                         f"{b:.2f} | {model} | {held:.0f} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
