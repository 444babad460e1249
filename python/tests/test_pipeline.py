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


def launch(worker, job, args, world=WORLD, timeout=180):
    """Runs `world` ranks of `worker` (RANK WORLD_SIZE JOB_DIR *args) to their end; returns each
    one's standard error."""
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
    return errors


def results_of(job, errors, world=WORLD):
    """Each rank's result in `job`, after checking that every rank wrote one without an error."""
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


def run_ranks(worker, job, args, world=WORLD, timeout=180):
    """launch, then results_of: one job in `job`."""
    return results_of(job, launch(worker, job, args, world, timeout), world)


# Every job of this file, run by one launch of the ranks (pipeline_worker.py runs them in turn):
# SCHEDULE:MICROBATCHES:VERBS:ROTATING.
JOBS = ([f"{s}:{m}:verbs:{r}" for s in ("gpipe", "1f1b") for m in (4, 8) for r in (0, 2)] +
        [f"interleaved:{m}:verbs:0" for m in (4, 8)] +
        [f"{s}:4:hooks:0" for s in ("1f1b", "interleaved")])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    job = tmp_path_factory.mktemp("pipelines") / "jobs"
    return job, launch(WORKER, job, JOBS, timeout=600)


def run_job(jobs, schedule, microbatches, verbs="verbs", rotating=0):
    job, errors = jobs
    key = f"{schedule}:{microbatches}:{verbs}:{rotating}"
    assert key in JOBS, key
    results = results_of(job / key.replace(":", "-"), errors)
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
def test_gpipe_is_exact_and_loads_what_stage_loads_predicts(jobs, microbatches, rotating):
    loads, sequential = steady_loads(run_job(jobs, "gpipe", microbatches, rotating=rotating))
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
def test_1f1b_is_exact_and_only_its_warmup_reloads(jobs, microbatches, rotating):
    loads, sequential = steady_loads(run_job(jobs, "1f1b", microbatches, rotating=rotating))
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
def test_interleaved_1f1b_is_exact(jobs, microbatches):
    loads, sequential = steady_loads(run_job(jobs, "interleaved", microbatches))
    assert sorted(loads) == [0, 1, 2, 3]  # two stages per rank, each its own offloader
    for stage, n in loads.items():
        assert n >= sequential[stage] == 2 * microbatches, loads


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_blockswaps_own_hooks_are_exact_in_a_pipeline(jobs, schedule):
    """hook_blocks=True (as for diffusers' classes) instead of the explicit verbs."""
    run_job(jobs, schedule, 4, "hooks")
