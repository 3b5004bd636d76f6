#!/usr/bin/env bash
# Runs a command against efim-server in front of a fresh llama.cpp llama-server (efim-server
# --upstream), both on free ports of 127.0.0.1, llama-server on a small random-weight model that
# efim-model writes with the tokenizer's vocabulary:
#   with_llama_server.sh LLAMA_SERVER EFIM_MODEL TOKENIZER SERVER [SERVER FLAGS...] -- COMMAND [ARGS...]
# The tests' scripts use it in place of with_server.sh when EFIM_WITH_SERVER names it. Says
# "skipped" when llama-server has not been built (.ci/setup --llama-server builds it).
set -uo pipefail
llama=$1 maker=$2 tokenizer=$3
shift 3
if [ ! -x "$llama" ] || [ ! -f "$tokenizer" ]; then
  echo "with_llama_server: skipped: needs $llama and $tokenizer (.ci/setup --llama-server)"
  exit 0
fi
work=$(mktemp -d)
lpid=
finish() { [ -n "$lpid" ] && kill "$lpid" 2> /dev/null && wait "$lpid" 2> /dev/null; rm -rf "$work"; }
trap finish EXIT
if ! "$maker" make --arch qwen2 --hidden 128 --layers 2 --heads 4 --kv-heads 2 --ffn 256 --context 8192 --seed 3 \
     --tokenizer "$tokenizer" "$work/model.gguf" > "$work/make.log" 2>&1; then
  echo "with_llama_server: efim-model make failed:"; cat "$work/make.log"; exit 1
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$llama" -m "$work/model.gguf" --host 127.0.0.1 --port "$port" -c 8192 -np 2 -t 2 --no-webui --no-warmup \
  > "$work/llama.log" 2>&1 &
lpid=$!
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$lpid" 2> /dev/null || { echo "with_llama_server: llama-server exited:"; cat "$work/llama.log"; exit 1; }
  sleep 0.1
done
echo "with_llama_server: llama-server on 127.0.0.1:$port, efim-server --upstream in front of it"
server=$1
shift
flags=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
shift
bash "$(dirname "$0")/with_server.sh" "$server" "${flags[@]}" --upstream "http://127.0.0.1:$port" \
  --tokenizer "$tokenizer" -- "$@"
rc=$?
[ $rc -eq 0 ] || { echo "with_llama_server: llama-server's log:"; tail -n 40 "$work/llama.log"; }
exit $rc
