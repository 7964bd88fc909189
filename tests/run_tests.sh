#!/usr/bin/env bash
# Installs what is missing, builds everything and runs the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ACCEL_BUILD_DIR:-$root/build}
bash "$root/.ci/install-deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j2
cd "$build"
ctest --output-on-failure -j2 --timeout 600
