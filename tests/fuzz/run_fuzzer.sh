#!/usr/bin/env bash
# Runs one libFuzzer target for a fixed time from its seed corpus and prints
# how many inputs it executed. New inputs go to a scratch directory, so the
# committed corpus only changes when someone copies findings into it.
#   run_fuzzer.sh FUZZER SEED_CORPUS SECONDS
set -euo pipefail
fuzzer=$1
seeds=$2
seconds=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
log=$scratch/log
if ! "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=4096 \
     -artifact_prefix="$scratch/" "$scratch" "$seeds" >"$log" 2>&1; then
  tail -40 "$log"
  for crash in "$scratch"/crash-* "$scratch"/leak-* "$scratch"/timeout-*; do
    [[ -e $crash ]] && { echo "reproducer ($crash):"; od -A x -t x1z "$crash" | head -20; }
  done
  exit 1
fi
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
echo "$(basename "$fuzzer"): $runs executions in ${seconds}s, no crash"
