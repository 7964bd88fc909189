"""Accelerate itself as the reference for accel.hpp's prepared data loaders
(CTest python_accelerate_2, tests/python_ref/run_accelerate.sh).

    python3 accelerate_ref.py DIR     on every rank (accel_launch 2)

For each case of CASES (the same list as tests/test_training_data.cpp's suite
python_accelerate), Accelerate prepares a DataLoader over samples 0..n-1 with
that case's options, and each process writes to DIR/py_rank<r>.txt the
batches it receives and what gather_for_metrics gives back for each (not
with even_batches=False, where processes get different numbers of batches):

    <case> batch: <values...>
    <case> gathered: <values...>

run_accelerate.sh compares these files with the C++ side's, line for line.
"""
import os
import sys

import torch
import torch.distributed
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, Dataset

from leave import leave_without_teardown

# name, samples, batch size, split_batches, even_batches, dispatch_batches, drop_last
CASES = [
    ("default_10_2", 10, 2, False, True, False, False),
    ("default_11_2", 11, 2, False, True, False, False),
    ("default_13_3", 13, 3, False, True, False, False),
    ("drop_last_11_3", 11, 3, False, True, False, True),
    ("split_12_4", 12, 4, True, True, False, False),
    ("split_13_4", 13, 4, True, True, False, False),
    ("uneven_11_2", 11, 2, False, False, False, False),
    ("uneven_13_3", 13, 3, False, False, False, False),
    ("dispatch_10_2", 10, 2, False, True, True, False),
    ("dispatch_13_2", 13, 2, False, True, True, False),
]


class Samples(Dataset):
    # tests/training_fixtures.hpp's Indexed: sample i is [i]
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def line(case, what, tensor):
    return f"{case} {what}: " + " ".join(str(v) for v in tensor.reshape(-1).tolist())


def main(root):
    lines = []
    for name, n, batch, split, even, dispatch, drop_last in CASES:
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
            split_batches=split, even_batches=even, dispatch_batches=dispatch))
        loader = accelerator.prepare(DataLoader(Samples(n), batch_size=batch, drop_last=drop_last))
        for values in loader:
            lines.append(line(name, "batch", values))
            if even:  # (uneven: processes get different numbers of batches, so no collective per batch)
                lines.append(line(name, "gathered", accelerator.gather_for_metrics(values)))
        accelerator.wait_for_everyone()
    rank = int(os.environ["RANK"])
    with open(os.path.join(root, f"py_rank{rank}.txt"), "w") as out:
        out.write("\n".join(lines) + "\n")
    leave_without_teardown()  # (leave.py: a teardown that aborts now and then)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
