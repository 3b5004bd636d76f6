#!/usr/bin/env bash
# Runs a command against a fresh efim-server: with_server.sh SERVER [SERVER FLAGS...] -- COMMAND [ARGS...]
# The server listens on a free port of 127.0.0.1; the command finds its address in EFIM_URL. The
# server is then stopped with SIGTERM and must exit 0. Its log (EFIM_SERVER_LOG: one line per request)
# is shown when anything fails.
set -uo pipefail
server=$1
shift
flags=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkfifo "$work/out"
"$server" --port 0 "${flags[@]}" > "$work/out" 2> "$work/log" &
pid=$!
exec 3< "$work/out"
if ! read -r -t 180 line <&3 || [[ "$line" != *"listening on "* ]]; then
  echo "with_server: efim-server did not start: ${line:-}"; cat "$work/log"; kill -9 $pid 2>/dev/null; exit 1
fi
export EFIM_URL=${line##*listening on }
export EFIM_SERVER_LOG="$work/log"
"$@"
rc=$?
kill -TERM $pid
wait $pid
server_rc=$?
if [ $rc -ne 0 ] || [ $server_rc -ne 0 ]; then
  echo "with_server: command exit $rc, efim-server exit $server_rc; the server's log:"
  cat "$work/log"
  exit $(( rc != 0 ? rc : server_rc ))
fi
