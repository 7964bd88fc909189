#!/usr/bin/env bash
# Sharded data parallel, side by side in one run: per-process memory and step
# time of accel::Accelerator with NO_SHARD, SHARD_GRAD_OP (ZeRO-2) and FULL_SHARD (ZeRO-3), and of
# Python's DistributedDataParallel with a plain Adam and with
# ZeroRedundancyOptimizer (Debian's python3-torch; Gloo), Adam on an MLP of
# 4 x 2048 x 2048 (16.8 M parameters), batch 16 per process, at 2 and 4
# processes, one intra-op thread each, interleaved. Writes sharding.csv and
# sharding.md to ACCEL_BENCH_OUT (default tests/bench/results). Never part of
# the test command.
#
#     bash tests/bench/run_sharding_bench.sh [rounds (2)] [steps per trial (5)]
set -euo pipefail
rounds=${1:-2}
steps=${2:-5}
source "$(dirname "$0")/common.sh"
bench_prepare sharding.csv python3-torch accel_bench_sharding
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for world in 2 4; do
  for ((round = 1; round <= rounds; ++round)); do
    for variant in no_shard shard_grad_op full_shard; do run $world "$build/tests/accel_bench_sharding" $variant 3 "$steps"; done
    for variant in no_shard zero; do run $world /usr/bin/python3 "$root/tests/bench/bench_sharding.py" $variant 3 "$steps"; done
  done
done
/usr/bin/python3 - "$csv" "$out/sharding.md" <<'PY'
import collections, csv, os, statistics, sys
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(r["part"].removeprefix("sharding_"), int(r["world"]), r["variant"])].append(float(r["value"]))
def cell(figure, world, variant, fmt="{:.1f}"):
    v = rows.get((figure, world, variant))
    return fmt.format(statistics.median(v)) if v else "-"
variants = [("no_shard", "accel NO_SHARD"), ("shard_grad_op", "accel SHARD_GRAD_OP"), ("full_shard", "accel FULL_SHARD"),
            ("python_no_shard", "Python DDP + Adam"), ("python_zero", "Python DDP + ZeroRedundancyOptimizer")]
lines = [f"Sharded data parallel, {os.cpu_count()} cores, one thread per process; Adam on 4 x 2048 x 2048 "
         "(16.8 M parameters), batch 16 per process. Per process, the largest over the processes; MiB held "
         "between two steps (after step, before the next zero_grad); medians over rounds.", "",
         "| processes | variant | parameters (+ shards) | gradients | optimizer state | all CPU bytes between steps | of which engine buffers kept | peak CPU bytes in a step | ms/step |",
         "|---|---|---|---|---|---|---|---|---|"]
for world in sorted({w for _, w, _ in rows}):
    for key, name in variants:
        lines.append(f"| {world} | {name} | {cell('params_mb', world, key)} | {cell('grads_mb', world, key)} | "
                     f"{cell('optimizer_mb', world, key)} | {cell('between_steps_mb', world, key)} | {cell('buffers_mb', world, key)} | "
                     f"{cell('peak_mb', world, key)} | {cell('step_ms', world, key, '{:.0f}')} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
