"""etcd as the job's store: the c10d operations, training on it, and etcd restarting mid-run.

The `etcd` fixture (conftest.py) starts a real etcd on loopback with a temporary data
directory; .ci/run installs Debian's etcd-server so that CI never skips these.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from spotpipe.store.etcd import EtcdStore
from spotpipe.cluster.launcher import LaunchError, train
from spotpipe.config import ConfigError
from spotpipe.faults import Fault

from conftest import tiny_config
from test_cli_errors import workers_running
from test_equivalence import reference
from test_failover import FAST, assert_samples_exactly_once, events


def _store(etcd, prefix: str, timeout_s: float = 10.0) -> EtcdStore:
    host, port = etcd.endpoint.split(":")
    return EtcdStore(host, int(port), prefix, timeout=timedelta(seconds=timeout_s))


def _etcd_cfg(corpus, etcd, **extra):
    return tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy",
                       **{**FAST, "cluster.store": "etcd", "cluster.etcd_endpoint": etcd.endpoint,
                          **extra})


def test_store_operations_and_namespaces(etcd):
    a, b = _store(etcd, "/spotpipe/jobs/a"), _store(etcd, "/spotpipe/jobs/b")
    a.set("k", "1")
    assert a.get("k") == b"1" and not b.check(["k"])  # jobs do not see each other's keys
    assert [a.add("n", 1), a.add("n", 5), a.add("n", 0)] == [1, 6, 6]
    assert a.compare_set("leader", "", "x") == b"x"  # missing + empty expectation: set
    assert a.compare_set("leader", "", "y") == b"x"  # taken: the holder is returned
    assert a.compare_set("leader", "x", "z") == b"z"
    assert a.delete_key("k") and not a.delete_key("k") and not a.check(["k"])
    with pytest.raises(dist.DistStoreError):
        a.wait(["never"], timedelta(seconds=0.3))
    # a blocked wait wakes when another client writes the key
    woke = threading.Event()
    t = threading.Thread(target=lambda: (a.wait(["late"]), woke.set()))
    t.start()
    b2 = _store(etcd, "/spotpipe/jobs/a")
    b2.set("late", "v")
    t.join(timeout=10)
    assert woke.is_set()
    # gloo rendezvous over it (through a PrefixStore, as runtime/comm.py builds its groups)
    out = {}

    def rank(r: int) -> None:
        # keep the Python store alive while C++ uses it: the trampoline finds its methods
        # through the Python object
        store = _store(etcd, "/spotpipe/jobs/a")
        pg = dist.ProcessGroupGloo(dist.PrefixStore("g", store), r, 2, timedelta(seconds=20))
        x = torch.full((3,), float(r + 1))
        pg.allreduce([x]).wait()
        out[r] = x

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(timeout=30) for t in ts]
    assert torch.equal(out[0], torch.full((3,), 3.0)) and torch.equal(out[1], out[0])
    # a generation's keys go by their prefix (`cluster.collect`), no one else's
    for key in ("spotpipe/gen1/abort/1", "spotpipe/gen1/world/0/0", "spotpipe/gen10/abort/1"):
        a.set(key, "x")
    assert a.delete_under("spotpipe/gen1/") == 2
    assert a.check(["spotpipe/gen10/abort/1", "g/0/0"]) and not a.check(["spotpipe/gen1/abort/1"])
    a.delete_prefix()
    assert a.num_keys() == 0 and b.check([]) and not b.check(["k"])


def test_store_survives_an_etcd_restart(etcd):
    store = _store(etcd, "/spotpipe/jobs/r", timeout_s=30)
    store.set("before", "1")
    assert store.add("n", 1) == 1
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (store.wait(["after"]), woke.set()))
    waiter.start()
    etcd.kill()
    # calls during the outage retry until etcd is back (bounded by the reconnect deadline)
    done: dict = {}
    writer = threading.Thread(target=lambda: done.update(n=store.add("n", 1)))
    writer.start()
    etcd.start()
    writer.join(timeout=30)
    assert done == {"n": 2}  # counted once, though the first attempts failed
    assert store.get("before") == b"1"  # the data directory kept it
    _store(etcd, "/spotpipe/jobs/r").set("after", "x")
    waiter.join(timeout=30)
    assert woke.is_set()
    store.delete_prefix()


def test_leader_election_under_a_lease(etcd):
    """etcd's election recipe (store.leader): one agent wins the put-if-absent under its
    lease, the other loses and watches; when the winner stops renewing (its host lost), etcd
    expires the lease, the key goes, the watcher wakes and wins; the old leader then finds
    its lease gone (deposed)."""
    from spotpipe.protocol import keys
    from spotpipe.store.leader import Leadership

    from spotpipe.checkpoint.transfer import ReceiverWatch
    from spotpipe.store.sealed import SealedStore

    a = Leadership(_store(etcd, "/el"), "1", ttl_s=2)
    b = Leadership(_store(etcd, "/el"), "2", ttl_s=2)
    assert a.campaign() and a.leader() == "1"
    # a worker's upload to the coordinator (agent 1) watches its office (transfer.py)
    upload = ReceiverWatch.of(SealedStore(_store(etcd, "/el"), b"k" * 32), every_s=0.1)
    assert upload is not None and upload.holder == b"1"
    assert not b.campaign() and b.leader() == "1"
    assert b.wait_vacant("over", 1.0) is None  # renewed: the office stays taken
    assert upload.gone() == ""
    a._stop.set()  # the leader's host is gone: nothing renews its lease
    assert b.wait_vacant("over", 30.0) == "vacant"
    assert "agent 1" in upload.gone() and "(vacant)" in upload.gone()
    assert b.campaign() and b.leader() == "2"
    assert "(now agent 2's)" in upload.gone()
    assert not a.store.keep_alive(a._lease)  # the old leader would learn it is deposed
    store = _store(etcd, "/el")
    store.set("over", "1")
    assert b.wait_vacant("over", 5.0) == "over"
    b.resign()
    assert not store.check([keys.LEADER])  # resigning deletes the key with the lease
    # an office handed on that nobody takes is taken back: a fresh term under a new lease
    assert not b.wait_taken("never", 0.5)
    assert b.campaign() and b.leading and b.leader() == "2"
    assert a.wait_taken("never", 1.0)
    b.resign()


def test_a_resign_during_a_renewal_deposes_no_one():
    """The keep-alive thread renewing at the moment the leader resigns (its office handed
    on) hears the lease gone: that is the resignation, not a deposition (which made the
    agent that handed over exit 1, saying it had lost its lease)."""
    import threading

    from spotpipe.store.leader import Leadership

    class Store:  # etcd's part that the recipe uses, with a renewal held open
        def __init__(self) -> None:
            self.renewing, self.answer = threading.Event(), threading.Event()

        def grant_lease(self, ttl: int) -> int:
            return 7

        def create_leased(self, key: str, value: str, lease: int) -> bytes:
            return value.encode()

        def keep_alive(self, lease: int) -> bool:
            self.renewing.set()
            self.answer.wait(10)
            return False  # revoked meanwhile

        def revoke_lease(self, lease: int) -> None:
            pass

    store = Store()
    leader = Leadership(store, "1", ttl_s=1)  # type: ignore[arg-type]
    assert leader.campaign()
    assert store.renewing.wait(10)
    leader.resign()
    store.answer.set()
    leader._thread.join(10)
    assert not leader._thread.is_alive() and not leader.deposed.is_set()


def test_unreachable_etcd_is_refused_before_anything_starts(tmp_path, corpus):
    from etcd_server import free_port

    cfg = tiny_config(corpus, **{"cluster.store": "etcd",
                                 "cluster.etcd_endpoint": f"127.0.0.1:{free_port()}"})
    with pytest.raises(LaunchError, match="cluster.etcd_endpoint"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="cluster.etcd_endpoint"):
        tiny_config(corpus, **{"cluster.store": "etcd"})
    with pytest.raises(ConfigError, match="cluster.etcd_endpoint"):
        tiny_config(corpus, **{"cluster.store": "etcd", "cluster.etcd_endpoint": "nohost"})


def test_training_on_etcd_with_a_failover_matches_tcpstore(tmp_path, corpus, etcd):
    """P=2, D=1 with node1 crashing at iteration 3: the same final parameters, bit for bit, on
    etcd as on the embedded TCPStore; the job's keys are gone afterwards."""
    faults = [Fault.parse("fail", "node1@3", ["node0", "node1"])]
    on_etcd, on_tcp = tmp_path / "etcd", tmp_path / "tcp"
    cfg = _etcd_cfg(corpus, etcd)
    assert train(cfg, on_etcd, progress=False, faults=faults) == 0
    tcp_cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy", **FAST)
    assert train(tcp_cfg, on_tcp, progress=False, faults=faults) == 0
    got = load_file(str(on_etcd / "final" / "model.safetensors"))
    want = load_file(str(on_tcp / "final" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    launch = events(on_etcd)[0]
    assert launch["store_kind"] == "etcd" and launch["store"] == etcd.endpoint
    assert [e["action"] for e in events(on_etcd) if e["kind"] == "plan"] == ["failover"]
    assert_samples_exactly_once(on_etcd, cfg)
    assert _store(etcd, launch["store_prefix"]).num_keys() == 0
    assert workers_running(on_etcd) == [] and workers_running(on_tcp) == []


def test_job_survives_an_etcd_restart_mid_run(tmp_path, corpus, etcd):
    cfg = _etcd_cfg(corpus, etcd, iterations=40)
    run = tmp_path / "run"
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(code=train(cfg, run, progress=False)))
    job.start()
    metrics = run / "metrics.jsonl"

    def at_iteration() -> int:
        if not metrics.exists():
            return -1
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["iter"] if lines else -1

    while job.is_alive() and at_iteration() < 8:  # a real condition: training is under way
        time.sleep(0.05)
    assert job.is_alive(), "the job finished before etcd could be restarted"
    restarted_at = at_iteration()
    etcd.restart()  # SIGKILL, then the same data directory
    job.join(timeout=600)
    assert result.get("code") == 0, (run / "summary.json").read_text()
    assert restarted_at < cfg.iterations - 1
    want, _ = reference(tiny_config(corpus, stages=2, pipelines=1, **{**FAST, "iterations": 40}))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert_samples_exactly_once(run, cfg)
    assert [e for e in events(run) if e["kind"] == "plan"] == []  # nobody was lost
    assert workers_running(run) == []


def test_a_store_lost_for_good_ends_the_job_saying_so(tmp_path, corpus, etcd):
    """etcd goes away for good while the job trains (one back within `cluster.timeout_s` is
    ridden out: the test above). Nothing can go on without it, so the job ends: exit 1, the
    reason in its summary, its last event and its last line, its workers stopped. Before,
    the loop's cleanup (the mailbox's closing record, the job's keys) raised the store's
    error out of `train`: a traceback, and no summary."""
    cfg = _etcd_cfg(corpus, etcd, iterations=5000, **{"cluster.timeout_s": 5.0})
    run = tmp_path / "run"
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(code=train(cfg, run, progress=False)))
    job.start()
    metrics = run / "metrics.jsonl"
    while job.is_alive() and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.05)  # (a real condition, polled: training is under way)
    assert job.is_alive(), "the job ended before etcd was lost"
    etcd.kill()
    job.join(timeout=300)
    assert not job.is_alive() and result.get("code") == 1, result
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["iterations"] < cfg.iterations
    assert summary["message"].startswith(f"lost the store: etcd at {etcd.endpoint} "
                                         "unreachable for 5 s"), summary["message"]
    last = events(run)[-1]
    assert last["kind"] == "job_failed" and last["message"] == summary["message"]
    assert workers_running(run) == []


def test_pipelines_go_two_one_two_on_etcd(tmp_path, tmp_path_factory, corpus, etcd):
    """Membership on etcd: D = 2 -> 1 (adjacent losses drop a pipeline) -> 2 (two nodes join,
    gated on iterations through the store, and form one); every sample exactly once."""
    from test_membership import check_pipelines_two_one_two

    check_pipelines_two_one_two(tmp_path, tmp_path_factory, corpus,
                                **{"cluster.store": "etcd", "cluster.etcd_endpoint": etcd.endpoint})


def test_shadow_restore_on_etcd(tmp_path, corpus, etcd):
    """CPU shadows link to their writers through the store: on etcd, a stage lost without a
    replica (redundancy off) comes back from its shadow, exactly."""
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="none",
                      **{**FAST, "shadow.enabled": True, "cluster.store": "etcd",
                         "cluster.etcd_endpoint": etcd.endpoint})
    run = tmp_path / "run"
    assert train(cfg, run, progress=False,
                 faults=[Fault.parse("fail", "node1@3", ["node0", "node1"])]) == 0
    assert [e["action"] for e in events(run) if e["kind"] == "plan"] == ["restore_from_shadow"]
    want, _ = reference(tiny_config(corpus, stages=2, pipelines=1, **FAST))
    got = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert_samples_exactly_once(run, cfg)
    assert workers_running(run) == []


def test_a_guarded_client_writes_only_while_its_guard_holds(etcd):
    """The coordinator writes through a client guarded by the leader key (`guarded`): each
    write lands in one transaction with the check that the key still names it. Once another
    agent holds the office, every kind of write is refused whole (NotLeader, after telling
    `on_refused`), and nothing of it is in the store; a compare_set that fails on its own
    compare while the guard holds answers as usual."""
    from spotpipe.protocol import keys
    from spotpipe.store.leader import NotLeader

    store = _store(etcd, "/guarded")
    store.set(keys.LEADER, "1")
    refused: list[int] = []
    g = store.guarded(keys.LEADER, "1", on_refused=lambda: refused.append(1))
    g.set("a", "x")
    assert g.compare_set("b", "", "y") == b"y" and g.compare_set("b", "", "z") == b"y"
    assert g.add("n", 2) == 2
    g.multi_set(["c", "d"], ["1", "2"])
    assert g.delete_key("d") and refused == []
    g.set("gen1/x", "1")
    assert g.delete_under("gen1/") == 1 and refused == []
    g.multi_set(["mail/1", "mail/2", "mail/3"], [".", ".", "."])
    g.delete_keys(["mail/1", "mail/2", "mail/9"])  # (the mailbox's old read slots)
    assert [store.check([f"mail/{i}"]) for i in (1, 2, 3)] == [False, False, True]
    store.set(keys.LEADER, "2")  # a successor holds the office
    writes = [lambda: g.set("a", "stale"), lambda: g.compare_set("e", "", "stale"),
              lambda: g.compare_set("b", "y", "stale"), lambda: g.add("n", 1),
              lambda: g.multi_set(["c", "f"], ["stale", "stale"]), lambda: g.delete_key("c"),
              lambda: g.delete_under("c"), lambda: g.delete_keys(["c"])]
    for write in writes:
        with pytest.raises(NotLeader):
            write()
    assert len(refused) == len(writes)
    assert [store.get(k) for k in ("a", "b", "n", "c")] == [b"x", b"y", b"2", b"1"]
    assert not store.check(["e"]) and not store.check(["f"])
    store.delete_key(keys.LEADER)  # (vacant: no one's guard holds)
    with pytest.raises(NotLeader):
        g.set("a", "stale")
    store.delete_prefix()


def test_a_client_writing_while_the_jobs_record_stands_writes_nothing_once_it_is_gone(etcd):
    """An agent's clients, and its workers', write only while the job's record stands
    (`StoreAddress.writing_while`). A host cut off until the job ended and its keys were
    deleted put three back once it reached etcd again (its worker's last heartbeat, its
    agent's report of that worker's exit and the mailbox's count: tests/test_netns.py, a CI
    run with tests two at a time); each kind of write is now refused whole, as a store gone."""
    from spotpipe.protocol import keys
    from spotpipe.store.address import StoreAddress
    from spotpipe.store.etcd import JobGone

    host, port = etcd.endpoint.split(":")
    address = StoreAddress("etcd", host, int(port), "/while").writing_while(keys.JOB)
    assert StoreAddress.from_env(address.env()) == address  # (as workers get it)
    plain, store = _store(etcd, "/while"), address.connect(10)
    plain.set(keys.JOB, "the job")
    store.set("a", "1")
    assert store.compare_set("b", "", "2") == b"2" and store.add("n", 1) == 1
    store.multi_set(["c"], ["3"])
    assert store.delete_key("c")
    plain.delete_prefix()  # the job ended: its keys are deleted
    writes = [lambda: store.set(keys.heartbeat("node0"), "beat"),
              lambda: store.compare_set(keys.mailbox_slot(1), "", "exit"),
              lambda: store.add(keys.MAILBOX_COUNT, 1), lambda: store.multi_set(["c"], ["3"]),
              lambda: store.delete_keys(["a"])]
    for write in writes:
        with pytest.raises(JobGone, match="the job ended"):
            write()
    assert plain.num_keys() == 0


def test_a_deposed_coordinators_plan_never_reaches_the_board(etcd, corpus):
    """A coordinator cut off past its lease, back before its keep-alive heard, publishes the
    plan its last report completed: through its guarded client the plan is refused and the
    coordinator deposed, so the nodes never see two plans of one generation (the successor
    then had to stop the job: `test_coordinator`)."""
    from spotpipe.cluster.coordinator import Coordinator
    from spotpipe.plan import Layout
    from spotpipe.protocol import Channel, Report, job_key, keys
    from spotpipe.store.leader import Leadership, NotLeader

    store = _store(etcd, "/deposed-plan")
    old = Leadership(store, "1", ttl_s=5)
    assert old.campaign()
    old._stop.set()  # (cut off: its renewals no longer reach etcd)
    store.revoke_lease(old._lease)
    successor = Leadership(_store(etcd, "/deposed-plan"), "2", ttl_s=5)
    assert successor.campaign()
    try:
        coord = Coordinator(
            cfg=tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy"),
            store=old.fenced(store, "1"), layout=Layout.build(2, 1, ["node0", "node1"]),
            kill=lambda node: None, emit=lambda e: None, now=lambda: 0.0,
            channel=Channel(job_key(b"sesame", "t"), "coordinator"), partition=[(0, 1), (1, 2)])
        report = dict(generation=0, boundary=True, iteration=5, position=0, instruction="",
                      committed_through=5, stepped_through=5, done=(), clip_scale=None,
                      flight=-1, formed=True, lacking=(), untouched=True, replica=None,
                      leaving=False,
                      reason="the layout changes at this iteration boundary", time_s=0.0)
        coord.report(Report(node="node0", **report), "node0")
        with pytest.raises(NotLeader):
            coord.report(Report(node="node1", **report), "node1")
        assert old.deposed.is_set()
        assert not store.check([keys.board_slot(keys.decision_board(0), 1)])
    finally:
        successor.resign()
        store.delete_prefix()


def test_a_write_refused_for_want_of_the_office_ends_the_renewals():
    """A coordinator deposed by a write its guard refused holds a lease that holds no key:
    it is deposed, and its keep-alive thread stops renewing that lease."""
    from spotpipe.store.leader import Leadership, NotLeader

    class Store:  # etcd's part that the recipe uses; every guarded write refused
        def grant_lease(self, ttl: int) -> int:
            return 7

        def create_leased(self, key: str, value: str, lease: int) -> bytes:
            return value.encode()

        def keep_alive(self, lease: int) -> bool:
            return True

        def guarded(self, key: str, holds: str, on_refused):
            class Guarded:
                def set(self, key: str, value: str) -> None:
                    on_refused()
                    raise NotLeader(key)
            return Guarded()

    leader = Leadership(Store(), "1", ttl_s=2)  # type: ignore[arg-type]
    assert leader.campaign()
    with pytest.raises(NotLeader):
        leader.fenced(leader.store, "1").set("k", "v")
    assert leader.deposed.is_set()
    leader._thread.join(10)
    assert not leader._thread.is_alive()
