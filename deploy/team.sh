#!/usr/bin/env bash
# A team's server on this machine, on loopback: redis-server (the KV tier the replicas share), N
# efim-server replicas, and nginx in front keeping each user (API key) on one replica (HAProxy
# instead with TEAM_PROXY=haproxy: deploy/haproxy.cfg.in).
#
#   deploy/team.sh [REPLICAS] [PORT] [-- efim-server flags...]     (2 replicas, port 8012)
#
# Editors and clients use http://127.0.0.1:PORT with their own API key (llama.vim: api_key in
# g:llama_config; OpenAI clients: apiKey). Ctrl-C stops everything. Logs in $TEAM_DIR (a temporary
# directory unless set), and $TEAM_DIR/replicas: a line "PID PORT" per replica.
#
# To compare: TEAM_KV_STORE=none runs no Redis (each replica keeps its own KV), TEAM_BALANCE=round-robin
# spreads requests over the replicas without affinity.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
replicas=${1:-2}
port=${2:-8012}
shift $(($# < 2 ? $# : 2))
[ "${1:-}" = "--" ] && shift
server=${EFIM_SERVER:-$here/../build/examples/efim-server}
dir=${TEAM_DIR:-$(mktemp -d)}
mkdir -p "$dir"
store=${TEAM_KV_STORE:-redis}
balance=${TEAM_BALANCE:-hash}
proxy=${TEAM_PROXY:-nginx}
case "$store/$balance/$proxy" in
  redis/hash/nginx | redis/round-robin/nginx | none/hash/nginx | none/round-robin/nginx) ;;
  redis/hash/haproxy | redis/round-robin/haproxy | none/hash/haproxy | none/round-robin/haproxy) ;;
  *) echo "team.sh: TEAM_KV_STORE is redis or none, TEAM_BALANCE hash or round-robin, TEAM_PROXY nginx or haproxy" >&2
     exit 2 ;;
esac
tools=("$proxy")
[ "$store" = redis ] && tools+=(redis-server)
for tool in "${tools[@]}"; do
  command -v $tool >/dev/null || [ -x /usr/sbin/$tool ] || { echo "team.sh: no $tool (apt-get install $tool)" >&2; exit 1; }
done
[ -x "$server" ] || { echo "team.sh: no $server (build first, or set EFIM_SERVER)" >&2; exit 1; }

pids=()
stop() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
store_flags=()
if [ "$store" = redis ]; then
  redis_port=$(free_port)
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    --maxmemory "${TEAM_REDIS_MEMORY:-2gb}" --maxmemory-policy allkeys-lru > "$dir/redis.log" 2>&1 &
  pids+=($!)
  store_flags=(--kv-store "redis://127.0.0.1:$redis_port")
fi
servers=""
: > "$dir/replicas"
for i in $(seq 1 "$replicas"); do
  p=$(free_port)
  "$server" --port "$p" "${store_flags[@]}" "$@" > "$dir/replica-$i.out" 2> "$dir/replica-$i.log" &
  pids+=($!)
  echo "${pids[-1]} $p" >> "$dir/replicas"
  if [ "$proxy" = nginx ]; then
    servers+="server 127.0.0.1:$p max_fails=1 fail_timeout=10s; "
  else
    servers+="server replica-$i 127.0.0.1:$p check inter 1s fall 1 rise 1\\n  "
  fi
  until curl -sf "127.0.0.1:$p/health" >/dev/null; do
    kill -0 "${pids[-1]}" 2>/dev/null || { echo "team.sh: replica $i did not start:" >&2; cat "$dir/replica-$i.log" >&2; exit 1; }
    sleep 0.2
  done
done
rr=()
if [ "$proxy" = nginx ]; then
  [ "$balance" = round-robin ] && rr=(-e '/hash \$efim_user consistent;/d')
  sed -e "s|@DIR@|$dir|g" -e "s|@LISTEN@|127.0.0.1:$port|" -e "s|@SERVERS@|$servers|" "${rr[@]}" \
    "$here/nginx.conf.in" > "$dir/nginx.conf"
  nginx=$(command -v nginx || echo /usr/sbin/nginx)
  "$nginx" -p "$dir" -c "$dir/nginx.conf" -g "user $(id -un);" 2> "$dir/nginx.log" &
else
  [ "$balance" = round-robin ] && rr=(-e 's|^  balance hash .*|  balance roundrobin|')
  sed -e "s|@LISTEN@|127.0.0.1:$port|" -e "s|@SERVERS@|$servers|" "${rr[@]}" \
    "$here/haproxy.cfg.in" > "$dir/haproxy.cfg"
  haproxy=$(command -v haproxy || echo /usr/sbin/haproxy)
  "$haproxy" -db -f "$dir/haproxy.cfg" > "$dir/haproxy.log" 2>&1 &
fi
pids+=($!)
until curl -sf "127.0.0.1:$port/health" >/dev/null; do sleep 0.2; done
echo "team.sh: http://127.0.0.1:$port ($proxy, $replicas replicas, ${balance/hash/affinity by API key}, KV store ${store_flags[1]:-none}; logs in $dir)"
wait
