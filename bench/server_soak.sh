#!/usr/bin/env bash
# A soak test of efim-server: 64 editor sessions typing at once for a while, with a KV cache too
# small to hold them all (so blocks are evicted all the time), the server's resident memory sampled
# every 10 s. Passes when every request was answered with 200 (efim-bench stops at the first that is
# not), no answer was a 5xx, and the server shut down cleanly on SIGTERM; prints the memory series and
# the server's counters. The exit status says which: 0 passed, anything else failed.
#
#   bench/server_soak.sh [SECONDS] [BUILD_DIR]          (600 and build by default)
set -euo pipefail
seconds=${1:-600}
build=${2:-build}
corpus=${EFIM_SOAK_CORPUS:-/usr/include/c++/12}
work=$(mktemp -d)
server=""
sampler=""
cleanup() {
  local status=$?
  for pid in $sampler $server; do kill "$pid" 2> /dev/null || true; done
  rm -rf "$work"
  exit $status
}
trap cleanup EXIT
"$build/examples/efim-server" --port 0 --quiet --parallel 64 --cache-tokens 32768 > "$work/out" 2> "$work/log" &
server=$!
for _ in $(seq 1 300); do grep -q 'listening on' "$work/out" && break; sleep 0.1; done
url=$(sed -n 's/.*listening on //p' "$work/out")
if [ -z "$url" ]; then
  echo "soak: FAILED: efim-server did not start" >&2
  cat "$work/log" >&2
  exit 1
fi
echo "soak: efim-server $url (pid $server), 64 sessions, ${seconds} s, corpus $corpus"
(
  while kill -0 $server 2> /dev/null; do
    echo "$(date +%s) $(awk '/VmRSS/ {print $2}' /proc/$server/status)"
    sleep 10
  done
) > "$work/rss" &
sampler=$!
"$build/examples/efim-bench" --url "efim=$url" --keystroke --users 64 --documents 64 --corpus "$corpus" \
  --keystroke-prefix 600 --keystroke-suffix 600 --keystroke-chars 120 --output-tokens 8 \
  --duration "$seconds" --quiet --json "$work/soak.json"
curl -sf "$url/metrics" > "$work/metrics"
kill -TERM $server
server_status=0
wait $server || server_status=$?
server=""
kill $sampler 2> /dev/null || true
wait $sampler 2> /dev/null || true
sampler=""
echo "soak: resident memory (KiB) every 10 s:"
awk 'NR == 1 {t0 = $1} {printf "  %4d s  %s\n", $1 - t0, $2}' "$work/rss"
echo "soak: answers by status, and the cache:"
grep -E '^efim_requests_total\{endpoint="/infill"|^efim_kv_evicted_blocks_total|^efim_requests_finished_total' "$work/metrics" | sed 's/^/  /'
if grep -qE '^efim_requests_total\{[^}]*status="5[0-9][0-9]"' "$work/metrics"; then
  echo "soak: FAILED: the server answered with 5xx" >&2
  exit 1
fi
if [ "$server_status" -ne 0 ]; then
  echo "soak: FAILED: efim-server exited with status $server_status on SIGTERM" >&2
  tail -5 "$work/log" >&2
  exit 1
fi
echo "soak: passed"
