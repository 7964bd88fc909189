#!/usr/bin/env bash
# Runs a command inside a Debian root (made by make_root.sh) with this
# checkout bound in at the same path, /proc, /dev and /sys mounted and a fresh
# /tmp, in a private mount namespace: the mounts vanish with the command,
# whatever way it ends. Needs root (CI and these machines run as root).
#
#     bash tests/trixie/in_root.sh ROOT COMMAND [ARGS...]
set -euo pipefail
root=${1:?usage: in_root.sh ROOT COMMAND [ARGS...]}
shift
src=$(cd "$(dirname "$0")/../.." && pwd)
root=$(cd "$root" && pwd)
inner='
set -euo pipefail
root=$1 src=$2
shift 2
mount --bind "$root" "$root"  # "/" inside is a mount point (ip netns exec remounts it)
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t tmpfs tmpfs "$root/tmp"
# The checkout last: it may live under /tmp itself.
mkdir -p "$root$src" "$root/run/netns"
mount --bind "$src" "$root$src"
cp /etc/hosts "$root/etc/hosts"
exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 CI="${CI:-}" \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  bash -c "cd \"\$0\" && exec \"\$@\"" "$src" "$@"
'
exec unshare --mount --propagation private -- bash -c "$inner" in_root "$root" "$src" "$@"
