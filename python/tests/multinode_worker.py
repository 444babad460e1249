"""One rank of test_multinode.py's jobs, started by torchrun's multi-node rendezvous on each of
two hosts made of network and UTS namespaces (python multinode_worker.py JOB_DIR SCENARIO):
data-parallel LoRA training under DistributedDataParallel (Gloo), once without blockswap and
once with node sharing (process_group=), the node being the host name; writes what it saw, with
its host, its node memory and its timings, to JOB_DIR/rank-RANK.json. SCENARIO "kill": rank 2
(the second host's local rank 0, whose copy the host shares) kills itself in the middle of its
second swapped step; "kill_node": rank 2 kills its whole host there, its torchrun agent, the
host's other rank and itself."""
import time

STARTED = time.time()  # before torch is imported: the rendezvous time below leaves it out

import datetime  # noqa: E402
import os
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import blockswap
from distributed_worker import BLOCKS, DIM, SWAPPED, Block, Model, write_result

STEPS = 3


def train(rank, swapped, scenario, timings):
    model = Model(0)
    if swapped:
        if int(os.environ["LOCAL_RANK"]) != 0:  # only each node's local rank 0's are read
            with torch.no_grad():
                for p in model.parameters():
                    if not p.requires_grad:
                        p.fill_(7.0)
        start = time.monotonic()
        model.offloader = blockswap.ModelOffloader(
            "block", model.blocks, BLOCKS, SWAPPED, True, "cpu", False,
            process_group=dist.group.WORLD)
        model.offloader.exclude_from_ddp(model)
        timings["offloader_seconds"] = time.monotonic() - start
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        start = time.monotonic()
        torch.manual_seed(100 + 10 * rank + step)  # each rank its own data
        loss = ddp(torch.randn(4, 8, DIM)).pow(2).mean()
        if scenario.startswith("kill") and swapped and rank == 2 and step == 1:
            with open(os.path.join(sys.argv[1], "killed-at"), "w") as f:
                f.write(repr(time.time()))
            if scenario == "kill_node":
                kill_host()
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            timings["swapped_first_step" if swapped else "plain_first_step"] = (
                time.monotonic() - start)
    adapters = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    dist.barrier()  # every rank maps its node's memory now
    use = blockswap.node_memory_use()
    dist.barrier()
    if model.offloader is not None:
        model.offloader.close()
    return adapters, use


def kill_host():
    """SIGKILLs this rank's torchrun agent and the agent's other workers (each its own
    session), as a host that loses power would end them."""
    agent = os.getppid()
    siblings = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == agent and int(entry) != os.getpid():
            siblings.append(int(entry))
    for pid in [agent] + siblings:
        os.kill(pid, signal.SIGKILL)


def main():
    job_dir, scenario = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    now = time.time()
    timings = {"rendezvous": now - STARTED,  # this process's start to the group's
               "launch_to_group": now - float(os.environ["BLOCKSWAP_TEST_LAUNCHED"])}
    result = {"rank": rank, "host": socket.gethostname(),
              "local_rank": int(os.environ["LOCAL_RANK"]), "timings": timings}
    try:
        plain, _ = train(rank, False, scenario, timings)
        swapped, use = train(rank, True, scenario, timings)
        result["exact"] = all(torch.equal(a, b) for a, b in zip(plain, swapped))
        theirs = [a.clone() for a in swapped]
        for t in theirs:
            dist.broadcast(t, src=0)
        result["same_as_rank0"] = all(torch.equal(a, b) for a, b in zip(theirs, swapped))
        result["use"] = use
        block_bytes = sum(p.numel() * p.element_size() for p in Block().parameters()
                          if not p.requires_grad)
        result["copy_bytes"] = BLOCKS * block_bytes
    except Exception as e:  # what a trainer would see, for the test to check
        result["error"] = f"{type(e).__name__}: {e}"
        result["failed_at"] = time.time()
    write_result(job_dir, rank, result)
    if "error" in result:
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
