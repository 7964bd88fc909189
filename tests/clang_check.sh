#!/usr/bin/env bash
# clang++ -Wall -Wextra -Werror over every translation unit of the project that
# includes accel.hpp: a full semantic check (templates instantiated) without
# code generation (clang's warnings come from its front end). Against
# Debian's LibTorch 2.6 and libstdc++ 14, with clang 19 in the trixie root
# (tests/trixie/leg.sh). (Not on 1.13: its headers do not compile with clang 14
# and libstdc++ 12 in C++20, and a check against libc++ judged a build no one
# can link, as LibTorch is built for libstdc++.)
# accel.hpp and include/accel/ are included with -I, so their warnings count;
# LibTorch's system headers do not.
#   clang_check.sh CLANGXX SOURCE_DIR [STDLIB (libstdc++)]
set -euo pipefail
clangxx=$1
root=$2
stdlib=${3:-libstdc++}
flags=(-std=c++20 -stdlib="$stdlib" -fsyntax-only -Wall -Wextra -Werror -Wno-missing-field-initializers
       -I"$root" -I"$root/include" -isystem /usr/include/torch/csrc/api/include)  # Debian's home of torch/torch.h
# Two compilers at once (the machines CI runs on have two cores); every
# failure is reported, and any one fails the check.
pids=()
names=()
start() {  # NAME COMMAND...
  while (($(jobs -rp | wc -l) >= 2)); do wait -n || true; done
  "${@:2}" &
  pids+=($!)
  names+=("$1")
}
for tu in tests/test_accel.cpp tests/test_launch.cpp tests/test_ops.cpp tests/test_cuda.cpp examples/quick_start.cpp \
          examples/mesh_demo.cpp examples/train_mlp.cpp examples/train_llama.cpp tests/bench/bench.cpp tests/bench/bench_ddp.cpp \
          tests/bench/bench_sharding.cpp tests/launch.cpp tests/consumers/main.cpp tests/compile_fail.cpp \
          tests/abi_a.cpp tests/abi_b.cpp; do
  defines=()
  [[ $tu == tests/compile_fail.cpp ]] && defines=(-DACCEL_CASE_OK)
  start "$tu" "$clangxx" "${flags[@]}" "${defines[@]}" "$root/$tu"
done
# The training tests as CMake builds them: one translation unit (UNITY_BUILD),
# with ACCEL_TRAINING.
training=("$root"/tests/test_training_*.cpp)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
unity=$scratch/training_unity.cpp
printf '#include "%s"\n' "${training[@]}" >"$unity"
start "${#training[@]} training test files (one translation unit)" "$clangxx" "${flags[@]}" -DACCEL_TRAINING "$unity"
# The core alone, without LibTorch, compiled and linked with libstdc++.
core=$scratch/core_only.cpp
printf '#define ACCEL_CORE_ONLY\n#include "accel.hpp"\nint main() { return accel::get_world_size() - 1; }\n' >"$core"
start "ACCEL_CORE_ONLY program (built and linked without LibTorch)" \
  "$clangxx" -std=c++20 -Wall -Wextra -Werror -I"$root" "$core" -o /dev/null
status=0
for k in "${!pids[@]}"; do
  if wait "${pids[$k]}"; then
    echo "clang -Werror: ${names[$k]} ok"
  else
    echo "clang -Werror: ${names[$k]} FAILED" >&2
    status=1
  fi
done
exit $status
