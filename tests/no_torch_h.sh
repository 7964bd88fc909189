#!/usr/bin/env bash
# The header must never pull in <torch/torch.h> (23 s and 1.1 GB per TU):
# list accel.hpp's whole include graph and look for it.
set -euo pipefail
compiler=$1
header=$2
deps=$("$compiler" -std=c++20 -x c++ -M "$header")
count=$(grep -Ec '(^|[ /])torch/torch\.h|csrc/api/include/torch/torch\.h' <<<"$deps" || true)
echo "headers in accel.hpp's include graph: $(wc -w <<<"$deps"); torch/torch.h among them: $count"
grep -q "c10d/ProcessGroupGloo.hpp" <<<"$deps"   # the graph is real: Gloo's group is in it
[[ $count -eq 0 ]]
