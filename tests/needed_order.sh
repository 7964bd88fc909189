#!/usr/bin/env bash
# A pip wheel's libtorch_cpu.so exports a statically linked libstdc++'s
# std::filesystem (pytorch#133437); a program that loads it before the
# system's libstdc++ binds std::filesystem calls to that copy and crashes.
# The program must need libstdc++ first: the order of its NEEDED entries.
# Or carry its own: a GCC that has only libstdc++.a (the one in /opt/gcc on
# the GPU machine) or -static-libstdc++ links the runtime into the program,
# and listed before LibTorch it supplies every std::filesystem function.
#
#     needed_order.sh PROGRAM
set -euo pipefail
program=${1:?usage: needed_order.sh PROGRAM}
if command -v readelf >/dev/null; then
  needed=$(readelf -d "$program" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
elif command -v objdump >/dev/null; then
  needed=$(objdump -p "$program" | awk '$1 == "NEEDED" { print $2 }')
else
  echo "SKIP: neither readelf nor objdump here to read the NEEDED entries"
  exit 77
fi
echo "$(basename "$program") needs, in this order:" $needed
# A program with libstdc++ inside: std::filesystem's out-of-line functions
# defined (T) in it, and none of them left for another library to supply
# (a libstdc++.a listed after LibTorch lets libtorch_cpu.so supply them).
if ! grep -q '^libstdc++\.so' <<<"$needed" && command -v nm >/dev/null; then
  own=$(nm "$program" 2>/dev/null | grep -cE ' T _ZNK?St10filesystem' || true)
  imported=$(nm -D --undefined-only "$program" 2>/dev/null | grep -cE ' U _ZNK?St10filesystem' || true)
  if ((own > 0 && imported == 0)); then
    echo "libstdc++ is linked into $(basename "$program") itself (statically): its std::filesystem is its own"
    exit 0
  elif ((imported > 0)); then
    echo "FAILED: $imported std::filesystem functions are left for a library to supply (libstdc++ is not linked first)"
    exit 1
  fi
fi
first=$(grep -E '^lib(stdc\+\+|torch_cpu)\.so' <<<"$needed" | head -1 || true)
if [[ $first != libstdc++.so* ]]; then
  echo "FAILED: ${first:-neither libstdc++ nor libtorch_cpu} comes first; libstdc++ must precede libtorch_cpu"
  exit 1
fi
