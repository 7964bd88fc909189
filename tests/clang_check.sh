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
base=(-std=c++20 -stdlib="$stdlib" -Wall -Wextra -Werror -Wno-missing-field-initializers
      -I"$root" -I"$root/include" -isystem /usr/include/torch/csrc/api/include)  # Debian's home of torch/torch.h
flags=("${base[@]}" -fsyntax-only)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
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
# What most files include first, precompiled once (clang's -include-pch):
# parsing LibTorch's headers under accel.hpp was most of each file's check
# (test_cuda.cpp's 100 lines: 27 s, 7 s from the precompiled header, which
# takes 26 s to make). Each is made with the same flags and -Werror, so a
# warning in accel.hpp or its parts still fails the check, once, there. A
# file's own `#define ACCEL_TRAINING` before its include matches the
# precompiled one's (the same definition), and its `#include` then adds
# nothing (the header's guard).
declare -A pch=()
precompile() {  # NAME TEXT
  printf '%b' "$2" >"$scratch/$1.hpp"
  start "precompiled: $(tr '\n' ' ' <"$scratch/$1.hpp")" \
    "$clangxx" "${base[@]}" -x c++-header "$scratch/$1.hpp" -o "$scratch/$1.pch"
  pch[$1]=$!
}
precompile parts '#include "accel/distributed.hpp"\n'
precompile header '#include "accel.hpp"\n'
precompile training '#define ACCEL_TRAINING\n#include "accel.hpp"\n'
# The files that do not start from one: the training tests as CMake builds
# them, one translation unit (UNITY_BUILD) with ACCEL_TRAINING; the launcher
# and the ABI test (no LibTorch); the core alone, compiled and linked with
# libstdc++, without LibTorch.
training=("$root"/tests/test_training_*.cpp)
unity=$scratch/training_unity.cpp
printf '#include "%s"\n' "${training[@]}" >"$unity"
start "${#training[@]} training test files (one translation unit)" "$clangxx" "${flags[@]}" -DACCEL_TRAINING "$unity"
for tu in tests/launch.cpp tests/abi_a.cpp tests/abi_b.cpp; do
  start "$tu" "$clangxx" "${flags[@]}" "$root/$tu"
done
core=$scratch/core_only.cpp
printf '#define ACCEL_CORE_ONLY\n#include "accel.hpp"\nint main() { return accel::get_world_size() - 1; }\n' >"$core"
start "ACCEL_CORE_ONLY program (built and linked without LibTorch)" \
  "$clangxx" -std=c++20 -Wall -Wextra -Werror -I"$root" "$core" -o /dev/null
# Then each file from its precompiled header (skipped, with the header's
# failure reported, where that failed).
status=0
# A job's exit status; bash lets each pid be waited for once, and a header's
# job is asked for twice (before its files start, and in the report).
declare -A finished=()
succeeded() {  # PID
  [[ -n ${finished[$1]:-} ]] || { wait "$1" && finished[$1]=0 || finished[$1]=$?; }
  ((finished[$1] == 0))
}
from() {  # PCH FILE...
  local name=$1 tu defines
  shift
  if ! succeeded "${pch[$name]}"; then
    echo "clang -Werror: $* not checked: their precompiled header failed" >&2
    status=1
    return 0
  fi
  for tu in "$@"; do
    defines=()
    [[ $tu == tests/compile_fail.cpp ]] && defines=(-DACCEL_CASE_OK)
    start "$tu" "$clangxx" "${flags[@]}" -include-pch "$scratch/$name.pch" "${defines[@]}" "$root/$tu"
  done
}
from parts tests/test_accel.cpp tests/test_launch.cpp tests/test_ops.cpp tests/test_cuda.cpp
from header examples/quick_start.cpp examples/mesh_demo.cpp tests/bench/bench.cpp tests/consumers/main.cpp \
  tests/compile_fail.cpp
from training examples/train_mlp.cpp examples/train_llama.cpp tests/bench/bench_ddp.cpp tests/bench/bench_sharding.cpp
for k in "${!pids[@]}"; do
  if succeeded "${pids[$k]}"; then
    echo "clang -Werror: ${names[$k]} ok"
  else
    echo "clang -Werror: ${names[$k]} FAILED" >&2
    status=1
  fi
done
exit $status
