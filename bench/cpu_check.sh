#!/usr/bin/env bash
# The host backend's speed on the CPU this runs on, in one go, against llama.cpp: what a session on a new
# kind of CPU (an Intel Xeon, a Zen 3 without AVX-512) runs first, so that its figures come from one
# prepared run rather than commands typed one by one. Run after .ci/setup and a Release build:
#
#   bash bench/cpu_check.sh
#
# It writes into RESULTS (default build/cpu-check/<date>):
#   cpu.txt           the CPU (lscpu, its vector flags, the kernel's view of AMX), the commit, the compiler
#   model.txt/.json   efim-model-bench --no-reference --rows --reps REPS on the default Qwen2 768 x 12
#                     files (f16, q8_0, q4_0, Q4_K_M): prefill pp512 and decode tg128 against llama.cpp's
#                     prebuilt libraries and llama.cpp built here; the decode tiles chosen by timing; the
#                     row "rows": the matrices as stored beside the interleaved copies the defaults read
#                     (f16 only where it is interleaved: the AVX-512 path off AMD CPUs)
#   model-avx2.txt    the same files on the AVX2 path (EFIM_ISA=avx2), where the CPU has AVX-512
#   tiles.txt         efim-kernels-bench 2 typed decode tiles: each one-row decode with both kinds of
#                     decode tiles (the AVX-512 path only)
#   crossover.txt     efim-kernels-bench 1 crossover: the int8 streams, panels and their bounds
#   summary.txt       the lines of the above that carry the ratios
#
#   BUILD=DIR     the build folder (default build)
#   REPS=N        efim-model-bench's repetitions (default 3)
#   LLAMA=0       do not build llama.cpp here (by default it is built, with bench/build_llama_cpp.sh,
#                 when .cache/llama.cpp/native was built on another CPU or not at all; without AMX's tile
#                 kernels where the CPU advertises AMX, since a VM may advertise it with the tile state
#                 off, where llama.cpp's native build dies with SIGILL), then the build reconfigured
#   VARIANTS=1    also a row for each prebuilt llama.cpp CPU variant the CPU can load (--llama-variants;
#                 the oldest ones are slow: minutes more)
#   KERNELS=0     skip the kernel lab (tiles.txt, crossover.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD:-build}
reps=${REPS:-3}
[[ "$reps" =~ ^[1-9][0-9]?$ ]] || { echo "cpu_check: REPS must be 1-99, not '$reps'" >&2; exit 2; }
[[ -x "$build/bench/efim-model-bench" ]] || {
  echo "cpu_check: no $build/bench/efim-model-bench (cmake -S . -B $build -DCMAKE_BUILD_TYPE=Release && cmake --build $build)" >&2
  exit 2
}
results=${RESULTS:-$build/cpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$results"
cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
flags=" $(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo | head -n 1) "
has() { [[ "$flags" == *" $1 "* ]]; }

{
  echo "date: $(date -u)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "cpu: $cpu"
  sed -n 's/^\(cpu family\|model\|stepping\)[[:space:]]*: /\1: /p' /proc/cpuinfo | head -n 3
  echo -n "vector flags:"
  for f in avx2 fma f16c avx_vnni avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16; do
    has "$f" && echo -n " $f"
  done
  echo
  echo "compiler: $(c++ --version | head -n 1)"
  echo "threads: $(nproc)"
  lscpu
} >"$results/cpu.txt"
echo "cpu_check: $cpu; results in $results"

native=.cache/llama.cpp/native/VERSION
if [[ "${LLAMA:-1}" == 1 && -f .cache/llama.cpp/VERSION ]]; then
  release=$(sed -n 's/.*commit \([0-9a-f]\{40\}\).*/\1/p' .cache/llama.cpp/VERSION | head -n 1)
  # (Built again: none yet, built on another CPU or from another release, or with AMX where advertised.)
  if [[ ! -f "$native" ]] || ! grep -qxF "cpu: $cpu" "$native" || ! grep -q "commit $release" "$native" ||
    { has amx_tile && ! grep -q "without AMX" "$native"; }; then
    opts=()
    has amx_tile && opts+=(--no-amx)
    echo "cpu_check: building llama.cpp for this CPU (bench/build_llama_cpp.sh ${opts[*]:-}; about 5 minutes on 2 cores)"
    bash bench/build_llama_cpp.sh "${opts[@]}"
    cmake "$build" >/dev/null
    cmake --build "$build" -j"$(nproc)" --target efim-model-bench
  fi
fi
[[ -f "$native" ]] && cp "$native" "$results/llama-native-VERSION.txt"

variants=()
[[ "${VARIANTS:-0}" == 1 ]] && variants=(--llama-variants)
echo "cpu_check: efim-model-bench, the issue's table (a few minutes a file)"
"$build/bench/efim-model-bench" --no-reference --rows --reps "$reps" "${variants[@]}" --json "$results/model.json" \
  2>&1 | tee "$results/model.txt"
if has avx512f; then
  echo "cpu_check: the AVX2 path on the same files"
  EFIM_ISA=avx2 "$build/bench/efim-model-bench" --no-reference --no-llama --reps 1 2>&1 | tee "$results/model-avx2.txt"
fi
if [[ "${KERNELS:-1}" == 1 ]]; then
  if has avx512f; then
    echo "cpu_check: the kernel lab, both kinds of one-row decode tiles"
    "$build/bench/efim-kernels-bench" 2 typed decode tiles 2>&1 | tee "$results/tiles.txt"
  fi
  echo "cpu_check: the kernel lab, int8 crossovers"
  "$build/bench/efim-kernels-bench" 1 crossover 2>&1 | tee "$results/crossover.txt"
fi

{
  grep -E '^(date|commit|cpu|cpu family|model|stepping|vector flags):' "$results/cpu.txt"
  grep -h -E '^(cpu|kernels|decode tiles)|^qwen2|^ +(int8|llama|built|rows) +[0-9]|^ +variant ' "$results/model.txt" || true
  if [[ -f "$results/model-avx2.txt" ]]; then
    echo "-- the AVX2 path (EFIM_ISA=avx2):"
    grep -h -E '^(kernels)|^qwen2|^ +int8 +[0-9]' "$results/model-avx2.txt" || true
  fi
  [[ -f "$results/tiles.txt" ]] && grep -h -E 'streams|prefetched' "$results/tiles.txt"
} >"$results/summary.txt"
echo "cpu_check: done; the summary:"
cat "$results/summary.txt"
