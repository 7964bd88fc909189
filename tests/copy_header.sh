#!/usr/bin/env bash
# Copies accel.hpp and the quick-start example into an empty directory,
# builds with `g++ -std=c++20 main.cpp -ltorch_cpu -lc10` and runs 4 ranks.
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
