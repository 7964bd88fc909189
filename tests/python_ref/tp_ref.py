"""Python's DTensor tensor parallelism as the reference for accel::tp's Megatron layers
(CTest python_tp_*, tests/python_ref/run_tp.sh).

    python3 tp_ref.py data DIR                 one process: the start and the batches
    python3 tp_ref.py train DIR MODE...        every rank (accel_launch N): Python trains each MODE
    python3 tp_ref.py compare DIR WORLD MODE...  one process: Python's, accel.hpp's and one process's
    python3 tp_ref.py dcp DIR MODE...          every rank: Python's DCP loads accel.hpp's checkpoints

The model (tests/test_training_tp.cpp's, name for name): a token embedding whose weight
the head shares (tied), BLOCKS identical pre-norm MLP blocks with residuals (LayerNorm,
Linear H -> F, exact GELU, Linear F -> H), a final LayerNorm; the loss is cross entropy
over the vocabulary with torch's default ignore_index (-100) on some targets. float64.

MODE, both with tp = the world, parallelize_module with torchtitan's styles:
  tp     embedding RowwiseParallel (Replicate output), up ColwiseParallel, down
         RowwiseParallel, head ColwiseParallel(Shard(-1), use_local_output=False) under
         loss_parallel; norms whole (no sequence parallelism)
  tp_sp  the same with sequence parallelism: the embedding's and the downs' outputs
         Shard(1), the ups' and the head's inputs Shard(1), every norm SequenceParallel

  fsdp_tp_sp  tp_sp on the inner dimension of a (dp, tp 2) mesh, FSDP2's fully_shard
         (each block, then the root) along dp: torchtitan's FSDP + TP; each dp rank trains
         its half of every batch, the loss recorded is the mean over dp (on 4 processes)

  plan_tp, plan_tp_sp, plan_fsdp_tp_sp  accel.hpp's side only: the same plan applied to a
         plain C++ model through accel::tp::parallelize_module (tests/test_training_tp_plan.cpp;
         the last under the Accelerator's FULL_SHARD along mp_shard, the blocks' layers its units),
         compared with Python's tp, tp_sp and fsdp_tp_sp (Python has one way; it trains those)

Both sides start from DIR/init.safetensors, run STEPS AdamW steps on DIR/batches.safetensors
(ids and targets, [steps, batch, sequence], the same on every rank) and write each step's
loss and the trained whole parameters: Python DIR/py_MODE_WORLD.safetensors, accel.hpp
DIR/cpp_MODE_WORLD.safetensors. Each also writes the collectives one step issues (forward,
backward and the optimizer step): Python's counted by CommDebugMode, by kind; accel.hpp's
by the tp group's sequence number (every kind together). compare checks both against one
process training the whole model (under dp, the mean of the halves' losses), each other,
and that accel.hpp issues at most what Python does (not under FSDP: Python's count takes in
FSDP2's gathers and reduce-scatters on dp, accel.hpp's the tp group's alone).

Under fsdp_tp_sp Python also saves its trained model and AdamW's state with dcp.save through
HuggingFaceStorageWriter (each rank its pieces: DIR/py_MODE_WORLD_dcp; and consolidated into one file and an
index: _dcp_consolidated), which accel.hpp's plan_fsdp_tp_sp reads back with load_model, into its own layout and
into a whole model, and with load_state into its own layout: Python's trained parameters and AdamW's state
exactly.
Under plan_fsdp_tp_sp accel.hpp also saves its state after training (save_state: each process
its shards of its tensor-parallel pieces, placed in the whole tensors, DIR/cpp_MODE_WORLD_checkpoint),
and dcp loads it with torch.distributed.checkpoint's HuggingFaceStorageReader into Python's
fsdp_tp_sp model (2-D DTensors: another placement) and AdamW: every parameter equal to accel.hpp's
trained one exactly, AdamW's state within 1e-9 of Python's own after the same steps
(DIR/py_MODE_WORLD_optimizer.safetensors).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from leave import leave_without_teardown

VOCAB, HIDDEN, FFN, BATCH, SEQ, BLOCKS, STEPS = 48, 10, 36, 4, 12, 2, 4
LR, WEIGHT_DECAY = 1e-2, 0.1


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, FFN)
        self.down = torch.nn.Linear(FFN, HIDDEN)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def fresh_model(root):
    model = Model().double()
    start = load_file(os.path.join(root, "init.safetensors"))
    missing, unexpected = model.load_state_dict(start, strict=False)
    assert missing == ["head.weight"] and not unexpected, (missing, unexpected)  # head.weight: the tie
    return model


def optimizer_for(parameters):
    return torch.optim.AdamW(parameters, lr=LR, weight_decay=WEIGHT_DECAY)


def make_data(root):
    torch.manual_seed(0)
    model = Model().double()
    with torch.no_grad():  # LayerNorm's start is ones and zeros: moved off them, so a wrong norm gradient shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"},
              os.path.join(root, "init.safetensors"))
    ids = torch.randint(VOCAB, (STEPS, BATCH, SEQ))
    targets = torch.randint(VOCAB, (STEPS, BATCH, SEQ))
    targets[:, 0, :3] = -100
    save_file({"ids": ids, "targets": targets}, os.path.join(root, "batches.safetensors"))


def parallelize(model, mode, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    sp = mode.endswith("tp_sp")
    sequence = Shard(1) if sp else Replicate()
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        "head": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(BLOCKS):
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=sequence)
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=sequence)
        if sp:
            plan[f"blocks.{i}.norm"] = SequenceParallel()
    if sp:
        plan["norm"] = SequenceParallel()
    parallelize_module(model, mesh, plan)
    model.head.weight = model.embed.weight  # tied again: both Shard(0) over the vocabulary
    return model


def run_steps(model, batches, parallel, counts=None, dp=1, dp_rank=None, dp_group=None, optimizer=None, steps=STEPS):
    """STEPS AdamW steps; each step's loss. parallel: the loss under loss_parallel (logits split along the
    vocabulary; its backward must run inside it too). counts: filled with the first step's collectives.
    dp > 1: the batch cut in dp parts, the loss the mean of theirs: this rank's part (dp_rank, the mean taken
    over dp_group for the record), or in one process (dp_rank None) all of them."""
    import contextlib
    from torch.distributed.tensor.parallel import loss_parallel
    optimizer = optimizer or optimizer_for(model.parameters())
    losses = []
    for step in range(steps):
        def one_step():
            with loss_parallel() if parallel else contextlib.nullcontext():
                ids, targets = batches["ids"][step].chunk(dp), batches["targets"][step].chunk(dp)
                parts = range(dp) if dp_rank is None else [dp_rank]
                loss = sum(F.cross_entropy(model(ids[k]).flatten(0, 1), targets[k].flatten(0, 1)) for k in parts)
                loss = loss / len(parts)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss = loss.detach()
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            if dp_group is not None:
                dist.all_reduce(loss, group=dp_group)
                loss = loss / dp
            return loss
        if counts is not None and step == 0:
            from torch.distributed.tensor.debug import CommDebugMode
            comm = CommDebugMode()
            with comm:
                loss = one_step()
            for op, n in comm.get_comm_counts().items():
                counts[str(op).split(".")[-1]] = n
        else:
            loss = one_step()
        losses.append(float(loss))
    return losses


def fsdp_tp_model(root, mode):
    """The fsdp_tp_sp model: tp_sp's plan on the inner dimension of a (dp, tp 2) mesh, fully_shard along dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(fresh_model(root), mode, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def train(root, mode):
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    counts, batches = {}, load_file(os.path.join(root, "batches.safetensors"))
    if mode.startswith("fsdp_"):
        model, mesh = fsdp_tp_model(root, mode)
        optimizer = optimizer_for(model.parameters())
        losses = run_steps(model, batches, True, counts, world // 2, mesh.get_local_rank("dp"), mesh["dp"].get_group(),
                           optimizer)
        state = {f"optimizer.state.{name}.{key}": full(value).contiguous()
                 for name, p in model.named_parameters() for key, value in optimizer.state[p].items()}
        if dist.get_rank() == 0:
            save_file(state, os.path.join(root, f"py_{mode}_{world}_optimizer.safetensors"))
        # Python's own checkpoint of the trained model and its AdamW state, each rank its pieces of the 2-D
        # DTensors, for accel.hpp's load_model and load_state to read (test_training_tp_plan.cpp); the optimizer's
        # tensors alone (the writer pickles anything else into a file its own reader cannot read back)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        # (the tied head's weight as a copy of its own: safetensors stores no tensor twice, and the C++ model, tied
        # as LibTorch ties, keeps a registered head.weight of its own that a load must fill)
        state = {k: v.clone() if k == "head.weight" else v for k, v in model.state_dict().items()}
        state["optimizer"] = {"state": get_optimizer_state_dict(model, optimizer)["state"]}
        for name, consolidated in (("dcp", False), ("dcp_consolidated", True)):
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(
                os.path.join(root, f"py_{mode}_{world}_{name}"), save_distributed=True,
                enable_consolidation=consolidated))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        model = parallelize(fresh_model(root), mode, mesh)
        losses = run_steps(model, batches, True, counts)
    # (without sequence parallelism the norms are not parallelized: plain tensors)
    whole = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
             for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        out = {name: t.contiguous() for name, t in whole.items() if name != "head.weight"}
        out["losses"] = torch.tensor(losses, dtype=torch.float64)
        save_file(out, os.path.join(root, f"py_{mode}_{world}.safetensors"))
        kinds = sorted(counts)
        print(f"Python {mode} on {world}: one step's collectives (CommDebugMode): " +
              ", ".join(f"{k} {counts[k]}" for k in kinds) + f"; {sum(counts.values())} in all")
        save_file({"collectives": torch.tensor([sum(counts.values())])},
                  os.path.join(root, f"py_{mode}_{world}_counts.safetensors"))


def python_mode(mode):
    """The Python run a mode is compared with: plan_tp is Python's tp, plan_tp_sp its tp_sp."""
    return mode.removeprefix("plan_")


def compare(root, mode, world):
    reference = fresh_model(root)
    fsdp = mode.startswith("plan_fsdp_")
    one = run_steps(reference, load_file(os.path.join(root, "batches.safetensors")), False, dp=world // 2 if fsdp else 1)
    ours = load_file(os.path.join(root, f"cpp_{mode}_{world}.safetensors"))
    python = load_file(os.path.join(root, f"py_{python_mode(mode)}_{world}.safetensors"))
    for side, got in (("Python", python), ("accel.hpp", ours)):
        losses = got["losses"].tolist()
        assert len(losses) == STEPS, f"{side}: {len(losses)} losses"
        for step, (a, b) in enumerate(zip(losses, one)):
            assert abs(a - b) <= 1e-12 * abs(b), f"{side} step {step}: loss {a!r}, one process {b!r}"
        for name, p in reference.named_parameters():
            if name == "head.weight":
                continue
            worst = (got[name] - p.detach()).abs().max().item()
            assert worst <= 1e-10, f"{side} {name}: differs from one process by {worst:.3e}"
    for name in python:
        worst = (ours[name] - python[name]).abs().max().item()
        assert worst <= 1e-10, f"{name}: accel.hpp and Python differ by {worst:.3e}"
    ours_n = int(load_file(os.path.join(root, f"cpp_{mode}_{world}_counts.safetensors"))["collectives"])
    python_n = int(load_file(os.path.join(root, f"py_{python_mode(mode)}_{world}_counts.safetensors"))["collectives"])
    print(f"{mode} on {world}: losses and parameters after {STEPS} AdamW steps equal one process's (1e-12 and "
          f"1e-10) on both sides; collectives per step: accel.hpp {ours_n}" + (" on the tp group" if fsdp else "") +
          f", Python {python_n}" + (" (FSDP2's on dp included: not compared)" if fsdp else ""))
    assert fsdp or ours_n <= python_n, f"accel.hpp issues {ours_n} collectives per step, Python {python_n}"


def dcp_load(root, mode):
    """accel.hpp's checkpoint of MODE (saved with FULL_SHARD along mp_shard 2 and tp 2) loaded by DCP into
    Python's fsdp_tp_sp model and AdamW (their state made by one step, as get_optimizer_state_dict needs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    world = dist.get_world_size()
    checkpoint = os.path.join(root, f"cpp_{mode}_{world}_checkpoint")
    model, mesh = fsdp_tp_model(root, python_mode(mode))
    optimizer = optimizer_for(model.parameters())
    batches = load_file(os.path.join(root, "batches.safetensors"))
    run_steps(model, batches, True, None, world // 2, mesh.get_local_rank("dp"), mesh["dp"].get_group(), optimizer,
              steps=1)  # (one step: moves every weight off the saved values too)
    # (head.weight is the embedding's tensor here; the C++ model's own registered head.weight is unused)
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(checkpoint))
    optim = {"state": get_optimizer_state_dict(model, optimizer)["state"]}
    dcp.load({"optimizer": optim}, storage_reader=HuggingFaceStorageReader(checkpoint))
    set_optimizer_state_dict(model, optimizer, {"state": optim["state"],
                                                "param_groups": get_optimizer_state_dict(model, optimizer)["param_groups"]})
    ours = load_file(os.path.join(root, f"cpp_{mode}_{world}.safetensors"))
    python = load_file(os.path.join(root, f"py_{python_mode(mode)}_{world}_optimizer.safetensors"))
    checked = 0
    for name, p in model.named_parameters():
        if not torch.equal(full(p), ours[name]):
            raise SystemExit(f"{name}: DCP loaded {full(p)}, accel.hpp trained {ours[name]}")
        for key, value in optimizer.state[p].items():
            want = python[f"optimizer.state.{name}.{key}"]
            worst = (full(value) - want).abs().max().item()
            if worst > 1e-9:
                raise SystemExit(f"{name} {key}: DCP loaded accel.hpp's, {worst:.3e} from Python's own")
            checked += 1
    if dist.get_rank() == 0:
        print(f"{mode} on {world}: DCP loaded accel.hpp's checkpoint into Python's FSDP2 + TP DTensors: "
              f"{len(ours) - 1} parameters equal to accel.hpp's, {checked} tensors of AdamW's state within 1e-9 "
              "of Python's own")


def main():
    command, root = sys.argv[1], sys.argv[2]
    if command == "data":
        make_data(root)
    elif command == "train":
        dist.init_process_group("gloo")
        for mode in dict.fromkeys(python_mode(m) for m in sys.argv[3:]):  # each Python run once, in order
            train(root, mode)
        leave_without_teardown()
    elif command == "dcp":
        dist.init_process_group("gloo")
        for mode in sys.argv[3:]:
            if os.path.isdir(os.path.join(root, f"cpp_{mode}_{dist.get_world_size()}_checkpoint")):
                dcp_load(root, mode)
        leave_without_teardown()
    elif command == "compare":
        failed = []
        for mode in sys.argv[4:]:
            try:
                compare(root, mode, int(sys.argv[3]))
            except AssertionError as e:
                print(f"FAILED {mode}: {e}")
                failed.append(mode)
        if failed:
            sys.exit(f"tp_ref: {', '.join(failed)} differ")
    else:
        sys.exit(f"tp_ref: unknown command {command}")


if __name__ == "__main__":
    main()
