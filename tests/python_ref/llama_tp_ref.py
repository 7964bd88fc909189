"""torchtitan's tensor-parallel plan in Python (DTensor, loss_parallel; FSDP2 along the outer dimension) against
examples/train_llama --tp (tests/llama_tp_check.sh): the same LLaMA, the same start, the same batches in the same
order, the same learning-rate schedule, clipping and AdamW.

    llama_tp_ref.py start HF_DIR SEQ
        one process: a LlamaForCausalLM initialised by transformers (llama_check.py's) saved to HF_DIR; this file's
        model (LlamaForCausalLM's parameter names, examples/llama.hpp's operations) loaded from there gives
        transformers' logits on train_llama's fixed input
    llama_tp_ref.py train HF_DIR OUT TP STEPS SEQ BATCH WARMUP
        every rank (accel_launch N, or one process with TP 1): train_llama's run with --import HF_DIR --tp TP
        --steps STEPS --seq SEQ --batch BATCH --warmup WARMUP (its default lr, clipping, seed and corpus): tp over
        TP processes, FSDP2's fully_shard along world / TP (train_llama's mp_shard) when that is above 1. Writes
        OUT/losses.txt (one per step, the mean over every token of the step), OUT/model.safetensors (the whole
        trained parameters) and, without FSDP2, OUT/collectives.txt: what CommDebugMode counts in the second step
        (forward, backward, clipping and the optimizer step), by kind.

train_llama's data, rebuilt: the corpus's bytes (every regular file of the directory, in name order), windows of
SEQ + 1 bytes at a stride of SEQ, the order torch.randperm under a generator seeded with the seed (0) plus the
epoch (0), cut into batches of BATCH / dp and dealt to the dp ranks in turn (accel's ShardSampler, BATCHES).
"""
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from leave import leave_without_teardown

# train_llama's defaults (examples/train_llama.cpp's Options)
LR, CLIP, SEED, CORPUS, BETAS, WEIGHT_DECAY = 3e-3, 1.0, 0, "/usr/share/common-licenses", (0.9, 0.95), 0.1


def read_config(hf_dir):
    import json
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    assert not c.get("tie_word_embeddings", False), "llama_tp_ref: this model's head is its own (untied)"
    if "rope_theta" not in c:  # (transformers 5 keeps it in rope_parameters)
        c["rope_theta"] = c["rope_parameters"]["rope_theta"]
    return c


class RMSNorm(torch.nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def linear(i, o):
    return torch.nn.Linear(i, o, bias=False)


def rotate(x, cos, sin):
    t = x.transpose(1, 2)
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin


class Attention(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.d = c["hidden_size"] // c["num_attention_heads"]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.q_proj, self.k_proj = linear(c["hidden_size"], heads * self.d), linear(c["hidden_size"], kv * self.d)
        self.v_proj, self.o_proj = linear(c["hidden_size"], kv * self.d), linear(heads * self.d, c["hidden_size"])

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        # (-1: under tp the projections hold their share of the heads)
        q, k, v = (p(x).view(B, T, -1, self.d) for p in (self.q_proj, self.k_proj, self.v_proj))
        hq, hk = q.shape[2], k.shape[2]
        q, k, v = rotate(q, cos, sin), rotate(k, cos, sin), v.transpose(1, 2)
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        scores = (q @ k.transpose(2, 3)) / math.sqrt(self.d)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out = (torch.softmax(scores.float(), -1).to(q.dtype) @ v).transpose(1, 2)
        return self.o_proj(out.reshape(B, T, -1))


class Mlp(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj, self.down_proj = linear(h, i), linear(h, i), linear(i, h)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), Mlp(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Llama(torch.nn.Module):
    """examples/llama.hpp's model under LlamaForCausalLM's names."""

    def __init__(self, c):
        super().__init__()
        self.c, self.model, self.lm_head = c, Body(c), linear(c["hidden_size"], c["vocab_size"])

    def forward(self, ids):
        d = self.c["hidden_size"] // self.c["num_attention_heads"]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(ids.shape[1]).float(), inv)
        angles = torch.cat((freqs, freqs), -1)
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, angles.cos(), angles.sin())
        return self.lm_head(self.model.norm(h))


def load(hf_dir):
    model = Llama(read_config(hf_dir))
    missing, unexpected = model.load_state_dict(load_file(os.path.join(hf_dir, "model.safetensors")), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def tp_plan(layers):
    """torchtitan's plan for Llama (parallelize_llama), sequence parallelism included: examples/llama.hpp's
    llama::tp_plan, entry for entry."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(layers):
        p = f"model.layers.{i}."
        plan.update({p + "input_layernorm": SequenceParallel(), p + "post_attention_layernorm": SequenceParallel(),
                     p + "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                         desired_input_layouts=(Replicate(), None, None)),
                     p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(),
                     p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                     p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def windows(seq):
    """train_llama's dataset: [n, seq + 1] windows of the corpus's bytes at a stride of seq."""
    names = sorted(os.path.join(CORPUS, f) for f in os.listdir(CORPUS))
    text = b"".join(open(p, "rb").read() for p in names if os.path.isfile(p) and not os.path.islink(p))
    data = torch.tensor(list(text), dtype=torch.long)
    n = (len(text) - 1) // seq
    return torch.stack([data[i * seq:i * seq + seq + 1] for i in range(n)])


def learning_rate(step, steps, warmup):
    """train_llama's schedule: linear warmup to LR, then cosine decay to LR / 10 at the last step."""
    if step < warmup:
        return LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return LR * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def train(hf_dir, out, tp, steps, seq, batch, warmup):
    import contextlib
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    model = load(hf_dir)
    dp, dp_rank, dp_group, parallel = world // tp, 0, None, tp > 1
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
        dist.init_process_group("gloo")
        assert tp > 1 and world % tp == 0, "llama_tp_ref: tp over the world, or along the inner dimension"
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan(len(model.model.layers)))
        if dp > 1:  # FSDP + TP: the pieces sharded along dp, train_llama's units (llama::is_unit)
            dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
            for unit in [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]:
                fully_shard(unit, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            for module in model.modules():  # Gloo's AVG sums in FSDP2 (pytorch#162338): sum, then divide
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
                    module.set_gradient_divide_factor(float(dp))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    data = windows(seq)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + 0))
    per = batch // dp
    losses, counts = [], {}

    def one_step(step):
        ids = data[order[(step * dp + dp_rank) * per:(step * dp + dp_rank + 1) * per]]
        x, y = ids[:, :-1], ids[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, warmup)
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel() if parallel else contextlib.nullcontext():  # its backward inside it too
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        return full(loss.detach())

    for step in range(steps):
        if step == 1 and parallel and dp == 1:  # the steady step: CommDebugMode's counts (FSDP2's would add dp's)
            from torch.distributed.tensor.debug import CommDebugMode
            comm = CommDebugMode()
            with comm:
                loss = one_step(step)
            counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        else:
            loss = one_step(step)
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss = loss / dp
        losses.append(float(loss))
    whole = {name: full(p).contiguous() for name, p in model.named_parameters()}
    if world == 1 or dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        save_file(whole, os.path.join(out, "model.safetensors"))
        with open(os.path.join(out, "losses.txt"), "w") as f:
            f.write("".join(f"{v!r}\n" for v in losses))
        if counts:
            with open(os.path.join(out, "collectives.txt"), "w") as f:
                f.write("".join(f"{kind} {n}\n" for kind, n in sorted(counts.items())))
        print(f"llama_tp_ref: Python trained {steps} steps on {world} process(es), tp {tp}, dp {dp}"
              + (f"; the second step's collectives (CommDebugMode): {counts}" if counts else ""), flush=True)
    if world > 1:
        leave_without_teardown()


def start(hf_dir, seq):
    import transformers
    from llama_check import fixed_input, make
    make(hf_dir, seq)
    ids = fixed_input(seq)
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        expected, got = reference(ids).logits, load(hf_dir)(ids)
    difference = (got - expected).abs().max().item()
    print(f"llama_tp_ref: this model (LlamaForCausalLM's names) against transformers {transformers.__version__}: "
          f"largest logit difference {difference:.3g} (tolerance 1e-4)")
    assert difference <= 1e-4, difference


def main():
    command = sys.argv[1]
    if command == "start":
        start(sys.argv[2], int(sys.argv[3]))
    elif command == "train":
        hf_dir, out = sys.argv[2], sys.argv[3]
        tp, steps, seq, batch, warmup = map(int, sys.argv[4:9])
        train(hf_dir, out, tp, steps, seq, batch, warmup)
    else:
        sys.exit(f"llama_tp_ref: unknown command {command}")


if __name__ == "__main__":
    main()
