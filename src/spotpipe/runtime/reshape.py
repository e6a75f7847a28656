"""Carrying out a Decision: promote replicas, move states, re-partition, relink shadows.

Nothing here decides. `plan.recovery` said which node takes which stage, which states travel
from where, and whether a re-partition happens; this module turns that into local changes of a
node's `NodeState`, over the new generation's process groups, and records what the node did
not receive yet (`lacking`) and whether its state changed (`untouched`), which is what its next
report says if a peer is lost meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spotpipe.plan import MoveKind, held_replica, layer_plan
from spotpipe.plan.recovery import Decision
from spotpipe.plan.transfers import Transfer, after_restores
from spotpipe.protocol import Channel, Mark, Refused, keys
from spotpipe.runtime import migrate
from spotpipe.runtime import node as nodelib
from spotpipe.runtime.activity import Activity
from spotpipe.runtime.comm import Comm, PeerFailure
from spotpipe.runtime.optim import follow_parameters
from spotpipe.runtime.shadow_link import ShadowWriter
from spotpipe.runtime.state import NodeState
from spotpipe.store.sealed import SealedStore


@dataclass
class Progress:
    """What a node has of the Decision it is carrying out, for a report if it fails."""

    lacking: list[str] = field(default_factory=list)
    untouched: bool = True
    bytes_received: int = 0


@dataclass
class Carried:
    """What carrying out a Decision did on this node (for its event)."""

    promoted: list[int]
    received: list[str]
    groups_s: float
    exchange_s: float


class Reshaper:
    def __init__(self, state: NodeState, *, store: Any, sealed: SealedStore, namespace: str,
                 channel: Channel, shadow: ShadowWriter | None, digests: Any,
                 inject: Callable[[str, int], None],
                 refused: Callable[[Refused], None], activity: Activity | None = None) -> None:
        """`activity`: the main thread's, where each step of carrying out a Decision is named
        and each wait marked (`runtime.activity`: a step that stops is a hang)."""
        self.state = state
        self.activity = activity or Activity()
        self.store = store
        self.sealed = sealed  # the layer metadata's (not protocol messages)
        self.namespace = namespace
        self.channel = channel
        self.shadow = shadow
        self.digests = digests
        self.inject = inject
        self.refused = refused
        self.progress = Progress()

    def carry_out(self, decision: Decision, open_comm: Callable[[], Comm],
                  open_handover: Callable[[Decision], Comm] | None = None
                  ) -> tuple[Comm, Carried]:
        """Make this node's state what `decision` says, over the new generation's groups
        (opened with `open_comm` once the layout and generation are the decision's), and
        over the departing nodes' group (`open_handover`) for the stages they hand over."""
        st, me = self.state, self.state.node
        started = time.perf_counter()
        old = decision.previous_layout
        resume = decision.resume
        progress = self.progress = Progress()
        repartition = decision.action.value == "repartition"
        if not repartition:  # a joiner learns the job's current depth
            st.partition = [tuple(r) for r in decision.partition]  # type: ignore[misc]
        promoted = decision.promotions(me)
        for stage in promoted:
            progress.untouched = False
            self.activity.begin(f"taking over stage {stage}", decision.generation)
            self._promote(stage, resume)
        st.layout = decision.layout
        st.generation = decision.generation
        progress.lacking = decision.receives(me)
        self.activity.begin("forming the process groups", decision.generation)
        self.inject("regroup", resume)
        comm = open_comm()
        formed = time.perf_counter()
        # the replica of a stage restored from its shadow is sent once its restorer holds it
        late = after_restores(decision.transfers, old, {m.stage for m in decision.moves
                                                        if m.kind == MoveKind.RESTORE
                                                        and m.pipeline == 0})
        handed = decision.handed_over
        moves = [t for t in decision.transfers if t not in late and t not in handed]
        # shadows are fed by pipeline 0's owners: those restore from them; a lost stage of
        # another pipeline is the same state (data parallel), copied from pipeline 0's owner
        # once that one holds it
        restores = [m for m in decision.moves if m.kind == MoveKind.RESTORE]
        restored = sorted(m.stage for m in restores if m.dst == me and m.pipeline == 0)
        after = [Transfer("stage", m.stage, decision.layout.owner(0, m.stage), m.dst)
                 for m in restores if m.pipeline != 0] + late
        to_come = [f"{t.kind} {t.stage}" for t in after if t.dst == me]
        self.activity.begin("re-partitioning" if repartition else "moving states",
                            decision.generation)
        if repartition or progress.lacking or any(me in (t.src, t.dst)
                                                  for t in moves + after):
            # (only a plan that moves this node's state: a sender of copies made once a stage
            # is restored from its shadow included, though those go after the restore)
            self.inject("transfer", resume)
        held = self._held()
        handed = self._receive_handed(decision, open_handover)
        received = (self._repartition(decision, comm, handed) if repartition
                    else self._migrate(moves, comm, resume, handed))
        progress.untouched = progress.untouched and held == self._held()
        # what this node lacks from now on is only what waits for a shadow restore: a failure
        # after its receives (waiting on its sends of those copies) must not count it out
        progress.lacking = [f"stage {s}" for s in restored] + to_come
        if st.holding is not None and me in st.layout.active_nodes:
            # a kept replica may be fed by a new owner now (a hand-over to a standby node)
            st.holding.owner = st.layout.owner(st.pipeline, st.holding.replica.index)
        exchanged = time.perf_counter()
        if restored:
            progress.untouched = False
            self.activity.begin(f"restoring stage(s) {', '.join(map(str, restored))} from "
                                "their shadows", decision.generation)
        for s in restored:
            st.own(s, *st.build_stage(s))
        scale = decision.clip_scale
        self._relink(resume, set(restored), float("nan") if scale == "skip" else scale)
        received += [f"stage {s} from its shadow" for s in restored]
        progress.lacking = to_come
        if after:
            # (only a node that receives one changes: the others, uninvolved or sending, can
            # still take their places in the layout before, if the plan is rolled back)
            self.activity.begin("moving states", decision.generation)
            before, held = progress.bytes_received, self._held()
            received += self._migrate(after, comm, resume)
            progress.untouched = progress.untouched and held == self._held()
            progress.bytes_received += before
        progress.lacking = []
        return comm, Carried(promoted, received, formed - started, exchanged - formed)

    # ------------------------------------------------------------------ the parts

    def _held(self) -> tuple[dict[int, int], int]:
        """Which stage and replica objects this node holds: a plan that replaces or drops
        any of them changed its state (`Progress.untouched`)."""
        st = self.state
        return {s: id(x) for s, x in st.stages.items()}, id(st.holding)

    def _states(self) -> dict[tuple[str, int], Any]:
        """What this node can send, as `migrate.run` takes it: its stages, and its replica,
        brought up to the last committed iteration (a stage copied from its replica, by a
        node that stays or by one leaving on a notice, is exact as a promoted one is)."""
        st = self.state
        have: dict[tuple[str, int], Any] = {("stage", s): (x.module, x.optimizer)
                                             for s, x in st.stages.items()}
        if st.holding is not None:
            st.holding.applier.drain()
            have[("replica", st.holding.replica.index)] = (st.holding.replica.module,
                                                           st.holding.replica.optimizer)
        return have

    def _promote(self, stage: int, resume: int) -> None:
        """The replica becomes an owned stage: it is already exact, nothing is transferred."""
        st = self.state
        holding = st.holding
        if holding is None or holding.replica.index != stage:
            raise RuntimeError(f"{st.node} was asked to take over stage {stage} but holds no "
                               "replica of it")
        holding.applier.drain()
        if holding.applier.applied != resume - 1:
            raise RuntimeError(f"replica of stage {stage} is at iteration "
                               f"{holding.applier.applied}, expected {resume - 1}")
        holding.applier.close()
        holding.replica.optimizer.zero_grad(set_to_none=True)
        st.own(stage, holding.replica.module.to(st.device),
               follow_parameters(holding.replica.optimizer))
        st.holding = None

    def hand_over(self, decision: Decision,
                  open_handover: Callable[[Decision], Comm]) -> list[str]:
        """This node leaves on a notice, and the plan takes some of its stages or its replica
        from it (no node that stays holds them: its predecessor, which held a replica, leaves
        too, or redundancy is off; or the replica's stage crashed): send them over the
        departing nodes' group, then go. Their receivers are in the new generation's groups,
        which a node leaving is in no more. Returns what it sent."""
        st = self.state
        mine = [f"{t.kind} {t.stage} to {t.dst}" for t in decision.handed_over
                if t.src == st.node]
        self.activity.begin("handing over " + ", ".join(mine), decision.generation)
        self.inject("handover", decision.resume)
        self._departing_transfers(decision, open_handover, self._states())
        return mine

    def _receive_handed(self, decision: Decision,
                        open_handover: Callable[[Decision], Comm] | None
                        ) -> dict[tuple[str, int], Any]:
        """What departing nodes hand over to this node, received before the generation's own
        moves (nothing that stays waits on it); empty if they send it nothing."""
        if not any(t.dst == self.state.node for t in decision.handed_over):
            return {}
        assert open_handover is not None, "a hand-over to receive and no group for it"
        return self._departing_transfers(decision, open_handover, {})

    def _departing_transfers(self, decision: Decision,
                             open_handover: Callable[[Decision], Comm],
                             have: dict[tuple[str, int], Any]) -> dict[tuple[str, int], Any]:
        """This node's part of the departing nodes' transfers, over their group."""
        comm = open_handover(decision)
        try:
            return migrate.run(list(decision.handed_over), self.state.node, comm, have,
                               self.state.build_stage)
        finally:
            comm.close()

    def _migrate(self, moves: list[Transfer], comm: Comm, resume: int,
                 handed: dict[tuple[str, int], Any] | None = None) -> list[str]:
        """This node's part of the state moves, and what departing nodes `handed` it
        (`_receive_handed`); returns what it received."""
        st, me = self.state, self.state.node
        self.progress.bytes_received = 0
        replicas = st.cfg.redundancy != "none"
        if st.holding is not None and held_replica(st.layout, me) is None:
            # this node now carries several stages: no room (and no feed) for a replica
            self.progress.untouched = False
            st.drop_replica()
        mine = set(nodelib.owned_stages(st.layout, me))
        got = dict(handed or {})
        bytes_received = got.pop(("bytes", -1), 0)
        if not got and not any(me in (t.src, t.dst) for t in moves):
            for s in [s for s in st.stages if s not in mine]:  # kept by a plan that failed
                del st.stages[s]
            return []

        def arrived(kind: str, stage: int, state: Any) -> None:
            # a stage is this node's as it lands: should a peer be lost before the rest
            # arrives, the node reports lacking only the rest, and one that lacks only its
            # replica keeps its place (`plan.recovery`); the replica is held once all is in
            if kind == "stage":
                self.progress.untouched = False
                st.own(stage, *state)
                if f"stage {stage}" in self.progress.lacking:
                    self.progress.lacking.remove(f"stage {stage}")

        for (kind, s), state in got.items():  # handed over by a departing node: here already
            arrived(kind, s, state)
        got.update(migrate.run(moves, me, comm, self._states(),
                               lambda stage: st.build_stage(stage), arrived))
        self.progress.bytes_received = bytes_received + got.pop(("bytes", -1))
        for s in [s for s in st.stages if s not in mine]:  # handed over to another node
            del st.stages[s]
        want = held_replica(st.layout, me) if replicas else None
        if ("replica", want) in got:
            module, optimizer = got[("replica", want)]
            st.hold(want, module, optimizer, resume, self.digests)  # type: ignore[arg-type]
        elif st.holding is not None and want is None:
            st.drop_replica()
        return [f"{kind} {s}" for kind, s in sorted(got)]

    def _repartition(self, decision: Decision, comm: Comm,
                     handed: dict[tuple[str, int], Any]) -> list[str]:
        """Change the depth in place: build this node's new stage(s) and replica from layers,
        each layer's parameters and optimizer state taken from this node's memory when it holds
        them (the stages of the old partition a leaving node `handed` it included) and from a
        peer that does otherwise (`plan.layer_plan`); returns what it received."""
        st, me = self.state, self.state.node
        old = decision.previous_layout
        new_partition = [tuple(r) for r in decision.partition]
        old_partition = [tuple(r) for r in decision.previous_partition]
        redundancy = st.cfg.redundancy != "none"
        if me in decision.unreplicated:  # a plan failed before its replica arrived: a replica
            st.drop_replica()  # it still holds is the one of the layout before that plan
        expected = (held_replica(old, me) if redundancy and me not in decision.unreplicated
                    else None)
        actual = st.held_replica_index()
        if me in old.active_nodes and expected != actual:
            raise RuntimeError(f"{me} holds the replica of stage {actual}, the layout says "
                               f"{expected}: cannot re-partition from it")
        handed = dict(handed)
        handed_bytes = handed.pop(("bytes", -1), 0)
        held = [(x.module, x.optimizer) for x in st.stages.values()] + list(handed.values())
        if st.holding is not None:
            st.holding.applier.drain()  # the replica is exact through resume - 1
            held.append((st.holding.replica.module, st.holding.replica.optimizer))
        current = st.partition
        st.partition = new_partition  # type: ignore[assignment]
        try:
            owned = {s: st.build_stage(s) for s in nodelib.owned_stages(st.layout, me)}
            want = held_replica(st.layout, me) if redundancy else None
            replica = st.build_stage(want, st.replica_device) if want is not None else None
        finally:
            st.partition = current
        moves = layer_plan(old, st.layout, old_partition, new_partition, redundancy,
                           decision.unreplicated, decision.handed_over)
        self.progress.bytes_received = handed_bytes + migrate.exchange_layers(
            moves, me, comm, self.sealed.rendezvous(st.cfg.cluster.timeout_s),
            keys.layers_prefix(self.namespace, st.generation),
            st.model, have=migrate.state_index(held),
            want=migrate.state_index(list(owned.values()) + ([replica] if replica else [])),
            timeout_s=st.cfg.cluster.timeout_s)
        self._commit_exchange(comm)
        st.drop_replica()
        st.partition = new_partition  # type: ignore[assignment]
        st.stages = {}
        for s, (module, opt) in owned.items():
            st.own(s, module, opt)
        if replica is not None and want is not None:
            st.hold(want, replica[0], replica[1], decision.resume, self.digests)
        # (`_receive_handed` returned every stage handed to this node, or raised)
        return ([f"stage {t.stage} from {t.src}" for t in decision.handed_over if t.dst == me]
                + sorted({f"layer {m.layer} from {m.src}" for m in moves if m.dst == me}))

    def _commit_exchange(self, comm: Comm) -> None:
        """Switch to the new partition only once every node of it holds its new layers.

        A re-partition cut short by a loss must leave the nodes either all on the old
        partition (the coordinator then rolls the plan back) or all on the new one, never
        mixed. Each node's mark is written once (compare-and-set, so the first writer wins):
        by the node itself, "exchanged", when its exchange is complete, or, once the
        generation is aborted, "abandoned" by any node that finds it missing. A node then
        switches only if every mark says "exchanged", and since no mark changes once
        written, every node reads the same marks and decides alike. (A node woken by the
        abort once only looked whether every mark was there: a slower node that wrote its
        own just after switched alone.) A mark that does not open (forged) counts as not
        exchanged: a forger can at worst make the re-partition roll back, never mix
        partitions.
        """
        st = self.state
        g = st.generation
        nodes = sorted(st.layout.active_nodes)
        marks = [keys.exchanged(self.namespace, g, n) for n in nodes]
        self._mark(keys.exchanged(self.namespace, g, st.node), "exchanged")
        try:
            comm.wait_keys(marks, st.cfg.cluster.timeout_s, "every node's exchange")
        except PeerFailure:
            for key in marks:  # (a mark written by now, by its node or another, stays)
                self._mark(key, "abandoned")
            if not self._exchanged(marks, nodes, g):
                raise
            return
        if not self._exchanged(marks, nodes, g):
            raise PeerFailure("the re-partition was abandoned: a node's exchange did not "
                              "complete before the generation was aborted")

    def _mark(self, key: str, what: str) -> None:
        """Write this node's `what` as the mark at `key`, unless a mark is there already."""
        st = self.state
        self.store.compare_set(key, "", self.channel.seal(Mark(st.node, st.generation, what),
                                                          st.generation, at=key))

    def _exchanged(self, marks: list[str], nodes: list[str], generation: int) -> bool:
        """Whether every node's mark says, under its own seal, that its exchange is done."""
        for key, node in zip(marks, nodes):
            try:
                opened = self.channel.open(self.store.get(key), at=key, expect=Mark,
                                           writers=set(nodes))
            except Refused as why:
                self.refused(why)
                return False
            mark = opened.message
            assert isinstance(mark, Mark)
            if (opened.writer != node or mark.node != node or mark.generation != generation
                    or mark.what != "exchanged"):
                return False
        return True

    def _relink(self, resume: int, restore: set[int], scale: float | None = None) -> None:
        """Point the shadow links at the stages this node now writes (pipeline 0's owners);
        stages in `restore` are loaded from their shadow."""
        st = self.state
        if self.shadow is None:
            if restore:
                raise RuntimeError(f"{st.node} was asked to restore stages {sorted(restore)} "
                                   "from shadows, but shadows are off")
            return
        writes = {s: (x.module, x.optimizer) for s, x in st.stages.items()
                  if st.layout.owner(0, s) == st.node}
        missing = restore - set(writes)
        if missing:
            raise RuntimeError(f"{st.node} must restore stages {sorted(missing)} from shadows "
                               "but does not write them (only pipeline 0's owners link to shadows)")
        before = self.shadow.bytes_received
        with self.activity.waiting():  # on the shadows (a restore's state comes from them)
            self.shadow.relink(writes, resume, restore, scale)
        self.progress.bytes_received += self.shadow.bytes_received - before

    def relink_at_start(self, resume: int) -> None:
        self._relink(resume, set())

