#!/usr/bin/env bash
# The parts under include/accel/ must be as clang-format leaves them
# (.clang-format). Only clang-format 19.1.7 judges (pinned in
# tests/pip/requirements.txt, on the pip leg's PATH): other versions format
# differently, so elsewhere the check is skipped (77), saying why.
#   format_check.sh SOURCE_DIR
set -euo pipefail
root=${1:?usage: format_check.sh SOURCE_DIR}
want=19.1.7
version=$(clang-format --version 2>/dev/null || true)
if [[ $version != *"version $want"* ]]; then
  echo "SKIP: format_check needs clang-format $want (the pip leg's venv has it); found: ${version:-none}"
  exit 77
fi
cd "$root"
files=(include/accel/*.hpp include/accel/*/*.hpp include/accel/*/*/*.hpp)
if ! clang-format --dry-run -Werror "${files[@]}"; then
  echo "format_check: run clang-format $want -i on the files above (CONTRIBUTING.md), then tools/amalgamate.py"
  exit 1
fi
echo "format_check: ${#files[@]} parts formatted as .clang-format says"
