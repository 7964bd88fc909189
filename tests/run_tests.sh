#!/usr/bin/env bash
# Installs what is missing, builds everything and runs the test suite on the
# three LibTorch builds CI proves (README: Supported LibTorch versions):
#   pip   PyPI's torch wheel (the newest release, a CUDA build, pinned in
#         tests/pip/requirements.txt) in a virtual environment under the build
#         directory, re-used while its pins are the same (tests/pip/leg.sh),
#         g++ 12: every entry (nested sanitizer and consumer builds, the NCCL
#         path, libuv, torchrun, the Python references) but those the 1.13
#         leg runs.
#   1.13  Debian bookworm's libtorch-dev on this machine, g++ 12: what only it
#         proves: the quick suites on the oldest supported LibTorch (with
#         mpirun, two hosts, the sampler against Python 1.13), built at
#         Release's -O3 as users build them, the header copied alone, and
#         clang 14's fuzzers; and the checks no LibTorch version changes,
#         cheapest on its smaller headers: every part compiled alone, the
#         compile-failure cases, the diagnostics kept out of line, and a
#         user's -Werror build (GCC 12).
#   2.6   Debian trixie's libtorch-dev in a root made once under the build
#         directory and re-used (tests/trixie/make_root.sh, ~4 min, ~2 GB):
#         g++ 14 (the quick suites, a user's -Werror build) and clang 19's
#         -Werror check of every translation unit (tests/clang_check.sh).
# The pip and 2.6 legs build the test binaries at -Og: code generation is
# most of their compile time (a test file: 181 s at -O3, 119 at -O1, 90 at
# -Og, g++ 12), the suites spend theirs in LibTorch, and CI must stay within
# its hour. The 1.13 leg keeps -O3, the probes of a user's build (werror_,
# diagnostics_) and the benchmarks are -O3 on every leg, and the sanitizer
# build is -O0.
# ACCEL_LEGS="pip", "1.13" or "2.6" (or several) runs those legs; arguments go
# to ctest instead of each leg's own selection (e.g. -L quick).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ACCEL_BUILD_DIR:-$root/build}
legs=${ACCEL_LEGS:-1.13 pip 2.6}  # (1.13 first: the others' setup runs beside it, below)
status=0
report=()
begin=$(date +%s)
bash "$root/.ci/install-deps.sh"
mkdir -p "$build"
# The pip leg's virtual environment and the 2.6 leg's root are mostly
# downloading and unpacking (3 and 2 minutes on a fresh machine): they are
# made in the background while the legs before them build and run (the
# 1.13 leg first), each into a log shown when its leg starts. A failed one
# is tried again by its leg, in the foreground. At the lowest CPU and disk
# priority: unpacking is CPU work, and at normal priority it slowed the 1.13
# leg's build by about as much as it saved (a fresh clone: the 1.13 leg's
# build took 756 s beside them against ~390 s alone); the leg that needs one
# waits for what is left of it.
declare -A preparing=() prepare_log=()
prepare() {  # LEG COMMAND...
  local leg=$1
  shift
  [[ " $legs " == *" $leg "* ]] || return 0
  prepare_log[$leg]=$build/prepare-$leg.log
  nice -n 19 ionice -c 3 "$@" >"${prepare_log[$leg]}" 2>&1 &
  preparing[$leg]=$!
}
prepared() {  # LEG: waits for its preparation and shows its log
  local leg=$1
  [[ -n ${preparing[$leg]:-} ]] || return 0
  wait "${preparing[$leg]}" || echo "== preparing the $leg leg failed; its leg tries again:"
  cat "${prepare_log[$leg]}"
  unset "preparing[$leg]"
}
prepare pip bash "$root/tests/pip/make_venv.sh" "$build/pip-venv"
prepare 2.6 bash "$root/tests/trixie/make_root.sh" "$build/trixie-root"
for leg in $legs; do
  prepared "$leg"
  start=$(date +%s)
  case $leg in
    pip)
      bash "$root/tests/pip/leg.sh" "$build" "$@" || status=1 ;;
    1.13)
      echo "== LibTorch 1.13, $(g++ --version | head -1)"
      cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DACCEL_BUILD_BENCHMARKS=OFF
      cmake --build "$build" -j2
      if (($#)); then
        (cd "$build" && ctest --output-on-failure -j2 --timeout 900 "$@") || status=1
      else
        # The quick entries and the nested ones above but the sanitizer and
        # consumer builds (the pip leg's), in one run: two runs, one after
        # the other, each ended with a processor idle while its last entries
        # finished. The sharded examples run on the pip leg (their strategies
        # are the ranks suites' here).
        (cd "$build" && ctest --output-on-failure -j2 --timeout 900 -L '^(quick|nested)$' \
          -E '^(asan_|consumer_|example_train_mlp_sharded_4$|example_train_mlp_full_shard_4$)') || status=1
      fi ;;
    2.6)
      bash "$root/tests/trixie/make_root.sh" "$build/trixie-root"
      bash "$root/tests/trixie/in_root.sh" "$build/trixie-root" bash tests/trixie/leg.sh "$build" "$@" || status=1 ;;
    *) echo "unknown leg '$leg' (pip, 1.13 or 2.6)" >&2; exit 2 ;;
  esac
  report+=("LibTorch $leg leg: $(( $(date +%s) - start )) s")
done
report+=("all: $(( $(date +%s) - begin )) s")
printf '== %s\n' "${report[@]}"
exit $status
