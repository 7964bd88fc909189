#!/usr/bin/env bash
# Checkpoints loaded by another number of processes, the suite
# checkpoint_resize of the test program, whose saving run records what each
# loading run must match (parameters, RNG draws, the samples after the saved
# place, the step after it):
#   a whole model (NO_SHARD) saved by 2 processes, loaded by 1, 3 and 4 with
#   the same global batch, by 3 with another, and by 4 under FULL_SHARD
#   (its optimizer state cut into pieces);
#   a FULL_SHARD model saved by 4 (its optimizer state in 4 pieces), loaded
#   by 2 under SHARD_GRAD_OP, by 1 (whole) and by 3 under FULL_SHARD
#   (pieces that straddle the saved ones);
#   a HYBRID_SHARD model saved by 4 (2 replicas of 2 pieces: process k holds
#   piece k mod 2), loaded by 3 under FULL_SHARD;
#   the FULL_SHARD checkpoint saved again by a run whose main process dies at
#   each step of the save (exchange and two-rename paths), then loaded by 4
#   (the saved state, no leftovers);
#   a model saved by 1 process, loaded by 4 under FULL_SHARD.
# Each sharded save writes each process's pieces of the model, which
# Python's torch.distributed.checkpoint (HuggingFaceStorageReader with
# safetensors: the pip leg's torch) also loads, at 1 and 2 processes
# (tests/python_ref/dcp_check.py); elsewhere that check says it is skipped.
# ACCEL_RESIZE_SAVE / ACCEL_RESIZE_LOAD: the strategy of either run.
#     bash tests/resize_check.sh ACCEL_LAUNCH ACCEL_TESTS
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
launch=${1:?usage: resize_check.sh ACCEL_LAUNCH ACCEL_TESTS} tests=${2:?usage: resize_check.sh ACCEL_LAUNCH ACCEL_TESTS}
ACCEL_RESIZE_DIR=$(mktemp -d)
export ACCEL_RESIZE_DIR
kept=$(mktemp -d)  # saves kept for Python's DCP (keep_for_python)
trap 'rm -rf "$ACCEL_RESIZE_DIR" "$kept"' EXIT
suite=(--no-skip -ts=checkpoint_resize --no-intro=true)
# Saves on $1 processes (the strategy in ACCEL_RESIZE_SAVE), replacing the last checkpoint.
save() {
  echo "== saved by $1 processes (${ACCEL_RESIZE_SAVE:-no_shard})"
  rm -rf "${ACCEL_RESIZE_DIR:?}"/*
  "$launch" --timeout 120 "$1" "$tests" "${suite[@]}" -tc='save*'
}
# Loads on $1 processes; its output in full where it fails.
load() {
  local out
  echo "== loaded by $1 (${ACCEL_RESIZE_LOAD:-no_shard}${ACCEL_RESIZE_BATCH:+, $ACCEL_RESIZE_BATCH samples per process})"
  if ! out=$("$launch" --timeout 120 "$1" "$tests" "${suite[@]}" -tc='load*' -s 2>&1); then
    echo "$out"
    exit 1
  fi
  grep -E "processes after|test cases" <<<"$out"
}
# A run that loads the checkpoint and saves it again, its main process dying at step $1 of the save
# (ACCEL_RESIZE_RENAMES: on the two-rename path). Only "exchanged" may be a step the save never reaches
# (a filesystem that cannot exchange two directories); it says so.
crash() {
  local out
  echo "== saved again by 4 processes (${ACCEL_RESIZE_SAVE:-no_shard}), the main one killed at \"$1\""
  if out=$(ACCEL_RESIZE_CRASH=$1 "$launch" --timeout 120 4 "$tests" "${suite[@]}" -tc='crash*' -s 2>&1); then
    if [[ $1 == exchanged ]] && grep -q "no step" <<<"$out"; then
      echo "   (this filesystem cannot exchange: the two-rename steps below stand for it)"
      return 0
    fi
    echo "$out"
    echo "!! the run that was to die finished"
    exit 1
  fi
}
# Python's DCP loads sharded saves on 1 and 2 processes: equal to the model gathered. Where Python's
# torch is 2.7 or newer, its HuggingFaceStorageReader and safetensors must be there. keep_for_python
# copies the last save aside (the next save replaces it); python_loads checks those and the last save,
# one start of Python per number of processes.
dcp_reader=$(python3 -c '
import sys, torch
try:
    import safetensors, torch.distributed.checkpoint as dcp
    dcp.HuggingFaceStorageReader
    print("yes")
except (ImportError, AttributeError) as e:
    print("no" if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 7) else "broken: %s" % e)
' 2>/dev/null || echo no)
for_python=()
keep_for_python() {  # NAME
  mkdir "$kept/$1"
  cp -r "$ACCEL_RESIZE_DIR/checkpoint" "$ACCEL_RESIZE_DIR/whole" "$kept/$1/"
  for_python+=("$kept/$1/checkpoint" "$kept/$1/whole")
}
python_loads() {
  case $dcp_reader in
    yes) ;;
    no) echo "== Python's DCP: skipped (no torch >= 2.7 with safetensors here)" && return 0 ;;
    *) echo "!! Python's torch is 2.7 or newer, yet: $dcp_reader" && exit 1 ;;
  esac
  local world
  for world in 1 2; do
    OMP_NUM_THREADS=1 "$launch" --timeout 120 "$world" python3 "$here/python_ref/dcp_check.py" \
      "${for_python[@]}" "$ACCEL_RESIZE_DIR/checkpoint" "$ACCEL_RESIZE_DIR/whole"
  done
}
save 2
for world in 1 3 4; do load "$world"; done
ACCEL_RESIZE_BATCH=6 load 3  # a global batch of 18, not 12
ACCEL_RESIZE_LOAD=full_shard load 4
ACCEL_RESIZE_SAVE=full_shard save 4
keep_for_python full_shard
ACCEL_RESIZE_LOAD=shard_grad_op load 2
# (every step of the save protocol, both paths; checkpoint/files.hpp)
for step in "files written" "manifest written" "exchanged" renames:"between renames" renames:renamed; do
  renames=
  [[ $step == renames:* ]] && renames=1 step=${step#renames:}
  ACCEL_RESIZE_RENAMES=$renames ACCEL_RESIZE_SAVE=full_shard crash "$step"
  ACCEL_RESIZE_LOAD=full_shard load 4
done
load 1
ACCEL_RESIZE_LOAD=full_shard load 3
ACCEL_RESIZE_SAVE=hybrid_shard save 4
python_loads
ACCEL_RESIZE_LOAD=full_shard load 3
save 1
ACCEL_RESIZE_LOAD=full_shard load 4
