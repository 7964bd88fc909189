#!/usr/bin/env bash
# A pip wheel's libtorch_cpu.so exports a statically linked libstdc++'s
# std::filesystem (pytorch#133437); a program that loads it before the
# system's libstdc++ binds std::filesystem calls to that copy and crashes.
# The program must need libstdc++ first: the order of its NEEDED entries.
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
first=$(grep -E '^lib(stdc\+\+|torch_cpu)\.so' <<<"$needed" | head -1 || true)
if [[ $first != libstdc++.so* ]]; then
  echo "FAILED: ${first:-neither libstdc++ nor libtorch_cpu} comes first; libstdc++ must precede libtorch_cpu"
  exit 1
fi
