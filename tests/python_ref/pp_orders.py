"""torch.distributed.pipelining's schedule orders against accel.hpp's (core/pipeline_orders.hpp), live.

    python3 pp_orders.py dump DIR      torch's compute-only order of every case into DIR/torch_CASE.csv
                                       (DIR/torch_CASE.err with the message where torch refuses the case)
    python3 pp_orders.py compare DIR   ours (DIR/ours_CASE.csv or .err, written by the test binary's
                                       python_pp suite) against torch's, case by case

A case is SCHEDULE_RANKS_STAGESPERRANK_MICROBATCHES over the grid below (ZBV, DualPipeV: 2 stages per rank,
in a V). The
schedules are made on stages that stand in for real ones (the order needs only their indices and the
group's size: no process group, no model), as torch's own test_schedule.py does with its mock stages.
Interleaved 1F1B, Looped BFS, the zero-bubble schedules and DualPipeV dump their order with torch's
_dump_csv(format="compute_only"): ours must be the same bytes. GPipe and 1F1B have no _dump_csv; their
pipeline_order (what torch's tools draw) is compared as each rank's sequence of forwards and backwards,
without torch's empty slots and gradient reduction, and with its 1F1B naming the last rank's forwards
1..m where its step runs 0..m-1 (docs/differences.md).

Each of our orders is also lowered for running (core/pipeline_lowering.hpp: the sends and receives put in
each rank's list, DIR/lowered_ours_CASE.csv) and compared byte for byte with torch's _add_send_recv applied
to the same compute-only order (read back with torch's _Action.from_str; DualPipeV's compound
OVERLAP_F_B actions given as their sub-actions one after the other, as both runtimes run them).
"""
import csv
import io
import pathlib
import sys

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.stage import _PipelineStageBase

SCHEDULES = {"gpipe": S.ScheduleGPipe, "1f1b": S.Schedule1F1B, "looped_bfs": S.ScheduleLoopedBFS,
             "interleaved_1f1b": S.ScheduleInterleaved1F1B,
             "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble, "zbv": S.ScheduleZBVZeroBubble,
             "dualpipev": S.ScheduleDualPipeV}
SINGLE = ("gpipe", "1f1b")
V = ("zbv", "dualpipev")  # (two stages per rank, r and 2p - 1 - r)


def cases():
    for name in SCHEDULES:
        for ranks in (1, 2, 3, 4):
            for local in ((1,) if name in SINGLE else (2,) if name in V else (1, 2, 3)):
                for microbatches in (1, 2, 3, 4, 6, 8, 12, 16):
                    yield f"{name}_{ranks}_{local}_{microbatches}", name, ranks, local, microbatches


class StandIn(_PipelineStageBase):
    """A stage with its indices only: what a schedule reads to make its order."""

    def __init__(self, stage_index, num_stages, group_size):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, 0
        self.submod = None
        self.has_backward = True
        self.stage_index_to_group_rank = {}

    def _prepare_forward_infra(self, *args, **kwargs):
        pass

    def _prepare_backward_infra(self, *args, **kwargs):
        pass

    def _create_grad_recv_info(self, *args, **kwargs):
        return ()


def torch_schedule(name, ranks, local, microbatches):
    # (rank 0's stages: in a loop, 0, p, 2p, ...; in a V, 0 and 2p - 1)
    indices = [0, 2 * ranks - 1] if name in V else [ranks * i for i in range(local)]
    stages = [StandIn(i, ranks * local, ranks) for i in indices]
    if name in SINGLE:
        return SCHEDULES[name](stages[0], microbatches)
    return SCHEDULES[name](stages, microbatches)


def computations(row, name, rank, ranks):
    """A single-stage schedule's pipeline_order row as its sequence of F and B."""
    out = []
    for a in row:
        if a is None or a.computation_type.value not in ("F", "B"):
            continue
        if name == "1f1b" and rank == ranks - 1 and a.computation_type.value == "F":
            a = a._replace(microbatch_index=a.microbatch_index - 1)
        out.append(str(a))
    return out


def dump(out):
    for case, name, ranks, local, microbatches in cases():
        try:
            schedule = torch_schedule(name, ranks, local, microbatches)
        except (ValueError, AssertionError) as e:
            (out / f"torch_{case}.err").write_text(str(e))
            continue
        if name in SINGLE:
            order = schedule._get_pipeline_order()
            with open(out / f"torch_{case}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                for rank in range(ranks):
                    writer.writerow(computations(order[rank], name, rank, ranks))
        else:
            schedule._dump_csv(str(out / f"torch_{case}.csv"), format="compute_only")


def expanded(action):
    """A compound action (OVERLAP_F_B) as its sub-actions; any other as itself."""
    return list(action.sub_actions) if action is not None and action.sub_actions else [action]


def torch_lowered(ours, name, ranks, local):
    """torch's _add_send_recv of our compute-only order, as torch's CSV writer writes it."""
    with open(ours, newline="") as f:
        order = {rank: [sub for s in row for sub in expanded(S._Action.from_str(s))]
                 for rank, row in enumerate(csv.reader(f))}
    mapping = generate_stage_to_rank_mapping(ranks, ranks * local, style="v" if name in V else "loop")
    lowered = S._add_send_recv(order, stage_to_rank=lambda s: mapping[s], num_stages=ranks * local)
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    for rank in range(ranks):
        writer.writerow(lowered.get(rank, []))
    return text.getvalue().encode()


def compare(out):
    failed = checked = lowered = 0
    for case, name, ranks, local, microbatches in cases():
        theirs_err, ours_err = out / f"torch_{case}.err", out / f"ours_{case}.err"
        theirs, ours = out / f"torch_{case}.csv", out / f"ours_{case}.csv"
        checked += 1
        if theirs_err.exists() or ours_err.exists():
            if not (theirs_err.exists() and ours_err.exists()):
                failed += 1
                refused = theirs_err if theirs_err.exists() else ours_err
                print(f"FAIL {case}: only {'torch' if refused == theirs_err else 'accel.hpp'} refuses it: "
                      f"{refused.read_text()}")
            continue
        if name in SINGLE:  # (ours written whole: compare the sequences)
            mine = [[a for a in row if a] for row in csv.reader(open(ours, newline=""))]
            same = mine == [row for row in csv.reader(open(theirs, newline=""))]
        else:
            same = ours.read_bytes() == theirs.read_bytes()
        if not same:
            failed += 1
            print(f"FAIL {case}:\n  torch:     {theirs.read_text()!r}\n  accel.hpp: {ours.read_text()!r}")
        mine, expected = (out / f"lowered_ours_{case}.csv").read_bytes(), torch_lowered(ours, name, ranks, local)
        lowered += 1
        if mine != expected:
            failed += 1
            print(f"FAIL {case} lowered:\n  torch:     {expected!r}\n  accel.hpp: {mine!r}")
    print(f"pp_orders: {checked} cases against torch {torch.__version__} ({lowered} lowered too), {failed} differ")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "compare"):
        sys.exit(__doc__)
    directory = pathlib.Path(sys.argv[2])
    sys.exit(dump(directory) if sys.argv[1] == "dump" else compare(directory))
