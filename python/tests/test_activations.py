"""offload_activations=True as a trainer uses it: what each block saves for backward goes to
host memory and comes back for its backward; gradients and trained weights bitwise those of
the run without offloading, alone (K = 0) and with swapping, in every checkpointing layout."""

import warnings

import pytest
import torch
import torch.utils.checkpoint

import blockswap
from blockswap import _activations
from conftest import DIM, Block, assert_bitwise, lora_parameters, make_blocks, run_blocks, train, twin
from real_models import build, swap
from real_models import train as train_model

TOKENS = 64  # (2, 64, 32) float32: 16 KiB a hidden state


def offloader(blocks, k=0, reentrant=False, **extra):
    extra.setdefault("activation_threshold_bytes", 1024)
    return blockswap.ModelOffloader("blocks", blocks, len(blocks), k, True, "cpu", reentrant,
                                    offload_activations=True, **extra)


def train_big(blocks, steps=2, offloader=None, checkpointing=None, layer=None):
    """conftest.train with inputs large enough to pass the threshold."""
    torch.manual_seed(11)
    x0 = torch.randn(2, TOKENS, DIM)
    params = lora_parameters(blocks)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    seen = []
    for _ in range(steps):
        x = x0.clone().requires_grad_(True)
        out = layer(blocks, x) if layer else run_blocks(blocks, x, offloader, checkpointing)
        loss = out.pow(2).mean()
        loss.backward()
        seen += [loss.detach(), x.grad] + [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
    return seen + [p.detach().clone() for p in params]


@pytest.fixture(autouse=True)
def fresh_stats():
    _activations.store_for("cpu").reset_stats()


@pytest.mark.parametrize("k", [0, 2, 4])
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_lora_training_is_bitwise_the_run_without_offloading(k, checkpointing):
    blocks = make_blocks(6)
    reference = twin(blocks)
    o = offloader(blocks, k, reentrant=checkpointing == "reentrant")
    assert_bitwise(train_big(reference, checkpointing=checkpointing),
                   train_big(blocks, offloader=o, checkpointing=checkpointing))
    stats = o.stats()
    if checkpointing is None:  # the checkpoint around the block call saves outside the block
        assert stats["activation_offloaded_bytes"] > 0
        assert stats["activation_restored_bytes"] == stats["activation_offloaded_bytes"]
    else:
        assert stats["activation_offloaded_bytes"] == 0


def test_a_non_reentrant_checkpoint_around_the_block_stays_in_charge():
    """Its saved-tensor hooks are on top when the block's call starts, so offloading leaves
    them alone: the checkpoint saves only its input, and every block's forward runs again in
    backward (its recompute). Offloading in their place would turn the checkpoint off without
    a word: a forward a block, every activation copied to the host (torch 2.7, which cannot
    tell which hooks are on top as 2.8 can, did until _compat read it another way)."""
    blocks = make_blocks(6)
    forwards = []
    for block in blocks:
        block.register_forward_pre_hook(lambda module, args: forwards.append(module))
    o = offloader(blocks, 2)
    train_big(blocks, steps=1, offloader=o, checkpointing="non-reentrant")
    assert len(forwards) == 2 * len(blocks)
    assert o.stats()["activation_offloaded_bytes"] == 0
    # torch's save_on_cpu around the whole pass is in charge the same way.
    forwards.clear()
    with torch.autograd.graph.save_on_cpu():
        train_big(blocks, steps=1, offloader=o)
    assert len(forwards) == len(blocks)
    assert o.stats()["activation_offloaded_bytes"] == 0


class CheckpointedBlock(torch.nn.Module):
    """musubi-tuner's layout: the block's own forward runs its body in a checkpoint."""

    def __init__(self, block, reentrant):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoint_inside_the_block_offloads_its_inputs(reentrant):
    blocks = [CheckpointedBlock(b, reentrant) for b in make_blocks(5)]
    reference = twin(blocks)
    o = offloader(blocks, 2, reentrant=reentrant)
    assert_bitwise(train_big(reference), train_big(blocks, offloader=o))
    # Both kinds save their inputs for the recompute (the non-reentrant one through a node of
    # its own, outside its hooks): one hidden state a step and a block but the last.
    assert o.stats()["activation_offloaded_bytes"] == 2 * (5 - 1) * 2 * TOKENS * DIM * 4


def test_a_context_around_a_checkpoint_outside_the_block_offloads_its_inputs():
    """diffusion-pipe's layout: torch.utils.checkpoint around the layer that waits, runs the
    block and submits; offloading_activations(i) around the checkpoint call."""
    blocks = make_blocks(5)
    reference = twin(blocks)
    o = offloader(blocks, 2, reentrant=True)

    def layer(blocks, x):
        o.prepare_block_devices_before_forward()
        for i, block in enumerate(blocks):
            def run(h, i=i, block=block):
                o.wait_for_block(i)
                h = block(h)
                o.submit_move_blocks_forward(i)
                return h
            with o.offloading_activations(i):
                x = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=True)
        return x

    assert_bitwise(train_big(reference, checkpointing="reentrant"), train_big(blocks, layer=layer))
    assert o.stats()["activation_offloaded_bytes"] == 2 * (5 - 1) * 2 * TOKENS * DIM * 4


def test_gradient_accumulation_and_two_forwards_before_one_backward():
    blocks = make_blocks(6)
    reference = twin(blocks)
    o = offloader(blocks, 3)
    torch.manual_seed(3)
    xs = [torch.randn(2, TOKENS, DIM) for _ in range(3)]

    def accumulate(blocks, o=None):
        seen = []
        # two micro-batches, each forward and backward
        for x in xs[:2]:
            run_blocks(blocks, x, o).pow(2).mean().backward()
        # then two forwards kept alive, one backward through both
        losses = [run_blocks(blocks, x, o).pow(2).mean() for x in xs[1:]]
        sum(losses).backward()
        seen += [p.grad.clone() for p in lora_parameters(blocks)]
        return seen

    assert_bitwise(accumulate(reference), accumulate(blocks, o))


def test_a_graph_kept_for_a_second_backward_unpacks_again():
    blocks = make_blocks(4)
    reference = twin(blocks)
    o = offloader(blocks, 0)
    x = torch.randn(2, TOKENS, DIM)
    grads = []
    for bs, off in ((reference, None), (blocks, o)):
        loss = run_blocks(bs, x, off).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.clone() for p in lora_parameters(bs)])
    assert_bitwise(*grads)


def test_full_fine_tuning_with_a_fused_optimizer():
    def build_blocks():
        blocks = make_blocks(5, lora=False)
        for b in blocks:
            b.requires_grad_(True)
        return blocks

    reference, blocks = build_blocks(), build_blocks()
    o_ref = blockswap.ModelOffloader("blocks", reference, 5, 2, True, "cpu", False,
                                     optimizer=blockswap.FusedAdamW(
                                         [p for b in reference for p in b.parameters()], lr=1e-2))
    o = offloader(blocks, 2, optimizer=blockswap.FusedAdamW(
        [p for b in blocks for p in b.parameters()], lr=1e-2))
    x = torch.randn(2, TOKENS, DIM)
    for bs, off in ((reference, o_ref), (blocks, o)):
        for _ in range(2):
            run_blocks(bs, x, off).pow(2).mean().backward()
    o_ref.close()
    o.close()
    assert_bitwise([p.detach() for b in reference for p in b.parameters()],
                   [p.detach() for b in blocks for p in b.parameters()])


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_diffusers_models_both_block_lists_on_one_device(kind, k):
    reference, model = build(kind), build(kind)
    offloaders = swap(model, kind, k, offload_activations=True, activation_threshold_bytes=0)
    assert_bitwise(train_model(reference, kind, steps=2),
                   train_model(model, kind, offloaders, steps=2))
    assert offloaders[0].stats()["activation_offloaded_bytes"] > 0


@pytest.mark.parametrize("n", [8, 16])
def test_the_device_holds_about_two_blocks_of_activations_whatever_n(n):
    def peak(offload):
        blocks = make_blocks(n)
        o = blockswap.ModelOffloader("blocks", blocks, n, 0, True, "cpu", False,
                                     offload_activations=offload,
                                     activation_threshold_bytes=1024)
        store = _activations.store_for("cpu")
        if not offload:  # the same hooks, counting only: a threshold nothing passes
            o.close()
            o = blockswap.ModelOffloader("blocks", blocks, n, 0, True, "cpu", False,
                                         offload_activations=True,
                                         activation_threshold_bytes=1 << 40)
        store.reset_stats()
        x = torch.randn(2, TOKENS, DIM, requires_grad=True)
        run_blocks(blocks, x, o).pow(2).mean().backward()
        return store.stats()["peak_activation_bytes"]

    kept, offloaded = peak(False), peak(True)
    per_block = kept / n
    assert offloaded <= 2.5 * per_block, (kept, offloaded)
    assert kept >= n * per_block * 0.99


def test_an_activation_written_in_place_after_it_was_saved_raises():
    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Block()

        def forward(self, x):
            y = torch.sigmoid(x * 2)  # sigmoid saves its output y
            self.last = y
            return self.inner(y)

    blocks = [Writes() for _ in range(3)]
    o = offloader(blocks)
    x = torch.randn(2, TOKENS, DIM, requires_grad=True)
    out = run_blocks(blocks, x, o)
    with torch.no_grad():
        blocks[0].last.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_failed_copy_to_host_is_a_clear_error_and_loses_nothing(monkeypatch):
    blocks = make_blocks(4)
    reference = twin(blocks)
    o = offloader(blocks, 2)

    def refuse(nbytes, pin):
        raise RuntimeError("cudaHostAlloc: out of memory")

    monkeypatch.setattr(_activations, "_allocate_host", refuse)
    with pytest.raises(RuntimeError, match="saved activations to host memory failed"):
        train_big(blocks, steps=1, offloader=o)
    monkeypatch.undo()
    # the weights are intact and the next steps are exact
    for b, r in zip(blocks, reference):
        for p, q in zip(b.parameters(), r.parameters()):
            assert torch.equal(p, q)
    assert_bitwise(train_big(reference), train_big(blocks, offloader=o))


@pytest.mark.parametrize("k", [0, 2])
def test_the_offloaders_device_counts_the_copies(k):
    """The store copies on torch's streams; the offloader's Device (shared_device here, so that
    K = 0, without an engine, has one too) counts the host memory they hold and each copy."""
    blocks = make_blocks(4)
    device = blockswap.open_device("cpu")
    o = offloader(blocks, k, shared_device=device)
    o.reset_stats()
    x = torch.randn(2, TOKENS, DIM, requires_grad=True)
    loss = run_blocks(blocks, x, o).pow(2).mean()
    out = o.stats()["activation_offloaded_bytes"]
    assert out > 0
    assert device.transfers()["bytes_d2h"] == out
    assert device.transfers()["host_bytes"] == out  # held while the graph lives
    loss.backward()
    del loss
    t = device.transfers()
    assert t["bytes_h2d"] == o.stats()["activation_restored_bytes"]
    assert t["peak_host_bytes"] == out
    assert t["host_bytes"] == 0  # the graph was freed
    o.close()


def test_options_are_checked():
    blocks = make_blocks(2)
    with pytest.raises(blockswap.InvalidArgumentError, match="offload_activations"):
        blockswap.ModelOffloader("b", blocks, 2, 0, True, "cpu", False, offload_activations=1)
    with pytest.raises(blockswap.InvalidArgumentError, match="activation_threshold_bytes"):
        blockswap.ModelOffloader("b", blocks, 2, 0, True, "cpu", False, offload_activations=True,
                                 activation_threshold_bytes=-1)
    o = blockswap.ModelOffloader("b", blocks, 2, 0, True, "cpu", False)
    with pytest.raises(blockswap.InvalidArgumentError, match="needs offload_activations=True"):
        o.offloading_activations(0)


def test_close_removes_the_hooks_and_inference_saves_nothing():
    blocks = make_blocks(3)
    o = offloader(blocks)
    x = torch.randn(2, TOKENS, DIM)
    with torch.no_grad():
        run_blocks(blocks, x, o)
    assert o.stats()["activation_offloaded_bytes"] == 0
    o.close()
    run_blocks(blocks, x.requires_grad_(), None).sum().backward()
    assert _activations.store_for("cpu").stats()["activation_offloaded_bytes"] == 0
    assert train(blocks, steps=1)  # plain blocks again


class LinearBlock(torch.nn.Module):
    """A frozen Linear (whose weight autograd saves: a view of the block's slot) and an adapter."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(DIM, DIM).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(4, DIM) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(DIM, 4) * 0.1)

    def forward(self, x):
        return x + torch.tanh(self.base(x) + x @ self.a.t() @ self.b.t())


@pytest.mark.parametrize("n", [5, 6])
def test_hook_blocks_at_the_largest_k_never_offloads_a_weight(n):
    """Outside tester: with hook_blocks=True the activation hook opened before the block's wait
    had bound its weights to a slot, so a saved weight was taken for an activation, and at
    K = N-2 its slot was reloaded before the copy: gradients 50 % off."""
    torch.manual_seed(0)
    reference = [LinearBlock() for _ in range(n)]
    blocks = twin(reference)
    o = blockswap.ModelOffloader("blocks", blocks, n, n - 2, True, "cpu", False,
                                 hook_blocks=True, offload_activations=True,
                                 activation_threshold_bytes=0)

    def step(blocks, prepare):
        torch.manual_seed(1)
        x0 = torch.randn(2, TOKENS, DIM, requires_grad=True)
        prepare()
        x = x0
        for block in blocks:
            x = block(x)
        x.pow(2).mean().backward()
        return [x0.grad] + [p.grad for p in lora_parameters(blocks)]

    expected = step(reference, lambda: None)
    assert_bitwise(expected, step(blocks, o.prepare_block_devices_before_forward))
    o.close()


def test_saved_activation_bytes_is_what_offloading_moves():
    """blockswap.saved_activation_bytes (for plan --activation-bytes) against the bytes the
    offloader moves for a block that is not the last (threshold 0)."""
    torch.manual_seed(0)
    blocks = [LinearBlock() for _ in range(3)]
    x = torch.randn(2, TOKENS, DIM, requires_grad=True)
    out, measured = blockswap.saved_activation_bytes(blocks[0], x)
    assert out.shape == x.shape and out.grad_fn is not None
    # x, base(x) + ..., the adapters' two products, tanh's output: weights and adapters excluded
    assert measured > 2 * TOKENS * DIM * 4
    o = blockswap.ModelOffloader("blocks", blocks, 3, 0, True, "cpu", False,
                                 offload_activations=True, activation_threshold_bytes=0)
    o.reset_stats()
    h = blocks[0](x)
    blocks[1](h)  # opening block 1's group sends block 0's out
    assert o.stats()["activation_offloaded_bytes"] == measured
    o.close()



def test_offloaded_activations_are_in_page_locked_memory_the_device_counts():
    """Note [exact host memory]: the activations' host copies come from the Device's pool, are
    counted in stats() with the host copies, and a later step of the same shapes reuses them."""
    device = blockswap.open_device("cpu")
    blocks = make_blocks(4)
    o = offloader(blocks, 2, shared_device=device)
    torch.manual_seed(11)
    x0 = torch.randn(2, TOKENS, DIM)
    pinned = []
    for _ in range(3):
        x = x0.clone().requires_grad_(True)
        run_blocks(blocks, x, o, None).pow(2).mean().backward()
        pinned.append(device.host_memory()["pinned_host_bytes"])
    stats = o.stats()
    moved = device.transfers()
    assert moved["bytes_d2h"] > 0
    frozen = sum(t.numel() * t.element_size() for b in blocks for t in b.parameters()
                 if not t.requires_grad) + sum(t.numel() * t.element_size()
                                               for b in blocks for t in b.buffers())
    assert stats["peak_kept_host_bytes"] >= frozen + moved["peak_host_bytes"]
    assert stats["peak_pinned_host_bytes"] >= stats["peak_kept_host_bytes"]
    assert stats["pageable_host_bytes"] == 0
    assert pinned[2] == pinned[1]  # the third step locked nothing new
    assert stats == {**stats, **device.host_memory()}  # the device's figures, in stats()
    device.trim_host_pool()  # the idle activation buffers go; the host copies stay
    assert device.host_memory()["pinned_host_bytes"] < pinned[2]
    o.close()
    assert o.stats()["pinned_host_bytes"] == 0
