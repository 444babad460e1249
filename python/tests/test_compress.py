"""compress= (docs/python.md, "Compressed weights"): the blocks' frozen weights kept in host memory
losslessly compressed and decoded on the device at each load. Every mode is bitwise the model
without blockswap with compression off and on: FLUX and Wan inference in float32 and bfloat16,
LoRA training (with checkpointing too), offloaded activations, full fine-tuning stepped on the
device and on the host; off the device a compressed block's frozen tensors have no elements and
close() gives them back; a value compress does not take is named."""

import copy
import io

import pytest
import torch

import blockswap
from blockswap import InvalidArgumentError
from conftest import run_blocks
from real_models import assert_bitwise, build, checkpointing, inputs, prepare, swap, train
from test_fine_tune import OPTIMIZERS, STEPS, assert_same, batches, fine_tune_blocks, trainable


def infer(model, kind, offloaders=(), seed=1, dtype=torch.float32):
    with torch.no_grad():
        prepare(offloaders)
        return model(**inputs(kind, seed, dtype=dtype), return_dict=False)[0]


def compressed_blocks(offloaders):
    return sum(o.compression()["blocks"] for o in offloaders)


def check_compression(offloaders, compress):
    if compress == "on":
        assert compressed_blocks(offloaders) > 0
        assert all(o.stats()["decoded_bytes"] > o.stats()["compressed_bytes"] for o in offloaders)
    else:
        assert compressed_blocks(offloaders) == 0


@pytest.mark.parametrize("compress", ["off", "on"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_inference_is_bitwise(kind, dtype, compress):
    expected = [infer(build(kind, dtype=dtype), kind, seed=s, dtype=dtype) for s in (1, 2)]
    model = build(kind, dtype=dtype)
    offloaders = swap(model, kind, 2, supports_backward=False, compress=compress)
    assert_bitwise([infer(model, kind, offloaders, seed=s, dtype=dtype) for s in (1, 2)],
                   expected)
    check_compression(offloaders, compress)
    if compress == "on" and dtype == torch.bfloat16:
        assert all(o.compression()["ratio"] > 1.2 for o in offloaders)
    for o in offloaders:
        o.close()


@pytest.mark.parametrize("compress", ["off", "on"])
@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
@pytest.mark.parametrize("activations", [False, True])
def test_lora_training_is_bitwise(ckpt, activations, compress):
    if ckpt and activations:
        pytest.skip("checkpointing saves no activations to offload")
    plain = build("flux")
    checkpointing(plain, ckpt)
    expected = train(plain, "flux")
    model = build("flux")
    checkpointing(model, ckpt)
    offloaders = swap(model, "flux", 2, compress=compress, offload_activations=activations)
    assert_bitwise(train(model, "flux", offloaders), expected)
    check_compression(offloaders, compress)
    for o in offloaders:
        o.close()


@pytest.mark.parametrize("compress", ["off", "on"])
@pytest.mark.parametrize("step_on", ["device", "host"])
def test_full_fine_tuning_is_bitwise(step_on, compress):
    reference_optimizer, fused_optimizer = OPTIMIZERS["adamw"]

    def make():
        blocks = fine_tune_blocks()
        for block in blocks:
            block.fc2.requires_grad_(False)  # fc1 trains (raw), fc2 is frozen (compressed)
        return blocks

    inputs = batches(STEPS)

    def steps(blocks, optimizer, offloader=None):
        seen = []
        for x in inputs:
            loss = run_blocks(blocks, x, offloader).pow(2).mean()
            loss.backward()
            seen.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return seen

    reference = make()
    expected = steps(reference, reference_optimizer(trainable(reference)))
    expected += [p.detach().clone() for b in reference for p in b.parameters()]
    blocks = make()
    optimizer = fused_optimizer(trainable(blocks))
    with blockswap.ModelOffloader("blocks", blocks, len(blocks), 2, True, torch.device("cpu"),
                                  False, optimizer=optimizer, step_on=step_on,
                                  compress=compress) as offloader:
        got = steps(blocks, optimizer, offloader)
        check_compression([offloader], compress)
    got += [p.detach().clone() for b in blocks for p in b.parameters()]  # after close
    assert_same(expected, got, f"{step_on} compress={compress}")


def test_the_one_line_takes_compress_too():
    reference, model = build("flux", dtype=torch.bfloat16), build("flux", dtype=torch.bfloat16)
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    # Less than the model, more than the smallest that fits with each list's two decode buffers.
    budget = sum(p.numel() * p.element_size() for p in model.parameters()) * 17 // 20
    with blockswap.offload(model, device_budget=budget, device="cpu",
                           compress="on") as handle:
        got = infer(model, "flux", dtype=torch.bfloat16)
        assert sum(o.compression()["blocks"] for o in handle.offloaders.values()) > 0
    assert torch.equal(got, expected)


def test_frozen_tensors_off_the_device_are_empty_until_close():
    model = build("flux", dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    offloaders = swap(model, "flux", 2, supports_backward=False, compress=True)
    infer(model, "flux", offloaders, dtype=torch.bfloat16)
    blocks = model.transformer_blocks
    evicted = [i for i in range(len(blocks)) if not offloaders[0].is_resident(i)]
    assert evicted
    frozen = [p for p in blocks[evicted[0]].parameters() if not p.requires_grad]
    assert frozen and all(p.numel() == 0 for p in frozen)
    for o in offloaders:
        o.close()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


@pytest.mark.parametrize("supports_backward", [False, True])
def test_copies_pickles_and_state_dicts_hold_the_true_weights(supports_backward):
    """Note [copies of compressed blocks]: copy.deepcopy (an EMA copy), torch.save of the model
    and state_dict() while offloaded give the true frozen weights, though the live tensors of a
    block off the device have no elements; the copies are plain modules that run exactly."""
    reference = build("flux", dtype=torch.bfloat16)
    model = copy.deepcopy(reference)
    if supports_backward:
        model.requires_grad_(False)
    offloaders = swap(model, "flux", 2, supports_backward=supports_backward, compress=True)
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    assert compressed_blocks(offloaders) > 0
    blocks = model.transformer_blocks
    assert any(p.numel() == 0 for p in blocks.parameters())  # the live tensors: no elements
    truth = reference.state_dict()

    def same(state):
        assert list(state) == list(truth)
        for key, value in truth.items():
            assert torch.equal(state[key], value), key

    same(model.state_dict())
    ema = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (ema, loaded):
        same(copied.state_dict())
        assert not any("__getstate__" in m.__dict__ for m in copied.modules())
        assert torch.equal(infer(copied, "flux", dtype=torch.bfloat16), expected)
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    for o in offloaders:
        o.close()
    assert not any("__getstate__" in m.__dict__ for m in model.modules())
    same(model.state_dict())


def test_values_compress_does_not_take_are_named():
    blocks = fine_tune_blocks()
    for bad in ("yes", 1):
        with pytest.raises(InvalidArgumentError, match="off.*on.*auto"):
            blockswap.ModelOffloader("blocks", blocks, len(blocks), 2, False,
                                     torch.device("cpu"), compress=bad)
    # auto: off until the planner says when it pays.
    with blockswap.ModelOffloader("blocks", blocks, len(blocks), 2, False, torch.device("cpu"),
                                  compress="auto") as offloader:
        assert offloader.compression()["blocks"] == 0
