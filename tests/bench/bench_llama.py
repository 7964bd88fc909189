"""Python's side of run_llama_bench.sh: the LLaMA of examples/llama.hpp in PyTorch, trained with FSDP2's
fully_shard on the same model mesh (HSDP on a 2-D one) and the same Ulysses context parallelism on cp
(torch.distributed.nn.functional.all_to_all_single), AdamW, fp32, Gloo, one thread per process; or, with TP
above 1, with DTensor tensor parallelism: torchtitan's plan (llama::tp_plan's, sequence parallelism included)
and loss_parallel, over every process (no sharding), or, with TP below the world, on the inner dimension of a
(shard, tp) mesh with FSDP2's fully_shard along the outer one (torchtitan's FSDP + TP).

    torchrun-style launch: bench_llama.py MP_REPLICATE CP STEPS [TP [PP SCHEDULE MICROBATCHES]]
    (dp = world / cp, mp_shard = world / mp_replicate; with TP > 1: MP_REPLICATE and CP 1, dp = mp_shard =
    world / TP; with PP > 1: MP_REPLICATE, CP and TP 1, dp = world / PP)

With PP above 1, torch.distributed.pipelining as torchtitan's pipeline_llama: the layers split evenly into stages
(the embedding on the first, the norm and head on the last; llama::Stage's split), one stage per process for gpipe
and 1f1b, two for interleaved_1f1b (a loop) and zbv (a V), each stage FSDP2-sharded along dp beside pp, the
gradients clipped over every stage (the squared norms summed over the world, as train_llama's clip_grad_norm_ and
torchtitan's clip over pp).

Prints "bench: T tokens/s over steps a-b; peak RSS M MiB" (the largest VmHWM over the processes) on rank 0.
"""
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single  # autograd-aware (deprecated in 2.x for _functional_collectives)

LAYERS, SEQ, BATCH, VOCAB = 4, 128, 16, 256
# train_llama's --hidden 128 --intermediate 352; BENCH_LLAMA_HIDDEN / _INTERMEDIATE give run_llama_bench.sh's small set.
HIDDEN, INTERMEDIATE = int(os.environ.get("BENCH_LLAMA_HIDDEN", "128")), int(os.environ.get("BENCH_LLAMA_INTERMEDIATE", "352"))
# train_llama's 4 heads sharing 2 key/value heads; run_llama_bench.sh's tp set takes 8 and 4 (tp 4 splits them).
HEADS, KV_HEADS = int(os.environ.get("BENCH_LLAMA_HEADS", "4")), int(os.environ.get("BENCH_LLAMA_KV_HEADS", "2"))


def ulysses(x, cp, to_heads):
    """[B, T/cp, h, d] <-> [B, T, h/cp, d] along the cp group (examples/llama.hpp's to_heads / to_sequence)."""
    P = dist.get_world_size(cp)
    if to_heads:
        B, Tl, h, d = x.shape
        out = all_to_all_single(torch.empty_like(x.permute(2, 0, 1, 3).contiguous()),
                                x.permute(2, 0, 1, 3).contiguous(), group=cp)
        return out.view(P, h // P, B, Tl, d).permute(2, 0, 3, 1, 4).reshape(B, P * Tl, h // P, d)
    B, T, hl, d = x.shape
    chunks = x.view(B, P, T // P, hl, d).permute(1, 3, 0, 2, 4).contiguous().view(P * hl, B, T // P, d)
    out = all_to_all_single(torch.empty_like(chunks), chunks, group=cp)
    return out.permute(1, 2, 0, 3)


class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def rotate(x, cos, sin):
    t = x.transpose(1, 2)
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        d = HIDDEN // HEADS
        self.q, self.k = torch.nn.Linear(HIDDEN, HEADS * d, bias=False), torch.nn.Linear(HIDDEN, KV_HEADS * d, bias=False)
        self.v, self.o = torch.nn.Linear(HIDDEN, KV_HEADS * d, bias=False), torch.nn.Linear(HEADS * d, HIDDEN, bias=False)

    def forward(self, h, cos, sin, cp):
        B, Tl, _ = h.shape
        d = HIDDEN // HEADS
        # (-1: under tp the projections hold their share of the heads)
        q, k, v = self.q(h).view(B, Tl, -1, d), self.k(h).view(B, Tl, -1, d), self.v(h).view(B, Tl, -1, d)
        if cp is not None:
            q, k, v = (ulysses(t, cp, True) for t in (q, k, v))
        T, hq, hk = q.shape[1], q.shape[2], k.shape[2]
        q, k, v = rotate(q, cos, sin), rotate(k, cos, sin), v.transpose(1, 2)
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        scores = (q @ k.transpose(2, 3)) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = (torch.softmax(scores.float(), -1).to(q.dtype) @ v).transpose(1, 2)
        if cp is not None:
            out = ulysses(out.contiguous(), cp, False)
        return self.o(out.reshape(B, Tl, -1))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False), torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), Mlp()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()

    def forward(self, x, cos, sin, cp):
        x = x + self.attn(self.norm1(x), cos, sin, cp)
        return x + self.mlp(self.norm2(x))


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm, self.head = RMSNorm(), torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, cp):
        P = dist.get_world_size(cp) if cp is not None else 1
        T, d = ids.shape[1] * P, HIDDEN // HEADS
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(T).float(), inv)
        angles = torch.cat((freqs, freqs), -1)
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, angles.cos(), angles.sin(), cp)
        return self.head(self.norm(h))


def peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def report(start, first_timed, steps, rank, distributed):
    """The final line (tokens/s since `start`, the largest peak RSS over the processes), then the exit."""
    seconds = time.perf_counter() - start
    peak = torch.tensor([peak_rss_mib()])
    if distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = BATCH * SEQ * (steps - first_timed)
        print(f"bench: {tokens / seconds:.0f} tokens/s over steps {first_timed + 1}-{steps}; peak RSS {peak.item():.0f} MiB",
              flush=True)
    if distributed:
        dist.barrier()
    os._exit(0)  # (no teardown: torch 2.15's FSDP2 on Gloo can abort there; the figures are out)


def tensor_parallel(model, mesh):
    """torchtitan's plan for Llama (examples/llama.hpp's llama::tp_plan, this model's names) on a tp mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(LAYERS):
        plan.update({f"layers.{i}.norm1": SequenceParallel(), f"layers.{i}.norm2": SequenceParallel(),
                     f"layers.{i}.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                            desired_input_layouts=(Replicate(), None, None, None)),
                     f"layers.{i}.attn.q": ColwiseParallel(), f"layers.{i}.attn.k": ColwiseParallel(),
                     f"layers.{i}.attn.v": ColwiseParallel(),
                     f"layers.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                     f"layers.{i}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"layers.{i}.mlp.gate": ColwiseParallel(), f"layers.{i}.mlp.up": ColwiseParallel(),
                     f"layers.{i}.mlp.down": RowwiseParallel(output_layouts=Shard(1))})
    return parallelize_module(model, mesh, plan)


class Stage(torch.nn.Module):
    """Stage k of S of the whole model (llama::Stage's split: the first L % S stages one layer more)."""

    def __init__(self, whole, k, S):
        super().__init__()
        per, extra = LAYERS // S, LAYERS % S
        first = k * per + min(k, extra)
        self.embed = whole.embed if k == 0 else None
        self.layers = torch.nn.ModuleDict({str(i): whole.layers[i] for i in range(first, first + per + (k < extra))})
        self.norm, self.head = (whole.norm, whole.head) if k == S - 1 else (None, None)

    def forward(self, x):
        T, d = x.shape[1], HIDDEN // HEADS
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(T).float(), inv)
        angles = torch.cat((freqs, freqs), -1)
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h, angles.cos(), angles.sin(), None)
        return self.head(self.norm(h)) if self.head is not None else h


def train_pipelined(pp, schedule_name, microbatches, steps):
    """PP above 1: the stages, the schedule, and the steps; prints the same line as main()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleZBVZeroBubble)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    r, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    two = schedule_name not in ("gpipe", "1f1b")
    S = pp * (2 if two else 1)
    indices = [r] + ([2 * pp - 1 - r if schedule_name == "zbv" else r + pp] if two else [])
    torch.manual_seed(0)
    whole = Llama()
    stages, parts = [], []
    for k in indices:
        part = Stage(whole, k, S)
        if dp > 1:  # each stage's units sharded along dp (torchtitan's FSDP per stage)
            for unit in [part.embed, *part.layers.values(), part.norm, part.head]:
                if unit is not None:
                    fully_shard(unit, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
            for module in part.modules():  # (pytorch#162338, as main())
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
                    module.set_gradient_divide_factor(float(dp))
        parts.append(part)
        stages.append(PipelineStage(part, k, S, torch.device("cpu"), group=mesh["pp"].get_group()))
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
    if two:
        kind = ScheduleZBVZeroBubble if schedule_name == "zbv" else ScheduleInterleaved1F1B
        schedule = kind(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        schedule = (ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B)(
            stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    per_dp = BATCH // dp
    first_here, last_here = 0 in indices, S - 1 in indices
    start, first_timed = None, 5
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)[dp_rank * per_dp:(dp_rank + 1) * per_dp]
        x, y = ids[:, :SEQ], ids[:, 1:]
        args = (x,) if first_here else ()
        schedule.step(*args, target=y if last_here else None)
        # clip over every stage and shard: each rank's squared norm of its own pieces, summed over the world
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        total = torch.stack([g.pow(2).sum() for g in local]).sum() if local else torch.zeros(())
        dist.all_reduce(total)
        scale = min(1.0, 1.0 / (total.sqrt().item() + 1e-6))
        for g in local:
            g.mul_(scale)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == first_timed:
            start = time.perf_counter()
    report(start, first_timed, steps, rank, distributed=True)


def main():
    replicate, cp_size, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    if len(sys.argv) > 5 and int(sys.argv[5]) > 1:
        assert replicate == 1 and cp_size == 1 and tp == 1, "bench_llama.py: PP with dp only"
        return train_pipelined(int(sys.argv[5]), sys.argv[6], int(sys.argv[7]), steps)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = Llama()
    cp, dp_rank, dp = None, 0, world // cp_size
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        assert world % tp == 0 and replicate == 1 and cp_size == 1, "bench_llama.py: TP with sharding only"
        dp = world // tp
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("shard", "tp"))
        model = tensor_parallel(model, mesh["tp"])
        if dp > 1:  # FSDP + TP: the pieces sharded along the outer dimension, the units as accel's
            dp_rank = mesh.get_local_rank("shard")
            for unit in [model.embed, *model.layers, model.norm, model.head]:
                fully_shard(unit, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
            for module in model.modules():  # (pytorch#162338, as below)
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
                    module.set_gradient_divide_factor(float(dp))
    elif distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        data_mesh = init_device_mesh("cpu", (dp, cp_size), mesh_dim_names=("dp", "cp"))
        cp = data_mesh["cp"].get_group() if cp_size > 1 else None
        dp_rank = data_mesh.get_local_rank("dp")
        shape, names = ((replicate, world // replicate), ("replicate", "shard")) if replicate > 1 else ((world,), ("shard",))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for unit in [model.embed, *model.layers, model.norm, model.head]:  # accel's units (llama::is_unit)
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in model.modules():  # Gloo's AVG sums in FSDP2 (pytorch#162338): sum, then divide as we do
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(float(world))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    per_dp, slice_len = BATCH // dp, SEQ // cp_size
    cp_rank = rank % cp_size
    start, first_timed = None, 5
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)[dp_rank * per_dp:(dp_rank + 1) * per_dp]
        x = ids[:, cp_rank * slice_len:(cp_rank + 1) * slice_len]
        y = ids[:, 1 + cp_rank * slice_len:1 + (cp_rank + 1) * slice_len]
        if tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():  # (the logits split over the vocabulary; the backward inside it too)
                loss = F.cross_entropy(model(x, cp).flatten(0, 1), y.flatten(0, 1))
                loss.backward()
        else:
            loss = F.cross_entropy(model(x, cp).reshape(-1, VOCAB).float(), y.reshape(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == first_timed:
            start = time.perf_counter()
    report(start, first_timed, steps, rank, distributed)


if __name__ == "__main__":
    main()
