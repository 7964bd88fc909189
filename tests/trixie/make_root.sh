#!/usr/bin/env bash
# Makes (once) a Debian trixie root with LibTorch 2.6, GCC 14, clang 19 and the
# packages the test suite needs, at $1. A root that was finished before (its
# stamp names the same package list) is re-used as it is.
set -euo pipefail
root=${1:?usage: make_root.sh DIR}
packages=(libtorch-dev libgloo-dev doctest-dev g++ clang cmake make pkg-config python3-torch
          python3-safetensors openmpi-bin iproute2 procps ca-certificates valgrind)
stamp="$root/.accel-root-ready"
want="trixie ${packages[*]}"
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  echo "trixie root: re-using $root"
  exit 0
fi
command -v mmdebstrap >/dev/null || bash "$(dirname "$0")/../../.ci/install-deps.sh" mmdebstrap
rm -rf "$root"
mkdir -p "$(dirname "$root")"
start=$(date +%s)
include=$(IFS=,; echo "${packages[*]}")
mmdebstrap --variant=apt --include="$include" --components=main \
  --aptopt='Acquire::Retries "3"' trixie "$root" http://deb.debian.org/debian
echo "$want" > "$stamp"
echo "trixie root: made $root in $(( $(date +%s) - start )) s ($(du -sh "$root" | cut -f1))"
