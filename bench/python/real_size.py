"""Real-size models on one GPU under a device-memory cap (run by scripts/gpu-check): seconds per
step, peak device and host memory, bytes over the link, for blockswap and the peers.

Models (bench/python/real_size_models.py): diffusers' FluxTransformer2DModel with FLUX.1-dev's
configuration (19 double + 38 single blocks, 11.9B parameters) at 1024x1024 (4096 image + 512
text tokens) and WanTransformer3DModel with Wan 2.1 14B's (40 blocks) on a 480x832 clip
(--wan-frames 81: latent 21x60x104, 32760 tokens), random bf16 weights, a peft LoRA (rank 16)
on the attention projections. Caps (torch.cuda.set_per_process_memory_fraction) stand for 24,
16 and 12 GiB cards. Per cap and mode (train: a LoRA step, gradient checkpointing, AdamW;
infer: one forward), each implementation in a process of its own
(bench/python/real_size_impls.py): blockswap at the K of the planner for the cap, the seed's
class (seed_offloader.py) at the same K, diffusers' group offloading (block_level, one block per
group, use_stream) and RamTorch's OffloadModel; "reference" is the model resident, no cap: the
step without swapping, T_noswap, for blockswap's bound T* = max(T_noswap, h2d bytes / B).

  on a GPU:  PYTHONPATH=build-gpu/python python bench/python/real_size.py --out DIR [--quick]
  here:      PYTHONPATH=build/python .venv/bin/python bench/python/real_size.py --rehearse
--rehearse: tiny configs of the same classes on the CPU, the same code path; caps are emulated
(the blocks' weight budget is a fraction of the blocks' bytes), CUDA's memory figures absent.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers_bench import error_text  # noqa: E402

CAPS_GIB = (24, 16, 12)
IMPLS = ("blockswap", "seed", "diffusers", "ramtorch")
# --rehearse: the weight budget as a fraction of the blocks' bytes, for each emulated cap.
REHEARSE_FRACTION = {24: 0.75, 16: 0.55, 12: 0.4}
CONTEXT_BYTES = 1 << 29  # what a card's CUDA context takes outside the caching allocator


def runs(args):
    """The children: one per (model, implementation), each running its caps and modes."""
    caps = [c for c in CAPS_GIB if not args.caps or c in args.caps]
    if args.quick:  # the most telling first: a run out of time loses the last ones
        plan = [("flux", "blockswap", [24, 16]), ("flux", "diffusers", [24, 16]),
                ("flux", "ramtorch", [24, 16]), ("flux", "seed", [24]), ("wan", "blockswap", [24])]
    else:
        plan = [(m, i, caps) for m in ("flux", "wan") for i in IMPLS]
    out = []
    for model in dict.fromkeys(m for m, _, _ in plan):
        if model in args.models:
            out.append(dict(model=model, impl="reference", caps=[None]))
            out += [dict(model=m, impl=i, caps=c) for m, i, c in plan
                    if m == model and i in args.impls]
    return out


def host_peak_mib():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024


def reset_host_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)
    except OSError:
        pass


def link_gbps(device):
    """Pinned host->device bandwidth of a 256 MiB copy (on the CPU: a clone's, the emulated
    link's counterpart)."""
    if device.type == "cuda":
        from gpu_bench import bandwidth
        return max(r["gbps"] for r in bandwidth([256 << 20], repeats=5) if r["pinned"])
    x = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    start = time.perf_counter()
    for _ in range(5):
        x.clone()
    return 5 * x.numel() / (time.perf_counter() - start) / 1e9


def child(spec, args):
    """One implementation of one model in this process: its rows, one per cap and mode."""
    from real_size_impls import SETUPS
    from real_size_models import activation_reserve, build, inputs
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.set_num_threads(args.threads)
    bw = link_gbps(device)
    model, facts = build(spec["model"], args.rehearse, device)
    blocks_total = sum(map(sum, facts["block_bytes"].values()))
    batch = inputs(spec["model"], args.rehearse, device, args.wan_frames)
    common = dict(model=spec["model"], impl=spec["impl"], link_gbps=bw,
                  weight_gib=facts["weight_bytes"] / 2**30, params=facts["params"],
                  make_gbps=facts["make_gbps"], make_seconds=facts["make_seconds"])
    rows = []
    for cap in spec["caps"]:
        for mode in args.modes:
            row = dict(common, cap_gib=cap, mode=mode)
            reserve = activation_reserve(spec["model"], args.rehearse, mode == "train",
                                         args.wan_frames)
            if cap is None:
                budget = blocks_total
            elif args.rehearse:
                budget = int(REHEARSE_FRACTION[cap] * blocks_total)
            else:
                budget = (cap << 30) - CONTEXT_BYTES - facts["fixed_bytes"] - reserve
            row.update(weight_budget_gib=budget / 2**30, activation_reserve_gib=reserve / 2**30)
            if cuda:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(
                    1.0 if cap is None else ((cap << 30) - CONTEXT_BYTES) / total)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            reset_host_peak()
            teardown, started = None, time.perf_counter()
            try:
                step, moved, teardown, info = SETUPS[spec["impl"]](
                    model, facts, device, mode, budget, spec["model"], batch)
                row.update({k: v for k, v in info.items() if not k.startswith("_")})
                step()  # warm-up
                sync()
                before, times = moved(), []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    step()
                    sync()
                    times.append(time.perf_counter() - start)
                row["s_per_step"] = sorted(times)[len(times) // 2]
                after = moved()
                row["h2d_bytes_per_step"] = (None if after is None
                                             else (after - before) / args.steps)
                if "_host" in info:
                    host = info["_host"]()
                    row["pinned_host_gib"] = host["peak_pinned_host_bytes"] / 2**30
                    row["pinned_per_kept"] = host["pinned_per_kept"]
            except (torch.OutOfMemoryError, MemoryError) as e:
                row["error"] = "out of memory: " + error_text(e)[:160]
            except Exception as e:  # noqa: BLE001 (a row says what failed; the rest runs)
                oom = type(e).__name__ == "OutOfMemoryError"  # blockswap's: a plan too big
                row["error"] = ("out of memory: " if oom else "") + error_text(e)[:200]
            if cuda:
                row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
                row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            row["peak_rss_gib"] = host_peak_mib()[0] / 1024
            try:
                if teardown is not None:
                    teardown()
            except Exception as e:  # noqa: BLE001
                row["teardown_error"] = error_text(e)[:160]
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            row["row_seconds"] = time.perf_counter() - started
            rows.append(row)
            print(f"[{spec['model']} {spec['impl']} cap {cap} {mode}] "
                  f"{row.get('s_per_step', row.get('error'))} ({row['row_seconds']:.1f} s)",
                  file=sys.stderr, flush=True)
    return rows


def run_child(spec, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec),
           "--device", args.device, "--steps", str(args.steps), "--threads", str(args.threads),
           "--wan-frames", str(args.wan_frames), "--modes", *args.modes]
    cmd += ["--rehearse"] if args.rehearse else []
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        out, err, why = proc.stdout, proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode(), (e.stderr or b"").decode()
        why = f"timed out after {args.timeout} s"
    sys.stderr.write(err)
    seconds = time.perf_counter() - start
    for line in reversed(out.splitlines()):
        if line.startswith("["):
            return [dict(r, process_seconds=seconds) for r in json.loads(line)]
    last = (err or out).strip().splitlines()
    return [dict(model=spec["model"], impl=spec["impl"], cap_gib=cap, mode=mode,
                 process_seconds=seconds,
                 error=f"process {why}: " + (last[-1][:200] if last else "no output"))
            for cap in spec["caps"] for mode in args.modes]


def add_bounds(rows):
    """blockswap's T* = max(T_noswap, h2d bytes per step / B), T_noswap the reference's."""
    ref = {(r["model"], r["mode"]): r.get("s_per_step") for r in rows if r["impl"] == "reference"}
    for r in rows:
        t_ref = ref.get((r["model"], r["mode"]))
        if r["impl"] == "blockswap" and "s_per_step" in r and t_ref:
            r["t_bound"] = max(t_ref, r["h2d_bytes_per_step"] / (r["link_gbps"] * 1e9))
            r["swap_over_bound"] = r["s_per_step"] / r["t_bound"]
        if "s_per_step" in r and t_ref:
            r["over_reference"] = r["s_per_step"] / t_ref


def cell(r, key, fmt):
    return fmt.format(r[key]) if r.get(key) is not None else "-"


def table(rows):
    head = ("| model | mode | cap GiB | impl | s/step | x ref | peak alloc / reserved GiB "
            "| peak RSS GiB | pinned GiB (per byte kept) | GB over link / step | K | T_swap/T* "
            "| note / error |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        mem = (f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f}"
               if "peak_allocated_gib" in r else "-")
        link = ("n/a" if "s_per_step" in r and r.get("h2d_bytes_per_step") is None
                else cell(r, "h2d_bytes_per_step", "{:.2e}") if "s_per_step" in r else "-")
        if r.get("h2d_bytes_per_step") is not None and "s_per_step" in r:
            link = f"{r['h2d_bytes_per_step'] / 1e9:.3g}"
        k = ",".join(str(v) for v in r["k"].values()) if isinstance(r.get("k"), dict) else "-"
        text = r.get("error") or r.get("note", "")
        pinned = (f"{r['pinned_host_gib']:.2f} ({r['pinned_per_kept']:.3f})"
                  if "pinned_per_kept" in r else "-")
        lines.append(f"| {r['model']} | {r['mode']} | {r.get('cap_gib') or 'none'} | "
                     f"{r['impl']} | {cell(r, 's_per_step', '{:.3g}')} | "
                     f"{cell(r, 'over_reference', '{:.2f}')} | {mem} | "
                     f"{cell(r, 'peak_rss_gib', '{:.2f}')} | {pinned} | {link} | {k} | "
                     f"{cell(r, 'swap_over_bound', '{:.3f}')} | {text} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for real-size.json")
    p.add_argument("--device", default=None, help="cuda (default), or cpu with --rehearse")
    p.add_argument("--rehearse", action="store_true",
                   help="tiny configs of the same classes on the CPU, caps emulated")
    p.add_argument("--quick", action="store_true",
                   help="FLUX at 24 and 16 GiB for every implementation, Wan at 24 GiB "
                        "for blockswap and diffusers")
    p.add_argument("--models", nargs="+", default=["flux", "wan"])
    p.add_argument("--impls", nargs="+", default=list(IMPLS))
    p.add_argument("--caps", nargs="+", type=int, help="GiB caps (default 24 16 12)")
    p.add_argument("--modes", nargs="+", default=["train", "infer"])
    p.add_argument("--steps", type=int, default=None, help="timed steps after a warm-up")
    p.add_argument("--wan-frames", type=int, default=None,
                   help="frames of the Wan clip (default 81; 21 with --quick)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--child-timeout", type=int, default=300, help="seconds per child process")
    p.add_argument("--budget", type=int, default=100000,
                   help="seconds in all: children that would start later are rows 'not run'")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.rehearse else "cuda")
    args.steps = args.steps or (1 if args.quick else 3)
    args.wan_frames = args.wan_frames or (21 if args.quick else 81)
    if args.child:
        print(json.dumps(child(json.loads(args.child), args)), flush=True)
        os._exit(0)  # offloader and loader threads must not keep the child alive
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --rehearse here")
    start, rows = time.perf_counter(), []
    for spec in runs(args):
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            rows += [dict(model=spec["model"], impl=spec["impl"], cap_gib=cap, mode=mode,
                          error=f"not run: the --budget of {args.budget} s was spent")
                     for cap in spec["caps"] for mode in args.modes]
            continue
        args.timeout = min(args.child_timeout, int(left))
        rows += run_child(spec, args)
        write(args, rows, start)  # what is done so far survives a kill
    write(args, rows, start, final=True)
    failed = [r for r in rows if r["impl"] in ("reference", "blockswap") and "error" in r
              and not r["error"].startswith(("out of memory", "not run"))]
    sys.exit(1 if failed else 0)


def write(args, rows, start, final=False):
    add_bounds(rows)
    wall = time.perf_counter() - start
    title = (f"{'rehearsal (tiny configs, CPU)' if args.rehearse else 'real size'}, "
             f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
             f"torch {torch.__version__}, {args.steps} timed steps after a warm-up, "
             f"{wall:.0f} s in all")
    if final:
        print(title + "\n\n" + table(rows), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "real-size.json"), "w") as f:
            json.dump(dict(title=title, wall_seconds=wall, quick=args.quick, final=final,
                           rehearse=args.rehearse, wan_frames=args.wan_frames, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
