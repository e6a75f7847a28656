"""The simulator's planner decisions, memoised by the shape of the situation, not node names.

`plan.recovery.settle` is a pure function of (layout, nodes lost, nodes joining, rules), and
for most situations it looks at the nodes only as slots: which slots one node owns, which
slots are lost, how many wait on standby and in which order. Two situations that differ only
in the nodes' names then get the same decisions, renamed. A 10,000-seed table meets the same
few thousand situations again and again (a node of pipeline 1, stage 4 lost with two nodes
on standby...), each under fresh names, so the decisions are kept under a key that
numbers the nodes by where they stand: the owners in slot order, then the standby nodes,
then the joiners in arrival order. On a hit the stored decisions are renamed back.

That is exact only for decisions that compare no two names. The planner sorts names in a few
places: a restart of a running job (survivors in name order; a first start places the
waiting nodes in their order), a dropped pipeline (its freed nodes in name
order), a rebalance of two or more carriers (carriers in name order) and a re-partition
refused into a KEEP (the waiting nodes in name order). A settle that went through any of
those is never stored (`_nameless`), and is computed afresh each time.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import lru_cache

from spotpipe.plan import Action, Layout
from spotpipe.plan.policy import PEERS, SHADOW, Move
from spotpipe.plan.recovery import Decision, History, Rules, settle

Steps = list[tuple[Layout, Decision]]
# a layout with nodes numbered: (P, D, the owner of each slot in slot order, standby, target,
# max pipelines)
_Shape = tuple[int, int, tuple[int, ...], tuple[int, ...], int, "int | None"]
# per (interned) rules: canonical key -> the decisions with nodes numbered; shared by every run
# of a process (a sweep makes a Planner per seed). Bounded: cleared when full.
_TABLES: dict[int, tuple[Rules, dict[tuple, tuple]]] = {}
_RULES: dict[Rules, Rules] = {}
MEMO_LIMIT = 200_000
_SPECIAL = (PEERS, SHADOW)
# actions whose layouts depend on no comparison of names (see the module doc)
_SAFE = frozenset({Action.FAILOVER, Action.HANDOVER, Action.REBALANCE, Action.ADD_PIPELINE,
                   Action.REPARTITION, Action.RESTORE_FROM_SHADOW, Action.KEEP})
_RESTART = (Action.RESTORE_FROM_CHECKPOINT, Action.REPARTITION)


def shared_rules(rules: Rules) -> Rules:
    """One object per distinct rules, so that lookups compare identities, not fields."""
    return _RULES.setdefault(rules, rules)


def _table(rules: Rules) -> dict[tuple, tuple]:
    entry = _TABLES.get(id(rules))
    if entry is None or entry[0] is not rules:
        rules = shared_rules(rules)
        entry = _TABLES.get(id(rules))
        if entry is None:
            entry = _TABLES[id(rules)] = (rules, {})
    return entry[1]


@lru_cache(maxsize=None)
def _slots(depth: int, width: int) -> tuple[tuple[int, int], ...]:
    return tuple((d, s) for d in range(width) for s in range(depth))


def settle_steps(layout: Layout, lost: Collection[str], ready: list[str], rules: Rules,
                 memo: bool = True) -> Steps:
    """(layout before, decision) for each decision `settle` makes at this instant."""
    if not memo:
        return _settle(layout, lost, ready, rules)
    # nodes numbered by where they stand: owners in slot order, standby, joiners
    owners = list(map(layout._map.__getitem__, _slots(layout.num_stages,
                                                      layout.num_pipelines)))
    names = list(dict.fromkeys(owners + list(layout.standby) + list(ready)))
    number = {n: i for i, n in enumerate(names)}
    if any(n not in number for n in lost):
        return _settle(layout, lost, ready, rules)
    key = (layout.num_stages, layout.num_pipelines, tuple(map(number.__getitem__, owners)),
           len(layout.standby), frozenset(map(number.__getitem__, lost)),
           tuple(map(number.__getitem__, ready)), layout.target_stages, layout.max_pipelines)
    table = _table(rules)
    stored = table.get(key)
    if stored is not None:
        return _renamed(stored, layout, names, lost)
    steps = _settle(layout, lost, ready, rules)
    if _nameless(steps):
        if len(table) >= MEMO_LIMIT:
            table.clear()
        table[key] = tuple((d, _shape(d.layout, number), tuple(
            (m.kind, m.pipeline, m.stage, _num(m.src, number), _num(m.dst, number))
            for m in d.moves), d.needs_restore, d.layout.shape_key()) for _, d in steps)
    return steps


def _settle(layout: Layout, lost: Collection[str], ready: list[str], rules: Rules) -> Steps:
    history = History(layout, tuple((s, s + 1) for s in range(layout.num_stages)))
    steps: Steps = []
    current = layout
    # (the simulator moves no state: the transfers are never looked at)
    for outcome in settle(history, rules, lost=lost, joiners=ready, with_transfers=False):
        steps.append((current, outcome.decision))
        current = outcome.decision.layout
    return steps


def _num(node: str, number: dict[str, int]) -> "int | str":
    return node if node in _SPECIAL else number[node]


def _shape(layout: Layout, number: dict[str, int]) -> _Shape:
    own = layout._map
    return (layout.num_stages, layout.num_pipelines,
            tuple(number[own[slot]] for slot in _slots(layout.num_stages,
                                                       layout.num_pipelines)),
            tuple(number[n] for n in layout.standby), layout.target_stages,
            layout.max_pipelines)


def _nameless(steps: Steps) -> bool:
    """Whether no decision of the settle compared two names (see the module doc)."""
    for before, d in steps:
        if d.message or d.rejoin or d.salvage:
            return False
        # (a start from nothing places the waiting nodes in their order: no names compared)
        if (d.action not in _SAFE or d.needs_restore) and not (
                before.num_pipelines == 0 and d.action in _RESTART):
            return False
        if d.action == Action.REBALANCE and len(before.carriers()) > 1:
            return False
        if (d.action == Action.KEEP and d.reason.startswith("cannot re-partition")
                and len(d.layout.standby) > 1):
            return False
    return True


def _renamed(stored: tuple, layout: Layout, names: list[str],
             lost: Collection[str]) -> Steps:
    steps: Steps = []
    before = layout
    # (the first decision starts from the layout less its lost standby nodes, as `recover`)
    previous = layout
    if lost and layout.standby:
        kept = tuple(n for n in layout.standby if n not in lost)
        if len(kept) != len(layout.standby):
            previous = layout.with_standby(kept)
    for d, (p, width, owners, standby, target, cap), moves, restore, shape in stored:
        mapping = dict(zip(_slots(p, width), map(names.__getitem__, owners)))
        new = Layout._trusted(p, width, mapping, tuple(map(names.__getitem__, standby)),
                              target, cap)
        object.__setattr__(new, "_shape", shape)  # (`Layout.shape_key`'s cache)
        # (a copy with three fields changed: dataclasses.replace re-runs every field's init)
        copy = object.__new__(_Renamed)
        copy.__dict__.update(d.__dict__, layout=new, previous_layout=previous,
                             _moves=moves, _names=names, _restore=restore)
        del copy.__dict__["moves"]
        steps.append((before, copy))
        before = previous = new
    return steps


class _Renamed(Decision):
    """A stored decision renamed onto other nodes. Its moves are renamed when first read:
    the simulator reads only `needs_restore`, known from the stored decision, and a
    re-partition has a move per slot. (As a dataclass it equals only another `_Renamed`;
    compare `to_json()` with a plain Decision.)"""

    def _get_moves(self) -> tuple[Move, ...]:
        got = self.__dict__.get("_moved")
        if got is None:
            names = self.__dict__["_names"]
            got = tuple(Move(kind, pipe, stage, src if src.__class__ is str else names[src],
                             dst if dst.__class__ is str else names[dst])
                        for kind, pipe, stage, src, dst in self.__dict__["_moves"])
            self.__dict__["_moved"] = got
        return got

    def _set_moves(self, moves: tuple[Move, ...]) -> None:  # (dataclasses.replace's init)
        self.__dict__["_moved"] = tuple(moves)

    moves = property(_get_moves, _set_moves)  # type: ignore[assignment]

    @property
    def needs_restore(self) -> bool:
        known = self.__dict__.get("_restore")
        return Decision.needs_restore.fget(self) if known is None else known  # type: ignore
