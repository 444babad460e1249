"""Two nodes × two ranks on this machine: hosts made of network and UTS namespaces
(namespace_hosts.py), ranks started on each by torchrun's multi-node rendezvous (c10d, over
TCP between the hosts' private addresses), data-parallel LoRA training with node sharing
(multinode_worker.py): exact against the same job without blockswap, one host copy per node,
and a rank killed mid-step makes the other node's ranks raise within a bounded time, leaving
no shared memory behind; so does a whole node killed. Skipped, saying why, without root or iproute2."""
import json
import os
import subprocess
import sys
import time

import pytest

import namespace_hosts

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "multinode_worker.py")
NODES, PER_NODE, PORT = 2, 2, 29411

pytestmark = pytest.mark.skipif(namespace_hosts.unavailable() is not None,
                                reason=str(namespace_hosts.unavailable()))


def shm():
    """blockswap's names in /dev/shm (other jobs on the machine may add their own meanwhile)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if "blockswap" in n}


def leftovers(launched):
    """The processes of the job launched at `launched` still alive."""
    mark = f"BLOCKSWAP_TEST_LAUNCHED={launched!r}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def run_job(tmp_path, scenario, timeout=150):
    """Starts torchrun on both hosts; returns (torchrun exit codes, each rank's result or None,
    the launch time, the hosts' names)."""
    job = tmp_path / f"multinode-{scenario}"
    job.mkdir()
    try:
        hosts = namespace_hosts.Hosts(NODES, f"bs{os.getpid() % 100000}")
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot make namespace hosts here: {e}")
    try:
        launched = time.time()
        agents = []
        for i in range(NODES):
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=hosts.iface(i),
                       BLOCKSWAP_TEST_LAUNCHED=repr(launched))
            env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in [env.get("PYTHONPATH")]
                                                           if p])
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                    "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{hosts.addrs[0]}:{PORT}", "--rdzv-id", scenario,
                    "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'},join_timeout=60",
                    "--local-addr", hosts.addrs[i], "--max-restarts", "0",
                    WORKER, str(job), scenario]
            log = open(job / f"torchrun-{i}.log", "w")
            agents.append(hosts.run(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True))
        deadline = time.monotonic() + timeout
        codes = []
        for a in agents:
            try:
                codes.append(a.wait(timeout=max(1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for pid in [b.pid for b in agents] + leftovers(launched):
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                logs = [(job / f"torchrun-{i}.log").read_text()[-3000:] for i in range(NODES)]
                pytest.fail(f"the two-node job '{scenario}' hung for {timeout} s: {logs}")
    finally:
        hosts.close()
    deadline = time.monotonic() + 20  # the agents have ended; their workers end with them
    while leftovers(launched) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(launched), "a process of the job outlived it"
    results = []
    for r in range(NODES * PER_NODE):
        path = job / f"rank-{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return codes, results, launched, hosts.names, job


def test_two_nodes_train_exactly_on_one_host_copy_each(tmp_path):
    before = shm()
    codes, results, _, names, job = run_job(tmp_path, "train")
    logs = [(job / f"torchrun-{i}.log").read_text()[-3000:] for i in range(NODES)]
    assert codes == [0] * NODES, logs
    by_host = {}
    for r in results:
        assert r is not None and "error" not in r, (r, logs)
        assert r["exact"], "blockswap's adapters differ from the job's without it"
        assert r["same_as_rank0"], "the ranks' adapters differ"
        by_host.setdefault(r["host"], []).append(r)
    assert sorted(by_host) == sorted(names)  # each rank saw its own host's name
    for host, ranks in by_host.items():
        assert sorted(r["local_rank"] for r in ranks) == list(range(PER_NODE))
        copy = ranks[0]["copy_bytes"]
        # The node's ranks map one copy: every rank holds it shared, none privately, and their
        # proportional shares add up to one copy (its header page and page rounding aside).
        for r in ranks:
            assert r["use"]["shared_bytes"] >= copy, (host, r["use"])
            assert r["use"]["private_bytes"] < 0.1 * copy, (host, r["use"])
        node = sum(r["use"]["proportional_bytes"] for r in ranks)
        assert copy <= node < 1.1 * copy, (host, node, copy)
    assert shm() <= before, "node-shared memory left a name in /dev/shm"


def test_a_rank_killed_mid_step_makes_the_other_node_raise(tmp_path):
    before = shm()
    start = time.monotonic()
    codes, results, _, _, job = run_job(tmp_path, "kill")
    logs = [(job / f"torchrun-{i}.log").read_text()[-3000:] for i in range(NODES)]
    assert all(c != 0 for c in codes), (codes, logs)  # both agents report the failure
    assert results[2] is None  # rank 2 (node 1's local rank 0, the node's copy) died
    killed_at = float((job / "killed-at").read_text())
    for r in (0, 1):  # the other node's ranks raised, in bounded time
        assert results[r] is not None and "error" in results[r], (results, logs)
        error = results[r]["error"].lower()
        assert "peer" in error or "timed out" in error or "timeout" in error, error
        assert results[r]["failed_at"] - killed_at < 30, results[r]
    assert time.monotonic() - start < 120
    assert shm() <= before, "node-shared memory left a name in /dev/shm"


def test_a_node_killed_mid_step_makes_the_other_node_raise(tmp_path):
    """Node 1's torchrun agent and both its ranks SIGKILLed at once, in a step."""
    before = shm()
    codes, results, _, _, job = run_job(tmp_path, "kill_node")
    logs = [(job / f"torchrun-{i}.log").read_text()[-3000:] for i in range(NODES)]
    assert codes[1] == -9 and codes[0] != 0, (codes, logs)
    assert results[2] is None and results[3] is None, results
    killed_at = float((job / "killed-at").read_text())
    for r in (0, 1):
        assert results[r] is not None and "error" in results[r], (results, logs)
        assert results[r]["failed_at"] - killed_at < 30, results[r]
    assert shm() <= before, "node-shared memory left a name in /dev/shm"
