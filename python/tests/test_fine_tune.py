"""Full fine-tuning with the Python package, as a trainer would write it: the blocks' base
weights train with blockswap.FusedSGD / FusedAdamW, and after 5 steps every weight equals
bitwise the same model trained without blockswap by torch.optim."""

import pytest
import torch

import blockswap
from conftest import DIM, make_blocks, run_blocks, twin

N = 6
STEPS = 5


def fine_tune_blocks():
    blocks = make_blocks(N)
    for block in blocks:
        block.fc1.requires_grad_(True)
        block.fc2.requires_grad_(True)
    return blocks


def trainable(blocks):
    return [p for b in blocks for p in b.parameters() if p.requires_grad]


def batches(count):
    torch.manual_seed(5)
    return [torch.randn(2, 5, DIM) for _ in range(count)]


def train(blocks, optimizer, accumulation, offloader=None, scheduler=None):
    losses = []
    inputs = batches(STEPS * accumulation)
    for step in range(STEPS):
        for m in range(accumulation):
            loss = run_blocks(blocks, inputs[step * accumulation + m], offloader).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return losses + [p.detach().clone() for b in blocks for p in b.parameters()]


def assert_same(expected, got, what):
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{what} #{i}: max diff {(a - b).abs().max().item()}"


OPTIMIZERS = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
            lambda p: blockswap.FusedSGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                         weight_decay=0.01)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
              lambda p: blockswap.FusedAdamW(p, lr=0.01, weight_decay=0.1)),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("accumulation", [1, 2])
def test_fused_steps_equal_torch_optim_for_every_k(kind, accumulation):
    reference_optimizer, fused_optimizer = OPTIMIZERS[kind]
    reference = fine_tune_blocks()
    expected = train(reference, reference_optimizer(trainable(reference)), accumulation)
    for k in range(0, N - 1):
        blocks = fine_tune_blocks()
        optimizer = fused_optimizer(trainable(blocks))
        with blockswap.ModelOffloader("blocks", blocks, N, k, True, torch.device("cpu"), False,
                                      optimizer=optimizer,
                                      gradient_accumulation_steps=accumulation) as offloader:
            got = train(blocks, optimizer, accumulation, offloader)
            for p in trainable(blocks):
                assert p.grad is None  # the gradients live in the step, not in .grad
        assert_same(expected, got, f"{kind} K={k} accumulation {accumulation}")
        # after close(), the blocks hold the trained weights as ordinary tensors
        assert_same(expected[-len(got) // 2:], [p.detach() for b in blocks
                                                 for p in b.parameters()][-len(got) // 2:],
                    "after close")


def test_a_learning_rate_scheduler_drives_the_fused_step():
    reference = fine_tune_blocks()
    ref_opt = torch.optim.AdamW(trainable(reference), lr=0.02)
    expected = train(reference, ref_opt, 1,
                     scheduler=torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5))
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedAdamW(trainable(blocks), lr=0.02)
    with blockswap.ModelOffloader("blocks", blocks, N, 3, True, torch.device("cpu"), False,
                                  optimizer=optimizer) as offloader:
        got = train(blocks, optimizer, 1, offloader,
                    scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    assert_same(expected, got, "StepLR")


def test_per_parameter_clipping_is_clip_grad_norm_of_each_parameter_alone():
    reference = fine_tune_blocks()
    ref_opt = torch.optim.SGD(trainable(reference), lr=0.5)
    inputs = batches(2)
    for x in inputs:
        run_blocks(reference, x).pow(2).mean().backward()
        for p in trainable(reference):
            torch.nn.utils.clip_grad_norm_([p], 0.01)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.5)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, torch.device("cpu"), False,
                                  optimizer=optimizer, max_grad_norm_per_parameter=0.01) as o:
        for x in inputs:
            run_blocks(blocks, x, o).pow(2).mean().backward()
    assert_same([p.detach() for p in trainable(reference)],
                [p.detach() for p in trainable(blocks)], "clipped")


def test_optimizer_state_reads_torch_optims_values():
    reference = fine_tune_blocks()
    ref_opt = torch.optim.AdamW(trainable(reference), lr=0.01)
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedAdamW(trainable(blocks), lr=0.01)
    with blockswap.ModelOffloader("blocks", blocks, N, 4, True, torch.device("cpu"), False,
                                  optimizer=optimizer) as offloader:
        for x in batches(2):
            run_blocks(reference, x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            run_blocks(blocks, x, offloader).pow(2).mean().backward()
        for i in range(N):
            state = offloader.optimizer_state(i)
            assert offloader.optimizer_steps(i) == {n: 2 for n, p in blocks[i].named_parameters()
                                                    if p.requires_grad}
            for name, p in reference[i].named_parameters():
                if not p.requires_grad:
                    continue
                assert torch.equal(state[name + ".exp_avg"], ref_opt.state[p]["exp_avg"])
                assert torch.equal(state[name + ".exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"])


def test_mistakes_are_clear_errors():
    blocks = fine_tune_blocks()
    with pytest.raises(ValueError, match="not a AdamW"):
        blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                 optimizer=torch.optim.AdamW(trainable(blocks)))
    with pytest.raises(ValueError, match="not in the optimizer"):
        blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                 optimizer=blockswap.FusedSGD(trainable(blocks)[:3], lr=0.1))
    with pytest.raises(ValueError, match="pass optimizer= too"):
        blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                 gradient_accumulation_steps=2)
    with pytest.raises(blockswap.Error, match="needs supports_backward"):
        blockswap.ModelOffloader("blocks", blocks, N, 2, False, "cpu", False,
                                 optimizer=blockswap.FusedSGD(trainable(blocks), lr=0.1))
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer):
        with pytest.raises(ValueError, match="already belongs"):
            blockswap.ModelOffloader("blocks", twin(blocks), N, 2, True, "cpu", False,
                                     optimizer=optimizer)
