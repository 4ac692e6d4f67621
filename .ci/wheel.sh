#!/usr/bin/env bash
# The wheel as a user installs it: built from this checkout, installed (not editable) into a fresh
# virtual environment, and checked from outside the repository that the C kernels it ships are
# built and in use. A wheel missing a csrc/ file would otherwise pass every test of an editable
# install while users silently ran the torch fallbacks.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d /tmp/shardserve-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "wheel check: FAILED: $*" >&2; exit 1; }

# Build from a copy of the files git would ship (tracked and new, not ignored): a stale build/
# in the checkout could put files into the wheel that the repository no longer has.
mkdir "$work/src"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -C "$work/src" -xf -
else
    cp -r . "$work/src"
fi
python -m pip wheel -q --no-deps -w "$work/dist" "$work/src" || fail "pip wheel failed"
wheel=$(ls "$work"/dist/shardserve-*.whl)
echo "wheel check: built $(basename "$wheel")"

# Every .c/.h under a csrc/ of the package must be in the wheel.
(cd src && find shardserve -path '*/csrc/*' \( -name '*.c' -o -name '*.h' \) | sort) > "$work/want"
python -m zipfile -l "$wheel" | awk '$1 ~ /\/csrc\// {print $1}' | sort > "$work/have"
echo "wheel check: the wheel's csrc files:"
sed 's/^/  /' "$work/have"
missing=$(comm -23 "$work/want" "$work/have")
[ -z "$missing" ] || fail "the wheel lacks: $(echo $missing)"

# torch first and pinned, as .ci/install.sh does: the wheel's bare torch requirement would pull a
# multi-GB CUDA build. The pip cache is shared with the rest of CI, so this is mostly copying.
python -m venv "$work/venv"
py=$work/venv/bin/python
"$py" -m pip install -q torch==2.13.0 || fail "pip install torch failed"
"$py" -m pip install -q "$wheel" || fail "pip install of the wheel failed"

# From outside the repository, with an empty kernel cache: the kernels are compiled from the
# wheel's own sources, and any one that is unavailable fails the check.
cd "$work"
export SHARDSERVE_CACHE=$work/cache
"$work/venv/bin/shardserve" env > env.txt || fail "shardserve env failed"
cat env.txt
"$py" - "$work/venv" <<'EOF' || fail "the installed wheel does not run its C kernels"
import json
import subprocess
import sys
from pathlib import Path

import torch

import shardserve
from shardserve.attention import cpu_kernel
from shardserve.layers import cpu_ops, kernels, quant_kernel

venv = Path(sys.argv[1]).resolve()
where = Path(shardserve.__file__).resolve()
assert venv in where.parents, f"shardserve imported from {where}, not the venv"
report = json.loads(subprocess.run([str(venv / "bin" / "shardserve"), "env", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
bad = [f"{k['provides']}: {k['error']}" for k in report["kernels"] if not k["loaded"]]
assert not bad, "C kernels unavailable: " + "; ".join(bad)
assert kernels.load().decode_layers  # the decode loop's entry point
w, x = torch.randn(24, 32), torch.randn(3, 32)
rows = quant_kernel.float_weight(w)
assert rows is not None, "quant_kernel does not take float32 rows"
torch.testing.assert_close(quant_kernel.linear(x, ((0, rows),), 24), x @ w.T, rtol=1e-4, atol=1e-4)
assert cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6) is not None
assert cpu_kernel.load().paged_decode_f32
print("wheel check: C kernels in use from", where.parent)
EOF
echo "wheel check: passed"
