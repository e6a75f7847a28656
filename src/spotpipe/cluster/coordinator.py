"""Failure handling on the launcher's (or agent's) side: collect, recover, publish.

The coordinator lives next to the store, in the process that is never preempted. It learns of
failures three ways: a worker process exits (the launcher sees it at once), a worker reports a
broken connection or a notice (a sealed Report in the mailbox), or heartbeats say a node is
dead or hung (then it fences the node: a hung process must not come back into a job that
moved on).

Agreement runs per generation: an Abort record wakes every survivor, each reports where it
stands, and once every live node has reported or is known dead, `plan.recovery.recover`
decides. The coordinator decides nothing itself: it publishes the Decision on the
generation's decision board, which every survivor is waiting on, and keeps the books (who is
dead, fenced, finished, waiting to join).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch.distributed as dist

from spotpipe.cluster.liveness import Liveness, StoreWatch, hung
from spotpipe.cluster.join_checks import join_problem
from spotpipe.config import Config
from spotpipe.plan import Layout
from spotpipe.plan.policy import Action, Room
from spotpipe.plan.recovery import (CARRIED_OUT, Decision, History, NodeReport, Outcome, Rules,
                                    recover, settle)
from spotpipe.cluster import succession
from spotpipe.cluster.collect import KEPT_GENERATIONS, GenerationRecords, collect
from spotpipe.protocol import (Abort, Channel, CoordinatorState, DecisionRecord, JoinAnswer,
                               JoinRequest, Notice, Prepare, Regroup, Report, Stalled, keys)
from spotpipe.protocol.auth import REASON_CHARS, WRITER_CHARS
from spotpipe.store import board

# why a node that ended with code 0 while the job had iterations left is lost
EXITED_EARLY = "it exited with code 0 before the job's end"


def rules_for(cfg: Config, partition_for: Callable[[int], Any] | None,
              min_stages: int = 1, room: Room | None = None) -> Rules:
    """The job's configuration as recovery rules (the simulator builds the same from its
    own options); `min_stages`: the smallest depth whose stages fit (`job.min_stages`);
    `room`: whether a node's memory holds a set of stages (`plan.policy.Room`)."""
    blocked = None
    if cfg.shadow.enabled or cfg.checkpoint.scheme == "gemini":
        blocked = ("the " + ("CPU shadows" if cfg.shadow.enabled else "gemini peer copies")
                   + " hold the stages of the launch partition; the job keeps its carriers")
    return Rules(replicas=cfg.redundancy != "none", shadows=cfg.shadow.enabled,
                 repartition=cfg.failover.repartition, replay_rest=cfg.failover.replay == "rest",
                 microbatches=cfg.num_microbatches * cfg.pipelines, repartition_blocked=blocked,
                 partition_for=partition_for, min_stages=min_stages, room=room)


@dataclass
class Collecting:
    """Agreement in progress for one generation."""

    generation: int
    started_s: float
    reasons: list[str] = field(default_factory=list)
    reports: dict[str, Report] = field(default_factory=dict)


Partition = list[tuple[int, int]]


@dataclass(frozen=True)
class Agreed:
    """An agreement: iterations before `resume` are committed, as of `generation` under
    `layout`, whose nodes reported `reports`."""

    generation: int
    layout: Layout
    resume: int
    reports: Mapping[str, Report]


class Coordinator:
    def __init__(self, *, cfg: Config, store: dist.Store, layout: Layout,
                 kill: Callable[[str], None], emit: Callable[[dict[str, Any]], None],
                 now: Callable[[], float], channel: Channel,
                 partition: Partition | None = None,
                 partition_for: Callable[[int], Partition] | None = None, min_stages: int = 1,
                 stages_fit: Callable[[Partition, tuple[int, ...]], bool] | None = None,
                 start: int = 0, agreed: Callable[[Agreed], None] = lambda _: None,
                 namespace: str = keys.ROOT) -> None:
        """`partition` is the layer ranges per stage at launch; `partition_for(P)` computes
        them for another depth the way the launch did (None: the job never re-partitions),
        down to `min_stages`; `stages_fit(partition, stages)` whether one node's memory holds
        those stages of a partition (`job.stages_fit`; None: the planner's count rule);
        `start` the iteration the job starts at (a resumed checkpoint's next); `agreed` hears
        each agreement (the job loop writes from its reports the metrics lines that a
        failure kept the nodes from posting); `namespace` the workers' (their groups' keys,
        which it removes once their generation is over: `cluster.collect`)."""
        self.cfg = cfg
        self.channel = channel
        self._partitions: dict[int, tuple[tuple[int, int], ...]] = {}
        self._partition_for = partition_for
        self._stages_fit = stages_fit
        self.rules = rules_for(cfg, self._partition_at if partition_for else None,
                               min_stages, self._room if stages_fit else None)
        self.history = History(layout, tuple(tuple(r) for r in partition or []),
                               resumed_at=start)
        self.joining: list[str] = []  # accepted, not yet placed
        self.store = store
        self.kill = kill
        self.emit = emit
        self.agreed = agreed
        self.now = now
        self.dead: set[str] = set()
        self.finished: set[str] = set()  # exited 0 at the end of training
        # exited 0 before the last iteration's line came: finished once it comes, lost if a
        # recovery begins first (`node_exited`)
        self.exited_early: set[str] = set()
        self.fenced: set[str] = set()
        self.over = False  # training is over: late joiners are sent home
        self.left: set[str] = set()  # left after a notice, by plan
        self.left_on_notice: set[str] = set()  # of those, the ones that had a notice
        self.newest_committed = start - 1  # the newest iteration with a metrics line
        self.collecting: Collecting | None = None
        self.stop_message: str | None = None
        self.causes: dict[str, str] = {}  # a lost node's cause, where its launcher knew it
        self.liveness = Liveness(store, channel, self.refused)
        self._store_watch = StoreWatch(cfg.failover.heartbeat_timeout_s)
        self._refusals: set[tuple[str, str]] = set()
        self._regroup_asked = -1  # the generation whose regroup was asked for
        # the layouts of the next generation that nodes were asked to form groups for ahead
        # of the boundary, in order, with the generation that asked (`_prepare`): the last is
        # the one the boundary's plan may take; one replaced is never prepared again in that
        # generation, since its groups would form a second time under the same store prefix,
        # where the abandoned formation's records lie
        self._prepared_in: tuple[int, list[Layout]] = (-1, [])
        # the nodes whose notices came in a generation, with that generation
        self._noticed: tuple[int, frozenset[str]] = (-1, frozenset())
        # what the generations not yet removed from the store wrote (`cluster.collect`)
        self.namespace = namespace
        self._records = {self.generation: GenerationRecords(self.generation, layout)}

    # ------------------------------------------------------------------ views

    @property
    def layout(self) -> Layout:
        return self.history.layout

    @property
    def generation(self) -> int:
        return self.history.generation

    @property
    def partition(self) -> Partition:
        return [tuple(r) for r in self.history.partition]  # type: ignore[misc]

    @property
    def live(self) -> set[str]:
        """Nodes running a stage now (not lost, not finished)."""
        return set(self.layout.active_nodes) - self.dead - self.finished

    def expected_exits(self) -> set[str]:
        """Nodes whose exit with code 0 is part of the plan."""
        return set(self.layout.active_nodes) | self.left

    def refused(self, writer: str, reason: str) -> None:
        """A record dropped: said once per writer and reason (a flood of forged records must
        not flood the events). Both are cut as `Refused` cuts them, so that what is kept to
        say each once is bounded too (a forger chooses the text of most reasons)."""
        writer, reason = writer[:WRITER_CHARS], reason[:REASON_CHARS]
        if (writer, reason) in self._refusals:
            return
        self._refusals.add((writer, reason))
        self.emit({"time_s": self.now(), "kind": "record_refused", "node": writer,
                   "reason": reason})

    # ------------------------------------------------------------------ succession

    def books(self) -> dict[str, Any]:
        """This coordinator's part of a `CoordinatorState`: what lives only in its memory."""
        rec = self.collecting
        return {
            "generation": self.generation,
            "history": {**succession.history_to_json(self.history),
                        "partitions": succession.partitions_to_json(self._partitions)},
            "dead": tuple(sorted(self.dead)), "finished": tuple(sorted(self.finished)),
            "exited_early": tuple(sorted(self.exited_early)),
            "fenced": tuple(sorted(self.fenced)), "left": tuple(sorted(self.left)),
            "left_on_notice": tuple(sorted(self.left_on_notice)),
            "joining": tuple(self.joining), "over": self.over,
            "stop_message": self.stop_message, "regroup_asked": self._regroup_asked,
            "prepared_ahead": {"generation": self._prepared_in[0],
                         "layouts": [layout.to_json() for layout in self._prepared_in[1]]},
            "noticed": {"generation": self._noticed[0], "nodes": sorted(self._noticed[1])},
            "causes": dict(self.causes),
            "collecting": None if rec is None else {
                "generation": rec.generation, "started_s": rec.started_s,
                "reasons": list(rec.reasons),
                "reports": [r.to_json() for r in rec.reports.values()]}}

    def restore(self, state: CoordinatorState) -> None:
        """Take up a predecessor's books. Liveness starts afresh: beats are timed on this
        coordinator's clock from their next arrival, so no node is fenced for the time the
        office was vacant."""
        self.history = succession.history_from_json(state.history)
        self._partitions = succession.partitions_from_json(state.history.get("partitions", {}))
        self.dead, self.finished = set(state.dead), set(state.finished)
        # (their exits were taken in here once: none will come to the successor again)
        self.exited_early = set(state.exited_early)
        self.fenced, self.left = set(state.fenced), set(state.left)
        self.left_on_notice = set(state.left_on_notice)
        self.joining, self.over = list(state.joining), state.over
        self.stop_message, self._regroup_asked = state.stop_message, state.regroup_asked
        self.causes = dict(state.causes)
        rec = state.collecting
        self.collecting = None if rec is None else Collecting(
            int(rec["generation"]), float(rec["started_s"]), [str(r) for r in rec["reasons"]],
            {r["node"]: Report.from_json(r) for r in rec["reports"]})
        self.newest_committed = _newest_committed(state)
        # what the nodes were asked to form ahead, and who leaves on a notice: forgotten, the
        # boundary's Decision told the nodes to form fresh groups instead of the ones formed,
        # and a notice read again prepared them a second time
        prepared = state.prepared_ahead or {"generation": -1, "layouts": []}
        self._prepared_in = (int(prepared["generation"]),
                             [Layout.from_json(layout) for layout in prepared["layouts"]])
        # what this generation and the ones before it still kept wrote, removed as the
        # predecessor would have (`_collect_before`). The layouts before are not in the
        # books: this one's names their groups (all of them where etcd deletes by prefix;
        # on a TCPStore, those of a group that was larger stay), and the groups formed
        # ahead for it are not known (they stay)
        g = self.generation
        ahead = self._prepared_in[1] if self._prepared_in[0] == g - 1 else []
        self._records = {k: GenerationRecords(k, self.layout, tuple(ahead) if k == g else ())
                         for k in range(max(0, g - KEPT_GENERATIONS - 1), g + 1)}
        noticed = state.noticed or {"generation": -1, "nodes": []}
        self._noticed = (int(noticed["generation"]), frozenset(map(str, noticed["nodes"])))

    def decided_after_books(self) -> bool:
        """Whether the predecessor published the Decision of the books' generation after it
        last saved them (it died in between: a few milliseconds of one turn). The workers
        follow that Decision, which these books know nothing of, so no successor can go on
        exactly: the job is stopped with a clear message instead (`_stop_behind`)."""
        g = self.generation
        found = self._first_decision(g)
        if found is None:
            return False
        self._stop_behind(found, g, f"the coordinator was lost after it published the plan "
                                    f"of generation {g} and before it saved its books")
        return True

    def _first_decision(self, g: int, before: int | None = None) -> Decision | None:
        """The first genuine Decision on generation `g`'s board (in its slots before `before`):
        the one every node follows."""
        index = 1
        while (before is None or index < before) and self.store.check(
                [slot := keys.board_slot(keys.decision_board(g), index)]):
            try:
                opened = self.channel.open(self.store.get(slot), at=slot,
                                           expect=DecisionRecord, writers={self.channel.writer})
                assert isinstance(opened.message, DecisionRecord)
                return Decision.from_json(opened.message.decision)
            except Exception:  # (Refused, or a record that does not parse: not a decision)
                pass
            index += 1
        return None

    def _stop_behind(self, found: Decision, g: int, why: str) -> None:
        """The nodes follow `found`, a Decision of generation `g` that this coordinator did
        not make: stop them in the generation it starts (a stop Decision there), with a clear
        message; the newest checkpoint stays the way back."""
        message = f"{why}; its successor cannot go on exactly (resume from the newest checkpoint)"
        self.emit({"time_s": self.now(), "kind": "books_stale", "node": "launcher",
                   "generation": g, "message": message})
        self.stop_message = found.message if found.stopped else message
        if not found.stopped:
            nxt = found.generation
            stop = Decision(Action.STOP, generation=nxt + 1, resume=found.resume,
                            layout=found.layout, previous_layout=found.layout,
                            partition=found.partition, previous_partition=found.partition,
                            message=message)
            board.publish(self.store, self.channel, keys.abort_board(nxt), Abort(nxt, message),
                          nxt)
            board.publish(self.store, self.channel, keys.decision_board(nxt),
                          DecisionRecord(nxt, stop.to_json()), nxt)
        self.collecting = None

    def _collect_before(self, g: int, decision: Decision) -> None:
        """Generation `g` is over and its Decision published: note what the generation it
        starts will write, and remove from the store what the generations before `g` wrote
        (`cluster.collect` says why no one reads them any more)."""
        if not decision.stopped:
            ahead = self._prepared_in[1] if self._prepared_in[0] == g else []
            moved = tuple(map(tuple, decision.partition)) != tuple(
                map(tuple, decision.previous_partition))
            self._records[decision.generation] = GenerationRecords(
                decision.generation, decision.layout, tuple(ahead),
                self.layout if moved else None, len(decision.handover_group()))
        for old in sorted(k for k in self._records if k < g - KEPT_GENERATIONS):
            collect(self.store, self.namespace, self._records.pop(old))

    # ------------------------------------------------------------------ inputs

    def node_exited(self, node: str, code: int, why: str = "") -> None:
        """`node`'s process ended with `code`; `why`: what its launcher knows of the cause
        (its fork server's end), said with the loss and the stop it leads to."""
        spare = self._spare(node)
        if code != 0 and self.let_go(node):
            self.emit({"time_s": self.now(), "kind": "left_node_exited", "node": node,
                       "returncode": code, **({"reason": why} if why else {})})
            return
        if code == 0 and (node in self.left or self.collecting is None) and not spare:
            if node in self.left or self._trained_to_the_end():
                if node in self.layout.active_nodes:
                    self.finished.add(node)
            elif node in self.layout.active_nodes:
                # a worker ends with 0 after the job's last iteration, whose line may still
                # be on its way; or mid-job, where something in it ended the process (a C
                # library's exit, os._exit): taken for finished, the recovery its peers then
                # began waited for its report through plans of cluster.timeout_s each
                self.exited_early.add(node)
            return
        if node in self.dead:
            return
        if spare and self.collecting is None:
            self.dead.add(node)
            self.liveness.forget(node)
            # it holds no stage and takes no part in the last plan: training goes on
            # untouched (no abort, no regroup), and no plan places it (`recover` counts the
            # dead out of the spares; the joiners here)
            self.joining = [n for n in self.joining if n != node]
            self.emit({"time_s": self.now(), "kind": "standby_lost", "node": node,
                       "returncode": code, "generation": self.generation})
            return
        if code == 0 and not why and not self._trained_to_the_end():
            # (after a recovery began: said as `_begin` says it of one that exited before)
            self._lose(node, 0, EXITED_EARLY)
            self._begin(f"{node} exited with code 0 before the job's end")
        else:
            self._lose(node, code, why)
            if why:
                self.causes[node] = why
            self._begin(f"{node} exited with code {code}" + (f" ({why})" if why else ""))
        self._maybe_decide()

    def committed(self, iteration: int) -> None:
        """Iteration `iteration` is committed (its metrics line is written)."""
        self.newest_committed = max(self.newest_committed, iteration)
        if self._trained_to_the_end():
            self.finished |= self.exited_early
            self.exited_early.clear()

    def _spare(self, node: str) -> bool:
        """Waiting to be placed (on standby, accepted to join, or asking to) since before the
        last plan, so that plan moves nothing to or from it, and not let go by a plan or at
        the end. A node the last plan put on standby may still be sending its layers, and
        takes its old place again if the plan fails before it commits: until the plan's first
        iteration is committed, its loss is a loss like any."""
        return node not in self.left and self._outside_the_plan(node)

    def let_go(self, node: str) -> bool:
        """Let go by a plan (it left on a notice, or the layout released it) that no longer
        needs it: the plan's first iteration is committed, or an earlier plan let it go. Its
        exit, whatever the code, is said and changes nothing: until then it may still be
        sending its stages (a hand-over), and its loss is a loss like any."""
        return node in self.left and self._outside_the_plan(node)

    def _outside_the_plan(self, node: str) -> bool:
        """In neither the last plan's layout nor, until that plan's first iteration is
        committed, the layout before it (which a plan rolled back gives back)."""
        settled = self.newest_committed >= self.history.resumed_at
        before = (self.history.before[0].active_nodes
                  if self.history.before and not settled else ())
        return node not in self.layout.active_nodes and node not in before

    def report(self, report: Report, writer: str) -> None:
        if writer != report.node:
            self.refused(writer, f"a report for {report.node}")
            return
        if report.generation != self.generation:
            self.refused(writer, f"a report of generation {report.generation}; the job is in "
                                 f"generation {self.generation}")
            return
        if report.node in self.dead or report.node in self.fenced:
            self.refused(writer, "a report from a node the job lost")
            return
        if self.collecting is None:
            self._begin(f"{report.node}: {report.reason}", abort=not report.boundary)
        assert self.collecting is not None
        self.collecting.reports[report.node] = report
        self._maybe_decide()

    def noticed(self, notice: Notice, writer: str) -> None:
        """A node will leave at the next iteration boundary: have the nodes that stay form
        the next generation's groups now (`_prepare`), for the layout the planner gives the
        departures noticed in this generation, by the same call the boundary's agreement
        makes. A node's notice said twice prepares once."""
        if writer != notice.node:
            self.refused(writer, f"a notice for {notice.node}")
            return
        if notice.node in self.joining:
            # a joiner not placed yet leaves at once on its notice (`runtime.standby`): no
            # plan may place it. Its exit (code 0) came too late for a plan made meanwhile,
            # which placed it and then failed to move its stage there.
            self.joining.remove(notice.node)
            self.left.add(notice.node)
            self.left_on_notice.add(notice.node)
            return
        g = self.generation
        if (notice.generation != g or self.collecting is not None or self.over
                or notice.node not in self.layout.active_nodes or notice.node in self.fenced
                or notice.node in self.leaving_now()):
            return
        self._noticed = (g, self.leaving_now() | {notice.node})
        self._prepare_following(f"{notice.node} leaves on a notice")

    @property
    def _prepared(self) -> tuple[int, Layout] | None:
        """The newest preparation, with the generation that asked for it."""
        g, layouts = self._prepared_in
        return (g, layouts[-1]) if layouts else None

    def leaving_now(self) -> frozenset[str]:
        """The nodes whose notices came in this generation (they leave at its boundary)."""
        g, nodes = self._noticed
        return nodes if g == self.generation else frozenset()

    def _prepare(self, g: int, decision: Decision, why: str) -> None:
        """Ask the nodes of `decision`'s layout to form its groups while generation `g`
        trains (`Prepare`, see `runtime.early_groups`): the Decision that ends `g` takes them
        if its layout is this one (`_publish`). The nodes training now read it on the
        generation's regroup board; a node waiting to be placed (on standby, or accepted to
        join), on its own answer board, which is what it watches."""
        waiting = set(self.layout.standby) | set(self.joining)
        placed = decision.layout.active_nodes - self.layout.active_nodes
        before = self._prepared_in[1] if self._prepared_in[0] == g else []
        if (decision.stopped or decision.action not in CARRIED_OUT or not placed <= waiting
                or decision.layout in before):
            return
        self._prepared_in = (g, before + [decision.layout])
        prepare = Prepare(g, decision.layout.to_json())
        board.publish(self.store, self.channel, keys.regroup_board(g), prepare, g)
        for node in sorted(placed):
            self._answer(node, prepare)
        self.emit({"time_s": self.now(), "kind": "groups_prepared", "node": "launcher",
                   "generation": g + 1, "reason": why,
                   "nodes": sorted(decision.layout.active_nodes)})

    def _prepare_following(self, why: str, placing: bool = False) -> None:
        """Prepare the plan the next boundary makes if nothing else happens until then: a
        node joined or has a notice, or the layout can improve. Each such event in a
        generation prepares again, and the newest preparation is the one the boundary's plan
        may take: the nodes read their generation's regroup board to its end, in order, and
        replace the groups they form. `placing`: only if that plan places a node waiting to
        be placed. A joiner that waits on standby (one node short of a pipeline) changes
        nothing the groups depend on, so the groups formed would only take the cores from
        training; the next joiner, often moments later, prepares the pipeline the two form."""
        leaving = self.leaving_now()
        try:
            following = settle(self.history, self.rules, leaving=sorted(leaving),
                               joiners=self.joining, with_transfers=False)[0].decision
        except (ValueError, RuntimeError):  # the boundary's plan will say why
            return
        if leaving & following.layout.active_nodes:  # no plan lets them go: none to prepare
            return
        if placing and following.layout.active_nodes <= self.layout.active_nodes:
            return
        self._prepare(self.generation, following, why)

    def stalled(self, stall: Stalled, writer: str) -> None:
        """A node says its main thread has computed at one instruction for the hang timeout
        (`spotpipe.runtime.stall`): fence it now, as the heartbeat check would a beat or two
        later. Only the node itself may say so; a stall of an earlier generation is over.

        A node a plan let go (leaving on a notice) is fenced too, whatever its generation:
        until that plan's first iteration commits its receivers wait for its hand-over, and
        its loss is a loss like any (`let_go`); after, only the job's end waits for its exit.
        No heartbeat check watches it, and unfenced, a hand-over stuck in it held its
        receivers for `cluster.timeout_s` and the job's end for ever."""
        if writer != stall.node:
            self.refused(writer, f"a stall report for {stall.node}")
            return
        if stall.generation > self.generation:
            self.refused(writer, f"a stall report of generation {stall.generation}; the job is "
                                 f"in generation {self.generation}")
            return
        if stall.node in self.fenced or stall.node in self.dead:
            return
        if stall.node not in self.left and (stall.generation < self.generation
                                            or stall.node not in self.live):
            return
        self._fence(stall.node, hung(stall.still_s, stall.iteration, stall.position, stall.step)
                    + " (its own report)")

    def join(self, request: JoinRequest, writer: str, incarnation: str = "") -> None:
        """A node asks to join: check it, then reshape at the next iteration boundary. Its
        seal already proved it holds the job's key (the token); the rest is checked here.
        `incarnation` is the seal's (the process that asked): a refusal names it.

        A request from a node that runs a stage or is joining already is ignored (a copy of
        an earlier one, or a confused process): accepted, it would be placed a second time
        and force a regroup. The nodes that legitimately ask again are not among them: one a
        Decision counted out (`rejoin`) is no longer in its layout when it reads it, and a
        fenced node comes back as a new node (its agent arrives again, `_rejoin`)."""
        node = request.node
        if writer != node:
            # (only a process with the key does this; the node of that name did not ask, and
            # the asker does not read that board: nothing is posted on it)
            self.emit({"time_s": self.now(), "kind": "join_refused", "node": node,
                       "reason": f"{writer} asked under this node's name"[:300]})
            return
        if node in self.live or node in self.joining:
            self.refused(writer, "a join request from a node that runs a stage or is "
                                 "joining already: ignored")
            return
        problem = join_problem(self.cfg, token_ok=True, model_digest=request.model_digest,
                               config_digest=request.config_digest,
                               config_keys=request.config_keys)
        if problem:
            self._answer(node, JoinAnswer(node, "refused", to=incarnation,
                                          message=f"{node} refused by the job: {problem}"))
            self.emit({"time_s": self.now(), "kind": "join_refused", "node": node,
                       "reason": problem})
            return
        if self.over or not self.live:
            self._answer(node, JoinAnswer(node, "finished"))
            self.left.add(node)
            self.emit({"time_s": self.now(), "kind": "join_too_late", "node": node})
            return
        self.joining.append(node)
        self.emit({"time_s": self.now(), "kind": "join_accepted", "node": node,
                   "generation": self.generation})
        if self.collecting is None:
            # (prepared before the request: the nodes start forming the groups before they
            # head for the boundary)
            self._prepare_following(f"{node} joined", placing=True)
            self.request_regroup(f"{node} joined")

    def join_without_key(self, node: str, incarnation: str = "") -> None:
        """A join request that did not open under the job's key: refused, with an answer its
        writer can read (but not authenticate) on its board, addressed to the incarnation its
        envelope claims. Anyone can write such a request in any name, so none is posted on
        the board of a node the job knows (running a stage, on standby, joining): its
        refusal is an event only."""
        problem = join_problem(self.cfg, token_ok=False, model_digest=None, config_digest=None)
        known = node in self.layout.all_nodes or node in self.joining
        if not known:
            self._answer(node, JoinAnswer(node, "refused", to=incarnation,
                                          message=f"{node} refused by the job: {problem}"))
        self.emit({"time_s": self.now(), "kind": "join_refused", "node": node,
                   "reason": problem + (" (not answered: the job has a node of that name)"
                                        if known else "")})

    def release_standby(self) -> None:
        """The job is over: nodes still waiting to be placed may go."""
        self.over = True
        for node in list(self.joining) + list(self.layout.standby):
            self._answer(node, JoinAnswer(node, "finished"))
            self.left.add(node)
        # they are gone: a plan made after this (a failure in the job's last moments) must not
        # place them
        self.joining.clear()
        self.history = replace(self.history, layout=self.layout.with_standby(()))

    def _answer(self, node: str, answer: JoinAnswer | Prepare) -> None:
        board.publish(self.store, self.channel, keys.join_board(node), answer, self.generation)

    def request_regroup(self, why: str) -> None:
        """Ask for a change of layout at the next iteration boundary (once per generation)."""
        if self._regroup_asked == self.generation:
            return
        self._regroup_asked = self.generation
        board.publish(self.store, self.channel, keys.regroup_board(self.generation),
                      Regroup(self.generation, why), self.generation)
        self.emit({"time_s": self.now(), "kind": "regroup_requested", "node": "launcher",
                   "generation": self.generation, "reason": why})

    def tick(self) -> None:
        """Heartbeat check: fence nodes that stopped beating or stopped making progress, and
        survivors that do not report after a failure (a node that cannot report would leave
        the agreement waiting forever; fencing turns that into a decision)."""
        before = self.liveness.clock()
        self.store.check([keys.HEARTBEATS])  # blocks while the store is away (etcd restarting)
        now = self.liveness.clock()
        failover = self.cfg.failover
        watch = self._store_watch
        if watch.answered(before, now):
            # beats could not arrive meanwhile, which says nothing about the nodes: judge them
            # afresh (a busy machine's slow answer is no such stall)
            self.liveness.restart_clocks()
            self.emit({"time_s": self.now(), "kind": "store_stalled", "node": "launcher",
                       "stalled_s": round(now - before, 3)})
        if watch.in_grace(now):
            for node in sorted(self.live - self.fenced):
                self.liveness.read(node)  # take in new beats (and refuse stale ones)
            if watch.slow:  # (the grace renewed at every check: see `StoreWatch`)
                for node in sorted(self.live - self.fenced):
                    why = self.liveness.outpaced(node, failover.heartbeat_timeout_s,
                                                 since=watch.slow_since)
                    if why:
                        self._fence(node, why)
            self.liveness.restart_clocks()
            return
        rec = self.collecting
        if rec is not None:
            waited = self.now() - rec.started_s
            silent = self.live - set(rec.reports) - self.fenced
            if silent and waited > failover.hang_timeout_s:
                for node in sorted(silent):
                    self._fence(node, f"did not report within {waited:.1f} s of the failure "
                                      f"of generation {rec.generation}")
        for node in sorted(self.live - self.fenced):
            why = self.liveness.verdict(node, failover.heartbeat_timeout_s,
                                        failover.hang_timeout_s)
            if why:
                self._fence(node, why)

    # ------------------------------------------------------------------ agreement

    def _partition_at(self, depth: int) -> tuple[tuple[int, int], ...]:
        """Partitions at other depths, computed once each (profiling is noisy, so every node
        must get the same one); a failure is the ValueError the rules expect."""
        if depth not in self._partitions:
            assert self._partition_for is not None
            try:
                self._partitions[depth] = tuple(tuple(r) for r in self._partition_for(depth))
            except ValueError:
                raise
            except Exception as exc:  # the partitioner's own error: a reason, not a crash
                raise ValueError(str(exc)) from exc
        return self._partitions[depth]

    def _room(self, depth: int, stages: tuple[int, ...]) -> bool:
        """`plan.policy.Room` on the job's partition at that depth (the one it runs, else
        the one a re-partition would cut); no room where there is no such partition."""
        assert self._stages_fit is not None
        ranges = self.history.partition
        if len(ranges) != depth:
            if self._partition_for is None:
                return False
            try:
                ranges = self._partition_at(depth)
            except ValueError:
                return False
        return self._stages_fit(ranges, stages)

    def _fence(self, node: str, why: str) -> None:
        if node in self.fenced:
            return  # killed already; its exit is on its way
        self.fenced.add(node)
        self.emit({"time_s": self.now(), "kind": "node_fenced", "node": node, "reason": why,
                   "generation": self.generation})
        self.liveness.forget(node)
        if node in self.exited_early:
            # its process is gone, its exit taken in already: a kill would bring no other,
            # and a recovery would wait for its report or its exit to the job's end
            self.exited_early.discard(node)
            self._lose(node, 0, EXITED_EARLY)
            self._begin(f"{node} exited with code 0 before the job's end")
            self._maybe_decide()
            return
        self.kill(node)  # its exit then arrives through node_exited

    def _begin(self, reason: str, abort: bool = True) -> None:
        """Start agreement. `abort` wakes every node at once (a failure); a change at an
        iteration boundary needs none: every node saw the same commit flag and comes on its
        own, after finishing the iteration's tail (its metrics)."""
        if self.collecting is None:
            self.collecting = Collecting(self.generation, self.now())
            if abort:
                self._abort(reason)
            self.emit({"time_s": self.now(), "kind": "failure_detected", "node": "launcher",
                       "generation": self.generation, "reason": reason})
        self.collecting.reasons.append(reason)
        for node in sorted(self.exited_early):  # gone before the job's end: lost
            self.exited_early.discard(node)
            self._lose(node, 0, EXITED_EARLY)

    def _trained_to_the_end(self) -> bool:
        """The job's last iteration has its line: a node that exits 0 now has finished."""
        return self.newest_committed >= self.cfg.iterations - 1

    def _lose(self, node: str, code: int, why: str = "") -> None:
        self.dead.add(node)
        self.liveness.forget(node)
        self.emit({"time_s": self.now(), "kind": "node_lost", "node": node, "returncode": code,
                   "generation": self.generation, **({"reason": why} if why else {})})

    def _abort(self, reason: str) -> None:
        g = self.generation
        board.publish(self.store, self.channel, keys.abort_board(g), Abort(g, reason), g)

    def _maybe_decide(self) -> None:
        rec = self.collecting
        if rec is None or set(rec.reports) < self.live:
            return
        reports = {n: _node_report(r) for n, r in rec.reports.items()}
        outcome = recover(self.history, reports, self.joining, self.rules, dead=self.dead,
                          seen_committed=self.newest_committed)
        self._publish(rec, outcome)

    def _publish(self, rec: Collecting, outcome: Outcome) -> None:
        decision = outcome.decision
        self.agreed(Agreed(rec.generation, self.layout, decision.resume, dict(rec.reports)))
        if outcome.refused:
            self.emit({"time_s": self.now(), "kind": "repartition_refused", "node": "launcher",
                       "generation": rec.generation, "reason": outcome.refused})
        agreed = self.now()
        self.emit({"time_s": agreed, "kind": "agreement", "node": "launcher",
                   "generation": rec.generation, "lost": sorted(outcome.lost),
                   "leaving": sorted(outcome.leaving), "resume": decision.resume,
                   "reports": len(rec.reports),
                   **({"lacking": {n: list(w) for n, w in outcome.lacking.items()}}
                      if outcome.lacking else {}),
                   **({"unreplicated": sorted(outcome.unreplicated)}
                      if outcome.unreplicated else {}),
                   **({"rolled_back": True} if outcome.rolled_back else {}),
                   "agreement_s": round(agreed - rec.started_s, 6),
                   "action": decision.action.value})
        g = rec.generation
        # the nodes take the groups they formed ahead only when this is the layout they formed
        # them for (every node reads the same answer here, so all meet in one set of groups)
        prepared = (self._prepared is not None and self._prepared[0] == g
                    and not decision.stopped and decision.layout == self._prepared[1])
        slot = board.publish(self.store, self.channel, keys.decision_board(g),
                             DecisionRecord(g, decision.to_json(), prepared=prepared), g)
        # a predecessor deposed while cut off (etcd retries its calls for cluster.timeout_s)
        # may have published its own plan for this generation after this successor read the
        # board (`decided_after_books`): the nodes follow the first one, not this one
        first = self._first_decision(g, before=slot)
        if first is not None:
            self._stop_behind(first, g, "a coordinator deposed while cut off published the "
                                        f"plan of generation {g} after its successor took over")
            return
        # (the nodes have it from here on)
        self.emit({**_plan_event(self.now(), g, decision), "early_groups": prepared})
        # the generation is over: close its boards, so every watcher of it ends (a change at a
        # boundary aborted no one, and a regroup may never have been asked for)
        self._abort("the generation ended")
        board.publish(self.store, self.channel, keys.regroup_board(g),
                      Regroup(g, "the generation ended", ended=True), g)
        self._collect_before(g, decision)
        self.left |= outcome.leaving
        self.left_on_notice |= outcome.leaving
        if decision.stopped:
            causes = dict.fromkeys(self.causes[n] for n in sorted(outcome.lost)
                                   if n in self.causes)
            self.stop_message = "; ".join([*causes, decision.message])
            self.collecting = None
            return
        # nodes the new layout does not list leave the job; those it puts on standby wait in
        # their processes (a joiner, or a node a re-partition or a dropped pipeline left over)
        # until a later plan places them
        self.left |= decision.released()
        # nodes waiting on standby that the decision runs: placed now, or given back their
        # place by a plan rolled back (they kept their state on standby). Only they read
        # their join board: a node that reported in this generation reads the Decision on
        # its board, also one that a plan rolled back places again (an answer would lie
        # unread until it next waits, and then place it by a Decision long past)
        waiting = set(self.layout.standby) | set(self.joining)
        self.history = outcome.history
        for node in sorted(decision.layout.active_nodes & waiting):
            self._answer(node, JoinAnswer(node, "placed", generation=g))
        # nodes waiting to be placed that the new layout does not list and nothing released
        # (a joiner that a failed plan put on standby, which its rollback does not know):
        # still waiting in their processes, so still joiners, placed by a later plan or told
        # at the end that the job is over (else nobody answers them and the job never ends)
        stranded = (waiting - decision.layout.all_nodes - outcome.lost - self.left
                    - set(decision.rejoin) - set(self.joining))
        self.joining = [n for n in self.joining if n not in decision.layout.all_nodes]
        self.joining += sorted(stranded)
        self.collecting = None
        if outcome.improve and decision.resume + 1 < self.cfg.iterations:
            # (a plan resuming at the last iteration has nothing left to train after its next
            # boundary: improving there would only stop the nodes and form groups for nothing)
            # the next plan is known now (nothing happened yet): its groups can form while the
            # job trains (prepared before the request, so that they start before the boundary)
            self._prepare_following("the layout can improve further")
            self.request_regroup("the layout can improve further")


def _newest_committed(state: CoordinatorState) -> int:
    """The newest iteration the books' metrics.jsonl has a line of (the job's first, less
    one, before any): a successor that started from -1 took every plan for uncommitted, and
    the loss of a node the last plan had put on standby aborted the generation for nothing
    (`Coordinator._spare`), where its predecessor went on training."""
    last = state.last_metrics
    if isinstance(last, dict) and isinstance(last.get("iter"), int):
        return max(int(last["iter"]), state.first_iteration - 1)
    return state.first_iteration - 1


def _node_report(r: Report) -> NodeReport:
    return NodeReport(r.node, iteration=r.iteration, committed_through=r.committed_through,
                      boundary=r.boundary, leaving=r.leaving, formed=r.formed,
                      lacking=tuple(r.lacking), untouched=r.untouched, replica=r.replica,
                      flight=r.flight,
                      done=tuple(r.done), clip_scale=r.clip_scale, reason=r.reason)


def _plan_event(now: float, generation: int, d: Decision) -> dict[str, Any]:
    """The plan as events.jsonl records it (what `spotpipe.cluster.story` tells)."""
    if d.stopped:
        return {"time_s": now, "kind": "plan", "node": "launcher", "generation": generation,
                "action": "stop", "message": d.message}
    return {"time_s": now, "kind": "plan", "node": "launcher", "generation": d.generation,
            "action": d.action.value, "resume": d.resume, "reason": d.reason,
            "moves": [{"kind": m.kind.value, "pipeline": m.pipeline, "stage": m.stage,
                       "src": m.src, "dst": m.dst} for m in d.moves],
            "transfers": [t.to_json() for t in d.transfers],
            "stages": d.layout.num_stages, "standby": list(d.layout.standby),
            "partition": [list(r) for r in d.partition],
            "previous_partition": [list(r) for r in d.previous_partition],
            "previous_layout": d.previous_layout.to_json(),
            "replay": "rest" if d.salvage is not None else "iteration",
            "carriers": {n: [s for _, s in slots] for n, slots in d.layout.carriers().items()}}
