"""Bamboo as published: the rules of its simulator (uclasystem/bamboo,
project_pactum/simulation/simulator.py), re-expressed on this simulator's clock and ledger.

Why a policy of its own rather than spotpipe's decisions with other costs: Bamboo decides
differently, and the figures it published come from these rules:
- P is fixed (`num_stages`); D = nodes // P at each rendezvous, 0 below P nodes (the job
  stops until a node becomes ready, which starts a global rendezvous);
- a loss is taken over by the predecessor (the holder of stage s - 1, which holds the
  replica of s): from then on that node carries two stages until the next rendezvous;
  the pipeline runs `fallback_slowdown` (1.5x) slower from the loss on, in-flight step
  included, until the next rendezvous;
- fatal: losing a node that carries two stages, or a node whose predecessor already carries
  two; a fatal failure starts a global rendezvous (30 s) and loses only the step in flight
  (its simulator keeps the step count: no checkpoint rollback);
- at each step's end it reconfigures with a local rendezvous (20 s) when the carriers can
  be relieved by waiting nodes, when 2 x carriers / active nodes exceeds 5 %, or when
  another pipeline can be formed;
- a rendezvous completes after its timeout with the nodes ready then; if one of them was
  lost meanwhile it starts over. As in its simulator, a rendezvous started while another
  is pending (a fatal failure during a rendezvous) does not cancel the pending timeout, and
  a waiting node that is preempted stays counted as waiting until the next rendezvous: both
  change its figures, so both are kept.
- a rendezvous lists the nodes in the order they were granted (its `spot_instances`), which
  differs from the order they became ready only where boots of one instant are taken in
  another order (`Trace.boot_order`: its heap's, for the nodes granted at t = 0);
- with a measured step table (its, in whole milliseconds) its clock's truncations are kept:
  a slowed step is `int(step_ms * 1.5)` ms and the step in flight at a takeover ends
  `int(0.5 x its ms left)` later; without them hundreds of slowed steps drift a run by a
  step within hours, and a later removal falls on the other side of a step's end.
Nodes are ready `params.boot_s` after they are granted (its 45 s). Its step times per D come
from `cfg.shape_times` when given (its table), else from the timing model with eager FRC of
every replica, the last stage's included, as its engine runs it.
Its value formula (the time average of samples/s per $/h over the time the job ran) is
`Result.time_average_value`; `SimConfig.value_formula = "bamboo"` makes it the value.
"""

from __future__ import annotations

import heapq
from functools import lru_cache
from math import inf

from spotpipe.sim import fit
from spotpipe.sim.itertime import iteration_time
from spotpipe.sim.job import Job
from spotpipe.sim.memo import PerObject
from spotpipe.sim.params import SimConfig

GLOBAL, LOCAL, CHECK = 0, 1, 2


# per config object: width -> (step s, of which without FRC). A sweep runs the policy on
# thousands of traces of one config, and timing a width hashes the whole model
_STEPS: PerObject[dict[int, tuple[float, float]]] = PerObject()


def _step_memo(cfg: SimConfig) -> dict[int, tuple[float, float]]:
    return _STEPS.get(cfg, None, dict)


@lru_cache(maxsize=None)
def _slots(width: int, depth: int) -> tuple[tuple[int, int], ...]:
    """Each slot of a rendezvous's layout, in the order members take them."""
    return tuple((d, s) for d in range(width) for s in range(depth))


class BambooPolicy:
    name = "bamboo"
    fallback_slowdown = 1.5
    failure_budget = 0.05  # reconfigure above this chance of a fatal failure

    def __init__(self, cfg: SimConfig, job: Job) -> None:
        # P is fixed; Bamboo keeps its replica in device memory and runs eager FRC of every
        # replica
        fit.require_fit(cfg, cfg.num_stages, 1, "eager" if cfg.num_stages > 1 else "none",
                        replica_on_host=False, frc_every_stage=True)
        self.cfg, self.job = cfg, job
        self.fatal_failures = 0
        self.target = cfg.num_stages
        self.p = 0  # depth now (0 while stopped)
        self.width = 0
        self.status = "stopped"  # stopped | rendezvous | running
        self.nodes: dict[str, list[tuple[int, int]]] = {}  # ready nodes -> coordinates
        self.owner: dict[tuple[int, int], str] = {}  # coordinate -> the node that ran it last
        self.members: list[str] = []
        # node -> the place of its grant (set by the simulator): a rendezvous lists the
        # nodes in the order they were granted, as its simulator's `spot_instances` holds
        # them, not in the order they became ready (the two differ only where boots that
        # complete at one instant are taken in another order: `Trace.boot_order`)
        self.grants: dict[str, int] = {}
        self.waiting = 0
        self.carriers = 0  # nodes of `nodes` that carry two stages
        self.slowed = False
        self.stepping = False  # steps run (also during a rendezvous a fatal failure started)
        self.version = 0
        self._timers: list[tuple[float, int, int, int]] = []  # (t, seq, kind, version)
        self._seq = 0
        self.wakeup = inf  # when the next timer is due (the simulator's loop reads it)
        self._check: tuple[float, int] | None = None  # the step-end check pending last
        self._steps = _step_memo(cfg)
        self.shapes: set[tuple[int, int, bool]] = set()  # (P, D, a node carries two stages)

    # -- what the simulator asks ------------------------------------------------------------
    def used_nodes(self) -> int:
        return sum(1 for c in self.nodes.values() if c) if self.status == "running" else 0

    def next_wakeup(self) -> float:
        return self.wakeup

    def on_wakeup(self, t: float) -> None:
        timers = self._timers
        _, _, kind, version = heapq.heappop(timers)
        self.wakeup = timers[0][0] if timers else inf
        if kind == CHECK:
            # a check superseded by a later one is no step's end: a takeover slowed the step
            # after it was set (its simulator defers that step's end, and checks only then)
            if version == self.version and self.stepping and self._check == (t, version):
                self._step_end(t)
        else:
            self._rendezvous_timeout(t, kind)

    def on_events(self, t: float, lost: tuple[str, ...], ready: list[str],
                  index: int = -1) -> None:
        for name in lost:  # in trace order
            self._remove(t, name)
        for name in ready:
            self._ready(t, name)

    # -- Bamboo's rules ---------------------------------------------------------------------
    def _remove(self, t: float, name: str) -> None:
        coords = self.nodes.pop(name, [])  # a rendezvous member: noticed at its timeout
        if len(coords) > 1:
            self.carriers -= 1
            return self._fatal(t)
        if coords:
            d, s = coords[0]
            want = (d, s - 1 if s > 0 else self.p - 1)
            heir = self.owner.get(want)
            # (the node that ran `want` last may be gone, or back under the same name)
            other = self.nodes.get(heir) if heir is not None else None
            if other is not None and want in other:
                if len(other) > 1:  # the heir already carries two stages
                    return self._fatal(t)
                other.append(coords[0])
                self.owner[coords[0]] = heir
                self.carriers += 1
                if self.status == "running":
                    self.shapes.add((self.p, self.width, True))
        # as its simulator has it: any preemption while running (a waiting or booting node's
        # too) slows the steps by the fallback factor until the next rendezvous
        if self.status == "running" and not self.slowed:
            self.slowed = True
            full, plain = self._steps[self.width]  # the whole step slows down
            end = self.job.next_iteration_end()
            self.job.set_iteration(self._slowed(full), self._slowed(plain))
            if self.cfg.shape_times and end is not None:
                # its in-flight step: its end is put off by int(0.5 x the ms left)
                left_ms = round((end - t) * 1000.0)
                self.job.end_in_flight_at(
                    end + int(left_ms * (self.fallback_slowdown - 1.0)) / 1000.0)
        self._check_at_step_end()

    def _ready(self, t: float, name: str) -> None:
        self.nodes[name] = []
        if self.status == "stopped":
            self._start_rendezvous(t, GLOBAL)
        elif self.status == "rendezvous":
            self.members.append(name)
        else:
            self.waiting += 1
            self._check_at_step_end()

    def _fatal(self, t: float) -> None:
        """As its simulator has it: the steps already scheduled go on until the global
        rendezvous completes (or a step's end starts a local one)."""
        self.fatal_failures += 1
        self._start_rendezvous(t, GLOBAL)
        self._check_at_step_end()

    def _start_rendezvous(self, t: float, kind: int) -> None:
        self.status = "rendezvous"
        self.members = self._in_grant_order()
        self._timer(t + self._timeout(kind), kind)
        if kind == LOCAL or not self.stepping:
            self.stepping = False
            bucket = "idle" if self.version == 0 else "restarting" if kind == GLOBAL \
                else "recovering"
            self.job.set_iteration(None, idle_bucket=bucket)

    def _in_grant_order(self) -> list[str]:
        grants = self.grants
        if not grants:
            return list(self.nodes)
        return sorted(self.nodes, key=lambda n: grants.get(n, -1))

    def _timeout(self, kind: int) -> float:
        p = self.cfg.params
        return p.rendezvous_s if kind == GLOBAL else p.reconfig_pause_s

    def _rendezvous_timeout(self, t: float, kind: int) -> None:
        members = self.members
        if not self.nodes.keys() >= set(members):  # one of them was lost meanwhile
            self.members = self._in_grant_order()
            self._timer(t + self._timeout(kind), kind)
            return
        n = len(members)
        self.p = self.target if n >= self.target else 0
        self.width = n // self.target if self.p else 0
        slots = _slots(self.width, self.p)
        # members are the nodes known when it started: each gets its slot, the rest wait
        # (as lists: a takeover appends its second stage to the heir's)
        nodes = self.nodes
        for name, slot in zip(members, slots):
            nodes[name] = [slot]
        placed = len(slots)
        for name in members[placed:]:
            nodes[name] = []
        # (updated, not replaced: a timeout that finds no members keeps the old layout's
        # coordinates, as its simulator does)
        self.owner.update(zip(slots, members))
        self.carriers = 0
        self.waiting = n - placed
        self.slowed = False
        self.version += 1
        self.members = []
        if self.stepping:  # the step in flight when a global rendezvous completes is lost
            self.job.lose_in_flight("restarting")
        self.stepping = bool(self.width)
        if self.width:
            self.shapes.add((self.p, self.width, False))
            self.status = "running"
            self.job.set_iteration(*self._step_s(self.width))
        else:
            self.status = "stopped"
            self.job.set_iteration(None)

    def _step_end(self, t: float) -> None:
        carriers = self.carriers
        active = self.p * self.width - carriers
        reconfigure = (
            (carriers > 0 and self.waiting >= carriers)
            or (carriers > 0 and 2 * carriers / active > self.failure_budget)
            or (active + self.waiting) // self.target > self.width)
        if reconfigure:
            self.job.lose_in_flight("recovering")  # at a step's end: only rounding
            self._start_rendezvous(t, LOCAL)

    def _check_at_step_end(self) -> None:
        when = self.job.next_iteration_end()
        # several events within one step ask for the same check: it is made once (a second
        # check at the same time and version finds what the first found)
        if when is not None and (when, self.version) != self._check:
            self._check = (when, self.version)
            self._timer(when, CHECK)

    def _timer(self, t: float, kind: int) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (t, self._seq, kind, self.version))
        self.wakeup = self._timers[0][0]

    def _slowed(self, step_s: float) -> float:
        """A step after a takeover. Its simulator's clock counts whole milliseconds and
        truncates the slowed step (`int(step_delta * fallback_slowdown)`: 2707 ms for its
        BERT table's 1805 ms, not 2707.5); a measured step table is taken as its, in whole
        milliseconds, and truncated alike, else hundreds of slowed steps drift a run's
        clock from its by a step's length within a few hours."""
        if self.cfg.shape_times:
            return int(round(step_s * 1000.0) * self.fallback_slowdown) / 1000.0
        return step_s * self.fallback_slowdown

    def _step_s(self, width: int) -> tuple[float, float]:
        """(step seconds, of which without FRC): a measured step has no split."""
        hit = self._steps.get(width)
        if hit is None:
            measured = dict(self.cfg.shape_times).get((self.target, width, ((),) * width))
            if measured is not None:
                hit = (measured, measured)
            else:
                cfg = self.cfg
                hit = (iteration_time(cfg.model, cfg.schedule, self.target, width, ((),),
                                      self.target > 1, frc_every_stage=True),
                       iteration_time(cfg.model, cfg.schedule, self.target, width, ((),),
                                      False))
            self._steps[width] = hit
        return hit
