#!/usr/bin/env bash
# examples/train_mlp on WORLD ranks: trains 2 epochs, checkpoints, exports
# its weights as safetensors and lowers the loss; a run stopped after STOP batches (mid-epoch) and resumed from its
# checkpoint ends with the same weights, bit for bit (the same checksum); and
# a finished run resumed for one more epoch with another accumulation still
# lowers the loss.
#     bash tests/resume_check.sh ACCEL_LAUNCH TRAIN_MLP WORLD DIR STOP [TRAIN_MLP FLAGS...]
set -euo pipefail
launch=$1 train=$2 world=$3 dir=$4 stop=$5
shift 5
flags=("$@")  # e.g. --sharding shard_grad_op, given to every run
rm -rf "$dir" && mkdir -p "$dir"
# One thread per process: bit for bit needs the same sums in the same order in every run, and a BLAS with
# dynamic threading (the pip wheel's MKL) may take fewer threads when the machine is busy (CI runs suites side by
# side): once, two identical uninterrupted runs differed at step 60 (loss 0.1007 against 0.1006).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
run() { "$launch" --timeout 240 "$world" "$train" "${flags[@]}" "$@"; }
checksum() { sed -n 's/^\[rank 0\] train_mlp: weights checksum \([0-9a-f]*\)$/\1/p' "$1"; }

run --epochs 2 --checkpoint "$dir/straight" --export "$dir/weights" | tee "$dir/straight.log"
grep -q 'samples/s' "$dir/straight.log"
test -s "$dir/straight/model.pt" && test -s "$dir/straight/loaders.pt"
test -s "$dir/straight/optimizer.pt" || test -s "$dir/straight/optimizer_rank0.pt"  # one per process, sharded
test -s "$dir/weights/model.safetensors"

run --epochs 2 --checkpoint "$dir/resumed" --stop-after "$stop" | tee "$dir/stopped.log"
grep -q "stopped after $stop batches" "$dir/stopped.log"
run --epochs 2 --checkpoint "$dir/resumed" --resume | tee "$dir/resumed.log"
straight=$(checksum "$dir/straight.log") resumed=$(checksum "$dir/resumed.log")
echo "uninterrupted $straight, stopped after $stop batches and resumed $resumed"
test -n "$straight" && test "$straight" = "$resumed"

run --epochs 3 --accumulate 2 --checkpoint "$dir/straight" --resume
