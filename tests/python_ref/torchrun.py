# torchrun, exactly (torch.distributed.run.main), on a torch built without
# libuv. torch 2.6's rendezvous stores (static and c10d) construct their
# TCPStore with use_libuv=True whatever USE_LIBUV says, so on Debian's
# python3-torch (built without libuv) `torchrun` fails before starting any
# rank. This turns TCPStore's use_libuv default off -- what USE_LIBUV=0 asks
# for -- and changes nothing else. pip and pytorch.org builds have libuv and
# need none of this.
#
#     python3 torchrun.py --nproc-per-node 4 --no-python PROGRAM ...
import sys

import torch.distributed as dist

_TCPStore = dist.TCPStore


class TCPStore(_TCPStore):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        super().__init__(*args, **kwargs)


dist.TCPStore = TCPStore

from torch.distributed.run import main  # noqa: E402 (after the patch: its modules import TCPStore by name)

sys.exit(main())
