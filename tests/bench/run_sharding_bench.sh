#!/usr/bin/env bash
# Sharded data parallel, side by side in one run: per-process memory and step
# time of accel::Accelerator with NO_SHARD, SHARD_GRAD_OP (ZeRO-2) and FULL_SHARD (ZeRO-3), and of
# Python's DistributedDataParallel with a plain Adam and with
# ZeroRedundancyOptimizer (Debian's python3-torch; Gloo), Adam on an MLP of
# 4 x 2048 x 2048 (16.8 M parameters), batch 16 per process, at 2 and 4
# processes, one intra-op thread each, interleaved; FULL_SHARD under a bf16
# MixedPrecisionPolicy too (and, on the pip leg, Python's FSDP2 under the same), HYBRID_SHARD on a
# (2, 2) mesh at 4 processes (on the pip leg against FSDP2's HSDP); from torch 2.4 on, with
# accel::FusedAdam and Python's Adam(fused=True) as well. Writes sharding.csv and
# sharding.md to ACCEL_BENCH_OUT (default tests/bench/results), with the step's
# parts (forward, backward, optimizer), the step's collectives alone (wall and
# CPU; NO_SHARD's also as reduce-scatter + all-gather point to point), the
# one-process step, and each step's bucket timeline (sharding_timeline.csv;
# bucket_timeline.png where gnuplot is installed). Never part of the test
# command.
#
# ACCEL_BENCH_LEG=pip: the pip leg's LibTorch and Python instead (common.sh),
# with Python's FSDP2 (`fully_shard`, ZeRO-2 and ZeRO-3) beside DDP and
# ZeroRedundancyOptimizer.
#
# The set "gpt" (third argument) runs the small GPT-2-shaped decoder instead
# (bench_sharding.cpp's gpt_ variants: 4 blocks, hidden 64, tied head, a
# unit per block): NO_SHARD and FULL_SHARD against Python's DDP and (pip leg)
# FSDP2, into sharding_gpt.csv and sharding_gpt.md.
#
#     bash tests/bench/run_sharding_bench.sh [rounds (2)] [steps per trial (5)] [mlp|gpt]
#     ACCEL_BENCH_LEG=pip bash tests/bench/run_sharding_bench.sh 1 3
set -euo pipefail
rounds=${1:-2}
steps=${2:-5}
set_name=${3:-mlp}
source "$(dirname "$0")/common.sh"
if [[ $set_name == gpt ]]; then
  prefix=gpt_ name=sharding_gpt
  accel_variants=(gpt_no_shard gpt_full_shard)
  python_variants=(gpt_no_shard)
  [[ ${ACCEL_BENCH_LEG:-} == pip ]] && python_variants+=(gpt_fsdp2_full_shard)
else
  prefix='' name=sharding
  accel_variants=(no_shard shard_grad_op full_shard full_shard_bf16 hybrid_shard)
  python_variants=(no_shard zero)
  if [[ ${ACCEL_BENCH_LEG:-} == pip ]]; then
    python_variants+=(fsdp2_shard_grad_op fsdp2_full_shard fsdp2_full_shard_bf16 fsdp2_hybrid_shard)
  fi
  # With torch 2.4 or newer (its fused Adam kernel on the CPU): accel::FusedAdam
  # and Python's Adam(fused=True) too.
  if "$python" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 4))'; then
    accel_variants+=(no_shard_fused shard_grad_op_fused full_shard_fused)
    python_variants+=(no_shard_fused zero_fused)
  fi
fi
bench_prepare $name.csv python3-torch accel_bench_sharding
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# The step's collectives alone too (no_shard, full_shard and Python's DDP): "collectives" after the steps.
alone() { [[ $1 == "${prefix}no_shard" || $1 == "${prefix}full_shard" ]] && echo collectives; }
for world in 1 2 4; do
  for ((round = 1; round <= rounds; ++round)); do
    if [[ $world == 1 ]]; then  # one process, no communication: the step's compute alone
      run 1 "$build/tests/accel_bench_sharding" "${prefix}no_shard" 3 "$steps"
      continue
    fi
    # (HSDP on a (2, world / 2) mesh: at 4 processes only; at 2 it would shard nothing)
    for variant in "${accel_variants[@]}"; do
      # shellcheck disable=SC2046  # (nothing, or the one word)
      [[ $variant == *hybrid* && $world == 2 ]] ||
        run $world "$build/tests/accel_bench_sharding" $variant 3 "$steps" $(alone $variant)
    done
    for variant in "${python_variants[@]}"; do
      # shellcheck disable=SC2046
      [[ $variant == *hybrid* && $world == 2 ]] ||
        run $world "$python" "$root/tests/bench/bench_sharding.py" $variant 3 "$steps" $(alone $variant)
    done
  done
done
# The bucket timeline of one step at 2 processes (the last round's), where gnuplot is installed.
if [[ $set_name == mlp ]] && command -v gnuplot > /dev/null; then
  bash "$root/tests/bench/plot_timeline.sh" "$timeline_csv" "$out/bucket_timeline.png" 2 "no_shard full_shard"
fi
"$python" - "$csv" "$out/$name.md" "$prefix" <<'PY'
import collections, csv, os, statistics, sys
prefix = sys.argv[3]
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(r["part"].removeprefix("sharding_"), int(r["world"]), r["variant"])].append(float(r["value"]))
def cell(figure, world, variant, fmt="{:.1f}"):
    v = rows.get((figure, world, variant))
    return fmt.format(statistics.median(v)) if v else "-"
variants = [("no_shard", "accel NO_SHARD"), ("shard_grad_op", "accel SHARD_GRAD_OP"), ("full_shard", "accel FULL_SHARD"),
            ("full_shard_bf16", "accel FULL_SHARD, bf16 policy"), ("hybrid_shard", "accel HYBRID_SHARD, (2, 2) mesh"),
            ("python_no_shard", "Python DDP + Adam"), ("python_zero", "Python DDP + ZeroRedundancyOptimizer"),
            ("python_fsdp2_shard_grad_op", "Python FSDP2, ZeRO-2"), ("python_fsdp2_full_shard", "Python FSDP2, ZeRO-3"),
            ("python_fsdp2_full_shard_bf16", "Python FSDP2, ZeRO-3, bf16 policy"),
            ("python_fsdp2_hybrid_shard", "Python FSDP2, HSDP, (2, 2) mesh"),
            ("no_shard_fused", "accel NO_SHARD, FusedAdam"), ("shard_grad_op_fused", "accel SHARD_GRAD_OP, FusedAdam"),
            ("full_shard_fused", "accel FULL_SHARD, FusedAdam"), ("python_no_shard_fused", "Python DDP + Adam(fused=True)"),
            ("python_zero_fused", "Python DDP + ZeroRedundancyOptimizer(Adam, fused=True)")]
# (the gpt set's variants carry the prefix after python_)
variants = [(f"python_{prefix}{k[7:]}" if k.startswith("python_") else prefix + k, n) for k, n in variants]
model = ("the GPT-2-shaped decoder (4 blocks, hidden 64, tied head; a unit per block), 8 x 64 tokens"
         if prefix else "4 x 2048 x 2048 (16.8 M parameters), batch 16")
import torch
lines = [f"Sharded data parallel, LibTorch and Python torch {torch.__version__}, {os.cpu_count()} cores, one thread per process; Adam on {model} "
         "per process. Per process, the largest over the processes; MiB held "
         "between two steps (after step, before the next zero_grad); medians over rounds.", "",
         "The two RSS columns, read from /proc on both sides (Python's allocator has no counting hook): resident "
         "memory added since before the model was built, between two steps and at the peak of the timed steps "
         "(VmHWM after a reset); they include what each process's malloc keeps of freed blocks. CPU ms/step: the CPU "
         "time of every thread of every process per step, summed (steadier than wall time where busy threads outnumber cores).", "",
         "| processes | variant | parameters (+ shards) | gradients | optimizer state | all CPU bytes between steps | of which engine buffers kept | peak CPU bytes in a step | RSS between steps | peak RSS | ms/step | CPU ms/step |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for world in sorted({w for _, w, _ in rows}):
    for key, name in variants:
        if ("step_ms", world, key) not in rows:
            continue  # (a variant this leg has not, or whose runs failed)
        lines.append(f"| {world} | {name} | {cell('params_mb', world, key)} | {cell('grads_mb', world, key)} | "
                     f"{cell('optimizer_mb', world, key)} | {cell('between_steps_mb', world, key)} | {cell('buffers_mb', world, key)} | "
                     f"{cell('peak_mb', world, key)} | {cell('rss_between_mb', world, key)} | {cell('rss_peak_mb', world, key)} | "
                     f"{cell('step_ms', world, key, '{:.0f}')} | {cell('cpu_ms', world, key, '{:.0f}')} |")
# Where the step's time goes: its phases, and the collectives alone (the same buckets, no compute: wall, and CPU
# per process); at 2 processes (one core each) against the one-process step: the step beyond it should be at
# most the collectives' CPU time (which competes with compute for the cores) plus 10 % of the one-process step.
one = cell("step_ms", 1, prefix + "no_shard")
lines += ["", "The step's parts (ms, medians; the slowest process's): forward, backward with the wait for the reduction, "
          "optimizer step; the step's collectives alone on the same buckets with no compute (wall; CPU per process: "
          "every thread's); and, at 2 processes, the step beyond the one-process step (" + one + " ms) against the "
          "collectives' CPU time plus 10 % of the one-process step.", "",
          "| processes | variant | step | forward | backward | optimizer | collectives alone | their CPU per process | step - one process | bound |",
          "|---|---|---|---|---|---|---|---|---|---|"]
for world in sorted({w for _, w, _ in rows}):
    for key, name in variants:
        if ("forward_ms", world, key) not in rows:
            continue
        beyond = bound = "-"
        if world == 2 and one != "-" and ("collectives_cpu_ms", world, key) in rows:
            step, cpu = float(cell("step_ms", world, key)), float(cell("collectives_cpu_ms", world, key))
            beyond, bound = f"{step - float(one):.0f}", f"{cpu + 0.1 * float(one):.0f}"
        lines.append(f"| {world} | {name} | {cell('step_ms', world, key, '{:.0f}')} | {cell('forward_ms', world, key, '{:.0f}')} | "
                     f"{cell('backward_ms', world, key, '{:.0f}')} | {cell('optimizer_ms', world, key, '{:.0f}')} | "
                     f"{cell('collectives_ms', world, key, '{:.0f}')} | {cell('collectives_cpu_ms', world, key, '{:.0f}')} | {beyond} | {bound} |")
        if ("collectives_ms", world, key + "_p2p") in rows:
            lines.append(f"| {world} | {name}: its all-reduces as reduce-scatter + all-gather point to point | | | | | "
                         f"{cell('collectives_ms', world, key + '_p2p', '{:.0f}')} | {cell('collectives_cpu_ms', world, key + '_p2p', '{:.0f}')} | | |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
