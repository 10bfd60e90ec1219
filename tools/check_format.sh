#!/usr/bin/env bash
# Checks that every tracked C++ and CUDA file is as clang-format 14 (.clang-format: LLVM style,
# 100 columns) writes it: bash tools/check_format.sh [--fix]. Lists each file that is not and
# exits 1; --fix rewrites them in place instead. tools/test.sh runs it as one test case.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/flag.sh
fix=0
switch_given check_format.sh --fix "$@" && fix=1
formatter=$(command -v clang-format-14 || command -v clang-format || true)
if [ -z "$formatter" ]; then
  echo "check_format.sh: error: clang-format-14 not found; install it with tools/setup.sh" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -- '*.cpp' '*.h' '*.cu' '*.cuh' ':!third_party/**')
if [ "$fix" = 1 ]; then
  "$formatter" -i -- "${files[@]}"
  exit 0
fi
bad=$("$formatter" --dry-run -- "${files[@]}" 2>&1 | sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: warning: code should be clang-formatted.*/\1/p' | sort -u)
if [ -n "$bad" ]; then
  echo "not clang-formatted ($(wc -l <<<"$bad") files; fix with: bash tools/check_format.sh --fix):"
  sed 's/^/  /' <<<"$bad"
  exit 1
fi
echo "clang-format: ${#files[@]} files clean"
