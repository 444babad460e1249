"""One rank of the pipeline-parallel jobs test_pipeline.py runs (python pipeline_worker.py RANK
WORLD_SIZE JOB_DIR JOB...), each JOB "SCHEDULE:MICROBATCHES:VERBS:ROTATING", one after another
in one process group (a process per rank and job would start torch 24 times): a model of BLOCKS
blocks (frozen base weights, LoRA adapters) split into stages by torch.distributed.pipelining
(Gloo, CPU ranks), trained STEPS steps once without blockswap and once with each stage's blocks
swapped by its own ModelOffloader (the emulated device, training_rotating_slots=ROTATING);
writes the losses, gradients and adapters' equality and each stage's loads per step to
JOB_DIR/<JOB with - for :>/rank-RANK.json."""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import pipelining

import blockswap
from distributed_worker import DIM, Block, write_result

BLOCKS, STEPS, BATCH, TOKENS = 12, 2, 16, 8
SCHEDULES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
             "interleaved": pipelining.ScheduleInterleaved1F1B}


class Stage(torch.nn.Module):
    """A stage's share of the blocks; with an offloader, the stage swaps them itself: every
    forward (one per micro-batch) is a pass of its own, so it starts with prepare."""

    def __init__(self, blocks, swapped, verbs, rotating=0):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.verbs = verbs
        self.offloader = None
        if swapped:
            k = len(blocks) // 2
            self.offloader = blockswap.ModelOffloader(
                "stage", self.blocks, len(blocks), k, True, "cpu", False,
                hook_blocks=not verbs, training_rotating_slots=rotating)

    def forward(self, x):
        o = self.offloader
        if o is not None:
            o.prepare_block_devices_before_forward()
        for i, block in enumerate(self.blocks):
            if o is not None and self.verbs:
                o.wait_for_block(i)
            x = block(x)
            if o is not None and self.verbs:
                o.submit_move_blocks_forward(i)
        return x


def loss_fn(output, target):
    return (output - target).pow(2).mean()


def train(rank, world, schedule_name, microbatches, swapped, verbs, rotating=0):
    stages_per_rank = 2 if schedule_name == "interleaved" else 1
    num_stages = world * stages_per_rank
    per_stage = BLOCKS // num_stages
    torch.manual_seed(0)  # the same model on every rank: each keeps its stages' blocks
    blocks = [Block() for _ in range(BLOCKS)]
    indices = [rank + world * j for j in range(stages_per_rank)]  # looped, as interleaved wants
    modules = [Stage(blocks[s * per_stage:(s + 1) * per_stage], swapped, verbs, rotating)
               for s in indices]
    stages = [pipelining.PipelineStage(m, s, num_stages, torch.device("cpu"))
              for m, s in zip(modules, indices)]
    kind = SCHEDULES[schedule_name]
    schedule = kind(stages if stages_per_rank > 1 else stages[0], microbatches, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    seen, loads = [], []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x, target = torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, TOKENS, DIM)
        for m in modules:
            if m.offloader is not None:
                m.offloader.reset_stats()
        losses = []
        if 0 in indices:
            schedule.step(x)
        elif num_stages - 1 in indices:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        seen += [loss.detach().clone() for loss in losses]
        seen += [p.grad.clone() for p in params]
        optimizer.step()
        optimizer.zero_grad()
        loads.append({str(s): block_loads(m) for s, m in zip(indices, modules)
                      if m.offloader is not None})
    seen += [p.detach().clone() for p in params]
    planned, peaks = {}, {}
    for s, m in zip(indices, modules):
        if m.offloader is not None:
            peak = m.offloader.stats()["peak_device_bytes"]
            m.offloader.close()
            planned[str(s)], sequential_peak = sequential_loads(list(m.blocks), microbatches)
            peaks[str(s)] = [peak, sequential_peak]
    return seen, loads, len(losses), (planned, peaks)


def block_loads(stage):
    """The blocks the stage's offloader loaded since its stats were reset: its host-to-device
    bytes in blocks (on-demand loads included, which `moves` does not count)."""
    frozen = sum(p.numel() * p.element_size() for p in stage.blocks[0].parameters()
                 if not p.requires_grad)
    h2d = stage.offloader.stats()["h2d_bytes"]
    assert h2d % frozen == 0, (h2d, frozen)
    return h2d // frozen


def sequential_loads(blocks, microbatches):
    """The loads of one step of the same stage run the way the schedule plans a pass: each
    micro-batch's forward, then its backward (gradient accumulation), in steady state; and the
    device bytes it peaked at."""
    stage = Stage(blocks, True, True)
    for _ in range(2):
        stage.offloader.reset_stats()
        for _ in range(microbatches):
            x = torch.randn(BATCH // microbatches, TOKENS, DIM, requires_grad=True)
            stage(x).pow(2).mean().backward()
    loads, peak = block_loads(stage), stage.offloader.stats()["peak_device_bytes"]
    stage.offloader.close()
    for p in stage.parameters():
        p.grad = None
    return loads, peak


def run(rank, world, schedule_name, microbatches, verbs, rotating):
    """One job's result on this rank, as the test reads it."""
    result = {"rank": rank}
    try:
        plain, _, n_losses, _ = train(rank, world, schedule_name, microbatches, False, verbs)
        swapped, loads, _, planned = train(rank, world, schedule_name, microbatches, True,
                                           verbs, rotating)
        result["compared"] = len(plain)
        result["losses"] = n_losses
        result["exact"] = len(plain) == len(swapped) and all(
            torch.equal(a, b) for a, b in zip(plain, swapped))
        result["loads"] = loads
        result["sequential_loads"], result["peak_device_bytes"] = planned
    except Exception as e:  # what a trainer would see, for the test to check
        import traceback
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return result


def main():
    rank, world, job_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job_dir}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    for job in sys.argv[4:]:
        schedule_name, microbatches, verbs, rotating = job.split(":")
        result = run(rank, world, schedule_name, int(microbatches), verbs == "verbs",
                     int(rotating))
        out = os.path.join(job_dir, job.replace(":", "-"))
        os.makedirs(out, exist_ok=True)
        write_result(out, rank, result)
        dist.barrier()  # the next job starts on every rank together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
