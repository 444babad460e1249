"""Hosts made of network and UTS namespaces on this machine, for test_multinode.py: each host
is a `sleep` started by `unshare --net --uts` (its own host name, its own loopback), the hosts
joined by veth pairs into one private /24 (10.201.0.0/24 inside those namespaces only: no
traffic leaves them). Commands run on a host through `nsenter --net --uts`; the file system,
the process ids and /dev/shm stay the machine's, as two nodes' would not: the tests check what
each node maps, and that nothing is left.

Needs root and iproute2 (`ip`), util-linux (`unshare`, `nsenter`); `unavailable()` says why not.
"""
import os
import shutil
import subprocess
import time

SUBNET = "10.201.0"


def unavailable():
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2, util-linux)"
    return None


def _namespace(pid, kind):
    return os.readlink(f"/proc/{pid}/ns/{kind}")


class Hosts:
    """`count` hosts named `<tag>-node<i>`, host i at SUBNET.(i+1) on interface `iface(i)`."""

    def __init__(self, count, tag):
        if count != 2:
            raise ValueError("two hosts, one veth pair (more would need a bridge in a namespace "
                             "of its own)")
        self.names = [f"{tag}-node{i}" for i in range(count)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.sleepers = []
        self.links = []
        try:
            for name in self.names:
                self.sleepers.append(subprocess.Popen(
                    ["unshare", "--net", "--uts", "sh", "-c",
                     f"hostname {name} && ip link set lo up && exec sleep 3600"]))
            for i, p in enumerate(self.sleepers):
                self._wait_until_own(p, self.names[i])
            for i in range(1, count):
                a, b = f"bs{os.getpid() % 100000}x{i}a", f"bs{os.getpid() % 100000}x{i}b"
                subprocess.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b],
                               check=True)
                subprocess.run(["ip", "link", "set", a, "netns", str(self.sleepers[0].pid)],
                               check=True)
                subprocess.run(["ip", "link", "set", b, "netns", str(self.sleepers[i].pid)],
                               check=True)
                self.links.append((a, b))
                self._on(0, ["ip", "addr", "add", f"{self.addrs[0]}/24", "dev", a])
                self._on(0, ["ip", "link", "set", a, "up"])
                self._on(i, ["ip", "addr", "add", f"{self.addrs[i]}/24", "dev", b])
                self._on(i, ["ip", "link", "set", b, "up"])
        except BaseException:
            self.close()
            raise

    def iface(self, i):
        """The interface host i's ranks talk through (Gloo's GLOO_SOCKET_IFNAME)."""
        return self.links[0][0] if i == 0 else self.links[i - 1][1]

    def _wait_until_own(self, p, name):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"unshare --net --uts failed (exit status {p.returncode})")
            try:
                own = (_namespace(p.pid, "uts") != _namespace("self", "uts") and
                       _namespace(p.pid, "net") != _namespace("self", "net"))
                with open(f"/proc/{p.pid}/comm") as f:
                    asleep = f.read().strip() == "sleep"
            except OSError:
                own = asleep = False
            if own and asleep:
                return
            time.sleep(0.05)
        raise RuntimeError(f"host {name}'s namespaces did not come up")

    def _enter(self, i):
        p = self.sleepers[i]
        # Never enter the machine's own namespaces: a host name set there would be the
        # machine's.
        assert _namespace(p.pid, "uts") != _namespace("self", "uts"), "not a host of its own"
        return ["nsenter", "-t", str(p.pid), "--net", "--uts", "--"]

    def _on(self, i, argv):
        done = subprocess.run(self._enter(i) + argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on {self.names[i]}: {done.stderr.strip()}")

    def run(self, i, argv, **popen):
        """Starts argv on host i; returns its Popen."""
        return subprocess.Popen(self._enter(i) + argv, **popen)

    def close(self):
        """Ends the hosts: their interfaces go with their namespaces."""
        for p in self.sleepers:
            if p.poll() is None:
                p.kill()
            p.wait()
        for a, _ in self.links:  # a pair whose namespaces are gone is gone too
            subprocess.run(["ip", "link", "del", a], capture_output=True)
