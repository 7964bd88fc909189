"""The Python torch.distributed side of accel.hpp's benchmarks.

Run each rank with Debian's /usr/bin/python3 (python3-torch 1.13 on bookworm,
2.6 on trixie; Gloo)
under tests/launch.cpp; rank 0 prints CSV lines in bench.cpp's format:
    CSV,<part>,<world>,<variant>,<size>,<value>,<unit>

    bench_torch.py latency | batching | collectives | mesh
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def csv(part, variant, size, value, unit):
    if dist.get_rank() == 0:
        print(f"CSV,{part},{dist.get_world_size()},{variant},{size},{value:.6g},{unit}", flush=True)


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def timed(fn, trials, reps):
    samples = []
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - start) / reps)
    return median(samples)


def latency():
    # The same sizes as bench.cpp's overhead (1 float) and bandwidth parts.
    t = torch.ones(1)
    csv("overhead", "python_torch", 4, timed(lambda: dist.all_reduce(t), 31, 2000) * 1e6, "us")
    nbytes = 4 << 10
    while nbytes <= 64 << 20:
        t = torch.ones(nbytes // 4)
        reps = min(max((256 << 20) // nbytes // 8, 2), 200)
        trials = 5 if nbytes >= 16 << 20 else 9
        csv("all_reduce", "python_torch", nbytes, timed(lambda: dist.all_reduce(t), trials, reps) * 1e6, "us")
        nbytes *= 4


def batching():
    # A Python list of floats reduced the way a Python user would: one tensor
    # from the list, one all_reduce, back to a list.
    for n in (1, 100, 10000):
        values = [1.0] * n

        def reduce_list():
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t)
            return t.tolist()

        reps = 3 if n >= 10000 else 20
        trials = 3 if n >= 10000 else 9
        csv("batching", "python_torch", n, timed(reduce_list, trials, reps) * 1e6, "us")


def mesh():
    # Python's way to build the same two 2-D meshes: init_device_mesh where
    # torch has it (2.2 on), else (1.13) new_group for every sub-group, which
    # is what init_device_mesh does underneath for Gloo.
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    shapes = ((2, world // 2), (world // 2, 2))  # (mp_replicate, mp_shard) and (dp, cp)
    try:
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        init_device_mesh = None
    dist.barrier()
    start = time.perf_counter()
    # accel.hpp's timed initialisation builds its own world group besides the
    # meshes; Python's was built by init_process_group before the clock
    # started, so one more world-sized group here keeps the work equal.
    dist.new_group(list(range(world)))
    calls = 1
    if init_device_mesh is not None:
        variant = "python_init_device_mesh"
        for (rows, cols), names in zip(shapes, (("mp_replicate", "mp_shard"), ("dp", "cp"))):
            init_device_mesh("cpu", (rows, cols), mesh_dim_names=names)
            calls += rows + cols  # one new_group per row and per column, on every rank
    else:
        variant = "python_new_group"
        for rows, cols in shapes:
            grid = [[i * cols + j for j in range(cols)] for i in range(rows)]
            for j in range(cols):  # along dim 0: the columns
                dist.new_group([grid[i][j] for i in range(rows)])
                calls += 1
            for i in range(rows):  # along dim 1: the rows
                dist.new_group(grid[i])
                calls += 1
    seconds = time.perf_counter() - start
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    csv("mesh_init", variant, world, slowest.item() * 1e3, "ms")
    csv("mesh_groups_per_rank", variant + "_calls", world, calls, "groups")
    dist.destroy_process_group()


def collectives():
    # bench.cpp's collectives part, as a Python user writes it. Gloo in torch
    # 1.13 has no reduce_scatter: that row is absent there.
    world, rank = dist.get_world_size(), dist.get_rank()
    for nbytes in (64 << 10, 1 << 20, 16 << 20):
        n = nbytes // 4 // world * world
        reps = min(max((64 << 20) // nbytes // 4, 2), 100)
        t, out = torch.ones(n), torch.empty(n)
        try:
            part = torch.empty(n // world)
            dist.reduce_scatter_tensor(part, t)
            csv("reduce_scatter", "python_torch", nbytes,
                timed(lambda: dist.reduce_scatter_tensor(part, t), 9, reps) * 1e6, "us")
        except (RuntimeError, AttributeError):
            pass
        csv("all_to_all", "python_torch", nbytes, timed(lambda: dist.all_to_all_single(out, t), 9, reps) * 1e6, "us")

        def pingpong():
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
        csv("send_recv", "python_torch", nbytes, timed(pingpong, 9, reps) * 1e6, "us")


def main():
    part = sys.argv[1] if len(sys.argv) > 1 else ""
    if part == "mesh":
        mesh()
        return
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if part == "latency":
        latency()
    elif part == "batching":
        batching()
    elif part == "collectives":
        collectives()
    else:
        print("usage: bench_torch.py latency|batching|collectives|mesh", file=sys.stderr)
        sys.exit(2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
