#!/usr/bin/env bash
# clang++ -Wall -Wextra -Werror over every translation unit of the project that
# includes accel.hpp: a full semantic check (templates instantiated), with
# libc++ because LibTorch 1.13's headers do not compile with clang 14 and
# libstdc++ 12 in C++20. accel.hpp and include/accel/ are included with -I,
# so their warnings count; LibTorch's system headers do not.
#   clang_check.sh CLANGXX SOURCE_DIR
set -euo pipefail
clangxx=$1
root=$2
flags=(-std=c++20 -stdlib=libc++ -fsyntax-only -Wall -Wextra -Werror -Wno-missing-field-initializers
       -I"$root" -I"$root/include" -isystem /usr/include/torch/csrc/api/include)  # Debian's home of torch/torch.h
for tu in tests/test_accel.cpp tests/test_launch.cpp tests/test_ops.cpp tests/test_cuda.cpp examples/quick_start.cpp \
          examples/mesh_demo.cpp examples/train_mlp.cpp tests/bench/bench.cpp tests/bench/bench_ddp.cpp tests/launch.cpp \
          tests/consumers/main.cpp tests/compile_fail.cpp tests/abi_a.cpp tests/abi_b.cpp; do
  defines=()
  [[ $tu == tests/compile_fail.cpp ]] && defines=(-DACCEL_CASE_OK)
  "$clangxx" "${flags[@]}" "${defines[@]}" "$root/$tu"
  echo "clang -Werror: $tu ok"
done
# The training tests as CMake builds them: one translation unit (UNITY_BUILD),
# with ACCEL_TRAINING.
training=("$root"/tests/test_training_*.cpp)
printf '#include "%s"\n' "${training[@]}" | "$clangxx" "${flags[@]}" -DACCEL_TRAINING -x c++ -
echo "clang -Werror: ${#training[@]} training test files (one translation unit) ok"
# The core alone, without LibTorch, compiled and linked with libstdc++.
printf '#define ACCEL_CORE_ONLY\n#include "accel.hpp"\nint main() { return accel::get_world_size() - 1; }\n' |
  "$clangxx" -std=c++20 -Wall -Wextra -Werror -I"$root" -x c++ - -o /dev/null
echo "clang -Werror: ACCEL_CORE_ONLY program builds and links without LibTorch"
