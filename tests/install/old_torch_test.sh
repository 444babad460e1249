#!/usr/bin/env bash
# Configuring blockswap against a torch older than 2.7 is one clear error at configure time.
# Usage: old_torch_test.sh SOURCE_DIR WORK_DIR
set -uo pipefail
source_dir=$1 work_dir=$2
rm -rf "$work_dir"
out=$(cmake -S "$source_dir" -B "$work_dir" -G Ninja -DBLOCKSWAP_TORCH_PYTHON=/nonexistent \
        -DTorch_DIR="$source_dir/tests/install/torch-2.6" -DBLOCKSWAP_BUILD_TESTS=OFF 2>&1)
rc=$?
echo "$out" | tail -8
[ $rc -ne 0 ] || { echo "old_torch_test: configure succeeded against torch 2.6"; exit 1; }
echo "$out" | tr '\n' ' ' | tr -s ' ' | grep "blockswap needs torch 2.7 to 2.14; .* is torch 2.6.0" >/dev/null \
  || { echo "old_torch_test: not the expected message"; exit 1; }
echo "old_torch_test: ok"
