#!/usr/bin/env bash
# Copies accel.hpp and the quick-start example into an empty directory,
# builds it with plain g++ as the README says and runs 4 ranks, under
# accel_launch and as the README's shell loop over TCP:
#   Debian's LibTorch:  g++ -std=c++20 main.cpp -ltorch_cpu -lc10
#   a pip wheel's (TORCH_DIR given: the torch package's directory): the
#   README's two commands, with the NCCL path compiled in and CPU-only.
#
#     copy_header.sh SOURCE_DIR LAUNCHER [TORCH_DIR]
set -euo pipefail
source_dir=$1
launcher=$2
T=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$source_dir/accel.hpp" "$work/"
cp "$source_dir/examples/quick_start.cpp" "$work/main.cpp"
cd "$work"
run4() {
  local output
  output=$("$launcher" --timeout 120 4 "$1")
  echo "$output"
  grep -q "mean loss 2.5, counts from 4 ranks" <<<"$output"
}
if [[ -z $T ]]; then
  g++ -std=c++20 main.cpp -o main -ltorch_cpu -lc10
else
  # The README's pip commands, word for word (T: the torch package's directory).
  # PyPI's wheel is a CUDA build: its CUDA libraries are linked, NCCL's path compiled.
  # (The two compile at once: this entry holds four processors for its ranks.)
  N=$T/../nvidia
  g++ -std=c++20 main.cpp -o main_nccl -isystem $T/include -isystem $T/include/torch/csrc/api/include \
    -isystem $N/nccl/include -isystem $N/cu13/include -L$T/lib -Wl,-rpath,$T/lib \
    -Wl,--no-as-needed -ltorch_cuda -Wl,--as-needed -ltorch_cpu -lc10_cuda -lc10 &
  nccl_build=$!
  # The CPU-only form: no NCCL path, whatever nccl.h the system has.
  g++ -std=c++20 -DACCEL_WITH_NCCL=0 main.cpp -o main -isystem $T/include \
    -isystem $T/include/torch/csrc/api/include -L$T/lib -Wl,-rpath,$T/lib -ltorch_cpu -lc10
  wait "$nccl_build"
  # The first really holds the NCCL path, the second does not: ACCEL_WITH_NCCL
  # is in the name of accel.hpp's ABI namespace (accel::abi_v..._nccl1).
  nm -C main_nccl | grep -c "accel::abi_v[0-9_]*t[0-9]*_nccl1::" >/dev/null || { echo "main_nccl: no NCCL path"; exit 1; }
  nm -C main | grep -c "accel::abi_v[0-9_]*t[0-9]*_nccl0::" >/dev/null || { echo "main: an NCCL path"; exit 1; }
  run4 ./main_nccl  # (no GPU here: Gloo on the CPU, from the NCCL build)
fi
run4 ./main
# Again as the README starts it: four plain processes meeting over the default
# TCP rendezvous (rank 0 serves the TCPStore; here on a free port instead of
# 29500, so parallel runs do not collide).
export MASTER_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
unset ACCEL_STORE_DIR LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR
pids=()
for r in 0 1 2 3; do RANK=$r WORLD_SIZE=4 timeout 120 ./main >"rank$r.log" 2>&1 & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
cat rank*.log
((status == 0))
grep -q "mean loss 2.5, counts from 4 ranks" rank0.log
