"""Failure handling on the launcher's (or agent's) side: detect, agree, decide, publish.

The coordinator lives next to the store, in the process that is never preempted. It learns of
failures three ways: a worker process exits (the launcher sees it at once), a worker reports a
broken connection or a notice (through the store), or heartbeats say a node is dead or hung
(then it fences the node: a hung process must not come back into a job that moved on).

Agreement runs per generation: the abort key wakes every survivor, each reports where it
stands (iteration, last committed iteration, whether it leaves), and once every node has
reported or is known dead, `spotpipe.plan.decide` picks the recovery. The plan, with the
iteration to resume at (one past the newest iteration any survivor committed), is published
under the generation's key, which is what every survivor is waiting on.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from spotpipe.cluster.membership import HEARTBEATS, abort_key, join_key, plan_key, regroup_key
from spotpipe.config import Config
from spotpipe.plan import Action, Decision, Layout, MoveKind, decide


def join_problem(cfg: Config, *, token_ok: bool, model_digest: str | None,
                 config_digest: str | None) -> str | None:
    """Why a node (a worker, or a whole node agent) may not join this job, or None.

    The same three checks guard a worker joining a running job and an agent arriving at the
    rendezvous: the shared secret, then the model and the configuration it would train."""
    if not token_ok:
        return "it did not present this job's join token"
    if model_digest != cfg.model_digest():
        return "it runs another model or optimizer"
    if config_digest != cfg.digest():
        return "it runs another configuration"
    return None


@dataclass
class Recovery:
    """Agreement in progress for one generation."""

    generation: int
    started_s: float
    reasons: list[str] = field(default_factory=list)
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)


Partition = list[tuple[int, int]]


class Coordinator:
    def __init__(self, *, cfg: Config, store: dist.Store, layout: Layout,
                 kill: Callable[[str], None], emit: Callable[[dict[str, Any]], None],
                 now: Callable[[], float], token: str = "", partition: Partition | None = None,
                 partition_for: Callable[[int], Partition] | None = None) -> None:
        """`partition` is the layer ranges per stage at launch; `partition_for(P)` computes
        them for another depth the way the launch did (None: the job never re-partitions)."""
        self.cfg = cfg
        self.partition: Partition = list(partition or [])
        self.partition_for = partition_for
        self._partitions: dict[int, Partition] = {}
        self.repartition_refused: str | None = None
        self.token = token
        self.joining: list[str] = []  # accepted, not yet placed
        self.store = store
        self.layout = layout
        self.kill = kill
        self.emit = emit
        self.now = now
        self.generation = 0
        self.dead: set[str] = set()
        self.finished: set[str] = set()  # exited 0 at the end of training
        self.fenced: set[str] = set()
        self.over = False  # training is over: late joiners are sent home
        self.left: set[str] = set()  # left after a notice, by plan
        self.recovery: Recovery | None = None
        self.stop_message: str | None = None
        self._progress: dict[str, tuple[Any, float]] = {}  # node -> (progress, since)
        self.pauses: list[dict[str, Any]] = []
        self._grace_until = 0.0  # no fencing before this time (the store was away)
        # the layout and partition the last plan started from: a plan that fails before any
        # survivor's state changed is rolled back to them (`_roll_back`)
        self._before: tuple[Layout, Partition] | None = None
        self._resumed_at = 0  # the iteration the last plan resumed at
        self._futile = 0  # failed plans in a row with no node lost in between
        self._lost_before: set[str] = set()

    @property
    def live(self) -> set[str]:
        """Nodes running a stage now (not lost, not finished)."""
        return set(self.layout.active_nodes) - self.dead - self.finished

    def expected_exits(self) -> set[str]:
        """Nodes whose exit with code 0 is part of the plan."""
        return set(self.layout.active_nodes) | self.left

    # ------------------------------------------------------------------ inputs

    def node_exited(self, node: str, code: int) -> None:
        if code == 0 and (node in self.left or self.recovery is None):
            if node in self.layout.active_nodes:
                self.finished.add(node)
            return
        if node in self.dead:
            return
        self.dead.add(node)
        self.emit({"time_s": self.now(), "kind": "node_lost", "node": node, "returncode": code,
                   "generation": self.generation})
        self._begin(f"{node} exited with code {code}")
        self._maybe_decide()

    def report(self, record: dict[str, Any]) -> None:
        if record["generation"] != self.generation:
            return
        if self.recovery is None:
            self._begin(f"{record['node']}: {record['reason']}",
                        abort=not record.get("boundary", False))
        assert self.recovery is not None
        self.recovery.reports[record["node"]] = record
        self._maybe_decide()

    def join(self, record: dict[str, Any]) -> None:
        """A node asks to join: check it, then reshape at the next iteration boundary."""
        node = record["node"]
        problem = join_problem(self.cfg, token_ok=bool(self.token)
                               and hmac.compare_digest(str(record.get("token", "")), self.token),
                               model_digest=record.get("model_digest"),
                               config_digest=record.get("config_digest"))
        if problem:
            self.store.set(join_key(node), json.dumps(
                {"refused": f"{node} refused by the job: {problem}"}))
            self.emit({"time_s": self.now(), "kind": "join_refused", "node": node,
                       "reason": problem})
            return
        if self.over or not self.live:
            self.store.set(join_key(node), json.dumps({"finished": True}))
            self.left.add(node)
            self.emit({"time_s": self.now(), "kind": "join_too_late", "node": node})
            return
        self.joining.append(node)
        self.emit({"time_s": self.now(), "kind": "join_accepted", "node": node,
                   "generation": self.generation})
        if self.recovery is None:
            self._request_regroup(f"{node} joined")

    def release_standby(self) -> None:
        """The job is over: nodes still waiting to be placed may go."""
        self.over = True
        for node in list(self.joining) + list(self.layout.standby):
            self.store.set(join_key(node), json.dumps({"finished": True}))
            self.left.add(node)
        # they are gone: a plan made after this (a failure in the job's last moments) must not
        # place them
        self.joining.clear()
        self.layout = self.layout.with_standby(())

    def _request_regroup(self, why: str) -> None:
        self.store.set(regroup_key(self.generation), why)
        self.emit({"time_s": self.now(), "kind": "regroup_requested", "node": "launcher",
                   "generation": self.generation, "reason": why})

    def tick(self) -> None:
        """Heartbeat check: fence nodes that stopped beating or stopped making progress, and
        survivors that do not report after a failure (a node that cannot report would leave
        the agreement waiting forever; fencing turns that into a decision)."""
        before = time.time()
        self.store.check([HEARTBEATS])  # blocks while the store is away (etcd restarting)
        now = time.time()
        if now - before > self.cfg.failover.heartbeat_s:
            # the store was unreachable: beats, progress and reports could not be written
            # meanwhile, which says nothing about the nodes; judge them afresh from now on
            self._grace_until = now + self.cfg.failover.heartbeat_timeout_s
            self.emit({"time_s": self.now(), "kind": "store_stalled", "node": "launcher",
                       "stalled_s": round(now - before, 3)})
        grace = now < self._grace_until
        rec = self.recovery
        if rec is not None and not grace:
            waited = self.now() - rec.started_s
            silent = self.live - set(rec.reports) - self.fenced
            if silent and waited > self.cfg.failover.hang_timeout_s:
                for node in sorted(silent):
                    self._fence(node, f"did not report within {waited:.1f} s of the failure "
                                      f"of generation {rec.generation}")
        for node in sorted(self.live):
            key = f"{HEARTBEATS}/{node}"
            if not self.store.check([key]):
                continue
            beat = json.loads(self.store.get(key))
            age = now - beat.pop("t")
            if grace:
                self._progress.pop(node, None)
                continue
            if age > self.cfg.failover.heartbeat_timeout_s:
                self._fence(node, f"no heartbeat for {age:.1f} s")
                continue
            progress = (beat.get("generation"), beat.get("iteration"), beat.get("position"))
            seen, since = self._progress.get(node, (None, now))
            if progress != seen or beat.get("state") != "busy":
                self._progress[node] = (progress, now)
            elif now - since > self.cfg.failover.hang_timeout_s:
                self._fence(node, f"hung: no progress for {now - since:.1f} s at iteration "
                                  f"{beat.get('iteration')}, instruction {beat.get('position')}")

    def _adjacent(self, lost: set[str]) -> bool:
        """Whether some lost stage's replica holder (its predecessor) is lost too."""
        lay = self.layout
        return any(lay.replica_holder(d, s) in lost
                   for (d, s), n in lay.mapping.items() if n in lost)

    # ------------------------------------------------------------------ agreement

    def _decide(self, lost: set[str], joining: list[str]) -> Decision:
        """`plan.decide`, less the re-partitions this job cannot make (a partition that cannot
        be derived for the new depth): those become KEEP once, with the reason in the events,
        and the job runs on in the layout it has."""
        decision = decide(self.layout, lost, joining, shadows=self.cfg.shadow.enabled,
                          replicas=self.cfg.redundancy != "none",
                          repartition=self.cfg.failover.repartition)
        if decision.action != Action.REPARTITION or decision.needs_restore:
            return decision
        depth = decision.layout.num_stages
        problem = self.repartition_refused
        if problem is None and (self.cfg.shadow.enabled or self.cfg.checkpoint.scheme == "gemini"):
            # each shadow (or gemini peer copy) holds one stage of the launch partition
            problem = self.repartition_refused = (
                f"cannot re-partition to P={depth}: the "
                + ("CPU shadows" if self.cfg.shadow.enabled else "gemini peer copies")
                + " hold the stages of the launch partition; the job keeps its carriers")
            self.emit({"time_s": self.now(), "kind": "repartition_refused", "node": "launcher",
                       "generation": self.generation, "reason": problem})
        if problem is None:
            try:
                self._partition_at(depth)
            except Exception as exc:  # the partitioner's message says what is wrong
                problem = self.repartition_refused = (
                    f"cannot re-partition to P={depth}: {exc}".splitlines()[0][:300])
                self.emit({"time_s": self.now(), "kind": "repartition_refused",
                           "node": "launcher", "generation": self.generation,
                           "reason": problem})
        if problem is None:
            return decision
        waiting = [n for n in decision.layout.all_nodes if n not in self.layout.active_nodes]
        return Decision(Action.KEEP, self.layout.with_standby(tuple(sorted(waiting))), (),
                        problem)

    def _partition_at(self, depth: int) -> Partition:
        if depth == len(self.partition):
            return self.partition
        if depth not in self._partitions:
            if self.partition_for is None:
                raise ValueError("this job cannot compute partitions at another depth")
            self._partitions[depth] = [tuple(r) for r in self.partition_for(depth)]
        return self._partitions[depth]

    def _fence(self, node: str, why: str) -> None:
        if node in self.fenced:
            return  # killed already; its exit is on its way
        self.fenced.add(node)
        self.emit({"time_s": self.now(), "kind": "node_fenced", "node": node, "reason": why,
                   "generation": self.generation})
        self._progress.pop(node, None)
        self.kill(node)  # its exit then arrives through node_exited

    def _begin(self, reason: str, abort: bool = True) -> None:
        """Start agreement. `abort` wakes every node at once (a failure); a change at an
        iteration boundary needs none: every node saw the same commit flag and comes on its
        own, after finishing the iteration's tail (its metrics)."""
        if self.recovery is None:
            self.recovery = Recovery(self.generation, self.now())
            if abort:
                self.store.set(abort_key(self.generation), reason)
            self.emit({"time_s": self.now(), "kind": "failure_detected", "node": "launcher",
                       "generation": self.generation, "reason": reason})
        self.recovery.reasons.append(reason)

    def _roll_back(self, rec: Recovery) -> bool:
        """Whether the plan that failed while it was carried out can be undone: every node of
        the layout before it is either lost or reports that nothing of the plan changed its
        state (a re-partition exchanges all layers before any node switches over, so one cut
        short leaves every node as it was). Then the job decides again from that layout, and
        a burst of losses during a re-partition costs the nodes lost, not the job."""
        if self._before is None:
            return False
        layout, partition = self._before
        for node in layout.active_nodes:
            if node in self.dead:
                continue
            report = rec.reports.get(node)
            if report is None or not report.get("untouched"):
                return False
        self.layout, self.partition = layout, list(partition)
        return True

    def _continues_in_flight(self, decision: Decision, resume: int) -> bool:
        """Whether survivors can go on with the in-flight iteration instead of replaying it:
        a takeover (stages only promoted, none moved away or re-shaped) of an iteration that
        no one committed, with replicas whose holders kept what a takeover needs."""
        return (self.cfg.failover.replay == "rest" and self.cfg.redundancy != "none"
                and decision.action == Action.FAILOVER
                and decision.layout.num_stages == self.layout.num_stages
                and decision.layout.num_pipelines == self.layout.num_pipelines
                and all(m.kind in (MoveKind.PROMOTE, MoveKind.REPLICA) for m in decision.moves)
                and any(m.kind == MoveKind.PROMOTE for m in decision.moves))

    def _maybe_decide(self) -> None:
        rec = self.recovery
        if rec is None or set(rec.reports) < self.live:
            return
        leaving = {n for n, r in rec.reports.items() if r["leaving"]}
        # a node that could not receive what the last plan gave it (a peer was lost while the
        # plan was carried out) does not hold its place: counted out, it joins again
        lacking = {n: r["lacking"] for n, r in rec.reports.items() if r.get("lacking")}
        rolled_back = bool(lacking) and self._roll_back(rec)
        if rolled_back:  # the nodes of the layout before hold their places; joiners do not
            lacking = {n: w for n, w in lacking.items() if n not in self.layout.active_nodes}
        lost = self.dead | leaving | set(lacking)
        if set(self.layout.standby) & lost:  # a standby node lost (or counted out) is no spare
            self.layout = self.layout.with_standby(
                tuple(n for n in self.layout.standby if n not in lost))
        # plans that fail while carried out, again and again with no node lost in between
        # (groups that cannot form: a partitioned network), would loop forever: stop instead
        failed_plan = any(not r.get("formed", True) for r in rec.reports.values())
        self._futile = self._futile + 1 if failed_plan and lost <= self._lost_before else 0
        self._lost_before = set(lost)
        # (at least what the last plan resumed after: the reports may all come from nodes that
        # committed nothing yet, joiners whose placement failed)
        committed = max([r["committed_through"] for r in rec.reports.values()]
                        + [self._resumed_at - 1])
        resume = committed + 1
        in_flight = max((r["iteration"] for r in rec.reports.values()), default=resume)
        when = f"in iteration {in_flight} (the last committed iteration is {committed})"
        where = {n: f"{n} (pipeline {d}, stage {s})" for (d, s), n in self.layout.mapping.items()}
        for n, what in lacking.items():
            where[n] = (f"{where.get(n, n)}, which did not receive {', '.join(what)} when a peer "
                        "was lost while the job reshaped")
        named = ", ".join(where.get(n, n) for n in sorted(lost & set(self.layout.active_nodes)))
        decision = self._decide(lost & set(self.layout.active_nodes), self.joining)
        total = self.cfg.num_microbatches * self.cfg.pipelines
        if decision.action == Action.ADD_PIPELINE and total % decision.layout.num_pipelines:
            # the iteration's micro-batches must split evenly: the new nodes wait on standby
            decision = Decision(Action.KEEP, self.layout.with_standby(
                tuple(self.layout.standby) + tuple(self.joining)), (),
                f"{total} micro-batches do not split over {decision.layout.num_pipelines} "
                "pipelines; the new nodes wait on standby")
        agreed = self.now()
        self.emit({"time_s": agreed, "kind": "agreement", "node": "launcher",
                   "generation": rec.generation, "lost": sorted(lost), "leaving": sorted(leaving),
                   "resume": resume, "reports": len(rec.reports),
                   **({"lacking": lacking} if lacking else {}),
                   **({"rolled_back": True} if rolled_back else {}),
                   "agreement_s": round(agreed - rec.started_s, 6),
                   "action": decision.action.value})
        plan: dict[str, Any]
        if self._futile >= 3:
            reasons = sorted({r["reason"] for r in rec.reports.values()})
            self.stop_message = (
                f"the job could not re-form {when}: the last {self._futile} plans failed while "
                f"they were carried out, with no node lost in between ({'; '.join(reasons)})"
                "; stopping")
            plan = {"action": "stop", "message": self.stop_message[:2000]}
        elif (self.cfg.redundancy == "none" and not self.cfg.shadow.enabled
                and lost & set(self.layout.active_nodes)):
            self.stop_message = (
                f"lost {named} {when}; redundancy is off, so no other node holds "
                "their stages (set redundancy: lazy or eager), and no checkpoint is available")
            plan = {"action": "stop", "message": self.stop_message}
        elif decision.action == Action.DROP_PIPELINE and (
                self.cfg.num_microbatches * self.cfg.pipelines) % decision.layout.num_pipelines:
            self.stop_message = (
                f"lost {named} {when}: adjacent stages of one pipeline; dropping that pipeline "
                f"would leave {decision.layout.num_pipelines} pipelines, over which the "
                f"{self.cfg.num_microbatches * self.cfg.pipelines} micro-batches of an "
                "iteration do not split evenly; stopping")
            plan = {"action": "stop", "message": self.stop_message}
        elif decision.action not in (Action.FAILOVER, Action.KEEP, Action.DROP_PIPELINE,
                                     Action.REBALANCE, Action.ADD_PIPELINE,
                                     Action.RESTORE_FROM_SHADOW, Action.REPARTITION) or (
                decision.action == Action.REPARTITION and decision.needs_restore):
            self.stop_message = (
                f"lost {named} {when}: "
                + ("adjacent stages of one pipeline, so no replica of one of them survives; "
                   if self._adjacent(lost) else "")
                + f"the plan is {decision.action.value} ({decision.reason}), which this runtime "
                  "cannot carry out yet (no restore from checkpoints at another depth"
                + ("" if self.cfg.shadow.enabled else "; shadow.enabled would restore the "
                   "lost stages from CPU shadows") + "); stopping. Resume with --resume from the "
                  "newest durable checkpoint if checkpoint.every was set")
            plan = {"action": "stop", "message": self.stop_message}
        else:
            partition = (self._partition_at(decision.layout.num_stages)
                         if decision.action == Action.REPARTITION else self.partition)
            plan = {"action": decision.action.value, "generation": rec.generation + 1,
                    "layout": decision.layout.to_json(),
                    "previous_layout": self.layout.to_json(), "resume": resume,
                    "moves": [{"kind": m.kind.value, "pipeline": m.pipeline, "stage": m.stage,
                               "src": m.src, "dst": m.dst} for m in decision.moves],
                    "stages": decision.layout.num_stages, "partition": partition,
                    "previous_partition": self.partition,
                    # for a shadow whose writer died between the commit and its COMMIT message
                    "clip_scale": next((r["clip_scale"] for r in rec.reports.values()
                                        if r["committed_through"] == resume - 1
                                        and r.get("clip_scale") is not None), None)}
            if self._continues_in_flight(decision, resume) and all(
                    r.get("formed", True) for r in rec.reports.values()):
                # (not after a plan that failed while it was carried out: some nodes dropped
                # their share of the iteration, so every node replays it whole)
                # survivors keep their share of the in-flight iteration; each derives the rest
                # from what every node reports done (spotpipe.schedule.replay)
                plan["salvage"] = {n: r["done"] for n, r in rec.reports.items()
                                   if r.get("flight") == resume and n not in lost}
        self.store.set(plan_key(rec.generation), json.dumps(plan))
        if not self.store.check([abort_key(rec.generation)]):
            # a change at an iteration boundary aborted no one; every node has reported, so the
            # generation's abort watchers may go now
            self.store.set(abort_key(rec.generation), "the generation ended at a boundary")
        self.emit({"time_s": self.now(), "kind": "plan", "node": "launcher",
                   "generation": rec.generation, **{k: v for k, v in plan.items()
                                                    if k not in ("layout", "salvage",
                                                                 "clip_scale")},
                   **({"replay": "rest" if "salvage" in plan else "iteration"}
                      if plan["action"] != "stop" else {}),
                   **({"carriers": {n: [s for _, s in slots] for n, slots in
                                    decision.layout.carriers().items()}}
                      if plan["action"] != "stop" else {})})
        self.left |= leaving
        if plan["action"] != "stop":
            # nodes the new layout does not list leave the job; those it puts on standby wait
            # in their processes (a joiner, or a node a re-partition or a dropped pipeline
            # left over) until a later plan places them
            self.left |= (set(self.layout.active_nodes) - set(decision.layout.active_nodes)
                          - set(decision.layout.standby))
            placed = set(decision.layout.active_nodes) - set(self.layout.active_nodes)
            self._before = (self.layout, list(self.partition))
            self._resumed_at = resume
            self.layout = decision.layout
            self.partition = plan["partition"]
            self.generation = rec.generation + 1
            for node in sorted(placed):
                self.store.set(join_key(node), json.dumps({"generation": rec.generation}))
            for node in list(self.joining):
                if node in decision.layout.all_nodes:
                    self.joining.remove(node)
        self.recovery = None
        if plan["action"] != "stop" and self._decide(set(), []).action not in (
                Action.KEEP, Action.ADD_PIPELINE):
            self._request_regroup("the layout can improve further")
