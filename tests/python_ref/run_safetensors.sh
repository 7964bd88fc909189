#!/usr/bin/env bash
# Weights between C++ and Python through safetensors: the C++ side writes a
# model (one file, and sharded) and its outputs; Python (safetensors and torch)
# loads them into the same architecture and must give the same outputs, then
# writes a model of its own, which the C++ side loads and must give Python's
# outputs. Skipped (77) where Python has no safetensors (bookworm). Where it
# has transformers (the pip leg), a tied GPT-2-shaped model goes the same way
# in GPT-2's layout: C++ to GPT2LMHeadModel.from_pretrained and save_pretrained
# back to C++ (a state-dict adapter on the C++ side).
#
#     run_safetensors.sh TEST_BINARY
set -euo pipefail
binary=${1:?usage: run_safetensors.sh TEST_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
if ! python3 -c 'import safetensors.torch, torch' 2>/dev/null; then
  echo "SKIP: no Python safetensors here (Debian has python3-safetensors from trixie on)"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
export ACCEL_SAFETENSORS_DIR=$out
gpt2=()
if python3 -c 'import transformers' 2>/dev/null; then
  export ACCEL_SAFETENSORS_GPT2=1
  gpt2=(--gpt2)
else
  echo "safetensors_python: no transformers here: the GPT-2 layout is checked on the pip leg"
fi
"$binary" --no-skip -ts=python_safetensors -tc='write*' --no-intro=true
python3 "$here/safetensors_check.py" "$out" "${gpt2[@]}"
"$binary" --no-skip -ts=python_safetensors -tc='read*' --no-intro=true
