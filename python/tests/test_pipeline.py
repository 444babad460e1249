"""Pipeline-parallel LoRA training with torch.distributed.pipelining (Gloo, CPU ranks), each
stage's blocks swapped by its own ModelOffloader: losses, gradients and adapters bitwise equal
to the same pipeline without blockswap, and each stage's block loads per step counted against
the loads of the same micro-batches run one after another (each forward, then its backward:
the order blockswap's schedule plans for) and against blockswap.stage_loads, which predicts
them. Real processes: each rank is pipeline_worker.py."""
import json
import os
import subprocess
import sys
import time

import pytest

import blockswap

pytest.importorskip("torch.distributed.pipelining")

WORKER = os.path.join(os.path.dirname(__file__), "pipeline_worker.py")
WORLD = 2
K = 3  # the worker's stages of 6 blocks swap half of them; interleaved stages of 3 swap 1


def run_ranks(worker, job, args, world=WORLD, timeout=180):
    """Runs `world` ranks of `worker` (RANK WORLD_SIZE JOB_DIR *args); returns each one's
    result, after checking that every rank wrote one without an error."""
    job.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
    ranks = [subprocess.Popen([sys.executable, worker, str(r), str(world), str(job)] +
                              [str(a) for a in args], env=env, stderr=subprocess.PIPE,
                              text=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    errors = []
    for p in ranks:
        try:
            _, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            pytest.fail(f"the job {os.path.basename(worker)} {args} hung for {timeout} s")
        errors.append(err)
    results = []
    for r in range(world):
        path = job / f"rank-{r}.json"
        assert path.exists(), errors[r][-4000:]
        result = json.loads(path.read_text())
        assert "error" not in result, result["error"]
        assert result["exact"], f"rank {r}: blockswap's pipeline differs from the plain one"
        for stage, (peak, sequential) in result.get("peak_device_bytes", {}).items():
            # micro-batches in flight share the stage's slots: no more device memory
            assert peak == sequential, (stage, peak, sequential)
        results.append(result)
    return results


def run_job(tmp_path, schedule, microbatches, verbs="verbs", rotating=0):
    results = run_ranks(WORKER, tmp_path / f"pipe-{schedule}-{microbatches}-{verbs}-{rotating}",
                        [schedule, microbatches, verbs, rotating])
    assert results[-1]["losses"] == microbatches  # the last stage saw every micro-batch's loss
    return results


def steady_loads(results):
    """Each stage's loads in the last step (the first also loads the resident blocks), and the
    loads of the same micro-batches run one after another."""
    loads, sequential = {}, {}
    for r in results:
        loads.update({int(s): n for s, n in r["loads"][-1].items()})
        sequential.update({int(s): n for s, n in r["sequential_loads"].items()})
    return loads, sequential


@pytest.mark.parametrize("rotating", [0, 2])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_gpipe_is_exact_and_loads_what_stage_loads_predicts(tmp_path, microbatches, rotating):
    loads, sequential = steady_loads(run_job(tmp_path, "gpipe", microbatches, rotating=rotating))
    # All forwards, then all backwards: each forward after the first puts back R blocks the one
    # before evicted, each backward after the first R its forward ended with (R = K = 3 in the
    # seed's layout, else the rotating slots).
    turn = K if rotating == 0 else rotating
    for stage in (0, 1):
        assert sequential[stage] == 2 * K * microbatches  # the plan: K up, K down per pass
        assert loads[stage] == blockswap.stage_loads("gpipe", WORLD, stage, microbatches,
                                                     2 * K, K, rotating), loads
        assert loads[stage] == sequential[stage] + 2 * turn * (microbatches - 1), loads


@pytest.mark.parametrize("rotating", [0, 2])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_1f1b_is_exact_and_only_its_warmup_reloads(tmp_path, microbatches, rotating):
    loads, sequential = steady_loads(run_job(tmp_path, "1f1b", microbatches, rotating=rotating))
    for stage in (0, 1):
        assert loads[stage] == blockswap.stage_loads("1f1b", WORLD, stage, microbatches,
                                                     2 * K, K, rotating), loads
    # The last stage alternates forward and backward: exactly the plan.
    assert loads[1] == sequential[1] == 2 * K * microbatches, loads
    # The first stage runs WORLD-1 warm-up forwards ahead of its backwards: each turn from a
    # forward to a forward, and later from a backward to a backward, reloads R blocks.
    turn = K if rotating == 0 else rotating
    assert loads[0] == sequential[0] + 2 * turn * (WORLD - 1), loads


@pytest.mark.parametrize("microbatches", [4, 8])
def test_interleaved_1f1b_is_exact(tmp_path, microbatches):
    loads, sequential = steady_loads(run_job(tmp_path, "interleaved", microbatches))
    assert sorted(loads) == [0, 1, 2, 3]  # two stages per rank, each its own offloader
    for stage, n in loads.items():
        assert n >= sequential[stage] == 2 * microbatches, loads


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_blockswaps_own_hooks_are_exact_in_a_pipeline(tmp_path, schedule):
    """hook_blocks=True (as for diffusers' classes) instead of the explicit verbs."""
    run_job(tmp_path, schedule, 4, "hooks")
