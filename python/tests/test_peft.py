"""peft adapters on swapped blocks: merge_adapter / unmerge_adapter (and diffusers' fuse_lora /
unfuse_lora) write the base weights through .data; with blockswap the merged weights are used,
bitwise as without it, and the host copy ends exactly as it was (Note [peft merges])."""

import copy

import pytest
import torch

from real_models import BLOCK_LISTS, base_weights, build, infer, swap, train

peft = pytest.importorskip("peft")
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402


def merge(model, **kwargs):
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge(**kwargs)


def unmerge(model):
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.unmerge()


@pytest.mark.parametrize("kind", list(BLOCK_LISTS))
@pytest.mark.parametrize("safe_merge", [False, True])
@pytest.mark.parametrize("when", ["after training", "before any pass"])
def test_merged_sample_is_peft_s_and_unmerge_restores_the_base_weights(kind, safe_merge, when):
    reference, model = build(kind), build(kind)
    originals = base_weights(model, kind)  # (the model's own proj_out is not swapped)
    offloaders = swap(model, kind, 2)
    if when == "after training":
        train(reference, kind, steps=2)
        train(model, kind, offloaders, steps=2)
    merge(reference, safe_merge=safe_merge)
    merge(model, safe_merge=safe_merge)
    for seed in (1, 2):
        assert torch.equal(infer(reference, kind, seed=seed), infer(model, kind, offloaders, seed))
    unmerge(model)
    unmerged = build(kind)
    unmerged.load_state_dict(model.state_dict())  # the adapters as trained, never merged
    unmerge(reference)  # (peft's own subtraction leaves rounding behind; blockswap does not)
    assert torch.equal(infer(unmerged, kind), infer(model, kind, offloaders))
    for offloader in offloaders:
        offloader.close()
    now = base_weights(model, kind)
    assert all(torch.equal(originals[name], now[name]) for name in originals)


def test_diffusers_fuse_lora_and_unfuse_lora():
    kind = "flux"
    reference, model = build(kind, lora=False), build(kind, lora=False)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                             target_modules=["to_q", "to_k", "to_v", "proj_out"])
    for m in (reference, model):
        torch.manual_seed(3)
        m.add_adapter(config)
    originals = base_weights(model, kind)  # (the model's own proj_out is not swapped)
    offloaders = swap(model, kind, 2, supports_backward=False)
    reference.fuse_lora()
    model.fuse_lora()
    assert torch.equal(infer(reference, kind), infer(model, kind, offloaders))
    model.unfuse_lora()
    reference.unfuse_lora()
    for offloader in offloaders:
        offloader.close()
    now = base_weights(model, kind)
    assert all(torch.equal(originals[name], now[name]) for name in originals)


def test_copies_and_models_without_blockswap_merge_as_peft_does():
    kind = "wan"
    model = build(kind)
    offloaders = swap(model, kind, 2)
    ema = copy.deepcopy(model)
    plain = build(kind)
    merge(ema)
    merge(plain)
    assert torch.equal(infer(plain, kind), infer(ema, kind))
    for offloader in offloaders:
        offloader.close()


@pytest.mark.parametrize("when", ["merged before the offloader", "written while merged",
                                  "adapters changed while merged"])
def test_unmerges_that_cannot_restore_are_peft_s_own_subtraction(when):
    kind = "wan"
    reference, model = build(kind), build(kind)
    if when == "merged before the offloader":
        merge(reference)
        merge(model)
    offloaders = swap(model, kind, 2, supports_backward=False)
    assert torch.equal(infer(reference, kind), infer(model, kind, offloaders))
    if when != "merged before the offloader":
        merge(reference)
        merge(model)
    for m in (reference, model):
        with torch.no_grad():
            if when == "written while merged":
                m.blocks[1].attn1.to_q.base_layer.weight.mul_(0.5)
            elif when == "adapters changed while merged":
                m.blocks[0].attn1.to_q.lora_B["default"].weight.mul_(2)
    assert torch.equal(infer(reference, kind), infer(model, kind, offloaders))
    unmerge(reference)
    unmerge(model)
    for seed in (1, 2):  # the resident blocks, and the swapped ones after their next load
        assert torch.equal(infer(reference, kind, seed=seed), infer(model, kind, offloaders, seed))
    for offloader in offloaders:
        offloader.close()
