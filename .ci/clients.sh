#!/usr/bin/env bash
# Install the real clients that tests/e2e/test_real_clients.py runs against a live server, in their
# own virtual environment: they pin their own transformers, datasets and numpy, which must not
# change the server's environment.
#   SHARDSERVE_CLIENTS_VENV  where the environment goes (default /tmp/shardserve-clients/venv)
# Idempotent: a second run with the same pins only checks the stamp and returns.
set -euo pipefail

VENV="${SHARDSERVE_CLIENTS_VENV:-/tmp/shardserve-clients/venv}"
# torch first and pinned, as in install.sh: guidellm requires a bare `torch`, which would
# otherwise pull a multi-GB CUDA build. lm-eval's [api] extra is what its local-completions model
# imports (aiohttp, requests, tenacity, tiktoken).
PINS=(torch==2.13.0 guidellm==0.8.1 "lm-eval[api]==0.4.13")
STAMP="$VENV/.shardserve-clients"

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "${PINS[*]}" ]]; then
    exit 0
fi

rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@"; }
pip install "${PINS[0]}"
pip install "${PINS[@]:1}"
"$VENV/bin/guidellm" --version >/dev/null
"$VENV/bin/python" -c "import lm_eval.models.openai_completions"
echo "${PINS[*]}" >"$STAMP"
