#!/usr/bin/env bash
# ctest's llama_vim: the real llama.vim plugin in Vim, driven through tmux as a person would use it,
# against a fresh efim-server: open a Python file, start a new line, type slowly until a suggestion
# appears as ghost text (with llama.vim's info on the prompt it read from the response), accept it
# with Tab, save. Passes when the saved file holds the accepted text and the server logged the
# keystroke requests as appends to one session. Says "skipped" without vim, tmux, curl or the plugin
# (.ci/setup installs the tools; the plugin is read from the shared clients folder).
#   llama_vim.sh SERVER PLUGIN_DIR
# Through a team's server (EFIM_WITH_SERVER=with_team.sh: replicas behind nginx, a key per user), the
# replica that served the first keystrokes is killed before the suggestion is accepted; the next
# keystroke, on the other replica, must continue the session with the blocks kept in the store.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "${1:-}" != "--inside" ]; then
  server=$1 plugin=$2
  for tool in vim tmux curl; do
    command -v $tool > /dev/null || { echo "llama_vim: skipped: no $tool (run .ci/setup)"; exit 0; }
  done
  [ -f "$plugin/autoload/llama.vim" ] || { echo "llama_vim: skipped: no llama.vim in $plugin"; exit 0; }
  # EFIM_WITH_SERVER: another launcher (with_llama_server.sh: efim-server in front of llama-server).
  exec ${EFIM_WITH_SERVER:-bash $here/with_server.sh} "$server" --threads 2 -- bash "$0" --inside "$plugin"
fi
plugin=$2
work=$(mktemp -d)
sock="efim-llama-vim-$$"
cleanup() { tmux -L "$sock" kill-server 2> /dev/null; rm -rf "$work"; }
trap cleanup EXIT
cat > "$work/vimrc" <<VIM
set nocompatible
let g:llama_config = {'endpoint_fim': '$EFIM_URL/infill', 'show_info': 1, 'api_key': '${EFIM_API_KEY:-}'}
set laststatus=2
set runtimepath^=$plugin
filetype plugin indent on
set noswapfile
VIM
printf 'def fibonacci(n):\n    if n < 2:\n        return n\n\n\nprint(fibonacci(10))\n' > "$work/fib.py"
screen() { tmux -L "$sock" capture-pane -p -t vim; }
# Waits until the screen matches a pattern; fails with the screen after $2 seconds.
wait_for() {
  for _ in $(seq 1 $(( $2 * 10 ))); do
    shown=$(screen)
    grep -qE "$1" <<< "$shown" && return 0
    sleep 0.1
  done
  echo "llama_vim: no /$1/ on the screen after $2 s:"; screen; exit 1
}
tmux -L "$sock" new-session -d -s vim -x 160 -y 40 "vim -u $work/vimrc $work/fib.py"
# llama.vim warns that it wants Vim 9.1 (Debian 12 has 9.0, which it works with): dismiss that.
wait_for 'fibonacci|Press ENTER' 20
grep -q 'Press ENTER' <<< "$(screen)" && tmux -L "$sock" send-keys -t vim Enter
wait_for 'fibonacci' 20
tmux -L "$sock" send-keys -t vim 3G o
typed=ret
for key in r e t; do
  sleep 0.4
  tmux -L "$sock" send-keys -t vim "$key"
done
# The suggestion: ghost text after "    ret", and llama.vim's info in the status line (cached tokens,
# prompt and generation timings), which it reads from the response's fields.
wait_for 'llama.vim \| c: [0-9]+, r: [0-9]+/[0-9]+' 60
echo "llama_vim: $(grep -o 'llama.vim | c: .*' <<< "$shown")"
if [ -n "${EFIM_TEAM_REPLICAS:-}" ]; then
  # The replica that served the keystrokes dies; the next one goes to the other through nginx.
  serving="" survivor=""
  i=0
  while read -r pid _; do
    i=$((i + 1))
    log=$(dirname "$EFIM_TEAM_REPLICAS")/replica-$i.log
    if grep -q 'POST /infill 200' "$log"; then serving="$serving $pid"; else survivor=$log; fi
  done < "$EFIM_TEAM_REPLICAS"
  if [ "$(wc -w <<< "$serving")" != 1 ] || [ -z "$survivor" ]; then
    echo "llama_vim: the keystrokes did not stay on one replica"; exit 1
  fi
  kill -9 $serving
  echo "llama_vim: killed the replica that served the keystrokes (pid$serving)"
  # Typing goes on until a keystroke's request reaches the other replica. A keystroke's request names
  # its session (#n); llama.vim's context updates, sent when the cursor rests, do not (session=-).
  # Each key differs from the suggestion shown after the text typed: one that continues it would be
  # shown from llama.vim's own cache of completions, and llama.vim might send nothing.
  moved=""
  for _ in 1 2 3; do
    sleep 0.4
    line=$(screen | sed -n 4p | sed 's/^ *//')
    ghost=${line#"$typed"}
    key=u
    [ "${ghost:0:1}" = u ] && key=x
    typed=$typed$key
    tmux -L "$sock" send-keys -t vim "$key"
    echo "llama_vim: typed $key (the suggestion shown began \"${ghost:0:1}\")"
    for _ in $(seq 1 50); do grep -aq 'POST /infill 200 session=#.*computed=' "$survivor" && break; sleep 0.1; done
    moved=$(grep -a -m1 'POST /infill 200 session=#.*computed=' "$survivor")
    [ -n "$moved" ] && break
  done
  echo "llama_vim: the next keystroke on the other replica: ${moved:-none}"
  # Taken up from the store: the session found (an append, an accepted suggestion or an edit as
  # llama.vim's speculative requests make them, never a session's first), its blocks read (a new
  # replica without the store would have none cached).
  cached=$(grep -o 'cached=[0-9]*' <<< "$moved" | cut -d= -f2)
  if [[ "$moved" == *"change=first"* ]] || [ "${cached:-0}" -lt 16 ]; then
    echo "llama_vim: the other replica did not continue the session from the store"; exit 1
  fi
  sleep 0.5
  wait_for 'llama.vim \| c: [0-9]+, r: [0-9]+/[0-9]+' 60
fi
# The suggestion Tab accepts: ghost text after "ret" on line 4, the same in two captures 0.3 s apart
# (llama.vim's speculative requests may clear and redraw it meanwhile).
last=""
for _ in $(seq 1 100); do
  sleep 0.3
  shown=$(screen)
  line=$(sed -n 4p <<< "$shown" | tr -d '[:space:]')
  [ ${#line} -gt 3 ] && [ "$line" = "$last" ] && break
  last=$line
done
echo "llama_vim: suggestion shown:"
sed -n '4,6p' <<< "$shown" | cut -c1-120
tmux -L "$sock" send-keys -t vim Tab
sleep 0.5
tmux -L "$sock" send-keys -t vim Escape
tmux -L "$sock" send-keys -t vim ':wq' Enter
for _ in $(seq 1 100); do tmux -L "$sock" has-session -t vim 2> /dev/null || break; sleep 0.1; done
echo "llama_vim: lines 4-6 after Tab:"
sed -n '4,6p' "$work/fib.py" | cut -c1-120
# The file grew by more than the text typed ("ret", and the keys typed after a kill), and starts what
# was shown where the suggestion was.
if [ "$(sed -n 4p "$work/fib.py" | sed 's/^ *//')" = "$typed" ] && [ "$(wc -l < "$work/fib.py")" -le 7 ]; then
  echo "llama_vim: nothing was accepted:"; cat "$work/fib.py"; exit 1
fi
# (blanks aside: the screen shows a tab as spaces and drops trailing ones; compared as bytes)
want=$(sed -n 4p <<< "$shown" | tr -d '[:space:]') got=$(sed -n 4p "$work/fib.py" | tr -d '[:space:]')
n=$(LC_ALL=C; echo $(( ${#got} < 24 ? ${#got} : 24 )))
if [ "$(LC_ALL=C; echo "${got:0:$n}")" != "$(LC_ALL=C; echo "${want:0:$n}")" ]; then
  echo "llama_vim: line 4 differs from the suggestion shown"; exit 1
fi
# The keystrokes were requests of one session, laid out as appends to its anchor.
# (with_team.sh: EFIM_SERVER_LOG is a pattern matching each replica's log)
# (grep reads the files itself: `cat | grep -q` under pipefail fails when grep stops reading first)
# shellcheck disable=SC2086
if ! grep -q 'POST /infill 200 session=#1 change=append' $EFIM_SERVER_LOG; then
  echo "llama_vim: no keystroke request was an append to the session"; exit 1
fi
echo "llama_vim: ok"
