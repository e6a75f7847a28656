"""The agents' rendezvous: options, the store it meets at, and its records' helpers.

Shared by every agent (`spotpipe.cluster.agent`) and the one elected to coordinate
(`spotpipe.cluster.admission`); the protocol of the rendezvous is described in `agent`."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from spotpipe.cluster.agent_options import AgentError, AgentOptions, is_local
from spotpipe.config import Config, parse_endpoint
from spotpipe.protocol import (JobOver, Message, MessageError, from_plain, keys, plain, vouch,
                               vouched)
from spotpipe.store import board
from spotpipe.store.address import StoreAddress, host_tcp_store, job_prefix
from spotpipe.store.waiting import wait_unbounded

ARRIVALS, COORDINATOR, JOB, OVER = keys.ARRIVALS, keys.COORDINATOR, keys.JOB, keys.OVER
LEFT, ALL_LEFT = keys.LEFT, keys.ALL_LEFT
agent_key, assign_key = keys.arrival, keys.assignment


def connect_rendezvous(opts: AgentOptions,
                       cfg: Config) -> tuple[StoreAddress, dist.Store | None]:
    """The job's store address, and the TCPStore this agent hosts (c10d, endpoint here)."""
    try:
        host, port = parse_endpoint(opts.endpoint)
    except ValueError as exc:
        raise AgentError(f"--rdzv-endpoint: {exc}") from None
    timeout = timedelta(seconds=cfg.cluster.timeout_s)
    if opts.backend == "etcd":
        from spotpipe.store.etcd import EtcdStore, EtcdStoreError

        address = StoreAddress("etcd", host, port, job_prefix(opts.rdzv_id), opts.tls)
        try:
            EtcdStore(host, port, address.prefix, timeout=timeout, reconnect_s=5.0,
                      tls=opts.tls).reachable()
        except EtcdStoreError as exc:
            raise AgentError(f"--rdzv-endpoint: {exc}") from None
        return address, None
    hosted = None
    if is_local(host):  # (an on-demand host: `check_options`)
        try:
            hosted = host_tcp_store(host, port, timeout)
        except OSError:
            hosted = None  # another agent of this host hosts it
    return StoreAddress("tcp", host, port), hosted


def wait_get(store: dist.Store, key: str, timeout_s: float) -> bytes | None:
    """The value at `key` once it is there; None when it is not within `timeout_s`. A store
    that is gone raises (DistNetworkError, etcd's too): taken for a timeout, it was said within
    a second as "no job appeared within 600 s", "not admitted within 600 s (--rdzv-timeout)"
    or too few agents arriving, none of which names the store."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except dist.DistNetworkError:
        raise
    except Exception:  # a timeout (the store raises its own error types)
        return None
    return store.get(key)


def read_record(store: dist.Store, key: str, *expect: type[Message]) -> Message:
    """The rendezvous record at `key`, typed; MessageError when it is not one of `expect`
    (anything with the store's address can write there: its reader says so and goes on)."""
    return from_plain(store.get(key), *expect)


def proof_key(rdzv_id: str, key: str) -> str:
    """What a rendezvous record's proof covers: the job's id and the record's key."""
    return f"{rdzv_id}/{key}"


def read_vouched(store: dist.Store, key: str, token: str, rdzv_id: str,
                 *expect: type[Message]) -> Message:
    """`read_record`, and MessageError as well when the record lacks the job's proof."""
    message = read_record(store, key, *expect)
    if not vouched(message, token, proof_key(rdzv_id, key)):
        raise MessageError("it lacks the job's proof")
    return message


def over_record(raw: bytes, token: str, rdzv_id: str) -> JobOver:
    """The job's end in `raw`, the value at its key; MessageError when it is not the one its
    coordinator posts (the key is plain: anything with the store's address can write there,
    and a forged end read as the job's stopped every host's workers)."""
    message = from_plain(raw, JobOver)
    if not vouched(message, token, proof_key(rdzv_id, OVER)):
        raise MessageError("it lacks the job's proof")
    assert isinstance(message, JobOver)
    return message


def is_over(raw: bytes, token: str, rdzv_id: str) -> bool:
    """Whether `raw` is the job's end as its coordinator posted it (`over_record`)."""
    try:
        over_record(raw, token, rdzv_id)
    except MessageError:
        return False
    return True


def posted_over(store: dist.Store, token: str, rdzv_id: str) -> JobOver | None:
    """The job's end as its coordinator posted it; None while there is none (nothing at its
    key, or a record there that is not the coordinator's)."""
    if not store.check([OVER]):
        return None
    try:
        return over_record(store.get(OVER), token, rdzv_id)
    except MessageError:
        return None


def wait_for_over(store: dist.Store, is_over: Callable[[bytes], bool],
                  poll_s: float = 1.0) -> None:
    """Block until the job's end key holds a record that `is_over` accepts (a c10d store,
    whose waits end when a key exists: a record squatting the key is looked at again every
    `poll_s` until the coordinator's end replaces it, `post_over` overwriting whatever is
    there; etcd's waits watch the key for changes instead, `Leadership.wait_vacant`)."""
    while True:
        wait_unbounded(store, [OVER])
        raw = store.get(OVER)
        if is_over(raw):
            return
        while _value_now(store, raw) == raw:
            time.sleep(poll_s)  # no watch for a change of value on a TCPStore: a poll


def _value_now(store: dist.Store, raw: bytes) -> bytes:
    """The end key's value (a compare_set that changes nothing reads it without blocking)."""
    now = store.compare_set(OVER, raw, raw)
    return now.encode() if isinstance(now, str) else bytes(now)


def arrive(store: dist.Store, record: Callable[[str], bytes]) -> int:
    """Take the next arrival number by writing `record(its key)` there: one compare_set
    claims the slot with the whole record (`store.board`), and the count, a hint of where to
    start, is raised after. An agent took a number (an add) and then wrote its record: one
    killed between the two (a host preempted at that instant) left its slot empty for good,
    and the coordinator, which reads the arrivals in order, answered no later agent.

    The count is plain: moved ahead by anyone with the store's address, it sent every later
    agent past slots nobody fills, the first of which the coordinator waits on. Writers fill
    a slot before they raise the count to it, so a count that names an empty slot was moved:
    it is put back to 0, and this writer claims the first free slot from the first on."""
    count = board.hint(store, ARRIVALS)
    if count and not store.check([keys.arrival(count)]):
        board.lower_hint(store, ARRIVALS, count, 0)
    return board.post(store, keys.ARRIVAL_BOARD, record, count_key=ARRIVALS)


def post_over(store: dist.Store, token: str, rdzv_id: str, status: str, message: str,
              agents: int) -> None:
    store.set(OVER, plain(vouch(JobOver(status, message, agents), token,
                                proof_key(rdzv_id, OVER))))


def write_atomic(path: Path, text: str) -> None:
    # the coordinating thread and its own agent write the same files at the same time: the
    # temporary name is the writer's (process and thread), not only the process's
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
