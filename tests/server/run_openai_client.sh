#!/usr/bin/env bash
# ctest's openai_client: the `openai` npm package against a fresh efim-server. Says "skipped" (a
# skipped test for ctest) when Node.js or the package is missing; .ci/setup installs both.
#   run_openai_client.sh SERVER NODE NODE_MODULES
set -uo pipefail
server=$1 node=$2 modules=$3
if ! command -v "$node" > /dev/null || [ ! -f "$modules/openai/package.json" ]; then
  echo "openai_client: skipped: needs node ($node) and $modules/openai; run .ci/setup"
  exit 0
fi
# EFIM_WITH_SERVER: another launcher (with_llama_server.sh: efim-server in front of llama-server).
exec ${EFIM_WITH_SERVER:-bash $(dirname "$0")/with_server.sh} "$server" --threads 2 -- "$node" "$(dirname "$0")/openai_client.mjs" "$modules"
