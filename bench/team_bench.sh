#!/usr/bin/env bash
# A team's server (deploy/team.sh: efim-server replicas behind nginx, Redis as the shared KV store)
# measured through nginx on this machine, with a key per user as a team's editors send them:
#
#  1. the multi-round workload (efim-bench's, over HTTP) on 1, 2 and 3 replicas with affinity and
#     the store, and on 3 replicas spread round-robin without a store (the naive way): what share of
#     the prompt tokens each keeps out of the computation;
#  2. typing (efim-bench --keystroke) on 2 replicas; half way, the replica that served the most
#     requests is killed (SIGKILL): the prompt tokens each keystroke computed before and after, with
#     the store and without it (affinity alone). A request whose answer was streaming when its
#     replica died is cut short: the client sees it fail (efim-bench --keep-going counts it).
#
#   bench/team_bench.sh [OUT_DIR]
#
# Environment: EFIM_BUILD (build), USERS (16), ROUNDS (5), KEY_USERS (8), KEY_CHARS (120),
# SERVER_FLAGS (more efim-server flags, e.g. --model FILE), PARTS (multi,keystroke: which to run).
# Needs redis-server, nginx, jq and python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${EFIM_BUILD:-$root/build}
out=${1:-$(mktemp -d)}
users=${USERS:-16}
rounds=${ROUNDS:-5}
key_users=${KEY_USERS:-8}
key_chars=${KEY_CHARS:-120}
read -r -a server_flags <<< "${SERVER_FLAGS:-}"
parts=${PARTS:-multi,keystroke}
bench=$build/examples/efim-bench
export EFIM_SERVER=$build/examples/efim-server
for tool in jq curl; do command -v $tool >/dev/null || { echo "team_bench.sh: needs $tool" >&2; exit 1; }; done
[ -x "$bench" ] && [ -x "$EFIM_SERVER" ] || { echo "team_bench.sh: build efim-bench and efim-server first" >&2; exit 1; }
mkdir -p "$out"
keys=$out/keys
for u in $(seq 0 $((users > key_users ? users - 1 : key_users - 1))); do echo "user-$u"; done > "$keys"
cores=$(nproc)

team_pid=""
stop_team() {
  [ -n "$team_pid" ] || return 0
  kill "$team_pid" 2>/dev/null || true
  wait "$team_pid" 2>/dev/null || true
  team_pid=""
}
trap stop_team EXIT

# start_team NAME REPLICAS STORE BALANCE: the team in $out/NAME, its address in $url.
start_team() {
  dir=$out/$1
  rm -rf "$dir"
  mkdir -p "$dir"
  local threads=$((cores / $2 > 0 ? cores / $2 : 1))
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  TEAM_DIR=$dir TEAM_KV_STORE=$3 TEAM_BALANCE=$4 "$root/deploy/team.sh" "$2" "$port" -- \
    --threads "$threads" --api-key-file "$keys" "${server_flags[@]}" > "$dir/team.out" 2>&1 &
  team_pid=$!
  until grep -q "^team.sh: http" "$dir/team.out"; do
    kill -0 "$team_pid" 2>/dev/null || { cat "$dir/team.out" >&2; exit 1; }
    sleep 0.2
  done
  url=http://127.0.0.1:$port
  echo "== $1: $(grep '^team.sh: http' "$dir/team.out")" >&2
}

served() {  # the /infill requests each replica answered, space-separated
  local n=() f
  for f in "$dir"/replica-*.log; do n+=("$(grep -c 'POST /infill 200' "$f" || true)"); done
  echo "${n[*]}"
}

# ---- 1. the multi-round workload ----
[[ ,$parts, == *,multi,* ]] && printf '%-28s %8s %9s %9s %9s %8s %10s %7s  %s\n' setup replicas mean_ms p50_ms p99_ms req/s computed hit "requests per replica" \
  > "$out/multi-round.txt"
for setup in "affinity+store 1 redis hash" "affinity+store 2 redis hash" "affinity+store 3 redis hash" \
  "round-robin 3 none round-robin"; do
  [[ ,$parts, == *,multi,* ]] || break
  read -r name n store balance <<< "$setup"
  start_team "multi-$name-$n" "$n" "$store" "$balance"
  "$bench" --url "efim=$url" --api-key 'user-{user}' --users "$users" --rounds "$rounds" --quiet \
    --json "$dir/bench.json" > "$dir/bench.txt"
  sleep 1  # the replicas' last log lines
  jq -r --arg name "$name" --arg n "$n" --arg per "$(served)" '.schemes.efim |
    [$name, $n, (.mean_latency_ms*10|round/10), (.p50_latency_ms*10|round/10), (.p99_latency_ms*10|round/10),
     (.requests_per_s*100|round/100), .computed_prompt_tokens, (.cache_hit_rate*1000|round/1000), $per] |
    @tsv' "$dir/bench.json" | awk -F'\t' '{printf "%-28s %8s %9s %9s %9s %8s %10s %7s  %s\n", $1,$2,$3,$4,$5,$6,$7,$8,$9}' \
    >> "$out/multi-round.txt"
  stop_team
done

# ---- 2. typing, the busiest replica killed half way ----
total=$((key_users * (1 + (key_chars + 1) / 2)))
printf '%-16s %-7s %9s %14s %12s %12s %10s\n' store period keystrokes computed_mean computed_max over_typed p50_ms \
  > "$out/keystroke-kill.txt"
for store in redis none; do
  [[ ,$parts, == *,keystroke,* ]] || break
  start_team "keystroke-$store" 2 "$store" hash
  "$bench" --url "efim=$url" --api-key 'user-{user}' --keystroke --users "$key_users" --documents "$key_users" \
    --keystroke-chars "$key_chars" --output-tokens 8 --keep-going --quiet --samples "$dir/samples.jsonl" \
    --json "$dir/bench.json" > "$dir/bench.txt" &
  bench_pid=$!
  while :; do
    read -r a b <<< "$(served)"
    [ $((a + b)) -ge $((total / 2)) ] && break
    kill -0 "$bench_pid" 2>/dev/null || { echo "team_bench.sh: efim-bench ended before half way" >&2; exit 1; }
    sleep 0.05
  done
  victim=$([ "$a" -ge "$b" ] && echo 1 || echo 2)
  kill -9 "$(sed -n "${victim}p" "$dir/replicas" | cut -d' ' -f1)"
  killed_at=$(date +%s.%N)
  echo "killed replica $victim after $a + $b requests" > "$dir/killed"
  wait "$bench_pid"
  # Keystrokes after each session's first request, answered before and after the kill (one in flight
  # at the kill is answered after it, by the other replica when nginx could send it there); and each
  # user's first keystroke answered after it (on the surviving replica, or moved there).
  jq -rs --arg store "$store" --argjson t "$killed_at" '
    def row(p; s): [$store, p, (s|length), ((s|map(.computed_tokens)|add // 0) / ([s|length,1]|max) * 10 | round / 10),
      (s|map(.computed_tokens)|max // 0), (s|map(.computed_tokens - .typed_tokens)|max // 0),
      (s|map(.latency_ms)|sort|if length > 0 then .[length/2|floor] * 10 | round / 10 else 0 end), 0];
    (map(select(.error == null and .first == false))) as $k |
    ($k|map(select(.start_s + .latency_ms / 1000 < $t))) as $before |
    ($k|map(select(.start_s + .latency_ms / 1000 >= $t))) as $after |
    ($after|group_by(.user)|map(min_by(.start_s))) as $next |
    row("before"; $before), row("after"; $after), row("next"; $next),
    [$store, "failed", (map(select(.error != null))|length), 0, 0, 0, 0, (map(select(.error != null))|length)] |
    @tsv' "$dir/samples.jsonl" |
    awk -F'\t' '$2 != "failed" {printf "%-16s %-7s %9s %14s %12s %12s %10s\n", $1,$2,$3,$4,$5,$6,$7}
                $2 == "failed" {failed[$1] = $8} END {for (s in failed) printf "%-16s failed requests: %s\n", s, failed[s]}' \
    >> "$out/keystroke-kill.txt"
  cat "$dir/killed" >> "$out/keystroke-kill.txt"
  stop_team
done

if [[ ,$parts, == *,multi,* ]]; then
  echo "multi-round workload through nginx ($users users, $rounds rounds; $(nproc) cores):"
  cat "$out/multi-round.txt"
  echo
fi
[[ ,$parts, == *,keystroke,* ]] && echo "typing through nginx, 2 replicas, $key_users users, $key_chars characters each; the busiest replica killed half way"
echo "(before/after: keystrokes after each session's first request; next: each user's first keystroke after the kill):"
[[ ,$parts, == *,keystroke,* ]] && cat "$out/keystroke-kill.txt"
echo "(results and logs in $out)"
