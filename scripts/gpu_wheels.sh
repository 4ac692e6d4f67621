#!/usr/bin/env bash
# Fetch the wheels scripts/gpu_check.sh installs on a GPU machine that has torch and Triton only,
# into ./wheels (git-ignored; carry it with the tree). Binary wheels are for this Python: pass
# PYTHON_VERSION=3.12 (say) to fetch for the GPU machine's instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ver="${PYTHON_VERSION:-$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
pip download -q --only-binary=:all: --python-version "$ver" --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --dest wheels \
    pyzmq msgspec gguf llguidance==1.9.1 transformers tokenizers safetensors huggingface-hub regex pyyaml \
    tqdm prometheus-client pytest pytest-timeout iniconfig pluggy
du -sh wheels
