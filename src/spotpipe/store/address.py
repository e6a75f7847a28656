"""Where a job's store is and how to reach it: torch's TCPStore or etcd.

The launcher (or agent) decides the store once; its address travels to every worker in the
environment (torchrun's MASTER_ADDR/MASTER_PORT, plus SPOTPIPE_STORE and SPOTPIPE_STORE_PREFIX),
and every connection in the job (workers, their watcher threads, the mailbox reader, the
coordinator) is opened from it, so nothing else in the code cares which store it is.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch.distributed as dist

from spotpipe.store.tls import EtcdTLS

StoreKind = Literal["tcp", "etcd"]
# past the connection's own timeout, how long a first connection may take to answer
ANSWER_GRACE_S = 5.0


class StoreSilent(ConnectionError):
    """Something accepts connections at the store's address but does not answer as a store."""


@dataclass(frozen=True)
class StoreAddress:
    kind: StoreKind
    host: str
    port: int
    # etcd: the job's namespace (several jobs share one etcd); either store: a restart's round
    prefix: str = ""
    tls: EtcdTLS | None = None  # etcd over TLS (`store.tls`)
    # etcd: a key without which its clients write nothing (`EtcdStore`'s `while_present`:
    # the job's record, once an agent has read it)
    while_present: str = ""

    def connect(self, timeout_s: float) -> dist.Store:
        """A client connection (the TCPStore's server is hosted by the launcher or agent)."""
        timeout = timedelta(seconds=timeout_s)
        if self.kind == "etcd":
            from spotpipe.store.etcd import EtcdStore

            return EtcdStore(self.host, self.port, self.prefix, timeout=timeout, tls=self.tls,
                             while_present=self.while_present)
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.prefix, store) if self.prefix else store

    def connect_answered(self, timeout_s: float) -> dist.Store:
        """`connect`, bounded even where something else than a store listens at the address.

        A TCPStore client whose connection something else accepts (an HTTP server, a port
        another service holds: a mistyped `--rdzv-endpoint`) waits for its handshake's answer
        for ever, whatever its timeout (torch 2.13's client against `python -m http.server`,
        measured): the first connection to an address a user gave is made on a thread of its
        own, and StoreSilent says so past its timeout and a grace."""
        got: queue.Queue[dist.Store | BaseException] = queue.Queue()

        def connect() -> None:
            try:
                got.put(self.connect(timeout_s))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                got.put(exc)

        threading.Thread(target=connect, name="store-first-connection", daemon=True).start()
        try:
            result = got.get(timeout=timeout_s + ANSWER_GRACE_S)
        except queue.Empty:
            raise StoreSilent(f"{self.describe()}: something accepts connections there but does "
                              f"not answer as a store within {timeout_s + ANSWER_GRACE_S:.0f} s "
                              "(another service on that port?)") from None
        if isinstance(result, BaseException):
            raise result
        return result

    def within(self, part: str) -> StoreAddress:
        """The same store with keys under one more part (a restart's round, as torchrun's
        rendezvous rounds): a fresh set of keys without a new server."""
        return StoreAddress(self.kind, self.host, self.port,
                            f"{self.prefix}/{part}" if self.prefix else part, self.tls)

    def writing_while(self, key: str) -> StoreAddress:
        """The same store, whose clients write only while `key` exists (etcd; a TCPStore lives
        in the process that ends the job, and goes with it)."""
        return dataclasses.replace(self, while_present=key if self.kind == "etcd" else "")

    def env(self) -> dict[str, str]:
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port),
                "SPOTPIPE_STORE": self.kind, "SPOTPIPE_STORE_PREFIX": self.prefix,
                "SPOTPIPE_STORE_WHILE": self.while_present,
                **(self.tls.env() if self.tls else {})}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreAddress:
        env = os.environ if environ is None else environ
        kind = env.get("SPOTPIPE_STORE") or "tcp"
        if kind not in ("tcp", "etcd"):
            raise ValueError(f"SPOTPIPE_STORE: expected tcp or etcd, got {kind!r}")
        return cls(kind, env["MASTER_ADDR"], int(env["MASTER_PORT"]),  # type: ignore[arg-type]
                   env.get("SPOTPIPE_STORE_PREFIX", ""), EtcdTLS.from_env(env),
                   env.get("SPOTPIPE_STORE_WHILE", ""))

    def describe(self) -> str:
        """host:port, as the launch event records it (plus the namespace for etcd)."""
        return f"{self.host}:{self.port}" + (
            f" (etcd{' over TLS' if self.tls else ''}, keys under {self.prefix})"
            if self.kind == "etcd" else "")


def job_prefix(job_id: str) -> str:
    """The etcd namespace of one job."""
    return f"/spotpipe/jobs/{job_id}"


def host_tcp_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """Host a TCPStore that listens on `host` only (loopback unless configured otherwise).

    TCPStore's own server listens on every interface whatever host name it is given; so the
    socket is bound here and handed over (the store owns and closes it).
    """
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=sock.detach())
