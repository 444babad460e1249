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


@pytest.mark.parametrize("step_on", ["device", "host"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("accumulation", [1, 2])
def test_fused_steps_equal_torch_optim_for_every_k(kind, accumulation, step_on):
    reference_optimizer, fused_optimizer = OPTIMIZERS[kind]
    reference = fine_tune_blocks()
    expected = train(reference, reference_optimizer(trainable(reference)), accumulation)
    for k in range(0, N - 1):
        blocks = fine_tune_blocks()
        optimizer = fused_optimizer(trainable(blocks))
        with blockswap.ModelOffloader("blocks", blocks, N, k, True, torch.device("cpu"), False,
                                      optimizer=optimizer, step_on=step_on,
                                      gradient_accumulation_steps=accumulation) as offloader:
            assert offloader.step_on == step_on
            got = train(blocks, optimizer, accumulation, offloader)
            for p in trainable(blocks):
                assert p.grad is None  # the gradients live in the step, not in .grad
        assert_same(expected, got, f"{kind} K={k} accumulation {accumulation}")
        # after close(), the blocks hold the trained weights as ordinary tensors
        assert_same(expected[-len(got) // 2:], [p.detach() for b in blocks
                                                 for p in b.parameters()][-len(got) // 2:],
                    "after close")


IMPLEMENTATIONS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                   "fused": dict(fused=True)}


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("kind", ["sgd", "sgd-nesterov", "adamw"])
def test_each_torch_optim_implementation_is_bitwise_that_one(kind, implementation):
    # torch.optim computes one formula three ways (the for-loop, foreach, fused kernels), which
    # round differently: the fused step named with the same arguments is bitwise that one.
    args = IMPLEMENTATIONS[implementation]
    if kind == "adamw":
        hyper = dict(lr=0.01, weight_decay=0.1)
        make = (torch.optim.AdamW, blockswap.FusedAdamW)
    else:
        hyper = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=kind == "sgd-nesterov",
                     dampening=0.0 if kind == "sgd-nesterov" else 0.1)
        make = (torch.optim.SGD, blockswap.FusedSGD)
    reference = fine_tune_blocks()
    expected = train(reference, make[0](trainable(reference), **hyper, **args), 2)
    for k in (0, 2, N - 2):
        blocks = fine_tune_blocks()
        optimizer = make[1](trainable(blocks), **hyper, **args)
        with blockswap.ModelOffloader("blocks", blocks, N, k, True, torch.device("cpu"), False,
                                      optimizer=optimizer, step_on="device",
                                      gradient_accumulation_steps=2) as offloader:
            got = train(blocks, optimizer, 2, offloader)
        assert_same(expected, got, f"{kind} {implementation} K={k}")


def test_foreach_and_fused_together_is_a_value_error():
    with pytest.raises(ValueError, match="foreach and fused"):
        blockswap.FusedAdamW(trainable(fine_tune_blocks()), foreach=True, fused=True)


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
        assert offloader.step_on == "host"  # "auto" on the emulated device
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


def test_any_hyper_parameter_a_scheduler_changes_is_followed():
    # OneCycleLR cycles AdamW's betas[0] as well as the learning rate.
    reference = fine_tune_blocks()
    ref_opt = torch.optim.AdamW(trainable(reference), lr=1e-2)
    expected = train(reference, ref_opt, 1, scheduler=torch.optim.lr_scheduler.OneCycleLR(
        ref_opt, max_lr=1e-2, total_steps=STEPS + 1))
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedAdamW(trainable(blocks), lr=1e-2)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer) as offloader:
        got = train(blocks, optimizer, 1, offloader, scheduler=torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-2, total_steps=STEPS + 1))
    assert_same(expected, got, "OneCycleLR")
    # SGD's momentum and weight decay, changed by hand
    reference = fine_tune_blocks()
    ref_opt = torch.optim.SGD(trainable(reference), lr=0.05, momentum=0.5)
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.05, momentum=0.5)
    with blockswap.ModelOffloader("blocks", blocks, N, 3, True, "cpu", False,
                                  optimizer=optimizer) as offloader:
        for step, x in enumerate(batches(3)):
            for opt in (ref_opt, optimizer):
                opt.param_groups[0]["momentum"] = 0.5 + 0.1 * step
                opt.param_groups[0]["weight_decay"] = 0.01 * step
            run_blocks(reference, x).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            run_blocks(blocks, x, offloader).pow(2).mean().backward()
        optimizer.param_groups[0]["momentum"] = 0.0
        with pytest.raises(blockswap.Error, match="cannot start or stop being 0"):
            run_blocks(blocks, batches(1)[0], offloader)
    assert_same([p.detach() for p in trainable(reference)],
                [p.detach() for p in trainable(blocks)], "SGD momentum schedule")


@pytest.mark.parametrize("step_on", ["device", "host"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_checkpoint_of_the_optimizer_resumes_exactly(kind, step_on, tmp_path):
    """state_dict() in torch.optim's format, load_state_dict() into a fresh offloader."""
    reference_optimizer, fused_optimizer = OPTIMIZERS[kind]
    inputs = batches(4)
    reference = fine_tune_blocks()
    ref_opt = reference_optimizer(trainable(reference))
    for x in inputs:
        run_blocks(reference, x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    blocks = fine_tune_blocks()
    optimizer = fused_optimizer(trainable(blocks))
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer, step_on=step_on) as offloader:
        for x in inputs[:2]:
            run_blocks(blocks, x, offloader).pow(2).mean().backward()
        torch.save({"model": [b.state_dict() for b in blocks],
                    "optimizer": optimizer.state_dict()}, tmp_path / "checkpoint.pt")
    # the checkpoint reads like torch.optim's
    saved = torch.load(tmp_path / "checkpoint.pt")
    assert len(saved["optimizer"]["state"]) == len(trainable(blocks))

    resumed = fine_tune_blocks()
    for block, state in zip(resumed, saved["model"]):
        block.load_state_dict(state)
    optimizer = fused_optimizer(trainable(resumed))
    optimizer.load_state_dict(saved["optimizer"])  # before the offloader exists
    with blockswap.ModelOffloader("blocks", resumed, N, 3, True, "cpu", False,
                                  optimizer=optimizer, step_on=step_on) as offloader:
        for x in inputs[2:]:
            run_blocks(resumed, x, offloader).pow(2).mean().backward()
        got = [p.detach().clone() for p in trainable(resumed)]
    assert_same([p.detach() for p in trainable(reference)], got, f"{kind} resumed")
    # and into a live offloader too
    again = fine_tune_blocks()
    for block, state in zip(again, saved["model"]):
        block.load_state_dict(state)
    optimizer = fused_optimizer(trainable(again))
    with blockswap.ModelOffloader("blocks", again, N, 1, True, "cpu", False,
                                  optimizer=optimizer, step_on=step_on) as offloader:
        optimizer.load_state_dict(saved["optimizer"])
        for x in inputs[2:]:
            run_blocks(again, x, offloader).pow(2).mean().backward()
        got = [p.detach().clone() for p in trainable(again)]
    assert_same([p.detach() for p in trainable(reference)], got, f"{kind} resumed live")


def test_python_argument_mistakes_are_value_errors():
    blocks = fine_tune_blocks()
    with pytest.raises(ValueError, match="invalid lr"):
        blockswap.FusedAdamW(trainable(blocks), lr=-1)
    with pytest.raises(ValueError, match="beta parameter at index 0"):
        blockswap.FusedAdamW(trainable(blocks), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        blockswap.FusedSGD(trainable(blocks), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="step_on must be"):
        blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                 optimizer=blockswap.FusedSGD(trainable(blocks), lr=0.1),
                                 step_on="cpu")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="gradient_accumulation_steps must be an int"):
            blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                     optimizer=blockswap.FusedSGD(trainable(blocks), lr=0.1),
                                     gradient_accumulation_steps=bad)


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_accumulation_steps_when_torch_optim_does_whichever_blocks_a_micro_batch_reaches(step_on):
    # The first micro-batch's loss is on block 3's output: blocks 4 and 5 get their gradient
    # from the second only. torch.optim steps every parameter with a .grad at step().
    inputs = batches(6)
    reach = (4, N)

    def train_partial(blocks, optimizer, offloader=None):
        for step in range(3):
            for m in range(2):
                run_blocks(blocks[:reach[m]], inputs[2 * step + m], offloader).pow(2).mean() \
                    .backward()
                if offloader is not None:
                    assert offloader.accumulated_backwards == (1 if m == 0 else 0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for b in blocks for p in b.parameters()]

    reference = fine_tune_blocks()
    expected = train_partial(reference, torch.optim.SGD(trainable(reference), lr=0.05,
                                                        momentum=0.9))
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.05, momentum=0.9)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer, step_on=step_on,
                                  gradient_accumulation_steps=2) as offloader:
        got = train_partial(blocks, optimizer, offloader)
    assert_same(expected, got, f"step on the {step_on}")


def test_accumulation_that_cannot_follow_torch_optim_raises():
    inputs = batches(4)
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer, gradient_accumulation_steps=2) as offloader:
        # The last micro-batch of a step does not reach blocks 4 and 5, which have gradients.
        run_blocks(blocks, inputs[0], offloader).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="'fc1.weight' of block 4"):
            run_blocks(blocks[:4], inputs[1], offloader).pow(2).mean().backward()
        optimizer.step()  # the step that raised has ended: the count starts anew
        # A micro-batch without backward (a NaN guard): step() after one backward of two.
        run_blocks(blocks, inputs[2], offloader).pow(2).mean().backward()
        run_blocks(blocks, inputs[3], offloader)
        with pytest.raises(blockswap.Error, match=r"step\(\) came after 1 of the 2 backwards"):
            optimizer.step()


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_a_block_weight_read_mid_pass_is_the_stepped_value_and_used_in_the_loss_raises(step_on):
    # Block 0's weight read after block 1 (block 0 has left the device by then, and is a host
    # tensor: on a GPU another device than in its block): its value is the stepped one, as
    # torch.optim's; tied into the loss it gets a gradient outside its block's backward, which
    # raises instead of stepping twice (docs/guide.md).
    inputs = batches(3)

    def train_reading(blocks, optimizer, offloader=None, seen=None):
        for step in range(3):
            if offloader is not None:
                offloader.prepare_block_devices_before_forward()
            x = inputs[step]
            for i, block in enumerate(blocks):
                if offloader is not None:
                    offloader.wait_for_block(i)
                x = block(x)
                if offloader is not None:
                    offloader.submit_move_blocks_forward(i)
                if i == 1 and seen is not None:
                    seen.append(blocks[0].fc1.weight.detach().clone())
            x.pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for b in blocks for p in b.parameters()]

    reference = fine_tune_blocks()
    seen_expected = []
    expected = train_reading(reference, torch.optim.SGD(trainable(reference), lr=0.1),
                             seen=seen_expected)
    for k in (1, 2):
        blocks = fine_tune_blocks()
        optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
        seen = []
        with blockswap.ModelOffloader("blocks", blocks, N, k, True, "cpu", False,
                                      optimizer=optimizer, step_on=step_on) as offloader:
            got = train_reading(blocks, optimizer, offloader, seen)
            assert_same(seen_expected, seen, f"K={k} read mid-pass, step on the {step_on}")
            assert_same(expected, got, f"K={k} step on the {step_on}")
            offloader.prepare_block_devices_before_forward()
            x, tied = inputs[0], None
            for i, block in enumerate(blocks):
                offloader.wait_for_block(i)
                x = block(x)
                offloader.submit_move_blocks_forward(i)
                if i == 1:
                    tied = blocks[0].fc1.weight.pow(2).sum()
            with pytest.raises(RuntimeError, match="'fc1.weight' of block 0"):
                (x.pow(2).mean() + tied).backward()


def test_torch_optim_options_the_fused_step_does_not_compute_are_refused():
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedAdamW(trainable(blocks), lr=0.1)
    with pytest.raises(ValueError, match="one parameter group"):
        blockswap.FusedAdamW([{"params": trainable(blocks)[:2]},
                              {"params": trainable(blocks)[2:]}], lr=0.1)
    with pytest.raises(ValueError, match="one parameter group"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    # A torch.optim checkpoint with maximize or amsgrad: refused before anything changes.
    reference = torch.optim.AdamW(trainable(fine_tune_blocks()), lr=0.1, amsgrad=True)
    before = dict(optimizer.param_groups[0])
    with pytest.raises(ValueError, match="amsgrad=True"):
        optimizer.load_state_dict(reference.state_dict())
    assert optimizer.param_groups[0] == before
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer) as offloader:
        optimizer.param_groups[0]["maximize"] = True  # set by hand: refused as a pass starts
        with pytest.raises(ValueError, match="maximize=True"):
            run_blocks(blocks, batches(1)[0], offloader)


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_after_a_backward_that_raised_the_weights_read_are_the_stepped(step_on):
    # An exception in a hook between blocks 1 and 2: blocks 2-5 stepped, 0-1 did not. What the
    # parameters read after synchronize() (and in optimizer.state_dict()) is what the next pass
    # computes with.
    x = batches(1)[0]
    reference = fine_tune_blocks()
    h = x
    for block in reference:
        h = block(h)
    h.pow(2).mean().backward()
    torch.optim.SGD([p for b in reference[2:] for p in b.parameters() if p.requires_grad],
                    lr=0.1).step()
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
    with blockswap.ModelOffloader("blocks", blocks, N, 0, True, "cpu", False,
                                  optimizer=optimizer, step_on=step_on) as offloader:
        offloader.prepare_block_devices_before_forward()
        h = x
        for i, block in enumerate(blocks):
            offloader.wait_for_block(i)
            h = block(h)
            offloader.submit_move_blocks_forward(i)
            if i == 1:
                h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            h.pow(2).mean().backward()
        offloader.synchronize()
        for a, b in zip(reference, blocks):
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p, q)


def test_a_block_run_under_no_grad_in_a_training_pass_with_its_submit_outside_is_exact():
    # A frozen first block computed under torch.no_grad() (wait and submit around it as for every
    # block, the submit outside the no_grad): no backward reaches it, so nothing of it steps.
    inputs = batches(2)

    def train_first_frozen(blocks, optimizer, offloader=None):
        for x in inputs:
            if offloader is not None:
                offloader.prepare_block_devices_before_forward()
            for i, block in enumerate(blocks):
                if offloader is not None:
                    offloader.wait_for_block(i)
                if i == 0:
                    with torch.no_grad():
                        x = block(x)
                else:
                    x = block(x)
                if offloader is not None:
                    offloader.submit_move_blocks_forward(i)
            x.pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for b in blocks for p in b.parameters()]

    reference = fine_tune_blocks()
    expected = train_first_frozen(reference, torch.optim.SGD(trainable(reference), lr=0.1))
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer) as offloader:
        got = train_first_frozen(blocks, optimizer, offloader)
        assert all(s == 0 for s in offloader.optimizer_steps(0).values())
    assert_same(expected, got, "block 0 under no_grad")


def test_two_backward_calls_per_step_raise_at_step():
    # Two losses, two backward calls, one optimizer.step(): the fused step ran twice.
    inputs = batches(2)
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer) as offloader:
        for x in inputs:
            run_blocks(blocks, x, offloader).pow(2).mean().backward()
        with pytest.raises(blockswap.Error, match="ran 2 times since the last step"):
            optimizer.step()


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_zero_grad_in_the_middle_of_an_accumulation_drops_the_sum(step_on):
    inputs = batches(4)

    def train_with_a_dropped_micro_batch(blocks, optimizer, offloader=None):
        for step in range(2):
            for m in range(2):
                if m == 1:
                    optimizer.zero_grad(set_to_none=True)  # micro-batch 0 is thrown away
                run_blocks(blocks, inputs[2 * step + m], offloader).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for b in blocks for p in b.parameters()]

    reference = fine_tune_blocks()
    expected = train_with_a_dropped_micro_batch(
        reference, torch.optim.SGD(trainable(reference), lr=0.1, momentum=0.9))
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1, momentum=0.9)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer, step_on=step_on,
                                  gradient_accumulation_steps=2) as offloader:
        got = train_with_a_dropped_micro_batch(blocks, optimizer, offloader)
    assert_same(expected, got, f"step on the {step_on}")


@pytest.mark.parametrize("step_on", ["device", "host"])
def test_weights_written_after_an_evaluation_pass_are_trained_from(step_on):
    # A step, an evaluation pass, then a write (EMA weights swapped in, a checkpoint loaded)
    # into blocks that stay on the device: the next step trains from the written values.
    inputs = batches(3)

    def train_write_after_eval(blocks, optimizer, offloader=None):
        run_blocks(blocks, inputs[0], offloader).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            run_blocks(blocks, inputs[1], offloader)
            for block in blocks:
                block.fc1.bias.fill_(0.5)
        run_blocks(blocks, inputs[2], offloader).pow(2).mean().backward()
        optimizer.step()
        return [p.detach().clone() for b in blocks for p in b.parameters()]

    reference = fine_tune_blocks()
    expected = train_write_after_eval(reference, torch.optim.SGD(trainable(reference), lr=0.1,
                                                                 momentum=0.9))
    for k in (0, 2):
        blocks = fine_tune_blocks()
        optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1, momentum=0.9)
        with blockswap.ModelOffloader("blocks", blocks, N, k, True, "cpu", False,
                                      optimizer=optimizer, step_on=step_on) as offloader:
            got = train_write_after_eval(blocks, optimizer, offloader)
        assert_same(expected, got, f"K={k} step on the {step_on}")


def test_step_after_the_offloader_closed_raises_when_gradients_wait():
    blocks = fine_tune_blocks()
    optimizer = blockswap.FusedSGD(trainable(blocks), lr=0.1)
    with blockswap.ModelOffloader("blocks", blocks, N, 2, True, "cpu", False,
                                  optimizer=optimizer):
        pass
    optimizer.step()  # nothing waits: nothing to say
    run_blocks(blocks, batches(1)[0]).pow(2).mean().backward()
    with pytest.raises(blockswap.Error, match="was closed"):
        optimizer.step()
