#!/usr/bin/env bash
# Makes (or re-uses) the pip leg's virtual environment: PyPI's torch and the
# Python references, pinned in tests/pip/requirements.txt. Re-used when its
# stamp holds that file's hash; made again from scratch otherwise.
#
#     make_venv.sh VENV_DIR
set -euo pipefail
venv=${1:?usage: make_venv.sh VENV_DIR}
requirements=$(cd "$(dirname "$0")" && pwd)/requirements.txt
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [[ -f $venv/.accel-stamp && $(cat "$venv/.accel-stamp") == "$want" ]]; then
  exit 0
fi
rm -rf "$venv"
start=$(date +%s)
python3 -m venv "$venv"
# (about 5.6 GB: the CUDA wheel brings the CUDA runtime, cuDNN and NCCL with it)
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements"
"$venv/bin/python" -c 'import torch, accelerate, safetensors; print("pip venv: torch", torch.__version__, "accelerate", accelerate.__version__)'
echo "$want" >"$venv/.accel-stamp"
echo "pip venv made in $(( $(date +%s) - start )) s"
