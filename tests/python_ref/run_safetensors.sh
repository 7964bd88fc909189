#!/usr/bin/env bash
# Weights between C++ and Python through safetensors: the C++ side writes a
# model (one file, and sharded) and its outputs; Python (safetensors and torch)
# loads them into the same architecture and must give the same outputs, then
# writes a model of its own, which the C++ side loads and must give Python's
# outputs. Skipped (77) where Python has no safetensors (bookworm).
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
"$binary" --no-skip -ts=python_safetensors -tc='write*' --no-intro=true
python3 "$here/safetensors_check.py" "$out"
"$binary" --no-skip -ts=python_safetensors -tc='read*' --no-intro=true
