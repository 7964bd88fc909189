#!/usr/bin/env bash
# accel.hpp on a GPU: builds the tests, the example and the benchmarks
# against the LibTorch inside python3's torch (a CUDA build) and runs, in
# this order (most telling first, so a run cut short still says the most):
#   1. the CUDA cases (CTest's cuda_* cases, each group in a process of its
#      own): the backend choice and device binding;
#      an NCCL world of one with every collective on CUDA tensors and on CPU
#      data staged through the device; the Accelerator on CUDA against the
#      same training on the CPU in fp32, bf16 autocast and fp16 with loss
#      scaling; the scaler's skipped step and its checkpoint with the CUDA
#      RNG; NO_SHARD, SHARD_GRAD_OP and FULL_SHARD with two processes on the
#      GPU (Gloo on CUDA tensors) against one CPU process;
#   2. examples/train_mlp on the GPU with no, bf16 and fp16 mixed precision;
#   3. the benchmarks, side by side in one run: all_reduce over NCCL through
#      accel and through c10d (a world of one, on the device and staged),
#      the data-parallel training step against Python's DDP, and the
#      sharded step (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD) against Python's
#      DDP, ZeroRedundancyOptimizer and FSDP2: a world of one on NCCL, and
#      2 and 4 processes sharing the GPU with Gloo on CUDA tensors;
#   4. every functional suite on the CPU (ACCEL_DEVICE=cpu: Gloo, 1-4 ranks)
#      with this CUDA LibTorch and a GPU present.
# Not part of CI (CI has no GPU). Where the machine has no Gloo or doctest
# headers, tests/gpu/stage_headers.sh puts them under .gpu/ beforehand.
#
#     bash tests/gpu/run_gpu.sh OUT_DIR [SECONDS (600)]
#     ACCEL_GPU_PHASES="1 3" bash tests/gpu/run_gpu.sh OUT_DIR   # some of them (the build always)
#     ACCEL_GPU_CPU_TESTS='^(single|ranks_2)$' ...   # step 4: those entries only, with their output
#     ACCEL_GPU_BUILD=DIR ...                         # the build directory (default build/gpu)
#     ACCEL_GPU_BENCHES="ddp sharding" ...            # step 3: those benchmarks (all_reduce ddp sharding)
#     ACCEL_GPU_ROUNDS=2 ...                          # step 3: interleaved rounds of the steps (3)
#     ACCEL_GPU_GLOO_WORLDS="2" ...                   # step 3: the steps at these numbers of processes as
#                                                     #   well, sharing the GPU over Gloo ("2 4"; "" for none)
# SECONDS: the suites of step 4 (and the rest of the build they need) stop
# when the script has run that long, and count as failed if cut short.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: run_gpu.sh OUT_DIR [SECONDS]}
deadline=${2:-600}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/gpu.log
exec > >(tee "$log") 2>&1
jobs=$(nproc)
# The test cases that compare with Python's torch live (training_fixtures.hpp)
# take this python3, which has it; their default is Debian's /usr/bin/python3.
ACCEL_TEST_PYTHON=${ACCEL_TEST_PYTHON:-$(command -v python3)}
export ACCEL_TEST_PYTHON
build=${ACCEL_GPU_BUILD:-$root/build/gpu}
phases=${ACCEL_GPU_PHASES:-1 2 3 4}
status=0
wanted() { [[ " $phases " == *" $1 "* ]]; }
phase() { echo; echo "== $* ($(date -u +%T), $SECONDS s)"; }
fail() { echo "FAILED: $*"; status=1; }

phase "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "nvidia-smi"
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())), "GPU", torch.cuda.get_device_name(0))' ||
  fail "python3's torch"
echo "compiler (CMake takes \$CXX, else c++): ${CXX:-c++}"; "${CXX:-c++}" --version | head -1
cmake --version | head -1
echo "$jobs cores"

phase "build"
# The wheel's CUDA headers need crt/host_config.h, which a CUDA toolkit has
# (cmake/accelTorch.cmake looks at CUDA_HOME).
if [[ -z ${CUDA_HOME:-} ]] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  export CUDA_HOME
fi
prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
extra=()
[[ -d $root/.gpu/include/gloo ]] && extra+=(-DACCEL_GLOO_INCLUDE_DIR="$root/.gpu/include")
[[ -d $root/.gpu/lib/cmake/doctest ]] && extra+=(-Ddoctest_DIR="$root/.gpu/lib/cmake/doctest")
[[ ! -f $build/CMakeCache.txt ]] && command -v ninja >/dev/null && extra+=(-G Ninja)
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DACCEL_TEST_EXPECT_NCCL=ON \
  -DACCEL_CLANG_NESTED=OFF -DACCEL_TRAINING_TESTS_UNITY=OFF "${extra[@]}" >"$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; fail "configure"; exit 1; }
grep -iE "warning|nccl|gloo" "$out/configure.log" | head -20
benches=${ACCEL_GPU_BENCHES:-all_reduce ddp sharding}
rounds=${ACCEL_GPU_ROUNDS:-3}
gloo_worlds=${ACCEL_GPU_GLOO_WORLDS-2 4}  # the step benchmarks at these numbers of processes too (Gloo, one GPU)
bench() { wanted 3 && [[ " $benches " == *" $1 "* ]]; }
targets=(accel_launch)
{ wanted 1 || wanted 4; } && targets+=(accel_tests)
wanted 2 && targets+=(train_mlp)
bench all_reduce && targets+=(accel_bench)
bench ddp && targets+=(accel_bench_ddp)
bench sharding && targets+=(accel_bench_sharding)
cmake --build "$build" -j"$jobs" --target "${targets[@]}" \
  >"$out/build.log" 2>&1 || { grep -B2 -A12 "error" "$out/build.log" | head -80; fail "build"; exit 1; }
echo "built in $SECONDS s"
# What puts libstdc++ ahead of LibTorch (the libstdcxx_before_libtorch entry).
link=$(cat "$build/tests/CMakeFiles/accel_tests.dir/link.txt" 2>/dev/null ||
       grep -A8 "^build tests/accel_tests:" "$build/build.ninja" 2>/dev/null || true)
echo "libstdc++ on accel_tests' link line: $(grep -oE -- '[^ ]*stdc\+\+[^ ]*' <<<"$link" | paste -sd' ')"

if wanted 1; then
phase "1. the CUDA cases"
# Each group of cases in a process of its own (CTest's cuda_gpu runs them in
# one), so that a crash in one hides none of the others.
tests=$build/tests/accel_tests
unlaunched=(env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u ACCEL_STORE_DIR)
for cases in "cuda: *" "gpu: an NCCL world*" "gpu: DataParallel*" "gpu: the Accelerator*" "gpu: fp16*"; do
  echo "-- $cases" >>"$out/cuda.log"
  "${unlaunched[@]}" timeout 120 "$tests" -ts=cuda "-tc=$cases" --no-intro=true >>"$out/cuda.log" 2>&1 ||
    fail "the cases $cases"
done
echo "-- 2 processes on the GPU" >>"$out/cuda.log"
timeout 200 "$build/tests/accel_launch" --timeout 180 2 "$tests" -ts=cuda_ranks --no-intro=true >>"$out/cuda.log" 2>&1 ||
  fail "the cases with 2 processes on the GPU"
grep -E "^-- |difference|SKIPPED|ERROR|CRASHED|test cases|gpu: " "$out/cuda.log" | head -60

fi

if wanted 2; then
phase "2. examples/train_mlp on the GPU"
for mp in no bf16 fp16; do
  ckpt=$(mktemp -d)
  (cd "$build" && timeout 120 examples/train_mlp --epochs 2 --mixed-precision $mp --checkpoint "$ckpt/c") \
    >"$out/train_mlp_$mp.log" 2>&1 || fail "train_mlp --mixed-precision $mp"
  grep -E "^train_mlp|epoch 1 .*step" "$out/train_mlp_$mp.log" | tail -4
  rm -rf "$ckpt"
done

fi

if wanted 3; then
phase "3. benchmarks (one GPU; medians of interleaved trials)"
launch=$build/tests/accel_launch
csv=$out/gpu_bench.csv
echo "part,world,variant,size,value,unit" >"$csv"
if bench all_reduce; then
  timeout 120 "$launch" --timeout 110 1 "$build/tests/accel_bench" gpu_all_reduce >"$out/bench_all_reduce.log" 2>&1 ||
    fail "bench gpu_all_reduce"
  sed -n 's/^\[rank 0\] CSV,//p' "$out/bench_all_reduce.log" >>"$csv"
fi
# A step benchmark at `world` processes: one on NCCL, or several sharing the
# GPU with Gloo on CUDA tensors (NCCL refuses two ranks on one device), every
# process bound to device 0.
on_gpu() {
  local world=$1
  shift
  if ((world == 1)); then
    ACCEL_BENCH_DEVICE=cuda timeout 150 "$launch" --timeout 140 1 "$@"
  else
    ACCEL_BACKEND=gloo ACCEL_DEVICE=cuda ACCEL_BENCH_DEVICE=cuda ACCEL_BENCH_BACKEND=gloo \
      timeout 150 "$launch" --timeout 140 "$world" env LOCAL_RANK=0 "$@"
  fi
}
if bench ddp; then
  for ((round = 1; round <= rounds; ++round)); do  # interleaved: accel, Python, accel, ...
    for world in 1 $gloo_worlds; do
      on_gpu "$world" "$build/tests/accel_bench_ddp" 3 100 >>"$out/bench_ddp.log" 2>&1 ||
        fail "bench_ddp (accel) at $world"
      on_gpu "$world" python3 "$root/tests/bench/bench_ddp.py" 3 100 >>"$out/bench_ddp.log" 2>&1 ||
        fail "bench_ddp.py (Python DDP) at $world"
    done
  done
  sed -n 's/^\[rank 0\] CSV,//p' "$out/bench_ddp.log" >>"$csv"
fi
if bench sharding; then
  for ((round = 1; round <= rounds; ++round)); do  # interleaved; a side that fails is reported, the rest go on
    for world in 1 $gloo_worlds; do
      for variant in no_shard shard_grad_op full_shard; do
        on_gpu "$world" "$build/tests/accel_bench_sharding" $variant 3 20 >>"$out/bench_sharding.log" 2>&1 ||
          fail "bench_sharding $variant at $world"
      done
      for variant in no_shard zero fsdp2_shard_grad_op fsdp2_full_shard; do
        on_gpu "$world" python3 "$root/tests/bench/bench_sharding.py" $variant 3 20 >>"$out/bench_sharding.log" 2>&1 ||
          fail "bench_sharding.py $variant at $world"
      done
    done
  done
  sed -n 's/^\[rank 0\] CSV,//p' "$out/bench_sharding.log" >>"$csv"
fi
python3 "$root/tests/gpu/summarize.py" "$csv" | tee "$out/gpu_bench.md"

fi

if wanted 4; then
left=$((deadline - SECONDS))
selected=${ACCEL_GPU_CPU_TESTS:-}  # a CTest regex: those entries only (their targets built already)
phase "4. the functional suites on the CPU, with this CUDA LibTorch (the $left s left)${selected:+: $selected}"
build_all="cmake --build . -j$jobs >'$out/build_all.log' 2>&1"
[[ -n $selected ]] && build_all=true
(cd "$build" && ACCEL_DEVICE=cpu timeout "$((left > 0 ? left : 1))" bash -c "$build_all && ctest -L quick \
   -E '^cuda_' ${selected:+-R '$selected'} -j$jobs --timeout 200 --output-on-failure >'$out/cpu_suites.log' 2>&1") ||
  fail "the CPU suites (or their build, or the time allowed)"
tail -25 "$out/cpu_suites.log"
# The failed entries once more, one at a time, each with its output (ctest -j
# in one log interleaves them), within what is left of the time.
left=$((deadline - SECONDS))
failed=$(sed -n '/tests FAILED:/,$ s/^[[:space:]]*[0-9]* - \([^ ]*\) (.*/\1/p' "$out/cpu_suites.log" | paste -sd'|')
if [[ -n $failed ]] && ((left > 20)); then
  (cd "$build" && ACCEL_DEVICE=cpu timeout "$left" ctest -R "^($failed)\$" --output-on-failure --timeout 120 \
     >"$out/cpu_failed.log" 2>&1)
  grep -E "Passed|Failed|SegFault|Timeout" "$out/cpu_failed.log" | head -20
fi
fi

phase "done: $([[ $status == 0 ]] && echo 'every step passed' || echo 'some step FAILED')"
exit $status
