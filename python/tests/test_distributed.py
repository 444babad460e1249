"""Data-parallel training with torch.distributed (Gloo) and DistributedDataParallel: the ranks
of this machine read one host copy of the swapped weights (process_group=), train exactly as
without blockswap, and fail clearly (never hang) when a rank dies. Real processes: each rank is
distributed_worker.py."""
import json
import os
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")


def run_job(tmp_path, world, scenario="train", timeout=120):
    """Runs the ranks; returns each one's exit code and result (None when it wrote none)."""
    job = tmp_path / f"job-{world}-{scenario}"
    job.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), str(job), scenario],
                              env=env, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    codes, errors = [], []
    deadline = time.monotonic() + timeout
    for p in ranks:
        try:
            _, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            pytest.fail(f"the {world}-rank job '{scenario}' hung for {timeout} s")
        codes.append(p.returncode)
        errors.append(err)
    results = []
    for r in range(world):
        path = job / f"rank-{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return codes, results, errors


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_trains_exactly_on_one_host_copy(tmp_path, world):
    codes, results, errors = run_job(tmp_path, world)
    assert codes == [0] * world, errors
    private = 0
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exact"], "blockswap's adapters differ from the job's without it"
        assert r["same_as_rank0"], "the ranks' adapters differ"
        assert r["use"]["shared_bytes"] >= r["copy_bytes"]
        private += r["use"]["private_bytes"]
    assert private < 0.1 * results[0]["copy_bytes"]


def test_every_rank_trains_exactly_on_one_compressed_copy(tmp_path):
    """compress="on" with process_group=: local rank 0 compresses the node's copy once; every
    rank maps it (fewer bytes than the raw weights), decodes it at each load, and trains
    exactly."""
    codes, results, errors = run_job(tmp_path, 2, "compressed")
    assert codes == [0, 0], errors
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exact"], "blockswap's adapters differ from the job's without it"
        assert r["same_as_rank0"], "the ranks' adapters differ"
        compression = r["use"]["compression"]
        assert compression["blocks"] > 0 and compression["ratio"] > 1.05, compression
        assert r["use"]["decoded_bytes"] > 0
        # the node's memory this rank maps: the compressed copy, not the raw one
        mapped = r["use"]["shared_bytes"] + r["use"]["private_bytes"]
        assert 0 < mapped < r["copy_bytes"], (mapped, r["copy_bytes"])


def test_every_rank_offloads_its_own_activations_exactly(tmp_path):
    codes, results, errors = run_job(tmp_path, 2, "activations")
    assert codes == [0, 0], errors
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exact"], "with offloaded activations the adapters differ from the job's"
        assert r["same_as_rank0"], "the ranks' adapters differ"


def test_subgroups_on_one_store_keep_their_own_copies(tmp_path):
    """Two data-parallel jobs of 2 ranks each, as subgroups of one 4-rank world (one store)."""
    codes, results, errors = run_job(tmp_path, 4, "subgroups")
    assert codes == [0] * 4, errors
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exact"] and r["same_as_rank0"]
        assert r["use"]["proportional_bytes"] <= r["copy_bytes"] / 2 + 64 * 1024


def test_a_rank_killed_mid_step_makes_the_others_fail_not_hang(tmp_path):
    start = time.monotonic()
    codes, results, errors = run_job(tmp_path, 3, "kill")
    assert codes[1] == -9  # SIGKILL
    for r in (0, 2):
        assert results[r] is not None and "error" in results[r], (codes, errors)
        # Gloo's words for the dead peer ("Connection closed by peer", "... reset by peer"), or
        # its timeout's.
        error = results[r]["error"].lower()
        assert "peer" in error or "timed out" in error or "timeout" in error, error
    assert time.monotonic() - start < 60


def test_ddp_without_exclude_from_ddp_is_a_clear_error(tmp_path):
    codes, results, errors = run_job(tmp_path, 2, "forgot_exclude")
    for r in results:
        assert r is not None and "error" in r, (codes, errors)
        assert "DistributedDataParallel" in r["error"], r["error"]
