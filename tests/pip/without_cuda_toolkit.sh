#!/usr/bin/env bash
# Runs a command as on a machine with no CUDA toolkit: in a private mount
# namespace, an empty directory over every /usr/local/cuda* and an empty,
# non-executable file over every nvcc on PATH (CUDA_HOME, CUDA_PATH unset). For the pip leg's
# consumer builds: a pip user needs no toolkit (cmake/accelTorch.cmake).
# Skipped (77) where mount namespaces cannot be made (not root, a sandbox).
#
#     without_cuda_toolkit.sh COMMAND [ARGS...]
set -euo pipefail
if [[ ${ACCEL_IN_NO_CUDA_NS:-} != 1 ]]; then
  if ! unshare -m true 2>/dev/null; then
    echo "SKIP: cannot make a mount namespace here (unshare -m needs root)"
    exit 77
  fi
  exec env ACCEL_IN_NO_CUDA_NS=1 unshare -m bash "$0" "$@"
fi
empty=$(mktemp -d)
nothing=$(mktemp)  # a plain file that is not executable
chmod 644 "$nothing"
hidden=()
for dir in /usr/local/cuda*; do
  [[ -d $dir ]] && mount --bind "$empty" "$dir" && hidden+=("$dir")
done
IFS=: read -ra path_dirs <<<"$PATH"
for dir in "${path_dirs[@]}"; do
  [[ -e $dir/nvcc ]] && mount --bind "$nothing" "$dir/nvcc" && hidden+=("$dir/nvcc")
done
unset CUDA_HOME CUDA_PATH CUDACXX ACCEL_IN_NO_CUDA_NS
# (Not `command -v`: bash names a non-executable file when no executable one exists.)
for dir in "${path_dirs[@]}"; do
  if [[ -x $dir/nvcc ]]; then
    echo "a CUDA toolkit is still visible: $dir/nvcc"
    exit 1
  fi
done
if [[ -e /usr/local/cuda/include/cuda.h ]]; then
  echo "a CUDA toolkit is still visible: /usr/local/cuda/include/cuda.h"
  exit 1
fi
echo "no CUDA toolkit visible (hidden: ${hidden[*]:-nothing to hide})"
exec "$@"
