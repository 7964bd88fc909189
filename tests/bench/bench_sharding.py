"""Python's side of the sharding benchmark: bench_sharding.cpp's MLP, batch and
Adam under DistributedDataParallel, with torch's ZeroRedundancyOptimizer
(optimizer state sharded by whole parameters; "zero") or a plain Adam
("no_shard"); or under FSDP2 (torch >= 2.7: `fully_shard` on every Linear
and the root, as accel's units; "fsdp2_full_shard" reshards after forward,
ZeRO-3, "fsdp2_shard_grad_op" does not, ZeRO-2; "fsdp2_full_shard_bf16":
ZeRO-3 under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32,
output_dtype=float32), bench_sharding.cpp's full_shard_bf16; "fsdp2_hybrid_shard":
ZeRO-3 on a (2, world / 2) mesh, replicated along the first dimension and
sharded along the second, HSDP, bench_sharding.cpp's hybrid_shard). FSDP2's averaging on
Gloo sums (pytorch#162338); set_force_sum_reduction_for_comms(True) makes it
sum and divide, as the accel side does. Rank 0 prints, the largest over the
processes,
    CSV,sharding_<figure>,<world>,python_<variant>,<params>,<value>,<unit>
for grads_mb and optimizer_mb (held by tensors between two steps) and
step_ms (median of the trials). Python has no CPU allocator counter, so no
between_steps_mb or peak_mb. With ACCEL_BENCH_DEVICE=cuda: NCCL and the
GPU (the variant ends in _cuda), as bench_sharding.cpp on a GPU. no_shard_fused
and zero_fused: the same with Adam(fused=True), as bench_sharding.cpp's
accel::FusedAdam variants. Run under tests/launch.cpp.

A variant starting with gpt_ (gpt_no_shard, gpt_fsdp2_full_shard) trains
bench_sharding.cpp's small GPT-2-shaped decoder instead (tests/python_ref/
fsdp2_ref.py's Gpt, the same model as tests/gpt_model.hpp's: 4 blocks, hidden
64, its head tied to the token embedding, 8 sequences of 64 tokens per
process): under DDP, or FSDP2 with `fully_shard` per block and on the root.

forward_ms, backward_ms and optimizer_ms are the step's phases (medians).
With "collectives" after <steps> (no_shard): DDP's all-reduces alone, as
bench_sharding.cpp's collectives mode (collectives_ms, collectives_cpu_ms).

    bench_sharding.py [gpt_]<no_shard|zero|fsdp2_full_shard|fsdp2_shard_grad_op|fsdp2_full_shard_bf16|fsdp2_hybrid_shard>[_fused] <trials> <steps> [collectives]
"""

import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

WIDTH, LAYERS, BATCH = 2048, 4, 16
# The gpt_ variants: bench_sharding.cpp's kGpt, kGptBatch and kGptTime.
GPT = dict(vocab=512, positions=64, width=64, heads=4, layers=4)
GPT_BATCH, GPT_TIME = 8, 64


def resident_mb(field="VmRSS"):
    """This process's resident memory (VmRSS) or its peak since the last reset (VmHWM), MiB, from /proc."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_resident():
    with open("/proc/self/clear_refs", "w") as f:  # "5": the peak (VmHWM) starts again from VmRSS
        f.write("5")


def collectives_alone(ddp, trials, steps, report):
    """DDP's all-reduces alone, with no compute: its buckets' sizes (DDP's logging data: the buckets it rebuilt
    after the first step, the same 16, 32 and 16 MiB as accel's; at construction it logs one), each all-reduced by
    Gloo, issued in order and waited for at the end; wall (the slowest process) and CPU time per process per
    step, medians of the trials: bench_sharding.cpp's collectives mode."""
    logged = ddp._get_ddp_logging_data()  # (the buckets as rebuilt after the first step, where torch logs them)
    sizes = [int(b) for b in str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", "")).split(",")
             if b.strip()]
    buffers = [torch.randn(max(1, b // 4)) for b in sizes]  # (bytes of float32 gradients)

    def one_step():
        for work in [dist.all_reduce(b, async_op=True) for b in buffers]:
            work.wait()

    one_step()
    wall, cpu = [], []
    for _ in range(trials):
        dist.barrier()
        cpu_start, start = time.process_time(), time.perf_counter()
        for _ in range(steps):
            one_step()
        wall.append((time.perf_counter() - start) / steps * 1e3)
        cpu.append((time.process_time() - cpu_start) / steps * 1e3)
    report("collectives_ms", statistics.median(wall), "ms")
    report("collectives_cpu_ms", statistics.median(cpu) / dist.get_world_size(), "ms", dist.ReduceOp.SUM)


def main():
    variant = sys.argv[1] if len(sys.argv) > 1 else "zero"
    fused = variant.endswith("_fused")  # Adam(fused=True): torch's fused kernel (on the CPU from torch 2.4)
    gpt = variant.startswith("gpt_")
    kind = variant.removesuffix("_fused").removeprefix("gpt_")
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    cuda = os.environ.get("ACCEL_BENCH_DEVICE") == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # ACCEL_BENCH_BACKEND=gloo: Gloo on CUDA tensors (several processes sharing one GPU; the variant ends in _cuda_gloo).
    backend = os.environ.get("ACCEL_BENCH_BACKEND") or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    suffix = ("_cuda" if cuda else "") + ("_gloo" if cuda and backend == "gloo" else "")
    rss_before = resident_mb()  # (the interpreter, torch and the process group: what no variant changes)
    torch.manual_seed(0)
    if gpt:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python_ref"))
        from fsdp2_ref import Gpt, next_token_loss
        model = Gpt(tied=True, **GPT).to(device)
    else:
        layers = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        model = nn.Sequential(*layers).to(device)
    if kind.startswith("fsdp2_"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        world = dist.get_world_size()
        mesh = (init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if kind == "fsdp2_hybrid_shard" else init_device_mesh(device.type, (world,)))
        reshard = kind != "fsdp2_shard_grad_op"
        policy = MixedPrecisionPolicy()
        if kind == "fsdp2_full_shard_bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          output_dtype=torch.float32)
        # A unit per Linear, or per block of the decoder (its root holding the embeddings and the tie)
        for layer in (model.transformer.h if gpt else model):
            if gpt or isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        ddp = fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        for module in ddp.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    else:
        ddp = nn.parallel.DistributedDataParallel(model)
    if kind == "zero":
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4, fused=fused)
    else:
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=fused)
    params = sum(p.numel() for p in model.parameters())  # (parameters() lists a tied tensor once)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    if gpt:
        tokens = torch.randint(GPT["vocab"], (GPT_BATCH, GPT_TIME), generator=g).to(device)
    else:
        x, y = torch.randn(BATCH, WIDTH, generator=g).to(device), torch.randn(BATCH, WIDTH, generator=g).to(device)

    def forward_loss():
        if gpt:
            return next_token_loss(ddp(tokens), tokens)
        return nn.functional.mse_loss(ddp(x), y)

    phases = []  # per step: forward, backward (with DDP's wait for its all-reduces), optimizer step; ms

    def step():
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = forward_loss()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        phases.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t2) * 1e3))

    for _ in range(2):
        step()
    def local(t):  # an FSDP2 parameter is a DTensor: this process's shard
        return t.to_local() if hasattr(t, "to_local") else t

    grads = sum(local(p.grad).numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    inner = optimizer.optim if kind == "zero" else optimizer
    state = sum(local(t).numel() * t.element_size() for s in inner.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    rss_between = resident_mb()
    if not cuda:
        reset_peak_resident()
    times = []
    phases.clear()
    cpu_start = time.process_time()  # every thread of this process: bench_sharding.cpp's cpu_ms
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append((time.perf_counter() - start) / steps * 1e3)
    cpu_per_step = (time.process_time() - cpu_start) / (trials * steps) * 1e3

    def report(figure, value, unit, op=dist.ReduceOp.MAX):
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        if dist.get_rank() == 0:
            print(f"CSV,sharding_{figure},{dist.get_world_size()},python_{variant}{suffix},{params},{t.item():.6g},{unit}",
                  flush=True)

    report("grads_mb", grads / 2**20, "MiB")
    report("optimizer_mb", state / 2**20, "MiB")
    if not cuda:  # resident memory that training added (the allocator's free blocks it kept count too)
        report("rss_between_mb", rss_between - rss_before, "MiB")
        report("rss_peak_mb", resident_mb("VmHWM") - rss_before, "MiB")
    report("step_ms", statistics.median(times), "ms")
    for k, name in enumerate(("forward_ms", "backward_ms", "optimizer_ms")):
        report(name, statistics.median(p[k] for p in phases), "ms")
    if kind == "no_shard" and not cuda and len(sys.argv) > 4 and sys.argv[4] == "collectives":
        collectives_alone(ddp, trials, steps, report)
    report("cpu_ms", cpu_per_step, "ms", dist.ReduceOp.SUM)  # all processes together
    # Every figure is out. No teardown: torch 1.13's can deadlock when a DDP model goes (seen at 4 processes: the
    # main thread in ~Reducer -> ~ProcessGroupGloo waiting for the group's mutex while its worker thread, holding
    # it, frees a tensor and waits for the GIL), which left a run spinning until the launcher's timeout.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
