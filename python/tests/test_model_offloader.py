"""blockswap.ModelOffloader as the trainers use it: bitwise against the same model run
without an offloader (CPU, the emulated device)."""

import gc
import os

import pytest
import torch

import blockswap
from conftest import (DIM, Block, assert_bitwise, lora_parameters, make_blocks, run_blocks,
                      train, twin)

N = 6


def offloader(blocks, k, training=True, reentrant=False, **kwargs):
    return blockswap.ModelOffloader("blocks", blocks, len(blocks), k, training,
                                    torch.device("cpu"), reentrant, **kwargs)


@pytest.mark.parametrize("k", range(N))
def test_inference_is_bitwise_for_every_k(k):
    blocks = make_blocks(N)
    reference = twin(blocks)
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        expected = run_blocks(reference, x)
        with offloader(blocks, k, training=False) as o:
            for _ in range(3):
                assert torch.equal(run_blocks(blocks, x, o), expected)
            assert o.stats()["d2h_bytes"] == 0


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
@pytest.mark.parametrize("k", range(N))
def test_training_is_bitwise_for_every_k_and_checkpointing(k, checkpointing):
    blocks = make_blocks(N)
    expected = train(twin(blocks), checkpointing=checkpointing)
    with offloader(blocks, k, reentrant=checkpointing == "reentrant") as o:
        got = train(blocks, offloader=o, checkpointing=checkpointing)
        assert o.stats()["d2h_bytes"] == 0
        assert k == 0 or o.stats()["h2d_bytes"] > 0  # K = N-1 (musubi-tuner's largest): one slot
    assert_bitwise(expected, got)


@pytest.mark.parametrize("k", [1, 4])
def test_non_reentrant_checkpointing_around_the_block_alone(k):
    # musubi-tuner's form: wait, checkpoint(block, x), submit.
    blocks = make_blocks(N)

    def forward_with(o, blocks):
        def forward(h):
            if o is not None:
                o.prepare_block_devices_before_forward()
            for i, block in enumerate(blocks):
                if o is not None:
                    o.wait_for_block(i)
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
                if o is not None:
                    o.submit_move_blocks_forward(blocks, i)
            return h
        return forward

    reference = twin(blocks)
    expected = train(reference, forward=forward_with(None, reference))
    with offloader(blocks, k) as o:
        got = train(blocks, forward=forward_with(o, blocks))
    assert_bitwise(expected, got)


def test_an_eval_pass_in_the_middle_of_training():
    blocks = make_blocks(N)
    expected = train(twin(blocks))
    x = torch.randn(2, 5, DIM)
    with offloader(blocks, 3) as o:
        def forward(h):
            for disable in (False, True):
                if disable:
                    o.disable_block_swap()
                o.set_forward_only(True)
                with torch.no_grad():
                    run_blocks(blocks, x, o)  # exact: the next test compares it
                if disable:
                    o.enable_block_swap()
                o.set_forward_only(False)
            return run_blocks(blocks, h, o)

        got = train(blocks, forward=forward)
    assert_bitwise(expected, got)


def test_eval_outputs_are_exact_between_training_steps():
    blocks = make_blocks(N)
    reference = twin(blocks)
    x = torch.randn(2, 5, DIM)
    with offloader(blocks, 4) as o:
        for _ in range(2):
            train(blocks, steps=1, offloader=o)
            train(reference, steps=1)
            o.set_forward_only(True)
            with torch.no_grad():
                assert torch.equal(run_blocks(blocks, x, o), run_blocks(reference, x))
            o.set_forward_only(False)


def test_two_offloaders_on_one_shared_device():
    doubles = make_blocks(3, seed=1)
    singles = make_blocks(5, seed=2, dim=DIM)
    for b in singles:  # wider single blocks: different sizes
        b.fc1 = torch.nn.Linear(DIM, 2 * DIM).requires_grad_(False)
    all_blocks = doubles + singles
    expected = train(twin(all_blocks))
    device = blockswap.open_device("cpu", budget_bytes=10 << 20)
    a = blockswap.ModelOffloader("double_blocks", doubles, 3, 1, True, torch.device("cpu"), False,
                                 shared_device=device)
    b = blockswap.ModelOffloader("single_blocks", singles, 5, 3, True, torch.device("cpu"), False,
                                 shared_device=device)

    def forward(h):
        return run_blocks(singles, run_blocks(doubles, h, a), b)

    got = train(all_blocks, forward=forward)
    assert_bitwise(expected, got)
    memory = device.memory()
    assert memory["peak_device_bytes"] == (a.stats()["peak_device_bytes"] +
                                           b.stats()["peak_device_bytes"])
    a.close()
    b.close()
    assert device.memory()["device_bytes"] == 0


def test_bf16_weights_a_block_without_frozen_weights_and_buffers():
    blocks = make_blocks(N, dtype=torch.bfloat16)
    expected = train(twin(blocks), dtype=torch.bfloat16)
    with offloader(blocks, 2) as o:
        got = train(blocks, offloader=o, dtype=torch.bfloat16)
    assert_bitwise(expected, got)

    blocks = make_blocks(N)
    blocks[2].requires_grad_(True)  # a block whose every weight trains: nothing to swap
    expected = train(twin(blocks))
    with offloader(blocks, 2) as o:
        got = train(blocks, offloader=o)
    assert_bitwise(expected, got)


def test_trainable_parameters_keep_their_identity_and_weights_survive_close():
    blocks = make_blocks(N)
    reference = twin(blocks)
    ids = [id(p) for b in blocks for p in b.parameters()]
    frozen = [b.fc1.weight for b in blocks]
    o = offloader(blocks, 3)
    train(blocks, steps=1, offloader=o)
    train(reference, steps=1)
    assert ids == [id(p) for b in blocks for p in b.parameters()]
    # A checkpoint saved while swapping: the true values of every weight.
    for b, r in zip(blocks, reference):
        for (name, p), (_, q) in zip(b.state_dict().items(), r.state_dict().items()):
            assert torch.equal(p, q), name
    o.close()
    o.close()
    for w, b, r in zip(frozen, blocks, reference):
        assert w is b.fc1.weight
        assert torch.equal(w, r.fc1.weight)


class PeftLinear(torch.nn.Module):
    """peft's wrapper: `weight` aliases the base layer's."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = torch.nn.Linear(2, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_peft_style_wrappers_and_aliased_parameters_are_packed_once():
    torch.manual_seed(3)
    blocks = []
    for _ in range(4):
        block = torch.nn.Sequential(PeftLinear(torch.nn.Linear(DIM, DIM).requires_grad_(False)),
                                    torch.nn.GELU())
        block.alias = block[0].base_layer.weight  # the same Parameter under a second name
        blocks.append(block)
    expected = train(twin(blocks))
    with offloader(blocks, 2) as o:
        got = train(blocks, offloader=o)
        packed = o.stats()["h2d_bytes"]
    assert_bitwise(expected, got)
    # The base weight and bias once per block, though the weight has three names: the first
    # prepare loads N-K = 2 blocks, then 3 steps of 2K = 4 loads.
    assert packed == (2 + 3 * 4) * (DIM * DIM + DIM) * 4


def test_the_trainers_dummy_allocates_nothing_even_without_a_gpu():
    dummy = blockswap.ModelOffloader("dummy", [], 0, 0, True, torch.device("cuda"), False)
    dummy.prepare_block_devices_before_forward()
    dummy.wait_for_block(0)
    dummy.submit_move_blocks_forward(0)
    dummy.set_forward_only(True)
    assert dummy.stats()["device_bytes"] == 0
    dummy.close()


def test_bad_arguments_are_value_errors_naming_what_was_wrong():
    blocks = make_blocks(N)
    with pytest.raises(ValueError, match=r"K=6 is out of range for N=6 blocks in training mode"):
        offloader(blocks, 6)
    with pytest.raises(ValueError, match=r"K=6 is out of range for N=6 blocks in forward-only"):
        offloader(blocks, 6, training=False)
    with pytest.raises(ValueError, match="num_blocks=5 but 6 blocks"):
        blockswap.ModelOffloader("blocks", blocks, 5, 2, True, torch.device("cpu"), False)
    with pytest.raises(ValueError, match="needs a budget: device_budget_bytes"):
        offloader(blocks, -1)
    with pytest.raises(ValueError, match="not one blockswap runs on"):
        blockswap.ModelOffloader("blocks", blocks, N, 2, True, torch.device("meta"), False)


def test_options_are_checked_once_and_raise_one_kind_of_error():
    # Options::check (C++) checks every option for both languages: the same mistake raises
    # the same error whichever layer would have seen it first.
    assert issubclass(blockswap.InvalidArgumentError, ValueError)
    assert issubclass(blockswap.InvalidArgumentError, blockswap.Error)
    blocks = make_blocks(N)
    reference = twin(blocks)
    cases = [
        (dict(k=6), r"\[blocks\] blocks_to_swap K=6 is out of range"),
        (dict(k=2, training=False, rotating_slots=N), r"rotating_slots R=6 is out of range for "
                                                      r"N=6, K=2: expected 1 <= R <= N-K = 4"),
        (dict(k=2, training=False, rotating_slots=5), r"rotating_slots R=5"),
        (dict(k=2, training=False, rotating_slots=-1), r"rotating_slots R=-1"),
        (dict(k=2, rotating_slots=1.5), r"rotating_slots must be an int, got 1.5"),
        (dict(k="2"), r"blocks_to_swap must be an int, got '2'"),
        (dict(k=2, emulated_link_gbps=-1.0), r"emulated_link_gbps is -1"),
        (dict(k=2, max_grad_norm_per_parameter=1.0), r"set Options::optimizer too \(Python: "
                                                     r"pass optimizer= too\)"),
        (dict(k=0, gradient_accumulation_steps=0), r"gradient_accumulation_steps must be an "
                                                   r"int >= 1, got 0"),
    ]
    cases += [
        (dict(k=0, training=False, rotating_slots=7), r"rotating_slots R=7 is out of range for "
                                                      r"N=6, K=0"),  # whatever K is
        (dict(k=2, device_budget_bytes=-1), r"device_budget_bytes must be an int >= 0"),
        (dict(k=2, shared_device="cpu"), r"shared_device must be a blockswap.Device"),
        (dict(k=2, optimizer="adamw"), r"optimizer must be a blockswap.FusedSGD"),
        (dict(k=2, process_group="world"), r"process_group must be a torch.distributed"),
        (dict(k=2, trace=5), r"trace must be a file path"),
        (dict(k=2, trace="/nonexistent-dir/x.json"), r"cannot be written there"),
        (dict(k=2, emulated_link_gbps=1e-9), r"emulated_link_gbps is 1e-09"),
        (dict(k=2, emulated_link_gbps=True), r"emulated_link_gbps must be a number"),
        (dict(k=2, training=False, step_on="cpu"), r"\[blocks\] step_on must be"),
    ]
    for arguments, message in cases:
        with pytest.raises(blockswap.InvalidArgumentError, match=message):
            offloader(blocks, **arguments)
    with pytest.raises(blockswap.InvalidArgumentError, match="open_device: budget_bytes must be"):
        blockswap.open_device("cpu", budget_bytes=-1)
    with pytest.raises(blockswap.InvalidArgumentError, match="not a device"):
        blockswap.open_device("gpu")
    # A budget the planner cannot fit is a budget that cannot hold the slots.
    with pytest.raises(blockswap.OutOfMemoryError, match=r"\[blocks\] .*smallest budget"):
        offloader(blocks, -1, device_budget_bytes=10)
    # Integers of numpy are integers.
    numpy = pytest.importorskip("numpy")
    with offloader(blocks, numpy.int64(2), rotating_slots=numpy.int32(0)) as ok:
        assert ok.blocks_to_swap == 2
    # The offloaders that raised changed nothing.
    for block, twin_block in zip(blocks, reference):
        for p, q in zip(block.parameters(), twin_block.parameters()):
            assert torch.equal(p, q)
    # Nothing was claimed by the failed offloaders.
    with offloader(blocks, 2):
        pass


def test_an_error_in_the_with_body_is_the_one_raised(tmp_path):
    blocks = make_blocks(N)
    folder = tmp_path / "traces"
    folder.mkdir()
    with pytest.raises(KeyError, match="the body's"):
        with offloader(blocks, 2, trace=str(folder / "trace.json")):
            folder.rmdir()  # the trace cannot be written at close() any more
            raise KeyError("the body's")
    # Without an error in the body, the trace's own error is raised.
    folder.mkdir()
    o = offloader(blocks, 2, trace=str(folder / "trace.json"))
    folder.rmdir()
    with pytest.raises(blockswap.Error, match="trace"):
        with o:
            pass


def test_misuse_raises_blockswap_errors():
    blocks = make_blocks(N)
    o = offloader(blocks, 3)
    assert issubclass(blockswap.Error, RuntimeError)
    o.prepare_block_devices_before_forward()
    with pytest.raises(blockswap.Error, match="block 4 is not on the device"):
        o.wait_for_block(4)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    o.prepare_block_devices_before_forward()
    o.wait_for_block(0)
    h = blocks[0].forward(x)  # .forward directly: no hook sees the outputs
    with pytest.raises(blockswap.Error, match="call the block as block"):
        o.submit_move_blocks_forward(0)
    with pytest.raises(blockswap.Error, match="out of range"):
        o.wait_for_block(6)
    o.close()
    with pytest.raises(ValueError, match="set_forward_only"):
        offloader(make_blocks(N), 2, training=False).set_forward_only(False)
    del h


def test_the_planner_chooses_k_from_a_budget():
    blocks = make_blocks(N)
    block_bytes = sum(p.numel() * 4 + 256 for p in blocks[0].parameters() if not p.requires_grad)
    with offloader(blocks, -1, device_budget_bytes=3 * block_bytes) as o:
        assert 1 <= o.blocks_to_swap <= N - 2
        assert o.stats()["device_bytes"] <= 3 * block_bytes


def test_a_trace_file_is_written_at_close(tmp_path):
    path = tmp_path / "trace.json"
    blocks = make_blocks(N)
    with offloader(blocks, 2, trace=path) as o:
        train(blocks, steps=1, offloader=o)
    assert '"traceEvents"' in path.read_text()


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_packing_leaves_no_second_copy_of_the_weights_in_host_memory():
    torch.manual_seed(0)
    n, k, dim = 8, 6, 1024
    blocks = [torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(5)]).requires_grad_(False)
              for _ in range(n)]  # 8 blocks of 5 x 4 MiB: 160 MiB of weights
    weights = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    gc.collect()
    before = rss_bytes()
    with offloader(blocks, k, training=False) as o:
        gc.collect()
        grown = rss_bytes() - before
        # The emulated device's slots live in host memory too: N-K of them.
        slots = o.stats()["device_bytes"]
        print(f"weights {weights >> 20} MiB, slots {slots >> 20} MiB, RSS grew {grown >> 20} MiB")
        assert grown < slots + weights // 10, (grown, slots, weights)
