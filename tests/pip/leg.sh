#!/usr/bin/env bash
# The pip leg of tests/run_tests.sh: the LibTorch inside PyPI's torch wheel
# (the newest release, a CUDA build, pinned in tests/pip/requirements.txt),
# run on the CPU. Every entry but those that no LibTorch version changes and
# that cost least on 1.13's smaller headers, so the 1.13 leg runs them
# (parts_compile_alone, the compile_fail_ cases, diagnostics_out_of_line, and
# werror_user_tu with the same GCC 12): the suites at 1-4 ranks on Gloo, the NCCL path
# compiled and linked (ACCEL_TEST_EXPECT_NCCL), libuv's TCPStore server
# (ACCEL_TEST_EXPECT_LIBUV), torchrun from the wheel as it is, the Python
# references (FSDP2, Accelerate, DDP numerics, init_device_mesh, the sampler)
# on that torch, the sanitizer build, consumers with and without a CUDA
# toolkit, the README's plain-g++ route.
#
#     bash tests/pip/leg.sh BUILD_DIR [CTEST_ARGS...]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: leg.sh BUILD_DIR [CTEST_ARGS...]}
shift
mkdir -p "$build"
build=$(cd "$build" && pwd)  # absolute: the tests run from other directories
venv=$build/pip-venv
bash "$root/tests/pip/make_venv.sh" "$venv"
# The wheel's python3 and torchrun first on PATH, for every script the tests
# start; ACCEL_TEST_PYTHON for the test binary's own Python comparisons.
export PATH="$venv/bin:$PATH" ACCEL_TEST_PYTHON="$venv/bin/python3"
# In the environment, so that the nested builds (sanitizers, consumers) find
# the same LibTorch.
CMAKE_PREFIX_PATH=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
export CMAKE_PREFIX_PATH
echo "== LibTorch $(python3 -c 'import torch; print(torch.__version__)') (pip wheel), $(g++ --version | head -1)"
dir=$build/pip
# The tests and examples at -Og (run_tests.sh says why); the 1.13 leg builds
# them at Release's -O3.
cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-Og -DNDEBUG" \
  -DACCEL_CLANG_NESTED=OFF -DACCEL_BUILD_BENCHMARKS=OFF -DACCEL_TEST_EXPECT_NCCL=ON -DACCEL_TEST_EXPECT_LIBUV=ON >/dev/null
cmake --build "$dir" -j2
(($#)) || set -- -E '^(parts_compile_alone|compile_fail_.*|diagnostics_out_of_line|werror_user_tu)$'
cd "$dir" && ctest --output-on-failure -j2 --timeout 900 "$@"
