#!/usr/bin/env bash
# The README's Python install on this machine: a fresh virtual environment that sees the
# project's torch (the one PYTHON has, through a .pth file: the same torch at the same path, so
# that setup.py's CMake build compiles what CMake's build/ compiled and ccache serves it), pip
# install --no-build-isolation of the checkout, then an import and a swapped forward pass from
# outside the source tree; and `pip install .` without --no-build-isolation, which must stop at
# once with the command to use. (A fresh environment with its own torch, 2.7.1 or 2.14.1 with
# CUDA, is docs/build.md's manual check.)
# Usage: pip_install_test.sh SOURCE_DIR WORK_DIR PYTHON
set -euo pipefail
source_dir=$1 work_dir=$2 python=$3
rm -rf "$work_dir/venv"
mkdir -p "$work_dir"
"$python" -m venv "$work_dir/venv"
pip=("$work_dir/venv/bin/python" -m pip install -q --disable-pip-version-check)
torch_site=$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
"$work_dir/venv/bin/python" - "$torch_site" <<'PY'
import sys, sysconfig, os
with open(os.path.join(sysconfig.get_paths()["purelib"], "blockswap-test-torch.pth"), "w") as f:
    f.write(sys.argv[1] + "\n")
PY

# Without --no-build-isolation pip builds in an empty environment: one clear stop.
if out=$("${pip[@]}" --no-deps "$source_dir" 2>&1); then
  echo "pip install without --no-build-isolation succeeded; it must stop"; exit 1
fi
echo "$out" | grep "pip install --no-build-isolation ." >/dev/null \
  || { echo "$out" | tail -20; echo "pip install: not the expected message"; exit 1; }

"${pip[@]}" --no-build-isolation "$source_dir"
"$work_dir/venv/bin/python" -m pip show blockswap | grep "^Requires: torch" >/dev/null \
  || { echo "the built package does not require its torch"; exit 1; }
cd "$work_dir"
"$work_dir/venv/bin/python" - <<'PY'
import importlib.metadata
import torch
import blockswap

assert blockswap.__file__.startswith(__import__("sys").prefix), blockswap.__file__
# The wheel requires exactly the torch it was built against.
assert importlib.metadata.requires("blockswap") == [f"torch=={torch.__version__.split('+')[0]}"]
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
