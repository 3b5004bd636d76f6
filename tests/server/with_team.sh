#!/usr/bin/env bash
# Runs a command against a team's server as deploy/team.sh starts it: redis-server, 2 efim-server
# replicas sharing KV through it, nginx in front keeping each API key on one replica.
#   with_team.sh SERVER [SERVER FLAGS...] -- COMMAND [ARGS...]
# The command finds nginx's address in EFIM_URL, the user's key in EFIM_API_KEY, the replicas
# ("PID PORT" lines) in EFIM_TEAM_REPLICAS and their logs in EFIM_SERVER_LOG (a pattern). Says
# "skipped" without redis-server or nginx.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
server=$1
shift
flags=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
shift
for tool in redis-server nginx; do
  command -v $tool > /dev/null || [ -x /usr/sbin/$tool ] || { echo "with_team: skipped: no $tool (run .ci/setup)"; exit 0; }
done
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TEAM_DIR=$work EFIM_SERVER=$server bash "$here/../../deploy/team.sh" 2 "$port" -- \
  --api-key team-user-1,team-user-2 "${flags[@]}" > "$work/team.out" 2>&1 &
team=$!
cleanup() { kill "$team" 2> /dev/null; wait "$team" 2> /dev/null; rm -rf "$work"; }
trap cleanup EXIT
for _ in $(seq 1 600); do
  grep -q '^team.sh: http' "$work/team.out" && break
  kill -0 "$team" 2> /dev/null || break
  sleep 0.2
done
if ! grep -q '^team.sh: http' "$work/team.out"; then
  echo "with_team: the team did not start:"; cat "$work/team.out" "$work"/*.log; exit 1
fi
export EFIM_URL=http://127.0.0.1:$port EFIM_API_KEY=team-user-1
export EFIM_TEAM_REPLICAS=$work/replicas EFIM_SERVER_LOG="$work/replica-*.log"
"$@"
rc=$?
if [ $rc -ne 0 ]; then
  echo "with_team: command exit $rc; the replicas' and nginx's logs:"
  tail -n 40 "$work"/replica-*.log "$work"/nginx-error.log
fi
exit $rc
