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



def evicted_block(model, offloaders):
    blocks = model.transformer_blocks
    evicted = [i for i in range(len(blocks)) if not offloaders[0].is_resident(i)]
    assert evicted
    return blocks[evicted[0]]


def test_writes_into_compressed_weights_off_the_device_raise_and_the_model_runs_on():
    """Note [changed compressed weights]: an in-place write into a frozen tensor with no
    elements (off the device) did nothing: the next pass says so, naming what to do, and the
    passes after it run with the true weights, never the half-written model."""
    reference, model = build("flux", dtype=torch.bfloat16), build("flux", dtype=torch.bfloat16)
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=False, compress=True)
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    block = evicted_block(model, offloaders)
    weight = next(p for n, p in block.named_parameters()
                  if n.endswith("weight") and not p.requires_grad)
    assert weight.numel() == 0
    with torch.no_grad():
        weight.mul_(0.5)
    with pytest.raises(blockswap.Error, match="written in place while their blocks were off "
                                              "the device.*compress='off'"):
        infer(model, "flux", offloaders, dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    with pytest.raises(RuntimeError):  # copy_ of a whole tensor: torch's own error, at once
        with torch.no_grad():
            weight.copy_(torch.ones(3, 4, dtype=torch.bfloat16))
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    # Values computed from the tensor with no elements (an outside tester's find: it was taken
    # as no change, silently): the same error, then the true weights.
    weight = next(p for n, p in evicted_block(model, offloaders).named_parameters()
                  if n.endswith("weight") and not p.requires_grad)
    assert weight.numel() == 0
    weight.data = weight.data * 0.5
    with pytest.raises(blockswap.Error, match=r"given values computed from them"):
        infer(model, "flux", offloaders, dtype=torch.bfloat16)
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    for o in offloaders:
        o.close()


@pytest.mark.parametrize("supports_backward", [False, True])
def test_assigned_compressed_weights_are_encoded_again_exactly(supports_backward):
    """param.data = new (or any rebinding to a tensor of the shape) between passes: the block's
    frozen bytes are encoded again; the passes use the new values, as without blockswap."""
    reference, model = build("flux", dtype=torch.bfloat16), build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=supports_backward, compress=True)
    infer(model, "flux", offloaders, dtype=torch.bfloat16)
    block = evicted_block(model, offloaders)
    index = list(model.transformer_blocks).index(block)
    truth = dict(reference.transformer_blocks[index].named_parameters())
    names = [n for n, p in block.named_parameters() if not p.requires_grad and truth[n].dim() == 2]
    target = truth[names[0]]
    with torch.no_grad():
        target.mul_(0.5)
    dict(block.named_parameters())[names[0]].data = target.detach().clone()
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    assert compressed_blocks(offloaders) > 0
    truth = reference.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, truth[key]), key
    for o in offloaders:
        o.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, truth[key]), key


@pytest.mark.parametrize("supports_backward", [False, True])
def test_writes_into_a_state_dict_of_compressed_blocks_are_the_weights(supports_backward):
    """Note [writes into a state dict of compressed blocks]: a state dict's entries of blocks
    off the device are copies of their true values; written in place (an EMA loaded into the
    model through its state dict, a weight scaled there), they are the weights from the next
    pass on, as the views a state dict holds without compression are (an outside tester found
    such writes lost)."""
    reference, model = build("flux", dtype=torch.bfloat16), build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=supports_backward, compress=True)
    infer(model, "flux", offloaders, dtype=torch.bfloat16)
    index = list(model.transformer_blocks).index(evicted_block(model, offloaders))
    prefix = f"transformer_blocks.{index}."
    sd, truth = model.state_dict(), reference.state_dict()
    keys = [k for k in sd if k.startswith(prefix) and k.endswith("weight") and sd[k].dim() == 2
            and "lora" not in k]
    assert keys and all(sd[k].numel() > 0 for k in keys)
    with torch.no_grad():
        sd[keys[0]].mul_(0.5)
        truth[keys[0]].mul_(0.5)
        sd[keys[1]].copy_(truth[keys[1]] + 1)
        truth[keys[1]].add_(1)
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    assert compressed_blocks(offloaders) > 0
    for o in offloaders:
        o.close()
    for key, value in model.state_dict().items():
        assert torch.equal(value, truth[key]), key


@pytest.mark.parametrize("strict,assign", [(True, False), (False, False), (True, True)])
def test_load_state_dict_while_compressed_loads_every_block(strict, assign):
    """Note [loading compressed blocks]: model.load_state_dict(checkpoint) while offloaded with
    compression loads the frozen weights of the blocks off the device too, exactly, and they
    are compressed again."""
    checkpoint = build("flux", seed=3, dtype=torch.bfloat16)
    expected = infer(checkpoint, "flux", dtype=torch.bfloat16)
    model = build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=False, compress=True)
    infer(model, "flux", offloaders, dtype=torch.bfloat16)
    blocks = compressed_blocks(offloaders)
    model.load_state_dict(checkpoint.state_dict(), strict=strict, assign=assign)
    if not assign:  # assign=True: the new Parameters are taken at the next pass
        assert any(p.numel() == 0 for p in model.transformer_blocks.parameters())
        assert compressed_blocks(offloaders) == blocks
    for _ in range(2):
        assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    truth = checkpoint.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, truth[key]), key
    for o in offloaders:
        o.close()


def test_loading_the_same_weights_again_encodes_no_block():
    """A checkpoint resumed from the weights the model was built with leaves every compressed
    block as it is (compression()["encoded_again"] counts the blocks encoded again); one weight
    changed encodes its block alone, once, exactly."""
    reference = build("flux", dtype=torch.bfloat16)
    model = build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=False, compress=True)
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    assert compressed_blocks(offloaders) > 0
    encoded = lambda: sum(o.compression()["encoded_again"] for o in offloaders)  # noqa: E731
    model.load_state_dict(reference.state_dict())
    for _ in range(2):
        assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    assert encoded() == 0
    key = next(k for k, v in reference.state_dict().items()
               if k.startswith("transformer_blocks.1.") and v.dim() == 2 and "lora" not in k)
    with torch.no_grad():
        reference.state_dict()[key].mul_(0.5)
    model.load_state_dict(reference.state_dict())
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    for _ in range(2):
        assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    assert encoded() == 1
    for o in offloaders:
        o.close()


@pytest.mark.parametrize("flag", [False, True])
def test_a_checkpoint_around_the_whole_model_raises_never_a_wrong_result(flag):
    """checkpoint(model, use_reentrant=False) over several compressed blocks: without
    reentrant_activation_checkpointing blockswap refuses the recompute's second forward; with it
    the recompute sees frozen tensors off the device with no elements, and torch refuses it
    (docs/guide.md, "Compressed weights")."""
    import torch.utils.checkpoint as checkpoint
    model = build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, reentrant=flag, compress=True)
    args = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs("flux", seed=1).items()}
    prepare(offloaders)
    expected = checkpoint.CheckpointError if flag else blockswap.Error
    with pytest.raises(expected, match="metadata" if flag else "forward a second time"):
        out = checkpoint.checkpoint(lambda **a: model(**a, return_dict=False)[0],
                                    use_reentrant=False, **args)
        out.float().pow(2).mean().backward()
    for o in offloaders:
        o.close()


def test_peft_merge_while_compressed_is_peft_s():
    """peft's merge_adapter / unmerge_adapter on compressed blocks (Note [peft merges]): the
    merged sample is peft's without blockswap, and the unmerge gives the base weights back."""
    pytest.importorskip("peft")
    from test_peft import merge, unmerge

    from real_models import base_weights

    reference, model = build("flux"), build("flux")
    originals = base_weights(model, "flux")  # (the model's own proj_out is not swapped)
    offloaders = swap(model, "flux", 2, compress=True)
    train(reference, "flux", steps=1)
    train(model, "flux", offloaders, steps=1)
    assert compressed_blocks(offloaders) > 0
    merge(reference)
    merge(model)
    for seed in (1, 2):
        assert torch.equal(infer(reference, "flux", seed=seed), infer(model, "flux", offloaders,
                                                                     seed=seed))
    unmerge(model)
    assert compressed_blocks(offloaders) > 0
    infer(model, "flux", offloaders)  # a pass: the unmerged weights encoded again
    for o in offloaders:
        o.close()
    now = base_weights(model, "flux")
    assert all(torch.equal(originals[name], now[name]) for name in originals)


def test_compressed_sizes_are_the_same_from_build_to_build():
    """Note [padding bytes]: the bytes between a block's tensors are zeroed before they are
    encoded, so the compressed sizes do not depend on what the allocator left there (here: host
    memory written with a pattern and freed before each build)."""
    sizes = []
    for pattern in (0x00, 0x5A, 0xC3):
        garbage = [torch.full((n,), pattern, dtype=torch.uint8)
                   for n in (1 << 12, 1 << 14, 1 << 16, 1 << 18) for _ in range(16)]
        del garbage
        model = build("flux", dtype=torch.bfloat16)
        offloaders = swap(model, "flux", 2, supports_backward=False, compress=True)
        sizes.append([(o.compression()["compressed_bytes"], o.compression()["blocks"])
                      for o in offloaders])
        for o in offloaders:
            o.close()
    assert sizes[0][0][1] > 0
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0]


def test_device_bytes_count_the_decode_buffer():
    """stats()["device_bytes"] is the device memory the offloader holds: its slots and, with
    compression, the decode buffer."""
    got = {}
    for compress in ("off", "on"):
        model = build("flux", dtype=torch.bfloat16)
        offloaders = swap(model, "flux", 2, supports_backward=False, compress=compress)
        infer(model, "flux", offloaders, dtype=torch.bfloat16)
        got[compress] = [(o.stats()["device_bytes"], o.stats()["peak_device_bytes"],
                          o.compression()["decode_buffer_bytes"]) for o in offloaders]
        for o in offloaders:
            o.close()
    for (off, peak_off, _), (on, peak_on, decode) in zip(got["off"], got["on"]):
        assert decode > 0
        assert on == off + decode and peak_on == peak_off + decode


def test_auto_is_off_where_nothing_says_it_pays_and_says_why():
    """Note [automatic compression]: with host memory to spare (this machine, a small model) and
    no step time known, auto is off; with weights of a dtype that does not compress it is off
    for that; the choice and its reason are in stats() and compression()."""
    model = build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=False, compress="auto")
    for o in offloaders:
        stats = o.stats()
        assert stats["compression"] == "off" and not o.compression()["on"]
        assert "host memory suffices" in stats["compression_reason"]
        assert o.compression()["blocks"] == 0
        o.close()
    model = build("flux", dtype=torch.float64)
    offloaders = swap(model, "flux", 2, supports_backward=False, compress="auto")
    for o in offloaders:
        assert o.stats()["compression"] == "off"
        assert "not of a dtype that compresses" in o.stats()["compression_reason"]
        o.close()
    model = build("flux", dtype=torch.bfloat16)
    offloaders = swap(model, "flux", 2, supports_backward=False, compress="on")
    assert all(o.stats()["compression"] == "on" for o in offloaders)
    assert all(o.stats()["compression_reason"] == "compress='on'" for o in offloaders)
    for o in offloaders:
        o.close()


def test_auto_is_on_where_host_memory_is_short(tmp_path):
    """Note [automatic compression]: a host budget under the blocks' raw bytes (the file tier
    holds the rest) is host memory short: auto compresses the blocks in host memory, exactly."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    reference = build("flux", dtype=torch.bfloat16, lora=False)
    path = tmp_path / "flux.safetensors"
    safetensors_torch.save_file(reference.state_dict(), str(path))
    expected = infer(reference, "flux", dtype=torch.bfloat16)
    model = build("flux", dtype=torch.bfloat16, lora=False)
    budget = min(sum(p.numel() * p.element_size() for p in getattr(model, name).parameters())
                 for name in ("transformer_blocks", "single_transformer_blocks")) // 2
    offloaders = swap(model, "flux", 2, supports_backward=False, compress="auto",
                      weights_file=str(path), host_budget_bytes=budget)
    assert all(o.stats()["compression"] == "on" for o in offloaders)
    assert all("host memory is short" in o.stats()["compression_reason"] for o in offloaders)
    assert torch.equal(infer(model, "flux", offloaders, dtype=torch.bfloat16), expected)
    for o in offloaders:
        o.close()
