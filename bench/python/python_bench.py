"""blockswap.ModelOffloader against the seed's algorithm (seed_offloader.py) on the same
nn.Module model, in one process, side by side: time per step, device memory, bytes moved, and
the largest difference from the model run without swapping (it must be 0).

On a GPU (scripts/gpu-check): python3 bench/python/python_bench.py --device cuda --out OUT
Here, a smoke test on the emulated device (the seed needs CUDA, so its column is empty):
    python3 bench/python/python_bench.py --device cpu --quick
"""
import argparse
import copy
import json
import os
import sys
import time

import torch

import blockswap

sys.path.insert(0, os.path.dirname(__file__))
from reference_model import make_blocks  # noqa: E402
from seed_offloader import SeedOffloader  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_time(blocks, x0, train, device, offloader, steps):
    """Seconds per step (the first step is a warm-up) and the last output."""
    times, out = [], None
    for step in range(steps + 1):
        sync(device)
        start = time.perf_counter()
        if offloader is not None:
            offloader.prepare_block_devices_before_forward()
        with torch.set_grad_enabled(train):
            x = x0
            for i, block in enumerate(blocks):
                if offloader is not None:
                    offloader.wait_for_block(i)
                x = block(x)
                if offloader is not None:
                    offloader.submit_move_blocks_forward(i)
            if train:
                x.pow(2).mean().backward()
        sync(device)
        if step > 0:
            times.append(time.perf_counter() - start)
        out = x.detach()
    return sum(times) / len(times), out


def run(kind, model, mode, k, device, steps):
    train = mode == "train"
    blocks = make_blocks(model["blocks"], model["hidden"], model["heads"], 8 if train else 0)
    torch.manual_seed(1)
    x0 = torch.randn(1, model["tokens"], model["hidden"], device=device)
    offloader = None
    if kind == "noswap":
        blocks.to(device)
    elif kind == "seed":
        offloader = SeedOffloader("blocks", list(blocks), k, train, device)
        if not train:
            offloader.set_forward_only(True)
    else:
        for block in blocks:  # adapters train on the device; frozen weights are swapped
            for p in block.parameters():
                if p.requires_grad:
                    p.data = p.data.to(device)
        offloader = blockswap.ModelOffloader("blocks", list(blocks), len(blocks), k, train,
                                             device, False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, out = step_time(blocks, x0, train, device, offloader, steps)
    row = {"kind": kind, "mode": mode, "k": k, "step_seconds": seconds, "out": out}
    if kind == "blockswap":
        stats = offloader.stats()
        row.update(h2d_bytes=stats["h2d_bytes"] / (steps + 1),
                   weight_device_bytes=stats["peak_device_bytes"])
        offloader.close()
    if kind == "seed":
        offloader.pool.shutdown(wait=True)
    if device.type == "cuda":
        row["torch_peak_bytes"] = torch.cuda.max_memory_allocated()
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick:
        model = {"blocks": 6, "hidden": 64, "heads": 4, "tokens": 32, "steps": 2}
    else:  # hidden 1280: about 75 MiB of weights per block
        model = {"blocks": 16, "hidden": 1280, "heads": 20, "tokens": 4096, "steps": 5}
    n = model["blocks"]
    kinds = ["noswap", "blockswap"] + (["seed"] if device.type == "cuda" else [])
    rows = []
    for mode, ks in (("infer", sorted({n // 4, n // 2, n - 1})),
                     ("train", sorted({n // 4, n // 2, n - 2}))):
        for k in ks:
            results = {kind: run(kind, model, mode, k, device, model["steps"]) for kind in kinds}
            base = results["noswap"]
            row = {"mode": mode, "k": k, "t_noswap": base["step_seconds"]}
            for kind in kinds[1:]:
                r = results[kind]
                row[f"t_{kind}"] = r["step_seconds"]
                row[f"max_abs_diff_{kind}"] = (r["out"].cpu() - base["out"].cpu()).abs().max().item()
                for key in ("h2d_bytes", "weight_device_bytes", "torch_peak_bytes"):
                    if key in r:
                        row[f"{key}_{kind}"] = r[key]
            if "t_seed" in row:
                row["seed_over_blockswap"] = row["t_seed"] / row["t_blockswap"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    failed = [r for r in rows if r["max_abs_diff_blockswap"] != 0]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "python-bench.json"), "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "model": model,
                       "rows": rows}, f, indent=2)
    print("\nmode   K  T_blockswap/T_noswap  T_seed/T_blockswap  max_abs_diff")
    for r in rows:
        seed = f"{r['seed_over_blockswap']:18.3f}" if "seed_over_blockswap" in r else f"{'-':>18}"
        print(f"{r['mode']:<6}{r['k']:>3}  {r['t_blockswap'] / r['t_noswap']:20.3f}  {seed}"
              f"  {r['max_abs_diff_blockswap']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
