"""Python's side of the pipeline benchmark: bench_pipeline.cpp's model, stages, batch, micro-batches and SGD
with torch.distributed.pipelining's PipelineStage and the same schedule (Gloo, CPU). Rank 0 prints per trial
    CSV,pp_step,<world>,python_<schedule>,<microbatches>,<ms per step (median)>,ms
Run each rank with the pip leg's Python under tests/launch.cpp (run_pipeline_bench.sh does).

    bench_pipeline.py <schedule> <microbatches> <trials> <steps>
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S

IN, HIDDEN, OUT, BLOCKS, BATCH = 256, 1024, 16, 8, 64


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def make_stage(k, stages):
    layers = [nn.Linear(IN, HIDDEN)] if k == 0 else []
    layers += [Residual() for _ in range(BLOCKS // stages)]
    layers += [nn.Linear(HIDDEN, OUT)] if k == stages - 1 else []
    return nn.Sequential(*layers)


def main():
    name, m, trials, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    looped = name not in ("gpipe", "1f1b")
    total = 2 * world if looped else world
    indices = [rank] + ([2 * world - 1 - rank if name in ("zbv", "dualpipev") else rank + world] if looped else [])
    torch.manual_seed(0)
    modules = [make_stage(k, total) for k in indices]
    stages = [PipelineStage(mod, k, total, torch.device("cpu")) for mod, k in zip(modules, indices)]
    classes = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "interleaved_1f1b": S.ScheduleInterleaved1F1B,
               "zbv": S.ScheduleZBVZeroBubble, "dualpipev": S.ScheduleDualPipeV}
    mse = lambda output, target: F.mse_loss(output, target)
    schedule = classes[name](stages if looped else stages[0], m, loss_fn=mse)
    optimizer = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=1e-3)
    first, last = 0 in indices, total - 1 in indices
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)

    def step():
        began = time.perf_counter()
        schedule.step(*((x,) if first else ()), target=y if last else None)
        optimizer.step()
        optimizer.zero_grad()
        return (time.perf_counter() - began) * 1e3

    for _ in range(3):
        step()
    for _ in range(trials):
        dist.barrier()
        times = [step() for _ in range(steps)]
        if rank == 0:
            print(f"CSV,pp_step,{world},python_{name},{m},{statistics.median(times):.6g},ms", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
