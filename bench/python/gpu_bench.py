"""The GPU benchmark (run by scripts/gpu-check): every figure is a ratio from one run.

(a) host-to-device bandwidth by copy size, pinned and pageable;
(b) the reference transformer through `blockswap run` for a sweep of K, inference and
    training, against the bound T* = max(T_noswap, h2d_bytes / B) of DESIGN.md section 6;
(c) the same model driven by the seed's own algorithm (seed_offloader.py): T_seed / T_swap;
(d) the schedule simulator's prediction of each step from the measured no-swap step and link;
(e) full fine-tuning (AdamW fused into backward) with the step on the device and on the host,
    each against LibTorch's AdamW without swapping: which one `step_on=automatic` should be.

Usage: python3 bench/python/gpu_bench.py --tool build-gpu/blockswap --out OUT_DIR
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from reference_model import make_blocks  # noqa: E402
from seed_offloader import SeedOffloader  # noqa: E402


def bandwidth(sizes, repeats=10):
    rows = []
    for size in sizes:
        device = torch.empty(size, dtype=torch.uint8, device="cuda")
        for pinned in (True, False):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                device.copy_(host, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / repeats
            rows.append({"bytes": size, "pinned": pinned, "gbps": size / seconds / 1e9})
    return rows


def pinned_gbps(rows, size):
    best = min((r for r in rows if r["pinned"]), key=lambda r: abs(r["bytes"] - size))
    return best["gbps"]


def run_tool(tool, mode, k, model, link_gbps, extra=()):
    # --link-gbps: on CUDA only the simulator's prediction uses it (swapped.predicted_step_seconds).
    args = [tool, "run", "--device", "cuda", "--mode", mode, "--swap", str(k), "--json",
            "--link-gbps", f"{link_gbps:.3f}",
            "--blocks", str(model["blocks"]), "--hidden", str(model["hidden"]),
            "--heads", str(model["heads"]), "--tokens", str(model["tokens"]),
            "--steps", str(model["steps"]), *extra]
    # The tool exits 1 when the results differ; its JSON still says by how much.
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return json.loads(proc.stdout)


def run_seed(mode, k, model):
    train = mode == "train"
    blocks = make_blocks(model["blocks"], model["hidden"], model["heads"], 8 if train else 0)
    offloader = SeedOffloader("blocks", list(blocks), k, train, torch.device("cuda"))
    if not train:
        offloader.set_forward_only(True)
    torch.manual_seed(1)
    x0 = torch.randn(1, model["tokens"], model["hidden"], device="cuda")
    times = []
    for step in range(model["steps"] + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        offloader.prepare_block_devices_before_forward()
        with torch.set_grad_enabled(train):
            x = x0
            for i, block in enumerate(blocks):
                offloader.wait_for_block(i)
                x = block(x)
                offloader.submit_move_blocks_forward(i)
            if train:
                x.pow(2).mean().backward()
        torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
    offloader.pool.shutdown(wait=True)
    return sum(times) / len(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    sizes = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    link = bandwidth(sizes)
    # hidden 1280: 12 * 1280^2 * 4 bytes = 75 MiB per block (>= 64 MiB).
    model = {"blocks": 16, "hidden": 1280, "heads": 20, "tokens": 4096, "steps": 3 if args.quick else 5}
    n = model["blocks"]
    block_gbps = pinned_gbps(link, 12 * model["hidden"] ** 2 * 4)
    sweep = []
    modes = ((("infer", [0, n // 2, n - 1]), ("train", [0, n // 2, n - 2])) if args.quick else
             (("infer", [0, n // 4, n // 2, 3 * n // 4, n - 1]),
              ("train", [0, n // 4, n // 2, 3 * n // 4, n - 2])))
    for mode, ks in modes:
        for k in ks:
            ours = run_tool(args.tool, mode, k, model, block_gbps)
            block_bytes = ours["baseline"]["peak_device_bytes"] / n
            b = pinned_gbps(link, block_bytes) * 1e9
            t_noswap = ours["baseline"]["step_seconds"]
            t_swap = ours["swapped"]["step_seconds"]
            t_bound = max(t_noswap, ours["swapped"]["h2d_bytes"] / b)
            t_seed = run_seed(mode, k, model)
            # The schedule simulator's prediction from the measured no-swap step and link: a
            # step here ends when its copies are done, the simulator's inference pass is one of
            # a sequence (its last loads overlap the next pass), so inference may read a
            # little above it.
            t_predicted = ours["swapped"].get("predicted_step_seconds", 0.0)
            row = {"mode": mode, "k": k, "t_noswap": t_noswap, "t_swap": t_swap, "t_bound": t_bound,
                   "t_seed": t_seed, "swap_over_bound": t_swap / t_bound,
                   "swap_over_noswap": t_swap / t_noswap, "seed_over_swap": t_seed / t_swap,
                   "h2d_bytes": ours["swapped"]["h2d_bytes"],
                   "peak_device_bytes": ours["swapped"]["peak_device_bytes"],
                   "max_abs_diff": ours["max_abs_diff"], "t_predicted": t_predicted,
                   "swap_over_predicted": t_swap / t_predicted if t_predicted > 0 else None}
            sweep.append(row)
            print(json.dumps(row), flush=True)

    # Full fine-tuning: where the fused step is faster. The block's bytes on the link count
    # both ways (loads, and write-backs or gradients).
    finetune = []
    for k in ((n // 2,) if args.quick else (0, n // 2, n - 2)):
        for where in ("device", "host"):
            ours = run_tool(args.tool, "finetune", k, model, block_gbps, ("--step-on", where))
            t_noswap = ours["baseline"]["step_seconds"]
            t_swap = ours["swapped"]["step_seconds"]
            moved = ours["swapped"]["h2d_bytes"] + ours["swapped"]["d2h_bytes"]
            row = {"step_on": where, "k": k, "t_noswap": t_noswap, "t_swap": t_swap,
                   "swap_over_noswap": t_swap / t_noswap,
                   "swap_over_bound": t_swap / max(t_noswap, moved / (block_gbps * 1e9)),
                   "h2d_bytes": ours["swapped"]["h2d_bytes"],
                   "d2h_bytes": ours["swapped"]["d2h_bytes"],
                   "peak_device_bytes": ours["swapped"]["peak_device_bytes"],
                   "max_abs_diff": ours["max_abs_diff"]}
            finetune.append(row)
            print(json.dumps(row), flush=True)

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "model": model, "bandwidth": link, "sweep": sweep, "finetune": finetune}
    with open(os.path.join(args.out, "gpu-bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    print("\nbandwidth (GB/s):")
    for r in link:
        print(f"  {r['bytes'] >> 10:>8} KiB {'pinned  ' if r['pinned'] else 'pageable'} {r['gbps']:7.1f}")
    print("\nmode   K   T_swap/T*  T_swap/T_noswap  T_seed/T_swap  T_swap/predicted  max_abs_diff")
    for r in sweep:
        predicted = r["swap_over_predicted"]
        predicted_text = f"{predicted:16.3f}" if predicted is not None else f"{'-':>16}"
        print(f"{r['mode']:<6}{r['k']:>3}  {r['swap_over_bound']:9.3f}  {r['swap_over_noswap']:15.3f}"
              f"  {r['seed_over_swap']:13.3f}  {predicted_text}  {r['max_abs_diff']}")
    print("\nfine-tuning  K  step on  T_swap/T_noswap  T_swap/T*  max_abs_diff")
    for r in finetune:
        print(f"{'':<11}{r['k']:>3}  {r['step_on']:<7}  {r['swap_over_noswap']:15.3f}"
              f"  {r['swap_over_bound']:9.3f}  {r['max_abs_diff']}")
    # Exactness is the first result: any difference fails the run.
    # The step on the host is the CPU's arithmetic, bitwise the CPU's optimizer and not the
    # GPU's (about 1 ulp apart): only the device step must be bitwise here.
    differing = [r for r in sweep + finetune
                 if r["max_abs_diff"] != 0 and r.get("step_on", "device") == "device"]
    if differing:
        print(f"\n{len(differing)} runs differ from the run without blockswap", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
