#!/usr/bin/env bash
# Compile cost of one translation unit, side by side in one run: accel.hpp
# against <ATen/ATen.h> alone (the target: <= 1.25x at -O2) and
# <torch/torch.h>, at -O0 and -O2, interleaved, five rounds; medians of wall
# seconds and peak memory. Writes tests/bench/results/compile.{csv,md}.
# Needs a quiet machine: never part of the test command.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${ACCEL_BENCH_OUT:-$root/tests/bench/results}
mkdir -p "$out"
csv=$out/compile.csv
echo "opt,tu,seconds,peak_mib" >"$csv"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '#include "accel.hpp"\nint main() { return accel::all_reduce(1) - 1; }\n' >"$tmp/accel.cpp"
printf '#include <ATen/ATen.h>\nint main() { return at::ones({1}).item<int>() - 1; }\n' >"$tmp/aten.cpp"
printf '#include <torch/torch.h>\nint main() { return torch::ones({1}).item<int>() - 1; }\n' >"$tmp/torch.cpp"
for round in 1 2 3 4 5; do
  for opt in O0 O2; do
    for tu in accel aten torch; do
      /usr/bin/time -f "%e %M" -o "$tmp/time" g++ -std=c++20 "-$opt" -I"$root" -I/usr/include/torch/csrc/api/include \
        -c "$tmp/$tu.cpp" -o "$tmp/$tu.o"
      read -r seconds kib <"$tmp/time"
      echo "$opt,$tu,$seconds,$((kib / 1024))" | tee -a "$csv" >&2
    done
  done
done
/usr/bin/python3 - "$csv" "$out/compile.md" "$(g++ --version | head -1)" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
def med(opt, tu, key):
    return statistics.median(float(r[key]) for r in rows if r["opt"] == opt and r["tu"] == tu)
lines = [f"# Compile cost of one translation unit ({sys.argv[3]}, -std=c++20 -c; medians of 5 interleaved rounds)", "",
         "| includes | -O0 s | -O0 MiB | -O0 ratio | -O2 s | -O2 MiB | -O2 ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
for tu, name in (("accel", "`accel.hpp`"), ("aten", "`<ATen/ATen.h>`"), ("torch", "`<torch/torch.h>`")):
    cells = []
    for opt in ("O0", "O2"):
        s = med(opt, tu, "seconds")
        cells += [f"{s:.1f}", f"{med(opt, tu, 'peak_mib'):.0f}", f"{s / med(opt, 'aten', 'seconds'):.2f}"]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
ratio = med("O2", "accel", "seconds") / med("O2", "aten", "seconds")
lines += ["", f"Target: accel.hpp <= 1.25x the ATen-only file at -O2: {ratio:.2f}, {'met' if ratio <= 1.25 else 'NOT met'}."]
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
