#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md): scripts/gpu_check.sh [OUT_DIR] (default $OUT, else
# ./gpu_check_out). On a machine without CUDA every GPU stage reports skipped (CI runs it so).
# Wheels carried beside the tree in ./wheels (scripts/gpu_wheels.sh fetches them) are installed
# first, with no index: the GPU machine has torch and Triton but not the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check_out}}"
if [ -d wheels ] && ls wheels/*.whl > /dev/null 2>&1; then
    pip install -q --no-index --find-links wheels wheels/*.whl
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec python scripts/gpu_check.py --out "$out"
