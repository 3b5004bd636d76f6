#!/usr/bin/env bash
# Runs the libFuzzer targets of a build made with -DEFIM_FUZZ=ON (clang), each from its seed corpus
# (efim-fuzz-seeds writes it the first time) for the given seconds; what a run finds new is kept in
# the corpus for the next. A fault stops the run with the input that made it (crash-*, leak-*,
# timeout-* in the corpus folder) and a non-zero exit.
#   tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]     (default: every target)
# Targets: gguf model tokenizer_json tokenizer_gguf encode handlers http.
set -euo pipefail
build=$(cd "$1" && pwd)
seconds=$2
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf model tokenizer_json tokenizer_gguf encode handlers http)
fuzz=$build/tests/fuzz
work=$fuzz/corpus
[ -d "$work/gguf" ] || "$fuzz/efim-fuzz-seeds" "$work"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for t in "${targets[@]}"; do
  mkdir -p "$work/$t" "$work/$t.found"
  echo "fuzz: $t for ${seconds} s"
  # -timeout: an input that takes longer is a fault (a hang); -rss_limit_mb: so is memory beyond it.
  if ! "$fuzz/fuzz_$t" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
       -artifact_prefix="$work/$t.found/" "$work/$t" > "$work/$t.log" 2>&1; then
    tail -n 60 "$work/$t.log"
    echo "fuzz: $t found a fault (its input is in $work/$t.found)" >&2
    exit 1
  fi
  grep -E '^stat::number_of_executed_units|^Done' "$work/$t.log" | tr '\n' ' '
  echo
done
