#!/usr/bin/env bash
# efim's CUDA backend beside llama.cpp's CUDA build, on the same GGUF files, in one run:
# Qwen2-shaped random-weight models (efim-model make: the 0.5B and 7B shapes, each type asked for),
# then for each file efim-cuda-bench --gguf (prefill of 512 tokens; decode: one sequence from an empty
# cache, or --batch sequences at 512 tokens each) and llama.cpp's llama-bench (pp512, tg128) and, for a
# batch of more than one, llama-batched-bench (as many sequences, 512 tokens each, 128 generated).
#
#   bench/cuda_peer.sh [options]
#     --efim DIR       efim's build folder (default build: build/bench/efim-cuda-bench and
#                      build/examples/efim-model), or a folder holding both programs
#     --llama DIR      llama.cpp's CUDA build (bench/build_llama_cpp.sh --cuda; default
#                      .cache/llama.cpp/cuda); "none" times efim alone
#     --models DIR     where the model files are made, or found when they are there (default bench-models)
#     --tokenizer F    tokenizer.json for the files (default efim-model's: .ci/setup's Qwen2.5-Coder)
#     --size S         0.5b or 7b (repeatable; default both)
#     --type T         f16, q8_0, q4_k_m, ... (repeatable; default f16, q8_0 and q4_k_m)
#     --batch N        sequences decoded together (repeatable; default 1 and 16)
#     --out DIR        where each program's output is kept (default bench-models/results)
set -euo pipefail
cd "$(dirname "$0")/.."
efim_bench=build/bench/efim-cuda-bench
efim_model=build/examples/efim-model
llama=.cache/llama.cpp/cuda
models=bench-models
out=""
tokenizer=()
sizes=()
types=()
batches=()
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || { echo "cuda_peer: $1 needs a value" >&2; exit 2; }
  case $1 in
    --efim)
      if [ -d "$2/bench" ]; then
        efim_bench=$2/bench/efim-cuda-bench efim_model=$2/examples/efim-model
      else
        efim_bench=$2/efim-cuda-bench efim_model=$2/efim-model
      fi ;;
    --llama) llama=$2 ;;
    --models) models=$2 ;;
    --tokenizer) tokenizer=(--tokenizer "$2") ;;
    --size) sizes+=("$2") ;;
    --type) types+=("$2") ;;
    --batch) batches+=("$2") ;;
    --out) out=$2 ;;
    *) echo "cuda_peer: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ ${#sizes[@]} -gt 0 ] || sizes=(0.5b 7b)
[ ${#types[@]} -gt 0 ] || types=(f16 q8_0 q4_k_m)
[ ${#batches[@]} -gt 0 ] || batches=(1 16)
parallel=""
for b in "${batches[@]}"; do [ "$b" -gt 1 ] && parallel+="${parallel:+,}$b"; done
out=${out:-$models/results}
mkdir -p "$models" "$out"
for p in "$efim_bench" "$efim_model"; do
  [ -x "$p" ] || { echo "cuda_peer: no $p (build efim with CUDA first)" >&2; exit 1; }
done
if [ "$llama" != none ] && [ ! -x "$llama/bin/llama-bench" ]; then
  echo "cuda_peer: no $llama/bin/llama-bench (bench/build_llama_cpp.sh --cuda)" >&2
  exit 1
fi

shape() {
  case $1 in
    0.5b) echo "--hidden 896 --layers 24 --heads 14 --kv-heads 2 --ffn 4864 --vocab 151936 --tied" ;;
    7b) echo "--hidden 3584 --layers 28 --heads 28 --kv-heads 4 --ffn 18944 --vocab 152064" ;;
    *) echo "cuda_peer: --size is 0.5b or 7b, not $1" >&2; exit 2 ;;
  esac
}

summary=$out/summary.txt
: >"$summary"
for size in "${sizes[@]}"; do
  for type in "${types[@]}"; do
    file=$models/qwen2-$size-$type.gguf
    if [ ! -f "$file" ]; then
      start=$SECONDS
      # shellcheck disable=SC2046
      "$efim_model" make --arch qwen2 $(shape "$size") --type "$type" "${tokenizer[@]}" "$file" >/dev/null
      echo "cuda_peer: made $file ($(du -h "$file" | cut -f1)) in $((SECONDS - start)) s"
    fi
    name=$size-$type
    : >"$out/efim-$name.txt"
    for b in "${batches[@]}"; do
      if [ "$b" -eq 1 ]; then
        "$efim_bench" --gguf "$file" --context 0 --steps 128 --prefill 512 | tee -a "$out/efim-$name.txt"
      else
        "$efim_bench" --gguf "$file" --context 512 --steps 128 --prefill 512 --batch "$b" | tee -a "$out/efim-$name.txt"
      fi
    done
    grep -h "^qwen2" "$out/efim-$name.txt" >>"$summary" || true
    if [ "$llama" != none ]; then
      "$llama/bin/llama-bench" -m "$file" -ngl 99 -p 512 -n 128 -r 3 -o md 2>"$out/llama-bench-$name.log" |
        tee "$out/llama-bench-$name.txt"
      grep -h "pp512\|tg128" "$out/llama-bench-$name.txt" | sed "s|^|$name llama-bench |" >>"$summary" || true
      if [ -n "$parallel" ]; then
        "$llama/bin/llama-batched-bench" -m "$file" -ngl 99 -c 20480 -b 2048 -ub 512 -npp 512 -ntg 128 \
          -npl "$parallel" 2>"$out/llama-batched-$name.log" | tee "$out/llama-batched-$name.txt"
        grep -hE "^\|\s+512 \|" "$out/llama-batched-$name.txt" | sed "s|^|$name batched |" >>"$summary" || true
      fi
    fi
  done
done
echo "== summary ($summary)"
cat "$summary"
