#!/usr/bin/env bash
# Puts the headers that a GPU machine without Debian's packages lacks into
# .gpu/ of the checkout, for tests/gpu/run_gpu.sh there: Gloo's (PyPI's torch
# wheel ships none; accel.hpp reaches Gloo's types only through pointers, so
# another Gloo's headers do) and doctest with its CMake package (made
# relocatable). Run it here, on a machine with libgloo-dev and doctest-dev;
# .gpu/ is then carried along (the device tool's `carry`).
#
#     bash tests/gpu/stage_headers.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=$root/.gpu
rm -rf "$dest"
mkdir -p "$dest/include" "$dest/lib/cmake"
cp -r /usr/include/gloo /usr/include/doctest "$dest/include/"
cp -r /usr/lib/cmake/doctest "$dest/lib/cmake/"
# doctest's exported targets name /usr; make them name wherever .gpu/ is.
sed -i 's|^set(_IMPORT_PREFIX "/usr")|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
  "$dest/lib/cmake/doctest/doctestTargets.cmake"
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo /.gpu/ >>"$exclude"
du -sh "$dest"
