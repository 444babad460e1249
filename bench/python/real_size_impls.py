"""The implementations bench/python/real_size.py compares, each set up on a built model for one
mode ("train": a LoRA step, each block in torch.utils.checkpoint, AdamW on the adapters;
"infer": a no_grad forward) within a device budget for the blocks' weights.

setup_<name>(model, facts, device, mode, budget) -> (step, moved, teardown, info): step() runs
one step, moved() the host->device bytes so far (None: not counted), teardown() undoes it,
info a dict of what was chosen (K, resident blocks).
"""
import functools
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers_bench import Block as FluxBlock, Head as FluxHead, count_group_onloads  # noqa: E402
from real_size_models import MODELS  # noqa: E402


def loss_of(out):
    return out.float().pow(2).mean()


def adapters(model):
    return [p for p in model.parameters() if p.requires_grad]


def plain_step(model, device, mode, inputs):
    """The step every implementation but RamTorch runs: the model's own forward."""
    if mode == "infer":
        def step():
            with torch.no_grad():
                return model(**inputs, return_dict=False)[0]
        return step
    model.enable_gradient_checkpointing(functools.partial(torch.utils.checkpoint.checkpoint,
                                                          use_reentrant=False))
    optimizer = torch.optim.AdamW(adapters(model), lr=1e-4)

    def step():
        loss_of(model(**inputs, return_dict=False)[0]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def to_device_except_blocks(model, name, device):
    lists = MODELS[name]["lists"]
    for child_name, child in model.named_children():
        if child_name not in lists:
            child.to(device)
    for list_name in lists:  # adapters live on the device; frozen block weights are the peers'
        for p in getattr(model, list_name).parameters():
            if p.requires_grad:
                p.data = p.data.to(device)


# --- the planner, for several lists ------------------------------------------------------------
# blockswap's Python package plans one list (blocks_to_swap=-1); the C++ plan_block_lists that
# plans several together is not bound in Python. This mirrors core/planner.cpp's rule: slots of
# the largest block, N-K of them; moved bytes per step 2K (training) or K+R, R = min(2, N-K)
# (inference) average blocks; the fewest moved bytes, then the most device bytes.

def plan(block_bytes, budget, mode):
    lists = list(block_bytes.values())
    choices = [[]]
    for sizes in lists:
        n, slot, avg = len(sizes), max(sizes), sum(sizes) / len(sizes)
        top = n - 2 if mode == "train" else n - 1
        options = []
        for k in range(0, top + 1):
            loads = 2 * k if mode == "train" else (k + min(2, n - k) if k else 0)
            options.append((k, (n - k) * slot, loads * avg))
        choices = [c + [o] for c in choices for o in options]
    fits = [c for c in choices if sum(o[1] for o in c) <= budget]
    if not fits:
        return None
    best = min(fits, key=lambda c: (sum(o[2] for o in c), -sum(o[1] for o in c)))
    return {name: o[0] for name, o in zip(block_bytes, best)}


# --- the implementations -----------------------------------------------------------------------

def setup_reference(model, facts, device, mode, budget, name, inputs):
    model.to(device)
    return plain_step(model, device, mode, inputs), lambda: 0, lambda: model.to("cpu"), \
        dict(note="all weights resident, no cap")


def setup_blockswap(model, facts, device, mode, budget, name, inputs):
    import blockswap
    to_device_except_blocks(model, name, device)
    ks = plan(facts["block_bytes"], budget, mode)
    if ks is None:
        raise MemoryError(f"no K fits a weight budget of {budget / 2**30:.2f} GiB")
    shared = blockswap.open_device(device.type, budget_bytes=max(budget, 1))
    offloaders = [blockswap.ModelOffloader(n, list(getattr(model, n)), len(getattr(model, n)),
                                           ks[n], mode == "train", device, False,
                                           shared_device=shared, hook_blocks=True)
                  for n in MODELS[name]["lists"]]
    inner = plain_step(model, device, mode, inputs)

    def step():
        for o in offloaders:
            o.prepare_block_devices_before_forward()
        return inner()

    def teardown():
        for o in offloaders:
            o.close()
        model.to("cpu")
    moved = lambda: sum(o.stats()["h2d_bytes"] for o in offloaders)  # noqa: E731
    # The host memory blockswap page-locks (Device.host_memory: Note [exact host memory]).
    host = lambda: shared.host_memory()  # noqa: E731
    return step, moved, teardown, dict(k=ks, device_weight_bytes=shared.memory()["device_bytes"],
                                       _host=host)


class _SeedHooks:
    """The seed's verbs from forward hooks (its trainers call them in the block wrapper); a
    checkpoint's recompute in backward calls neither (the seed's reentrant rule)."""

    def __init__(self, offloader, blocks):
        self.in_backward = False
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(
                lambda m, a, i=i: None if self.in_backward else offloader.wait_for_block(i)))
            self.handles.append(block.register_forward_hook(
                lambda m, a, o, i=i: None if self.in_backward
                else offloader.submit_move_blocks_forward(i)))


def setup_seed(model, facts, device, mode, budget, name, inputs):
    from seed_offloader import SeedOffloader
    to_device_except_blocks(model, name, device)
    ks = plan(facts["block_bytes"], budget, mode)  # the seed has no planner: blockswap's K
    if ks is None:
        raise MemoryError(f"no K fits a weight budget of {budget / 2**30:.2f} GiB")
    offloaders, hooks = [], []
    for n in MODELS[name]["lists"]:
        blocks = list(getattr(model, n))
        o = SeedOffloader(n, blocks, ks[n], mode == "train", device)
        o.set_forward_only(mode == "infer")
        offloaders.append(o)
        hooks.append(_SeedHooks(o, blocks))
    inner = plain_step(model, device, mode, inputs)

    def step():
        for o in offloaders:
            o.prepare_block_devices_before_forward()
        if mode == "infer":
            return inner()
        # The forward, then backward with the hooks quiet (a recompute is not a forward).
        original = torch.Tensor.backward

        def backward(tensor, *args, **kwargs):
            for h in hooks:
                h.in_backward = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                for h in hooks:
                    h.in_backward = False
        torch.Tensor.backward = backward
        try:
            return inner()
        finally:
            torch.Tensor.backward = original

    def teardown():
        for o, h in zip(offloaders, hooks):
            o.pool.shutdown(wait=True)
            for handle in h.handles + o.handles:
                handle.remove()
        model.to("cpu")
    bytes_per_block = {n: sum(b) / len(b) for n, b in facts["block_bytes"].items()}

    def moved():  # the seed moves K blocks in (and out) per swap; count its loads
        return sum(o.loads * bytes_per_block[o.block_type] for o in offloaders)
    return step, moved, teardown, dict(k=ks, note="K: blockswap's plan; loads counted")


def setup_diffusers(model, facts, device, mode, budget, name, inputs):
    from diffusers.hooks import apply_group_offloading
    stream = device.type == "cuda"
    # Group offloading does not depend on the cap: applied once per process, kept for the rest.
    if not hasattr(model, "_real_size_onloads"):
        model._real_size_onloads = count_group_onloads()[0]
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1,
                               use_stream=stream)
    counter = model._real_size_onloads
    return plain_step(model, device, mode, inputs), lambda: counter["bytes"], lambda: None, \
        dict(note=f"block_level, 1 block/group, use_stream={stream}; every block moves")


class FluxEmbed(torch.nn.Module):
    """RamTorch chunk 0 for FLUX.1-dev: peers_bench's Embed with the guidance embedding."""

    def __init__(self, m):
        super().__init__()
        self.x_embedder, self.time_text_embed = m.x_embedder, m.time_text_embed
        self.context_embedder, self.pos_embed = m.context_embedder, m.pos_embed

    def forward(self, hidden, context, pooled, timestep, guidance, img_ids, txt_ids):
        hidden = self.x_embedder(hidden)
        temb = self.time_text_embed(timestep.to(hidden.dtype) * 1000,
                                    guidance.to(hidden.dtype) * 1000, pooled)
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        return hidden, self.context_embedder(context), temb, cos, sin


class WanEmbed(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.rope, self.patch_embedding, self.condition_embedder = \
            m.rope, m.patch_embedding, m.condition_embedder

    def forward(self, latent, timestep, context):
        cos, sin = self.rope(latent)
        hidden = self.patch_embedding(latent).flatten(2).transpose(1, 2).contiguous()
        temb, proj, context, _ = self.condition_embedder(timestep, context, None)
        return hidden, context, proj.unflatten(1, (6, -1)), cos, sin, temb


class WanBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden, context, proj, cos, sin, temb):
        return self.block(hidden, context, proj, (cos, sin)), context, proj, cos, sin, temb


class WanHead(torch.nn.Module):
    """The model's output norm and projection (the unpatchify reshape left out)."""

    def __init__(self, m):
        super().__init__()
        self.norm_out, self.proj_out, self.scale_shift_table = \
            m.norm_out, m.proj_out, m.scale_shift_table

    def forward(self, hidden, context, proj, cos, sin, temb):
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        return self.proj_out(hidden)


def ramtorch_chunks(model, name):
    if name == "flux":
        return [FluxEmbed(model), *(FluxBlock(b) for b in model.transformer_blocks),
                *(FluxBlock(b) for b in model.single_transformer_blocks), FluxHead(model)]
    return [WanEmbed(model), *(WanBlock(b) for b in model.blocks), WanHead(model)]


def setup_ramtorch(model, facts, device, mode, budget, name, inputs):
    import ramtorch
    chunks = ramtorch_chunks(model, name)
    blocks = [b for bl in facts["block_bytes"].values() for b in bl]
    pin = max(0, int(budget // max(blocks)) - 2)  # resident chunks beside its window of 2
    engine = ramtorch.OffloadModel(chunks, device=device, window=2, pin=pin)
    counter = {"bytes": 0}
    load = engine._materialize

    def counting_load(state):
        counter["bytes"] += state.nbytes()
        return load(state)
    engine._materialize = counting_load
    order = (("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
              "guidance", "img_ids", "txt_ids") if name == "flux"
             else ("hidden_states", "timestep", "encoder_hidden_states"))
    x = tuple(inputs[k] for k in order)
    optimizer = torch.optim.AdamW(adapters(model), lr=1e-4)

    def step():
        if mode == "infer":
            with torch.no_grad():
                return engine(x)
        engine.step(x, loss_fn=lambda out, _: loss_of(out))
        engine.flush_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, lambda: counter["bytes"], engine.close, \
        dict(note=f"OffloadModel({len(chunks)} chunks, window=2, pin={pin}), recompute backward")


SETUPS = {"reference": setup_reference, "blockswap": setup_blockswap, "seed": setup_seed,
          "diffusers": setup_diffusers, "ramtorch": setup_ramtorch}
