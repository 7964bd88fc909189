#!/usr/bin/env bash
# Mesh initialisation alone, side by side in one run: both 2-D meshes
# (2, w/2 | w/2, 2) built by accel.hpp and by Python (init_device_mesh where
# torch has it, else new_group per sub-group), interleaved, at world 4, 8 and
# 16, with whatever LibTorch and python3-torch this machine (or root) has.
# Writes mesh.csv and mesh.md to ACCEL_BENCH_OUT (default tests/bench/results).
# run_bench.sh runs this part too, with the others; this script is the one to
# run inside the LibTorch 2.6 root (tests/trixie/in_root.sh).
#
#     bash tests/bench/run_mesh_bench.sh [trials (3)]
set -euo pipefail
trials=${1:-3}
source "$(dirname "$0")/common.sh"
bench_prepare mesh.csv python3-torch accel_bench
for world in 4 8 16; do
  for ((trial = 1; trial <= trials; ++trial)); do  # interleaved: accel, Python, accel, Python, ...
    run $world env -u ACCEL_STORE_DIR "$build/tests/accel_bench" mesh  # a TCPStore, as Python's
    run $world "$python" "$root/tests/bench/bench_torch.py" mesh
  done
done
"$python" - "$csv" "$out/mesh.md" <<'PY'
import collections, csv, statistics, sys
import torch
rows = collections.defaultdict(list)
for r in csv.DictReader(open(sys.argv[1])):
    if r["part"] == "mesh_init":
        rows[(int(r["world"]), r["variant"])].append(float(r["value"]))
python = next(v for _, v in rows if v.startswith("python"))
lines = [f"Mesh initialisation, both 2-D meshes (2, w/2 | w/2, 2) and a world-sized group; LibTorch/torch "
         f"{torch.__version__}; medians of {len(rows[next(iter(rows))])} interleaved trials; the slowest rank's time. "
         "accel.hpp's `instance` includes its rendezvous (which waits for the last rank to leave the previous "
         "destroy()); `from barrier` is Python's work alone, as Python's is timed.", "",
         f"| world | accel.hpp `instance` ms | accel.hpp from barrier ms | Python `{python.removeprefix('python_')}` ms "
         "| ratio `instance` | ratio from barrier |",
         "|---:|---:|---:|---:|---:|---:|"]
for world in sorted({w for w, _ in rows}):
    a, b, p = (statistics.median(rows[(world, v)]) for v in ("accel", "accel_from_barrier", python))
    lines.append(f"| {world} | {a:.0f} | {b:.0f} | {p:.0f} | {a / p:.2f} | {b / p:.2f} |")
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
