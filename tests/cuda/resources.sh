#!/usr/bin/env bash
# What ptxas reports of efim's kernels (tests/cuda/ptxas_log.sh keeps it while the CUDA programs build),
# for every architecture they are built for. Two rules:
#  - no stack frame beyond a kernel's spills: the rest of a frame is an array in local memory, indexed
#    by a value known only at run time (a kernel parameter's array so indexed is copied there first:
#    120 bytes a thread in the several-part decode kernels until decode_parts::pick), which no test's
#    result shows, only the kernel's speed on a GPU;
#  - spills of at most SPILLS bytes a thread (default 32): a few where the registers run short are the
#    compiler's trade (listed, for a GPU to weigh), more are a kernel to rework.
# Usage: resources.sh REPORT...  (the .ptxas files)
set -euo pipefail
(($# > 0)) || { echo "resources.sh: no report given" >&2; exit 2; }
for f in "$@"; do
  [[ -s $f ]] || { echo "resources.sh: no ptxas report $f (build the CUDA programs with this build tree's flags)" >&2; exit 1; }
done
out=$(mktemp)
trap 'rm -f "$out"' EXIT
awk -v most="${SPILLS:-32}" '
  /Compiling entry function/ { arch = $NF; gsub(/\047/, "", arch) }
  /Function properties for/ { name = $NF; next }
  /bytes stack frame/ {
    if (name !~ /4efim/) next  # (the libraries: CUB)
    ++kernels
    frame = $1 + 0; stores = $5 + 0; loads = $9 + 0
    spilled = int((stores + 7) / 8) * 8  # (a frame holds spills in 8-byte steps)
    if (frame == 0) next
    why = ""
    if (frame > spilled) why = sprintf(", %d bytes not spills: local memory", frame - spilled)
    if (stores > most) why = why sprintf(", spills over %d bytes", most)
    if (why != "") ++bad
    printf "%s: %d bytes stack frame (spills: %d bytes stored, %d loaded)%s: %s\n", arch, frame, stores, loads, why, name
  }
  END {
    printf "resources.sh: %d reports of efim kernels, %d against the rules\n", kernels, bad
    if (kernels == 0) { print "resources.sh: no kernel of efim in the reports" > "/dev/stderr"; exit 1 }
    exit bad > 0
  }' "$@" >"$out" || status=$?
# (The names demangled where binutils' c++filt is there.)
if command -v c++filt >/dev/null; then c++filt <"$out"; else cat "$out"; fi
exit "${status:-0}"
