"""One line against the peers' one lines, on a whole diffusers FluxPipeline (CLIP and T5 text
encoders, a FLUX transformer, a VAE; tiny configs of python/tests/tiny_pipelines.py, random
weights, nothing downloaded): blockswap.offload(pipe, device_budget=...), diffusers'
pipe.enable_group_offload (block level, one block a group; leaf level), pipe.enable_model_cpu_offload,
pipe.enable_sequential_cpu_offload, and RamTorch's replace_linear_with_ramtorch on the
transformer and text encoders. Each in a process of its own. Per method: the image against the
plain pipeline's (torch.equal), host->device bytes per image, seconds per image and the extra
time per denoising step over the plain pipeline, peak RSS.

Here (CPU):  PYTHONPATH=build/python .venv/bin/python bench/python/pipeline_bench.py
On a GPU:    ... pipeline_bench.py --device cuda --layers 19 --width 8   (gpu-check runs it)

How bytes are counted: blockswap: its offloaders' h2d_bytes. diffusers' group offloading: each
group onload's parameter and buffer bytes (peers_bench.count_group_onloads; on the CPU the
.to() is a no-op, so these are the bytes its hooks would move). accelerate's hooks (model and
sequential offload) and RamTorch: the bytes of every tensor copied to the device, counted by
torch.cuda's allocator on a GPU; on the CPU they move nothing and the row says why.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))
sys.path.insert(0, HERE)

METHODS = ("reference", "blockswap", "group_block", "group_leaf", "model_cpu_offload",
           "sequential_cpu_offload", "ramtorch")
STREAMED = ("transformer", "text_encoder", "text_encoder_2")


def pipe_bytes(pipe, parts=None):
    return sum(t.numel() * t.element_size() for name, m in pipe.components.items()
               if isinstance(m, torch.nn.Module) and (parts is None or name in parts)
               for t in (*m.parameters(), *m.buffers()))


def setup(method, pipe, device, args):
    """Applies the method; returns (bytes moved so far, a note)."""
    if method == "reference":
        pipe.to(device)
        return lambda: 0, "the plain pipeline, every weight on the device"
    if method == "blockswap":
        import blockswap
        # args.budget of the way from the smallest budget that fits to the whole pipeline.
        smallest = blockswap.plan_offload(pipe, device_budget=1 << 50,
                                          device=device).smallest_budget_bytes
        budget = smallest + int(args.budget * (pipe_bytes(pipe) - smallest))
        handle = blockswap.offload(pipe, device_budget=budget, device=device)
        lists = ", ".join(f"{x.name} K={x.blocks_to_swap}/{len(x.blocks)}"
                          for x in handle.plan.lists)

        def moved():
            return sum(s["h2d_bytes"] for n, s in handle.stats().items() if n != "device")
        return moved, (f"device_budget {budget / pipe_bytes(pipe):.2f} of the pipeline's "
                       f"bytes: {lists}")
    if method.startswith("group_"):
        from peers_bench import count_group_onloads
        counter, _ = count_group_onloads()
        level = "block_level" if method == "group_block" else "leaf_level"
        extra = dict(num_blocks_per_group=1) if level == "block_level" else {}
        pipe.enable_group_offload(onload_device=device, offload_type=level,
                                  use_stream=device.type == "cuda", **extra)
        note = f"{level}, use_stream={device.type == 'cuda'}"
        if device.type == "cpu":
            note += "; onload=offload=cpu: bytes are what its hooks would move"
        return lambda: counter["bytes"], note
    if method in ("model_cpu_offload", "sequential_cpu_offload"):
        getattr(pipe, "enable_" + method)(device=device)
        return cuda_bytes(device), "accelerate's hooks"
    if method == "ramtorch":
        from ramtorch.helpers import replace_linear_with_ramtorch
        for name in STREAMED:
            replace_linear_with_ramtorch(getattr(pipe, name), device=str(device))
        for name, m in pipe.components.items():  # what is not a Linear stays on the device
            if isinstance(m, torch.nn.Module):
                for sub in m.modules():
                    for key, p in sub._parameters.items():
                        if p is not None and not getattr(p, "is_ramtorch", False):
                            p.data = p.data.to(device)
                    for key, b in sub._buffers.items():
                        if b is not None:
                            sub._buffers[key] = b.to(device)
        return cuda_bytes(device), "replace_linear_with_ramtorch on transformer and text encoders"
    raise ValueError(method)


def cuda_bytes(device):
    """Bytes copied host->device, from the CUDA allocator's count of bytes allocated (every
    weight a hook brings is a new allocation); on the CPU: None."""
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.memory_stats(device).get("allocated_bytes.all.allocated", 0)


def worker(args):
    import tiny_pipelines
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    row = {"method": args.worker}
    pipe = tiny_pipelines.flux(layers=args.layers)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        moved, row["note"] = setup(args.worker, pipe, device, args)
        tiny_pipelines.flux_image(pipe, steps=args.steps)  # warm-up
        times, images = [], []
        for seed in range(args.images):
            before = moved()
            sync()
            start = time.perf_counter()
            images.append(tiny_pipelines.flux_image(pipe, seed=seed, steps=args.steps).cpu())
            sync()
            times.append(time.perf_counter() - start)
            after = moved()
        row["h2d_bytes_per_image"] = None if after is None else after - before
        row["s_per_image"] = sorted(times)[len(times) // 2]
        torch.save(images, os.path.join(args.tmp, args.worker + ".pt"))
    except Exception as e:  # a row that says what failed
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def plan_time():
    """Seconds blockswap.plan_offload takes on FLUX.1-dev's transformer (57 blocks, 11.9 B
    parameters, bf16 on the meta device), and offload() plus close() on the same 57 blocks at
    a width of 128 (real weights on the emulated device)."""
    import blockswap
    from diffusers import FluxTransformer2DModel
    from real_size_models import FLUX_DEV
    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_DEV).to(torch.bfloat16)
    start = time.perf_counter()
    plan = blockswap.plan_offload(model, device_budget="16GB", device="cpu",
                                  supports_backward=False)
    planned = time.perf_counter() - start
    narrow = dict(FLUX_DEV, num_attention_heads=4, attention_head_dim=32,
                  joint_attention_dim=128, pooled_projection_dim=128, axes_dims_rope=(8, 12, 12))
    small = FluxTransformer2DModel(**narrow).to(torch.bfloat16).requires_grad_(False)
    budget = blockswap.plan_offload(small, device_budget=1 << 40,
                                    device="cpu").smallest_budget_bytes
    start = time.perf_counter()
    handle = blockswap.offload(small, device_budget=budget * 2, device="cpu")
    set_up = time.perf_counter() - start
    start = time.perf_counter()
    handle.close()
    closed = time.perf_counter() - start
    print(f"{plan}\nplan_offload, FLUX.1-dev on meta: {planned * 1e3:.1f} ms; offload() of the "
          f"57 blocks at width 128 ({pipe_bytes_of(small) / 2**20:.1f} MiB): "
          f"{set_up * 1e3:.1f} ms, close(): {closed * 1e3:.1f} ms")


def pipe_bytes_of(module):
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def fmt_bytes(n):
    return "-" if n is None else f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / 2**20:.2f} MiB"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=3, help="blocks per list (and text encoder)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per image")
    p.add_argument("--images", type=int, default=5, help="timed images per method (median)")
    p.add_argument("--budget", type=float, default=0.25,
                   help="blockswap's device_budget: this fraction of the way from the smallest "
                   "budget that fits to the whole pipeline's bytes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--plan-time", action="store_true",
                   help="time plan_offload on FLUX.1-dev (meta) and offload() on its 57 blocks")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="/tmp/blockswap-pipeline-bench")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return
    if args.plan_time:
        plan_time()
        return
    os.makedirs(args.tmp, exist_ok=True)
    rows = []
    for method in args.methods.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--tmp", args.tmp]
        for name in ("device", "layers", "steps", "images", "budget", "threads"):
            cmd += [f"--{name}", str(getattr(args, name))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
        rows.append(json.loads(line) if line else {
            "method": method, "error": f"exit {proc.returncode}: "
            + (proc.stderr.strip().splitlines() or ["no output"])[-1]})
    ref_path = os.path.join(args.tmp, "reference.pt")
    reference = torch.load(ref_path) if os.path.exists(ref_path) else None
    ref_s = next((r.get("s_per_image") for r in rows if r["method"] == "reference"), None)
    print(f"| method | images == plain | H2D bytes / image | s / image (x plain) "
          f"| extra ms / step | peak RSS MiB | note / error |\n|{'---|' * 7}")
    for r in rows:
        path = os.path.join(args.tmp, r["method"] + ".pt")
        if reference is not None and "error" not in r and os.path.exists(path):
            r["exact"] = all(torch.equal(a, b) for a, b in zip(reference, torch.load(path)))
        s = r.get("s_per_image")
        timing = f"{s:.3f} (x{s / ref_s:.2f})" if s and ref_s else "-"
        extra = f"{1e3 * (s - ref_s) / args.steps:.1f}" if s and ref_s else "-"
        print(f"| {r['method']} | {r.get('exact', '-')} | "
              f"{fmt_bytes(r.get('h2d_bytes_per_image'))} | {timing} | {extra} | "
              f"{r['peak_rss_mib']:.0f} | {r.get('error') or r.get('note', '')} |"
              if "peak_rss_mib" in r else f"| {r['method']} | - | - | - | - | - | {r['error']} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
