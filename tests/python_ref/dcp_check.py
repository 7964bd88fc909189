"""Python's torch.distributed.checkpoint (DCP) reading a sharded checkpoint of
accel.hpp (CTest checkpoint_resize, tests/resize_check.sh).

    python3 dcp_check.py CHECKPOINT WHOLE [CHECKPOINT WHOLE...]
                                    one process, or each rank under accel_launch N

Each pair is checked in turn, on a model and an optimizer of its own (one
start of Python for several checkpoints: importing torch is most of a run).

CHECKPOINT holds what each saving process wrote of the test's Mlp(4, 16, 1)
and of its Adam's state (checkpoint/shards.hpp: safetensors with
DCP_SHARDING_INFO); WHOLE/model.safetensors the same model gathered
(Accelerator::save_model) and WHOLE/optimizer.safetensors Adam's state
gathered, under the checkpoint's names. On one process the model is plain;
on more it is sharded by fully_shard (parameters and Adam's moments
DTensors, each rank loading only its rows). Either way
dcp.load(..., storage_reader=HuggingFaceStorageReader(CHECKPOINT)) fills the
model (its state_dict names) and Adam's state ({"optimizer": {"state": ...}},
as get_optimizer_state_dict nests it), and every full tensor must equal the
gathered one exactly. Exits 77 (skipped) where torch has no
HuggingFaceStorageReader.
"""
import os
import sys

import torch
import torch.distributed as dist

from leave import leave_without_teardown

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
except ImportError:
    print(f"SKIP: torch {torch.__version__} has no HuggingFaceStorageReader")
    sys.exit(77)
from safetensors.torch import load_file


class Mlp(torch.nn.Module):
    # tests/training_fixtures.hpp's Mlp(4, 16, 1): the same names (body.0.weight, ...)
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)


def check(checkpoint, whole, mesh):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(5)  # weights unlike the saved ones: the load must replace every one
    model = Mlp()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.body:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # Adam's state as Python keeps it, made by one step (get_optimizer_state_dict's own way) before the load.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.zeros(1, 4)).sum().backward()
    adam.step()
    reader = lambda: HuggingFaceStorageReader(checkpoint)  # (one reader per load)
    state = model.state_dict()
    dcp.load(state, storage_reader=reader())
    model.load_state_dict(state)
    expected = load_file(os.path.join(whole, "model.safetensors"))
    assert sorted(expected) == sorted(model.state_dict()), (sorted(expected), sorted(model.state_dict()))
    loaded = dict(model.state_dict())
    optimizer = {"state": get_optimizer_state_dict(model, adam)["state"]}
    dcp.load({"optimizer": optimizer}, storage_reader=reader())
    set_optimizer_state_dict(model, adam, {"state": optimizer["state"],
                                           "param_groups": get_optimizer_state_dict(model, adam)["param_groups"]})
    for fqn, values in get_optimizer_state_dict(model, adam)["state"].items():
        for key, value in values.items():
            loaded[f"optimizer.state.{fqn}.{key}"] = value
    expected.update(load_file(os.path.join(whole, "optimizer.safetensors")))
    assert sorted(expected) == sorted(loaded), (sorted(expected), sorted(loaded))
    for name, value in loaded.items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if not torch.equal(full, expected[name]):
            raise SystemExit(f"{name}: DCP loaded {full}, the C++ run holds {expected[name]}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"DCP on {world} process(es): {len(expected)} tensors (the model's, Adam's state) of {checkpoint} "
              "equal to the C++ run's")


def main(pairs):
    if not pairs or len(pairs) % 2:
        raise SystemExit("usage: dcp_check.py CHECKPOINT WHOLE [CHECKPOINT WHOLE...]")
    mesh = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for checkpoint, whole in zip(pairs[::2], pairs[1::2]):
        check(checkpoint, whole, mesh)
    if dist.is_initialized():
        leave_without_teardown()  # every rank has checked (leave.py: a teardown that aborts now and then)


if __name__ == "__main__":
    main(sys.argv[1:])
