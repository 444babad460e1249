"""diffusers' FluxTransformer2DModel (two block lists on one device), WanTransformer3DModel and
QwenImageTransformer2DModel with a peft LoRA: inference, LoRA gradients and adapters after
AdamW steps bitwise equal to the same model without blockswap, for several K, without
checkpointing and with both kinds of torch.utils.checkpoint."""

import pytest
import torch

from real_models import (BLOCK_LISTS, assert_bitwise, base_weights, build, checkpointing, infer,
                         swap, train)

KINDS = list(BLOCK_LISTS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("checkpoint", [None, "non-reentrant", "reentrant"])
def test_lora_training_is_exact(kind, k, checkpoint):
    reference, model = build(kind), build(kind)
    for m in (reference, model):
        checkpointing(m, checkpoint)
    reentrant = checkpoint == "reentrant"
    expected = train(reference, kind, reentrant_inputs=reentrant)
    offloaders = swap(model, kind, k, reentrant=reentrant)
    got = train(model, kind, offloaders, reentrant_inputs=reentrant)
    assert_bitwise(expected, got)
    for offloader in offloaders:
        stats = offloader.stats()
        assert stats["moves"] == 3 * 2 * k  # 2K loads a step, the seed's moves
        assert stats["h2d_bytes"] > 0
    # The base weights are as built, in the model after close().
    for offloader in offloaders:
        offloader.close()
    assert_bitwise(list(base_weights(build(kind)).values()), list(base_weights(model).values()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_inference_is_exact(kind, k):
    reference, model = build(kind), build(kind)
    offloaders = swap(model, kind, k, supports_backward=False)
    for seed in (1, 2):  # two passes: the rotation comes back where it started
        assert torch.equal(infer(reference, kind, seed=seed), infer(model, kind, offloaders, seed))
    for offloader in offloaders:
        offloader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_stay_resident_and_only_base_weights_move(kind):
    model = build(kind)
    offloaders = swap(model, kind, 2)
    train(model, kind, offloaders, steps=1)
    for offloader in offloaders:
        offloader.reset_stats()  # the first prepare also placed the resident blocks
    train(model, kind, offloaders, steps=1)
    for name, offloader in zip(BLOCK_LISTS[kind], offloaders):
        blocks = getattr(model, name)
        base = sum(p.numel() * p.element_size() for p in blocks[0].parameters()
                   if not p.requires_grad)
        # 2K loads of one block's frozen weights (alignment adds at most 256 B a tensor).
        loads = offloader.stats()["h2d_bytes"] / 4
        assert base <= loads < base + 256 * len(list(blocks[0].parameters())), name
        offloader.close()
