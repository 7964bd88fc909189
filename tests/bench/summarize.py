"""Turns tests/bench/results/results.csv into results.md (tables with ratios
and a verdict per target) and bench.png (accel.hpp's throughput relative to
raw c10d by message size). Standard library only; gnuplot draws the plot."""

import collections
import csv
import os
import platform
import statistics
import subprocess
import sys


def load(path):
    values = collections.defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            key = (row["part"], int(row["world"]), row["variant"], int(row["size"]))
            values[key].append(float(row["value"]))
    return {key: statistics.median(v) for key, v in values.items()}


def fmt_size(n):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def verdict(ok):
    return "met" if ok else "NOT met"


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


def main():
    path, out = sys.argv[1], sys.argv[2]
    m = load(path)
    get = lambda part, world, variant, size: m.get((part, world, variant, size))
    lines = [f"Machine: {machine()}. Medians over interleaved trials; ratios are accel.hpp / reference.", ""]
    targets = []

    # 1. Overhead
    raw = get("overhead", 2, "raw_c10d", 4)
    acc = get("overhead", 2, "accel_all_reduce", 4)
    itf = get("overhead", 2, "accel_interface_dp", 4)
    pyt = get("overhead", 2, "python_torch", 4)
    again = get("overhead", 2, "raw_c10d_again", 4)
    cg_raw = get("callgrind", 1, "raw_c10d", 4)
    cg_acc = get("callgrind", 1, "accel_all_reduce", 4)
    lines += ["### 1. Overhead: all_reduce of one float, 2 ranks", "",
              "| variant | µs per call | ratio to raw c10d |", "|---|---:|---:|"]
    for name, v in (("raw c10d `allreduce()->wait()`", raw), ("`accel::all_reduce(t, SUM, group)`", acc),
                    ("`DistributedInterface::all_reduce(t, SUM, Dim::DP)`", itf),
                    ("raw c10d again (A/A control: the noise floor)", again), ("Python `dist.all_reduce`", pyt)):
        if v is not None:
            lines.append(f"| {name} | {v:.2f} | {v / raw:.3f} |")
    if cg_raw and cg_acc:
        lines += ["", f"Instructions per call at world size 1 (callgrind, deterministic): raw c10d {cg_raw:.0f}, "
                  f"accel.hpp {cg_acc:.0f}, ratio {cg_acc / cg_raw:.3f} (+{cg_acc - cg_raw:.0f})."]
        targets.append(("overhead within 2% of raw c10d (callgrind instructions)", cg_acc / cg_raw <= 1.02,
                        f"{cg_acc / cg_raw:.3f}"))
    if raw and acc:
        noise = f"; A/A control {again / raw:.3f}" if again else ""
        targets.append(("overhead within 2% of raw c10d (wall time, 2 ranks)", acc / raw <= 1.02,
                        f"{acc / raw:.3f}{noise}"))

    # 2. Bandwidth
    lines += ["", "### 2. Bandwidth: accel.hpp vs raw c10d", "",
              "`all_gather` returns a new stacked tensor; its reference is raw c10d producing the same "
              "result (fresh outputs, then `at::stack`). `all_gather_list` compares the same accel call "
              "with raw c10d's own result, P separate fresh tensors (no stack). `all_gather_into` is "
              "`accel::all_gather_into_tensor` into a reused buffer against raw c10d with reused outputs.", "",
              "| op | ranks | size | raw µs | accel µs | throughput ratio (raw/accel) | std::vector µs |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    worst = {}
    plot_rows = []
    for op in ("all_reduce", "all_gather", "all_gather_list", "all_gather_into", "broadcast"):
        for world in (2, 4):
            sizes = sorted({k[3] for k in m if k[0] == op and k[1] == world})
            for size in sizes:
                r = get(op, world, "raw_c10d", size)
                a = get(op, world, "accel_tensor", size)
                vec = get(op, world, "accel_vector", size)
                if r is None or a is None:
                    continue
                ratio = r / a
                plot_rows.append((op, world, size, ratio))
                if size >= 1 << 20 and op != "all_gather_list":  # the list is not the same result
                    worst[(op, world)] = min(worst.get((op, world), 9), ratio)
                lines.append(f"| {op} | {world} | {fmt_size(size)} | {r:.1f} | {a:.1f} | {ratio:.3f} | "
                             f"{'' if vec is None else f'{vec:.1f}'} |")
    if worst:
        low = min(worst.values())
        targets.append(("bandwidth ≥ 0.97× raw at every size ≥ 1 MiB", low >= 0.97, f"lowest {low:.3f}"))
    alloc = {v: get("alloc_bytes_per_call", 2, v, 4 << 20)
             for v in ("control_at_empty", "raw_c10d_tensor", "accel_tensor", "accel_vector")}
    if None not in alloc.values():
        lines += ["", "Bytes requested from ATen's CPU allocator per all_reduce of 4 MiB (counted, 2 ranks): "
                  f"raw c10d tensor {alloc['raw_c10d_tensor']:.0f}, accel tensor {alloc['accel_tensor']:.0f}, "
                  f"accel `std::vector<float>` {alloc['accel_vector']:.0f} (control: the counter sees "
                  f"{alloc['control_at_empty']:.0f} bytes for an `at::empty` of the same size)."]
        targets.append(("no extra copy for a contiguous CPU std::vector (allocator bytes)",
                        alloc["accel_vector"] <= alloc["raw_c10d_tensor"], f"{alloc['accel_vector']:.0f} B"))

    # 3. Batching
    lines += ["", "### 3. Batching: a std::vector<double> all-reduced, 2 ranks", "",
              "| values | accel.hpp µs | c10d calls | one collective per element µs | speed-up | raw c10d tensor µs | Python list→tensor µs |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in (1, 100, 10000):
        a = get("batching", 2, "accel_vector", n)
        p = get("batching", 2, "per_element", n)
        calls = get("batching_collectives", 2, "accel_vector", n)
        py = get("batching", 2, "python_torch", n)
        if a is None or p is None:
            continue
        raw_t = get("batching", 2, "raw_c10d_tensor", n)
        lines.append(f"| {n} | {a:.1f} | {calls:.0f} | {p:.1f} | {p / a:.1f}× | "
                     f"{'' if raw_t is None else f'{raw_t:.1f}'} | {'' if py is None else f'{py:.1f}'} |")
        if n == 100:
            targets.append(("one collective and ≥ 20× faster than per-element at 100 values",
                            calls == 1 and p / a >= 20, f"{calls:.0f} call, {p / a:.1f}×"))

    # 4. Mesh initialisation
    lines += ["", "### 4. Mesh initialisation: both 2-D meshes, (2, w/2 | w/2, 2)", "",
              "| world | accel.hpp ms | groups per rank | Python new_group ms | new_group calls per rank | ratio |",
              "|---:|---:|---:|---:|---:|---:|"]
    for world in (2, 4, 8, 16):
        a = get("mesh_init", world, "accel", world)
        py = "python_init_device_mesh" if get("mesh_init", world, "python_init_device_mesh", world) else "python_new_group"
        p = get("mesh_init", world, py, world)
        ga = get("mesh_groups_per_rank", world, "accel_subgroups", world)
        gp = get("mesh_groups_per_rank", world, py + "_calls", world)
        if a is None or p is None:
            continue
        lines.append(f"| {world} | {a:.0f} | {ga:.0f} | {p:.0f} | {gp:.0f} | {a / p:.2f} |")
        if world == 8:
            targets.append(("mesh init ≤ 0.5× Python's time at world 8", a / p <= 0.5, f"{a / p:.2f}"))
    groups = {get("mesh_groups_per_rank", w, "accel_subgroups", w) for w in (2, 4, 8, 16)} - {None}
    if groups:
        targets.append(("a constant 4 groups per rank", groups == {4.0}, ", ".join(f"{g:.0f}" for g in sorted(groups))))

    # 5. Compile cost
    cs = {tu: get("compile_seconds", 1, tu, 0) for tu in ("accel", "aten", "torch")}
    cm = {tu: get("compile_peak_mib", 1, tu, 0) for tu in ("accel", "aten", "torch")}
    if None not in cs.values():
        lines += ["", "### 5. Compile cost of one translation unit (g++ -std=c++20 -c, no optimisation)", "",
                  "| includes | wall s | peak MiB | ratio to ATen-only |", "|---|---:|---:|---:|"]
        for tu, name in (("accel", "`accel.hpp`"), ("aten", "`<ATen/ATen.h>`"), ("torch", "`<torch/torch.h>`")):
            lines.append(f"| {name} | {cs[tu]:.1f} | {cm[tu]:.0f} | {cs[tu] / cs['aten']:.2f} |")
        targets.append(("compile ≤ 1.25× the ATen-only file", cs["accel"] / cs["aten"] <= 1.25,
                        f"{cs['accel'] / cs['aten']:.2f}"))

    # 6. Python latency by size
    rows = [(s, get("all_reduce", 2, "python_torch", s), get("all_reduce", 2, "accel_tensor", s))
            for s in sorted({k[3] for k in m if k[0] == "all_reduce" and k[2] == "python_torch"})]
    if rows:
        lines += ["", "### 6. Per-call latency of all_reduce, Python torch.distributed vs accel.hpp, 2 ranks", "",
                  "| size | Python µs | accel.hpp µs | Python / accel |", "|---:|---:|---:|---:|"]
        if pyt and acc:
            lines.append(f"| 4 B | {pyt:.1f} | {acc:.1f} | {pyt / acc:.2f} |")
        for s, p, a in rows:
            if p and a:
                lines.append(f"| {fmt_size(s)} | {p:.1f} | {a:.1f} | {p / a:.2f} |")

    lines += ["", "### Targets", "", "| target | measured | verdict |", "|---|---:|---|"]
    lines += [f"| {name} | {value} | {verdict(ok)} |" for name, ok, value in targets]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print(text)

    # The plot: throughput ratio by size, one line per op and world size.
    data = os.path.join(out, "bandwidth_ratio.dat")
    with open(data, "w") as f:
        for op in ("all_reduce", "all_gather", "all_gather_list", "all_gather_into", "broadcast"):
            for world in (2, 4):
                pts = [(s, r) for o, w, s, r in plot_rows if o == op and w == world]
                if pts:
                    f.write(f'"{op}, {world} ranks"\n')
                    f.writelines(f"{s} {r:.4f}\n" for s, r in pts)
                    f.write("\n\n")
    script = f"""
set terminal png size 1000,560 noenhanced
set output '{os.path.join(out, "bench.png")}'
set title 'accel.hpp throughput relative to raw c10d, by message size (higher is better)'
set logscale x 2
set xtics ('4 KiB' 4096, '16 KiB' 16384, '64 KiB' 65536, '256 KiB' 262144, '1 MiB' 1048576, '4 MiB' 4194304, '16 MiB' 16777216, '64 MiB' 67108864)
set xrange [3000:90000000]
set xlabel 'message size'
set ylabel 'raw c10d time / accel.hpp time'
set yrange [0.6:1.6]
set key outside right
set grid
plot for [i=0:9] '{data}' index i using 1:2 with linespoints title columnheader(1), \\
     0.97 with lines dashtype 2 lc rgb 'red' title 'target 0.97', 1.0 with lines lc rgb 'gray' title 'parity'
"""
    try:
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"gnuplot failed: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
