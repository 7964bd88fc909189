#!/usr/bin/env bash
# examples/train_llama --tp against Python's DTensor tensor parallelism, live (the pip leg's torch): the same
# LLaMA (initialised by transformers, imported by both), the same batches, schedule, clipping and AdamW
# (tests/python_ref/llama_tp_ref.py rebuilds train_llama's data and loop; its model, LlamaForCausalLM's names,
# first checked against transformers' logits). torchtitan's plan with sequence parallelism and loss_parallel on
# both sides at tp 2 (2 processes), tp 4 (4), and tp 2 under FSDP along 2 (train_llama's FULL_SHARD along
# mp_shard, Python's fully_shard on the outer dimension of a (2, 2) mesh), fp32, against one process on each side:
#   - the loss of every step within 1e-5 relative;
#   - the whole parameters after STEPS AdamW steps within 1e-4 (fp32: AdamW's first update, about lr * g / (|g| +
#     eps), turns the rounding of tiny gradients into parameter differences of that order even between Python's
#     own tp and one process; the example has no float64 mode);
#   - without FSDP, the collectives of the second step: train_llama's on the tp group at most Python's
#     (CommDebugMode's, every kind together).
# Skipped (77) where Python's torch is older than 2.7 or has no transformers.
#     bash tests/llama_tp_check.sh ACCEL_LAUNCH TRAIN_LLAMA DIR
set -euo pipefail
launch=$1 train=$2 dir=$3
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import sys, torch, transformers; from torch.distributed.tensor.parallel import loss_parallel; sys.exit(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 7))' 2>/dev/null; then
  echo "SKIP: Python here has no torch 2.7 or later with DTensor's tensor parallelism, or no transformers"
  exit 77
fi
rm -rf "$dir" && mkdir -p "$dir"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export OMP_NUM_THREADS=1 PYTHONFAULTHANDLER=1
STEPS=5 SEQ=32 BATCH=8 WARMUP=2
ref=$here/python_ref/llama_tp_ref.py
python3 "$ref" start "$dir/start" "$SEQ"

# name world tp mp_shard: each side once
runs=("one 1 1 1" "tp2 2 2 1" "tp4 4 4 1" "fsdp_tp2 4 2 2")
for run in "${runs[@]}"; do
  read -r name world tp shard <<< "$run"
  if ((world == 1)); then
    python3 "$ref" train "$dir/start" "$dir/py_$name" 1 $STEPS $SEQ $BATCH $WARMUP
  else
    "$launch" --timeout 240 "$world" python3 "$ref" train "$dir/start" "$dir/py_$name" "$tp" $STEPS $SEQ $BATCH $WARMUP
  fi
  flags=(--import "$dir/start" --steps $STEPS --seq $SEQ --batch $BATCH --warmup $WARMUP --dir "$dir/cpp_$name"
         --export "$dir/cpp_$name/model")
  ((tp > 1)) && flags+=(--tp "$tp" --mp-shard "$shard")
  "$launch" --timeout 240 "$world" "$train" "${flags[@]}" > "$dir/cpp_$name.log"
  grep "issued" "$dir/cpp_$name.log" || true
done

python3 - "$dir" "${runs[@]}" <<'PY'
import csv, os, sys
from safetensors.torch import load_file
root, runs = sys.argv[1], [r.split() for r in sys.argv[2:]]
def losses(side, name):
    if side == "py":
        return [float(v) for v in open(os.path.join(root, f"py_{name}", "losses.txt"))]
    return [float(r["loss"]) for r in csv.DictReader(open(os.path.join(root, f"cpp_{name}", "logs", "metrics.csv")))]
def weights(side, name):
    return load_file(os.path.join(root, f"{side}_{name}", "model" if side == "cpp" else "", "model.safetensors"))
def compare(a, b, what):
    la, lb = losses(*a), losses(*b)
    assert len(la) == len(lb) == 5, (what, la, lb)
    loss = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    wa, wb = weights(*a), weights(*b)
    assert wa.keys() == wb.keys(), (what, sorted(set(wa) ^ set(wb)))
    weight = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"llama_tp_check: {what}: losses within {loss:.3g} relative, parameters within {weight:.3g}")
    assert loss <= 1e-5 and weight <= 1e-4, what
    return loss, weight
one = ("py", "one"), ("cpp", "one")
compare(*one, "one process, C++ against Python")
for name, world, tp, shard in runs[1:]:
    label = f"tp {tp}" + (f" x mp_shard {shard}" if shard != "1" else "") + f" on {world}"
    compare(("cpp", name), ("py", name), f"{label}: C++ against Python's DTensor")
    compare(("cpp", name), one[1], f"{label}: C++ against one process")
    compare(("py", name), one[0], f"{label}: Python against one process")
    if shard == "1":
        python = dict(line.split() for line in open(os.path.join(root, f"py_{name}", "collectives.txt")))
        log = open(os.path.join(root, f"cpp_{name}.log")).read()
        ours = int(log.split(" issued ")[1].split()[0])
        total = sum(map(int, python.values()))
        print(f"llama_tp_check: {label}: the second step's collectives: C++ {ours} on the tp group, Python {total} "
              f"({', '.join(f'{k} {v}' for k, v in sorted(python.items()))})")
        assert ours <= total, (ours, total)
PY
