"""The simulator's recovery decisions as a machine over situations, with nodes as numbers.

`plan.recovery.settle` is a pure function of (layout, nodes lost, nodes joining, rules), and
for most situations it looks at the nodes only as slots: which slots one node owns, which
slots are lost, how many wait on standby and in which order. Two situations that differ only
in the nodes' names then get the same decisions. A 10,000-seed table meets the same few
thousand situations again and again (a node of pipeline 1, stage 4 lost with two nodes on
standby...), each under fresh names.

So the spotpipe policy keeps its layout as a `Situation` (the layout with its nodes numbered
by where they stand: the owners in slot order, then the standby nodes) beside the list of
the names those numbers stand for. A `Transition` (situation, numbers lost, how many nodes
join) -> (the decisions, the next situation, where each of its numbers comes from) is
computed once per process from the real layout, and every later trace that meets it replays
it as list indexing: no layout is built, no name is renamed. This is what makes the table's
10,000 seeds per rate cheap; the planner itself runs only on a situation seen for the first
time.

That is exact only for transitions that compare no two names. The planner sorts names in a
few places: a restart of a running job (survivors in name order; a first start places the
waiting nodes in their order) and a re-partition refused into a KEEP (the waiting nodes in
name order). (A dropped pipeline's freed nodes and the carriers a rebalance relieves go in
slot order, for this reason.) A transition that went through any of those is never
stored (`_nameless`), and is computed afresh, from the real layout, each time it is met.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache

from spotpipe.plan import Action, Layout
from spotpipe.plan.recovery import Decision, History, Rules, settle
from spotpipe.sim.memo import PerObject

Steps = list[tuple[Layout, Decision]]
# a situation's identity: (P, D, the number owning each slot in slot order, how many wait on
# standby, target depth, max pipelines)
_Key = tuple[int, int, tuple[int, ...], int, int, "int | None"]
MEMO_LIMIT = 200_000  # situations per rules, then the table starts afresh
# actions whose layouts depend on no comparison of names (see the module doc)
_SAFE = frozenset({Action.FAILOVER, Action.HANDOVER, Action.REBALANCE, Action.ADD_PIPELINE,
                   Action.DROP_PIPELINE, Action.REPARTITION, Action.RESTORE_FROM_SHADOW,
                   Action.KEEP})
_RESTART = (Action.RESTORE_FROM_CHECKPOINT, Action.REPARTITION)
_RULES: dict[Rules, Rules] = {}


def shared_rules(rules: Rules) -> Rules:
    """One object per distinct rules, so that lookups compare identities, not fields."""
    return _RULES.setdefault(rules, rules)


@lru_cache(maxsize=None)
def _slots(depth: int, width: int) -> tuple[tuple[int, int], ...]:
    return tuple((d, s) for d in range(width) for s in range(depth))


@dataclass(eq=False)
class Situation:
    """A layout with its nodes numbered: 0 .. active-1 own stages (first seen in slot order),
    active .. size-1 wait on standby, in their order. Interned per rules (`Machine`), so
    situations compare by identity and carry what the policy asks of them."""

    key: _Key
    shape: tuple  # `Layout.shape_key()`: what the iteration time depends on
    active: int  # nodes running stages
    size: int  # numbered nodes: active and standby
    # (lost numbers, joiners) -> the transition, for those that compare no names
    transitions: dict[tuple[frozenset[int], int], "Transition"] = field(default_factory=dict)
    # redundancy mode -> (the config, (iteration s, plain iteration s)): the policy's cache
    speeds: dict[str, tuple] = field(default_factory=dict)
    # (P, D, a node carries two stages) while pipelines run, else None
    summary: tuple[int, int, bool] | None = field(init=False)

    def __post_init__(self) -> None:
        p, width = self.key[0], self.key[1]
        self.summary = (p, width, self.active < p * width) if width else None

    @property
    def num_stages(self) -> int:
        return self.key[0]

    @property
    def num_pipelines(self) -> int:
        return self.key[1]

    @property
    def has_carriers(self) -> bool:
        return self.active < self.key[0] * self.key[1]

    def layout(self, names: list[str]) -> Layout:
        """The real layout, with number i standing for `names[i]`."""
        p, width, owners, _, target, cap = self.key
        mapping = dict(zip(_slots(p, width), map(names.__getitem__, owners)))
        return Layout._trusted(p, width, mapping, tuple(names[self.active:self.size]),
                               target, cap)


@dataclass(frozen=True)
class Step:
    """One decision of a transition, as the simulator's ledger needs it."""

    action: Action
    needs_restore: bool
    was_running: bool  # the layout before it had pipelines
    after: Situation
    # number i of `after` is number sources[i] of the situation before the transition, its
    # joiners numbered after it (for rebuilding the layouts; the replay needs only the last)
    sources: tuple[int, ...]


@dataclass(frozen=True)
class Transition:
    """What one instant's events do to a situation: `settle`'s decisions, with the nodes as
    numbers, so that any run standing in the same situation can replay them."""

    steps: tuple[Step, ...]
    after: Situation
    sources: tuple[int, ...]  # as `Step.sources`, for `after`
    stored: bool  # kept on the situation (it compares no names)
    acts: tuple[Step, ...] = field(init=False)  # the steps that change something (not KEEP)

    def __post_init__(self) -> None:
        object.__setattr__(self, "acts", tuple(s for s in self.steps
                                               if s.action != Action.KEEP))

    def names_after(self, names: list[str], ready: list[str]) -> list[str]:
        """The names of the next situation's numbers, from this one's and the joiners'."""
        if not ready:
            return list(map(names.__getitem__, self.sources))
        return list(map((names + ready).__getitem__, self.sources))


class Machine:
    """The situations met under one `Rules`, and the transitions between them."""

    def __init__(self, rules: Rules, memo: bool = True) -> None:
        self.rules = rules
        self.memo = memo
        self._situations: dict[_Key, Situation] = {}
        self._starts: dict[tuple[int, int], Situation] = {}

    def situation(self, layout: Layout) -> tuple[Situation, list[str]]:
        """The situation of a real layout, and the names its numbers stand for."""
        p, width = layout.num_stages, layout.num_pipelines
        owners = list(map(layout._map.__getitem__, _slots(p, width)))
        names = list(dict.fromkeys(owners))
        active = len(names)
        names += layout.standby
        number = {n: i for i, n in enumerate(names)}
        key = (p, width, tuple(map(number.__getitem__, owners)), len(layout.standby),
               layout.target_stages, layout.max_pipelines)
        known = self._situations.get(key)
        if known is None:
            if len(self._situations) >= MEMO_LIMIT:
                self._situations.clear()
                self._starts.clear()
            known = self._situations[key] = Situation(key, layout.shape_key(), active,
                                                      len(names))
        return known, names

    def start(self, num_stages: int, num_pipelines: int) -> Situation:
        """The empty layout before the first nodes boot."""
        known = self._starts.get((num_stages, num_pipelines))
        if known is None:
            known = self._starts[(num_stages, num_pipelines)] = self.situation(
                Layout.from_mapping(num_stages, 0, {}, (), max_pipelines=num_pipelines))[0]
        return known

    def transition(self, situation: Situation, names: list[str], lost: frozenset[int],
                   ready: list[str], leaving: bool = False) -> Transition:
        """What `settle` does to this situation when the nodes numbered `lost` go (on a
        notice, still there at the boundary, when `leaving`) and `ready` join; from the
        table when it was met before under any names."""
        known = situation.transitions.get((lost, len(ready), leaving))
        if known is not None:
            return known
        before = situation.layout(names)
        lost_names = frozenset(map(names.__getitem__, lost))
        outer = names + ready
        position = {n: i for i, n in enumerate(outer)}
        steps = []
        after, sources = situation, tuple(range(situation.size))
        decided = settle_steps(before, lost_names, ready, self.rules, leaving)
        for prior, d in decided:
            after, after_names = self.situation(d.layout)
            sources = tuple(map(position.__getitem__, after_names))
            steps.append(Step(d.action, d.needs_restore, prior.num_pipelines > 0, after,
                              sources))
        stored = (self.memo and len(position) == len(outer)  # (a joiner already numbered)
                  and _nameless(decided))
        made = Transition(tuple(steps), after, sources, stored)
        if stored:
            situation.transitions[(lost, len(ready), leaving)] = made
        return made


_MACHINES: PerObject[Machine] = PerObject()


def machine_for(rules: Rules, memo: bool = True) -> Machine:
    """The process's machine for these rules (a sweep makes a policy per seed; they share it).

    Rules equal to shared ones get the shared rules' machine; the policies pass the shared
    object itself, whose machine is found by identity without hashing the rules' fields."""
    return _MACHINES.get(rules, memo, _shared_machine, rules, memo)


def _shared_machine(rules: Rules, memo: bool) -> Machine:
    shared = shared_rules(rules)
    return _MACHINES.get(shared, memo, Machine, shared, memo)


def settle_steps(layout: Layout, lost: Collection[str], ready: list[str],
                 rules: Rules, leaving: bool = False) -> Steps:
    """(layout before, decision) for each decision `settle` makes at this instant: the
    reference the machine's transitions are made from. `leaving`: the nodes of the layout
    that go had a notice and report at the boundary (those waiting on standby just go)."""
    history = History(layout, tuple((s, s + 1) for s in range(layout.num_stages)))
    steps: Steps = []
    current = layout
    going = frozenset(lost) & layout.active_nodes if leaving else frozenset()
    # (the simulator moves no state: the transfers are never looked at)
    for outcome in settle(history, rules, lost=frozenset(lost) - going, leaving=going,
                          joiners=ready, with_transfers=False):
        steps.append((current, outcome.decision))
        current = outcome.decision.layout
    return steps


def _nameless(steps: Steps) -> bool:
    """Whether no decision of the settle compared two names (see the module doc)."""
    for before, d in steps:
        if d.message or d.rejoin or d.salvage:
            return False
        # (a start from nothing places the waiting nodes in their order: no names compared)
        if (d.action not in _SAFE or d.needs_restore) and not (
                before.num_pipelines == 0 and d.action in _RESTART):
            return False
        if (d.action == Action.KEEP and d.reason.startswith("cannot re-partition")
                and len(d.layout.standby) > 1):
            return False
    return True
