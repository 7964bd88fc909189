#!/usr/bin/env bash
# Installs the Debian packages accel.hpp's build, tests and examples need,
# when they are missing, plus any package named as an argument (the
# benchmarks add theirs). Safe to run again; does nothing when all are there.
set -euo pipefail
# Inside the LibTorch 2.6 root (tests/trixie/make_root.sh), everything was
# installed when the root was made.
[[ -f /.accel-root-ready ]] && exit 0
packages=(g++ cmake make libtorch-dev libgloo-dev doctest-dev valgrind clang libclang-rt-14-dev pkg-config python3-torch openmpi-bin iproute2 mmdebstrap "$@")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
