"""The agents' rendezvous and the coordinator's office, one piece at a time: what an agent
makes of the records it finds at the rendezvous's keys (`cluster.rendezvous`,
`cluster.office`), on a real etcd and on a store like c10d's."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from spotpipe.cluster.agent_options import AgentOptions
from spotpipe.cluster.office import Office
from spotpipe.cluster.rendezvous import OVER, post_over, posted_over
from spotpipe.protocol import Channel, Event, JobPosted, job_key, keys, new_instance_id
from spotpipe.protocol import JobOver, plain, vouch
from spotpipe.store.leader import Leadership

TOKEN = "sesame"
# a run spec where a test reaches only the data digest of it (one host's data: none)
UNREAD_SPEC = SimpleNamespace(data_digest="")


def _office(tmp_path, backend: str, said: list[str], refused: threading.Event) -> Office:
    def say(text: str) -> None:
        said.append(text)
        if "refused" in text:
            refused.set()

    opts = AgentOptions(backend=backend, endpoint="127.0.0.1:1", rdzv_id="job1", min_nodes=2,
                        max_nodes=2, out=tmp_path)
    return Office(opts, None, TOKEN, None, say,  # type: ignore[arg-type]
                  on_handed_over=lambda: None)


def _posted(instance: str) -> JobPosted:
    return JobPosted(proof="", spec={}, t0=0.0, instance=instance, world=2, config_digest="",
                     model_digest="")


def _forged_end_is_waited_past(office: Office, store: dist.Store, said: list[str],
                               refused: threading.Event) -> None:
    """Forged ends at the end's key (bytes that are no record; a JobOver without the job's
    proof) neither end the agent's wait for the job's end (read as the end, they stopped every
    host's workers and failed the job) nor count as the end elsewhere; the coordinator's end,
    written over them, does end it."""
    instance = new_instance_id()
    channel = Channel(job_key(TOKEN, instance), "agent2")
    noticed = threading.Event()
    waiter = threading.Thread(target=office.wait_over,
                              args=(store, _posted(instance), channel, noticed), daemon=True)
    waiter.start()
    for forged in (b"\xff not a record",
                   plain(vouch(JobOver("failed", "stop"), "not the token", f"job1/{OVER}"))):
        refused.clear()
        store.set(OVER, forged)
        assert refused.wait(30), said
        assert waiter.is_alive(), "a forged end record ended the wait for the job's end"
        assert posted_over(store, TOKEN, "job1") is None
    assert any("not the coordinator's end of the job" in s for s in said), said
    # the job hears of it: a record_refused event in its mailbox, from this agent
    opened = channel.open(store.get(keys.board_slot(keys.MAILBOX, 1)),
                          at=keys.board_slot(keys.MAILBOX, 1), expect=Event)
    assert opened.message.kind == "record_refused" and opened.writer == "agent2"
    post_over(store, TOKEN, "job1", "completed", "", 2)
    waiter.join(30)
    assert not waiter.is_alive()
    over = posted_over(store, TOKEN, "job1")
    assert over is not None and over.status == "completed"


def test_a_forged_end_of_the_job_is_refused_under_etcd(tmp_path, etcd):
    from spotpipe.store.etcd import EtcdStore

    host, port = etcd.endpoint.split(":")

    def store() -> EtcdStore:
        return EtcdStore(host, int(port), "/rdzv-over", timeout=timedelta(seconds=10))

    coordinator = Leadership(store(), "1", ttl_s=5)
    assert coordinator.campaign()  # the office is held: only the end ends the wait
    said: list[str] = []
    refused = threading.Event()
    office = _office(tmp_path, "etcd", said, refused)
    office.leadership = Leadership(store(), "2", ttl_s=5)
    try:
        _forged_end_is_waited_past(office, store(), said, refused)
    finally:
        coordinator.resign()


def test_a_forged_end_of_the_job_is_refused_under_c10d(tmp_path):
    said: list[str] = []
    refused = threading.Event()
    _forged_end_is_waited_past(_office(tmp_path, "c10d", said, refused), dist.HashStore(),
                               said, refused)


def test_a_coordinator_that_fails_before_its_loop_ends_the_rendezvous_saying_why(
        tmp_path, corpus, etcd, monkeypatch):
    """The elected agent fails between posting the job and starting the job's loop (here the
    checkpoint folder's partial checkpoints cannot be removed). Its lease keeps the office
    taken, so no agent campaigns; before, no end was posted either, and every agent (its
    own included) waited for the job's end for ever. Now the end is posted, failed, naming
    the coordinator and the error."""
    from spotpipe.checkpoint import durable
    from spotpipe.cluster.admission import Coordinating
    from spotpipe.store.address import StoreAddress, job_prefix

    from conftest import tiny_config

    host, port = etcd.endpoint.split(":")
    address = StoreAddress("etcd", host, int(port), job_prefix("job1"))
    store = address.connect(10.0)
    leadership = Leadership(store, "1", ttl_s=5)
    assert leadership.campaign()
    cfg = tiny_config(corpus, stages=2, pipelines=1, **{"checkpoint.every": 2})

    class Spec:  # (only posted: the loop that would use it is never reached)
        data_digest = ""

        def to_json(self) -> dict:
            return {}

    def cannot(root):
        raise PermissionError(13, "Permission denied", str(root / ".iter_4"))

    monkeypatch.setattr(durable, "clean_partials", cannot)
    opts = AgentOptions(backend="etcd", endpoint=etcd.endpoint, rdzv_id="job1",
                        min_nodes=2, max_nodes=2, out=tmp_path / "out")
    (tmp_path / "out").mkdir()
    coordinating = Coordinating(opts, cfg, Spec(), TOKEN, address, 1,  # type: ignore[arg-type]
                                leadership)
    # another admitted agent, waiting for the job's end while it watches the office
    said: list[str] = []
    other = _office(tmp_path, "etcd", said, threading.Event())
    other.leadership = Leadership(address.connect(10.0), "2", ttl_s=5)
    instance = coordinating.instance
    waiter = threading.Thread(target=other.wait_over, daemon=True, args=(
        address.connect(10.0), _posted(instance), Channel(job_key(TOKEN, instance), "agent2"),
        threading.Event()))
    waiter.start()
    try:
        try:
            coordinating.run()
        except PermissionError:
            pass  # (raised on: the coordinator's thread says it)
        waiter.join(30)
        assert not waiter.is_alive(), "an agent waits for the job's end for ever"
        over = posted_over(store, TOKEN, "job1")
        assert over is not None and over.status == "failed", over
        assert "the coordinator (agent 1) failed: PermissionError" in over.message, over
        assert ".iter_4" in over.message
    finally:
        leadership.resign()


class _KilledAfterFirstWrite:
    """A store client whose process is killed right after its first write reaches the store
    (a host preempted at that instant): reads pass, the first write is done, then `Killed`."""

    class Killed(BaseException):
        pass

    def __init__(self, store: dist.Store) -> None:
        self.store, self.wrote = store, False

    def _write(self, call, *args):
        if self.wrote:
            raise self.Killed()
        call(*args)
        self.wrote = True
        raise self.Killed()

    def add(self, key: str, amount: int) -> int:
        return self._write(self.store.add, key, amount)

    def set(self, key: str, value) -> None:
        self._write(self.store.set, key, value)

    def compare_set(self, key: str, expected, desired):
        if expected == desired:  # (a read: it changes nothing)
            return self.store.compare_set(key, expected, desired)
        return self._write(self.store.compare_set, key, expected, desired)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def _admitting(tmp_path, corpus, me: int | None = None):
    """A running job's admission on a TCPStore: the coordinator's own agent arrived and was
    admitted, and its admission thread waits for the next arrival. The store, and an agent
    (its flags and configuration the job's) to arrive with. `me`: the number the coordinator
    goes by, if not that first arrival's (a successor whose agent came again since)."""
    import queue

    from spotpipe.cluster.admission import Coordinating
    from spotpipe.cluster.agent import Agent
    from spotpipe.store.address import StoreAddress, host_tcp_store

    from conftest import tiny_config

    hosted = host_tcp_store("127.0.0.1", 0, timedelta(seconds=10))
    address = StoreAddress("tcp", "127.0.0.1", hosted.port)
    cfg = tiny_config(corpus, stages=2, pipelines=1)
    opts = AgentOptions(backend="c10d", endpoint=f"127.0.0.1:{hosted.port}", rdzv_id="job1",
                        min_nodes=1, max_nodes=4, out=tmp_path, nproc=1)
    store = address.connect(10.0)
    agent = Agent(opts, cfg, UNREAD_SPEC, TOKEN, address, None)  # type: ignore[arg-type]
    first = agent._arrive(store)  # the coordinator's own agent
    c = Coordinating(opts, cfg, UNREAD_SPEC, TOKEN, address,  # type: ignore[arg-type]
                     me=first if me is None else me)
    c._admitted, c._nodes, c._agent_nodes, c._slots = [first], ["node0"], {first: ["node0"]}, \
        {0: first}
    c._next = first + 1
    c.go(queue.Queue())
    return store, agent, first, hosted


def _admitted_late(store: dist.Store, k: int) -> None:
    """Arrival `k` is answered (within 30 s), admitted to the running job."""
    from spotpipe.protocol import Assignment, from_plain

    store.wait([keys.assignment(k)], timedelta(seconds=30))
    answer = from_plain(store.get(keys.assignment(k)), Assignment)
    assert not answer.refused and answer.joining, answer


def test_an_agent_killed_as_it_arrives_holds_up_no_later_agent(tmp_path, corpus):
    """The coordinator reads the arrivals in order. An agent took its arrival number (an
    atomic add) and wrote its record in a second call: killed between the two, it left its
    slot empty for good, the coordinator's admission waited on that slot for ever, and no
    later agent was answered (every late host, every fenced node's host coming again, timed
    out unadmitted). The slot is now claimed with the whole record, so an agent killed at any
    instant of its arrival leaves a whole record or none."""
    store, agent, _, hosted = _admitting(tmp_path, corpus)
    dying = _KilledAfterFirstWrite(store)
    try:
        agent._arrive(dying)  # type: ignore[arg-type]
    except _KilledAfterFirstWrite.Killed:
        pass
    assert dying.wrote
    _admitted_late(store, agent._arrive(store))


def test_two_agents_of_one_host_arriving_at_once_take_two_slots(tmp_path, corpus):
    """Two agents of one host (the same name, flags and configuration) bring records alike
    but for their nonce: both trying the same free slot at once, only one may take it (a
    slot is claimed by a compare_set that answers what the slot holds; alike records would
    each read as their own, and both agents were given the same node)."""
    from spotpipe.cluster.agent import Agent

    from conftest import tiny_config

    opts = AgentOptions(backend="c10d", endpoint="127.0.0.1:1", rdzv_id="job1", min_nodes=2,
                        max_nodes=2, out=tmp_path)
    cfg = tiny_config(corpus, stages=2, pipelines=1)
    store = dist.HashStore()
    a, b = (Agent(opts, cfg, UNREAD_SPEC, TOKEN, None, None)  # type: ignore[arg-type]
            for _ in range(2))
    first = a._arrive(store)
    # b read the count before a raised it: it tries the slot a took
    store.compare_set(keys.ARRIVALS, str(first).encode(), b"0")
    assert b._arrive(store) == first + 1



def _arrival(cfg, k: int, node_rank: int = -1, data_digest: str = "") -> bytes:
    from spotpipe.protocol import AgentArrival

    return plain(vouch(AgentArrival(
        host=f"host{k}", nproc=1, node_rank=node_rank, proof="",
        model_digest=cfg.model_digest(), config_digest=cfg.digest(),
        config_keys=cfg.key_digests(), data_digest=data_digest), TOKEN,
        f"job1/{keys.arrival(k)}"))


def _first_layout(corpus, tmp_path, me: int, ranks: dict[int, int], max_nodes: int = 2,
                  data: dict[int, str] | None = None, spec=UNREAD_SPEC):
    """The elected agent `me` admits the first layout of a 2-agent job from the arrivals
    `ranks` (arrival number -> its --node-rank, `data`: its data digest); the answers, by
    arrival number."""
    from types import SimpleNamespace

    from spotpipe.cluster.admission import Coordinating
    from spotpipe.protocol import Assignment, from_plain

    from conftest import tiny_config

    cfg = tiny_config(corpus, stages=2, pipelines=1)
    opts = AgentOptions(backend="c10d", endpoint="127.0.0.1:1", rdzv_id="job1", min_nodes=2,
                        max_nodes=max_nodes, out=tmp_path, rdzv_timeout_s=5.0)
    store = dist.HashStore()
    for k, rank in ranks.items():
        store.set(keys.arrival(k), _arrival(cfg, k, rank, (data or {}).get(k, "")))
    c = Coordinating(opts, cfg, spec, TOKEN, None, me=me)  # type: ignore[arg-type]
    c._loop = lambda: SimpleNamespace()  # (the job's loop is not this test's)
    c._run_loop = lambda loop, store: 0
    assert c._run(store, None) == 0
    return {k: from_plain(store.get(keys.assignment(k)), Assignment)
            for k in ranks if store.check([keys.assignment(k)])}


def test_the_elected_agent_is_in_the_first_layout_whatever_its_arrival_number(corpus,
                                                                             tmp_path):
    """Agents take arrival numbers, then campaign: the winner need not be the first to
    arrive. The elected agent admitted the first layout in arrival order, its own arrival
    among them: one that came after MIN others was left to the late admission, as a node
    joining the running job, or refused at MAX (then its agent exited 2, taking the
    coordinator with it, and the job was lost). It admits itself first now."""
    answers = _first_layout(corpus, tmp_path, me=3, ranks={1: -1, 2: -1, 3: -1})
    assert 3 in answers and not answers[3].refused and not answers[3].joining, answers
    assert answers[3].ranks == (0,)
    assert [a.ranks for k, a in sorted(answers.items()) if k != 3] == [(1,)]


def test_a_node_rank_taken_twice_refuses_the_other_agent_not_the_coordinator(corpus,
                                                                          tmp_path):
    """Two agents given the same --node-rank: the one refused must not be the agent that
    coordinates (refused, it exited 2 and took the job's coordinator with it)."""
    answers = _first_layout(corpus, tmp_path, me=2, ranks={1: 0, 2: 0, 3: -1})
    assert not answers[2].refused and answers[2].ranks == (0,), answers
    assert "--node-rank 0 is taken" in answers[1].refused, answers
    assert not answers[3].refused and answers[3].ranks == (1,), answers


def test_an_agent_whose_copy_of_the_data_differs_is_refused_naming_the_file(corpus, tmp_path):
    """Two hosts whose data files have one length but other contents: a sample's inputs are
    read on its pipeline's first stage and its targets on the last, often on two hosts, so
    the job would train on one copy's inputs against the other's targets, without an error
    (the workers compare counts only). The agent whose copy is not the coordinating agent's
    is refused, naming the file."""
    from spotpipe import job

    from conftest import tiny_config

    cfg = tiny_config(corpus, stages=2, pipelines=1)
    ours = job.data_digest(cfg)
    copy = tmp_path / "copy.txt"
    text = corpus.read_bytes()
    copy.write_bytes(text[:100] + bytes([text[100] ^ 1]) + text[101:])  # one bit, one byte
    theirs = job.data_digest(tiny_config(copy, stages=2, pipelines=1))
    assert len(ours) == 64 and theirs != ours
    spec = SimpleNamespace(data_digest=ours)
    answers = _first_layout(corpus, tmp_path, me=1, ranks={1: -1, 2: -1, 3: -1},
                            max_nodes=3, data={1: ours, 2: theirs, 3: ours}, spec=spec)
    assert not answers[1].refused and not answers[3].refused, answers
    assert str(corpus) in answers[2].refused and "not the coordinating agent's" in \
        answers[2].refused, answers


def test_a_store_lost_during_the_rendezvous_is_said_as_such_not_as_a_timeout(tmp_path,
                                                                            corpus):
    """etcd gone while an agent waits for its answer: the error names the store, within the
    store's reconnect deadline; it was taken for the wait's end, and the agent said at once
    that it had not been admitted within --rdzv-timeout (600 s)."""
    import pytest

    from spotpipe.cluster.agent import Agent
    from spotpipe.store.etcd import EtcdStore, EtcdStoreError

    from conftest import tiny_config
    from etcd_server import free_port

    said: list[str] = []
    opts = AgentOptions(backend="etcd", endpoint="127.0.0.1:1", rdzv_id="job1", min_nodes=2,
                        max_nodes=2, out=tmp_path, rdzv_timeout_s=600.0)
    agent = Agent(opts, tiny_config(corpus, stages=2, pipelines=1), None, TOKEN,
                  None, None)  # type: ignore[arg-type]
    agent.say = said.append  # type: ignore[method-assign]
    gone = EtcdStore("127.0.0.1", free_port(), "/gone", timeout=timedelta(seconds=600),
                     reconnect_s=0.5)
    with pytest.raises(EtcdStoreError, match="unreachable"):
        agent._assignment(gone, 1)
    assert not any("not admitted" in s for s in said), said


def test_a_fresh_host_replaces_a_lost_one_under_max(corpus, tmp_path):
    """--nnodes MIN:MAX bounds the agents in the job, not every agent it ever admitted: a
    host lost (its nodes counted out) or gone on its notice makes room for a fresh one, the
    spot cloud's replacement. Every admitted agent counted toward MAX for good: under
    --nnodes 2:2 one lost host left the job a node short to its end, each replacement
    refused with "the job has its maximum of 2 agents"."""
    from spotpipe.cluster.admission import Coordinating
    from spotpipe.protocol import AgentArrival

    from conftest import tiny_config

    cfg = tiny_config(corpus, stages=2, pipelines=1)
    opts = AgentOptions(backend="etcd", endpoint="127.0.0.1:1", rdzv_id="job1", min_nodes=2,
                        max_nodes=2, out=tmp_path)
    c = Coordinating(opts, cfg, UNREAD_SPEC, TOKEN, None, me=1)  # type: ignore[arg-type]
    c._admitted, c._nodes = [1, 2], ["node0", "node1"]
    c._agent_nodes = {1: ["node0"], 2: ["node1"]}
    fresh = AgentArrival(host="replacement", nproc=1, node_rank=-1, proof="",
                         model_digest=cfg.model_digest(), config_digest=cfg.digest())
    fresh = vouch(fresh, TOKEN, f"job1/{keys.arrival(3)}")
    assert "maximum of 2 agents" in (c._problem(3, fresh, late=True) or "")
    c.node_gone("node1")  # agent 2's host is lost: its node counted out
    assert c._problem(3, fresh, late=True) is None


def test_an_agent_at_the_rendezvous_of_a_lost_job_says_so(tmp_path, corpus, etcd, capfd):
    """A job lost whole (every host gone, or etcd away past its reconnect deadline) leaves
    its keys in etcd: its vouched job record, no end, no coordinator. Agents started again
    under the same --rdzv-id (to --resume it) found a job, asked to be admitted and waited
    out --rdzv-timeout (600 s) for an answer no coordinator would give, saying only that
    they were not admitted. An agent now finds the office vacant past the time a successor
    takes, and says that the job there is not running and what to do."""
    from spotpipe.cluster.agent import Agent
    from spotpipe.store.address import StoreAddress, job_prefix

    from conftest import tiny_config

    cfg = tiny_config(corpus, stages=2, pipelines=1,
                      **{"failover.heartbeat_timeout_s": 2.0, "failover.heartbeat_s": 0.2,
                         "failover.hang_timeout_s": 2.0})
    host, port = etcd.endpoint.split(":")
    address = StoreAddress("etcd", host, int(port), job_prefix("job1"))
    store = address.connect(10.0)
    store.set(keys.JOB, plain(vouch(_posted(new_instance_id()), TOKEN, f"job1/{keys.JOB}")))
    opts = AgentOptions(backend="etcd", endpoint=etcd.endpoint, rdzv_id="job1", min_nodes=2,
                        max_nodes=2, out=tmp_path, rdzv_timeout_s=30.0)
    agent = Agent(opts, cfg, UNREAD_SPEC, TOKEN, address, None)  # type: ignore[arg-type]
    assert agent.run() == 1
    said = capfd.readouterr().err
    assert "not running" in said and "--rdzv-id" in said, said
    assert "not admitted" not in said, said


def test_an_arrival_count_moved_ahead_by_a_stranger_holds_up_no_agent(tmp_path, corpus):
    """The arrivals' count is a plain hint of where writers start. Moved ahead by anyone with
    the store's address (an add, no record), it sent every later agent past slots nobody
    would fill, while the coordinator's admission waits on the first of them: no agent was
    answered again. A writer now finds the slot the count names empty, and starts from the
    first slot instead (as the coordinator puts the mailbox's count back)."""
    store, agent, first, hosted = _admitting(tmp_path, corpus)
    store.add(keys.ARRIVALS, 5)  # a stranger moves the count ahead, writing nothing
    late = agent._arrive(store)
    assert late == first + 1
    _admitted_late(store, late)


def test_a_leader_key_no_lease_holds_is_taken_in_its_place(tmp_path, etcd):
    """Every agent holds the leader key under its lease, so that the key goes with a lost
    holder. One written without a lease (by anything that reaches etcd) never expired: put
    there before the election, no agent ever won it (and the job never started); written
    over a coordinator's, it deposed the coordinator, and no agent could succeed it, all of
    them waiting for the office to fall vacant for ever. Now a campaign takes such a key,
    and a coordinator finding its own overwritten puts it back under its lease."""
    from spotpipe.store.etcd import EtcdStore

    host, port = etcd.endpoint.split(":")

    def store() -> EtcdStore:
        return EtcdStore(host, int(port), "/squat", timeout=timedelta(seconds=10))

    forger = store()
    forger.set(keys.LEADER, "99")  # before any agent arrives
    a = Leadership(store(), "1", ttl_s=2)
    assert a.campaign() and a.leader() == "1"
    forger.set(keys.LEADER, "99")  # over the coordinator's
    assert a.leader() == "99" and a.reclaim() and a.leader() == "1"
    assert store().lease_of(keys.LEADER) == a._lease
    a.resign()
    # a waiting agent finds the office taken by no lease, and takes it (rather than wait)
    forger.set(keys.LEADER, "99")
    said: list[str] = []
    office = _office(tmp_path, "etcd", said, threading.Event())
    office.leadership = Leadership(store(), "3", ttl_s=2)
    office.me = 3
    instance = new_instance_id()
    waiter = threading.Thread(target=office.wait_over, daemon=True, args=(
        store(), _posted(instance), Channel(job_key(TOKEN, instance), "agent3"),
        threading.Event()))
    waiter.start()
    waiter.join(30)  # (no books: it takes the office, then ends the job saying so)
    assert not waiter.is_alive(), said
    # (the misleading "books cannot be read (not a JSON record ...)" before)
    assert any("the coordinator was lost before it kept any books" in s for s in said), said


def _silent_listener():
    """A port that accepts connections (the kernel's backlog) and never answers: what another
    service holding the port is to a TCPStore client."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def test_a_store_address_where_something_else_listens_is_said_not_waited_on(monkeypatch):
    """torch's TCPStore client waits for its handshake's answer for ever, whatever its
    timeout, where something that is no store accepts the connection."""
    from spotpipe.store import address as addresses
    from spotpipe.store.address import StoreAddress, StoreSilent

    monkeypatch.setattr(addresses, "ANSWER_GRACE_S", 0.5)
    sock = _silent_listener()
    port = sock.getsockname()[1]
    try:
        with pytest.raises(StoreSilent, match=f"127.0.0.1:{port}: something accepts "
                                              "connections there but does not answer as a "
                                              "store within 2 s"):
            StoreAddress("tcp", "127.0.0.1", port).connect_answered(1.5)
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        client = StoreAddress("tcp", "127.0.0.1", server.port).connect_answered(5.0)
        client.set("k", "v")
        assert server.get("k") == b"v"
    finally:
        sock.close()


def test_an_agent_whose_c10d_endpoint_another_service_holds_stops_saying_so(tmp_path, corpus):
    """It hung for ever (its c10d store's port taken, it connected as a client of whatever
    held it); now it exits 2 naming the endpoint."""
    import os
    import subprocess
    import sys

    import yaml

    from conftest import REPO, tiny_config

    cfg = tiny_config(corpus, stages=2, **{"cluster.timeout_s": 2.0,
                                           "failover.heartbeat_s": 0.2,
                                           "failover.heartbeat_timeout_s": 1.0,
                                           "failover.hang_timeout_s": 1.0})
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    sock = _silent_listener()
    port = sock.getsockname()[1]
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"), SPOTPIPE_JOIN_TOKEN="t")
        p = subprocess.run([sys.executable, "-m", "spotpipe", "agent", str(config),
                            "--nnodes", "2", "--rdzv-backend", "c10d", "--on-demand",
                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "x",
                            "--out", str(tmp_path / "out")],
                           env=env, capture_output=True, text=True, timeout=120)
    finally:
        sock.close()
    assert p.returncode == 2, p.stderr[-1000:]
    assert f"--rdzv-endpoint: 127.0.0.1:{port}: something accepts connections there but " \
           "does not answer as a store" in p.stderr, p.stderr[-1000:]


def _deposed_unaware(etcd, tmp_path, corpus):
    """A running job's coordinator (agent 1) on etcd whose lease expired while it was cut off
    (its keep-alive has not heard yet, so nothing in it says deposed), and the successor
    (agent 2) that holds the office since. The coordinator, its store, and the successor."""
    import queue

    from spotpipe.cluster.admission import Coordinating
    from spotpipe.store.address import StoreAddress, job_prefix

    from conftest import tiny_config

    host, port = etcd.endpoint.split(":")
    address = StoreAddress("etcd", host, int(port), job_prefix("job1"))
    store = address.connect(10.0)
    old = Leadership(store, "1", ttl_s=5)
    assert old.campaign()
    old._stop.set()  # (cut off: its renewals no longer reach etcd)
    store.revoke_lease(old._lease)  # the lease expires on etcd's clock
    successor = Leadership(address.connect(10.0), "2", ttl_s=5)
    assert successor.campaign() and not old.deposed.is_set()
    cfg = tiny_config(corpus, stages=2, pipelines=1)
    opts = AgentOptions(backend="etcd", endpoint=etcd.endpoint, rdzv_id="job1", min_nodes=1,
                        max_nodes=4, out=tmp_path, nproc=1)
    c = Coordinating(opts, cfg, UNREAD_SPEC, TOKEN, address, 1, old)  # type: ignore[arg-type]
    c._admitted, c._nodes, c._agent_nodes, c._slots = [1], ["node0"], {1: ["node0"]}, {0: 1}
    c._inbox = queue.Queue()  # (the job's loop: its events)
    return c, store, successor


def test_a_deposed_coordinator_answers_no_arrival(tmp_path, corpus, etcd):
    """The successor answers the job's arrivals from its own books; a coordinator deposed
    while cut off, whose admission thread reads an arrival before anything tells it it lost
    the office, must not answer it: two coordinators answered one agent (the deposed one's
    ranks in no successor's books, given again to the next agent), or it answered first and
    the successor, finding an answer, admitted nobody. Nor may it end the job."""
    from spotpipe.cluster.agent import Agent

    from conftest import tiny_config

    c, store, successor = _deposed_unaware(etcd, tmp_path, corpus)
    try:
        agent = Agent(c.opts, tiny_config(corpus, stages=2, pipelines=1), UNREAD_SPEC, TOKEN,
                      c.address, None)  # type: ignore[arg-type]
        assert agent._arrive(store) == c.me  # (the coordinator's own arrival)
        k = agent._arrive(store)
        c._next = k
        c.go(c._inbox)  # its admission thread reads the arrival
        c._late.join(30)
        assert not store.check([keys.assignment(k)]), "a deposed coordinator answered"
        assert not c._late.is_alive()  # it stopped admitting, deposed
        assert c.deposed()
        c.leadership.deposed.clear()  # (unaware again) its end of the job is refused too
        try:
            c._close(store)
        except Exception:  # noqa: BLE001
            pass
        assert not store.check([OVER]), "a deposed coordinator ended the job"
    finally:
        successor.resign()


@pytest.mark.parametrize("own", [False, True])
def test_an_arrival_answered_before_the_books_is_taken_into_them(tmp_path, corpus, own):
    """The coordinator answered an arrival (admitted it, ranks [1]) and was lost before its
    next books: its successor, reading on from the books' next arrival, finds it answered.
    It must take that agent into its books from the answer: before, it only said so, and
    gave the same ranks to the next agent (two workers named node1, two hosts' processes
    under one name), and the job never counted the first one's node. `own`: the arrival is
    the successor's own agent's, come again (a fenced node) under the number it now goes by."""
    from spotpipe.protocol import Assignment, from_plain

    store, agent, first, hosted = _admitting(tmp_path, corpus, me=2 if own else None)
    predecessor_answered = first + 1
    assert not own or predecessor_answered == 2
    store.set(keys.assignment(predecessor_answered), plain(vouch(
        Assignment(ranks=(1,), world=2, joining=True), TOKEN,
        f"job1/{keys.assignment(predecessor_answered)}")))
    assert agent._arrive(store) == predecessor_answered
    k = agent._arrive(store)
    _admitted_late(store, k)
    answer = from_plain(store.get(keys.assignment(k)), Assignment)
    assert answer.ranks == (2,), f"node{answer.ranks[0]} given twice"


def test_a_strangers_answer_to_an_arrival_is_waited_past(corpus, tmp_path, monkeypatch):
    """Anyone who reaches the store can write at an arrival's answer key before the
    coordinator does. The agent took that record for a refusal and left (a stranger could
    keep every host out of the job); it now says so once and waits for the coordinator's
    answer, which overwrites it."""
    from spotpipe.cluster.agent import Agent
    from spotpipe.protocol import Assignment

    from conftest import tiny_config

    cfg = tiny_config(corpus, stages=2, pipelines=1)
    opts = AgentOptions(backend="c10d", endpoint="127.0.0.1:1", rdzv_id="job1", min_nodes=2,
                        max_nodes=2, out=tmp_path, rdzv_timeout_s=60.0)
    agent = Agent(opts, cfg, UNREAD_SPEC, TOKEN, None, None)  # type: ignore[arg-type]
    waiting = threading.Event()
    said: list[str] = []

    def say(text: str) -> None:
        said.append(text)
        if "waiting for the coordinator's answer" in text:
            waiting.set()

    monkeypatch.setattr(agent, "say", say)
    store = dist.HashStore()
    store.set(keys.assignment(3), b'{"type": "assignment", "refused": "go away"}')
    got: list = []
    reader = threading.Thread(target=lambda: got.append(agent._assignment(store, 3)))
    reader.start()
    assert waiting.wait(timeout=60), said
    real = Assignment(ranks=(1,), world=2)
    store.set(keys.assignment(3), plain(vouch(real, TOKEN, f"job1/{keys.assignment(3)}")))
    reader.join(timeout=60)
    assert got and got[0].ranks == (1,) and not got[0].refused, (got, said)
