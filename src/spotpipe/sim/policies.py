"""What each system does when nodes come and go; the simulator's pluggable part.

A policy sees the events of one instant (nodes lost, nodes whose boot finished) and tells the
`Job` ledger what follows: pauses, rollbacks, the new iteration time. All spot policies hold
every instance the trace grants (an autoscaling group bills what it grants), so they pay the
same; they differ in how much of that time turns into kept samples.

- spotpipe: redundancy (FRC) slows each iteration; failover, rebalance, add/drop pipeline and
  re-partition come from `spotpipe.plan.decide`; a fatal failure (two adjacent losses in every
  pipeline) reloads from per-iteration CPU shadows, losing at most the in-flight iteration.
- bamboo: the same redundancy and decisions, as published: a fatal failure is a global
  restart from the last periodic checkpoint.
- checkpoint_restart (torchrun, Varuna): no redundancy; every preemption of a node in use
  restarts all processes from the last periodic checkpoint at the largest D that fits; spare
  nodes scale D up with a graceful (checkpoint-then-restart) relaunch. The 2-minute notice is
  not used to checkpoint, as in torchrun's default behaviour.
- on_demand: no preemptions, on-demand price; see `simulator.on_demand_closed_form`.
"""

from __future__ import annotations

import math

from spotpipe.plan import Action, Decision, Layout, decide
from spotpipe.sim.itertime import iteration_time
from spotpipe.sim.job import Job
from spotpipe.sim.params import SimConfig


class Policy:
    """Base: a policy owns the layout, reacts to events, and counts fatal failures."""

    name = "base"

    def __init__(self, cfg: SimConfig, job: Job) -> None:
        self.cfg = cfg
        self.job = job
        self.fatal_failures = 0

    def on_events(self, t: float, lost: frozenset[str], ready: list[str]) -> None:
        raise NotImplementedError

    def used_nodes(self) -> int:
        raise NotImplementedError


class SpotpipePolicy(Policy):
    """Redundant computation + plan.decide + per-iteration shadows."""

    name = "spotpipe"
    restore_bucket = "restarting"

    def __init__(self, cfg: SimConfig, job: Job) -> None:
        super().__init__(cfg, job)
        self.layout = Layout.from_mapping(cfg.num_stages, 0, {}, (),
                                          max_pipelines=cfg.num_pipelines)
        self.decisions: list[tuple[float, Action]] = []
        self._speeds: dict[tuple, tuple[float, float]] = {}

    def used_nodes(self) -> int:
        return len(self.layout.active_nodes)

    def on_events(self, t: float, lost: frozenset[str], ready: list[str]) -> None:
        lost = lost & self.layout.all_nodes
        if not lost and not ready:
            return
        for _ in range(8):  # a decision sequence converges in a few steps (KEEP ends it)
            before = self.layout
            d = decide(before, lost, ready, min_stages=self.cfg.min_stages)
            lost, ready = frozenset(), []
            self.layout = d.layout
            if d.action == Action.KEEP:
                return
            self.decisions.append((t, d.action))
            self._apply(d, before)
            if d.action == Action.STOP:
                return

    def _apply(self, d: Decision, before: Layout) -> None:
        job, p = self.job, self.cfg.params
        was_running = before.num_pipelines > 0
        if d.action == Action.STOP:
            if was_running:
                self.fatal_failures += 1
                self._roll_back()
            job.set_iteration(None)
            return
        if d.needs_restore:
            if was_running:
                self.fatal_failures += 1
                self._roll_back()
                job.pause(self._restore_pause(), self.restore_bucket)
            elif job.iters > 0:  # restarting after a stop: reload what was kept
                job.pause(self._restore_pause(), self.restore_bucket)
            else:  # the job's first start
                job.pause(p.rendezvous_s, "idle")
        elif d.action in (Action.FAILOVER, Action.DROP_PIPELINE):
            job.lose_in_flight("recovering")
            job.pause(p.pause_s if d.action == Action.FAILOVER else p.reconfig_pause_s,
                      "recovering")
        else:  # REBALANCE, ADD_PIPELINE, REPARTITION without loss: at an iteration boundary
            job.pause(p.reconfig_pause_s, "recovering")
        self._set_speed()

    def _set_speed(self) -> None:
        key = self.layout.shape_key()
        speed = self._speeds.get(key)
        if speed is None:  # a per-run memo: hashing the model per lookup would cost more
            cfg = self.cfg
            p, width, merged = key
            full = iteration_time(cfg.model, cfg.schedule, p, width, merged, True)
            plain = iteration_time(cfg.model, cfg.schedule, p, width, merged, False)
            speed = self._speeds[key] = (full, min(plain, full))
        self.job.set_iteration(*speed)

    def _roll_back(self) -> None:
        self.job.lose_in_flight(self.restore_bucket)

    def _restore_pause(self) -> float:
        return self.cfg.params.shadow_restore_pause_s


class BambooPolicy(SpotpipePolicy):
    """Bamboo as published: fatal failures restart globally from a periodic checkpoint."""

    name = "bamboo"

    def _roll_back(self) -> None:
        self.job.roll_back_to_checkpoint(self.restore_bucket)

    def _restore_pause(self) -> float:
        return self.cfg.params.restart_pause_s


class CheckpointRestartPolicy(Policy):
    """Restart everything on every preemption of a node in use; scale D to the nodes."""

    name = "checkpoint_restart"

    def __init__(self, cfg: SimConfig, job: Job) -> None:
        super().__init__(cfg, job)
        self.pool: dict[str, None] = {}  # ready nodes, in arrival order
        self.used: set[str] = set()
        self.width = 0  # pipelines running

    def used_nodes(self) -> int:
        return len(self.used)

    def on_events(self, t: float, lost: frozenset[str], ready: list[str]) -> None:
        cfg, job = self.cfg, self.job
        for node in lost:
            self.pool.pop(node, None)
        for node in ready:
            self.pool[node] = None
        hit = bool(lost & self.used)
        fits = min(cfg.num_pipelines, len(self.pool) // cfg.num_stages)
        if hit:
            self.fatal_failures += 1
            job.roll_back_to_checkpoint("restarting")
        elif fits <= self.width:
            return  # joins that cannot form another pipeline change nothing
        elif self.width:
            job.checkpoint_now()  # graceful relaunch to scale up: nothing lost
        if fits == 0:
            self.width, self.used = 0, set()
            job.set_iteration(None)
            return
        first_start = self.width == 0 and job.iters == 0
        job.pause(cfg.params.rendezvous_s if first_start else cfg.params.restart_pause_s,
                  "idle" if first_start else "restarting")
        self.width = fits
        self.used = set(list(self.pool)[: fits * cfg.num_stages])
        it = iteration_time(cfg.model, cfg.schedule, cfg.num_stages, fits, ((),), False)
        job.set_iteration(it)


POLICIES: dict[str, type[Policy]] = {
    "spotpipe": SpotpipePolicy,
    "bamboo": BambooPolicy,
    "checkpoint_restart": CheckpointRestartPolicy,
}
ALL_POLICIES = tuple(POLICIES) + ("on_demand",)


def policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {list(ALL_POLICIES)}") \
            from None


def checkpoint_interval(name: str, cfg: SimConfig) -> float:
    """spotpipe's shadows hold every iteration, so only in-flight work is ever lost."""
    return math.inf if name == "spotpipe" else cfg.params.checkpoint_interval_s
