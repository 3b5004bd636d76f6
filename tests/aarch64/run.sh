#!/usr/bin/env bash
# The kernel and model suite (test_model: matrix products of every weight type bit for bit against the
# canonical dot, attention, norms, RoPE, every architecture against the reference decoder, cached,
# chunked and batched computation bit-identical) cross-compiled for AArch64 (NEON) with Debian's
# g++-aarch64-linux-gnu and run under qemu-user. On AArch64 the kernels have one path, the generic one,
# and it fuses every multiply-add (FMA is part of the base instruction set), so the matrix products'
# bits are those of the x86 FMA paths. Needs: apt-get install g++-aarch64-linux-gnu qemu-user
# (.ci/setup installs them). Usage: tests/aarch64/run.sh [build dir] [Catch2 test spec...] (no spec: all of
# it, in two processes)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build-aarch64}
shift || true
cxx=aarch64-linux-gnu-g++
for tool in "$cxx" qemu-aarch64; do
  command -v "$tool" >/dev/null || { echo "aarch64: no $tool (apt-get install g++-aarch64-linux-gnu qemu-user)" >&2; exit 1; }
done
mkdir -p "$out/include"
# Only the architecture-independent headers the suite needs from the host: Catch2 (v2) and xxHash.
ln -sfn /usr/include/catch2 "$out/include/catch2"
ln -sfn /usr/include/xxhash.h "$out/include/xxhash.h"
launcher=()
command -v ccache >/dev/null && launcher=(ccache)
flags=(-std=c++20 -O2 -pthread -Wall -Wextra -Werror -Iinclude -I"$out/include")
# The three sources compile at once (one per core, the longest first).
objects=() jobs=()
for src in tests/model_test.cpp tests/matmul_isa_test.cpp tests/catch_main.cpp; do
  obj=$out/$(basename "$src" .cpp).o
  "${launcher[@]}" "$cxx" "${flags[@]}" -c "$src" -o "$obj" -DEFIM_SHARED_DATA="\"$PWD/../shared/data\"" &
  jobs+=($!)
  objects+=("$obj")
done
for job in "${jobs[@]}"; do wait "$job"; done
"$cxx" -static -pthread "${objects[@]}" -o "$out/test_model"
echo "aarch64: $(readelf -h "$out/test_model" | sed -n "s/^ *Machine: *//p")"
if [ $# -gt 0 ]; then
  exec timeout 1200 qemu-aarch64 "$out/test_model" "$@"
fi
# The whole suite in two halves at once (qemu-user runs one thread; the two longest cases, about a
# quarter of the time each, make one half): the other core is idle otherwise.
half=('every architecture\, weight type*,int8 products: cached\, chunked*')
rest=('~every architecture\, weight type*' '~int8 products: cached\, chunked*')
timeout 1200 qemu-aarch64 "$out/test_model" --warn NoTests "${half[@]}" >"$out/half.log" 2>&1 &
first=$!
rc=0
timeout 1200 qemu-aarch64 "$out/test_model" --warn NoTests "${rest[@]}" >"$out/rest.log" 2>&1 || rc=$?
wait $first || rc=$?
cat "$out/half.log" "$out/rest.log"
exit $rc
