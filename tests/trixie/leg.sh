#!/usr/bin/env bash
# The LibTorch 2.6 leg of tests/run_tests.sh, run inside the trixie root
# (tests/trixie/in_root.sh): the same CMake/CTest build as on 1.13, with
#   g++ 14:   the quick suites (every multi-rank suite, torchrun patched for a
#             torch without libuv, the examples) but the FSDP2 references
#             (Python's FSDP2 is compared live with the newest torch, on the
#             pip leg: 4 minutes here), the header copied alone and a user's
#             -Werror build (GCC 14 warns where GCC 12 does not); the nested
#             sanitizer and consumer builds run on the pip leg;
#   clang 19: -Wall -Wextra -Werror, built, linked against LibTorch 2.6 and
#             run: the quick suites of our own C++, without the Python
#             references (g++ 14 and the pip leg run them; they are most of
#             the quick label's time) and the checks of the repository that
#             no compiler changes (accel.hpp in sync, docs, formatting).
#             Built at -O0: clang's warnings come from its front end, the
#             same at every -O, and code generation is most of a build.
# CTEST_ARGS, when given, replace each compiler's own selection.
#
#     bash tests/trixie/leg.sh BUILD_DIR [CTEST_ARGS...]
set -euo pipefail
build=${1:?usage: leg.sh BUILD_DIR [CTEST_ARGS...]}
shift
status=0
for compiler in g++ clang++; do
  dir=$build/trixie-${compiler%++}
  flags=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=$compiler -DACCEL_CLANG_NESTED=OFF -DACCEL_BUILD_BENCHMARKS=OFF)
  selections=("-L quick -E ^python_fsdp2_")
  if [[ $compiler == clang++ ]]; then
    flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DCMAKE_CXX_COMPILER=$compiler
           -DACCEL_CLANG_NESTED=OFF -DACCEL_BUILD_BENCHMARKS=OFF
           -DACCEL_WERROR=ON -DACCEL_NESTED_BUILDS=OFF -DACCEL_INSTALL=OFF)
    selections=("-L quick -E ^(python_|safetensors_python|amalgamation_|api_reference_|docs_links|format_check)")
  else
    selections+=("-R ^(copy_header_|werror_)")
  fi
  (($#)) && selections=("$*")
  echo "== LibTorch 2.6, $($compiler --version | head -1)"
  start=$(date +%s)
  cmake -S . -B "$dir" "${flags[@]}" >/dev/null
  cmake --build "$dir" -j2
  for selection in "${selections[@]}"; do
    # shellcheck disable=SC2086 (a selection is several ctest words)
    (cd "$dir" && ctest --output-on-failure -j2 --timeout 900 $selection) || status=1
  done
  echo "== LibTorch 2.6, $compiler: $(( $(date +%s) - start )) s"
done
exit $status
