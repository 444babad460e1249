"""Where the system will not pin host memory (a low ``ulimit -l``, WSL, Windows), blockswap keeps
the host copies pageable and stages their loads through a few pinned buffers: emulated here with
open_device("cpu", pinnable_bytes=...). Bitwise the model without blockswap: FLUX inference and
LoRA training (both block lists), full fine-tuning stepped on the device and on the host, the
file tier's host budget; and no load makes the host wait for the copy stream."""

import pytest
import torch

import blockswap
from conftest import make_blocks, run_blocks
from real_models import BLOCK_LISTS, assert_bitwise, build, checkpointing, infer, swap, train
from test_fine_tune import OPTIMIZERS, STEPS, assert_same, batches, fine_tune_blocks, trainable

safetensors_torch = pytest.importorskip("safetensors.torch")


def staged(offloaders):
    return sum(o.stats()["staged_bytes"] for o in offloaders)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("pinnable", [0, 4096])
def test_inference_with_pageable_host_copies_is_bitwise(k, pinnable):
    expected = [infer(build("flux"), "flux", seed=s) for s in (1, 2)]
    model = build("flux")
    device = blockswap.open_device("cpu", pinnable_bytes=pinnable)
    offloaders = swap(model, "flux", k, device=device, supports_backward=False)
    assert_bitwise([infer(model, "flux", offloaders, seed=s) for s in (1, 2)], expected)
    assert staged(offloaders) > 0


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("ckpt", [None, "non_reentrant", "reentrant"])
def test_lora_training_with_pageable_host_copies_is_bitwise(k, ckpt):
    plain = build("flux")
    checkpointing(plain, ckpt)
    reentrant = ckpt == "reentrant"  # its inputs must require grad for the adapters' to flow
    expected = train(plain, "flux", reentrant_inputs=reentrant)
    model = build("flux")
    checkpointing(model, ckpt)
    device = blockswap.open_device("cpu", pinnable_bytes=0)
    offloaders = swap(model, "flux", k, device=device, reentrant=reentrant)
    assert_bitwise(train(model, "flux", offloaders, reentrant_inputs=reentrant), expected)
    assert staged(offloaders) > 0


def test_the_warning_is_loud_once_per_block_list(capfd):
    device = blockswap.open_device("cpu", pinnable_bytes=0)
    for attempt in range(2):  # built again (a rebuild, an expert switched): said once
        with blockswap.ModelOffloader("warned_blocks", make_blocks(4), 4, 2, False,
                                      torch.device("cpu"), False, shared_device=device):
            pass
        err = capfd.readouterr().err
        assert err.count("[warned_blocks] WARNING: the host copies of 4 of 4 blocks are "
                         "pageable") == (1 if attempt == 0 else 0), err


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_a_frozen_weight_written_between_fine_tuning_steps_is_kept(step_on):
    """A weight that does not train, changed between steps (a merged adapter, a schedule of
    frozen weights): the staged loads carry it, as pinned loads do."""
    def run(pinnable, use_blockswap=True):
        blocks = fine_tune_blocks()
        for block in blocks:
            block.fc2.requires_grad_(False)  # fc1 trains, fc2 is frozen
        params = trainable(blocks)
        offloader = None
        if use_blockswap:
            optimizer = blockswap.FusedAdamW(params, lr=1e-2)
            device = blockswap.open_device("cpu", pinnable_bytes=pinnable)
            offloader = blockswap.ModelOffloader("blocks", blocks, len(blocks), 2, True,
                                                 torch.device("cpu"), False, optimizer=optimizer,
                                                 step_on=step_on, shared_device=device)
        else:
            optimizer = torch.optim.AdamW(params, lr=1e-2)
        seen = []
        for x in batches(4):
            loss = run_blocks(blocks, x, offloader).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for block in blocks[:3]:
                    block.fc2.weight.mul_(0.5)
            seen.append(loss.detach())
        if offloader is not None:
            offloader.close()
        return seen + [p.detach().clone() for b in blocks for p in b.parameters()]

    expected = run(None, use_blockswap=False)
    assert_same(expected, run(None), "pinned")
    assert_same(expected, run(0), "pageable")


def test_pinned_host_copies_stage_nothing():
    model = build("flux")
    offloaders = swap(model, "flux", 2)
    train(model, "flux", offloaders, steps=1)
    assert staged(offloaders) == 0


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_full_fine_tuning_with_pageable_host_copies_is_bitwise(step_on):
    reference_optimizer, fused_optimizer = OPTIMIZERS["adamw"]
    reference = fine_tune_blocks()
    optimizer = reference_optimizer(trainable(reference))
    inputs = batches(STEPS)

    def steps(blocks, optimizer, offloader=None):
        seen = []
        for x in inputs:
            loss = run_blocks(blocks, x, offloader).pow(2).mean()
            loss.backward()
            seen.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return seen + [p.detach().clone() for b in blocks for p in b.parameters()]

    expected = steps(reference, optimizer)
    for k in (1, 3):
        blocks = fine_tune_blocks()
        optimizer = fused_optimizer(trainable(blocks))
        device = blockswap.open_device("cpu", pinnable_bytes=0)
        with blockswap.ModelOffloader("blocks", blocks, len(blocks), k, True,
                                      torch.device("cpu"), False, shared_device=device,
                                      optimizer=optimizer, step_on=step_on) as offloader:
            got = steps(blocks, optimizer, offloader)
            assert offloader.stats()["staged_bytes"] > 0
        assert_same(expected, got, f"{step_on} K={k}")


def test_the_file_tiers_host_budget_may_be_pageable(tmp_path):
    path = tmp_path / "flux.safetensors"
    safetensors_torch.save_file(build("flux", lora=False).state_dict(), str(path))
    expected = train(build("flux"), "flux")
    model = build("flux")
    device = blockswap.open_device("cpu", pinnable_bytes=0)
    budget = 2 * max(sum(p.numel() * p.element_size() for p in getattr(model, name)[0]
                         .parameters()) for name in BLOCK_LISTS["flux"])
    offloaders = swap(model, "flux", 2, device=device, weights_file=str(path), host_budget_bytes=budget)
    assert_bitwise(train(model, "flux", offloaders), expected)
    assert staged(offloaders) > 0
    assert sum(o.stats()["disk_bytes"] for o in offloaders) > 0


def test_pinnable_bytes_mistakes_are_named():
    with pytest.raises(blockswap.InvalidArgumentError, match="pinnable_bytes must be an int >= 0"):
        blockswap.open_device("cpu", pinnable_bytes=-1)
    with pytest.raises(blockswap.InvalidArgumentError, match="pinnable_bytes must be an int"):
        blockswap.open_device("cpu", pinnable_bytes=1.5)


def test_blocks_outside_real_models_too():
    """The small blocks of the other tests, every K, inference: bitwise."""
    blocks = make_blocks(6)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = run_blocks(blocks, x)
        for k in range(0, 5):
            device = blockswap.open_device("cpu", pinnable_bytes=0)
            with blockswap.ModelOffloader("blocks", blocks, 6, k, False, torch.device("cpu"),
                                          False, shared_device=device) as offloader:
                for _ in range(2):
                    assert torch.equal(run_blocks(blocks, x, offloader), expected), k
