"""Python's side of the data-parallel training benchmark: the MLP, sizes,
optimizer and step of bench_ddp.cpp under torch.nn.parallel.
DistributedDataParallel (Gloo, default 25 MB buckets). Rank 0 prints
    CSV,ddp_step,<world>,python_ddp,<params>,<ms per step>,ms
once per trial. Run each rank with Debian's /usr/bin/python3 under
tests/launch.cpp (run_ddp_bench.sh does).

    bench_ddp.py <trials> <steps>
"""

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
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, 1, generator=g)

    def step():
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()

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
            print(f"CSV,ddp_step,{dist.get_world_size()},python_ddp,{params},{ms:.6g},ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
