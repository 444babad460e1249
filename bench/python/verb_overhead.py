"""The host time blockswap's Python verbs add per block: a pass over N blocks too small to
compute anything much, with the seed's calls (wait_for_block / the block / submit, through the
forward hooks) and without blockswap, K = 0 so that nothing is copied. The difference per block
is what the verbs cost the host; it uses only the seed's public API, so the same script
measures any build of blockswap against any torch.
Usage: PYTHONPATH=<build>/python python verb_overhead.py [--blocks 64] [--repeats 200]"""

import argparse
import json
import time

import torch

import blockswap


def pass_seconds(blocks, x, offloader, train, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        if offloader is not None:
            offloader.prepare_block_devices_before_forward()
        with torch.set_grad_enabled(train):
            h = x
            for i, block in enumerate(blocks):
                if offloader is not None:
                    offloader.wait_for_block(i)
                h = block(h)
                if offloader is not None:
                    offloader.submit_move_blocks_forward(i)
            if train:
                h.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = args.blocks
    blocks = [torch.nn.Linear(8, 8).requires_grad_(False) for _ in range(n)]
    x = torch.randn(1, 8, requires_grad=True)
    result = {"torch": torch.__version__, "blocks": n}
    for mode in ("infer", "train"):
        train = mode == "train"
        plain = pass_seconds(blocks, x, None, train, args.repeats)
        with blockswap.ModelOffloader("blocks", blocks, n, 0, train, torch.device("cpu"),
                                      False) as offloader:
            swapped = pass_seconds(blocks, x, offloader, train, args.repeats)
        result[mode] = {"plain_us_per_block": plain / n * 1e6,
                        "verbs_us_per_block": (swapped - plain) / n * 1e6}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
