"""Hosts that really are separate: each "host" is a Linux network namespace the test makes.

Topology (all of it inside namespaces this module created, named `spt<pid>-<n>-...`):

    [h0: spnet0 10.213.0.10] --+
    [h1: spnet0 10.213.0.11] --+-- br0 in the switch namespace "sw"
    [h2: spnet0 10.213.0.12] --+
    [etcd: spnet0 10.213.0.2] -+

Each host namespace has its own loopback and one veth interface (`spnet0`) whose other end is
a port of the bridge in the switch namespace; etcd runs in a namespace of its own. Nothing is
added to the machine's own namespace, so no traffic can reach any other address. A host's link
goes down by setting its switch port down (the host's processes keep running: a partition).
A host is lost by SIGKILLing every process in its namespace (`ip netns pids`).

Every agent runs under `ip netns exec` with GLOO_SOCKET_IFNAME=spnet0 (as torchrun users set
it) and `--local-addr`, so workers' gloo pairs bind that interface, which `gloo_sockets`
checks from the namespace's own socket table.

Cleanup removes every namespace (which removes their links and the bridge) after killing every
process in them, also when the test failed; namespaces left by a test process that was killed
itself are removed by the next cluster made (their creator pid is in their name).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from conftest import REPO

SUBNET = "10.213.0"
IFACE = "spnet0"
ETCD_ADDR = f"{SUBNET}.2"
METADATA_ADDR = f"{SUBNET}.3"
ETCD_PORT = 2379
PREFIX = "spt"
CLONE_NEWNET = 0x40000000
_count = [0]
T = TypeVar("T")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """Run `fn` on a thread that has joined namespace `name` (sockets it creates live there;
    a listening socket keeps serving from any thread afterwards)."""
    out: dict[str, Any] = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {name}")
        finally:
            os.close(fd)
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=body, name=f"in-{name}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def netns_pids(name: str) -> list[int]:
    result = ip("netns", "pids", name, check=False)
    return [int(p) for p in result.stdout.split()]


def _kill_all(name: str) -> None:
    """SIGKILL every process in namespace `name` until none is left (children that a dying
    parent started meanwhile included)."""
    for _ in range(50):
        pids = netns_pids(name)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # the kernel reaps them; then ask again (bounded: 50 rounds)
    raise RuntimeError(f"processes left in namespace {name}: {netns_pids(name)}")


def remove_stale() -> None:
    """Namespaces of earlier test processes that died before their cleanup ran."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _kill_all(name)
            ip("netns", "del", name, check=False)


def can_make_namespaces() -> str:
    """'' when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CI's .ci/run runs as root)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    veth = ip("link", "add", "name", "a", "netns", probe, "type", "veth", "peer", "name", "b",
              "netns", probe, check=False)
    ip("netns", "del", probe, check=False)
    if veth.returncode != 0:
        return f"cannot make veth pairs in a namespace: {veth.stderr.strip()}"
    return ""


@dataclass
class Host:
    name: str  # the namespace
    addr: str
    port: str  # the bridge port (in the switch namespace) of this host's link
    procs: list[subprocess.Popen] = field(default_factory=list)


class Cluster:
    """Namespaced hosts on one bridge, with etcd in a namespace of its own."""

    def __init__(self, hosts: int, tmp: Path) -> None:
        remove_stale()
        _count[0] += 1
        self.tag = f"{PREFIX}{os.getpid()}-{_count[0]}"
        self.tmp = tmp
        self.switch = f"{self.tag}-sw"
        self.etcd_ns = f"{self.tag}-etcd"
        self.hosts = [Host(f"{self.tag}-h{i}", f"{SUBNET}.{10 + i}", f"p{i}")
                      for i in range(hosts)]
        self.namespaces: list[str] = []
        self.etcd_proc: subprocess.Popen | None = None
        self.etcd_restarts = 0
        self.servers: list[Any] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    # -- topology -----------------------------------------------------------------------

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _make(self) -> None:
        self._add(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for name, addr, port in ([(self.etcd_ns, ETCD_ADDR, "pe")]
                                 + [(h.name, h.addr, h.port) for h in self.hosts]):
            self._add(name)
            ip("link", "add", "name", port, "netns", self.switch, "type", "veth", "peer", "name",
               IFACE, "netns", name)
            ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", IFACE)
            ip("-n", name, "link", "set", IFACE, "up")

    # -- etcd ---------------------------------------------------------------------------

    @property
    def etcd_endpoint(self) -> str:
        return f"{ETCD_ADDR}:{ETCD_PORT}"

    def start_etcd(self) -> None:
        binary = shutil.which("etcd")
        assert binary is not None and self.etcd_proc is None
        client, peer = f"http://{self.etcd_endpoint}", f"http://{ETCD_ADDR}:2380"
        log = open(self.tmp / f"etcd.{self.etcd_restarts}.log", "wb")
        self.etcd_proc = subprocess.Popen(
            ["ip", "netns", "exec", self.etcd_ns, binary, "--name", "t",
             "--data-dir", str(self.tmp / "etcd-data"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while not self._etcd_healthy():  # a real condition, polled
            if self.etcd_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start (see {log.name})")
            time.sleep(0.05)

    def _etcd_healthy(self) -> bool:
        def ask() -> bool:
            try:
                with urllib.request.urlopen(f"http://{self.etcd_endpoint}/health",
                                            timeout=1) as reply:
                    return b'"true"' in reply.read()
            except OSError:
                return False

        return in_netns(self.hosts[0].name, ask)

    def restart_etcd(self) -> None:
        """SIGKILL etcd (its data directory stays), then start it again."""
        _kill_all(self.etcd_ns)
        if self.etcd_proc is not None:
            self.etcd_proc.wait()
        self.etcd_proc = None
        self.etcd_restarts += 1
        self.start_etcd()

    # -- agents -------------------------------------------------------------------------

    def agent(self, i: int, config: Path, out: Path, *, token: str, job: str = "job1",
              nnodes: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
        host = self.hosts[i]
        env = dict(os.environ, SPOTPIPE_JOIN_TOKEN=token, GLOO_SOCKET_IFNAME=IFACE,
                   PYTHONPATH=os.pathsep.join([str(REPO / "src"),
                                               os.environ.get("PYTHONPATH", "")]))
        out.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.name, sys.executable, "-m", "spotpipe", "agent",
             str(config), "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd_endpoint,
             "--rdzv-id", job, "--nnodes", nnodes, "--local-addr", host.addr, "--out",
             str(out), "--no-progress", *extra],
            env=env, stdout=open(out.parent / f"{out.name}.stdout", "wb"),
            stderr=open(out.parent / f"{out.name}.stderr", "wb"), start_new_session=True)
        host.procs.append(proc)
        return proc

    # -- the clouds' metadata service --------------------------------------------------

    def metadata(self) -> Any:
        """tests/metadata_servers.py's server, on an address of the switch (10.213.0.3),
        which every host reaches over its own link."""
        from metadata_servers import MetadataServer

        ip("-n", self.switch, "addr", "add", f"{METADATA_ADDR}/24", "dev", "br0")
        server = in_netns(self.switch, lambda: MetadataServer(METADATA_ADDR))
        self.servers.append(server)
        return server

    # -- faults -------------------------------------------------------------------------

    def link(self, i: int, up: bool) -> None:
        """The host's link at the switch, down (a partition: its processes run on) or up."""
        ip("-n", self.switch, "link", "set", self.hosts[i].port, "up" if up else "down")

    def lose_host(self, i: int) -> None:
        """Every process of the host killed at once."""
        _kill_all(self.hosts[i].name)

    # -- what tests check ---------------------------------------------------------------

    def gloo_sockets(self, i: int, pids: set[int]) -> list[tuple[str, str]]:
        """(local, peer) addresses of the established TCP connections of processes `pids`
        in host i's namespace, from its own socket table."""
        table = ip("netns", "exec", self.hosts[i].name, "ss", "-tnpH", "state",
                   "established").stdout
        found = []
        for line in table.splitlines():
            owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
            if owners & pids:
                cols = line.split()
                found.append((cols[2].rsplit(":", 1)[0], cols[3].rsplit(":", 1)[0]))
        return found

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []
        for name in reversed(self.namespaces):
            _kill_all(name)
        for proc in [p for h in self.hosts for p in h.procs] + (
                [self.etcd_proc] if self.etcd_proc else []):
            try:
                proc.wait(timeout=10)  # reap the `ip netns exec` children we started
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for name in reversed(self.namespaces):
            ip("netns", "del", name, check=False)
        self.namespaces = []


def left_behind(tag: str) -> list[str]:
    """Namespaces with this tag that still exist (for tests' final check)."""
    return [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines()
            if line.startswith(tag)]


@pytest.fixture
def cluster_factory(tmp_path):
    """Make namespaced clusters; every one is removed at the end, whatever happened."""
    why = can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed")
    made: list[Cluster] = []

    def make(hosts: int) -> Cluster:
        cluster = Cluster(hosts, tmp_path)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
        assert left_behind(cluster.tag) == [], "namespaces left behind"
