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
