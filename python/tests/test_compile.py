"""Blocks compiled with torch.compile while they swap, as the trainers do (each block compiled
on its own): the offloader's hooks and verbs are excluded from tracing (the graph breaks at
them) and training is bitwise the eager model's without blockswap. backend="eager" runs
dynamo's tracing and graph breaks without a code generator."""

import pytest
import torch

import blockswap
from conftest import DIM, assert_bitwise, lora_parameters, make_blocks, train, twin


def compiled_forward(blocks, offloader):
    compiled = [torch.compile(block, backend="eager") for block in blocks]

    def forward(x):
        offloader.prepare_block_devices_before_forward()
        for i, block in enumerate(compiled):
            offloader.wait_for_block(i)
            x = block(x)
            offloader.submit_move_blocks_forward(i)
        return x

    return forward


@pytest.mark.parametrize("k", [0, 2, 4])
def test_compiled_blocks_train_exactly_while_swapping(k):
    torch._dynamo.reset()
    blocks = make_blocks(6)
    reference = twin(blocks)
    expected = train(reference)
    with blockswap.ModelOffloader("blocks", blocks, 6, k, True, torch.device("cpu"),
                                  False) as offloader:
        got = train(blocks, forward=compiled_forward(blocks, offloader))
    assert_bitwise(expected, got)


def test_compiled_blocks_infer_exactly_while_swapping():
    torch._dynamo.reset()
    blocks = make_blocks(6, lora=False)
    reference = twin(blocks)
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        expected = x
        for block in reference:
            expected = block(expected)
        with blockswap.ModelOffloader("blocks", blocks, 6, 3, False, torch.device("cpu"),
                                      False) as offloader:
            got = compiled_forward(blocks, offloader)(x)
    assert torch.equal(expected, got)


# diffusers' model classes, compiled as the trainers compile them, through AOTAutograd
# (backend "aot_eager": dynamo's graphs and autograd's joint graph, without a code generator).

from real_models import BLOCK_LISTS, build, swap  # noqa: E402
from real_models import infer as infer_model  # noqa: E402
from real_models import train as train_model  # noqa: E402


class CountingBackend:
    """aot_eager, counting the graphs dynamo hands it: each one is a compilation."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_blocks_compiled_one_by_one_swap_exactly_and_never_recompile(kind):
    """musubi-tuner, sd-scripts, OneTrainer and diffusers' compile_repeated_blocks compile each
    block; swapping rebinds the blocks' tensors to other memory of the same size, stride and
    offset, so the graphs' guards hold: no recompilation after the first step."""
    torch._dynamo.reset()
    eager = build(kind)
    expected = train_model(eager, kind, steps=3) + [infer_model(eager, kind) for _ in range(2)]
    model = build(kind)
    backend = CountingBackend()
    for name in BLOCK_LISTS[kind]:
        for block in getattr(model, name):
            block.compile(backend=backend)
    offloaders = swap(model, kind, 2)
    graphs = []
    got = train_model(model, kind, offloaders, steps=3,
                      after_step=lambda step: graphs.append(backend.graphs))
    for o in offloaders:
        o.set_forward_only(True)
    got += [infer_model(model, kind, offloaders)]
    graphs.append(backend.graphs)
    got += [infer_model(model, kind, offloaders)]
    graphs.append(backend.graphs)
    for o in offloaders:
        o.close()
    torch._dynamo.reset()
    assert_bitwise(expected, got)
    assert graphs[0] > 0
    assert graphs[1:3] == [graphs[0]] * 2, f"swapping made dynamo recompile: {graphs}"
    assert graphs[4] == graphs[3], f"the second sample recompiled: {graphs}"


def test_the_whole_model_compiled_as_diffusion_pipe_does():
    """compile(dynamic=True) over the whole model: the offloader's hooks break the graph (they
    are excluded from tracing), the blocks compile between them."""
    torch._dynamo.reset()
    kind = "wan"
    eager = build(kind)
    expected = train_model(eager, kind, steps=2) + [infer_model(eager, kind)]
    model = build(kind)
    offloaders = swap(model, kind, 2)
    backend = CountingBackend()
    model.compile(dynamic=True, backend=backend)
    got = train_model(model, kind, offloaders, steps=2)
    for o in offloaders:
        o.set_forward_only(True)
    got += [infer_model(model, kind, offloaders)]
    for o in offloaders:
        o.close()
    torch._dynamo.reset()
    assert backend.graphs > 0
    assert_bitwise(expected, got)
