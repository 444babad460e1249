"""One rank of the data-parallel jobs test_distributed.py runs (python distributed_worker.py
RANK WORLD_SIZE JOB_DIR SCENARIO): LoRA training under DistributedDataParallel (Gloo, small
buckets so that its gradient hooks fire during backward while blockswap moves blocks), once
with blockswap over the node-shared host copy and once without; writes what it saw to
JOB_DIR/rank-RANK.json."""
import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import blockswap

DIM, HIDDEN, LORA_RANK, BLOCKS, SWAPPED, STEPS = 64, 256, 4, 6, 3, 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        for p in self.parameters():
            p.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(LORA_RANK, DIM) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(HIDDEN, LORA_RANK) * 0.1)

    def forward(self, x):
        h = self.fc1(x) + (x @ self.lora_a.t()) @ self.lora_b.t()
        return x + self.fc2(torch.nn.functional.gelu(h))


class Model(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)  # the same weights on every rank of a job
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.offloader = None

    def forward(self, x):
        if self.offloader is not None:
            self.offloader.prepare_block_devices_before_forward()
        for i, block in enumerate(self.blocks):
            if self.offloader is not None:
                self.offloader.wait_for_block(i)
            x = block(x)
            if self.offloader is not None:
                self.offloader.submit_move_blocks_forward(i)
        return x


def train(rank, scenario, swapped, group, first):
    model = Model(first)  # each job (subgroup) its own model
    if swapped:
        if rank != first:  # only local rank 0's weights are read: the others' may be anything
            with torch.no_grad():
                for p in model.parameters():
                    if not p.requires_grad:
                        p.fill_(7.0)
        # "activations": each rank also offloads what its blocks save for backward
        offload = scenario == "activations"
        # "compressed": the node's one copy holds the frozen weights compressed
        compress = "on" if scenario == "compressed" else "off"
        model.offloader = blockswap.ModelOffloader(
            "block", model.blocks, BLOCKS, SWAPPED, True, "cpu", False,
            process_group=group, offload_activations=offload, activation_threshold_bytes=0,
            compress=compress)
        if scenario != "forgot_exclude":
            model.offloader.exclude_from_ddp(model)
    # a bucket per few adapters
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, process_group=group)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * rank + step)  # each rank its own data
        loss = ddp(torch.randn(4, 8, DIM)).pow(2).mean()
        if scenario == "kill" and swapped and rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    adapters = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    if model.offloader is not None and scenario == "activations":
        stats = model.offloader.stats()
        assert stats["activation_offloaded_bytes"] > 0, stats
        assert stats["activation_restored_bytes"] == stats["activation_offloaded_bytes"], stats
    if model.offloader is not None and scenario == "compressed":
        use_compression = model.offloader.compression()
        use_stats = model.offloader.stats()
    dist.barrier()  # every rank maps the node's memory now
    use = blockswap.node_memory_use()
    if model.offloader is not None and scenario == "compressed":
        use = dict(use, compression=use_compression, decoded_bytes=use_stats["decoded_bytes"])
    dist.barrier()
    if model.offloader is not None:
        model.offloader.close()
    return adapters, use


def write_result(job_dir, rank, result):
    """This rank's result, as the test reads it: rank-<rank>.json in the job's folder, whole
    (written beside it, then renamed)."""
    path = os.path.join(job_dir, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)


def main():
    rank, world, job_dir, scenario = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                      sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job_dir}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    result = {"rank": rank}
    group, first = dist.group.WORLD, 0
    if scenario == "subgroups":  # two halves, each its own data-parallel job on one store
        halves = [dist.new_group(list(range(world // 2))),
                  dist.new_group(list(range(world // 2, world)))]
        group, first = halves[rank * 2 // world], rank * 2 // world * (world // 2)
    try:
        plain, _ = train(rank, scenario, False, group, first)
        swapped, use = train(rank, scenario, True, group, first)
        result["exact"] = all(torch.equal(a, b) for a, b in zip(plain, swapped))
        theirs = [a.clone() for a in swapped]
        for t in theirs:
            dist.broadcast(t, src=first, group=group)
        result["same_as_rank0"] = all(torch.equal(a, b) for a, b in zip(theirs, swapped))
        result["use"] = use
        block_bytes = sum(p.numel() * p.element_size() for p in Block().parameters()
                          if not p.requires_grad)
        result["copy_bytes"] = BLOCKS * block_bytes
    except Exception as e:  # what a trainer would see, for the test to check
        result["error"] = f"{type(e).__name__}: {e}"
    write_result(job_dir, rank, result)
    dist.barrier()  # no rank tears its groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
