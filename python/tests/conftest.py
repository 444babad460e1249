"""Shared models for the Python package's tests: blocks with frozen base weights, a LoRA
adapter and a buffer, as the trainers build them, run with and without an offloader."""

import copy

import pytest
import torch
import torch.utils.checkpoint

torch.set_num_threads(1)
DIM = 32
RANK = 4


class Block(torch.nn.Module):
    """A transformer-like block: frozen linears and norm, a buffer, LoRA on fc1."""

    def __init__(self, dim=DIM, dtype=torch.float32, lora=True):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim, dtype=dtype)
        self.fc1 = torch.nn.Linear(dim, 2 * dim, dtype=dtype)
        self.fc2 = torch.nn.Linear(2 * dim, dim, dtype=dtype)
        self.register_buffer("scale", torch.rand(dim, dtype=dtype) + 0.5)
        self.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(RANK, dim, dtype=dtype) * 0.1) if lora else None
        self.lora_b = torch.nn.Parameter(torch.randn(2 * dim, RANK, dtype=dtype) * 0.1) if lora else None

    def forward(self, x):
        y = self.norm(x) * self.scale
        z = self.fc1(y)
        if self.lora_a is not None:
            z = z + (y @ self.lora_a.t()) @ self.lora_b.t()
        return x + self.fc2(torch.nn.functional.gelu(z))


def make_blocks(n, seed=7, **kwargs):
    torch.manual_seed(seed)
    return [Block(**kwargs) for _ in range(n)]


def twin(blocks):
    """The same blocks, independent: one set runs with the offloader, one without."""
    return copy.deepcopy(blocks)


def lora_parameters(blocks):
    return [p for b in blocks for p in b.parameters() if p.requires_grad]


def run_blocks(blocks, x, offloader=None, checkpointing=None):
    """diffusion-pipe's forward wrapper: wait, the block's own call, submit; optionally inside
    torch.utils.checkpoint."""
    if offloader is not None:
        offloader.prepare_block_devices_before_forward()
    for i, block in enumerate(blocks):
        def layer(h, i=i, block=block):
            if offloader is not None:
                offloader.wait_for_block(i)
            h = block(h)
            if offloader is not None:
                offloader.submit_move_blocks_forward(i)
            return h

        if checkpointing is None:
            x = layer(x)
        else:
            x = torch.utils.checkpoint.checkpoint(layer, x,
                                                  use_reentrant=checkpointing == "reentrant")
    return x


def train(blocks, steps=3, offloader=None, checkpointing=None, forward=None, dtype=torch.float32):
    """AdamW steps on the adapters; returns every loss, input gradient, adapter gradient and
    the adapters after the last step."""
    torch.manual_seed(11)
    x0 = torch.randn(2, 5, DIM, dtype=dtype)
    params = lora_parameters(blocks)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    seen = []
    for _ in range(steps):
        x = x0.clone().requires_grad_(True)
        out = forward(x) if forward else run_blocks(blocks, x, offloader, checkpointing)
        loss = out.float().pow(2).mean()
        loss.backward()
        seen += [loss.detach(), x.grad] + [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
    return seen + [p.detach().clone() for p in params]


def assert_bitwise(expected, got):
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"#{i}: max diff {(a.float() - b.float()).abs().max().item()}"


@pytest.fixture
def cpu():
    return torch.device("cpu")
