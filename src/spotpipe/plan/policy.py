"""What to do when nodes leave or join: a pure function from (layout, events) to a decision.

The runtime and the simulator both call `decide`, so what the simulator predicts is what the
runtime does. One call makes one decision; callers call again (with no new events) until the
answer is KEEP, which lets a failover happen at once and a rebalance follow as a separate,
cheaper-to-reason-about step.

Order of preference, and why:
1. Lost nodes that own stages come first, because the job cannot take a step until every
   stage has an owner. Taking over from an in-memory replica (FAILOVER) is the cheapest fix.
2. A pipeline whose lost stage has no live replica (two adjacent losses; without redundancy,
   `replicas=False`, any loss) cannot be repaired from memory. If another pipeline survives,
   drop the broken one (DROP_PIPELINE): data parallelism shrinks, the global batch stays,
   nothing is reloaded.
   With CPU shadows (`shadows=True`) and no pipeline left whole, a broken pipeline is
   repaired instead (RESTORE_FROM_SHADOW): stages with a live replica are promoted as in a
   failover, the others are loaded from their shadow by a standby node or the nearest live
   node of the pipeline; the survivors keep their state and only the in-flight iteration is
   replayed; a pipeline with no live node left is dropped (the repaired ones hold its state).
3. If every pipeline is broken, state must come from the shadows/checkpoint
   (RESTORE_FROM_CHECKPOINT), at depth P if enough nodes remain, else at a smaller depth
   (REPARTITION), else STOP.
4. With nothing lost: give a node that carries two stages a standby partner (REBALANCE, which
   restores redundancy); with no standby node for it, re-partition the model onto the depth
   the active nodes allow, one stage per node (REPARTITION down: redundancy comes back and no
   node runs two stages' worth of layers); return to the configured depth once enough nodes
   are there for it at the same number of pipelines (REPARTITION up); or add a pipeline
   (ADD_PIPELINE), in that order: redundancy protects the work already running, extra
   pipelines only add throughput. A re-partition keeps D, so the micro-batches of an
   iteration split over the pipelines as before.

Every pipeline takes an equal share of the same global batch, so the number of pipelines D
must divide the iteration's micro-batches (`microbatches`, when the caller gives it). Growth
therefore forms, in one decision, as many pipelines as the standby nodes make up and the batch
splits over (with 8 micro-batches at P = 2 and D = 4: four at once from 8 spares, none from
4, since 6 pipelines would not split the batch), and a drop or a restart keeps the largest
such D the survivors allow, putting the nodes of the pipelines left over on standby: D = 1
always divides, so no loss stops a job over the batch's split alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable, Iterable

from spotpipe.plan.layout import Layout, Slot, splits_evenly


class Action(str, Enum):
    KEEP = "keep"
    FAILOVER = "failover"
    HANDOVER = "handover"  # a node with a notice hands its stage to a standby node
    REBALANCE = "rebalance"
    ADD_PIPELINE = "add_pipeline"
    DROP_PIPELINE = "drop_pipeline"
    REPARTITION = "repartition"
    RESTORE_FROM_CHECKPOINT = "restore_from_checkpoint"
    RESTORE_FROM_SHADOW = "restore_from_shadow"
    STOP = "stop"


class MoveKind(str, Enum):
    PROMOTE = "promote"  # the replica in dst's memory becomes an owned stage: no transfer
    # stage state (weights + optimizer) sent peer to peer from src to dst; in a REPARTITION,
    # a stage of the old partition a node leaving on a notice hands to one that stays
    COPY = "copy"
    REPLICA = "replica"  # a replica for dst to hold, sent from the stage's owner src
    RESTORE = "restore"  # state loaded from the shadows / durable checkpoint (src "shadow")
    LAYERS = "layers"  # a re-partitioned stage, assembled layer by layer from peers (src "peers")


SHADOW = "shadow"  # src of RESTORE moves
PEERS = "peers"  # src of LAYERS moves: which peer sends which layer is `plan.layers`' business

# Whether a node's memory holds these stages (sorted indices) of a `depth`-stage partition,
# with no replica beside them (a node running more than one stage holds none). The runtime
# answers from the memory the launch estimates per layer (`job.stages_fit`, on the
# coordinator's partition at that depth), the simulator from its instances'
# (`sim.fit.node_room`); without one, a count rule stands in for it.
Room = Callable[[int, tuple[int, ...]], bool]


@dataclass(frozen=True)
class Move:
    kind: MoveKind
    pipeline: int  # pipeline index in the NEW layout
    stage: int  # stage index in the NEW layout
    src: str
    dst: str


@dataclass(frozen=True)
class Decision:
    action: Action
    layout: Layout
    moves: tuple[Move, ...] = ()
    reason: str = ""
    lost_pipelines: tuple[int, ...] = field(default=())  # old indices dropped or broken

    @property
    def needs_restore(self) -> bool:
        """True when progress since the last shadow/checkpoint copy is rolled back."""
        return any(m.kind == MoveKind.RESTORE for m in self.moves)


def decide(layout: Layout, lost: set[str] | frozenset[str], joined: Iterable[str], *,
           min_stages: int = 1, shadows: bool = False, replicas: bool = True,
           repartition: bool = True, leaving: Iterable[str] = (),
           microbatches: int | None = None, room: Room | None = None,
           unreplicated: Iterable[str] = ()) -> Decision:
    """Decide the next layout given nodes `lost` and nodes `joined` since `layout`.

    `min_stages` is the smallest depth at which the model still fits in the nodes' memory;
    below it the job stops. `shadows`: every stage has a CPU shadow to restore it from.
    `replicas`: nodes hold their successor's replica (redundancy is on). `repartition`: the
    job may shrink its depth when too few nodes remain (else carriers carry on). `leaving`:
    the nodes of `lost` that had a preemption notice and are still there at the boundary.
    `microbatches`: of one iteration over every pipeline; only a number of pipelines that
    divides it is planned (None: any). `room`: whether a node's memory holds a set of stages
    (`Room`); a stage is copied or restored only onto a node it says holds it with the
    stages the node runs (None: any node running one stage, or where the model fits on
    fewer nodes, as many as `min_stages` implies). `unreplicated`: nodes of `layout` that do
    not hold the replica it gives them (a plan failed before they received it): nothing is
    taken over or copied from those replicas.
    """
    widths = _Widths(microbatches)
    lost = frozenset(lost)
    joined = tuple(joined)
    if not lost and not joined:  # the "anything else to do?" call after each decision
        standby = layout.standby
    else:
        standby = tuple(n for n in layout.standby if n not in lost)
        standby += tuple(n for n in joined if n not in lost and n not in standby
                         and n not in layout.active_nodes)
    hit = lost & layout.active_nodes
    if not hit:
        return _grow(layout.with_standby(standby), min_stages, repartition, widths)
    # (a node leaving on a notice is still there at the boundary: its stages are a source)
    sources = _Sources(lost, frozenset(leaving) & hit, replicas, room=room,
                       unreplicated=frozenset(unreplicated))
    handover = _handover(layout, hit, sources, standby)
    if handover is not None:
        return handover
    broken = _broken(layout, sources)
    if repartition and not broken:
        leave = _leave_by_repartition(layout, hit, sources, standby, min_stages, widths)
        if leave is not None:
            return leave
    in_place = _in_place(layout, sources, standby, widths, broken)
    if in_place is not None:
        return in_place
    # (a pipeline with no live node left is dropped: the others hold its state)
    kept = [d for d in broken if set(layout.grid[d]) - lost] if shadows else []
    # from memory when the survivors hold every stage, unless the shadows keep more pipelines
    assembled = _assemble(layout, sources, standby, widths,
                          widths.at_most(len(kept)), sources.takes(layout.num_stages))
    if assembled is not None:
        return assembled
    # A node may run more than two stages where its memory holds them (`room`; without it,
    # where the model fits on fewer nodes: at that depth a node's memory holds a stage and,
    # with redundancy, a replica). Slower than a drop or a re-assembly until the next
    # boundary re-plans (a pipeline waits for its busiest node), so only here, where the job
    # would otherwise restore or stop.
    roomy = replace(sources, carry=layout.num_stages if room is not None else max(
        2, (2 if replicas else 1) * layout.num_stages // max(1, min_stages)))
    if roomy.carry > sources.carry:
        in_place = _in_place(layout, roomy, standby, widths, _broken(layout, roomy))
        if in_place is not None:
            return in_place
    repaired = (_shadow_repair(layout, sources, standby, kept, widths,
                               roomy.takes(layout.num_stages)) if kept else None)
    if repaired is not None:
        return repaired
    survivors = sorted(layout.active_nodes - lost) + list(standby)
    return restart(layout, survivors, min_stages, broken, microbatches)


def _broken(layout: Layout, sources: _Sources) -> list[int]:
    """The pipelines hit by the losses that cannot be repaired in place (`_takeovers`)."""
    hit_pipes = sorted({d for d, _ in _lost_slots(layout, sources.lost)})
    return [d for d in hit_pipes
            if _takeovers(layout, d, sources, d, dict(layout.mapping)) is None]


def _in_place(layout: Layout, sources: _Sources, standby: tuple[str, ...], widths: _Widths,
              broken: list[int]) -> Decision | None:
    """Every pipeline hit repaired in place, else the broken ones dropped while another
    survives; None when none does."""
    if not broken:
        return _failover(layout, sources, standby)
    alive_pipes = [d for d in range(layout.num_pipelines) if d not in broken]
    if alive_pipes:
        return _drop(layout, sources, standby, broken, alive_pipes, widths)
    return None


@dataclass(frozen=True)
class _Widths:
    """Which numbers of pipelines the iteration's micro-batches split over evenly."""

    microbatches: int | None

    def fits(self, width: int) -> bool:
        return self.microbatches is None or splits_evenly(self.microbatches, width)

    def at_most(self, width: int) -> int:
        """The largest fitting width up to `width` (0 for 0; 1 always fits)."""
        return next((w for w in range(width, 0, -1) if self.fits(w)), 0)


# -- losses -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Sources:
    """Where a lost stage's state can come from at the boundary: the replica its
    predecessor holds, when that node survives (exact every iteration, and the only source
    after a crash), else a node `leaving` on a notice and still there that holds the stage
    or its replica (it hands it over before it goes)."""

    lost: frozenset[str]
    leaving: frozenset[str]
    replicas: bool  # redundancy is on: nodes hold their successor's replica
    carry: int = 2  # the most stages a node may run (copies go only to nodes with room)
    room: Room | None = None  # and whether its memory holds them (`Room`)
    # nodes that lack the replica the layout gives them (a plan failed before it arrived)
    unreplicated: frozenset[str] = frozenset()

    def takes(self, depth: int) -> _Takes:
        """Whether a node may run a set of stages of this `depth` (a copy's or a restore's
        target, with the stages it runs)."""
        def takes(stages: tuple[int, ...]) -> bool:
            return len(stages) <= self.carry and (self.room is None or self.room(depth, stages))
        return takes

    def held(self, layout: Layout, d: int, s: int) -> str | None:
        """The node holding stage s's replica, lost or not (None where the layout gives it
        none, or its holder never received it)."""
        holder = layout.replica_holder(d, s)
        if (self.replicas and layout.has_replica(d, s)
                and holder not in self.unreplicated):
            return holder
        return None

    def replica(self, layout: Layout, d: int, s: int) -> str | None:
        """The live node holding stage s's replica (room to take it over included)."""
        holder = self.held(layout, d, s)
        return holder if holder not in self.lost else None

    def leaving_owner(self, layout: Layout, d: int, s: int) -> str | None:
        owner = layout.owner(d, s)
        return owner if owner in self.leaving else None

    def departing_source(self, layout: Layout, d: int, s: int) -> str | None:
        """A node leaving on a notice that can hand stage s over before it goes: its owner,
        else the holder of its replica (exact at the boundary, as for a promotion): a crash
        beside a notice, the replica's holder the one told to go."""
        holder = self.held(layout, d, s)
        return self.leaving_owner(layout, d, s) or (holder if holder in self.leaving else None)

    def source(self, layout: Layout, d: int, s: int) -> str | None:
        """Where a copy of stage s comes from: the replica first (the leaving node may vanish
        at any instant of the transfer, the replica's holder stays), else the leaving owner."""
        return self.replica(layout, d, s) or self.leaving_owner(layout, d, s)


_Takes = Callable[[tuple[int, ...]], bool]  # whether a node may run these stages


def _lost_slots(layout: Layout, lost: frozenset[str]) -> list[Slot]:
    return sorted(slot for node in lost for slot in layout.stages_of(node))


def _takeovers(layout: Layout, d: int, sources: _Sources, new_d: int,
               mapping: dict[Slot, str]) -> list[Move] | None:
    """Repair pipeline d (as `new_d`) in place, in `mapping`: each lost stage is promoted by
    its live replica holder (nothing moves), else copied from a node leaving on a notice
    that holds it (`_Sources.departing_source`) to the nearest node of the pipeline that
    runs one stage, looking forward first (it receives the stage's activations); that node
    carries two, as a promoted holder does (or to one that runs more, where its memory
    holds them: `_Sources.takes`). None when some lost stage has neither (a crash of
    adjacent stages, or redundancy off) or no node has room for it."""
    p = layout.num_stages
    lost = sources.lost
    slots = [s for d_, s in _lost_slots(layout, lost) if d_ == d]
    moves: list[Move] = []
    for s in slots:
        holder = sources.replica(layout, d, s)
        if holder is not None:
            mapping[(new_d, s)] = holder
            moves.append(Move(MoveKind.PROMOTE, new_d, s, holder, holder))
    for s in slots:
        if (new_d, s) in mapping and mapping[(new_d, s)] not in lost:
            continue
        src = sources.departing_source(layout, d, s)
        target = _nearest_with_room(mapping, new_d, s, p, lost, sources.takes(p))
        if src is None or target is None:
            return None
        mapping[(new_d, s)] = target
        moves.append(Move(MoveKind.COPY, new_d, s, src, target))
    return moves


def _nearest_with_room(mapping: dict[Slot, str], d: int, s: int, p: int,
                       lost: frozenset[str], takes: _Takes) -> str | None:
    """The live node of pipeline d nearest to stage s, looking forward first (it receives
    s's activations), that runs a single stage, where there is one (its replica's room holds
    a second, as after a takeover); else the nearest with room for another. Either only
    where it `takes` the stages it would run."""
    runs = [mapping[(d, t)] for t in range(p)]
    live = [n for n in (runs[(s + k) % p] for j in range(1, p) for k in (j, -j))
            if n not in lost]
    fits = [n for n in live if takes(_stages_with(mapping, d, p, n, s))]
    return next((n for n in fits if runs.count(n) < 2), next(iter(fits), None))


def _stages_with(mapping: dict[Slot, str], d: int, p: int, node: str,
                 s: int) -> tuple[int, ...]:
    """The stages `node` runs in pipeline d of `mapping`, with stage s added."""
    return tuple(sorted([t for t in range(p) if mapping.get((d, t)) == node] + [s]))


def _failover(layout: Layout, sources: _Sources, standby: tuple[str, ...]) -> Decision:
    mapping = layout.mapping
    moves: list[Move] = []
    for d in sorted({d for d, _ in _lost_slots(layout, sources.lost)}):
        moves += _takeovers(layout, d, sources, d, mapping) or []
    new = _replace(layout, mapping, standby)
    copied = sum(1 for m in moves if m.kind == MoveKind.COPY)
    why = f"{len(moves) - copied} stage(s) taken over by their replica holders"
    if copied:
        why += f", {copied} copied to a neighbour from nodes leaving on a notice"
    return Decision(Action.FAILOVER, new, tuple(moves), why)


def _handover(layout: Layout, hit: frozenset[str], sources: _Sources,
              standby: tuple[str, ...]) -> Decision | None:
    """A planned hand-over, when every node lost is one leaving on a notice and a standby node
    waits for each of its stages: the standby node gets the stage straight away (copied from
    the replica its predecessor holds, which is exact at the boundary, so the leaving node
    may vanish at any instant of it; from the leaving node itself when its predecessor
    leaves too, or without redundancy) and the replica of the next stage from that stage's
    owner. Nobody carries two stages at any point, which a takeover followed by a rebalance
    would. None when that is not possible (a crash among the losses, too few standby nodes):
    then the takeover as after a crash."""
    if not hit <= sources.leaving:
        return None
    slots = _lost_slots(layout, hit)
    if len(slots) > len(standby):
        return None
    mapping = layout.mapping
    spare = list(standby)
    moves: list[Move] = []
    p = layout.num_stages
    for d, s in slots:
        fresh = spare.pop(0)
        mapping[(d, s)] = fresh
        moves.append(Move(MoveKind.COPY, d, s, sources.source(layout, d, s) or "", fresh))
        if sources.replicas:
            moves.append(Move(MoveKind.REPLICA, d, (s + 1) % p, layout.owner(d, (s + 1) % p),
                              fresh))
    new = _replace(layout, mapping, tuple(spare))
    handed = sum(1 for m in moves if m.kind == MoveKind.COPY and m.src in hit)
    how = ("from their replicas" if not handed else "from the leaving nodes themselves"
           if handed == len(slots) else f"{handed} from the leaving nodes themselves, the "
           "others from their replicas")
    return Decision(Action.HANDOVER, new, tuple(moves), f"{len(slots)} stage(s) of nodes with a "
                    f"notice handed to standby nodes, {how}")


def _leave_by_repartition(layout: Layout, hit: frozenset[str], sources: _Sources,
                          standby: tuple[str, ...], min_stages: int,
                          widths: _Widths) -> Decision | None:
    """Nodes leaving on a notice, with no standby node to hand their stages to: re-partition
    onto the nodes that stay at once. Each leaving stage's layers come from the replica its
    predecessor holds (exact at the boundary, so the leaving nodes may vanish at any
    instant), else (adjacent nodes leaving together, or redundancy off) the leaving node
    hands the stage whole to the node a takeover would copy it to, and its layers go on
    from there (`plan.layers`' `handed`): the Decision's COPY moves, stages of the old
    partition, sent before the layers move.

    The alternative, a takeover and the re-partition following at the next boundary
    (`_grow`), ends in the same layout with two pauses instead of one, and in the iteration
    between them a carrier holds no replica: a second loss beside it stopped the job. None
    unless that is exactly where the takeover would lead: every lost node leaving, each lost
    stage promoted or copied from a leaving node, and a re-partition down next."""
    if standby or not hit <= sources.leaving:
        return None
    failover = _failover(layout, sources, standby)
    handed = tuple(m for m in failover.moves if m.kind == MoveKind.COPY)
    if any(m.src not in hit for m in handed):
        return None
    after = _grow(failover.layout, min_stages, True, widths)
    if (after.action != Action.REPARTITION
            or after.layout.num_stages >= layout.num_stages
            # (a receiver the re-partition puts on standby would hold layers no one takes)
            or any(m.dst not in after.layout.active_nodes for m in handed)):
        return None
    names = ", ".join(sorted(hit))
    whence = ("the leaving stages' layers from the replicas their predecessors hold"
              if not handed else f"{len(handed)} stage(s) handed over whole by the nodes "
              "leaving, the others' layers from the replicas their predecessors hold"
              if len(handed) < len(failover.moves) else
              "the leaving stages handed over whole by the nodes leaving")
    return replace(after, moves=after.moves + handed, reason=(
        f"{names} leave{'s' if len(hit) == 1 else ''} on a notice and no standby node can "
        f"take {'its stage' if len(hit) == 1 else 'their stages'}: P={layout.num_stages} -> "
        f"{after.layout.num_stages} at once, one stage per node, {whence}; layers move peer "
        "to peer"))


def _shadow_repair(layout: Layout, sources: _Sources, standby: tuple[str, ...],
                   kept: list[int], widths: _Widths, takes: _Takes) -> Decision | None:
    """Repair the broken pipelines `kept` (each keeps a live node): promote what has a
    replica, restore the rest from the shadows onto a standby node or the nearest live node of
    the same pipeline with room (`takes`: whether a node may run a set of stages). The other
    pipelines (wholly lost, or more than the batch splits over) are dropped, as in `_drop`:
    every pipeline holds the same state, so one wholly lost does not send the job back to
    its checkpoint while another can be repaired. None when some stage has no node with
    room: restoring it anyway could put more stages on a node than its memory holds."""
    lost = sources.lost
    hits = {d: sum(1 for d_, _ in _lost_slots(layout, lost) if d_ == d) for d in kept}
    kept = sorted(sorted(kept, key=lambda d: (hits[d], d))[:widths.at_most(len(kept))])
    mapping: dict[Slot, str] = {}
    spare = list(standby)
    moves: list[Move] = []
    p = layout.num_stages
    for new_d, d in enumerate(kept):
        for s in range(p):
            mapping[(new_d, s)] = layout.owner(d, s)
        for d_, s in _lost_slots(layout, lost):
            if d_ != d:
                continue
            holder = sources.replica(layout, d, s)
            if holder is not None:
                mapping[(new_d, s)] = holder
                moves.append(Move(MoveKind.PROMOTE, new_d, s, holder, holder))
                continue
            if spare:
                target = spare.pop(0)
            else:
                target = _nearest_with_room(mapping, new_d, s, p, lost, takes)
                if target is None:
                    return None
            mapping[(new_d, s)] = target
            moves.append(Move(MoveKind.RESTORE, new_d, s, SHADOW, target))
    dropped = [d for d in range(layout.num_pipelines) if d not in kept]
    # (in slot order, as `_drop` frees them)
    freed = [n for n in dict.fromkeys(layout.owner(d, s) for d in dropped for s in range(p))
             if n not in lost]
    new = _replace(layout, mapping, tuple(spare) + tuple(freed), len(kept))
    restored = [m.stage for m in moves if m.kind == MoveKind.RESTORE]
    why = f"; pipeline(s) {dropped} dropped" if dropped else ""
    return Decision(Action.RESTORE_FROM_SHADOW, new, tuple(moves),
                    f"stage(s) {restored} have no live replica; restored from their shadows, "
                    f"the survivors keep their state{why}", tuple(dropped))


def _broke(replicas: bool) -> str:
    """What broke a pipeline, in a decision's reason."""
    return ("lost adjacent stages" if replicas
            else "lost a stage, with no replica of it (redundancy is off)")


def _drop(layout: Layout, sources: _Sources, standby: tuple[str, ...], broken: list[int],
          alive_pipes: list[int], widths: _Widths) -> Decision:
    """Drop the broken pipelines, and as many whole ones more as the batch's split needs:
    those with the most lost stages go first (each would need a takeover), then the last."""
    lost, replicas = sources.lost, sources.replicas
    keep = widths.at_most(len(alive_pipes))
    hits = {d: sum(1 for d_, _ in _lost_slots(layout, lost) if d_ == d) for d in alive_pipes}
    kept = sorted(sorted(alive_pipes, key=lambda d: (hits[d], d))[:keep])
    broken = sorted(set(broken) | (set(alive_pipes) - set(kept)))
    mapping: dict[Slot, str] = {}
    moves: list[Move] = []
    for new_d, d in enumerate(kept):
        for s in range(layout.num_stages):
            mapping[(new_d, s)] = layout.owner(d, s)
        moves += _takeovers(layout, d, sources, new_d, mapping) or []
    # (in slot order, not name order: a decision that compares no names is one the simulator
    # can replay for other nodes in the same places, `sim.planmemo`)
    freed = [n for n in dict.fromkeys(layout.owner(d, s) for d in broken
                                      for s in range(layout.num_stages)) if n not in lost]
    new = _replace(layout, mapping, standby + tuple(freed), len(kept))
    extra = sorted(set(alive_pipes) - set(kept))
    why = (f"; pipeline(s) {extra} to standby, since the {widths.microbatches} micro-batches "
           f"split over {keep} pipelines, not {len(alive_pipes)}" if extra else "")
    lost_adjacent = [d for d in broken if d not in extra]
    return Decision(Action.DROP_PIPELINE, new, tuple(moves),
                    f"pipeline(s) {lost_adjacent} {_broke(replicas)}; dropped, global batch "
                    f"kept{why}", tuple(broken))


def _assemble(layout: Layout, sources: _Sources, standby: tuple[str, ...], widths: _Widths,
              at_least: int, takes: _Takes) -> Decision | None:
    """Every pipeline is broken, yet each stage's state lives on some survivor (data-parallel
    owners of a stage hold identical state, and a replica is exact every iteration): build
    whole pipelines of the survivors of all of them, as many as they make up and the batch
    splits over (at least `at_least`, what a shadow repair would keep, else None). None too
    when some stage's state is on no survivor."""
    p, lost = layout.num_stages, sources.lost
    owners = {s: [layout.owner(d, s) for d in range(layout.num_pipelines)
                  if layout.owner(d, s) not in lost] for s in range(p)}
    holders = {s: [h for d in range(layout.num_pipelines)
                   if (h := sources.replica(layout, d, s)) is not None] for s in range(p)}
    if not all(owners[s] or holders[s] for s in range(p)):
        return None
    # (in slot order, as `_drop` frees them: no decision here compares names)
    live = [n for n in dict.fromkeys(layout.owner(d, s) for d in range(layout.num_pipelines)
                                     for s in range(p)) if n not in lost]
    most = min(layout.num_pipelines, max(1, (len(live) + len(standby)) // p))
    for width in range(widths.at_most(most), max(1, at_least) - 1, -1):
        if widths.fits(width):
            built = _assembled(layout, width, owners, holders, list(standby) + live,
                               _broke(sources.replicas), takes)
            if built is not None:
                return built
    return None


def _assembled(layout: Layout, width: int, owners: dict[int, list[str]],
               holders: dict[int, list[str]], nodes: list[str],
               broke: str, takes: _Takes) -> Decision | None:
    """`width` pipelines from the live `owners` and replica `holders` of each stage and the
    `nodes` (standby, then survivors): each slot takes a live owner of its stage first (nothing
    moves), else a live replica, promoted (nothing moves either), else a copy from pipeline
    0's owner, which has every stage by then (a live owner or a replica is there for each, and
    pipeline 0 chooses first), onto a spare node or the nearest node of the pipeline that runs
    one stage. None when a slot finds no node. A node given a stage it did not own runs at
    most two (a carrier, as after a failover: its replica's room holds the second), and only
    where it `takes` them."""
    p = layout.num_stages
    mapping: dict[Slot, str] = {}
    pipe: dict[str, int] = {}  # node -> its new pipeline
    load: dict[str, int] = {}  # node -> how many stages it runs
    promoted: set[str] = set()
    moves: list[Move] = []

    def place(j: int, s: int, node: str) -> None:
        mapping[(j, s)] = node
        pipe[node] = j
        load[node] = load.get(node, 0) + 1

    for j in range(width):
        for s in range(p):
            node = next((n for n in owners[s] if pipe.get(n, j) == j), None)
            if node is not None:
                place(j, s, node)
        for s in range(p):
            node = next((n for n in holders[s] if (j, s) not in mapping and n not in promoted
                         and pipe.get(n, j) == j and load.get(n, 0) < 2), None)
            if node is not None:
                place(j, s, node)
                promoted.add(node)
                moves.append(Move(MoveKind.PROMOTE, j, s, node, node))
    spare = [n for n in nodes if n not in pipe]
    for j in range(1, width):
        for s in range(p):
            if (j, s) in mapping:
                continue
            near = [mapping.get((j, (s + k) % p)) for i in range(1, p) for k in (i, -i)]
            target = spare.pop(0) if spare else next(
                (n for n in near if n is not None and load[n] < 2
                 and takes(_stages_with(mapping, j, p, n, s))), None)
            if target is None:
                return None
            place(j, s, target)
            moves.append(Move(MoveKind.COPY, j, s, mapping[(0, s)], target))
    new = _replace(layout, mapping, tuple(spare), width)
    promotions = sum(1 for m in moves if m.kind == MoveKind.PROMOTE)
    broken = tuple(range(layout.num_pipelines))
    return Decision(Action.DROP_PIPELINE, new, tuple(moves),
                    f"every pipeline {broke}, but the survivors hold every "
                    f"stage: {width} pipeline(s) assembled from pipelines {list(broken)} "
                    f"({promotions} replica(s) promoted, {len(moves) - promotions} stage(s) "
                    "copied), global batch kept", broken)


def restart(layout: Layout, nodes: list[str], min_stages: int,
            broken: list[int], microbatches: int | None = None) -> Decision:
    """Every pipeline is broken: rebuild from the shadows (or the newest checkpoint) at the
    deepest depth that fits on `nodes`, with as many pipelines as they hold and the
    `microbatches` split over."""
    depth = min(layout.target_stages, len(nodes))
    if depth < max(1, min_stages):
        empty = _empty(layout, nodes)
        return Decision(Action.STOP, empty, (), f"{len(nodes)} node(s) left, the model needs "
                        f"at least {max(1, min_stages)}", tuple(broken))
    new = _fresh(layout, depth, nodes, _Widths(microbatches))
    moves = tuple(Move(MoveKind.RESTORE, d, s, SHADOW, n) for (d, s), n in sorted(new.owners))
    action = Action.RESTORE_FROM_CHECKPOINT if depth == layout.num_stages else Action.REPARTITION
    return Decision(action, new, moves, f"no pipeline can be repaired from memory; restored "
                    f"at P={depth} x D={new.num_pipelines} from the shadows", tuple(broken))


# -- growth -------------------------------------------------------------------------------

def _grow(layout: Layout, min_stages: int, repartition: bool, widths: _Widths) -> Decision:
    """The boundary decision: nothing lost, maybe nodes waiting. Called again after each
    change (`plan.recovery.settle`), it reaches KEEP by construction, in at most four steps:
    a restart leaves pipelines and no carrier; a REBALANCE gives every carrier's stages but
    one to standby nodes while they last, so it leaves either no carrier or no standby node,
    and is never followed by another; a REPARTITION leaves no carrier, so neither a
    rebalance nor a re-partition down can follow it, and one up needs more nodes than the one
    down left (depth x D > nodes); an ADD_PIPELINE forms every pipeline the spares and the
    batch allow, so none follows it."""
    if layout.num_pipelines == 0:
        if not layout.standby:
            return Decision(Action.STOP, layout, (), "no nodes")
        return restart(layout, list(layout.standby), min_stages, [], widths.microbatches)
    if layout.has_carriers and layout.standby:
        return _rebalance(layout)
    if layout.has_carriers and repartition:
        depth = len(layout.active_nodes) // layout.num_pipelines
        # below two stages there is no replica ring: one node carrying both stages is as good
        if max(2, min_stages) <= depth < layout.num_stages:
            return _repartition(layout, depth, f"{len(layout.active_nodes)} active node(s) "
                                f"and no standby: P={layout.num_stages} -> {depth}, one stage "
                                "per node, redundancy restored")
    total = len(layout.all_nodes)
    if (layout.num_stages < layout.target_stages
            and total >= layout.target_stages * layout.num_pipelines):
        return _repartition(layout, layout.target_stages, f"back to the configured depth "
                            f"P={layout.target_stages}")
    most = layout.num_pipelines + len(layout.standby) // layout.num_stages
    if layout.max_pipelines is not None:
        most = min(most, layout.max_pipelines)
    width = widths.at_most(most)
    if width > layout.num_pipelines and not layout.has_carriers:
        return _add_pipelines(layout, width)
    return Decision(Action.KEEP, layout, (), "nothing to change")


def _rebalance(layout: Layout) -> Decision:
    mapping = layout.mapping
    standby = list(layout.standby)
    moves: list[Move] = []
    # carriers by their first stage (not by name, as `_drop` frees nodes)
    for node, slots in sorted(layout.carriers().items(), key=lambda item: item[1][0]):
        for d, s in _extra_stages(layout, node, slots):
            if not standby:
                break
            fresh = standby.pop(0)
            mapping[(d, s)] = fresh
            moves.append(Move(MoveKind.COPY, d, s, node, fresh))
            nxt = (s + 1) % layout.num_stages
            moves.append(Move(MoveKind.REPLICA, d, nxt, mapping[(d, nxt)], fresh))
    new = _replace(layout, mapping, tuple(standby))
    return Decision(Action.REBALANCE, new, tuple(moves),
                    f"{len(moves) // 2} extra stage(s) handed to standby nodes")


def _extra_stages(layout: Layout, node: str, slots: list[Slot]) -> list[Slot]:
    """The stages a carrier hands to standby nodes, in the order it hands them, so that it
    keeps exactly one: first those it took over (whose predecessor it also owns), then the
    first stages of its other runs. A stage restored from a shadow onto the nearest live
    node (`_shadow_repair`) need not be adjacent to that node's own, and a carrier of two
    stages apart has nothing "taken over": handing it only the taken-over ones left it a
    carrier, and the next boundary made an empty REBALANCE again, for ever."""
    own = set(slots)
    extra = [(d, s) for d, s in slots if (d, (s - 1) % layout.num_stages) in own]
    if len(extra) == len(slots):  # the carrier owns the whole ring: keep the first stage
        extra = extra[1:]
    runs = [slot for slot in slots if slot not in extra]  # the first stage of each run
    return extra + runs[1:]


def _repartition(layout: Layout, depth: int, why: str) -> Decision:
    """The same pipelines at another depth. Nodes keep roughly their place in the pipeline
    (a node that ran the first stages runs the first stages again), so that most layers stay
    where they are; only the layers whose holder changes travel (see `plan.layers`)."""
    width = layout.num_pipelines
    mapping: dict[Slot, str] = {}
    spare: list[str] = []
    for d in range(width):
        firsts = sorted((min(s for _, s in layout.stages_of(n)), n)
                        for n in set(layout.grid[d]))
        keep, spare = firsts[:depth], spare + [n for _, n in firsts[depth:]]
        for slot, (_, node) in zip(spread([s for s, _ in keep], layout.num_stages, depth), keep):
            mapping[(d, slot)] = node
    pool = spare + list(layout.standby)
    for d in range(width):
        for s in range(depth):
            if (d, s) not in mapping:
                mapping[(d, s)] = pool.pop(0)
    new = Layout._trusted(depth, width, mapping, tuple(pool), layout.target_stages,
                          layout.max_pipelines)
    moves = tuple(Move(MoveKind.LAYERS, d, s, PEERS, n) for (d, s), n in sorted(new.owners))
    return Decision(Action.REPARTITION, new, moves, f"{why}; layers move peer to peer")


def spread(old_stages: list[int], old_depth: int, new_depth: int) -> list[int]:
    """New stage indices for nodes that ran `old_stages` (ascending, at most `new_depth` of
    them): each goes to its proportional place, kept in order and leaving room for the rest."""
    out: list[int] = []
    k = len(old_stages)
    for i, s in enumerate(old_stages):
        want = s * new_depth // old_depth
        out.append(min(max(want, out[-1] + 1 if out else 0), new_depth - (k - i)))
    return out


def _add_pipelines(layout: Layout, width: int) -> Decision:
    """Standby nodes form pipelines up to `width` in one decision (one pause, not one per
    pipeline). Every data-parallel owner of a stage holds the same state, so the copies
    come from the running pipelines in turn, not all from pipeline 0's nodes."""
    mapping = layout.mapping
    p, running = layout.num_stages, layout.num_pipelines
    standby = list(layout.standby)
    moves: list[Move] = []
    added = range(running, width)
    for d_new in added:
        src = d_new % running
        for s in range(p):
            fresh = standby.pop(0)
            mapping[(d_new, s)] = fresh
            moves.append(Move(MoveKind.COPY, d_new, s, layout.owner(src, s), fresh))
            moves.append(Move(MoveKind.REPLICA, d_new, (s + 1) % p, layout.owner(src, s + 1),
                              fresh))
    new = _replace(layout, mapping, tuple(standby), width)
    named = f"pipeline {added[0]}" if len(added) == 1 else f"pipelines {added[0]}-{added[-1]}"
    return Decision(Action.ADD_PIPELINE, new, tuple(moves), f"standby nodes form {named}")


# -- helpers ------------------------------------------------------------------------------

def _replace(layout: Layout, mapping: dict[Slot, str], standby: tuple[str, ...],
             num_pipelines: int | None = None) -> Layout:
    """The same depth with new owners: built unchecked, since every caller derives it from a
    valid layout by moving whole stages (tests validate the results via Layout(...))."""
    width = layout.num_pipelines if num_pipelines is None else num_pipelines
    return Layout._trusted(layout.num_stages, width, mapping, standby, layout.target_stages,
                           layout.max_pipelines)


def _fresh(layout: Layout, depth: int, nodes: list[str], widths: _Widths) -> Layout:
    width = len(nodes) // depth
    if layout.max_pipelines is not None:
        width = min(width, layout.max_pipelines)
    width = widths.at_most(width)
    return Layout.build(depth, width, nodes, target_stages=layout.target_stages,
                        max_pipelines=layout.max_pipelines)


def _empty(layout: Layout, waiting: list[str]) -> Layout:
    """No pipeline runs; survivors wait on standby so that later joins can restart the job."""
    return Layout.from_mapping(layout.num_stages, 0, {}, waiting,
                               target_stages=layout.target_stages,
                               max_pipelines=layout.max_pipelines)
