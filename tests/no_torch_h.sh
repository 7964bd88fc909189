#!/usr/bin/env bash
# The header must never pull in <torch/torch.h> (23 s and 1.1 GB per TU):
# list the header's whole include graph (accel.hpp, or an umbrella header of
# the include tree with its -I) and look for it.
set -euo pipefail
compiler=$1
header=$2
shift 2  # the rest: compiler flags (-I for the include tree)
deps=$("$compiler" -std=c++20 "$@" -x c++ -M "$header")
count=$(grep -Ec '(^|[ /])torch/torch\.h|csrc/api/include/torch/torch\.h' <<<"$deps" || true)
echo "headers in $(basename "$header")'s include graph: $(wc -w <<<"$deps"); torch/torch.h among them: $count"
grep -q "c10d/ProcessGroupGloo.hpp" <<<"$deps"   # the graph is real: Gloo's group is in it
[[ $count -eq 0 ]]
