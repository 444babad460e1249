"""One rank of test_deepspeed_pipeline.py's jobs (python deepspeed_pipeline_worker.py RANK
WORLD_SIZE JOB_DIR): diffusion-pipe's shape, a DeepSpeed PipelineModule of layers that each wrap
one block and call the offloader's verbs around it (diffusion-pipe's TransformerLayer), trained
by DeepSpeed's PipelineEngine (train_batch, its 1F1B schedule) on CPU ranks over Gloo, once
without blockswap and once with each stage's blocks swapped by its own ModelOffloader; writes
whether losses, gradients and adapters were bitwise equal to JOB_DIR/rank-RANK.json.

Two things differ from diffusion-pipe's train.py (at 8f83dbf), which asserts
`pipeline_stages == 1` whenever `blocks_to_swap` is set (train.py:577):
- the offloader is a stage's: built over the blocks of the layers the stage holds (after the
  PipelineModule has partitioned them), block indices counted within the stage;
- each stage's first layer calls `prepare_block_devices_before_forward()`: a stage runs several
  micro-batches' forwards before their backwards, each a pass of its own. (diffusion-pipe
  prepares once, at `prepare_block_swap_training`, which holds only while each forward is
  followed by its backward.)
As train.py does (its line 628), `_support_torch_style_backward` is set on the engine: DeepSpeed
0.18's pipeline engine calls torch.autograd.backward on the stages before the last, which its
own guard refuses without a ZeRO optimizer ("Direct calls to tensor.backward() are not
supported in this configuration ... (2) using ZeRO stage 0", deepspeed/runtime/engine.py:2322).
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist

import blockswap
from distributed_worker import DIM, Block, write_result

BLOCKS, STEPS, MICRO, ACCUMULATION, TOKENS = 8, 2, 2, 4, 8


class TransformerLayer(torch.nn.Module):
    """diffusion-pipe's wrapper: wait for the block, run it, submit its move."""

    def __init__(self, block):
        super().__init__()
        self.block = block
        self.offloader = None
        self.block_idx = 0

    def forward(self, x):
        if self.offloader is not None:
            if self.block_idx == 0:  # the stage's first layer: a micro-batch's pass starts
                self.offloader.prepare_block_devices_before_forward()
            self.offloader.wait_for_block(self.block_idx)
        x = self.block(x)
        if self.offloader is not None:
            self.offloader.submit_move_blocks_forward(self.block_idx)
        return x


def loss_fn(output, target):
    return (output - target).pow(2).mean()


def train(swapped):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    torch.manual_seed(0)
    layers = [TransformerLayer(Block()) for _ in range(BLOCKS)]
    model = PipelineModule(layers=layers, num_stages=dist.get_world_size(), loss_fn=loss_fn,
                           partition_method="uniform")
    mine = [layer for layer in model.forward_funcs if isinstance(layer, TransformerLayer)]
    offloader = None
    if swapped:
        blocks = [layer.block for layer in mine]
        offloader = blockswap.ModelOffloader("stage", blocks, len(blocks), len(blocks) // 2,
                                             True, "cpu", False)
        for i, layer in enumerate(mine):
            layer.offloader, layer.block_idx = offloader, i
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    seen = []
    step = optimizer.step

    def step_seeing_gradients(*args, **kwargs):
        seen.extend(p.grad.clone() for p in params)
        return step(*args, **kwargs)

    optimizer.step = step_seeing_gradients
    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": ACCUMULATION, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine._support_torch_style_backward = True  # as diffusion-pipe's train.py:628

    def batches():
        g = torch.Generator().manual_seed(5)
        while True:
            yield (torch.randn(MICRO, TOKENS, DIM, generator=g),
                   torch.randn(MICRO, TOKENS, DIM, generator=g))

    data = batches()
    loads = []
    for _ in range(STEPS):
        if offloader is not None:
            offloader.reset_stats()
        seen.append(engine.train_batch(data).detach().clone())
        if offloader is not None:
            frozen = sum(p.numel() * p.element_size() for p in mine[0].block.parameters()
                         if not p.requires_grad)
            loads.append(offloader.stats()["h2d_bytes"] // frozen)
    seen += [p.detach().clone() for p in params]
    if offloader is not None:
        offloader.close()
    return seen, loads


def main():
    rank, world, job_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{job_dir}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    result = {"rank": rank}
    try:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        plain, _ = train(False)
        swapped, loads = train(True)
        result["compared"] = len(plain)
        result["exact"] = len(plain) == len(swapped) and all(
            torch.equal(a, b) for a, b in zip(plain, swapped))
        result["loads"] = loads
    except Exception as e:  # what a trainer would see, for the test to check
        import traceback
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    write_result(job_dir, rank, result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
