#!/usr/bin/env bash
# Installs what is missing, builds everything and runs the whole test suite,
# on both LibTorch versions CI proves:
#   1.13  Debian bookworm's libtorch-dev on this machine, g++ 12: every entry.
#   2.6   Debian trixie's libtorch-dev in a root made once under the build
#         directory and re-used (tests/trixie/make_root.sh, ~4 min, ~2 GB),
#         with g++ 14 (every entry) and clang 19 (-Werror; the quick suites).
# ACCEL_LEGS="1.13" or "2.6" runs one leg; arguments go to ctest (e.g. -L quick).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ACCEL_BUILD_DIR:-$root/build}
legs=${ACCEL_LEGS:-1.13 2.6}
status=0
report=()
bash "$root/.ci/install-deps.sh"
for leg in $legs; do
  start=$(date +%s)
  case $leg in
    1.13)
      echo "== LibTorch 1.13, $(g++ --version | head -1)"
      cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
      cmake --build "$build" -j2
      (cd "$build" && ctest --output-on-failure -j2 --timeout 900 "$@") || status=1 ;;
    2.6)
      bash "$root/tests/trixie/make_root.sh" "$build/trixie-root"
      bash "$root/tests/trixie/in_root.sh" "$build/trixie-root" bash tests/trixie/leg.sh "$build" "$@" || status=1 ;;
    *) echo "unknown leg '$leg' (1.13 or 2.6)" >&2; exit 2 ;;
  esac
  report+=("LibTorch $leg leg: $(( $(date +%s) - start )) s")
done
printf '== %s\n' "${report[@]}"
exit $status
