"""The two trainers' calling patterns, verb by verb (docs/python.md, "Trainers").

musubi-tuner: ModelOffloader(block_type, blocks, N, K, supports_backward, device,
use_pinned_memory, debug); prepare_block_devices_before_forward(blocks) once after loading, not
every step; submit_move_blocks_forward(blocks, i); non-reentrant checkpointing inside the block,
the verbs outside it; sampling between steps through set_forward_only(True) + prepare(blocks),
training again through set_forward_only(False) + prepare(blocks); skip-layer guidance (a block
submitted but neither waited for nor run).

diffusion-pipe: ModelOffloader(..., reentrant_activation_checkpointing, debug=False); the
verbs inside each checkpointed layer wrapper; prepare after every eval/train switch and not every
step; evaluation under no_grad between steps, with or without disable_block_swap()."""

import pytest
import torch
import torch.utils.checkpoint

import blockswap
from conftest import DIM, assert_bitwise, lora_parameters, make_blocks, twin
from real_models import build, infer, inputs

STEPS = 3


def musubi_forward(blocks, x, offloader=None, skip=(), checkpointing=False):
    """musubi-tuner's model forward: the verbs around each block, checkpointing inside it."""
    for i, block in enumerate(blocks):
        skipped = i in skip
        if offloader is not None and not skipped:
            offloader.wait_for_block(i)
        if not skipped:
            if checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if offloader is not None:
            offloader.submit_move_blocks_forward(blocks, i)
    return x


def musubi_training(blocks, offloader=None, checkpointing=False, sample_every=2, swap_k=None):
    """Steps of AdamW on the adapters with a sampling pass (two no_grad forwards, CFG-like)
    every `sample_every` steps; every loss, gradient, sample and the adapters at the end."""
    torch.manual_seed(11)
    x0 = torch.randn(2, 5, DIM)
    params = lora_parameters(blocks)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if offloader is not None:
        offloader.prepare_block_devices_before_forward(blocks)  # once, after loading
    seen = []
    for step in range(STEPS * 2):
        x = x0.clone().requires_grad_(True)
        loss = musubi_forward(blocks, x, offloader, checkpointing=checkpointing).pow(2).mean()
        loss.backward()
        seen += [loss.detach(), x.grad] + [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
        if step % sample_every == 0:
            if offloader is not None:  # switch_block_swap_for_inference
                offloader.set_forward_only(True)
                offloader.prepare_block_devices_before_forward(blocks)
            with torch.no_grad():
                for _ in range(2):
                    seen.append(musubi_forward(blocks, x0, offloader))
            if offloader is not None:  # switch_block_swap_for_training
                offloader.set_forward_only(False)
                offloader.prepare_block_devices_before_forward(blocks)
    return seen + [p.detach().clone() for p in params]


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("use_pinned_memory", [False, True])
def test_musubi_tuner_training_with_sampling_is_exact(k, checkpointing, use_pinned_memory):
    blocks = make_blocks(6)
    reference = twin(blocks)
    expected = musubi_training(reference, checkpointing=checkpointing)
    # The seventh positional argument is musubi-tuner's use_pinned_memory: read as the
    # reentrant flag, which only allows a block to run twice in a pass; exact either way.
    with blockswap.ModelOffloader("blocks", blocks, 6, k, True, torch.device("cpu"),
                                  use_pinned_memory, False) as offloader:
        got = musubi_training(blocks, offloader, checkpointing=checkpointing)
    assert_bitwise(expected, got)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_musubi_tuner_skip_layer_guidance_is_exact(k):
    blocks = make_blocks(6, lora=False)
    reference = twin(blocks)
    x = torch.randn(2, 5, DIM)
    with torch.no_grad(), blockswap.ModelOffloader("blocks", blocks, 6, k, False,
                                                   torch.device("cpu"), False) as offloader:
        offloader.prepare_block_devices_before_forward(blocks)
        for skip in [(), (2,), (0, 5), (1, 2, 3), ()]:
            assert torch.equal(musubi_forward(reference, x, skip=skip),
                               musubi_forward(blocks, x, offloader, skip=skip)), skip


def test_musubi_tuner_prepare_with_other_blocks_is_refused():
    blocks = make_blocks(4)
    with blockswap.ModelOffloader("blocks", blocks, 4, 2, True, torch.device("cpu"), False,
                                  False) as offloader:
        with pytest.raises(blockswap.InvalidArgumentError, match="not the blocks"):
            offloader.prepare_block_devices_before_forward(make_blocks(4))
        offloader.prepare_block_devices_before_forward(blocks)  # still usable


class Layer(torch.nn.Module):
    """diffusion-pipe's layer wrapper: the verbs inside what is checkpointed."""

    def __init__(self, block, index, offloader):
        super().__init__()
        self.block, self.index, self.offloader = block, index, offloader

    def forward(self, x):
        if self.offloader is not None:
            self.offloader.wait_for_block(self.index)
        x = self.block(x)
        if self.offloader is not None:
            self.offloader.submit_move_blocks_forward(self.index)
        return x


def pipe_training(blocks, offloader=None, checkpointing=None, disable_for_eval=False):
    torch.manual_seed(11)
    x0 = torch.randn(2, 5, DIM)
    layers = [Layer(b, i, offloader) for i, b in enumerate(blocks)]
    params = lora_parameters(blocks)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    def evaluate():
        if offloader is not None:  # prepare_block_swap_inference
            if disable_for_eval:
                offloader.disable_block_swap()
            offloader.set_forward_only(True)
            offloader.prepare_block_devices_before_forward()
        with torch.no_grad():
            h = x0
            for layer in layers:
                h = layer(h)
        if offloader is not None:  # prepare_block_swap_training
            offloader.enable_block_swap()
            offloader.set_forward_only(False)
            offloader.prepare_block_devices_before_forward()
        return h

    seen = [evaluate()]  # before the first step
    for step in range(STEPS * 2):
        x = x0.clone().requires_grad_(True)
        h = x
        for layer in layers:
            h = layer(h) if checkpointing is None else torch.utils.checkpoint.checkpoint(
                layer, h, use_reentrant=checkpointing == "reentrant")
        loss = h.pow(2).mean()
        loss.backward()
        seen += [loss.detach(), x.grad] + [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 1:
            seen.append(evaluate())
    return seen + [p.detach().clone() for p in params]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("disable_for_eval", [False, True])
def test_diffusion_pipe_training_with_evaluation_is_exact(k, checkpointing, disable_for_eval):
    blocks = make_blocks(6)
    reference = twin(blocks)
    expected = pipe_training(reference, checkpointing=checkpointing)
    offloader = blockswap.ModelOffloader("TransformerBlock", blocks, 6, k, True,
                                         torch.device("cpu"), checkpointing == "reentrant",
                                         debug=False)
    got = pipe_training(blocks, offloader, checkpointing, disable_for_eval)
    offloader.close()
    assert_bitwise(expected, got)


def test_diffusion_pipe_dummy_offloader_does_nothing():
    dummy = blockswap.ModelOffloader("dummy", [], 0, 0, True, torch.device("cuda"), False,
                                     debug=False)
    dummy.prepare_block_devices_before_forward()
    dummy.wait_for_block(0)
    dummy.submit_move_blocks_forward(0)
    dummy.set_forward_only(True)
    dummy.disable_block_swap()
    dummy.enable_block_swap()


def test_a_real_model_trained_with_prepare_once_and_sampling_in_between():
    """musubi-tuner's pattern on diffusers' Wan: prepare once, steps, a sample, steps."""
    kind = "wan"
    results = []
    for swapped in (False, True):
        model = build(kind)
        model.train()
        offloaders = []
        if swapped:
            offloaders = [blockswap.ModelOffloader(
                "blocks", list(model.blocks), 4, 2, True, torch.device("cpu"), False,
                hook_blocks=True)]
            offloaders[0].prepare_block_devices_before_forward(list(model.blocks))
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        seen = []
        for step in range(4):
            loss = model(**inputs(kind, seed=step), return_dict=False)[0].pow(2).mean()
            loss.backward()
            seen += [loss.detach()] + [p.grad.clone() for p in params]
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                for o in offloaders:
                    o.set_forward_only(True)
                seen.append(infer(model, kind, offloaders))
                for o in offloaders:
                    o.set_forward_only(False)
                    o.prepare_block_devices_before_forward()
        results.append(seen)
        for o in offloaders:
            o.close()
    assert_bitwise(*results)


@pytest.mark.parametrize("training", [False, True])
def test_a_model_that_skips_blocks_in_its_own_forward_with_hook_blocks(training):
    """diffusers' SD3Transformer2DModel(skip_layers=…) (StableDiffusion3Pipeline's skip-layer
    guidance) never calls a skipped block: the next block's wait hook submits it."""
    import diffusers

    def sd3():
        torch.manual_seed(0)
        return diffusers.SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, num_layers=6, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
            pooled_projection_dim=16, out_channels=4).requires_grad_(False)

    g = torch.Generator().manual_seed(1)
    args = dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g),
                timestep=torch.tensor([500]), return_dict=False)
    reference, model = sd3(), sd3()
    if training:  # gradients reach the input latents through the swapped blocks
        args["hidden_states"].requires_grad_(True)
    offloader = blockswap.ModelOffloader("transformer_blocks", list(model.transformer_blocks), 6,
                                         2, training, torch.device("cpu"), False,
                                         hook_blocks=True)
    for skip in (None, [3], [1], [0, 1], [5], [2, 4], None):
        offloader.prepare_block_devices_before_forward()
        with torch.set_grad_enabled(training):
            expected = reference(**args, skip_layers=skip)[0]
            got = model(**args, skip_layers=skip)[0]
        assert torch.equal(expected, got), skip
        if training:
            a, = torch.autograd.grad(expected.pow(2).mean(), args["hidden_states"])
            b, = torch.autograd.grad(got.pow(2).mean(), args["hidden_states"])
            assert torch.equal(a, b), skip
    offloader.close()
