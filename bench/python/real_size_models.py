"""The real-size models of bench/python/real_size.py: diffusers' FluxTransformer2DModel with
FLUX.1-dev's configuration and WanTransformer3DModel with Wan 2.1 T2V 14B's, or tiny configs of
the same classes (--rehearse), with random weights made here (nothing downloaded), a peft LoRA
on the attention projections, and one batch of inputs at the benchmark's resolution.

The configurations are those of the models' config.json on the hub, as diffusers' classes take
them (FLUX.1-dev: black-forest-labs/FLUX.1-dev/transformer/config.json; Wan 2.1 14B:
Wan-AI/Wan2.1-T2V-14B-Diffusers/transformer/config.json, which are WanTransformer3DModel's
defaults in diffusers 0.42.1).

Weights: the model is built with its parameters on the meta device (buffers, such as Wan's
rotary tables, are real), then each parameter is made on the compute device with randn and
copied to host memory, block by block: on a GPU the host's page faults and the device-to-host
copy bound it, not the random numbers.
"""
import contextlib
import time

import torch
from torch import nn

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=4, num_single_layers=6,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
               in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
               num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
               rope_max_seq_len=1024)
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
                num_layers=6, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32)

MODELS = {
    "flux": dict(cls="FluxTransformer2DModel", config=FLUX_DEV, tiny=FLUX_TINY,
                 lists=("transformer_blocks", "single_transformer_blocks"),
                 lora=["to_q", "to_k", "to_v", "to_out.0"]),
    "wan": dict(cls="WanTransformer3DModel", config=WAN_14B, tiny=WAN_TINY, lists=("blocks",),
                lora=["to_q", "to_k", "to_v", "to_out.0"]),
}


def shape_of(name, tiny, frames=81):
    """Tokens and widths of one batch: (image tokens, text tokens, hidden dim, FFN dim)."""
    if name == "flux":
        if tiny:
            return dict(img=64, txt=16, dim=32, ffn=128, latent=(64, 16))
        return dict(img=4096, txt=512, dim=3072, ffn=12288, latent=(4096, 64))  # 1024x1024
    if tiny:
        return dict(img=3 * 4 * 4, txt=6, dim=24, ffn=32, latent=(4, 3, 8, 8))
    lat_t = (frames - 1) // 4 + 1  # Wan's VAE: 4x in time, 8x in space; 480x832
    return dict(img=lat_t * 30 * 52, txt=512, dim=5120, ffn=13824, latent=(16, lat_t, 60, 104))


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside is moved to the meta device (buffers stay real), so
    that building a 12B model costs no memory and no initialisation."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model, make_on, keep_fp32=()):
    """Random parameters in host memory: bf16, except LoRA and `keep_fp32` modules (fp32, as
    diffusers' from_pretrained keeps them). Returns (bytes made, seconds)."""
    start, made = time.perf_counter(), 0
    gen = torch.Generator(device=make_on).manual_seed(0)
    for mod_name, module in model.named_modules():
        fp32 = "lora_" in mod_name or any(k in mod_name.split(".") for k in keep_fp32)
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            dtype = torch.float32 if fp32 else torch.bfloat16
            value = torch.randn(p.shape, generator=gen, device=make_on, dtype=dtype).mul_(0.02)
            if p.dim() == 1 and "norm" in mod_name:
                value.add_(1.0)  # norm weights near one
            host = value.to("cpu")
            module._parameters[name] = nn.Parameter(host, requires_grad=p.requires_grad)
            made += host.numel() * host.element_size()
    if make_on.type == "cuda":
        torch.cuda.synchronize()
    return made, time.perf_counter() - start


def build(name, tiny, make_on, lora_rank=16):
    """The model in host memory, base weights frozen, a peft LoRA (trainable, fp32) on the
    attention projections; returns (model, facts)."""
    import diffusers
    import peft
    spec = MODELS[name]
    cls = getattr(diffusers, spec["cls"])
    with parameters_on_meta():
        model = cls(**(spec["tiny"] if tiny else spec["config"]))
        model.requires_grad_(False)
        config = peft.LoraConfig(r=lora_rank, lora_alpha=lora_rank, init_lora_weights="gaussian",
                                 target_modules=spec["lora"])
        model = peft.inject_adapter_in_model(config, model)
    made, seconds = materialize(model, make_on, getattr(cls, "_keep_in_fp32_modules", None) or ())
    model.eval()
    blocks = {n: list(getattr(model, n)) for n in spec["lists"]}
    # Packed as blockswap packs them: each tensor at a multiple of 256 bytes (core/layout.hpp).
    frozen = lambda m: sum(-(-p.numel() * p.element_size() // 256) * 256  # noqa: E731
                           for p in m.parameters() if not p.requires_grad)
    block_bytes = {n: [frozen(b) for b in bl] for n, bl in blocks.items()}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    lora = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    facts = dict(params=sum(p.numel() for p in model.parameters()), weight_bytes=total,
                 lora_bytes=lora, block_bytes=block_bytes,
                 fixed_bytes=total - sum(map(sum, block_bytes.values())),
                 made_bytes=made, make_seconds=seconds,
                 make_gbps=made / seconds / 1e9 if seconds > 0 else None)
    return model, facts


def inputs(name, tiny, device, frames=81):
    """One batch (bf16) on `device`: FLUX at 1024x1024 (128x128 latent packed into 4096 tokens
    of 64 channels, 512 text tokens), Wan 480x832 with `frames` frames (latent 16 x
    ((frames-1)/4+1) x 60 x 104, 512 text tokens)."""
    s = shape_of(name, tiny, frames)
    g = torch.Generator(device=device).manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device,  # noqa: E731
                                      dtype=torch.bfloat16)
    if name == "flux":
        text_dim = FLUX_TINY["joint_attention_dim"] if tiny else 4096
        pooled = FLUX_TINY["pooled_projection_dim"] if tiny else 768
        side = int(s["img"] ** 0.5)
        ids = torch.zeros(side, side, 3, device=device)
        ids[..., 1] = torch.arange(side, device=device)[:, None]
        ids[..., 2] = torch.arange(side, device=device)[None, :]
        return dict(hidden_states=rand(1, *s["latent"]), encoder_hidden_states=rand(1, s["txt"],
                    text_dim), pooled_projections=rand(1, pooled),
                    timestep=torch.tensor([0.5], device=device),
                    guidance=torch.tensor([3.5], device=device),
                    img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(s["txt"], 3, device=device))
    text_dim = WAN_TINY["text_dim"] if tiny else 4096
    return dict(hidden_states=rand(1, *s["latent"]), timestep=torch.tensor([500], device=device),
                encoder_hidden_states=rand(1, s["txt"], text_dim))


def activation_reserve(name, tiny, train, frames=81):
    """Device bytes kept for activations beside the weights, an estimate: training (each
    block in torch.utils.checkpoint) keeps every block's input, and one block runs its forward
    and backward at a time; inference holds one block's working set. Plus 1.5 GiB for the
    CUDA workspaces, the allocator's rounding, the LoRA's gradients and AdamW state."""
    s = shape_of(name, tiny, frames)
    tokens = s["img"] + s["txt"]
    n = {"flux": 57, "wan": 40}[name] if not tiny else {"flux": 10, "wan": 6}[name]
    block_input = tokens * s["dim"] * 2
    working = tokens * max(s["ffn"], 4 * s["dim"]) * 2 * (6 if train else 2)
    slack = 0 if tiny else 3 << 29
    return (n * block_input if train else 0) + working + slack
