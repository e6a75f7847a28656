"""The one recovery decision: what a job does after a loss, a notice or a join.

`recover` is a pure function from the layout, the nodes' reports, the joiners, the job's rules
and its history to a `Decision`: the action (failover, rebalance, add or drop a pipeline,
re-partition, restore from shadows, roll back, keep, or stop with its reason), the iteration
to resume at, the moves and state transfers, and what each node does with the iteration in
flight. The coordinator collects reports, calls it and publishes what it returns; workers carry
a Decision out without deciding anything; the simulator's spotpipe policy calls it too, so what
the simulator predicts is what the runtime does.

The layout-level choice (which node takes which stage) is `plan.policy.decide`; on top of it
this module owns the rules a running job adds:
- the resume iteration: one past the newest iteration any survivor committed (never below
  what the last plan resumed at);
- a plan that failed while carried out (a peer lost while groups formed or states moved):
  nodes that did not receive a stage it gave them are counted out (they join again as new
  nodes); a node that missed only its replica keeps its place and its stages, and the next
  plan sends the replica again (meanwhile nothing is taken over from it); if no survivor's
  state changed yet, the plan is rolled back and the job decides again from the layout before
  it;
- plans failing again and again with no node lost in between (a partitioned network) stop
  the job instead of looping;
- without redundancy or shadows, a loss is a stop only when some stage's state is on no
  survivor (D = 1, or every pipeline lost that stage): with D >= 2 `decide` drops the broken
  pipelines (or assembles whole ones from their survivors), and every survivor replays the
  in-flight iteration whole, no replica holding the lost share;
- pipelines must divide the iteration's micro-batches (a new pipeline waits on standby, a
  drop that would not divide them is a stop);
- a re-partition the job cannot make (shadows hold the launch partition; no partition at that
  depth) becomes KEEP once, and the job runs on with its carriers;
- whether survivors keep their share of the in-flight iteration (the rest-of-iteration
  replay after a pure takeover) or replay it whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Iterable

from spotpipe.plan.layers import held_replica
from spotpipe.plan.layout import Layout
from spotpipe.plan.policy import Action, Decision as Choice, Move, MoveKind, Room, decide, restart
from spotpipe.plan.transfers import STAGE, Transfer, departing, transfers

Partition = tuple[tuple[int, int], ...]

# actions a running job carries out in memory; anything else is a stop
CARRIED_OUT = (Action.FAILOVER, Action.HANDOVER, Action.KEEP, Action.DROP_PIPELINE,
               Action.REBALANCE, Action.ADD_PIPELINE, Action.RESTORE_FROM_SHADOW,
               Action.REPARTITION)


@dataclass(frozen=True)
class Rules:
    """What the job's configuration says about recovery (see `Rules.from_config` callers)."""

    replicas: bool  # redundancy is on: nodes hold their successor's replica
    shadows: bool  # CPU shadows hold every stage of pipeline 0
    repartition: bool  # the job may change its depth
    replay_rest: bool  # after a pure takeover, survivors keep their share of the iteration
    microbatches: int  # micro-batches of one iteration, over every pipeline
    # why the job can never re-partition (shadows or peer copies hold the launch partition)
    repartition_blocked: str | None = None
    # the partition (layer ranges per stage) at another depth; raises ValueError when the
    # model cannot be split that way. Deterministic for a job (the caller memoises it).
    partition_for: Callable[[int], Partition] | None = None
    max_futile: int = 3  # plans failing in a row with no node lost, before the job stops
    min_stages: int = 1  # the smallest depth at which a stage fits in memory
    # whether a node's memory holds a set of stages (`plan.policy.Room`; None: a count rule)
    room: Room | None = None
    # the job is restarted from its newest checkpoint when no layout of the survivors holds
    # its state (a supervisor does it, as the simulator models it); the runtime stops
    # instead and says so (restarting it is the user's `--resume`)
    restarts: bool = False


@dataclass(frozen=True)
class NodeReport:
    """What one node says of itself when a generation ends (`protocol.Report`, planner side)."""

    node: str
    iteration: int = -1
    committed_through: int = -1
    boundary: bool = False  # at an iteration boundary (a change planned), not after a failure
    leaving: bool = False
    formed: bool = True
    lacking: tuple[str, ...] = ()
    untouched: bool = True
    flight: int = -1
    done: tuple[Any, ...] = ()
    clip_scale: float | str | None = None  # "skip": the committed step was skipped
    reason: str = ""
    # the stage whose replica it holds (None: none); read only where its last plan failed
    # (`formed` False): a node whose generation formed holds the one its layout gives it
    replica: int | None = None


@dataclass(frozen=True)
class History:
    """What the job remembers between decisions: where it is, and what the last plan was."""

    layout: Layout
    partition: Partition
    generation: int = 0
    before: tuple[Layout, Partition] | None = None  # the layout the last plan started from
    resumed_at: int = 0  # the iteration the last plan resumed at
    futile: int = 0  # failed plans in a row with no node lost in between
    lost_before: frozenset[str] = frozenset()
    repartition_refused: str | None = None  # said once, then remembered
    # the choice already made for this layout with nothing lost (the `improve` check), so
    # that the boundary decision after it does not make it again (a cache, not state)
    next_choice: "tuple[Layout, Choice, str | None] | None" = field(
        default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Decision:
    """The outcome of one recovery: what every node does next. Serialisable (`to_json`)."""

    action: Action
    generation: int  # the generation the decision starts (unused for a stop)
    resume: int
    layout: Layout
    previous_layout: Layout
    partition: Partition
    previous_partition: Partition
    moves: tuple[Move, ...] = ()
    transfers: tuple[Transfer, ...] = ()
    # node -> what it finished of the iteration in flight, for nodes that keep their share
    # of it (None: every node replays the in-flight iteration whole)
    salvage: Mapping[str, tuple[Any, ...]] | None = None
    # the committed iteration's, for a new shadow writer ("skip": its step was skipped)
    clip_scale: float | str | None = None
    rejoin: tuple[str, ...] = ()  # counted out for state they did not receive: join again
    # nodes of `previous_layout` that lack the replica it gives them (a plan failed before it
    # arrived): a re-partition takes none of its layers from them (`plan.layer_plan`)
    unreplicated: tuple[str, ...] = ()
    reason: str = ""
    message: str = ""  # a stop's one-sentence reason

    @property
    def stopped(self) -> bool:
        return self.action == Action.STOP

    @property
    def needs_restore(self) -> bool:
        """Progress since the last shadow copy or checkpoint is rolled back."""
        return any(m.kind == MoveKind.RESTORE for m in self.moves)

    @property
    def promoted(self) -> frozenset[str]:
        return frozenset(m.dst for m in self.moves if m.kind == MoveKind.PROMOTE)

    def promotions(self, node: str) -> list[int]:
        return [m.stage for m in self.moves if m.kind == MoveKind.PROMOTE and m.dst == node]

    def restores(self, node: str) -> list[Move]:
        return [m for m in self.moves if m.kind == MoveKind.RESTORE and m.dst == node]

    def receives(self, node: str) -> list[str]:
        """What `node` is to receive under this decision (it lacks it until it has it)."""
        if self.action == Action.REPARTITION:
            return [f"stage {s}" for (_, s), n in sorted(self.layout.owners) if n == node]
        return ([f"{t.kind} {t.stage}" for t in self.transfers if t.dst == node]
                + [f"stage {m.stage}" for m in self.restores(node)])

    @property
    def departing(self) -> frozenset[str]:
        """Nodes leaving on a notice that send stages before they go (`plan.transfers`)."""
        return frozenset(departing(self.transfers, self.layout))

    @property
    def handed_over(self) -> tuple[Transfer, ...]:
        """The transfers the departing nodes send."""
        gone = self.departing
        return tuple(t for t in self.transfers if t.src in gone)

    def handover_group(self) -> list[str]:
        """The members, in rank order, of the group the departing nodes send over: they
        and their receivers (empty when no node departs)."""
        handed = self.handed_over
        return sorted({t.src for t in handed} | {t.dst for t in handed})

    def released(self) -> frozenset[str]:
        """Nodes of the layout before that the new one neither runs nor keeps on standby."""
        return (self.previous_layout.active_nodes - self.layout.active_nodes
                - frozenset(self.layout.standby) - frozenset(self.rejoin))

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action.value, "generation": self.generation, "resume": self.resume,
            "layout": self.layout.to_json(), "previous_layout": self.previous_layout.to_json(),
            "partition": [list(r) for r in self.partition],
            "previous_partition": [list(r) for r in self.previous_partition],
            "moves": [[m.kind.value, m.pipeline, m.stage, m.src, m.dst] for m in self.moves],
            "transfers": [t.to_json() for t in self.transfers],
            "salvage": None if self.salvage is None else {
                n: [list(e) if isinstance(e, (list, tuple)) else e for e in done]
                for n, done in self.salvage.items()},
            "clip_scale": self.clip_scale, "rejoin": list(self.rejoin),
            "unreplicated": list(self.unreplicated),
            "reason": self.reason, "message": self.message}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Decision":
        """Raises ValueError (or KeyError/TypeError, which callers treat alike) when `data`
        is not a decision."""
        return cls(
            action=Action(data["action"]), generation=int(data["generation"]),
            resume=int(data["resume"]), layout=Layout.from_json(data["layout"]),
            previous_layout=Layout.from_json(data["previous_layout"]),
            partition=_partition(data["partition"]),
            previous_partition=_partition(data["previous_partition"]),
            moves=tuple(Move(MoveKind(k), int(d), int(s), str(src), str(dst))
                        for k, d, s, src, dst in data["moves"]),
            transfers=tuple(Transfer.from_json(t) for t in data["transfers"]),
            salvage=None if data["salvage"] is None else {
                str(n): tuple(tuple(e) if isinstance(e, list) else e for e in done)
                for n, done in data["salvage"].items()},
            clip_scale=(data["clip_scale"] if data["clip_scale"] in (None, "skip")
                        else float(data["clip_scale"])),
            rejoin=tuple(str(n) for n in data["rejoin"]),
            unreplicated=tuple(str(n) for n in data["unreplicated"]), reason=str(data["reason"]),
            message=str(data["message"]))._checked()

    def _checked(self) -> "Decision":
        """A transfer's source outside the layout before would be a node that is not in the
        job: no node waits for it (ValueError, as for any malformed decision)."""
        strangers = sorted(self.departing - self.previous_layout.active_nodes)
        if strangers:
            raise ValueError(f"transfers from {strangers}, which the layout before does not run")
        return self


@dataclass(frozen=True)
class Outcome:
    """A decision with what the coordinator records of it (its agreement event)."""

    decision: Decision
    history: History
    lost: frozenset[str]
    leaving: frozenset[str]
    lacking: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    rolled_back: bool = False
    refused: str | None = None  # a re-partition refused now (said once)
    improve: bool = False  # the new layout can improve further at the next boundary

    @property
    def unreplicated(self) -> frozenset[str]:
        """The nodes that kept their places lacking their replicas (the Decision says it)."""
        return frozenset(self.decision.unreplicated)


def _partition(data: Iterable[Iterable[int]]) -> Partition:
    return tuple((int(a), int(b)) for a, b in data)


def recover(history: History, reports: Mapping[str, NodeReport], joiners: Iterable[str],
            rules: Rules, *, dead: Iterable[str] = (), with_transfers: bool = True,
            seen_committed: int = -1) -> Outcome:
    """Decide what the job does after generation `history.generation` ended.

    `reports` are the survivors' (every live node has reported); `dead` the nodes known lost
    (exited, fenced); `joiners` accepted nodes not placed yet, in arrival order.
    `seen_committed`: the newest iteration the caller saw committed, for the messages only
    (when every node is lost, no report tells it).
    `with_transfers=False` leaves `Decision.transfers` empty: nothing else depends on them,
    and the simulator, which moves no state, need not pay for them."""
    joiners = list(joiners)
    layout, partition = history.layout, history.partition
    leaving = frozenset(n for n, r in reports.items() if r.leaving)
    # a node that could not receive a stage the last plan gave it (a peer was lost while the
    # plan was carried out) does not hold its place: counted out, it joins again. One that
    # missed only its replica runs its stages as placed (`_unreplicated`)
    missed = {n: r.lacking for n, r in reports.items() if r.lacking}
    lacking = {n: w for n, w in missed.items() if _lacks_a_stage(w)}
    rolled_back = False
    # nodes the failed plan let go (leaving on a notice) that no longer report: gone from the
    # job, as the dead are, whichever layout it goes on from
    let_go = frozenset(history.before[0].active_nodes - layout.all_nodes - reports.keys()
                       if history.before is not None else ())
    # (a plan whose only receivers died leaves no node lacking anything, yet its layout was
    # never made: the stages it moved are still where they were)
    cut_short = bool(missed) or any(not r.formed for r in reports.values())
    if cut_short and history.before is not None and _untouched(
            history.before[0], reports, frozenset(dead) | let_go, frozenset(layout.standby)):
        placed = layout.active_nodes - history.before[0].all_nodes
        layout, partition = history.before
        rolled_back = True
        dead = frozenset(dead) | let_go
        # the nodes of the layout before hold their places; joiners do not
        lacking = {n: w for n, w in lacking.items() if n not in layout.active_nodes}
        # a joiner the plan placed that received all it was sent is in no place of the layout
        # before: it waits on standby again (a node that a Decision neither runs, keeps on
        # standby nor counts out leaves the job)
        back = sorted(placed - frozenset(dead) - leaving - frozenset(lacking))
        if back:
            layout = layout.with_standby(layout.standby + tuple(back))
    lost = frozenset(dead) | leaving | frozenset(lacking)
    if set(layout.standby) & lost:  # a standby node lost (or counted out) is no spare
        layout = layout.with_standby(tuple(n for n in layout.standby if n not in lost))
    unreplicated = (_unreplicated(layout, reports, lost) if rules.replicas else frozenset())
    # plans that fail while carried out or in their first iteration, again and again with no
    # node lost in between (groups that cannot form or exchange: a partitioned network),
    # would loop forever: stop instead
    failed_plan = any(not r.formed for r in reports.values()) or _stalled(history, reports)
    futile = history.futile + 1 if failed_plan and lost <= history.lost_before else 0
    # (at least what the last plan resumed after: the reports may all come from nodes that
    # committed nothing yet, joiners whose placement failed)
    committed = max([r.committed_through for r in reports.values()] + [history.resumed_at - 1])
    resume = committed + 1
    # (a joiner whose placement failed ran no iteration: it reports -1)
    when = _when(max((r.iteration for r in reports.values() if r.iteration >= 0),
                     default=None), max(committed, seen_committed))
    hit = lost & layout.active_nodes
    state = replace(history, layout=layout, partition=partition)
    cached = history.next_choice
    if (cached is not None and cached[0] is layout and not hit and not joiners
            and not leaving and not unreplicated):
        choice, refused = cached[1], cached[2]
    else:
        choice, refused = _choose(state, hit, joiners, rules, leaving, unreplicated)
    if refused:
        state = replace(state, repartition_refused=refused)
    def named() -> str:
        return _named(layout, hit, lacking)

    message = _stop_reason(choice, rules, layout, hit, lost, reports, futile, named, when,
                           leaving, unreplicated)
    if message and rules.restarts and futile < rules.max_futile:
        # restarted from the newest checkpoint on the survivors (see Rules.restarts)
        survivors = sorted(layout.active_nodes - lost) + [n for n in layout.standby
                                                           if n not in lost]
        choice = restart(layout, survivors + [n for n in joiners if n not in survivors],
                         rules.min_stages, [], rules.microbatches)
        message = "" if choice.action != Action.STOP else (
            f"lost {named()} {when}: {choice.reason}")
    base = dict(generation=history.generation + 1, resume=resume, previous_layout=layout,
                previous_partition=partition, rejoin=tuple(sorted(
                    n for n in lacking if n not in choice.layout.active_nodes)),
                unreplicated=tuple(sorted(unreplicated)))
    if message:
        # (the layout a stop leaves: decide's own, or the survivors waiting for a restart)
        left = choice.layout if choice.action == Action.STOP else layout.with_standby(())
        decision = Decision(Action.STOP, layout=left, partition=partition, message=message,
                            reason=choice.reason, **base)  # type: ignore[arg-type]
        return Outcome(decision, replace(state, futile=futile, lost_before=lost), lost,
                       leaving, lacking, rolled_back, refused)
    new_partition = (_partition_at(rules, partition, choice.layout.num_stages)
                     if choice.action == Action.REPARTITION else partition)
    promoted = {m.dst for m in choice.moves if m.kind == MoveKind.PROMOTE}
    copies = [(m.stage, m.src, m.dst) for m in choice.moves if m.kind == MoveKind.COPY]
    # (a re-partition moves layers, not states, but for the stages nodes leaving on a notice
    # hand over whole before the layers move (`policy._leave_by_repartition`); a restart
    # loads every state from the checkpoint)
    moved: tuple[Transfer, ...] = ()
    if with_transfers and choice.action == Action.REPARTITION:
        moved = tuple(Transfer(STAGE, s, src, dst) for s, src, dst in copies)
    elif with_transfers and choice.action != Action.RESTORE_FROM_CHECKPOINT:
        moved = tuple(transfers(layout, choice.layout, copies, promoted, rules.replicas,
                                unreplicated))
    continues = (_continues_in_flight(choice, layout, rules)
                 and all(r.formed for r in reports.values()))
    decision = Decision(
        choice.action, layout=choice.layout, partition=new_partition, moves=choice.moves,
        transfers=moved, reason=choice.reason,
        # (not after a plan that failed while it was carried out: some nodes dropped their
        # share of the iteration, so every node replays it whole)
        salvage=({n: r.done for n, r in reports.items() if r.flight == resume and n not in lost}
                 if continues else None),
        # for a shadow whose writer died between the commit and its COMMIT message
        clip_scale=next((r.clip_scale for r in reports.values()
                         if r.committed_through == resume - 1 and r.clip_scale is not None),
                        None), **base)  # type: ignore[arg-type]
    after = History(choice.layout, new_partition, history.generation + 1,
                    before=(layout, partition), resumed_at=resume, futile=futile,
                    lost_before=lost, repartition_refused=state.repartition_refused)
    upcoming, upcoming_refused = _choose(after, frozenset(), [], rules)
    after = replace(after, next_choice=(after.layout, upcoming, upcoming_refused))
    # (pipelines the spares can form are an improvement too: after a drop, with nodes waiting)
    improve = upcoming.action is not Action.KEEP
    return Outcome(decision, after, lost, leaving, lacking, rolled_back, refused, improve)


def _lacks_a_stage(lacking: Iterable[str]) -> bool:
    """Whether what a node reports it lacks (`runtime.reshape`: "stage 1", "replica 2")
    includes a stage."""
    return any(not what.startswith("replica ") for what in lacking)


def _unreplicated(layout: Layout, reports: Mapping[str, NodeReport],
                  lost: frozenset[str]) -> frozenset[str]:
    """The live nodes of `layout` that do not hold the replica it gives them: a plan failed
    before it reached them (the layout a plan was carried out in, or the one before it,
    rolled back to: each node says which replica it holds, so both are read the same way)."""
    return frozenset(n for n, r in reports.items()
                     if not r.formed and n in layout.active_nodes and n not in lost
                     and (want := held_replica(layout, n)) is not None and r.replica != want)


def _untouched(before: Layout, reports: Mapping[str, NodeReport], dead: frozenset[str],
               waiting: frozenset[str]) -> bool:
    """Whether the plan that failed while carried out can be undone: every node of the layout
    before it is either lost, or put on standby by the plan (standby nodes keep their state),
    or reports that nothing of the plan changed its state (a re-partition exchanges all layers
    before any node switches over, so one cut short leaves every node as it was). A burst of
    losses during a re-partition then costs the nodes lost, not the job."""
    for node in before.active_nodes:
        if node in dead or (node in waiting and node not in reports):
            continue
        report = reports.get(node)
        if report is None or not report.untouched:
            return False
    return True


def _choose(history: History, hit: frozenset[str], joiners: list[str],
            rules: Rules, leaving: frozenset[str] = frozenset(),
            unreplicated: frozenset[str] = frozenset()) -> tuple[Choice, str | None]:
    """`plan.decide`, less the re-partitions this job cannot make: those become KEEP, and the
    job runs on in the layout it has (where nodes leave on a notice, `hit`, the takeover the
    re-partition stood in for). Returns the reason when it is new."""
    layout = history.layout

    def decided(repartition: bool) -> Choice:
        return decide(layout, hit, joiners, shadows=rules.shadows, replicas=rules.replicas,
                      repartition=repartition, min_stages=rules.min_stages, leaving=leaving,
                      microbatches=rules.microbatches, room=rules.room,
                      unreplicated=unreplicated)

    choice = decided(rules.repartition)
    if choice.action != Action.REPARTITION or choice.needs_restore:
        return choice, None
    depth = choice.layout.num_stages
    problem = history.repartition_refused
    new = None
    if problem is None and rules.repartition_blocked:
        problem = new = f"cannot re-partition to P={depth}: {rules.repartition_blocked}"
    if problem is None:
        try:
            _partition_at(rules, history.partition, depth)
        except ValueError as exc:  # the partitioner's message says what is wrong
            problem = new = f"cannot re-partition to P={depth}: {exc}".splitlines()[0][:300]
    if problem is None:
        return choice, None
    if hit:
        return decided(False), new
    waiting = [n for n in choice.layout.all_nodes if n not in layout.active_nodes]
    return Choice(Action.KEEP, layout.with_standby(tuple(sorted(waiting))), (), problem), new


def _partition_at(rules: Rules, partition: Partition, depth: int) -> Partition:
    if depth == len(partition):
        return partition
    if rules.partition_for is None:
        raise ValueError("this job cannot compute partitions at another depth")
    return _partition(rules.partition_for(depth))


def _when(in_flight: int | None, committed: int) -> str:
    """When the job was hit, as far as the reports tell: the iteration a node was in (else
    the one after the last committed), and none made up before the first commit (the job
    said "iteration 0 (the last committed iteration is -1)" of nodes that never reported)."""
    if committed < 0:
        return ("before any iteration was committed" if in_flight is None
                else f"in iteration {in_flight}, before any iteration was committed")
    # (a node at a boundary reports the iteration it just committed: the loss is in the next;
    # the job said "in iteration 5 (the last committed iteration is 5)")
    hit = committed + 1 if in_flight is None or in_flight <= committed else in_flight
    return f"in iteration {hit} (the last committed iteration is {committed})"


def _continues_in_flight(choice: Choice, layout: Layout, rules: Rules) -> bool:
    """Whether survivors can go on with the in-flight iteration instead of replaying it: a
    takeover (stages only promoted, none moved away or re-shaped) of an iteration that no one
    committed, with replicas whose holders kept what a takeover needs."""
    return (rules.replay_rest and rules.replicas and choice.action == Action.FAILOVER
            and choice.layout.num_stages == layout.num_stages
            and choice.layout.num_pipelines == layout.num_pipelines
            and all(m.kind in (MoveKind.PROMOTE, MoveKind.REPLICA) for m in choice.moves)
            and any(m.kind == MoveKind.PROMOTE for m in choice.moves))


def _named(layout: Layout, hit: frozenset[str], lacking: Mapping[str, tuple[str, ...]]) -> str:
    where = {}
    for n in layout.active_nodes:
        slots = layout.stages_of(n)  # (a carrier's are named together: "stages 1, 2")
        stages = ", ".join(str(s) for _, s in slots)
        where[n] = (f"{n} (pipeline {slots[0][0]}, stage{'s' if len(slots) > 1 else ''} "
                    f"{stages})")
    for n, what in lacking.items():
        where[n] = (f"{where.get(n, n)}, which did not receive {', '.join(what)} when a peer "
                    "was lost while the job reshaped")
    return ", ".join(where.get(n, n) for n in sorted(hit))


def _adjacent(layout: Layout, lost: frozenset[str], leaving: frozenset[str]) -> bool:
    """Whether some lost stage's replica holder (its predecessor) is lost too, and neither
    is a node leaving on a notice (which hands over what it holds before it goes)."""
    return any(layout.replica_holder(d, s) in lost and not {n, layout.replica_holder(d, s)}
               & leaving for (d, s), n in layout.mapping.items() if n in lost)


def _missing_replicas(layout: Layout, lost: frozenset[str],
                      unreplicated: frozenset[str]) -> str:
    """The lost stages whose replica holder had not received it, in words ("" for none)."""
    missing = [f"{layout.replica_holder(d, s)} had not received the replica of stage {s}"
               for (d, s), n in sorted(layout.mapping.items())
               if n in lost and layout.replica_holder(d, s) in unreplicated]
    return ", ".join(missing)


def _held_by_carriers(layout: Layout, lost: frozenset[str], leaving: frozenset[str]) -> str:
    """The lost stages whose predecessor survives but runs two stages (since an earlier loss)
    and so holds no replica, in words ("" for none)."""
    said = []
    for (d, s), n in sorted(layout.mapping.items()):
        holder = layout.replica_holder(d, s)
        if (n in lost and n not in leaving and holder not in lost and holder != n
                and layout.num_stages > 1 and not layout.has_replica(d, s)):
            runs = ", ".join(str(t) for _, t in layout.stages_of(holder))
            said.append(f"{holder} runs stages {runs} and so holds no replica of stage {s}")
    return ", ".join(said)


def _unheld(layout: Layout, lost: frozenset[str]) -> str:
    """The stages whose every data-parallel owner is lost, in words ("their stages" when none
    is: the job stops for another reason)."""
    stages = [s for s in range(layout.num_stages)
              if all(layout.owner(d, s) in lost for d in range(layout.num_pipelines))]
    if not stages:
        return "their stages"
    return f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages}"


def _stop_reason(choice: Choice, rules: Rules, layout: Layout, hit: frozenset[str],
                 lost: frozenset[str], reports: Mapping[str, NodeReport], futile: int,
                 named: Callable[[], str], when: str,
                 leaving: frozenset[str] = frozenset(),
                 unreplicated: frozenset[str] = frozenset()) -> str:
    """Why the job stops, in one sentence, or "" when it goes on."""
    if futile >= rules.max_futile:
        reasons = "; ".join(sorted({r.reason for r in reports.values()}))
        return (f"the job could not re-form {when}: the last {futile} plans failed before their "
                f"first iteration completed, with no node lost in between ({reasons}); "
                "stopping")[:2000]
    restart = choice.action == Action.RESTORE_FROM_CHECKPOINT or (
        choice.action == Action.REPARTITION and choice.needs_restore)
    goes_on = choice.action in CARRIED_OUT and not restart
    # without redundancy and shadows, the stages no survivor owns are simply gone (a job with
    # `rules.restarts` is restarted after this stop, as after the one below)
    if not rules.replicas and not rules.shadows and hit and not goes_on:
        return (f"lost {named()} {when}; redundancy is off, so no other node holds "
                f"{_unheld(layout, lost)} (set redundancy: lazy or eager, or shadow.enabled); "
                "stopping. Resume with --resume from the newest durable checkpoint if "
                "checkpoint.every was set")
    if restart and rules.restarts:
        return ""
    if not goes_on:
        survivors = len(layout.active_nodes - lost) + len(layout.standby)
        # a restart's own reason says what it would restore: nothing is, the job stops
        why = choice.reason if not restart else (
            "no pipeline can be repaired from memory" + (
                ", nor from the shadows onto the nodes left (no broken pipeline keeps a live "
                "node, or none has room for another stage)"
                if rules.shadows else ""))
        # (the last nodes lost at once: whether their stages were adjacent is beside the point)
        every = not survivors and not hit & leaving
        adjacent = not every and _adjacent(layout, lost, leaving)
        missing = _missing_replicas(layout, lost, unreplicated)
        carried = _held_by_carriers(layout, lost, leaving) if rules.replicas else ""
        return (f"lost {named()} {when}: "
                + ("no node of the job is left, so no copy of its state survives in memory; "
                   if every else "")
                + ("adjacent stages of one pipeline, so no replica of one of them survives; "
                   if adjacent else "")
                + (f"{missing} when a peer was lost while the job reshaped; " if missing
                   else "")
                + (f"{carried} (since an earlier loss); " if carried else "")
                # (every lost stage had a copy: what was missing is a node to take it)
                + ("the nodes leaving could hand their stages over, but "
                   + ("every node is leaving, so none is left to take them; " if not survivors
                      else "no node left has room for them beside its own (the memory the "
                      "launch measured); ")
                   if rules.replicas and not adjacent and hit & leaving else "")
                + f"no layout of the {survivors} surviving node(s) can hold the job's state "
                  f"({why}"
                + ("" if rules.shadows else "; shadow.enabled would restore the lost stages "
                   "from CPU shadows") + "); stopping. Resume with --resume from the newest "
                  "durable checkpoint if checkpoint.every was set")
    return ""


def _stalled(history: History, reports: Mapping[str, NodeReport]) -> bool:
    """The generation failed before it committed its first iteration: its plan failed as
    surely as one whose groups did not form. NCCL connects a communicator at its first
    collective, and nodes can form their groups yet not exchange (a link that drops data
    once it flows), so such plans fail in their first iteration; counted as failed, plan
    after plan that forms and fails with nothing lost stops the job instead of looping. A
    report at a boundary is a change planned, not a failure."""
    return bool(reports) and not any(r.boundary for r in reports.values()) and all(
        r.committed_through < history.resumed_at for r in reports.values())


@lru_cache(maxsize=4096)
def _boundary_report(node: str, committed: int, leaving: bool) -> NodeReport:
    """A node's report at a boundary with nothing in flight (immutable, so shared: the
    simulator's planner makes tens of them per event)."""
    return NodeReport(node, iteration=committed + 1, committed_through=committed,
                      boundary=True, leaving=leaving)


# Boundary decisions settle by construction (see `plan.policy._grow`: each one strictly lowers
# the layout's distance from its fixed point), within 4 steps of an event (the spares form
# every pipeline they can in one); `settle` raises past this many, which would be a planner
# bug, rather than cut the sequence short.
SETTLE_CAP = 8


def settle(history: History, rules: Rules, *, lost: Iterable[str] = (),
           leaving: Iterable[str] = (), joiners: Iterable[str] = (),
           committed: int | None = None, with_transfers: bool = True) -> list[Outcome]:
    """The decisions a running job makes for one event and at the boundaries after it, until
    its layout cannot improve further: one `recover` for the event (nodes `lost`, nodes
    `leaving` on a notice, `joiners`), then one per boundary while the last outcome says the
    layout can improve. This is what the coordinator does over several generations and what
    the simulator's policies replay at one instant; both call `recover`, so they agree.

    Every live node reports having committed `committed` (default: one before the iteration
    the job last resumed at, i.e. nothing in flight is kept)."""
    lost, leaving, joiners = frozenset(lost), frozenset(leaving), tuple(joiners)
    done = history.resumed_at - 1 if committed is None else committed

    def reports(h: History, going: frozenset[str]) -> dict[str, NodeReport]:
        return {n: _boundary_report(n, done, n in going)
                for n in sorted(h.layout.active_nodes - lost)}

    outcomes = [recover(history, reports(history, leaving), joiners, rules, dead=lost,
                        with_transfers=with_transfers)]
    while outcomes[-1].improve and not outcomes[-1].decision.stopped:
        if len(outcomes) >= SETTLE_CAP:
            steps = ", ".join(o.decision.action.value for o in outcomes)
            raise RuntimeError(
                f"the planner did not settle in {SETTLE_CAP} decisions after one event "
                f"(lost {sorted(lost)}, leaving {sorted(leaving)}, joiners {list(joiners)}, "
                f"from {history.layout.to_json()}): {steps}")
        after = outcomes[-1].history
        outcomes.append(recover(after, reports(after, frozenset()), [], rules,
                                with_transfers=with_transfers))
    return outcomes
