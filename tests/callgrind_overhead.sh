#!/usr/bin/env bash
# Instructions per accel::all_reduce of one float against the raw c10d call
# (allreduce()->wait()) at world size 1, counted by callgrind between the
# bench's toggles: deterministic, so a budget can be a test. Prints the two
# counts as CSV lines (for tests/bench/run_bench.sh) and the ratio; fails
# above ACCEL_CALLGRIND_LIMIT (1.02). Gloo's waits poll, so a loaded machine
# adds instructions to both sides: each count is the least of three runs,
# and CTest runs this entry alone (RUN_SERIAL).
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

count() {  # VARIANT [PRELOAD] -> instructions in the loop
  local variant=$1 preload=${2:-}
  env -u RANK -u WORLD_SIZE RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 ACCEL_STORE_DIR="$work" \
    ${preload:+LD_PRELOAD=$preload} \
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/out.$variant" \
    "$bench" callgrind "$variant" "$calls" >"$work/log" 2>&1 || true
  sed -n 's/^totals: *//p' "$work/out.$variant" 2>/dev/null | awk '$1 > 0 {print $1}'
}

preload=
total=$(count raw)
if [[ -z $total ]] && grep -q "Unrecognised instruction" "$work/log" && grep -q "libhwy" "$work/log"; then
  # Debian bookworm's libhwy (a dependency of its LibTorch) times itself with
  # RDTSCP in a static initialiser, which valgrind cannot run; a shim answers
  # for that one function (it never runs inside the counted loop).
  printf '#include <cstdint>\nnamespace hwy::platform { uint64_t TimerResolution() { return 1; } }\n' >"$work/hwy.cpp"
  "$cxx" -shared -fPIC -O2 -o "$work/libhwy_shim.so" "$work/hwy.cpp"
  preload=$work/libhwy_shim.so
  total=$(count raw "$preload")
fi
if [[ -z $total ]]; then
  echo "callgrind did not run the bench:" >&2
  cat "$work/log" >&2
  exit 1
fi
least() {  # RUNS VARIANT [PRELOAD] -> the least count of RUNS runs
  local best= runs=$1
  shift
  for ((k = 0; k < runs; ++k)); do
    local n
    n=$(count "$@")
    [[ -n $n ]] || { cat "$work/log" >&2; exit 1; }
    [[ -z $best || $n -lt $best ]] && best=$n
  done
  echo "$best"
}
first=$total  # the run above counts as one of raw's three
total=$(least 2 raw "$preload")
((first < total)) && total=$first
raw=$((total / calls))
total=$(least 3 accel "$preload")
accel=$((total / calls))
echo "CSV,callgrind,1,raw_c10d,4,$raw,instructions"
echo "CSV,callgrind,1,accel_all_reduce,4,$accel,instructions"
ratio=$(awk -v a="$accel" -v r="$raw" 'BEGIN { printf "%.4f", a / r }')
echo "instructions per all_reduce of one float: raw c10d $raw, accel.hpp $accel (+$((accel - raw))), ratio $ratio (budget $limit)"
awk -v x="$ratio" -v l="$limit" 'BEGIN { exit !(x <= l) }' || { echo "over budget" >&2; exit 1; }
