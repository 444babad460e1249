"""Peer offloading libraries on one tiny diffusers FluxTransformer2DModel (random weights, built
from a config, nothing downloaded): no offloading (reference), diffusers' group offloading at
block level (one block per group, with and without use_stream), RamTorch's OffloadModel, and,
with --blockswap, blockswap.ModelOffloader. Each method runs in a subprocess of its own, so the
peak host RSS (getrusage) is its own. Per method: the inference forward against the reference
(torch.equal, max abs diff), one training step's gradients against the reference's, host->device
bytes per forward, time per forward (ratio to the reference) and peak RSS.

Here (CPU):  .venv/bin/python bench/python/peers_bench.py [--json]
  with blockswap: PYTHONPATH=build/python .venv/bin/python bench/python/peers_bench.py --blockswap
On a GPU:    ... peers_bench.py --device cuda [--blockswap]   (streams used; untested here)

How bytes are counted: diffusers: a wrapper around ModuleGroup.onload_ adds the bytes of the
group's parameters and buffers each time a group is onloaded (on the CPU .to('cpu') is a no-op,
so these are bytes its hooks would move, none are copied). RamTorch: a wrapper around the
engine's per-chunk load (OffloadModel._materialize) adds the chunk's bytes (on the CPU the load
is a clone). blockswap: the h2d_bytes of stats() of both offloaders.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

CONFIG = dict(patch_size=1, in_channels=4, num_layers=4, num_single_layers=4,
              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
              pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def build(args):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**CONFIG).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, args.img_tokens, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, args.txt_tokens, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g),
                  timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(args.img_tokens, 3, generator=g),
                  txt_ids=torch.zeros(args.txt_tokens, 3))
    return model, inputs


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def loss_of(out):
    return out.float().pow(2).mean()


def model_grads(model):
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
            if p.grad is not None}


# Each setup_* returns (forward(inputs) -> output, train(inputs) -> {name: grad} or None,
# moved() -> host->device bytes so far, note).

def plain_calls(model, device, moved):
    def forward(inputs):
        with torch.no_grad():
            return model(**{k: v.to(device) for k, v in inputs.items()}, return_dict=False)[0]

    def train(inputs):
        model.zero_grad(set_to_none=True)
        loss_of(model(**{k: v.to(device) for k, v in inputs.items()}, return_dict=False)[0]).backward()
        return model_grads(model)
    return forward, train, moved


def setup_reference(model, device, args):
    model.to(device)
    return (*plain_calls(model, device, lambda: 0), "all weights resident")


def count_group_onloads():
    """Counts the bytes of each onload of diffusers' group offloading (also real_size.py's):
    returns (counter, restore), counter["bytes"] growing with each onload."""
    from diffusers.hooks import group_offloading
    counter = {"bytes": 0}
    original = group_offloading.ModuleGroup.onload_

    def counting_onload(group):  # the bytes this onload moves (or would move, on the CPU)
        tensors = [t for m in group.modules for t in (*m.parameters(), *m.buffers())]
        tensors += [*group.parameters, *group.buffers]  # the top-level group lists some twice
        counter["bytes"] += nbytes({id(t): t for t in tensors}.values())
        return original(group)
    group_offloading.ModuleGroup.onload_ = counting_onload

    def restore():
        group_offloading.ModuleGroup.onload_ = original
    return counter, restore


def setup_diffusers(model, device, args, use_stream):
    counter, _ = count_group_onloads()
    model.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1,
                               use_stream=use_stream)
    note = f"block_level, 1 block/group, use_stream={use_stream}"
    if device.type == "cpu":
        note += "; onload=offload=cpu: .to() is a no-op, bytes are what the hooks would move"
    return (*plain_calls(model, device, lambda: counter["bytes"]), note)


class Embed(nn.Module):
    """RamTorch chunk 0: the model's embedders (what its forward does before the blocks)."""

    def __init__(self, m):
        super().__init__()
        self.x_embedder, self.time_text_embed = m.x_embedder, m.time_text_embed
        self.context_embedder, self.pos_embed = m.context_embedder, m.pos_embed

    def forward(self, hidden, context, pooled, timestep, img_ids, txt_ids):
        hidden = self.x_embedder(hidden)
        temb = self.time_text_embed(timestep.to(hidden.dtype) * 1000, pooled)
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return hidden, self.context_embedder(context), temb, cos, sin


class Block(nn.Module):
    """RamTorch chunk: one double or single block; temb and the rotary pass through."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden, context, temb, cos, sin):
        context, hidden = self.block(hidden_states=hidden, encoder_hidden_states=context,
                                     temb=temb, image_rotary_emb=(cos, sin))
        return hidden, context, temb, cos, sin


class Head(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.norm_out, self.proj_out = m.norm_out, m.proj_out

    def forward(self, hidden, context, temb, cos, sin):
        return self.proj_out(self.norm_out(hidden, temb))


def setup_ramtorch(model, device, args):
    import ramtorch
    order = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
             "img_ids", "txt_ids")
    chunks = [Embed(model), *(Block(b) for name in BLOCK_LISTS for b in getattr(model, name)),
              Head(model)]
    engine = ramtorch.OffloadModel(chunks, device=device, window=2, pin=0)
    counter = {"bytes": 0}
    load = engine._materialize  # the loader thread's per-chunk load (a clone on the CPU)

    def counting_load(state):
        counter["bytes"] += state.nbytes()
        return load(state)
    engine._materialize = counting_load

    def forward(inputs):
        return engine(tuple(inputs[k] for k in order))

    def train(inputs):
        model.zero_grad(set_to_none=True)
        engine.step(tuple(inputs[k] for k in order), loss_fn=lambda out, _: loss_of(out))
        engine.flush_grads()
        return model_grads(model)
    return forward, train, lambda: counter["bytes"], \
        f"OffloadModel({len(chunks)} chunks, window=2, pin=0), recompute backward"


def setup_blockswap(model, device, args):
    # Two offloaders on one shared device, K = half of each list, the waits and submits from
    # blockswap's own forward hooks (hook_blocks=True).
    import blockswap
    for name, child in model.named_children():
        if name in BLOCK_LISTS:
            child.requires_grad_(False)  # frozen weights swap; trainable ones would stay put
        else:
            child.to(device)
    shared = blockswap.open_device(device.type)
    offloaders = [blockswap.ModelOffloader(name, list(getattr(model, name)),
                                           len(getattr(model, name)),
                                           len(getattr(model, name)) // 2, True, device, False,
                                           shared_device=shared, hook_blocks=True)
                  for name in BLOCK_LISTS]

    def prepare_both(module, args):
        for off in offloaders:
            off.prepare_block_devices_before_forward()
    model.register_forward_pre_hook(prepare_both)
    for off in offloaders:  # the inference forwards come first; train() switches back
        off.set_forward_only(True)
    forward, train, _ = plain_calls(model, device, None)

    def train_frozen(inputs):
        for off in offloaders:
            off.set_forward_only(False)
        return train(inputs)
    return forward, train_frozen, lambda: sum(o.stats()["h2d_bytes"] for o in offloaders), \
        "K=half of each list, shared_device; block weights frozen: grads compared = non-block"


SETUPS = {"reference": setup_reference,
          "diffusers": lambda m, d, a: setup_diffusers(m, d, a, use_stream=False),
          "diffusers-stream": lambda m, d, a: setup_diffusers(m, d, a, use_stream=True),
          "ramtorch": setup_ramtorch, "blockswap": setup_blockswap}


def error_text(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def rss_now_mib():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def worker(args):
    """One method in this process: results to stdout (JSON), tensors to args.tmp/<method>.pt."""
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)
    row = {"method": args.worker}
    model, inputs = build(args)
    row["rss_after_build_mib"] = rss_now_mib()
    saved = {}
    try:
        forward, train, moved, row["note"] = SETUPS[args.worker](model, device, args)
    except Exception as e:
        row["error"] = "setup: " + error_text(e)
        return row
    try:
        forward(inputs)  # warm-up
        sync()
        times = []
        for _ in range(args.iters):
            before = moved()
            start = time.perf_counter()
            out = forward(inputs)
            sync()
            times.append(time.perf_counter() - start)
        row["h2d_bytes_per_forward"] = moved() - before
        row["ms_per_forward"] = 1e3 * sorted(times)[len(times) // 2]
        saved["out"] = out.detach().cpu()
    except Exception as e:
        row["error"] = "forward: " + error_text(e)
    if train is not None and "error" not in row:
        try:
            saved["grads"] = train(inputs)
        except Exception as e:
            row["train_error"] = error_text(e)
    row["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save(saved, os.path.join(args.tmp, args.worker + ".pt"))
    return row


def compare(row, ref, got):
    if "out" in got and "out" in ref:
        row["forward_equal"] = torch.equal(got["out"], ref["out"])
        row["forward_max_abs_diff"] = (got["out"] - ref["out"]).abs().max().item()
    if "grads" in got and "grads" in ref:
        names = sorted(got["grads"])
        diffs = [(got["grads"][n] - ref["grads"][n]).abs().max().item() for n in names]
        row["grads_compared"] = len(names)
        row["grads_equal"] = all(torch.equal(got["grads"][n], ref["grads"][n]) for n in names)
        row["grads_max_abs_diff"] = max(diffs, default=0.0)


def run_method(method, args, tmp):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", method, "--tmp", tmp,
           "--device", args.device, "--iters", str(args.iters), "--threads", str(args.threads),
           "--img-tokens", str(args.img_tokens), "--txt-tokens", str(args.txt_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return {"method": method, "error": f"worker exit {proc.returncode}: "
            + (lines[-1] if lines else "no output")}


def fmt_bytes(n):
    return "-" if n is None else f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / 2**20:.2f} MiB"


def table(rows, ref_ms):
    head = ("| method | forward == ref (max abs diff) | train grads == ref (max abs diff, n) "
            "| H2D bytes / forward | ms / forward (x ref) | peak RSS MiB (+ over build) | note / error |")
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        fwd = (f"{r['forward_equal']} ({r['forward_max_abs_diff']:.3g})"
               if "forward_equal" in r else "-")
        grads = (f"{r['grads_equal']} ({r['grads_max_abs_diff']:.3g}, {r['grads_compared']})"
                 if "grads_equal" in r else r.get("train_error", "-"))
        ms = (f"{r['ms_per_forward']:.2f} (x{r['ms_per_forward'] / ref_ms:.2f})"
              if "ms_per_forward" in r and ref_ms else "-")
        rss = (f"{r['peak_rss_mib']:.0f} (+{r['peak_rss_mib'] - r['rss_after_build_mib']:.0f})"
               if r.get("peak_rss_mib") and r.get("rss_after_build_mib") else "-")
        text = r.get("error") or r.get("note", "")
        lines.append(f"| {r['method']} | {fwd} | {grads} | "
                     f"{fmt_bytes(r.get('h2d_bytes_per_forward'))} | {ms} | {rss} | {text} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--blockswap", action="store_true", help="add blockswap (needs import blockswap)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    p.add_argument("--iters", type=int, default=20, help="timed forwards per method (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per worker (on 2 busy cores, 2 threads time badly)")
    p.add_argument("--img-tokens", type=int, default=256)
    p.add_argument("--txt-tokens", type=int, default=32)
    p.add_argument("--timeout", type=int, default=120, help="seconds per method subprocess")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        os._exit(0)  # offloader threads must not keep the worker alive
    if args.blockswap:
        try:
            import blockswap  # noqa: F401
        except ImportError as e:
            p.error(f"--blockswap needs `import blockswap` to work ({e}); "
                    "try PYTHONPATH=build/python")
    methods = ["reference", "diffusers", "diffusers-stream", "ramtorch"]
    methods += ["blockswap"] if args.blockswap else []
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_method(m, args, tmp) for m in methods]
        ref_path = os.path.join(tmp, "reference.pt")
        ref = torch.load(ref_path) if os.path.exists(ref_path) else {}
        for row in rows[1:]:
            path = os.path.join(tmp, row["method"] + ".pt")
            if os.path.exists(path):
                compare(row, ref, torch.load(path))
    ref_ms = rows[0].get("ms_per_forward")
    print(f"FluxTransformer2DModel {CONFIG}, {args.img_tokens} image + {args.txt_tokens} text "
          f"tokens, device {args.device}, torch {torch.__version__}\n")
    print(table(rows, ref_ms))
    if args.json:
        print(json.dumps({"device": args.device, "torch": torch.__version__, "config": CONFIG,
                          "img_tokens": args.img_tokens, "txt_tokens": args.txt_tokens,
                          "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
