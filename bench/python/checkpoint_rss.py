"""Peak host memory (RSS) while the file tier loads a model from the checkpoints users have: a
sharded diffusers set (three shards, every block across them, read by its index) and one file
with other names (ComfyUI's prefix, q/k/v fused into one qkv tensor read as row slices through
weights_map), against the checkpoint's size and against loading it plainly (safetensors'
load_file).

Each measurement runs in a fresh process: the blocks are built on the meta device, the offloader
reads them from the file (host_budget_bytes=0: no block is kept in host memory) on the emulated
device (device='cpu', whose slots are host memory too: reported apart), and two forward passes
run. Usage (docs/performance.md, "Checkpoints users have"):

    PYTHONPATH=build/python .venv/bin/python bench/python/checkpoint_rss.py --gib 1.5
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HIDDEN = 2048  # a block: q, k, v, o (H x H) and an MLP of 4H: 12 H^2 bf16 = 96 MiB


def block_module(torch):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("to_q", "to_k", "to_v", "to_out"):
                setattr(self, name, torch.nn.Linear(HIDDEN, HIDDEN, bias=False,
                                                    dtype=torch.bfloat16))
            self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN, bias=False, dtype=torch.bfloat16)
            self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            a = self.to_out(self.to_q(x) + self.to_k(x) + self.to_v(x))
            return x + self.down(torch.nn.functional.gelu(self.up(a)))

    return Block


def write(folder, blocks):
    """The sharded set and the renamed file, from one set of random blocks."""
    import torch
    from safetensors.torch import save_file
    torch.manual_seed(0)
    state = {}
    for i in range(blocks):
        for name, shape in (("to_q", (HIDDEN, HIDDEN)), ("to_k", (HIDDEN, HIDDEN)),
                            ("to_v", (HIDDEN, HIDDEN)), ("to_out", (HIDDEN, HIDDEN)),
                            ("up", (4 * HIDDEN, HIDDEN)), ("down", (HIDDEN, 4 * HIDDEN))):
            state[f"blocks.{i}.{name}.weight"] = torch.randn(shape, dtype=torch.bfloat16)
    names = sorted(state)
    shards = [f"diffusion_pytorch_model-{s + 1:05d}-of-00003.safetensors" for s in range(3)]
    weight_map = {n: shards[k % 3] for k, n in enumerate(names)}
    os.makedirs(os.path.join(folder, "sharded"), exist_ok=True)
    for shard in shards:
        save_file({n: state[n] for n in names if weight_map[n] == shard},
                  os.path.join(folder, "sharded", shard))
    with open(os.path.join(folder, "sharded",
                           "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    renamed = {}
    for i in range(blocks):
        b, r = f"blocks.{i}.", f"model.diffusion_model.layers.{i}."
        renamed[r + "qkv.weight"] = torch.cat([state[b + f"to_{x}.weight"] for x in "qkv"])
        renamed[r + "proj.weight"] = state[b + "to_out.weight"]
        renamed[r + "mlp.0.weight"] = state[b + "up.weight"]
        renamed[r + "mlp.2.weight"] = state[b + "down.weight"]
    save_file(renamed, os.path.join(folder, "renamed.safetensors"))


def renamed_map(name):
    """The module's `N.<name>` to the renamed file's tensor, q/k/v as rows of qkv."""
    i, rest = name.split(".", 1)
    for x, n in enumerate("qkv"):
        if rest == f"to_{n}.weight":
            return (f"layers.{i}.qkv.weight", (x * HIDDEN, (x + 1) * HIDDEN))
    return {"to_out.weight": f"layers.{i}.proj.weight", "up.weight": f"layers.{i}.mlp.0.weight",
            "down.weight": f"layers.{i}.mlp.2.weight"}[rest]


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(kind, path, blocks):
    """In this (fresh) process: build on meta, load through the file tier, run two passes."""
    import torch
    import blockswap
    Block = block_module(torch)
    base = rss_mib()
    start = time.perf_counter()
    if kind == "load_file":  # the plain way: the model built, its state dict loaded into it
        from safetensors.torch import load_file
        with torch.device("meta"):
            model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(
                [Block() for _ in range(blocks)])})
        model.to_empty(device="cpu")
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                model.load_state_dict(load_file(os.path.join(path, f)), strict=False)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {"kind": kind, "baseline_mib": base, "peak_mib": peak,
                "seconds": time.perf_counter() - start}
    with torch.device("meta"):
        model = [Block().requires_grad_(False) for _ in range(blocks)]
    extra = dict(weights_map=renamed_map) if kind == "renamed" else {}
    offloader = blockswap.ModelOffloader(
        "blocks", model, blocks, blocks - 1, False, "cpu", hook_blocks=True, weights_file=path,
        host_budget_bytes=0, **extra)
    built = time.perf_counter() - start
    x = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            offloader.prepare_block_devices_before_forward()
            y = x
            for block in model:
                y = block(y)
    stats = offloader.stats()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"kind": kind, "baseline_mib": base, "peak_mib": peak, "build_seconds": built,
            "seconds": time.perf_counter() - start, "disk_mib": stats["disk_bytes"] / 2**20,
            "device_slots_mib": stats["peak_device_bytes"] / 2**20}


def size_mib(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20
    return os.path.getsize(path) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.5, help="checkpoint size (GiB)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], int(args.child[2]))))
        return
    blocks = max(2, round(args.gib * 2**30 / (12 * HIDDEN * HIDDEN * 2)))
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                        f"import checkpoint_rss; checkpoint_rss.write({folder!r}, {blocks})"],
                       check=True)
        sharded = os.path.join(folder, "sharded")
        runs = [("sharded", os.path.join(sharded, "diffusion_pytorch_model.safetensors.index.json"),
                 size_mib(sharded)),
                ("renamed", os.path.join(folder, "renamed.safetensors"),
                 size_mib(os.path.join(folder, "renamed.safetensors"))),
                ("load_file", sharded, size_mib(sharded))]
        print(f"{blocks} blocks of {12 * HIDDEN * HIDDEN * 2 / 2**20:.0f} MiB (bf16)")
        print(f"{'checkpoint':<28} {'file MiB':>9} {'base MiB':>9} {'peak MiB':>9} "
              f"{'peak-base':>10} {'slots MiB':>10} {'read MiB':>9} {'s':>6}")
        for kind, path, file_mib in runs:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind,
                                   path, str(blocks)], capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{kind}: {done.stderr}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            label = {"sharded": "sharded (3 shards, index)", "renamed": "renamed (qkv rows, map)",
                     "load_file": "load_file (plain, sharded)"}[kind]
            print(f"{label:<28} {file_mib:>9.0f} {r['baseline_mib']:>9.0f} {r['peak_mib']:>9.0f} "
                  f"{r['peak_mib'] - r['baseline_mib']:>10.0f} "
                  f"{r.get('device_slots_mib', 0):>10.0f} {r.get('disk_mib', 0):>9.0f} "
                  f"{r['seconds']:>6.1f}")


if __name__ == "__main__":
    main()
