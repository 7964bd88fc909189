"""Tables of tests/gpu/run_gpu.sh's benchmark figures (gpu_bench.csv: part,
world, variant, size, value, unit), in Markdown: all_reduce over NCCL through
accel against c10d, the data-parallel step against Python's DDP, and the
sharded step against DDP, ZeroRedundancyOptimizer and FSDP2. Each
figure is a median: of the interleaved trials inside one run for all_reduce,
of every trial of every run for the steps.

    python3 tests/gpu/summarize.py gpu_bench.csv
"""

import collections
import csv
import statistics
import sys


def main():
    rows = collections.defaultdict(list)
    for r in csv.DictReader(open(sys.argv[1])):
        rows[(r["part"], r["variant"], int(r["size"]))].append(float(r["value"]))
    med = lambda part, variant, size: statistics.median(rows[(part, variant, size)]) if rows.get((part, variant, size)) else None
    out = []
    for part, title in (("gpu_all_reduce", "all_reduce of a CUDA tensor"),
                        ("gpu_all_reduce_staged", "all_reduce of CPU data staged through the GPU")):
        sizes = sorted({s for (p, _, s) in rows if p == part})
        if not sizes:
            continue
        out += [f"{title}, NCCL, a world of one (µs per call, each followed by a device synchronisation):", "",
                "| bytes | c10d | accel.hpp | ratio (c10d time / accel time) |", "|---|---|---|---|"]
        for s in sizes:
            raw, ours = med(part, "raw_c10d", s), med(part, "accel_tensor", s)
            out.append(f"| {s:,} | {raw:.1f} | {ours:.1f} | {raw / ours:.2f} |")
        out.append("")
    steps = {v: rows[k] for k in rows if k[0] == "ddp_step" for v in [k[1]]}
    if steps:
        out += ["Data-parallel training step, NCCL, one process on the GPU (bench_ddp: MLP 256-1024-1024-1024-1, "
                "batch 64, SGD with momentum; ms per step, the loss read back each step on both sides):", "",
                "| side | trials | median ms/step | ratio (Python time / accel time) |", "|---|---|---|---|"]
        accel = statistics.median(steps.get("accel_accelerator_cuda", [float("nan")]))
        for variant, values in sorted(steps.items()):
            m = statistics.median(values)
            out.append(f"| {variant} | {len(values)} | {m:.3f} | {m / accel if variant.startswith('python') else 1:.2f} |")
        losses = [f"{k[1]} {v[-1]:.9g}" for k, v in rows.items() if k[0] == "ddp_loss"]
        out += ["", "Loss after the last step: " + ", ".join(sorted(losses)) + "."]
    shard = {k[1]: v for k, v in rows.items() if k[0] == "sharding_step_ms"}
    if shard:
        out += ["", "Sharded data parallel, NCCL, one process on the GPU (bench_sharding: Adam on 4 x 2048 x 2048, "
                "batch 16, every Linear a unit; ms per step, medians over the rounds of each process's median):", "",
                "| accel.hpp | ms/step | Python | ms/step | ratio (Python time / accel time) |", "|---|---|---|---|---|"]
        pairs = (("no_shard", "no_shard"), ("shard_grad_op", "zero"), ("shard_grad_op", "fsdp2_shard_grad_op"),
                 ("full_shard", "fsdp2_full_shard"))
        for ours, theirs in pairs:
            a, p = shard.get(f"{ours}_cuda"), shard.get(f"python_{theirs}_cuda")
            if a and p:
                a, p = statistics.median(a), statistics.median(p)
                out.append(f"| {ours} | {a:.3f} | {theirs} | {p:.3f} | {p / a:.2f} |")
        out += ["", "(Python's no_shard is DDP with Adam; zero is DDP with ZeroRedundancyOptimizer; fsdp2_* is "
                "`fully_shard` on every Linear and the root.)"]
    print("\n".join(out))


if __name__ == "__main__":
    main()
