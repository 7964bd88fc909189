#!/usr/bin/env bash
# examples/train_llama, small enough to run in seconds (fp32):
#  1. on 4 processes with the model mesh (2, 2) (HSDP) and the data mesh (dp 2, cp 2), with (dp 4), with
#     (dp 1, cp 4) (FULL_SHARD along 4), and with tensor parallelism (torchtitan's plan, sequence parallelism
#     included): tp 2 x dp 2 under FULL_SHARD along mp_shard 2 (FSDP + TP) with activation checkpointing, and
#     under NO_SHARD, tp 4, tp 2 x cp 2 (Ulysses on tp's heads, FSDP + TP), and on 8 processes HSDP (2, 2) beside
#     tp 2 (tensor-parallel pieces sharded along mp_shard, replicated along mp_replicate), the loss of every step
#     equals one process's on the same global batches (within LOSS_TOLERANCE, relative: the same sums in another
#     order); at tp 4 each process holds a quarter of the parameters (within 5 %:
#     the norms are whole);
#     tp 2 x mp_shard 2 exports one process's weights (whole tensors, within 1e-4 after 6 AdamW steps);
#     pipeline parallelism (--pp 2, each stage FULL_SHARD or NO_SHARD over dp 2, or over cp 2 with Ulysses'
#     attention inside the stages): GPipe (pp 2 x cp 2) and 1F1B at 2 layers,
#     interleaved 1F1B, interleaved zero bubble, ZBV and DualPipeV (two stages per rank) at 4 layers, against one
#     process of the same depth, the same way, and pp 2 x tp 2 (1F1B at 2 layers, ZBV with activation
#     checkpointing at 4), and on 8 processes pp 2 x HSDP (2, 2) (1F1B); 1F1B under bf16 against one process
#     under bf16 (within 2e-4); the exports of 1F1B (FULL_SHARD over dp 2) and of ZBV x tp 2 equal one process's
#     weights (each tensor sent by its stage), and pp 2 x tp 2 started from one process's export (--import: each
#     stage reads its own) trains as one process does from it;
#  2. a run stopped mid-epoch and resumed exports the uninterrupted run's weights, byte for byte (and the
#     same with activation checkpointing on: the same gradients), also under tp 2 x mp_shard 2 (FSDP + TP: each
#     process's shards of its pieces saved and loaded), and that checkpoint resumed at tp 4 gives the same losses;
#     under pp 2 x dp 2 (1F1B, FULL_SHARD) too, whose checkpoint resumed as ZBV under NO_SHARD, and without a
#     pipeline, gives the same losses (and Python's dcp.load reads it as transformers' model, the export's weights),
#     and under pp 2 x tp 2 (ZBV), whose checkpoint resumed as 1F1B at tp 1 gives the same losses;
#  3. bad configurations stop before any step, with their reason;
#  4. with transformers (the pip leg): LlamaForCausalLM.from_pretrained loads the exported models (HSDP's,
#     FSDP + TP's, and pp 2 x tp 2's) and gives the C++ model's logits, and a model initialised by transformers,
#     imported into C++, gives transformers' logits, and greedy decoding of 32 tokens (--generate, a key/value
#     cache) gives the tokens transformers' generate(do_sample=False) gives.
#     Skipped, saying so, where Python has no transformers.
#     bash tests/llama_check.sh ACCEL_LAUNCH TRAIN_LLAMA DIR
set -euo pipefail
launch=$1 train=$2 dir=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$dir" && mkdir -p "$dir"
LOSS_TOLERANCE=1e-5
sizes=(--layers 2 --hidden 64 --heads 8 --kv-heads 4 --intermediate 160 --seq 32 --batch 8 --warmup 2)
run() { local world=$1; shift; "$launch" --timeout 240 "$world" "$train" "${sizes[@]}" "$@"; }

# 1. Meshes against one process.
run 1 --steps 6 --dir "$dir/one" --export "$dir/one/model" > "$dir/one.log"
# (the number of processes, then the flags)
declare -A meshes=([hsdp_dp2_cp2]="4 --mp-replicate 2 --mp-shard 2 --dp 2 --cp 2" [dp4]="4 --dp 4"
                   [dp1_cp4]="4 --dp 1 --cp 4" [tp2_dp2_recompute]="4 --tp 2 --dp 2 --recompute --export $dir/tp2_dp2_recompute/model"
                   [tp2_dp2_no_shard]="4 --tp 2 --dp 2 --sharding no_shard" [tp4]="4 --tp 4" [tp2_cp2]="4 --tp 2 --cp 2"
                   [hsdp_tp2_8]="8 --mp-replicate 2 --mp-shard 2 --tp 2")
same_losses() {  # REFERENCE NAME [TOLERANCE]: NAME's 6 losses against REFERENCE's (one process)
  python3 - "$dir/$1/logs/metrics.csv" "$dir/$2/logs/metrics.csv" "${3:-$LOSS_TOLERANCE}" "$2" <<'PY'
import csv, sys
one, other = ([float(r["loss"]) for r in csv.DictReader(open(p))] for p in sys.argv[1:3])
tolerance = float(sys.argv[3])
worst = max(abs(a - b) / abs(a) for a, b in zip(one, other))
print(f"llama_check: {sys.argv[4]} against one process over {len(one)} steps: largest relative loss difference {worst:.3g}")
assert len(one) == len(other) == 6 and worst <= tolerance, (one, other)
PY
}
for name in hsdp_dp2_cp2 dp4 dp1_cp4 tp2_dp2_recompute tp2_dp2_no_shard tp4 tp2_cp2 hsdp_tp2_8; do
  # shellcheck disable=SC2086
  run ${meshes[$name]} --steps 6 --dir "$dir/$name" | tee "$dir/$name.log"
  same_losses one "$name"
done
# Pipelines: pp 2 x dp 2 (a stage per rank at 2 layers; two per rank, 4 stages, at 4 layers), and pp 2 x cp 2 (each
# rank's micro-batches its slice of the sequences, Ulysses' all-to-all inside each stage's attention).
run 4 --pp 2 --schedule 1f1b --microbatches 2 --steps 6 --dir "$dir/pp2_1f1b" --export "$dir/pp2_1f1b/model" \
  | tee "$dir/pp2_1f1b.log"
same_losses one pp2_1f1b
run 4 --pp 2 --cp 2 --schedule gpipe --microbatches 4 --sharding no_shard --recompute --steps 6 \
  --dir "$dir/pp2_cp2_gpipe" > "$dir/pp2_cp2_gpipe.log"
same_losses one pp2_cp2_gpipe
run 1 --layers 4 --steps 6 --dir "$dir/one4" --export "$dir/one4/model" > "$dir/one4.log"
for schedule in interleaved_1f1b interleaved_zero_bubble zbv dualpipev; do
  run 4 --layers 4 --pp 2 --schedule "$schedule" --microbatches 4 --steps 6 --dir "$dir/pp2_$schedule" \
    > "$dir/pp2_$schedule.log"
  same_losses one4 "pp2_$schedule"
done
# pp 2 x tp 2: each stage split by the tp plan (sequence parallelism: the hidden states between stages split along
# the sequence, the norms' partial gradients summed by the stage's step), 1F1B at 2 layers, ZBV with --recompute
# at 4.
run 4 --pp 2 --tp 2 --schedule 1f1b --microbatches 2 --steps 6 --dir "$dir/pp2_tp2" > "$dir/pp2_tp2.log"
same_losses one pp2_tp2
run 4 --layers 4 --pp 2 --tp 2 --schedule zbv --microbatches 4 --recompute --steps 6 --dir "$dir/pp2_tp2_zbv" \
  --export "$dir/pp2_tp2_zbv/model" > "$dir/pp2_tp2_zbv.log"
same_losses one4 pp2_tp2_zbv
# HSDP per stage on 8 processes: pp 2 x mp_replicate 2 x mp_shard 2, each stage's units sharded along mp_shard and
# replicated along mp_replicate (the reduce-scatter after the last micro-batch, then the all-reduce across replicas).
run 8 --pp 2 --mp-replicate 2 --mp-shard 2 --schedule 1f1b --microbatches 2 --steps 6 --dir "$dir/pp2_hsdp_8" \
  > "$dir/pp2_hsdp_8.log"
same_losses one pp2_hsdp_8
# bf16 autocast in each stage's forward: against one process under bf16 (the micro-batches' other matmul shapes
# round otherwise; dp 4 under bf16 differs from one process by about as much, 4e-5).
run 1 --mixed-precision bf16 --steps 6 --dir "$dir/one_bf16" > "$dir/one_bf16.log"
run 4 --pp 2 --schedule 1f1b --microbatches 2 --mixed-precision bf16 --steps 6 --dir "$dir/pp2_bf16" \
  > "$dir/pp2_bf16.log"
same_losses one_bf16 pp2_bf16 2e-4
# Exports: whole tensors under Hugging Face's names, each piece gathered (and under pp each tensor sent by its
# stage): one process's weights (the same sums in another order). Read without torch (the 1.13 leg's Python may
# have none): safetensors is a JSON header.
same_weights() {  # REFERENCE NAME: NAME's export against REFERENCE's
  python3 - "$dir/$1/model/model.safetensors" "$dir/$2/model/model.safetensors" "$2" <<'PY'
import array, json, struct, sys
def read(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (name, t["dtype"])
        out[name] = (t["shape"], array.array("f", body[t["data_offsets"][0]:t["data_offsets"][1]]))
    return out
one, other = read(sys.argv[1]), read(sys.argv[2])
assert one.keys() == other.keys(), sorted(set(one) ^ set(other))
worst = 0.0
for name, (shape, values) in one.items():
    assert other[name][0] == shape, (name, other[name][0], shape)
    worst = max(worst, max(abs(a - b) for a, b in zip(values, other[name][1])))
print(f"llama_check: {sys.argv[3]}'s export equals one process's weights ({len(one)} tensors): largest difference {worst:.3g}")
assert worst <= 1e-4, worst
PY
}
same_weights one tp2_dp2_recompute
same_weights one pp2_1f1b
same_weights one4 pp2_tp2_zbv
# --import under pp: each stage reads its own tensors from one process's export, and trains as one process does
# from it.
run 1 --steps 6 --import "$dir/one/model" --dir "$dir/one_imported" > "$dir/one_imported.log"
run 4 --pp 2 --tp 2 --schedule 1f1b --microbatches 2 --steps 6 --import "$dir/one/model" --dir "$dir/pp2_imported" \
  > "$dir/pp2_imported.log"
same_losses one_imported pp2_imported
# Tensor parallelism's memory: each process holds 1/tp of the parameters (and of AdamW's state), but the norms.
python3 - "$dir/tp4.log" <<'PY'
import re, sys
mine, whole = map(int, re.search(r"tp 4 - (\d+) of the (\d+) parameters", open(sys.argv[1]).read()).groups())
print(f"llama_check: tp 4 holds {mine} of {whole} parameters per process ({mine / whole:.4f}; 1/4 = 0.25)")
assert whole / 4 <= mine <= whole / 4 * 1.05, (mine, whole)
PY

# 2. Stopped mid-epoch and resumed (an epoch is about 760 steps here), HSDP with cp, and with checkpointing.
hsdp=(--mp-replicate 2 --mp-shard 2 --dp 2 --cp 2 --steps 8)
run 4 "${hsdp[@]}" --dir "$dir/straight" --export "$dir/straight/model" > "$dir/straight.log"
run 4 "${hsdp[@]}" --dir "$dir/resumed" --stop-after 3 | tee "$dir/stopped.log"
grep -q "stopped after 3 steps" "$dir/stopped.log"
run 4 "${hsdp[@]}" --dir "$dir/resumed" --resume --export "$dir/resumed/model" > "$dir/resumed.log"
cmp "$dir/straight/model/model.safetensors" "$dir/resumed/model/model.safetensors"
test "$(wc -l < "$dir/resumed/logs/metrics.csv")" = 9  # the header and steps 1-8, the resumed run appending
run 4 "${hsdp[@]}" --dir "$dir/recomputed" --recompute --export "$dir/recomputed/model" > "$dir/recomputed.log"
cmp "$dir/straight/model/model.safetensors" "$dir/recomputed/model/model.safetensors"
# (and FSDP + TP: each process saves its shards of its tensor-parallel pieces, and resumes from them)
fsdp_tp=(--tp 2 --mp-shard 2 --steps 6)
run 4 "${fsdp_tp[@]}" --dir "$dir/tp_straight" --export "$dir/tp_straight/model" > "$dir/tp_straight.log"
run 4 "${fsdp_tp[@]}" --dir "$dir/tp_resumed" --stop-after 2 > "$dir/tp_stopped.log"
grep -q "stopped after 2 steps" "$dir/tp_stopped.log"
cp -r "$dir/tp_resumed" "$dir/tp_moved"
run 4 "${fsdp_tp[@]}" --dir "$dir/tp_resumed" --resume --export "$dir/tp_resumed/model" > "$dir/tp_resumed.log"
cmp "$dir/tp_straight/model/model.safetensors" "$dir/tp_resumed/model/model.safetensors"
# ... and resumed at tp 4 (another layout: the pieces and AdamW's state cut again): the same losses.
run 4 "${fsdp_tp[@]}" --tp 4 --mp-shard 1 --dir "$dir/tp_moved" --resume > "$dir/tp_moved.log"
python3 - "$dir/tp_straight/logs/metrics.csv" "$dir/tp_moved/logs/metrics.csv" "$LOSS_TOLERANCE" <<'PY'
import csv, sys
straight, moved = ([float(r["loss"]) for r in csv.DictReader(open(p))] for p in sys.argv[1:3])
worst = max(abs(a - b) / abs(a) for a, b in zip(straight, moved))
print(f"llama_check: tp 2 x mp_shard 2 stopped after 2 steps, resumed at tp 4: largest relative loss difference {worst:.3g}")
assert len(straight) == len(moved) == 6 and worst <= float(sys.argv[3]), (straight, moved)
PY
# (and a pipeline: 1F1B at pp 2 x dp 2 under FULL_SHARD, each process saving its stage's shards under the whole
# model's names; resumed in the same layout, the same weights byte for byte; resumed as ZBV over 4 stages under
# NO_SHARD, and without a pipeline at dp 4, the same losses)
pp=(--layers 4 --pp 2 --microbatches 4 --steps 6)
run 4 "${pp[@]}" --dir "$dir/pp_straight" --export "$dir/pp_straight/model" > "$dir/pp_straight.log"
run 4 "${pp[@]}" --dir "$dir/pp_resumed" --stop-after 2 > "$dir/pp_stopped.log"
grep -q "stopped after 2 steps" "$dir/pp_stopped.log"
cp -r "$dir/pp_resumed" "$dir/pp_moved"
cp -r "$dir/pp_resumed" "$dir/pp_flat"
run 4 "${pp[@]}" --dir "$dir/pp_resumed" --resume --save-every 6 --export "$dir/pp_resumed/model" \
  > "$dir/pp_resumed.log"
cmp "$dir/pp_straight/model/model.safetensors" "$dir/pp_resumed/model/model.safetensors"
run 4 "${pp[@]}" --schedule zbv --sharding no_shard --dir "$dir/pp_moved" --resume > "$dir/pp_moved.log"
run 4 --layers 4 --steps 6 --dir "$dir/pp_flat" --resume > "$dir/pp_flat.log"
# (and pp 2 x tp 2, ZBV: each process saves its tensor-parallel pieces of its two stages; resumed, the uninterrupted
# run's weights byte for byte (pp2_tp2_zbv above); resumed as 1F1B at tp 1, the same losses)
pp_tp=(--layers 4 --pp 2 --tp 2 --schedule zbv --microbatches 4 --recompute --steps 6)
run 4 "${pp_tp[@]}" --dir "$dir/pp_tp_resumed" --stop-after 2 > "$dir/pp_tp_stopped.log"
cp -r "$dir/pp_tp_resumed" "$dir/pp_tp_moved"
run 4 "${pp_tp[@]}" --dir "$dir/pp_tp_resumed" --resume --export "$dir/pp_tp_resumed/model" > "$dir/pp_tp_resumed.log"
cmp "$dir/pp2_tp2_zbv/model/model.safetensors" "$dir/pp_tp_resumed/model/model.safetensors"
run 4 --layers 4 --pp 2 --microbatches 4 --steps 6 --dir "$dir/pp_tp_moved" --resume > "$dir/pp_tp_moved.log"
python3 - "$LOSS_TOLERANCE" "$dir/pp_straight" "$dir/pp_moved" "$dir/pp_straight" "$dir/pp_flat" \
  "$dir/pp2_tp2_zbv" "$dir/pp_tp_moved" <<'PY'
import csv, sys
losses = lambda run: [float(r["loss"]) for r in csv.DictReader(open(run + "/logs/metrics.csv"))]
runs = sys.argv[2:]
for straight, moved in zip(runs[::2], runs[1::2]):
    a, b = losses(straight), losses(moved)
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"llama_check: {moved.split('/')[-1]} (stopped after 2 steps, resumed in another layout) against "
          f"{straight.split('/')[-1]}: largest relative loss difference {worst:.3g}")
    assert len(a) == len(b) == 6 and worst <= float(sys.argv[1]), (a, b)
PY
echo "llama_check: stopped after 3 steps (2 under tp 2 x mp_shard 2, pp 2 and pp 2 x tp 2) and resumed, and with activation checkpointing: the same weights, byte for byte"

# 3. Refused before any step.
refused() {
  local want=$1; shift
  if "$@" > "$dir/refused.log" 2>&1; then echo "llama_check: accepted: $*"; exit 1; fi
  grep -q -- "$want" "$dir/refused.log" || { cat "$dir/refused.log"; exit 1; }
  if grep -q "step " "$dir/refused.log"; then echo "llama_check: a step ran before the error"; exit 1; fi
  echo "llama_check: refused as expected: $want"
}
refused "Ulysses over --cp 4 splits the heads: --heads 8 and --kv-heads 2 must both be multiples of 4" run 4 --steps 2 --dir "$dir/bad" --dp 1 --cp 4 --kv-heads 2
refused "is not a multiple of --cp 4" run 4 --steps 2 --dir "$dir/bad" --dp 1 --cp 4 --seq 30
refused "mp_replicate_size" run 4 --steps 2 --dir "$dir/bad" --mp-replicate 3
refused "--tp 4 splits the heads: --heads 8 and --kv-heads 2 must both be multiples of 4" \
  run 4 --steps 2 --dir "$dir/bad" --tp 4 --kv-heads 2
refused "--layers 2 over 4 stages leaves a stage without a layer" run 4 --steps 2 --dir "$dir/bad" --pp 2 --schedule zbv
refused "do not cut into --microbatches 3" run 4 --steps 2 --dir "$dir/bad" --pp 2 --microbatches 3
refused "2 micro-batches for 4 stages: DualPipeV needs at least as many micro-batches as stages" \
  run 4 --layers 4 --steps 2 --dir "$dir/bad" --pp 2 --schedule dualpipev

# 4. transformers.
if ! python3 -c 'import transformers' 2>/dev/null; then
  echo "llama_check: SKIP the transformers checks: no transformers in this Python (the pip leg has it)"
  exit 0
fi
"$train" --seq 32 --import "$dir/straight/model" --logits "$dir/straight/logits.bin"
python3 "$here/python_ref/llama_check.py" compare "$dir/straight/model" 32 "$dir/straight/logits.bin"
# (and FSDP + TP's export: whole tensors transformers loads)
"$train" --seq 32 --import "$dir/tp2_dp2_recompute/model" --logits "$dir/tp2_dp2_recompute/logits.bin"
python3 "$here/python_ref/llama_check.py" compare "$dir/tp2_dp2_recompute/model" 32 "$dir/tp2_dp2_recompute/logits.bin"
# (and a pipeline's export, pp 2 x tp 2 over four stages: the whole model transformers loads)
"$train" --seq 32 --import "$dir/pp2_tp2_zbv/model" --logits "$dir/pp2_tp2_zbv/logits.bin"
python3 "$here/python_ref/llama_check.py" compare "$dir/pp2_tp2_zbv/model" 32 "$dir/pp2_tp2_zbv/logits.bin"
# (and the pipeline's checkpoint, saved after the resumed run's last step: Python's dcp.load reads the stages'
# pieces into transformers' model as one, each tensor the export's)
python3 "$here/python_ref/llama_check.py" dcp "$dir/pp_resumed/checkpoint" "$dir/pp_resumed/model"
python3 "$here/python_ref/llama_check.py" make "$dir/python" 32
# (and greedy decoding from it: transformers' tokens. Its random weights give varied tokens, so every step of the
# cache counts; 8 steps of training here give spaces only. The smallest margin between the best two logits is
# printed: 1e-3 here, against differences of about 1e-7 between the two libraries' logits.)
"$train" --import "$dir/python" --generate "The quick brown " --max-new-tokens 32 | tee "$dir/generated.log"
python3 "$here/python_ref/llama_check.py" generate "$dir/python" "The quick brown " 32 "$dir/generated.log"
"$train" --seq 32 --import "$dir/python" --logits "$dir/python/logits.bin"
python3 "$here/python_ref/llama_check.py" compare "$dir/python" 32 "$dir/python/logits.bin"
