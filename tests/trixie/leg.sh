#!/usr/bin/env bash
# The LibTorch 2.6 leg of tests/run_tests.sh, run inside the trixie root
# (tests/trixie/in_root.sh):
#   g++ 14:   the test binaries at -Og (run_tests.sh says why), with the
#             quick suites (every multi-rank suite, torchrun patched for a
#             torch without libuv) but the FSDP2 references (Python's FSDP2
#             is compared live with the newest torch, on the pip leg) and the
#             examples (run on the pip and 1.13 legs; clang 19 below checks
#             them here), and a user's -Werror build (GCC 14 warns where
#             GCC 12 does not); the nested sanitizer and consumer builds run
#             on the pip leg;
#   clang 19: -Wall -Wextra -Werror over every translation unit against
#             LibTorch 2.6 and libstdc++ 14 (tests/clang_check.sh: a full
#             semantic check without code generation, two files at a time).
#             clang's warnings come from its front end; the suites already
#             run on four builds (pip, 1.13, ASan, g++ 14). Building and
#             running them with clang took 265-345 s here, the check 218 s
#             (162 s since it starts files from precompiled headers).
# CTEST_ARGS, when given, replace g++ 14's own selection.
#
#     bash tests/trixie/leg.sh BUILD_DIR [CTEST_ARGS...]
set -euo pipefail
build=${1:?usage: leg.sh BUILD_DIR [CTEST_ARGS...]}
shift
status=0
dir=$build/trixie-g
# The quick entries but the FSDP2 references (the pip leg's), the examples
# (run on the other two), and those that prove nothing of LibTorch's version
# the other legs do not: the launcher's failure modes, a checkpoint resized
# across process counts (the checkpoint cases of the ranks suites run here),
# and the ranks suite at 1 and 3 (here at 2 and 4).
selections=("-L quick -E ^(python_fsdp2_|example_|failures$|checkpoint_resize$|ranks_1$|ranks_3$)")
(($#)) && selections=("$*")
echo "== LibTorch 2.6, $(g++ --version | head -1)"
start=$(date +%s)
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-Og -DNDEBUG" -DACCEL_CLANG_NESTED=OFF \
  -DACCEL_BUILD_BENCHMARKS=OFF >/dev/null
targets=(--target accel_tests accel_launch abi_namespace)  # what the suites above run
(($#)) && targets=()
cmake --build "$dir" -j2 "${targets[@]}"
for selection in "${selections[@]}"; do
  # shellcheck disable=SC2086 (a selection is several ctest words)
  (cd "$dir" && ctest --output-on-failure -j2 --timeout 900 $selection) || status=1
done
echo "== LibTorch 2.6, g++: $(( $(date +%s) - start )) s"
# A user's -Werror build (one g++ process, about two minutes) runs beside
# clang's check, which keeps the other processor busy; one after the other,
# a processor idled for those two minutes.
werror=
werror_log=$(mktemp)
trap 'rm -f "$werror_log"' EXIT
if ! (($#)); then
  (cd "$dir" && ctest --output-on-failure --timeout 900 -R '^werror_') >"$werror_log" 2>&1 &
  werror=$!
fi
echo "== LibTorch 2.6, $(clang++ --version | head -1)${werror:+, beside the -Werror build of g++ 14}"
start=$(date +%s)
bash tests/clang_check.sh clang++ "$PWD" libstdc++ || status=1
if [[ -n $werror ]]; then
  wait "$werror" || status=1
  echo "== LibTorch 2.6, g++ 14, a user's -Werror build:"
  cat "$werror_log"
fi
echo "== LibTorch 2.6, clang++${werror:+ and the -Werror build}: $(( $(date +%s) - start )) s"
exit $status
