"""The reference transformer of models/reference_transformer.hpp, in PyTorch: the same blocks
(pre-norm attention and 4x GELU MLP, LoRA on every linear layer) for the seed's benchmark."""
import math

import torch
from torch import nn


class LoraLinear(nn.Module):
    def __init__(self, d_in, d_out, rank):
        super().__init__()
        bound = 1 / math.sqrt(d_in)
        self.weight = nn.Parameter(torch.empty(d_out, d_in).uniform_(-bound, bound), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(d_out).uniform_(-bound, bound), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * bound) if rank else None
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.01) if rank else None

    def forward(self, x):
        y = nn.functional.linear(x, self.weight, self.bias)
        if self.lora_a is not None:
            y = y + nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)
        return y


class Block(nn.Module):
    def __init__(self, hidden, heads, rank):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = LoraLinear(hidden, 3 * hidden, rank)
        self.proj = LoraLinear(hidden, hidden, rank)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = LoraLinear(hidden, 4 * hidden, rank)
        self.fc2 = LoraLinear(4 * hidden, hidden, rank)
        for p in list(self.norm1.parameters()) + list(self.norm2.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        b, t, h = x.shape
        d = h // self.heads
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attended = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


def make_blocks(n, hidden, heads, rank, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(Block(hidden, heads, rank) for _ in range(n))
