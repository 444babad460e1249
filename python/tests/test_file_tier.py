"""The file tier from Python: a diffusers model's frozen block weights read from its safetensors
file (weights_file=, host_budget_bytes=), both block lists of FLUX, at several K and host
budgets, loaded or built on the meta device; bitwise the model without blockswap; every failure
an error that loses nothing."""

import pytest
import torch

import blockswap
from real_models import (BLOCK_LISTS, assert_bitwise, build, checkpointing, infer, swap,
                         train)

safetensors_torch = pytest.importorskip("safetensors.torch")


def block_bytes(model, kind):
    """The packed bytes of the first block of each list (every block of a list is alike): its
    frozen tensors, each at a 256-byte boundary (blockswap/core/layout.hpp)."""
    return [sum(-(-p.numel() * p.element_size() // 256) * 256
                for p in getattr(model, name)[0].parameters() if not p.requires_grad)
            for name in BLOCK_LISTS[kind]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Each model's weights as the trainers find them: a safetensors file of its state dict."""
    out = {}
    for kind in ("flux", "wan"):
        path = tmp_path_factory.mktemp("weights") / f"{kind}.safetensors"
        model = build(kind, lora=False)
        safetensors_torch.save_file(model.state_dict(), str(path))
        out[kind] = str(path)
    return out


@pytest.mark.parametrize("kind", ["flux", "wan"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("budget_blocks", [0, 2, None])
def test_inference_from_the_file_is_bitwise(files, kind, k, budget_blocks):
    expected = [infer(build(kind), kind, seed=s) for s in (1, 2)]
    model = build(kind)
    budget = None if budget_blocks is None else budget_blocks * max(block_bytes(model, kind))
    offloaders = swap(model, kind, k, supports_backward=False, weights_file=files[kind],
                      host_budget_bytes=budget)
    assert_bitwise([infer(model, kind, offloaders, seed=s) for s in (1, 2)], expected)
    read = sum(o.stats()["disk_bytes"] for o in offloaders)
    in_file = sum(o.is_in_file(i) for o in offloaders for i in range(4))
    if budget_blocks == 0:
        assert read > 0 and in_file == 4 * len(offloaders)
    elif budget_blocks is None:
        assert read == 0 and in_file == 0
    else:  # two or more blocks of each list in host memory, the rest from the file
        assert 0 < in_file <= 2 * len(offloaders)


@pytest.mark.parametrize("file_reads", ["direct", "drop"])
def test_both_ways_of_reading_are_bitwise(files, file_reads):
    expected = train(build("flux"), "flux")
    model = build("flux")
    offloaders = swap(model, "flux", 2, weights_file=files["flux"], host_budget_bytes=0,
                      file_reads=file_reads)
    assert_bitwise(train(model, "flux", offloaders), expected)
    with pytest.raises(blockswap.InvalidArgumentError, match="file_reads must be"):
        swap(build("flux"), "flux", 2, weights_file=files["flux"], host_budget_bytes=0,
             file_reads="cached")


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("budget_blocks", [0, 2])
@pytest.mark.parametrize("ckpt", [None, "non_reentrant"])
def test_lora_training_from_the_file_is_bitwise(files, k, budget_blocks, ckpt):
    plain = build("flux")
    checkpointing(plain, ckpt)
    expected = train(plain, "flux")
    model = build("flux")
    checkpointing(model, ckpt)
    budget = budget_blocks * max(block_bytes(model, "flux"))
    offloaders = swap(model, "flux", k, weights_file=files["flux"], host_budget_bytes=budget)
    assert_bitwise(train(model, "flux", offloaders), expected)
    assert sum(o.stats()["disk_bytes"] for o in offloaders) > 0


@pytest.mark.parametrize("budget", [0, None])
def test_a_model_built_on_meta_is_loaded_from_the_file(files, budget):
    """accelerate's init_empty_weights, diffusers' low_cpu_mem_usage: the blocks' weights come
    from the file, without a second copy; the rest of the model is the caller's to load."""
    expected = infer(build("flux", lora=False), "flux")
    with torch.device("meta"):
        model = build("flux", lora=False)
    state = safetensors_torch.load_file(files["flux"])
    # (cloned: load_file's tensors may sit at unaligned addresses, where CPU kernels round
    # differently in the last bit)
    outside = {name: t.clone() for name, t in state.items()
               if not name.startswith(tuple(f"{n}." for n in BLOCK_LISTS["flux"]))}
    model.load_state_dict(outside, strict=False, assign=True)
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=files["flux"],
                      host_budget_bytes=budget)
    assert_bitwise(infer(model, "flux", offloaders), expected)
    for name, p in model.named_parameters():  # true values wherever a block is
        assert not p.is_meta, name
        assert torch.equal(p.detach(), state[name]), name


def test_weights_that_differ_from_the_file_are_refused(files):
    model = build("flux")
    with torch.no_grad():
        model.transformer_blocks[3].ff.net[2].weight[0, 0] += 1  # merged, or fine-tuned
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(blockswap.Error, match="ff.net.2.weight' of block 3 differs"):
        swap(model, "flux", 2, weights_file=files["flux"], host_budget_bytes=0)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_mistakes_are_named(files, tmp_path):
    model = build("flux")
    with pytest.raises(blockswap.InvalidArgumentError, match="host_budget_bytes needs weights_file"):
        swap(model, "flux", 2, host_budget_bytes=0)
    with pytest.raises(blockswap.InvalidArgumentError, match="host_budget_bytes"):
        swap(model, "flux", 2, weights_file=files["flux"], host_budget_bytes=-1)
    with pytest.raises(blockswap.InvalidArgumentError, match="are the file tier's"):
        swap(model, "flux", 2, weights_file=files["flux"], file_reads="drop")
    with pytest.raises(blockswap.Error, match="gone.safetensors"):
        swap(model, "flux", 2, weights_file=tmp_path / "gone.safetensors", host_budget_bytes=0)
    with pytest.raises(blockswap.Error, match="has no tensor 'blocks.0."):
        swap(model, "flux", 2, weights_file=files["flux"], weights_prefix="blocks.",
             host_budget_bytes=0)
    with pytest.raises(blockswap.Error, match="cast after loading"):
        swap(build("flux", dtype=torch.bfloat16), "flux", 2, weights_file=files["flux"],
             host_budget_bytes=0)
    with torch.device("meta"):
        half = build("flux", lora=False)
    half.transformer_blocks[1].to_empty(device="cpu")
    with pytest.raises(blockswap.InvalidArgumentError, match="some of the blocks' frozen weights"):
        swap(half, "flux", 2, weights_file=files["flux"], host_budget_bytes=0)
    # Nothing was left managed: the model still runs plain.
    assert_bitwise(infer(model, "flux"), infer(build("flux"), "flux"))


def test_writing_a_weight_read_from_the_file_raises_and_keeps_the_file(files):
    plain = build("flux")
    model = build("flux")
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=files["flux"],
                      host_budget_bytes=0)
    infer(model, "flux", offloaders)
    away = next(i for i in range(4) if not offloaders[0].is_resident(i))
    weight = model.transformer_blocks[away].ff.net[2].weight
    with torch.no_grad():
        weight.fill_(0)  # a checkpoint loaded into it
    with pytest.raises(blockswap.Error, match="cannot be kept"):
        infer(model, "flux", offloaders)
    # The weight is the file's again, and the offloader goes on, exactly.
    assert torch.equal(weight.detach(), plain.transformer_blocks[away].ff.net[2].weight)
    assert_bitwise(infer(model, "flux", offloaders), infer(plain, "flux"))
    for o in offloaders:
        o.close()  # true values (views of the file: compute on clones, docs/guide.md)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_a_failed_constructor_leaves_meta_blocks_meta(files):
    """All or nothing: blocks built on meta are meta again when the constructor fails, never
    empty tensors that would compute with garbage."""
    with torch.device("meta"):
        model = build("flux", lora=False)
    with pytest.raises(blockswap.OutOfMemoryError):
        blockswap.ModelOffloader("transformer_blocks", list(model.transformer_blocks), 4, 2, False,
                                 torch.device("cpu"), False, weights_file=files["flux"],
                                 host_budget_bytes=0, emulated_capacity_bytes=1000)
    assert all(p.is_meta for p in model.transformer_blocks.parameters())


@pytest.mark.parametrize("k", [0, 2])
def test_writing_a_block_that_never_moves_raises_at_the_next_pass(files, k):
    """A block read from the file that is on the device when written (K = 0: every block, for
    good) has no host copy to keep the write in either: the next pass raises, as for a block
    that moves, instead of computing with weights that close() would silently drop."""
    plain = build("flux")
    model = build("flux")
    offloaders = swap(model, "flux", k, supports_backward=False, weights_file=files["flux"],
                      host_budget_bytes=0)
    infer(model, "flux", offloaders)
    on = max(i for i in range(4) if offloaders[0].is_resident(i))
    assert offloaders[0].is_in_file(on)
    weight = model.transformer_blocks[on].ff.net[2].weight
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(blockswap.Error, match=f"'ff.net.2.weight' of block {on} were changed"):
        infer(model, "flux", offloaders)
    assert torch.equal(weight.detach().cpu(), plain.transformer_blocks[on].ff.net[2].weight)
    assert_bitwise(infer(model, "flux", offloaders), infer(plain, "flux"))
    for o in offloaders:
        o.close()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_k0_with_the_file_and_checkpointing_is_bitwise(files, ckpt):
    """K = 0 with weights_file (every block on the device, read from the file once), as the
    second list of FLUX often is, under diffusers' checkpointing."""
    plain = build("flux")
    checkpointing(plain, ckpt)
    expected = train(plain, "flux", reentrant_inputs=ckpt == "reentrant")
    model = build("flux")
    checkpointing(model, ckpt)
    offloaders = swap(model, "flux", 0, reentrant=ckpt == "reentrant",
                      weights_file=files["flux"], host_budget_bytes=0)
    assert_bitwise(train(model, "flux", offloaders, reentrant_inputs=ckpt == "reentrant"),
                   expected)


def test_a_checkpoint_of_the_same_weights_is_kept_and_other_writes_raise_once(files):
    """load_state_dict of the file's own values (a resumed checkpoint) changes nothing; writes of
    other values into many tensors raise once, and then the offloader goes on exactly."""
    plain = build("flux")
    model = build("flux")
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=files["flux"],
                      host_budget_bytes=0)
    infer(model, "flux", offloaders)
    model.load_state_dict(build("flux").state_dict())  # the same values, through copy_
    assert_bitwise(infer(model, "flux", offloaders), infer(plain, "flux"))
    with torch.no_grad():
        for p in model.transformer_blocks.parameters():
            if not p.requires_grad:
                p.mul_(2)
    with pytest.raises(blockswap.Error, match="and [0-9]+ more were changed"):
        infer(model, "flux", offloaders)
    assert_bitwise(infer(model, "flux", offloaders), infer(plain, "flux"))


def test_parameters_replaced_after_a_build_from_meta_are_the_new_ones(files, tmp_path):
    """musubi-tuner's expert switch (load_state_dict(assign=True)) on blocks first filled from
    the file: the next prepare takes the new Parameters' values, never the file's over them."""
    other = build("flux", seed=5, lora=False)
    expected = infer(other, "flux")
    with torch.device("meta"):
        model = build("flux", lora=False)
    state = safetensors_torch.load_file(files["flux"])
    blocks = tuple(f"{n}." for n in BLOCK_LISTS["flux"])
    model.load_state_dict({k: v.clone() for k, v in state.items() if not k.startswith(blocks)},
                          strict=False, assign=True)
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=files["flux"])
    infer(model, "flux", offloaders)
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    assert_bitwise(infer(model, "flux", offloaders), expected)


@pytest.mark.parametrize("how", ["delete", "replace", "rename"])
def test_a_file_deleted_or_renamed_under_the_run_keeps_the_weights(files, tmp_path, how):
    """The mapped file lives while it is mapped: deleted, or another file moved over its name,
    the run goes on exactly with the old contents; renamed, the reader's next read refuses it
    (changed since opened) with an error that says to build a new offloader.
    Either way the model's weights keep their values, during the run and after close()."""
    import os
    import shutil
    path = tmp_path / "model.safetensors"
    shutil.copy(files["flux"], path)
    expected = [infer(build("flux"), "flux", seed=s) for s in (1, 2, 3, 4)]
    model = build("flux")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    offloaders = swap(model, "flux", 2, supports_backward=False, weights_file=path,
                      host_budget_bytes=0)
    assert_bitwise(infer(model, "flux", offloaders, seed=1), expected[0])
    if how in ("delete", "replace"):
        if how == "delete":
            os.unlink(path)
        else:  # other weights under the same name
            other = tmp_path / "other.safetensors"
            safetensors_torch.save_file(build("flux", lora=False, seed=9).state_dict(),
                                        str(other))
            os.replace(other, path)
        assert_bitwise(infer(model, "flux", offloaders, seed=2), expected[1])
    else:
        os.rename(path, tmp_path / "moved.safetensors")
        # Blocks read ahead before the rename still run; the first read after it raises.
        with pytest.raises(blockswap.Error, match="build a new offloader"):
            for s in (2, 3, 4):
                assert_bitwise(infer(model, "flux", offloaders, seed=s), expected[s - 1])
    for o in offloaders:
        o.close()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_a_file_that_is_not_a_regular_file_is_named_at_once(files, tmp_path):
    import os
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # opening it to read would wait for a writer
    with pytest.raises(blockswap.Error, match="is not a regular file"):
        swap(build("flux"), "flux", 2, weights_file=fifo, host_budget_bytes=0)
