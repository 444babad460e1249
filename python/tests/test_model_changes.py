"""The model changes under the offloader, as the trainers change it (DESIGN.md traps 10 and 11):
frozen after prepare (musubi-tuner's generate scripts), Parameters replaced with
load_state_dict(assign=True) without a prepare (Wan 2.2's experts; K = N-1 included), an
output nobody uses, fullgraph compilation, and block swap enabled a second time. Each is exact
against the same blocks without blockswap, with bytes moved, or raises blockswap's own error."""

import warnings

import pytest
import torch

import blockswap
from conftest import DIM, assert_bitwise, lora_parameters, make_blocks, run_blocks, train, twin

N = 5


def infer(blocks, x, offloader=None):
    with torch.no_grad():
        return run_blocks(blocks, x, offloader)


def musubi_forward(blocks, x, offloader=None):
    """musubi-tuner's loop: no prepare in it (the trainer prepares once, after loading)."""
    for i, block in enumerate(blocks):
        if offloader is not None:
            offloader.wait_for_block(i)
        x = block(x)
        if offloader is not None:
            offloader.submit_move_blocks_forward(blocks, i)
    return x


@pytest.mark.parametrize("k", [1, 3, N - 1])
def test_a_model_frozen_after_prepare_swaps_from_its_first_pass(cpu, k):
    """musubi-tuner's generate scripts: enable block swap and prepare while every weight still
    requires grad, then requires_grad_(False) and generate."""
    blocks = make_blocks(N)
    reference = twin(blocks)
    for block in blocks:
        block.requires_grad_(True)  # as the loader leaves it
    offloader = blockswap.ModelOffloader("blocks", blocks, N, k, False, cpu, False)
    offloader.prepare_block_devices_before_forward(blocks)
    for block in blocks:
        block.requires_grad_(False)
    x = torch.randn(2, 3, DIM)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # frozen when the blocks run: no "nothing swaps" warning
        with torch.no_grad():
            for _ in range(2):
                got = musubi_forward(blocks, x, offloader)
                assert torch.equal(got, musubi_forward(reference, x))
                assert not all(offloader.is_resident(i) for i in range(N))
    assert offloader.stats()["h2d_bytes"] > 0
    offloader.close()


def test_blocks_still_trainable_when_they_run_warn_that_nothing_swaps(cpu):
    blocks = make_blocks(4)
    for block in blocks:
        block.requires_grad_(True)  # as from_pretrained leaves a model
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, True, cpu, False)
    offloader.prepare_block_devices_before_forward()
    with pytest.warns(UserWarning, match="require grad and stay on the device"):
        infer(blocks, torch.randn(1, DIM), offloader)
    offloader.close()


def expert_training(blocks, experts, offloader=None, k=None):
    """musubi-tuner's Wan 2.2 training: prepare once, then before each step the expert that the
    timestep asks for is put in with load_state_dict(assign=True) (the other kept as a state
    dict), never a prepare again. Every loss, gradient and the adapters at the end."""
    model = torch.nn.ModuleList(blocks)
    params = lora_parameters(blocks)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    inactive = {name: t for name, t in experts.items() if name in frozen}
    if offloader is not None:
        offloader.prepare_block_devices_before_forward(blocks)
    torch.manual_seed(3)
    x0 = torch.randn(2, 3, DIM)
    seen = []
    for step, high in enumerate([True, True, False, True, False, False]):
        if step == 0 or high != previous:  # swap_high_low_weights
            active = {n: t for n, t in model.state_dict().items() if n in frozen}
            model.load_state_dict(inactive, strict=False, assign=True)
            inactive = active
        previous = high
        x = x0.clone().requires_grad_(True)
        loss = musubi_forward(blocks, x, offloader).pow(2).mean()
        loss.backward()
        seen += [loss.detach(), x.grad] + [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
        if offloader is not None:
            assert offloader.stats()["h2d_bytes"] > 0
            offloader.reset_stats()
    return seen + [p.detach().clone() for p in params]


@pytest.mark.parametrize("k", [1, 2, N - 1])
def test_experts_switched_by_assign_train_exactly_without_a_prepare(cpu, k):
    blocks = make_blocks(N)
    experts = torch.nn.ModuleList(make_blocks(N, seed=99)).state_dict()
    reference = twin(blocks)
    expected = expert_training(reference, experts)
    offloader = blockswap.ModelOffloader("wan_attn_block", blocks, N, k, True, cpu, False)
    assert_bitwise(expected, expert_training(blocks, experts, offloader))
    offloader.close()


def test_parameters_replaced_in_the_middle_of_a_pass_raise(cpu):
    blocks = make_blocks(N)
    other = make_blocks(N, seed=5)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, cpu, False) as offloader:
        offloader.prepare_block_devices_before_forward()
        with torch.no_grad():
            offloader.wait_for_block(0)
            blocks[0](torch.randn(1, DIM))
            offloader.submit_move_blocks_forward(0)
            blocks[1].load_state_dict(other[1].state_dict(), assign=True)
            with pytest.raises(blockswap.Error, match="in the middle of a pass"):
                offloader.wait_for_block(1)


class TwoStreams(torch.nn.Module):
    """A joint block (Qwen-Image, FLUX): an image stream and a text stream, each with an
    adapter; the last block's text output is discarded by the model."""

    def __init__(self):
        super().__init__()
        self.img = torch.nn.Linear(DIM, DIM)
        self.txt = torch.nn.Linear(DIM, DIM)
        self.requires_grad_(False)
        self.img_lora = torch.nn.Parameter(torch.randn(DIM, DIM) * 0.01)
        self.txt_lora = torch.nn.Parameter(torch.randn(DIM, DIM) * 0.01)

    def forward(self, img, txt):
        img = torch.tanh(self.img(img) + img @ self.img_lora) + txt.mean()  # the joint part
        txt = torch.tanh(self.txt(txt) + txt @ self.txt_lora)  # reaches only the next block
        return txt, img


def two_stream_training(blocks, offloader=None, hook=False):
    params = lora_parameters(blocks)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    torch.manual_seed(4)
    img0, txt0 = torch.randn(2, DIM), torch.randn(3, DIM)
    seen = []
    for _ in range(3):
        if offloader is not None:
            offloader.prepare_block_devices_before_forward()
        img, txt = img0, txt0
        for i, block in enumerate(blocks):
            if offloader is not None and not hook:
                offloader.wait_for_block(i)
            txt, img = block(img, txt)
            if offloader is not None and not hook:
                offloader.submit_move_blocks_forward(i)
        img.pow(2).mean().backward()  # the last text output reaches no loss
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        seen.append(grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen, [p.detach().clone() for p in params]


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_an_output_nobody_uses_leaves_its_parameters_without_a_gradient(cpu, k, hook):
    torch.manual_seed(0)
    blocks = [TwoStreams() for _ in range(4)]
    reference = twin(blocks)
    expected_grads, expected_params = two_stream_training(reference)
    assert expected_grads[0][-1] is None  # the last block's txt_lora: no gradient at all
    with blockswap.ModelOffloader("transformer_blocks", blocks, 4, k, True, cpu, False,
                                  hook_blocks=hook) as offloader:
        grads, params = two_stream_training(blocks, offloader, hook)
        for step, (want, got) in enumerate(zip(expected_grads, grads)):
            assert [g is None for g in want] == [g is None for g in got], step
            assert_bitwise([g for g in want if g is not None], [g for g in got if g is not None])
        assert_bitwise(expected_params, params)
        if k:
            assert offloader.stats()["h2d_bytes"] > 0


@pytest.mark.parametrize("how", ["module", "torch.compile"])
def test_fullgraph_compilation_raises_blockswaps_own_error(cpu, how):
    blocks = make_blocks(4)
    offloader = blockswap.ModelOffloader("blocks", blocks, 4, 2, False, cpu, False)
    if how == "module":  # diffusers' compile_repeated_blocks(fullgraph=True) does this per block
        for block in blocks:
            block.compile(fullgraph=True, backend="eager")
        with pytest.raises(blockswap.InvalidArgumentError, match="fullgraph=False"):
            offloader.prepare_block_devices_before_forward()
    else:  # musubi-tuner's --compile_fullgraph puts compiled blocks in the model's list
        offloader.prepare_block_devices_before_forward()
        compiled = [torch.compile(b, fullgraph=True, backend="eager") for b in blocks]
        with pytest.raises(blockswap.InvalidArgumentError, match="fullgraph=False"):
            offloader.prepare_block_devices_before_forward(compiled)
    offloader.close()


def test_block_swap_enabled_again_takes_the_blocks_over(cpu):
    """musubi-tuner's enable_block_swap(k) builds a new offloader over the same blocks while the
    old one still exists (it has no close())."""
    blocks = make_blocks(N)
    reference = twin(blocks)
    expected = train(reference)
    old = blockswap.ModelOffloader("blocks", blocks, N, 2, True, cpu, False)
    old.prepare_block_devices_before_forward()
    with pytest.warns(UserWarning, match="takes them over"):
        new = blockswap.ModelOffloader("blocks", blocks, N, 3, True, cpu, False)
    with pytest.raises(blockswap.Error, match="after close"):
        old.wait_for_block(0)
    assert_bitwise(expected, train(blocks, offloader=new))
    assert new.stats()["h2d_bytes"] > 0
    new.close()


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_a_kept_state_dict_keeps_each_blocks_weights_while_passes_run(cpu, k, training):
    """A state_dict taken while blocks are on the device and kept (musubi-tuner keeps the
    inactive expert's) reads each block's own weights after more passes, whichever block a
    slot holds by then (Note [kept state dicts])."""
    blocks = make_blocks(N)
    model = torch.nn.ModuleList(blocks)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    expected = {name: t.clone() for name, t in model.state_dict().items() if name in frozen}
    with blockswap.ModelOffloader("blocks", blocks, N, k, True, cpu, False) as offloader:
        offloader.set_forward_only(not training)
        offloader.prepare_block_devices_before_forward()
        kept = model.state_dict()
        for _ in range(3):
            if training:
                train(blocks, steps=1, offloader=offloader)
            else:
                infer(blocks, torch.randn(2, DIM), offloader)
            for name in frozen:  # the adapters train, with blockswap or without
                assert torch.equal(kept[name], expected[name]), name
        assert offloader.stats()["h2d_bytes"] > 0


@pytest.mark.parametrize("s, b", [(1, 2), (2, 2), (3, 1), (4, 2)])
def test_lora_stream_offloaders_keywords_swap_at_every_ring_size(cpu, s, b):
    """musubi-tuner's LoRAStreamOffloader(type, blocks, N, S, backward, device, ring_size=B,
    use_pinned_memory=..., debug=...): a ring as large as S still streams (the trainer leaves
    the blocks on the host until prepare places them)."""
    blocks = make_blocks(N)
    reference = twin(blocks)
    offloader = blockswap.ModelOffloader("blocks", blocks, N, s, True, cpu, ring_size=b,
                                         use_pinned_memory=True, debug=False)
    assert offloader.blocks_to_swap == max(1, s - b)
    assert_bitwise(train(reference), train(blocks, offloader=offloader))
    assert offloader.stats()["h2d_bytes"] > 0
    offloader.set_forward_only(True)
    x = torch.randn(2, 3, DIM)
    assert torch.equal(infer(reference, x), infer(blocks, x, offloader))
    offloader.close()


def test_freezing_between_forward_and_a_checkpointed_backward_is_exact(cpu):
    """A parameter frozen after the forward, before a backward that recomputes the blocks
    (non-reentrant checkpointing around the verbs, as diffusion-pipe's layers): the recompute
    runs as the forward did; the next pass takes the new split."""
    def step(blocks, offloader=None):
        torch.manual_seed(5)
        x = torch.randn(2, 3, DIM, requires_grad=True)
        out = run_blocks(blocks, x, offloader, checkpointing="non-reentrant")
        blocks[3].fc2.bias.requires_grad_(False)  # saves nothing for backward either way
        out.pow(2).mean().backward()
        grads = [x.grad] + [p.grad for b in blocks for p in (b.lora_a, b.lora_b, b.fc2.bias)]
        out2 = infer(blocks, x.detach(), offloader)
        return grads, out2

    blocks = make_blocks(N)
    blocks[3].fc2.bias.requires_grad_(True)  # trainable when the offloader is built
    reference = twin(blocks)
    want, want_out = step(reference)
    assert want[-4] is None  # block 3's bias, frozen before the backward: no gradient
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, cpu, False) as offloader:
        got, got_out = step(blocks, offloader)
        assert [g is None for g in want] == [g is None for g in got]
        assert_bitwise([g for g in want if g is not None], [g for g in got if g is not None])
        assert torch.equal(want_out, got_out)
        assert offloader.stats()["h2d_bytes"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_a_state_dict_after_weights_are_loaded_in_place_reads_the_new_weights(cpu, k):
    """load_state_dict (copy_, not assign) into a running offloader's blocks, then state_dict():
    the new values, on the device or off it (Note [kept state dicts])."""
    blocks = make_blocks(N)
    model = torch.nn.ModuleList(blocks)
    new = torch.nn.ModuleList(make_blocks(N, seed=42)).state_dict()
    with blockswap.ModelOffloader("blocks", blocks, N, k, False, cpu, False) as offloader:
        x = torch.randn(2, DIM)
        infer(blocks, x, offloader)
        offloader.prepare_block_devices_before_forward()
        model.load_state_dict(new)
        got = model.state_dict()
        for name, value in new.items():
            assert torch.equal(got[name], value), name
        assert torch.equal(infer(blocks, x, offloader), infer(make_blocks(N, seed=42), x))
