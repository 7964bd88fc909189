# Sourced by the tests/bench/run_*.sh scripts: paths, the build, the CSV and
# the launcher they share.
#   bench_prepare CSV_NAME "PACKAGES" TARGET...   installs PACKAGES (and what the
#       build needs), builds TARGET... and accel_launch, starts $out/CSV_NAME
#   run NPROCS PROGRAM [ARGS...]   runs NPROCS ranks, appends rank 0's CSV lines
#       (and every rank's TIMELINE lines to $timeline_csv, NAME_timeline.csv,
#       removed at the end if none came);
#       a run that exits non-zero (a reference that fails, a rank that dies)
#       is reported, then and again at the end, and the benchmark goes on;
#       ACCEL_BENCH_TIMEOUT (seconds, default 900) ends a run that stops
#       progressing (a reference rank that spins) and counts it as failed
#   $python   the Python the references run on: Debian's python3-torch (1.13
#       here, 2.6 in the trixie root), or with ACCEL_BENCH_LEG=pip the pip
#       leg's venv (tests/pip/make_venv.sh), whose LibTorch the benchmark
#       is then built against (in build/bench-pip; results in
#       tests/bench/results/pip)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=/usr/bin/python3
if [[ ${ACCEL_BENCH_LEG:-} == pip ]]; then
  bash "$root/tests/pip/make_venv.sh" "$root/build/pip-venv"
  export PATH="$root/build/pip-venv/bin:$PATH"
  CMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  export CMAKE_PREFIX_PATH
  python=$root/build/pip-venv/bin/python3
  export ACCEL_BUILD_DIR=${ACCEL_BUILD_DIR:-$root/build/bench-pip}
  export ACCEL_BENCH_OUT=${ACCEL_BENCH_OUT:-$root/tests/bench/results/pip}
fi
build=${ACCEL_BUILD_DIR:-$root/build}
out=${ACCEL_BENCH_OUT:-$root/tests/bench/results}
launch=$build/tests/accel_launch
# Python's env:// store asks for libuv unless told otherwise; Debian's torch 2.6
# has none (1.13 ignores the variable). accel.hpp reads it the same way.
export USE_LIBUV=0

bench_prepare() {
  local name=$1 packages=$2
  shift 2
  # shellcheck disable=SC2086  # a list of package names
  bash "$root/.ci/install-deps.sh" $packages
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$build" -j2 --target "$@" accel_launch
  mkdir -p "$out"
  csv=$out/$name
  echo "part,world,variant,size,value,unit" >"$csv"
  timeline_csv=$out/${name%.csv}_timeline.csv  # (TIMELINE lines, every rank's: bench_sharding.cpp's)
  echo "world,variant,rank,bucket,bytes,ready,issued,waiting,landed,forward_ms,backward_ms,finish_began" >"$timeline_csv"
}

# Keep rank 0's CSV lines; show progress on stderr.
failed_runs=()
run() {
  echo "== $*" >&2
  if ! "$launch" --timeout "${ACCEL_BENCH_TIMEOUT:-900}" "$@" |
    awk -v timeline="$timeline_csv" '
      /^\[rank [0-9]+\] TIMELINE,/ { sub(/^\[rank [0-9]+\] TIMELINE,/, ""); print >> timeline; next }
      /^\[rank 0\] CSV,/ { sub(/^\[rank 0\] CSV,/, ""); print; fflush() }' | tee -a "$csv" >&2; then
    echo "!! exited non-zero (its rows so far are kept; going on): $*" >&2
    failed_runs+=("$*")
  fi
}
report_failed_runs() {
  ((${#failed_runs[@]})) || return 0
  echo "!! ${#failed_runs[@]} run(s) exited non-zero; their figures are missing or partial:" >&2
  printf '!!   %s\n' "${failed_runs[@]}" >&2
}
# A benchmark whose runs printed no TIMELINE line leaves no timeline file.
drop_empty_timeline() {
  if [[ -n ${timeline_csv:-} && -f $timeline_csv && $(wc -l <"$timeline_csv") -le 1 ]]; then rm -f "$timeline_csv"; fi
}
trap 'report_failed_runs; drop_empty_timeline' EXIT
