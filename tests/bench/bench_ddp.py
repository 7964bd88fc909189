"""Python's side of the data-parallel training benchmark: the MLP, sizes,
optimizer and step of bench_ddp.cpp under torch.nn.parallel.
DistributedDataParallel (Gloo, default 25 MB buckets), with or without a
communication hook (fp16: default_hooks.fp16_compress_hook; powersgd:
powerSGD_hook of rank 1 from step 2). Rank 0 prints
    CSV,ddp_step,<world>,python_ddp[_fp16],<params>,<ms per step>,ms
once per trial, and its loss after the last step (ddp_loss). Run each rank
with the leg's Python under tests/launch.cpp (run_ddp_bench.sh does).
With ACCEL_BENCH_DEVICE=cuda: NCCL and the GPU (the variant ends in _cuda), as
bench_ddp.cpp on a machine with one.

    bench_ddp.py <trials> <steps> [none|fp16|powersgd]
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

IN, HIDDEN, BATCH = 256, 1024, 64


def main():
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    hook = sys.argv[3] if len(sys.argv) > 3 else "none"
    cuda = os.environ.get("ACCEL_BENCH_DEVICE") == "cuda"
    variant = ("python_ddp" if hook == "none" else f"python_ddp_{hook}") + ("_cuda" if cuda else "")
    if cuda and os.environ.get("ACCEL_BENCH_BACKEND") == "gloo":
        variant += "_gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # ACCEL_BENCH_BACKEND=gloo: Gloo on CUDA tensors (several processes sharing one GPU; the variant ends in _cuda_gloo).
    backend = os.environ.get("ACCEL_BENCH_BACKEND") or ("nccl" if cuda else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x, y = torch.randn(BATCH, IN, generator=g).to(device), torch.randn(BATCH, 1, generator=g).to(device)

    loss = [0.0]

    def step():
        optimizer.zero_grad()
        l = nn.functional.mse_loss(ddp(x), y)
        l.backward()
        optimizer.step()
        loss[0] = l.item()

    for _ in range(5):  # warm-up
        step()
    for _ in range(trials):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        ms = (time.perf_counter() - start) / steps * 1e3
        if dist.get_rank() == 0:
            print(f"CSV,ddp_step,{dist.get_world_size()},{variant},{params},{ms:.6g},ms", flush=True)
    if dist.get_rank() == 0:
        print(f"CSV,ddp_loss,{dist.get_world_size()},{variant},{params},{loss[0]:.9g},mse", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
