"""The offloader's life as trainers live it: dropped without close(), a managed model deep-copied
(an EMA) or saved whole, cast with model.to(dtype) or moved, a verb called twice, help()."""

import copy
import gc
import inspect
import io
import weakref

import pytest
import torch

import blockswap
from conftest import DIM, assert_bitwise, make_blocks, run_blocks, train, twin
from real_models import build, infer, swap
from real_models import train as train_model


def forward(blocks, x, offloader=None):
    with torch.no_grad():
        return run_blocks(blocks, x, offloader)


def test_del_without_close_frees_it_and_the_blocks_run_plain_or_with_a_new_one(cpu):
    blocks = make_blocks(6)
    reference = twin(blocks)
    offloader = blockswap.ModelOffloader("blocks", blocks, 6, 3, True, cpu, False)
    train(blocks, steps=1, offloader=offloader)
    train(reference, steps=1)
    gone = weakref.ref(offloader)
    del offloader
    gc.collect()
    assert gone() is None
    x = torch.randn(2, 5, DIM)
    assert torch.equal(forward(reference, x), forward(blocks, x))  # plain, true weights
    with blockswap.ModelOffloader("blocks", blocks, 6, 2, True, cpu, False) as again:
        assert_bitwise(train(reference), train(blocks, offloader=again))


def test_a_deep_copy_is_a_plain_model_with_the_true_weights():
    kind = "flux"
    reference, model = build(kind), build(kind)
    offloaders = swap(model, kind, 2)
    train_model(reference, kind, steps=2)
    train_model(model, kind, offloaders, steps=2)
    ema = copy.deepcopy(model)  # blocks 0 and 1 are off the device now
    assert torch.equal(infer(reference, kind), infer(ema, kind))
    for p in ema.parameters():  # independent of the swapped model's memory
        assert all(p.data_ptr() != q.data_ptr() for q in model.parameters() if q.numel())
    # The copy's hooks are inert; the swapped model trains on, exactly.
    assert train_model(reference, kind, steps=1)[0] == train_model(model, kind, offloaders,
                                                                    steps=1)[0]
    assert all(o.stats()["moves"] > 0 for o in offloaders)


def test_torch_save_of_the_whole_model_loads_as_a_plain_model():
    kind = "wan"
    reference, model = build(kind), build(kind)
    offloaders = swap(model, kind, 2)
    infer(model, kind, offloaders)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(infer(reference, kind), infer(loaded, kind))
    assert torch.equal(infer(reference, kind), infer(model, kind, offloaders))


@pytest.mark.parametrize("training", [False, True])
def test_model_to_dtype_casts_everything_and_swapping_goes_on(training):
    kind = "qwen"
    reference, model = build(kind), build(kind)
    offloaders = swap(model, kind, 2, supports_backward=training)
    infer(model, kind, offloaders)
    for m in (reference, model):
        m.to(torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}  # nothing half cast
    x = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
         for k, v in __import__("real_models").inputs(kind).items()}
    with torch.no_grad():
        for o in offloaders:
            o.prepare_block_devices_before_forward()  # built again over the cast blocks
        assert torch.equal(reference(**x, return_dict=False)[0], model(**x, return_dict=False)[0])
    assert all(o.stats()["h2d_bytes"] > 0 and o.blocks_to_swap == 2 for o in offloaders)


def test_a_move_leaves_the_swapped_weights_to_the_schedule(cpu):
    blocks = make_blocks(4)
    model = torch.nn.Sequential(*blocks)
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, True, cpu, False)
    names = [n for n, _ in model.named_parameters()]
    model.to("cpu")
    assert [n for n, _ in model.named_parameters()] == names  # order kept
    assert offloader._active
    offloader.close()


def test_a_cast_with_a_fused_optimizer_is_refused_before_the_block_changes(cpu):
    blocks = make_blocks(4)
    for block in blocks:
        block.requires_grad_(True)
    optimizer = blockswap.FusedAdamW([p for b in blocks for p in b.parameters()], lr=1e-3)
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, True, cpu, False,
                                         optimizer=optimizer)
    with pytest.raises(blockswap.InvalidArgumentError, match="cast.*fused optimizer"):
        torch.nn.Sequential(*blocks).to(torch.float64)
    assert all(p.dtype == torch.float32 for p in blocks[0].parameters())
    offloader.close()


def test_a_second_submit_of_a_block_says_so_in_python_words(cpu):
    blocks = make_blocks(4, lora=False)
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, False, cpu, False)
    offloader.prepare_block_devices_before_forward()
    with torch.no_grad():
        offloader.wait_for_block(0)
        blocks[0](torch.randn(1, DIM))
        offloader.submit_move_blocks_forward(0)
        with pytest.raises(blockswap.Error,
                           match=r"submit_move_blocks_forward\(0\) was called again"):
            offloader.submit_move_blocks_forward(0)
    # The mistake leaves the offloader usable: the next pass, after a prepare, is exact.
    reference = make_blocks(4, lora=False)
    x = torch.randn(2, 5, DIM)
    assert torch.equal(forward(reference, x), forward(blocks, x, offloader))
    offloader.close()


def test_help_documents_every_argument_and_verb():
    doc = inspect.getdoc(blockswap.ModelOffloader)
    for name in inspect.signature(blockswap.ModelOffloader.__init__).parameters:
        if name != "self":
            assert f"``{name}``" in doc or name in doc.split("``")[0], name
    for name, member in inspect.getmembers(blockswap.ModelOffloader):
        if not name.startswith("_") and callable(member):
            assert inspect.getdoc(member), f"{name} has no docstring"


def test_parameters_replaced_by_load_state_dict_assign_are_taken_at_the_next_pass():
    """musubi-tuner switches Wan 2.2's experts with load_state_dict(assign=True)."""
    kind = "wan"
    high, low = build(kind, seed=0), build(kind, seed=5)
    model = build(kind, seed=0)
    offloaders = swap(model, kind, 2, supports_backward=False)
    assert torch.equal(infer(high, kind), infer(model, kind, offloaders))
    model.load_state_dict(low.state_dict(), assign=True)
    assert torch.equal(infer(low, kind), infer(model, kind, offloaders))  # prepare takes them
    assert offloaders[0].stats()["h2d_bytes"] > 0
    # Without a prepare in between: the first block's wait takes them.
    model.load_state_dict(high.state_dict(), assign=True)
    with torch.no_grad():
        got = model(**__import__("real_models").inputs(kind), return_dict=False)[0]
    assert torch.equal(infer(high, kind), got)
    assert offloaders[0].stats()["h2d_bytes"] > 0
    offloaders[0].close()


def test_verbs_after_close_say_so_and_index_mistakes_are_named(cpu):
    blocks = make_blocks(4)
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, True, cpu, False)
    for wrong in (4, 100, -1):
        with pytest.raises(blockswap.Error, match="out of range"):
            offloader.wait_for_block(wrong)
    offloader.prepare_block_devices_before_forward()
    with torch.no_grad():
        offloader.wait_for_block(0)
        blocks[0](torch.randn(1, DIM))
        with pytest.raises(blockswap.InvalidArgumentError, match="not the blocks"):
            offloader.submit_move_blocks_forward(list(reversed(blocks)), 0)
        offloader.submit_move_blocks_forward(blocks, 0)
    offloader.close()
    for verb in (offloader.prepare_block_devices_before_forward,
                 lambda: offloader.wait_for_block(0),
                 lambda: offloader.submit_move_blocks_forward(0)):
        with pytest.raises(blockswap.Error, match="after close"):
            verb()


def test_an_inference_offloader_trains_exactly_when_a_backward_comes(cpu):
    blocks = make_blocks(6)
    reference = twin(blocks)
    with blockswap.ModelOffloader("blocks", blocks, 6, 3, False, cpu, False) as offloader:
        assert_bitwise(train(reference), train(blocks, offloader=offloader))
