#!/bin/bash
# The file tier's steady-state read bandwidth against the disk's own (docs/performance.md, "The
# file tier"): `dd` with the cache bypassed and `blockswap run --host-budget 0`, alternating.
# Usage: bench/file_tier_bench.sh [FILE.safetensors] [runs]; FILE is written (32 blocks, hidden
# 1536: 3.6 GB) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${1:-/tmp/blockswap-file-tier.safetensors}
runs=${2:-3}
tool=build/blockswap
if [ ! -f "$file" ]; then
  "$tool" run --blocks 32 --hidden 1536 --heads 12 --tokens 16 --steps 1 --swap 30 \
    --save-weights "$file" --json > /dev/null
fi
for _ in $(seq "$runs"); do
  dd if="$file" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1 | awk '{print "dd", $(NF-1), $NF}'
  "$tool" run --weights "$file" --host-budget 0 --mode infer --swap 30 --tokens 16 --steps 3 \
    --link-gbps 0 --json 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
s = d["swapped"]
print("file tier", round(s["disk_read_bytes"] / s["step_seconds"] / 1e9, 3), "GB/s; step",
      round(s["step_seconds"], 3), "s; loaded whole", round(d["baseline"]["step_seconds"], 3),
      "s; peak RSS", s["peak_rss_bytes"], "B of", d["weights_file_bytes"], "; max_abs_diff",
      d["max_abs_diff"])'
done
