#!/usr/bin/env bash
# Installs what is missing, builds the mesh demo and runs it on 4 local ranks.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${ACCEL_BUILD_DIR:-$root/build}
bash "$root/.ci/install-deps.sh"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j2 --target mesh_demo accel_launch
"$build/tests/accel_launch" --timeout 120 4 "$build/examples/mesh_demo" "$@"
