#!/usr/bin/env bash
# compile_fail_cases: tests/compile_fail.cpp compiled once, without
# ACCEL_CASE_OK, must fail; every line marked `// must fail: CONCEPT` must be
# the site of an error whose diagnostic names CONCEPT, and no other line of the
# file may have an error. (One compilation for every case: the cases cost one
# parse of accel.hpp and LibTorch instead of one each.)
#
#     compile_fail.sh SOURCE CMAKE BUILD_DIR TARGET
set -euo pipefail
source=$1 cmake=$2 build=$3 target=$4
if output=$("$cmake" --build "$build" --target "$target" 2>&1); then
  echo "$output"
  echo "compile_fail.cpp compiled: every case must be rejected" >&2
  exit 1
fi
name=$(basename "$source")
# The diagnostic that begins at LINE's first error, up to the next error the
# compiler reports in this file (GCC and clang both print FILE:LINE:COL: error:).
diagnostic() {
  awk -v file="$name" -v line="$1" '
    match($0, file ":[0-9]+:[0-9]+: error:") {
      split(substr($0, RSTART + length(file) + 1), at, ":")
      on = (at[1] == line)
    }
    on { print }' <<<"$output"
}
marked=$(grep -n '// must fail: ' "$source")  # LINE:text ... // must fail: CONCEPT
status=0
while IFS= read -r case; do
  line=${case%%:*}
  concept=${case##*must fail: }
  if diagnostic "$line" | grep -q "$concept"; then
    echo "line $line: rejected through $concept"
  else
    echo "line $line: no error naming $concept at this line" >&2
    status=1
  fi
done <<<"$marked"
expected=$(cut -d: -f1 <<<"$marked" | sort -u)
reported=$(grep -oE "$name:[0-9]+:[0-9]+: error:" <<<"$output" | cut -d: -f2 | sort -u)
if [[ $reported != "$expected" ]]; then
  echo "errors on lines $(echo $reported), the cases are on lines $(echo $expected)" >&2
  status=1
fi
((status == 0)) || echo "$output"
echo "$(wc -l <<<"$marked") cases"
exit $status
