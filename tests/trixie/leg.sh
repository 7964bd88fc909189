#!/usr/bin/env bash
# The LibTorch 2.6 leg of tests/run_tests.sh, run inside the trixie root
# (tests/trixie/in_root.sh): the same CMake/CTest build as on 1.13, with
#   g++ 14:   every entry (the nested sanitizer, consumer and compile-failure
#             builds included; clang's own entries are the build below);
#   clang 19: -Wall -Wextra -Werror, built, linked against LibTorch 2.6 and
#             run: the quick suites (every multi-rank suite, torchrun, the
#             examples).
#
#     bash tests/trixie/leg.sh BUILD_DIR [CTEST_ARGS...]
set -euo pipefail
build=${1:?usage: leg.sh BUILD_DIR [CTEST_ARGS...]}
shift
status=0
for compiler in g++ clang++; do
  dir=$build/trixie-${compiler%++}
  flags=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=$compiler -DACCEL_CLANG_NESTED=OFF)
  labels=()
  if [[ $compiler == clang++ ]]; then
    flags+=(-DACCEL_WERROR=ON -DACCEL_NESTED_BUILDS=OFF -DACCEL_INSTALL=OFF)
    labels=(-L quick)
  fi
  echo "== LibTorch 2.6, $($compiler --version | head -1)"
  start=$(date +%s)
  cmake -S . -B "$dir" "${flags[@]}" >/dev/null
  cmake --build "$dir" -j2
  (cd "$dir" && ctest --output-on-failure -j2 --timeout 900 "${labels[@]}" "$@") || status=1
  echo "== LibTorch 2.6, $compiler: $(( $(date +%s) - start )) s"
done
exit $status
