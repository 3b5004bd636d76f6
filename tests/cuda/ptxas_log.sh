#!/usr/bin/env bash
# A compiler launcher for the CUDA suite's translation units (CMake runs `ptxas_log.sh DIR nvcc ARGS...`):
# runs the compiler, whose ptxas is asked for its report (-Xptxas=-v: each kernel's registers, stack
# frame and spills), and keeps that report in DIR/<object's name>.ptxas for resources.sh; the compiler's
# other output passes through as it came, and its exit status is the launcher's.
set -uo pipefail
dir=$1
shift
object=
previous=
for arg in "$@"; do
  [[ $previous == -o ]] && object=$arg
  previous=$arg
done
err=$(mktemp)
"$@" 2>"$err"
status=$?
grep -v -e '^ptxas info' -e '^    [0-9]* bytes stack frame' "$err" >&2
if [[ $status -eq 0 && -n $object ]]; then
  mkdir -p "$dir"
  grep -e '^ptxas info' -e '^    [0-9]* bytes stack frame' "$err" >"$dir/$(basename "$object").ptxas"
fi
rm -f "$err"
exit $status
