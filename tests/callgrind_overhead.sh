#!/usr/bin/env bash
# Instructions per accel::all_reduce of one float against the raw c10d call
# (allreduce()->wait()) at world size 1, counted by callgrind between the
# bench's toggles: deterministic, so a budget can be a test. Prints the two
# counts as CSV lines (for tests/bench/run_bench.sh) and the ratio; fails
# above ACCEL_CALLGRIND_LIMIT (1.02). Gloo's waits poll, so a loaded machine
# adds instructions to both sides: each count is the least of two runs (one
# run counts both loops, one after the other: tests/bench/bench.cpp's
# callgrind), and CTest runs this entry alone (RUN_SERIAL).
#
#     bash tests/callgrind_overhead.sh ACCEL_BENCH CXX [CALLS]
set -euo pipefail
bench=${1:?usage: callgrind_overhead.sh ACCEL_BENCH CXX [CALLS]}
cxx=${2:?usage: callgrind_overhead.sh ACCEL_BENCH CXX [CALLS]}
calls=${3:-2000}
limit=${ACCEL_CALLGRIND_LIMIT:-1.02}
command -v valgrind >/dev/null || { echo "valgrind is not installed: skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 700 "$work"  # ACCEL_STORE_DIR: a FileStore, no TCP port

count() {  # [PRELOAD] -> "RAW ACCEL": instructions in each loop of one run
  local preload=${1:-}
  rm -f "$work"/out*
  env -u RANK -u WORLD_SIZE RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 ACCEL_STORE_DIR="$work" \
    ${preload:+LD_PRELOAD=$preload} \
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/out" \
    "$bench" callgrind "$calls" >"$work/log" 2>&1 || true
  local raw accel
  raw=$(sed -n 's/^totals: *//p' "$work/out.1" 2>/dev/null | awk '$1 > 0 {print $1}')
  accel=$(sed -n 's/^totals: *//p' "$work/out.2" 2>/dev/null | awk '$1 > 0 {print $1}')
  [[ -n $raw && -n $accel ]] && echo "$raw $accel"
}

preload=
pair=$(count)
if [[ -z $pair ]] && grep -q "Unrecognised instruction" "$work/log" && grep -q "libhwy" "$work/log"; then
  # Debian bookworm's libhwy (a dependency of its LibTorch) times itself with
  # RDTSCP in a static initialiser, which valgrind cannot run; a shim answers
  # for that one function (it never runs inside the counted loop).
  printf '#include <cstdint>\nnamespace hwy::platform { uint64_t TimerResolution() { return 1; } }\n' >"$work/hwy.cpp"
  "$cxx" -shared -fPIC -O2 -o "$work/libhwy_shim.so" "$work/hwy.cpp"
  preload=$work/libhwy_shim.so
  pair=$(count "$preload")
fi
if [[ -z $pair ]]; then
  echo "callgrind did not run the bench:" >&2
  cat "$work/log" >&2
  exit 1
fi
# The least of two runs, each side on its own.
read -r raw_total accel_total <<<"$pair"
pair=$(count "$preload")
[[ -n $pair ]] || { cat "$work/log" >&2; exit 1; }
read -r raw2 accel2 <<<"$pair"
((raw2 < raw_total)) && raw_total=$raw2
((accel2 < accel_total)) && accel_total=$accel2
raw=$((raw_total / calls))
accel=$((accel_total / calls))
echo "CSV,callgrind,1,raw_c10d,4,$raw,instructions"
echo "CSV,callgrind,1,accel_all_reduce,4,$accel,instructions"
ratio=$(awk -v a="$accel" -v r="$raw" 'BEGIN { printf "%.4f", a / r }')
echo "instructions per all_reduce of one float: raw c10d $raw, accel.hpp $accel (+$((accel - raw))), ratio $ratio (budget $limit)"
awk -v x="$ratio" -v l="$limit" 'BEGIN { exit !(x <= l) }' || { echo "over budget" >&2; exit 1; }
