#!/usr/bin/env bash
# examples/train_llama against the same LLaMA in Python (tests/bench/bench_llama.py: FSDP2's fully_shard on the
# same model mesh, the same Ulysses exchanges on cp, AdamW, fp32, Gloo), side by side in one run on the pip leg:
# tokens/s over the steps after the 5th and the largest peak RSS (VmHWM, MiB) over the processes, at 1, 2 and 4
# processes: (dp 2), (cp 2), (dp 4), (dp 2, cp 2) sharded along all 4, and HSDP (2, 2) with dp 4. One thread per
# process, rounds interleaved (C++ then Python, config by config), medians. Sizes: train_llama's defaults (4
# layers, hidden 128, 4 heads sharing 2 key/value heads, seq 128, 16 sequences per step). Never part of the test
# command. Writes llama.csv and llama.md to ACCEL_BENCH_OUT (default tests/bench/results/pip).
# The set `tp` instead: tensor parallelism at tp 2 and 4 over the whole world (train_llama --tp), and tp 2 on 4
# processes with the pieces sharded along mp_shard 2 (FULL_SHARD: FSDP + TP), against Python's DTensor with the
# same plan (torchtitan's, sequence parallelism, loss_parallel; FSDP2's fully_shard along the same dimension),
# into llama_tp.{csv,md}; the model with 8 heads sharing 4 key/value heads on both sides (tp 4 splits them),
# otherwise the same.
# The set `pp`: pipeline parallelism (train_llama --pp) against torch.distributed.pipelining (bench_llama.py's
# train_pipelined: the same split into stages, each stage FSDP2-sharded along dp beside pp, clipped over every
# stage): GPipe, 1F1B and ZBV (two stages per process) at pp 2, 1F1B at pp 4 (a layer per stage) and at pp 2 x dp 2
# (each stage FULL_SHARD over dp 2), 4 micro-batches, into llama_pp.{csv,md}; the model otherwise the same.
# The set `small`: small units, latency-bound (hidden 64, intermediate 176: seven FULL_SHARD units of about 50K
# parameters) at dp 4: accel's FULL_SHARD and NO_SHARD against FSDP2, into llama_small.{csv,md}.
#
#     bash tests/bench/run_llama_bench.sh [rounds (3)] [steps per run (20)] [set: fsdp (default) | tp | pp | small]
set -euo pipefail
rounds=${1:-3}
steps=${2:-20}
set=${3:-fsdp}
top=$(cd "$(dirname "$0")/../.." && pwd)
build=${ACCEL_BUILD_DIR:-$top/build/pip}
out=${ACCEL_BENCH_OUT:-$top/tests/bench/results/pip}
mkdir -p "$out"
export PATH="$top/build/pip-venv/bin:$PATH" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONWARNINGS=ignore
cmake --build "$build" --target train_llama accel_launch -j2 > /dev/null
base=llama && python_side=python_fsdp2
heads=()
if [[ $set == small ]]; then
  base=llama_small && heads=(--hidden 64 --intermediate 176)
  export BENCH_LLAMA_HIDDEN=64 BENCH_LLAMA_INTERMEDIATE=176
fi
if [[ $set == tp ]]; then
  base=llama_tp && python_side=python_dtensor_tp && heads=(--heads 8 --kv-heads 4)
  export BENCH_LLAMA_HEADS=8 BENCH_LLAMA_KV_HEADS=4
fi
[[ $set == pp ]] && base=llama_pp && python_side=python_pipelining
csv=$out/$base.csv
echo "round,world,mesh,side,tokens_per_s,peak_rss_mib" > "$csv"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# name world mp_replicate dp cp tp [pp schedule microbatches]
configs=("one 1 1 1 1 1" "dp2 2 1 2 1 1" "cp2 2 1 1 2 1" "dp4 4 1 4 1 1" "dp2_cp2 4 1 2 2 1" "hsdp_dp4 4 2 4 1 1")
[[ $set == tp ]] && configs=("tp2 2 1 1 1 2" "tp4 4 1 1 1 4" "fsdp2_tp2 4 1 2 1 2")
[[ $set == pp ]] && configs=("pp2_gpipe 2 1 1 1 1 2 gpipe 4" "pp2_1f1b 2 1 1 1 1 2 1f1b 4" "pp2_zbv 2 1 1 1 1 2 zbv 4"
                             "pp4_1f1b 4 1 1 1 1 4 1f1b 4" "pp2_dp2_1f1b 4 1 2 1 1 2 1f1b 4")
[[ $set == small ]] && configs=("small_dp4 4 1 4 1 1")
record() {  # round world mesh side log
  local line
  line=$(grep -E "tokens/s over steps" "$5" | tail -1)
  local tokens peak
  tokens=$(sed -E 's/.*[ :]([0-9]+) tokens\/s.*/\1/' <<< "$line")
  peak=$(sed -E 's/.*peak RSS ([0-9]+) MiB.*/\1/' <<< "$line")
  echo "$1,$2,$3,$4,$tokens,$peak" >> "$csv"
  echo "round $1, $3 ($2 processes), $4: $tokens tokens/s, peak RSS $peak MiB"
}
for ((round = 1; round <= rounds; ++round)); do
  for config in "${configs[@]}"; do
    pp=1 schedule=1f1b microbatches=1
    read -r name world replicate dp cp tp pp schedule microbatches <<< "$config"
    pipeline=()
    ((pp > 1)) && pipeline=(--pp "$pp" --schedule "$schedule" --microbatches "$microbatches")
    rm -rf "$scratch/run"
    "$build/tests/accel_launch" --timeout 300 "$world" "$build/examples/train_llama" --steps "$steps" \
      --mp-replicate "$replicate" --dp "$dp" --cp "$cp" --tp "$tp" "${pipeline[@]}" "${heads[@]}" \
      --dir "$scratch/run" > "$scratch/cpp.log" 2>&1
    record "$round" "$world" "$name" accel "$scratch/cpp.log"
    if [[ $set == small ]]; then  # (the same, not sharded: what small units cost against NO_SHARD)
      rm -rf "$scratch/run"
      "$build/tests/accel_launch" --timeout 300 "$world" "$build/examples/train_llama" --steps "$steps" \
        --dp "$dp" --sharding no_shard "${heads[@]}" --dir "$scratch/run" > "$scratch/cpp.log" 2>&1
      record "$round" "$world" "$name" accel_no_shard "$scratch/cpp.log"
    fi
    "$build/tests/accel_launch" --timeout 300 "$world" python3 "$top/tests/bench/bench_llama.py" "$replicate" "$cp" \
      "$steps" "$tp" "$pp" "$schedule" "$microbatches" > "$scratch/py.log" 2>&1
    record "$round" "$world" "$name" "$python_side" "$scratch/py.log"
  done
done
python3 - "$csv" "$out/$base.md" "$rounds" "$steps" "$python_side" "$base" <<'PY'
import collections, csv, os, statistics, sys
import torch
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    rows[(r["mesh"], int(r["world"]), r["side"])].append((float(r["tokens_per_s"]), float(r["peak_rss_mib"])))
names = {"one": "one process", "dp2": "dp 2", "cp2": "cp 2 (Ulysses)", "dp4": "dp 4", "dp2_cp2": "dp 2 x cp 2",
         "hsdp_dp4": "HSDP (2, 2), dp 4", "tp2": "tp 2", "tp4": "tp 4",
         "fsdp2_tp2": "mp_shard 2 x tp 2 (FSDP + TP)", "pp2_gpipe": "pp 2, GPipe", "pp2_1f1b": "pp 2, 1F1B",
         "pp2_zbv": "pp 2, ZBV (4 stages)", "pp4_1f1b": "pp 4, 1F1B", "pp2_dp2_1f1b": "pp 2 x dp 2 (FULL_SHARD), 1F1B"}
side, base = sys.argv[5], sys.argv[6]
lines = [f"examples/train_llama against the same model in Python torch {torch.__version__} with FSDP2 (fully_shard per "
         f"layer, embedding, norm and head; the same model mesh) and the same Ulysses exchanges; {os.cpu_count()} cores, "
         f"one thread per process, AdamW, fp32; tokens/s over steps 6-{sys.argv[4]}, medians of {sys.argv[3]} "
         "interleaved rounds; peak RSS = the largest VmHWM over the processes (Python's includes its interpreter and "
         "torch's Python modules).", "",
         "| processes | mesh (sharded along the model mesh: FULL_SHARD) | accel tokens/s | Python FSDP2 tokens/s | accel / Python | accel peak RSS MiB | Python peak RSS MiB |",
         "|---:|---|---:|---:|---:|---:|---:|"]
if side == "python_dtensor_tp":
    lines = [f"examples/train_llama --tp against the same model in Python torch {torch.__version__} with DTensor tensor "
             "parallelism (parallelize_module with torchtitan's plan, sequence parallelism, loss_parallel; no sharding "
             "beside tp over the whole world; FSDP2's fully_shard per layer, embedding, norm and head along mp_shard "
             f"beside tp 2 on 4, accel's FULL_SHARD with the same units), 8 heads sharing 4 key/value heads; {os.cpu_count()} cores, one thread per process, AdamW, fp32; tokens/s over steps "
             f"6-{sys.argv[4]}, medians of {sys.argv[3]} interleaved rounds; peak RSS = the largest VmHWM over the "
             "processes.", "",
             "| processes | mesh | accel tokens/s | Python DTensor TP tokens/s | accel / Python | accel peak RSS MiB | Python peak RSS MiB |",
             "|---:|---|---:|---:|---:|---:|---:|"]
if side == "python_pipelining":
    lines = [f"examples/train_llama --pp against the same model in Python torch {torch.__version__} with "
             "torch.distributed.pipelining (PipelineStage and the same schedule over the same split into stages; "
             "beside dp, each stage FSDP2-sharded as accel's FULL_SHARD; clipped over every stage), 4 micro-batches "
             f"per step; {os.cpu_count()} cores, one thread per process, AdamW, fp32; tokens/s over steps "
             f"6-{sys.argv[4]}, medians of {sys.argv[3]} interleaved rounds; peak RSS = the largest VmHWM over the "
             "processes.", "",
             "| processes | pipeline | accel tokens/s | Python pipelining tokens/s | accel / Python | accel peak RSS MiB | Python peak RSS MiB |",
             "|---:|---|---:|---:|---:|---:|---:|"]
if base == "llama_small":
    lines = [f"examples/train_llama with small units (hidden 64, intermediate 176, 4 layers: seven FULL_SHARD units of "
             f"about 50K parameters) at dp 4, FULL_SHARD and NO_SHARD, against the same model in Python torch "
             f"{torch.__version__} with FSDP2 (fully_shard per layer, embedding, norm and head); {os.cpu_count()} cores, "
             f"one thread per process, AdamW, fp32; tokens/s over steps 6-{sys.argv[4]}, medians of {sys.argv[3]} "
             "interleaved rounds.", "",
             "| processes | accel FULL_SHARD tokens/s | accel NO_SHARD tokens/s | Python FSDP2 tokens/s | FULL_SHARD / FSDP2 | FULL_SHARD / NO_SHARD |",
             "|---:|---:|---:|---:|---:|---:|"]
    f, n, p = (statistics.median(x[0] for x in rows.get(("small_dp4", 4, k), [(float("nan"), 0)]))
               for k in ("accel", "accel_no_shard", side))
    lines.append(f"| 4 | {f:.0f} | {n:.0f} | {p:.0f} | {f / p:.2f} | {f / n:.2f} |")
for mesh, world in [("one", 1), ("dp2", 2), ("cp2", 2), ("dp4", 4), ("dp2_cp2", 4), ("hsdp_dp4", 4), ("tp2", 2), ("tp4", 4),
                    ("fsdp2_tp2", 4), ("pp2_gpipe", 2), ("pp2_1f1b", 2), ("pp2_zbv", 2), ("pp4_1f1b", 4),
                    ("pp2_dp2_1f1b", 4)]:
    a, p = rows.get((mesh, world, "accel"), []), rows.get((mesh, world, side), [])
    if not a or not p:
        continue
    at, pt = statistics.median(x[0] for x in a), statistics.median(x[0] for x in p)
    am, pm = statistics.median(x[1] for x in a), statistics.median(x[1] for x in p)
    lines.append(f"| {world} | {names[mesh]} | {at:.0f} | {pt:.0f} | {at / pt:.2f} | {am:.0f} | {pm:.0f} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
