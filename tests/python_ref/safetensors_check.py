"""The Python side of the safetensors round trip (CTest safetensors_python).

    python3 safetensors_check.py DIR

DIR holds what the C++ side wrote (tests/test_training_checkpoints.cpp, suite
python_safetensors, "write"): cpp/ (model.safetensors, from
Accelerator::save_model), cpp_sharded/ (shards and model.safetensors.index.json)
and io.safetensors (inputs x and the C++ model's outputs y). Python loads both
layouts into the same architecture with strict load_state_dict and must give
the same outputs, bit for bit. Then it writes py/model.safetensors (another
initialisation, with safetensors' save_file) and py_io.safetensors (x and its
outputs) for the C++ side ("read") to load.

With transformers (the pip leg; --gpt2): gpt2/ is a tied GPT-2-shaped model the
C++ side exported in GPT-2's layout through a state-dict adapter, with
gpt2_io.safetensors (tokens and its logits): GPT2LMHeadModel.from_pretrained
must load it with no key missing, unexpected or mismatched, tie the head, and
give those logits. Then it saves a GPT2LMHeadModel of its own (save_pretrained)
to py_gpt2/ with py_gpt2_io.safetensors, for the C++ side to load.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file


class Net(torch.nn.Module):
    # tests/training_fixtures.hpp's Net: the same names (body.0.weight, body.1.running_mean, ...)
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)


def outputs(state, x):
    net = Net().eval()
    net.load_state_dict(state, strict=True)  # every name, no other
    with torch.no_grad():
        return net(x)


def main(root):
    io = load_file(os.path.join(root, "io.safetensors"))
    x, y = io["x"], io["y"]
    single = load_file(os.path.join(root, "cpp", "model.safetensors"))
    assert torch.equal(outputs(single, x), y), "C++ weights give other outputs in Python"

    index_path = os.path.join(root, "cpp_sharded", "model.safetensors.index.json")
    index = json.load(open(index_path))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, shards
    sharded = {}
    for shard in shards:
        sharded.update(load_file(os.path.join(root, "cpp_sharded", shard)))
    assert set(sharded) == set(index["weight_map"])
    total = sum(t.numel() * t.element_size() for t in sharded.values())
    assert index["metadata"]["total_size"] == total, (index["metadata"], total)
    assert torch.equal(outputs(sharded, x), y), "sharded C++ weights give other outputs in Python"
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name

    torch.manual_seed(1)
    net = Net().eval()
    with torch.no_grad():  # non-trivial running statistics, so the buffers matter
        net.body[1].running_mean.uniform_(-1, 1)
        net.body[1].running_var.uniform_(0.5, 2)
        net.body[1].num_batches_tracked.fill_(7)
        py_y = net(x)
    os.makedirs(os.path.join(root, "py"), exist_ok=True)
    save_file(net.state_dict(), os.path.join(root, "py", "model.safetensors"))
    save_file({"x": x, "y": py_y}, os.path.join(root, "py_io.safetensors"))
    print(f"safetensors_check: C++ weights ({len(single)} tensors, 1 file and {len(shards)} shards) give the C++ "
          f"outputs in Python; Python weights written")


def gpt2(root):
    import transformers
    io = load_file(os.path.join(root, "gpt2_io.safetensors"))
    model, info = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(root, "gpt2"), attn_implementation="eager",
                                                                output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "the head is not tied"
    model.eval()
    with torch.no_grad():
        difference = (model(io["tokens"]).logits - io["logits"]).abs().max().item()
    assert difference <= 1e-5, difference  # (Conv1D's addmm against Linear's: the same sums in another order)

    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(model.config).eval()
    with torch.no_grad():
        for p in model.parameters():  # every tensor away from its initial value, LayerNorms included
            p.add_(torch.randn_like(p) * 0.05)
        logits = model(io["tokens"]).logits
    model.save_pretrained(os.path.join(root, "py_gpt2"))
    save_file({"tokens": io["tokens"], "logits": logits}, os.path.join(root, "py_gpt2_io.safetensors"))
    print(f"safetensors_check: transformers {transformers.__version__} loaded the C++ GPT-2 export (tied, Conv1D "
          f"layout): largest logit difference {difference:.3g}; a GPT2LMHeadModel saved for the C++ side")


if __name__ == "__main__":
    main(sys.argv[1])
    if "--gpt2" in sys.argv:
        gpt2(sys.argv[1])
