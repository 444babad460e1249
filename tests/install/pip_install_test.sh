#!/usr/bin/env bash
# The README's Python install on this machine: a virtual environment that sees Debian's torch
# (--system-site-packages), pip install --no-build-isolation of the checkout, then an import and
# a swapped forward pass from outside the source tree.
# Usage: pip_install_test.sh SOURCE_DIR WORK_DIR PYTHON
set -euo pipefail
source_dir=$1 work_dir=$2 python=$3
rm -rf "$work_dir/venv"
mkdir -p "$work_dir"
"$python" -m venv --system-site-packages "$work_dir/venv"
# ccache for the extension's compiles, as for the CMake build (its compiler links).
if [ -d /usr/lib/ccache ]; then export PATH="/usr/lib/ccache:$PATH"; fi
"$work_dir/venv/bin/pip" install -q --no-build-isolation "$source_dir"
cd "$work_dir"
"$work_dir/venv/bin/python" - <<'PY'
import torch
import blockswap

assert blockswap.__file__.startswith(__import__("sys").prefix), blockswap.__file__
blocks = [torch.nn.Linear(8, 8).requires_grad_(False) for _ in range(4)]
expected = torch.randn(2, 8)
x = expected.clone()
with torch.no_grad():
    for b in blocks:
        expected = b(expected)
    with blockswap.ModelOffloader("blocks", blocks, 4, 2, False, torch.device("cpu"), False) as o:
        o.prepare_block_devices_before_forward()
        for i, b in enumerate(blocks):
            o.wait_for_block(i)
            x = b(x)
            o.submit_move_blocks_forward(i)
assert torch.equal(x, expected)
print("pip install: ok")
PY
