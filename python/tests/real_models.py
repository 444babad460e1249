"""diffusers' own model classes from tiny configs (those of diffusers' tests, with 4 blocks per
list), random weights, run with and without blockswap the way the trainers run them."""

import functools
import warnings

import pytest
import torch
import torch.utils.checkpoint

import blockswap
from conftest import assert_bitwise  # noqa: F401 (the tests import it from here too)

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

LAYERS = 4
# The block lists each model swaps, as diffusion-pipe, musubi-tuner and OneTrainer name them.
BLOCK_LISTS = {
    "flux": ["transformer_blocks", "single_transformer_blocks"],
    "wan": ["blocks"],
    "qwen": ["transformer_blocks"],
}
LORA_TARGETS = {
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_mlp", "proj_out"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"],
    "qwen": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "img_mlp.net.2"],
}


def build(kind, seed=0, lora=True, dtype=torch.float32):
    """The model in eval mode, its base weights frozen, a peft LoRA on its attention and MLP."""
    torch.manual_seed(seed)
    if kind == "flux":
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=4, num_layers=LAYERS, num_single_layers=LAYERS,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
    elif kind == "wan":
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=LAYERS,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    else:
        model = diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=LAYERS, attention_head_dim=16,
            num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    model = model.to(dtype)
    model.requires_grad_(False)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                 target_modules=LORA_TARGETS[kind])
        model = peft.inject_adapter_in_model(config, model)
    return model.eval()


def inputs(kind, seed=1, dtype=torch.float32, requires_grad=False):
    """One batch of the model's forward arguments; the latent requires grad when asked (the
    input of a reentrant checkpoint must, for the blocks' adapters to get gradients)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flux":
        args = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                    encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
                    pooled_projections=torch.randn(1, 32, generator=g),
                    timestep=torch.tensor([0.5]), img_ids=torch.randn(16, 3, generator=g),
                    txt_ids=torch.zeros(6, 3))
    elif kind == "wan":
        args = dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g),
                    timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 6, 16, generator=g))
    else:
        args = dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                    encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
                    encoder_hidden_states_mask=torch.ones(1, 6), timestep=torch.tensor([0.5]),
                    img_shapes=[(1, 4, 4)])
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        if name in args:
            args[name] = args[name].to(dtype).requires_grad_(requires_grad)
    return args


def checkpointing(model, kind):
    """diffusers' gradient checkpointing, each block in torch.utils.checkpoint of that kind."""
    if kind is not None:
        model.enable_gradient_checkpointing(functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=kind == "reentrant"))


def swap(model, kind, k, reentrant=False, supports_backward=True, device=None, **extra):
    """One offloader per block list of the model on one shared device (a new emulated one
    unless given), its hooks waiting for each block and submitting its move (hook_blocks=True;
    inside checkpointing a recompute waits and submits again). Returns the offloaders."""
    device = device if device is not None else blockswap.open_device("cpu")
    return [blockswap.ModelOffloader(name, list(getattr(model, name)),
                                     len(getattr(model, name)), k, supports_backward,
                                     torch.device("cpu"), reentrant, shared_device=device,
                                     hook_blocks=True, **extra)
            for name in BLOCK_LISTS[kind]]


def prepare(offloaders):
    for offloader in offloaders:
        offloader.prepare_block_devices_before_forward()


def adapters(model):
    return [p for p in model.parameters() if p.requires_grad]


def infer(model, kind, offloaders=(), seed=1):
    with torch.no_grad():
        prepare(offloaders)
        return model(**inputs(kind, seed), return_dict=False)[0]


def train(model, kind, offloaders=(), steps=3, reentrant_inputs=False, after_step=None):
    """AdamW steps on the adapters; every loss, input gradient, adapter gradient, and the
    adapters after the last step."""
    params = adapters(model)
    assert params, "no adapters to train"
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    model.train()
    seen = []
    for step in range(steps):
        prepare(offloaders)
        args = inputs(kind, seed=step + 1, requires_grad=reentrant_inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reentrant checkpoint's input warning
            out = model(**args, return_dict=False)[0]
        loss = out.float().pow(2).mean()
        loss.backward()
        assert all(p.grad is not None for p in params), "an adapter got no gradient"
        seen += [loss.detach(), args["hidden_states"].grad if reentrant_inputs else loss]
        seen += [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step)
    model.eval()
    return seen + [p.detach().clone() for p in params]


def base_weights(model, kind=None):
    """Every frozen tensor's values by name; with `kind`, only those of the swapped blocks."""
    lists = tuple(f"{name}." for name in BLOCK_LISTS[kind]) if kind else ("",)
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if not p.requires_grad and name.startswith(lists)}
