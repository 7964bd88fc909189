#!/usr/bin/env bash
# torchrun (Python 2.x's launcher; its agent serves the TCPStore that every
# rank joins) starts the test binary on 4 ranks with --no-python: the torchrun
# suite: torchrun's environment and agent store, and every mesh dimension's
# group, each made over that store, against Python's init_device_mesh. The
# Python reference (mesh_groups.py) runs first, on 4 ranks of its own.
#
#     run_torchrun.sh ACCEL_LAUNCH TEST_BINARY
set -euo pipefail
launch=${1:?usage: run_torchrun.sh ACCEL_LAUNCH TEST_BINARY}
binary=${2:?usage: run_torchrun.sh ACCEL_LAUNCH TEST_BINARY}
here=$(cd "$(dirname "$0")" && pwd)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export OMP_NUM_THREADS=1
# pip and pytorch.org builds have libuv: torchrun runs as it is, its agent's
# store served by libuv, and accel.hpp's stores take libuv too (USE_LIBUV
# unset). Debian's torch is built without libuv: USE_LIBUV=0 for every store
# (Python's and accel.hpp's), and torchrun through torchrun.py, which makes
# torchrun's own stores honour it (see there). (One start of Python asks both
# this and whether torch has DeviceMesh: importing torch is most of a start.)
torch_has=$(python3 -c '
import torch.distributed as d
import torch.distributed.device_mesh
try:
    d.TCPStore("127.0.0.1", 0, 1, True, use_libuv=True)
    print("libuv")
except Exception:
    print("no libuv")
' 2>/dev/null || echo "no DeviceMesh")
if [[ $torch_has == libuv ]]; then
  echo "torchrun: $(command -v torchrun), unpatched (libuv store)"
  torchrun=(torchrun)
else
  export USE_LIBUV=0
  torchrun=(python3 "$here/torchrun.py")
fi
if [[ $torch_has == "no DeviceMesh" ]] ||
   ! timeout 120 "${torchrun[@]}" --nproc-per-node 1 --master-port "$(free_port)" --no-python true >/dev/null 2>&1; then
  echo "SKIP: no torchrun with init_device_mesh here (bookworm's python3-torch is 1.13: no DeviceMesh, and its torchrun fails on Python 3.11)"
  exit 77
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE ACCEL_STORE_DIR
"$launch" --timeout 240 4 python3 "$here/mesh_groups.py" "$out"
for r in 0 1 2 3; do test -s "$out/rank$r.txt"; done
ACCEL_PYTHON_MESH_DIR=$out timeout 300 "${torchrun[@]}" --nproc-per-node 4 --master-addr 127.0.0.1 \
  --master-port "$(free_port)" --no-python "$binary" -ts=torchrun --abort-after=1 --no-intro=true
