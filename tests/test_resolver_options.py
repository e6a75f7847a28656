"""The job's processes retry a dropped name lookup after 1 s, not glibc's 5 s.

torch's TCPStore looks up a name on every connection (see
`spotpipe.cluster.supervisor.RESOLVER_OPTIONS`); a resolver that drops the query held the
connection, and a regroup waiting on it, for 5 s. Here a resolver in a namespace of the test's
own drops the first query and answers the next: a process started with the job's environment
has its answer after about one second.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from netns import PREFIX, can_make_namespaces, in_netns, ip, remove_stale

LOOKUP = ("import socket, time; t = time.monotonic(); "
          "socket.getnameinfo(('10.213.9.9', 0), 0); print(time.monotonic() - t)")


def _nxdomain(query: bytes) -> bytes:
    """The answer 'no such name' to a DNS query: its id and question, QR and RCODE 3."""
    ident, flags = struct.unpack("!HH", query[:4])
    header = struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x0100) | 0x0080 | 3, 1, 0, 0, 0)
    return header + query[12:]


@pytest.fixture
def dropping_resolver(tmp_path):
    """A namespace whose resolv.conf names a resolver on its loopback that drops the first
    query and answers every later one. Yields (namespace, the queries it saw)."""
    why = can_make_namespaces()
    if why:
        pytest.skip(why)
    remove_stale()
    name = f"{PREFIX}{os.getpid()}-dns"
    conf = Path("/etc/netns") / name
    ip("netns", "add", name)
    seen: list[float] = []
    sock: socket.socket | None = None
    try:
        ip("-n", name, "link", "set", "lo", "up")
        conf.mkdir(parents=True)
        (conf / "resolv.conf").write_text("nameserver 127.0.0.1\n")

        def bind() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 53))
            return s

        sock = in_netns(name, bind)

        def serve() -> None:
            while True:
                try:
                    query, peer = sock.recvfrom(512)
                except OSError:  # closed: the test is over
                    return
                seen.append(time.monotonic())
                if len(seen) > 1:
                    sock.sendto(_nxdomain(query), peer)

        threading.Thread(target=serve, daemon=True).start()
        yield name, seen
    finally:
        if sock is not None:
            sock.close()
        ip("netns", "del", name, check=False)
        shutil.rmtree(conf, ignore_errors=True)


def _job_env(tmp_path: Path) -> dict[str, str]:
    from spotpipe.cluster.supervisor import search_path, start_env

    from conftest import tiny_config

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("spotpipe " * 100)
    cfg = tiny_config(corpus, stages=2, pipelines=1)
    return start_env(cfg, search_path(cfg))


def test_a_dropped_lookup_is_asked_again_after_one_second(dropping_resolver, tmp_path,
                                                          monkeypatch):
    name, seen = dropping_resolver
    monkeypatch.delenv("RES_OPTIONS", raising=False)
    out = subprocess.run(["ip", "netns", "exec", name, sys.executable, "-c", LOOKUP],
                         env=_job_env(tmp_path), capture_output=True, text=True, timeout=60,
                         check=True)
    took = float(out.stdout)
    assert len(seen) == 2, seen  # the first query dropped, the second answered
    assert 0.9 < seen[1] - seen[0] < 2.0 and took < 2.5, (seen, took)  # glibc's own: 5 s


def test_the_users_own_resolver_options_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("RES_OPTIONS", "timeout:3 rotate")
    assert _job_env(tmp_path)["RES_OPTIONS"] == "timeout:3 rotate"
