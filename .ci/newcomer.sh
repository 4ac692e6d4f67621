#!/usr/bin/env bash
# The README's first command as a newcomer runs it: a fresh virtual environment holding only what
# that command installs, the server started in the background, /health, the README's client
# example (openai installed separately, as the README says), then Ctrl-C and no process left.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d /tmp/shardserve-newcomer.XXXXXX)
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then
        kill -KILL -- "-$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "newcomer check: FAILED: $*" >&2; [ -f "$work/server.log" ] && tail -n 40 "$work/server.log" >&2; exit 1; }

# The first ```bash block's command and the first ```python block (the client example).
first_cmd=$(awk '/^```bash/{on=1; next} on && /^```/{exit} on && NF{print; exit}' README.md)
awk '/^```python/{on=1; next} on && /^```/{exit} on{print}' README.md > "$work/client.py"
[ -n "$first_cmd" ] || fail "README.md has no bash block"
[ -s "$work/client.py" ] || fail "README.md has no python block"
install=${first_cmd% && *}
start=${first_cmd##* && }
case "$start" in shardserve*) ;; *) fail "the first command does not end by starting shardserve: $first_cmd" ;; esac
echo "newcomer check: $first_cmd"

python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 8000)); s.close()' \
    || fail "port 8000 (the README's port) is busy on this machine"
(eval "$install") > "$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; fail "install failed"; }
setsid bash -c "exec $start" > "$work/server.log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + 300))
until python -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8000/health", timeout=2)' 2>/dev/null; do
    kill -0 "$server_pid" 2>/dev/null || fail "the server exited while starting"
    [ $SECONDS -lt $deadline ] || fail "the server was not healthy after 300 s"
    sleep 1
done
echo "newcomer check: /health ok after ${SECONDS}s"

pip install -q openai > "$work/openai.log" 2>&1 || fail "pip install openai failed"
answer=$(cd "$work" && timeout 120 python client.py) || fail "the README's client example failed"
echo "newcomer check: the client example answered: $answer"
case "$answer" in *Paris*) ;; *) fail "the client example's answer does not name Paris" ;; esac

kill -INT "$server_pid"
for _ in $(seq 1 100); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$server_pid" 2>/dev/null && fail "the server did not stop within 10 s of Ctrl-C"
wait "$server_pid" && code=0 || code=$?
[ "$code" -eq 0 ] || fail "the server exited with $code after Ctrl-C"
# Anything still alive (zombies aside) in the server's session a few seconds on was left behind.
for _ in $(seq 1 50); do
    left=$(ps -eo pid=,sid=,stat= | awk -v s="$server_pid" '$2 == s && $3 !~ /^Z/ {print $1}')
    [ -z "$left" ] && break
    sleep 0.1
done
[ -z "$left" ] || fail "processes left behind: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
grep -q Traceback "$work/server.log" && fail "the server's log has a traceback"
server_pid=""
echo "newcomer check: passed (stopped cleanly, no process left)"
deactivate
cd "$repo"
