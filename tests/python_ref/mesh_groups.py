# Python's reference for accel.hpp's meshes: for every strategy of the world
# (each mp_replicate size and each cp size that divides it), builds the model
# mesh (mp_replicate, mp_shard) and the data mesh (dp, cp) with
# torch.distributed.device_mesh.init_device_mesh, and writes the global ranks
# of each dimension's group (mesh[name].get_group()) to DIR/rank<r>.txt:
#
#   <mp_replicate> <mp_shard> <dp> <cp> <dim>: <ranks...>
#
# then the same with each tp size above 1 as the meshes' innermost dimension
# ("tp <mp_replicate> <mp_shard> <dp> <cp> <tp> <dim>: <ranks...>"), then each
# pp size above 1 as their outermost ("pp <pp> <mp_replicate> <mp_shard> <dp>
# <cp> <tp> <dim>: <ranks...>"), then, at world size 4, Accelerate's 4-d meshes with their flattened
# dimensions (see below).
#
# Run on 4 ranks with torchrun's environment (run_torchrun.sh uses accel_launch).
import os
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from leave import leave_without_teardown

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
divisors = [d for d in range(1, world + 1) if world % d == 0]
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as out:
    for mp_replicate in divisors:
        for cp in divisors:
            mp_shard, dp = world // mp_replicate, world // cp
            model = init_device_mesh("cpu", (mp_replicate, mp_shard), mesh_dim_names=("mp_replicate", "mp_shard"))
            data = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
            for mesh, names in ((model, ("mp_replicate", "mp_shard")), (data, ("dp", "cp"))):
                for name in names:
                    ranks = dist.get_process_group_ranks(mesh[name].get_group())
                    print(mp_replicate, mp_shard, dp, cp, f"{name}:", *ranks, file=out)
    # With tensor parallelism, innermost in both meshes (torchtitan's order):
    # the model mesh (mp_replicate, mp_shard, tp) and the data mesh (dp, cp, tp).
    for tp in divisors[1:]:
        rest = [d for d in divisors if (world // tp) % d == 0]
        for mp_replicate in rest:
            for cp in rest:
                mp_shard, dp = world // tp // mp_replicate, world // tp // cp
                model = init_device_mesh("cpu", (mp_replicate, mp_shard, tp),
                                         mesh_dim_names=("mp_replicate", "mp_shard", "tp"))
                data = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
                for mesh, names in ((model, ("mp_replicate", "mp_shard", "tp")), (data, ("dp", "cp", "tp"))):
                    for name in names:
                        ranks = dist.get_process_group_ranks(mesh[name].get_group())
                        print("tp", mp_replicate, mp_shard, dp, cp, tp, f"{name}:", *ranks, file=out)
    # With pipeline parallelism too, outermost in both meshes (torchtitan's order):
    # the model mesh (pp, mp_replicate, mp_shard, tp), the data mesh (pp, dp, cp, tp).
    for pp in divisors[1:]:
        for tp in [d for d in divisors if (world // pp) % d == 0]:
            rest = [d for d in divisors if (world // pp // tp) % d == 0]
            for mp_replicate in rest:
                for cp in rest:
                    mp_shard, dp = world // pp // tp // mp_replicate, world // pp // tp // cp
                    model = init_device_mesh("cpu", (pp, mp_replicate, mp_shard, tp),
                                             mesh_dim_names=("pp", "mp_replicate", "mp_shard", "tp"))
                    data = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
                    for mesh, names in ((model, ("pp", "mp_replicate", "mp_shard", "tp")), (data, ("dp", "cp"))):
                        for name in names:
                            ranks = dist.get_process_group_ranks(mesh[name].get_group())
                            print("pp", pp, mp_replicate, mp_shard, dp, cp, tp, f"{name}:", *ranks, file=out)
    # Accelerate's (dp_replicate, dp_shard, cp, tp) meshes and the dimensions its
    # ParallelismConfig flattens; each line: the sub-mesh's ranks and this
    # rank's coordinate in it.
    layouts = [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2), (2, 1, 1, 2), (1, 4, 1, 1)]
    for shape in layouts if world == 4 else []:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        for what in ("dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp",
                     ("dp_replicate", "dp_shard_cp"), ("dp_shard", "tp")):
            sub = mesh[what]
            label = what if isinstance(what, str) else ",".join(what)
            print("nd", *shape, f"{label}:", *sub.mesh.flatten().tolist(), "coordinate", *sub.get_coordinate(),
                  file=out)
leave_without_teardown()  # (leave.py: a teardown that aborts now and then)
