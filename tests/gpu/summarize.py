"""Tables of tests/gpu/run_gpu.sh's benchmark figures (gpu_bench.csv: part,
world, variant, size, value, unit), in Markdown: all_reduce over NCCL through
accel against c10d, the data-parallel step against Python's DDP, and the
sharded step against DDP, ZeroRedundancyOptimizer and FSDP2, for each
number of processes (one on NCCL; several sharing the GPU with Gloo). Each
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
        rows[(r["part"], int(r["world"]), r["variant"], int(r["size"]))].append(float(r["value"]))
    med = lambda part, variant, size: statistics.median(rows[(part, 1, variant, size)]) if rows.get((part, 1, variant, size)) else None
    out = []
    for part, title in (("gpu_all_reduce", "all_reduce of a CUDA tensor"),
                        ("gpu_all_reduce_staged", "all_reduce of CPU data staged through the GPU")):
        sizes = sorted({s for (p, _, _, s) in rows if p == part})
        if not sizes:
            continue
        out += [f"{title}, NCCL, a world of one (µs per call, each followed by a device synchronisation):", "",
                "| bytes | c10d | accel.hpp | ratio (c10d time / accel time) |", "|---|---|---|---|"]
        for s in sizes:
            raw, ours = med(part, "raw_c10d", s), med(part, "accel_tensor", s)
            out.append(f"| {s:,} | {raw:.1f} | {ours:.1f} | {raw / ours:.2f} |")
        out.append("")
    # The steps by world: one process on NCCL (variants ending in _cuda), or several processes sharing the
    # GPU with Gloo on CUDA tensors (_cuda_gloo).
    def by_world(part):
        found = collections.defaultdict(list)
        for (p, world, variant, _), values in rows.items():
            if p == part:
                found[(world, variant)] += values
        return found

    def setting(world, suffix):
        return "1, NCCL" if suffix == "_cuda" else f"{world}, Gloo on CUDA tensors"

    steps = by_world("ddp_step")
    if steps:
        out += ["Data-parallel training step on the GPU (bench_ddp: MLP 256-1024-1024-1024-1, batch 64 per process, "
                "SGD with momentum; ms per step, the loss read back each step on both sides; medians of every "
                "trial of every round):", "",
                "| processes, backend | accel.hpp ms/step | Python DDP ms/step | ratio (Python time / accel time) |",
                "|---|---|---|---|"]
        for world, suffix in sorted({(w, v[v.index("_cuda"):]) for (w, v) in steps if "_cuda" in v}):
            a, p = steps.get((world, "accel_accelerator" + suffix)), steps.get((world, "python_ddp" + suffix))
            a, p = (statistics.median(a) if a else None), (statistics.median(p) if p else None)
            ratio = f"{p / a:.2f}" if a and p else "-"
            out.append(f"| {setting(world, suffix)} | {a or float('nan'):.3f} | {p or float('nan'):.3f} | {ratio} |")
        out += ["", "(At one process the Accelerator wraps nothing, as Accelerate does; Python's DDP wraps its one "
                "process and all-reduces over NCCL.)"]
        losses = [f"{k[2]} at {k[1]} {v[-1]:.9g}" for k, v in rows.items() if k[0] == "ddp_loss"]
        out += ["", "Loss after the last step: " + ", ".join(sorted(losses)) + "."]
    shard = by_world("sharding_step_ms")
    if shard:
        out += ["", "Sharded data parallel on the GPU (bench_sharding: Adam on 4 x 2048 x 2048, batch 16 per process, "
                "every Linear a unit; ms per step, medians over the rounds of each process's median):", "",
                "| processes, backend | accel.hpp | ms/step | Python | ms/step | ratio (Python time / accel time) |",
                "|---|---|---|---|---|---|"]
        pairs = (("no_shard", "no_shard"), ("shard_grad_op", "zero"), ("shard_grad_op", "fsdp2_shard_grad_op"),
                 ("full_shard", "fsdp2_full_shard"))
        for world, suffix in sorted({(w, v[v.index("_cuda"):]) for (w, v) in shard if "_cuda" in v}):
            for ours, theirs in pairs:
                a, p = shard.get((world, ours + suffix)), shard.get((world, f"python_{theirs}{suffix}"))
                if a or p:
                    a, p = (statistics.median(a) if a else None), (statistics.median(p) if p else None)
                    ratio = f"{p / a:.2f}" if a and p else "- (a side failed)"
                    out.append(f"| {setting(world, suffix)} | {ours} | {a or float('nan'):.3f} | {theirs} | "
                               f"{p or float('nan'):.3f} | {ratio} |")
        out += ["", "(Python's no_shard is DDP with Adam; zero is DDP with ZeroRedundancyOptimizer; fsdp2_* is "
                "`fully_shard` on every Linear and the root.)"]
    print("\n".join(out))


if __name__ == "__main__":
    main()
