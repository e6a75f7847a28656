"""Records written into the store without the job's key: every reader refuses them with an
event and reads on (nothing in the store can crash the job or steer it without the key)."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import types

import pytest
import torch.distributed as dist

from spotpipe.cluster import agent as agent_module
from spotpipe.cluster.admission import Coordinating
from spotpipe.cluster.agent import Agent
from spotpipe.cluster.agent_loop import AgentJobLoop
from spotpipe.cluster.coordinator import Coordinator
from spotpipe.cluster.jobloop import JobLoop
from spotpipe.cluster.rendezvous import read_record
from spotpipe.plan import Layout
from spotpipe.protocol import (Abort, AgentArrival, Channel, Event, Exit, JoinAnswer,
                               JoinRequest,
                               MessageError, Prepare, Refused, from_plain, job_key, keys, unseal)
from spotpipe.protocol.bounds import MAX_DEPTH, MAX_RECORD_BYTES
from spotpipe.runtime.standby import JoinRefused, Standby
from spotpipe.store import board
from spotpipe.store.abort import AbortSignal
from spotpipe.store.mailbox import Outbox, read_mailbox
from spotpipe.store.watchers import BoardReader, watch_abort

from conftest import tiny_config
from test_coordinator import KEY, _boundary, _plan, _report  # (its key: its helpers read with it)

DEEP = b"[" * 5000 + b"]" * 5000  # json.loads raises RecursionError on it
HUGE = b'{"p": 1, "pad": "' + b"x" * MAX_RECORD_BYTES + b'"}'


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def test_deep_and_huge_records_are_refused_by_both_parsers():
    for parse in (lambda blob: unseal(KEY, blob), lambda blob: from_plain(blob, Event)):
        with pytest.raises((Refused, MessageError), match="nested too deeply"):
            parse(DEEP)
        # deep enough for the checks that walk it, not for json itself
        with pytest.raises((Refused, MessageError), match="nested too deeply"):
            parse(json.dumps(_nested(MAX_DEPTH + 1)).encode())
        with pytest.raises((Refused, MessageError), match="cap on a record"):
            parse(HUGE)
    # a record nested as deep as a legitimate one gets: opened
    channel = Channel(KEY, "node1")
    deep_event = Event("e", "node1", 0.0, {"d": _nested(20)})
    at = keys.mailbox_slot(1)
    assert channel.open(channel.seal(deep_event, at=at), at=at).message == deep_event


def test_the_mailbox_reads_on_past_a_deep_record():
    store = dist.HashStore()
    board.post(store, keys.MAILBOX, lambda _: DEEP, count_key=keys.MAILBOX_COUNT)
    Outbox(store, Channel(KEY, "node1"), 0.0).event("e", n=1)
    refused: list[Refused] = []
    records = read_mailbox(store, Channel(KEY, "coordinator"), refused.append, timeout_s=5)
    assert next(records).message.details == {"n": 1}
    assert [r.reason for r in refused] == [f"nested too deeply (over {MAX_DEPTH} levels)"]


def test_a_watcher_reads_on_past_every_kind_of_refused_record():
    store = dist.HashStore()
    coordinator, node = Channel(KEY, "coordinator"), Channel(KEY, "node1")
    stranger = Channel(job_key(b"guess", "instance-1"), "coordinator")
    abort_board = keys.abort_board(7)
    for seal in (lambda _: DEEP, lambda _: HUGE, lambda _: b"\xff not json",
                 lambda _: b'{"type": "abort"}',
                 lambda at: stranger.seal(Abort(7, "forged"), 7, at=at)):
        board.post(store, abort_board, seal)
    board.publish(store, coordinator, abort_board, Abort(7, "node2 lost"), 7)
    signal = AbortSignal()
    refused: list[Refused] = []
    watch = watch_abort(store, node, 7, signal, on_refused=refused.append)
    watch.join(30)  # (it ends at the first genuine abort)
    assert signal.reason == "node2 lost"
    assert len(refused) == 5


def test_the_rendezvous_refuses_a_deep_arrival_as_any_malformed_one():
    store = dist.HashStore()
    store.set("arrival", DEEP)
    with pytest.raises(MessageError, match="nested too deeply"):
        read_record(store, "arrival", AgentArrival)


def test_refusal_reasons_are_bounded_whatever_the_record_says(corpus):
    channel = Channel(KEY, "coordinator")
    reasons = set()
    for i in range(3):
        blob = json.dumps({"p": "x" * 1_000_000 + str(i), "mac": "0",
                           "writer": "node1"}).encode()
        with pytest.raises(Refused) as refused:
            channel.open(blob, at="anywhere")
        assert len(refused.value.reason) <= 300 and len(str(refused.value)) <= 300
        reasons.add(refused.value.reason)
    assert len(Refused("y" * 10_000, "w" * 10_000).reason) == 300
    assert len(Refused("y" * 10_000, "w" * 10_000).writer) == 200
    # the coordinator's memory of what it said keeps only bounded keys
    cfg = tiny_config(corpus, stages=2, pipelines=1)
    emitted: list[dict] = []
    coord = Coordinator(cfg=cfg, store=dist.HashStore(), layout=Layout.build(2, 1, ["n0", "n1"]),
                        kill=lambda node: None, emit=emitted.append, now=lambda: 0.0,
                        channel=channel, partition=[(0, 1), (1, 2)])
    coord.refused("node1", "z" * 1_000_000)
    coord.refused("node1", "z" * 1_000_001)  # the same start: said once
    assert len(emitted) == 1 and len(emitted[0]["reason"]) <= 300
    assert all(len(w) + len(r) <= 600 for w, r in coord._refusals)


def test_a_mailbox_count_that_promises_more_than_comes_ends_the_drain_not_the_job():
    """The count is not sealed: raised by a stranger, the drain at the job's end waits out
    the store's timeout for records that never come, says so, and the job finishes."""
    store = dist.HashStore()
    store.add(keys.MAILBOX_COUNT, 5)  # one record posted; four more promised by a stranger
    written: list[dict] = []
    loop = JobLoop.__new__(JobLoop)
    loop._store, loop._inbox, loop._received = store, queue.Queue(), 0
    loop.lines = types.SimpleNamespace(drain=lambda: None)
    loop.t0 = 0.0
    loop.cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(timeout_s=0.2))
    loop.files = types.SimpleNamespace(event=written.append)
    loop.coordinator = types.SimpleNamespace(refused=lambda writer, reason: None)
    loop._inbox.put(Refused("no MAC", "node1"))
    loop._drain()
    short = [e for e in written if e["kind"] == "mailbox_short"]
    assert [(e["promised"], e["came"]) for e in short] == [(5, 1)]


# ------------------------------------------------------------------ joining


def _coordinator(corpus, nodes: list[str]) -> tuple[Coordinator, list[dict]]:
    cfg = tiny_config(corpus, stages=2, pipelines=1, redundancy="lazy")
    emitted: list[dict] = []
    coord = Coordinator(cfg=cfg, store=dist.HashStore(), layout=Layout.build(2, 1, nodes),
                        kill=lambda node: None, emit=emitted.append, now=lambda: 0.0,
                        channel=Channel(KEY, "coordinator"), partition=[(0, 1), (1, 2)])
    return coord, emitted


def _answers(coord: Coordinator, node: str) -> list:
    """What the coordinator posted on `node`'s join board, as `node` reads it."""
    found, index = [], 1
    while coord.store.check([slot := keys.board_slot(keys.join_board(node), index)]):
        found.append(Channel(KEY, node).open(coord.store.get(slot), at=slot).message)
        index += 1
    return found


def _loop(coord: Coordinator, written: list[dict]) -> JobLoop:
    """A job loop with only what taking in a mailbox record needs."""
    loop = JobLoop.__new__(JobLoop)
    loop._received, loop.coordinator = 0, coord
    loop.files = types.SimpleNamespace(event=written.append)
    return loop


def _unkeyed_join(node: str, incarnation: str) -> Refused:
    """A join request written without the key, in `node`'s name, as the job's loop gets it."""
    forged = json.dumps({"p": 1, "type": "join", "ver": 1, "writer": node, "inc": incarnation,
                         "gen": 0, "seq": 1, "body": {"node": node}}).encode()
    with pytest.raises(Refused) as refused:
        Channel(KEY, "coordinator").open(forged, at=keys.mailbox_slot(1))
    return refused.value


def test_an_unkeyed_join_in_a_known_nodes_name_posts_nothing_on_its_board(corpus):
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    _loop(coord, [])._handle_record(_unkeyed_join("node1", "abc"))
    assert _answers(coord, "node1") == []
    refused = [e for e in emitted if e["kind"] == "join_refused"]
    assert [e["node"] for e in refused] == ["node1"] and "not answered" in refused[0]["reason"]
    # a stranger of a name the job does not know is answered, addressed to its request
    _loop(coord, [])._handle_record(_unkeyed_join("node91", "def"))
    [answer] = _answers(coord, "node91")
    assert (answer.outcome, answer.to) == ("refused", "def")


def test_a_keyed_join_refusal_names_the_request_and_one_in_another_name_posts_nothing(corpus):
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    cfg = coord.cfg
    coord.join(JoinRequest("node5", 0.0, cfg.digest(), cfg.model_digest()), "node0", "inc0")
    assert _answers(coord, "node5") == []
    assert [e["node"] for e in emitted if e["kind"] == "join_refused"] == ["node5"]
    coord.join(JoinRequest("node6", 0.0, "another config", cfg.model_digest()), "node6", "inc6")
    [answer] = _answers(coord, "node6")
    assert (answer.outcome, answer.to) == ("refused", "inc6")


def test_a_join_request_from_a_node_running_or_joining_is_ignored(corpus):
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    cfg = coord.cfg
    request = lambda node: JoinRequest(node, 0.0, cfg.digest(), cfg.model_digest())  # noqa: E731
    coord.join(request("node1"), "node1")  # running a stage
    coord.join(request("node2"), "node2")
    coord.join(request("node2"), "node2")  # joining already
    assert coord.joining == ["node2"]
    assert [e["node"] for e in emitted if e["kind"] == "join_accepted"] == ["node2"]
    ignored = [e for e in emitted if e["kind"] == "record_refused"]
    assert [e["node"] for e in ignored] == ["node1", "node2"]
    assert all("ignored" in e["reason"] for e in ignored)


def test_a_node_counted_out_asks_again_and_is_accepted(corpus):
    """A plan places a joiner that then lacks its state: the next Decision counts it out
    (`rejoin`), and its process asks to join again, under its own name."""
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    cfg = coord.cfg
    coord.node_exited("node1", -9)
    _report(coord, "node0", formed=True)
    assert _plan(coord, 0)["action"] == "failover"
    coord.join(JoinRequest("node2", 0.0, cfg.digest(), cfg.model_digest()), "node2")
    coord.report(_boundary(coord, "node0"), "node0")
    assert [0, 1, "node2"] in _plan(coord, 1)["layout"]["owners"]
    _report(coord, "node0", untouched=True, committed_through=6)
    _report(coord, "node2", lacking=["stage 1", "replica 0"], committed_through=-1)
    assert _plan(coord, 2)["rejoin"] == ["node2"]
    coord.join(JoinRequest("node2", 0.0, cfg.digest(), cfg.model_digest()), "node2")
    assert coord.joining == ["node2"]
    assert [e["node"] for e in emitted if e["kind"] == "join_accepted"] == ["node2", "node2"]


def test_a_fenced_node_asks_again_once_it_is_gone(corpus):
    """A fenced node's agent starts a new node in its place once the fenced process has
    exited; a request in the fenced node's own name while it still runs is its hung process's,
    and is ignored."""
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    cfg = coord.cfg
    coord._fence("node1", "hung")
    coord.join(JoinRequest("node1", 0.0, cfg.digest(), cfg.model_digest()), "node1")
    assert coord.joining == []
    coord.node_exited("node1", -9)
    for node in ("node1", "node2"):  # (its agent arrives again: the new node's is a new name)
        coord.join(JoinRequest(node, 0.0, cfg.digest(), cfg.model_digest()), node)
    assert coord.joining == ["node1", "node2"]


def _waiting_node(store: dist.Store, key: bytes, events: list) -> Standby:
    """node5 waiting to be placed, with only what that wait needs (its answers on a board of
    an in-memory store, the records it refuses in a list)."""
    protocol = Channel(key, "node5")
    answers = BoardReader(store, protocol, keys.join_board("node5"),
                          expect=(JoinAnswer, Prepare), writers={"coordinator"})
    return Standby(answers, protocol.sealer.incarnation,
                   outbox=types.SimpleNamespace(event=lambda kind, **d: events.append(d)),
                   notices=types.SimpleNamespace(is_set=lambda: False, source=""),
                   activity=types.SimpleNamespace(waiting=contextlib.nullcontext),
                   prepare=lambda plan: None, refused=events.append)


def test_a_waiting_node_reads_past_junk_and_refusals_of_other_requests(corpus):
    coord, _ = _coordinator(corpus, ["node0", "node1"])
    store, events = coord.store, []
    worker = _waiting_node(store, KEY, events)
    board_key = keys.join_board("node5")
    stranger = Channel(job_key(b"guess", "test"), "coordinator")
    for seal in (lambda _: DEEP, lambda _: b"junk",
                 lambda at: stranger.seal(JoinAnswer("node5", "refused", message="go"), at=at),
                 lambda at: stranger.seal(JoinAnswer("node5", "refused", to="another",
                                                     message="go"), at=at)):
        board.post(store, board_key, seal)
    # a keyed request another process made in node5's name, refused by the job
    coord.join(JoinRequest("node5", 0.0, "another config", coord.cfg.model_digest()), "node5",
               "another incarnation")
    board.publish(store, coord.channel, board_key, JoinAnswer("node5", "finished"))
    assert worker.wait() is None
    assert len(events) == 5


def test_a_node_with_another_token_learns_it_from_the_refusal_of_its_own_request(corpus):
    coord, _ = _coordinator(corpus, ["node0", "node1"])
    events: list[dict] = []
    worker = _waiting_node(coord.store, job_key(b"guess", "test"), events)
    board.post(coord.store, keys.join_board("node5"), lambda _: b"junk")
    loop = _loop(coord, [])
    loop._handle_record(_unkeyed_join("node5", "someone else"))
    loop._handle_record(_unkeyed_join("node5", worker.incarnation))
    with pytest.raises(JoinRefused, match="did not present this job's join token"):
        worker.wait()
    assert len(events) == 3  # the junk, the refusal of the other request, its own


# ------------------------------------------------------------------ exits an agent reports

FORK_SERVER_DIED = ("on host-b, the fork server that starts the workers was killed by SIGKILL, "
                    "and they died with it")


def _exit_record(writer: str, exit_: Exit, slot: int = 1):
    """`exit_` sealed with the job's key by `writer`, as the coordinator's mailbox reader
    gets it: opened, or refused."""
    at = keys.mailbox_slot(slot)
    blob = Channel(KEY, writer).seal(exit_, at=at)
    try:
        return Channel(KEY, "coordinator").open(blob, at=at)
    except Refused as refused:
        return refused


def _admitted(agents: dict[int, list[int]]) -> Coordinating:
    """The coordinating agent's admission books: agent k runs the nodes of its ranks."""
    books = Coordinating(None, types.SimpleNamespace(stages=2, pipelines=1), None, "",
                         None, me=1)  # (what its books need)
    for k, ranks in agents.items():
        books._book(k, None, ranks)
    return books


def _agents_loop(coord: Coordinator, written: list[dict], books: Coordinating) -> AgentJobLoop:
    """The coordinating agent's loop with only what taking in an exit needs."""
    loop = AgentJobLoop.__new__(AgentJobLoop)
    loop._received, loop.coordinator, loop._exited, loop._shadows = 0, coord, {}, None
    loop.files = types.SimpleNamespace(event=written.append)
    loop.rdzv = books
    return loop


def test_a_workers_cause_of_death_on_another_host_is_said_where_a_local_one_is(corpus):
    """node1's fork server on host-b died and took node1 with it: its agent says so in the
    exit record, and the coordinator on another host says it in the loss's events and in the
    job's final message, as the local launcher does (before: a bare "exited with code -9")."""
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    loop = _agents_loop(coord, [], _admitted({1: [0], 2: [1], 3: [2]}))  # (node2: a spare)
    loop._take(_exit_record("agent2", Exit("node1", -9, FORK_SERVER_DIED)))
    lost = [e for e in emitted if e["kind"] == "node_lost"]
    assert [(e["node"], e["returncode"], e.get("reason")) for e in lost] == [
        ("node1", -9, FORK_SERVER_DIED)]
    detected = [e["reason"] for e in emitted if e["kind"] == "failure_detected"]
    assert detected == [f"node1 exited with code -9 ({FORK_SERVER_DIED})"]
    loop._take(_exit_record("agent1", Exit("node0", -9)))  # (no cause: a signal of its own)
    assert coord.stop_message.startswith(FORK_SERVER_DIED + "; "), coord.stop_message


def test_an_exit_record_is_taken_only_from_the_agent_of_the_nodes_host(corpus):
    """A record in the job's key about another host's node, or from a worker, or under the
    local launcher (whose own supervisor sees its workers' exits) counts nobody out: refused,
    with an event naming the writer."""
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    loop = _agents_loop(coord, [], _admitted({1: [0], 2: [1]}))
    for writer in ("agent1", "node0", "node1", "coordinator", "agent", "agent9"):
        loop._take(_exit_record(writer, Exit("node1", -9, FORK_SERVER_DIED)))
    local = _loop(coord, [])
    local._exited = {}
    local._take(_exit_record("agent2", Exit("node1", -9)))
    assert not [e for e in emitted if e["kind"] in ("node_lost", "failure_detected")]
    refused = [(e["node"], e["reason"]) for e in emitted if e["kind"] == "record_refused"]
    assert refused[0] == ("agent1", "an exit record for node1, which agent1 does not run")
    assert [w for w, _ in refused] == ["agent1", "node0", "node1", "coordinator", "agent",
                                       "agent9", "agent2"]
    assert refused[-1][1] == "an exit record for node1, where no agent runs the workers"
    assert not loop._exited and not local._exited


def test_an_exit_cause_that_is_not_one_short_line_of_plain_text_is_refused(corpus):
    """The cause goes into the job's output: a record whose cause would forge a line of it
    (a newline), steer a terminal (an escape), reorder its text (a bidirectional override)
    or flood it is refused whole, as any malformed record."""
    coord, emitted = _coordinator(corpus, ["node0", "node1"])
    loop = _agents_loop(coord, [], _admitted({1: [0], 2: [1]}))
    for cause in ("died\n  9999.00s  node0: lost", "\x1b[2Jdied", "died \u202egnol",
                  "x" * 401):
        forged = Exit("node1", -9)
        object.__setattr__(forged, "cause", cause)  # (past the writer's own check)
        refused = _exit_record("agent2", forged)
        assert isinstance(refused, Refused), cause
        assert refused.reason.startswith("exit.cause: "), refused.reason
        loop._take(refused)
    assert not [e for e in emitted if e["kind"] == "node_lost"]
    # what a writer sends is always such a line (said in full up to the bound)
    assert Exit("node1", -9, "x" * 400).cause == "x" * 400
    with pytest.raises(MessageError, match="not one line of plain text"):
        Exit("node1", -9, "two\nlines")


def test_an_agent_that_came_again_still_reports_on_its_hosts_nodes(corpus):
    """An agent comes again under a new arrival number when its node is fenced or crashes,
    but seals its records as before: its exits are its host's, through every renaming, and a
    successor coordinator's books keep the renamings."""
    books = _admitted({1: [0, 1], 2: [2, 3]})
    books._book(3, 1, [4])  # agent1 came again as agent3, with node4 for node0
    books._book(5, 3, [5])  # and again as agent5
    assert all(books.runs("agent1", f"node{r}") for r in (0, 1, 4, 5))
    assert books.runs("agent5", "node5") and books.runs("agent3", "node0")
    assert not books.runs("agent1", "node2") and not books.runs("agent2", "node0")
    assert not books.runs("node0", "node0") and not books.runs("agent-1", "node0")
    assert books.admission()["renamed"] == {"1": 3, "3": 5}


def test_an_agent_says_its_fork_servers_end_in_one_bounded_line(monkeypatch):
    """What the agent sends is what the record's reader accepts, whatever the host's name;
    and nothing where its supervisor knows no more than the code."""
    said = "the fork server that starts the workers was killed by SIGKILL, and they died with it"
    monkeypatch.setattr(agent_module.socket, "gethostname", lambda: "host-b\n\x1b[2J" + "h" * 500)
    cause = Agent._exit_cause(said)
    assert cause == "on host-b  [2J" + "h" * 50 + "..., " + said  # (the name cut at 64)
    assert Exit("node1", -9, cause).cause == cause  # (accepted by the check)
    monkeypatch.setattr(agent_module.socket, "gethostname", lambda: "host-b")
    assert Agent._exit_cause(said) == f"on host-b, {said}"
    assert Agent._exit_cause("") == ""


def test_an_agent_says_its_workers_died_with_their_fork_server_not_of_a_crash():
    """The agent's own word on a worker it did not stop (its output, `worker_crashed`) names
    the fork server's end, as the job's does: before, "died of SIGKILL" alone, a crash."""
    agent = Agent.__new__(Agent)
    said: list[str] = []
    agent.say, agent._lock, agent._restarts = said.append, threading.Lock(), 0
    agent.opts, agent._posted = types.SimpleNamespace(max_restarts=0), types.SimpleNamespace(t0=0)
    agent.channel, store = Channel(KEY, "agent2"), dist.HashStore()
    why = "the fork server that starts the workers was killed by SIGKILL, and they died with it"
    agent._crashed("node1", -9, store, why)
    assert said == [f"node1 died of SIGKILL ({why}) while its host lives; the job goes on "
                    "without it (--max-restarts N would start a fresh node in its place)"]
    event = Channel(KEY, "coordinator").open(store.get(keys.mailbox_slot(1)),
                                             at=keys.mailbox_slot(1)).message
    assert (event.kind, event.details["signal"], event.details["cause"]) == (
        "worker_crashed", "SIGKILL", why)


def test_a_failed_worker_of_another_host_is_said_with_where_its_log_is(corpus, tmp_path):
    """A worker's error ends the job; its log is on its own host, in its agent's --out (the
    message named the coordinating agent's folder, where no such file is)."""
    coord, _ = _coordinator(corpus, ["node0", "node1"])
    loop = _agents_loop(coord, [], _admitted({1: [0], 2: [1]}))  # (agent1: this host)
    loop.out, loop._errors, loop._drain = tmp_path, {"node1": "ValueError: boom"}, lambda: None
    loop.t0 = 0.0
    assert loop._failed("node1", 1, "worker_failed") == (
        "node1 failed: ValueError: boom (log: logs/node1.log in the --out of its host's agent)")
    assert loop._failed("node0", 1, "worker_failed") == (
        f"node0 failed: exited with code 1 (log: {tmp_path}/logs/node0.log)")
