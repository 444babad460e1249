"""Activation offloading on the reference transformer (reference_model.py): the device bytes
held by saved activations at their peak, with offloading and without, for several block counts
and token counts; the step time of both side by side; and the largest difference of the
adapters' gradients between the two (it must be 0).

    python3 bench/python/activation_bench.py                    # the emulated device ('cpu')
    python3 bench/python/activation_bench.py --device cuda      # a GPU (scripts/gpu-check)
    python3 bench/python/activation_bench.py --quick --json OUT.json

Without offloading the saved activations are counted by the same hooks with a threshold that
no tensor passes, so both columns count the same tensors (weights and adapters excluded).
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

import blockswap
from blockswap import _activations

sys.path.insert(0, os.path.dirname(__file__))
from reference_model import make_blocks  # noqa: E402


def run(blocks, x0, device, k, offload, steps, threshold):
    threshold = threshold if offload else (1 << 62)  # counting only: nothing passes
    offloader = blockswap.ModelOffloader("blocks", list(blocks), len(blocks), k, True, device,
                                         False, offload_activations=True,
                                         activation_threshold_bytes=threshold)
    store = _activations.store_for(device)
    params = [p for p in blocks.parameters() if p.requires_grad]
    times, grads = [], None
    for step in range(steps + 1):
        if step == 1:
            store.reset_stats()
        for p in params:
            p.grad = None
        start = time.perf_counter()
        offloader.prepare_block_devices_before_forward()
        x = x0.clone().requires_grad_(True)
        for i, block in enumerate(blocks):
            offloader.wait_for_block(i)
            x = block(x)
            offloader.submit_move_blocks_forward(i)
        x.float().pow(2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
        grads = [p.grad.clone() for p in params]
    stats = offloader.stats()
    offloader.close()
    return sorted(times)[len(times) // 2], stats, grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--swap", type=int, default=0, help="blocks to swap (K)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threshold", type=int, default=16 << 10,
                        help="activation_threshold_bytes (default 16 KiB: these blocks are "
                             "small; the library's default is 1 MiB)")
    parser.add_argument("--quick", action="store_true", help="N = 8 and 16, 256 tokens")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    device = torch.device(args.device)
    sizes = [8, 16] if args.quick else [8, 16, 32]
    tokens = [256] if args.quick else [256, 1024, 2048]
    rows = []
    print(f"{'N':>3} {'tokens':>6} {'kept MB':>9} {'offloaded MB':>12} {'/ a block':>9} "
          f"{'step kept s':>11} {'step offl. s':>12} {'ratio':>6} {'max diff':>8}")
    for n in sizes:
        for t in tokens:
            blocks = make_blocks(n, args.hidden, args.heads, rank=4).to(device)
            twin = copy.deepcopy(blocks)
            x0 = torch.randn(1, t, args.hidden, device=device)
            t_kept, s_kept, g_kept = run(blocks, x0, device, args.swap, False, args.steps,
                                          args.threshold)
            t_off, s_off, g_off = run(twin, x0, device, args.swap, True, args.steps,
                                       args.threshold)
            diff = max((a - b).abs().max().item() for a, b in zip(g_kept, g_off))
            kept, off = s_kept["peak_activation_bytes"], s_off["peak_activation_bytes"]
            per_block = kept / n
            row = dict(blocks=n, tokens=t, hidden=args.hidden, kept_peak_bytes=kept,
                       offloaded_peak_bytes=off, offloaded_in_blocks=off / per_block,
                       step_seconds_kept=t_kept, step_seconds_offloaded=t_off,
                       offloaded_bytes=s_off["activation_offloaded_bytes"],
                       max_abs_diff=diff, device=str(device))
            rows.append(row)
            print(f"{n:>3} {t:>6} {kept / 1e6:>9.1f} {off / 1e6:>12.1f} {off / per_block:>9.2f} "
                  f"{t_kept:>11.3f} {t_off:>12.3f} {t_off / t_kept:>6.2f} {diff:>8.1g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if any(r["max_abs_diff"] != 0 for r in rows):
        sys.exit("activation_bench: offloading changed the gradients")


if __name__ == "__main__":
    main()
