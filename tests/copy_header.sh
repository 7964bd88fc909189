#!/usr/bin/env bash
# Copies accel.hpp and the quick-start example into an empty directory,
# builds with `g++ -std=c++20 main.cpp -ltorch_cpu -lc10` and runs 4 ranks,
# under accel_launch and as the README's shell loop over TCP.
set -euo pipefail
source_dir=$1
launcher=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$source_dir/accel.hpp" "$work/"
cp "$source_dir/examples/quick_start.cpp" "$work/main.cpp"
cd "$work"
g++ -std=c++20 main.cpp -o main -ltorch_cpu -lc10
output=$("$launcher" --timeout 120 4 ./main)
echo "$output"
grep -q "mean loss 2.5, counts from 4 ranks" <<<"$output"
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
