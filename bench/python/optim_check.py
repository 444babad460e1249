"""blockswap.FusedSGD / FusedAdamW against torch.optim on one device, for each of torch.optim's
implementations (its default for the device, foreach, fused): every weight after a few steps
must be bitwise torch.optim's. Run by scripts/gpu-check on CUDA (torch.optim's default there is
foreach); the same equalities on the CPU are python/tests/test_fine_tune.py's.
Usage: optim_check.py [--device cuda]; exits 1 on any difference."""

import argparse
import sys

import torch
from torch import nn

import blockswap

N, K, STEPS, DIM = 6, 3, 4, 64


def make_blocks(device):
    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)) for _ in range(N)]
    return [b.to(device) for b in blocks]


def train(blocks, optimizer, device, offloader=None):
    torch.manual_seed(4)
    for _ in range(STEPS):
        x = torch.randn(8, DIM, device=device)
        if offloader is not None:
            offloader.prepare_block_devices_before_forward()
        for i, block in enumerate(blocks):
            if offloader is not None:
                offloader.wait_for_block(i)
            x = block(x)
            if offloader is not None:
                offloader.submit_move_blocks_forward(i)
        x.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().to("cpu", copy=True) for b in blocks for p in b.parameters()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    device = torch.device(parser.parse_args().device)
    cases = {"sgd": (torch.optim.SGD, blockswap.FusedSGD, dict(lr=0.05, momentum=0.9)),
             "adamw": (torch.optim.AdamW, blockswap.FusedAdamW, dict(lr=0.01, weight_decay=0.1))}
    failed = 0
    for name, (reference, fused, hyper) in cases.items():
        for label, args in (("default", {}), ("foreach", dict(foreach=True)),
                            ("for-loop", dict(foreach=False)), ("fused", dict(fused=True))):
            blocks = make_blocks(device)
            expected = train(blocks, reference([p for b in blocks for p in b.parameters()],
                                               **hyper, **args), device)
            blocks = make_blocks(device)
            optimizer = fused([p for b in blocks for p in b.parameters()], **hyper, **args)
            with blockswap.ModelOffloader("blocks", blocks, N, K, True, device, False,
                                          optimizer=optimizer, step_on="device") as offloader:
                got = train(blocks, optimizer, device, offloader)
            diff = max((a - b).abs().max().item() for a, b in zip(expected, got))
            same = all(torch.equal(a, b) for a, b in zip(expected, got))
            failed += not same
            print(f"{device.type} {name:<6} {label:<9} {'bitwise' if same else 'DIFFERS'}"
                  f"  max diff {diff:.3g}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
