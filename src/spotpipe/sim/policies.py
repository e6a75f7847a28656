"""What each system does when nodes come and go; the simulator's pluggable part.

A policy sees the events of one instant (nodes lost, nodes whose boot finished) and tells the
`Job` ledger what follows: pauses, rollbacks, the new iteration time. All spot policies hold
every instance the trace grants (an autoscaling group bills what it grants), so they pay the
same; they differ in how much of that time turns into kept samples.

- spotpipe: redundancy none | lazy | eager (lazy costs `lazy_ratio`, eager its FRC);
  failover, rebalance, add/drop pipeline and re-partition come from `spotpipe.plan.recovery`,
  the runtime's own decision (`Planner`, the one call into it), never below the smallest
  depth that fits memory (`spotpipe.sim.fit`); a takeover redoes only the lost stage's share
  of the in-flight iteration; a fatal failure (every pipeline broken, by two adjacent losses
  or, without redundancy, by any loss, and some stage's state on no survivor: else the
  survivors make up a pipeline) reloads from per-iteration CPU shadows (`shadows`, losing at
  most the in-flight iteration, their host billed) or else from the last durable checkpoint.
  With notices (`SimConfig.notice_s`) a removal is told ahead and met at a boundary, as the
  runtime meets one: nothing in flight lost, and leaving nodes hand over what no one else
  holds.
- bamboo: Bamboo as its simulator has it (P fixed, carriers until a rendezvous, its fatal
  rule, global and local rendezvous); see `spotpipe.sim.bamboo`.
- checkpoint_restart (torchrun, Varuna): no redundancy; every preemption of a node in use
  restarts all processes from the last periodic checkpoint at the largest D that fits; spare
  nodes scale D up with a graceful (checkpoint-then-restart) relaunch. The 2-minute notice is
  not used to checkpoint, as in torchrun's default behaviour.
- on_demand: no preemptions, on-demand price; see `simulator.on_demand_closed_form`.
"""

from __future__ import annotations

import math

from spotpipe.plan import Action, Layout
from spotpipe.plan.recovery import Rules
from spotpipe.sim import fit
from spotpipe.sim.bamboo import BambooPolicy
from spotpipe.sim.itertime import iteration_time
from spotpipe.sim.job import Job
from spotpipe.sim.memo import PerObject
from spotpipe.sim.params import SimConfig
from spotpipe.sim.planmemo import (Machine, Situation, Step, Transition, machine_for,
                                   shared_rules)


_NOTHING: frozenset[int] = frozenset()
# (module constants: an Enum member's lookup costs more than the comparison, per event)
_STOP, _FAILOVER, _DROP = Action.STOP, Action.FAILOVER, Action.DROP_PIPELINE
_HANDOVER = Action.HANDOVER


class Policy:
    """Base: a policy owns the layout, reacts to events, and counts fatal failures."""

    name = "base"

    def __init__(self, cfg: SimConfig, job: Job) -> None:
        self.cfg = cfg
        self.job = job
        self.fatal_failures = 0

    def on_events(self, t: float, lost: tuple[str, ...], ready: list[str],
                  index: int = -1) -> None:
        """React to the nodes lost and the nodes ready at instant number `index`, time t."""
        raise NotImplementedError

    def used_nodes(self) -> int:
        raise NotImplementedError


_SPEEDS: PerObject[dict[tuple, tuple[float, float]]] = PerObject()


def _speed_memo(cfg: SimConfig, redundancy: str) -> dict[tuple, tuple[float, float]]:
    """(iteration s, plain iteration s) per layout shape, per config object and redundancy;
    measured shapes (a profile of the cluster) take precedence over the timing model."""
    return _SPEEDS.get(cfg, redundancy, _measured_speeds, cfg)


def _measured_speeds(cfg: SimConfig) -> dict[tuple, tuple[float, float]]:
    return {shape: (t, t) for shape, t in cfg.shape_times}


def _iteration_time(cfg: SimConfig, p: int, width: int, merged: tuple[tuple[int, ...], ...],
                    redundant: bool) -> float:
    """`itertime.iteration_time`, with each pipeline's time memoised per config: a sweep
    meets thousands of layout shapes (which stages are merged in which pipeline) but few
    pipeline shapes, and the timing cache's keys hash the whole model on every lookup."""
    memo = _speed_memo(cfg, "pipelines")
    worst = 0.0
    for m in set(merged):
        k = (p, width, m, redundant)
        t = memo.get(k)
        if t is None:
            t = memo[k] = iteration_time(cfg.model, cfg.schedule, p, width, (m,), redundant)
        worst = max(worst, t)
    return worst


def recovery_rules(cfg: SimConfig, redundancy: str) -> Rules:
    """The runtime's recovery rules for a simulated job (`cluster.coordinator.rules_for` makes
    the same from a config): with them `plan.recovery` decides here what the coordinator
    decides in a run. Partitions are uniform (the simulator has no model to profile); a job
    whose layout no survivor can hold is restarted from its checkpoint, as a supervisor would
    restart a stopped run."""
    return Rules(replicas=redundancy != "none", shadows=cfg.shadows,
                 repartition=cfg.repartition, replay_rest=True,
                 microbatches=cfg.model.global_microbatches,
                 repartition_blocked=("the CPU shadows hold the stages of the launch "
                                      "partition; the job keeps its carriers"
                                      if cfg.shadows else None),
                 partition_for=_uniform, min_stages=fit.min_stages(cfg, redundancy),
                 room=fit.node_room(cfg), restarts=True)


_RULES_OF: PerObject[Rules] = PerObject()


def _rules_of(cfg: SimConfig, redundancy: str) -> Rules:
    """`recovery_rules`, once per config object (a sweep makes a policy per seed, and building
    and interning the rules costs more than a quiet run's events)."""
    return _RULES_OF.get(cfg, redundancy, _shared_recovery_rules, cfg, redundancy)


def _shared_recovery_rules(cfg: SimConfig, redundancy: str) -> Rules:
    return shared_rules(recovery_rules(cfg, redundancy))


def _uniform(depth: int) -> tuple[tuple[int, int], ...]:
    return tuple((s, s + 1) for s in range(depth))


class Planner:
    """The spotpipe policy's decisions on one trace: `planmemo.Machine` transitions,
    memoised per instant.

    Layouts evolve from the events and the rules alone (recovery never looks at the job's
    clock), so runs of the spotpipe policy on one trace with the same rules (lazy and eager
    redundancy in a sweep) share one Planner and take each instant's transition once; the
    memo is used only when the caller stands where the memo started from (the very
    situation and names objects). `memo=False` recomputes every transition from the real
    layout (the reference the tests hold the machine to).
    """

    def __init__(self, memo: bool = True) -> None:
        self.memo = memo
        self._instants: dict[int, tuple[Situation, list[str], Machine, tuple[str, ...], bool,
                                        tuple[Transition, list[str]] | None]] = {}
        self._empty: list[str] = []  # the names of every run's empty start (shared)

    def machine(self, rules: Rules) -> Machine:
        return machine_for(rules, self.memo)

    def start(self, machine: Machine, num_stages: int,
              num_pipelines: int) -> tuple[Situation, list[str]]:
        """The empty layout before the first nodes boot (shared, so the memo can match)."""
        return machine.start(num_stages, num_pipelines), self._empty

    def plan(self, index: int, machine: Machine, situation: Situation, names: list[str],
             lost: tuple[str, ...], ready: list[str],
             leaving: bool = False) -> tuple[Transition, list[str]] | None:
        """The transition for instant number `index` (nodes `lost`, those of them that stand
        in the layout, on a notice when `leaving`, and `ready`), and the names after it;
        None when no node of the layout is lost and none joins."""
        hit = self._instants.get(index)
        # (`lost` by identity: the instants of a trace told with notices are other tuples)
        if hit is not None and hit[0] is situation and hit[1] is names and hit[2] is machine \
                and hit[3] is lost and hit[4] == leaving:
            return hit[5]
        # (a scan of a few dozen names costs less than keeping a dict of them)
        gone = frozenset([names.index(n) for n in lost if n in names]) if lost else _NOTHING
        out = None
        if gone or ready:
            move = machine.transition(situation, names, gone, ready, leaving and bool(gone))
            out = move, move.names_after(names, ready)
        if index >= 0:
            self._instants[index] = (situation, names, machine, lost, leaving, out)
        return out


class SpotpipePolicy(Policy):
    """Redundant computation + the runtime's recovery decisions + per-iteration shadows."""

    name = "spotpipe"
    restore_bucket = "restarting"
    # the part of the in-flight iteration a takeover redoes (`failover.replay: rest`): the
    # heir runs two stages, keeps its own stage's work and every survivor's, and redoes the
    # lost stage's, which is half of what the heir now runs; the pause covers the rest
    takeover_redo = 0.5

    def __init__(self, cfg: SimConfig, job: Job, planner: "Planner | None" = None) -> None:
        super().__init__(cfg, job)
        self.planner = planner or Planner()
        self.rules = _rules_of(cfg, self.redundancy())
        self.machine = self.planner.machine(self.rules)
        # where the job stands: a numbered layout and the names of its numbers
        self.situation, self.names = self.planner.start(
            self.machine, cfg.num_stages, cfg.num_pipelines)
        self.shapes: set[tuple[int, int, bool]] = set()  # (P, D, a node carries two stages)
        self._mode = self.redundancy()

    @property
    def layout(self) -> Layout:
        return self.situation.layout(self.names)

    def used_nodes(self) -> int:
        return self.situation.active

    def on_events(self, t: float, lost: tuple[str, ...], ready: list[str],
                  index: int = -1) -> None:
        notice = bool(lost) and self._noticed()
        planned = self.planner.plan(index, self.machine, self.situation, self.names, lost,
                                    ready, notice)
        if planned is None:
            return
        move, self.names = planned
        for step in move.acts:
            # (the event's own decision; those after it are the boundaries' improvements)
            self._apply(step, notice and step is move.steps[0])
        self.situation = now = move.after
        if now.summary is not None:
            self.shapes.add(now.summary)

    def _noticed(self) -> bool:
        """Whether a removal told `acted_notice_s` ahead reaches the job as a notice: with an
        iteration boundary inside the window, where the leaving nodes still report (else it
        is a kill, a little early)."""
        notice = self.cfg.acted_notice_s
        return notice > 0 and (not self.job.iter_s or notice >= self.job.iter_s)

    def _apply(self, step: Step, notice: bool = False) -> None:
        """`notice`: the step is a notice's, at an iteration boundary: nothing in flight is
        lost, nothing to detect."""
        job, p = self.job, self.cfg.params
        action = step.action
        if action is _STOP:
            if step.was_running:
                self.fatal_failures += 1
                self._roll_back()
            job.set_iteration(None)
            return
        if step.needs_restore:
            if step.was_running:
                self.fatal_failures += 1
                self._roll_back()
                job.pause(self._restore_pause(), self.restore_bucket)
            elif job.iters > 0:  # restarting after a stop: reload what was kept
                job.pause(self._restore_pause(), self.restore_bucket)
            else:  # the job's first start
                job.pause(p.rendezvous_s, "idle")
        elif notice and action in (_FAILOVER, _HANDOVER):
            job.pause(p.notice_pause_s, "recovering")
        elif action is _FAILOVER:
            job.lose_in_flight("recovering", self.takeover_redo)
            job.pause(p.pause_s, "recovering")
        elif action is _DROP:
            if not notice:
                job.lose_in_flight("recovering", 1.0)
            job.pause(p.reconfig_pause_s, "recovering")
        else:  # REBALANCE, ADD_PIPELINE, REPARTITION without loss: at an iteration boundary
            job.pause(p.reconfig_pause_s, "recovering")
        self._set_speed(step.after)

    def redundancy(self) -> str:
        """spotpipe runs the configured redundancy (lazy: replicas kept exact by gradient
        replication, no extra compute; eager: plus FRC in the bubbles)."""
        return self.cfg.redundancy

    def _set_speed(self, situation: Situation) -> None:
        # the speed rides on the situation (shared by every run of the process), else by shape
        cfg, mode = self.cfg, self._mode
        hit = situation.speeds.get(mode)
        if hit is not None and hit[0] is cfg:
            self.job.set_iteration(*hit[1])
            return
        key = situation.shape
        speeds = _speed_memo(cfg, mode)
        speed = speeds.get(key)
        if speed is None:
            p, width, merged = key
            plain = _iteration_time(cfg, p, width, merged, False)
            if mode == "eager":
                full = _iteration_time(cfg, p, width, merged, True)
            elif mode == "lazy" and p > 1:
                # applying each replica's gradient in the background costs a little (see
                # SimParams.lazy_ratio); a pipeline that has a carrier still does it for the
                # replicas it has left, which this charges as if all were there
                full = plain / cfg.params.lazy_ratio
            else:
                full = plain
            speed = speeds[key] = (full, min(plain, full))
        situation.speeds[mode] = (cfg, speed)
        self.job.set_iteration(*speed)

    def _roll_back(self) -> None:
        """With shadows only the iteration in flight is lost; without, everything since the
        last durable checkpoint."""
        if self.cfg.shadows:
            self.job.lose_in_flight(self.restore_bucket)
        else:
            self.job.roll_back_to_checkpoint(self.restore_bucket)

    def _restore_pause(self) -> float:
        p = self.cfg.params
        return p.shadow_restore_pause_s if self.cfg.shadows else p.restart_pause_s


class CheckpointRestartPolicy(Policy):
    """Restart everything on every preemption of a node in use; scale D to the nodes."""

    name = "checkpoint_restart"

    def __init__(self, cfg: SimConfig, job: Job) -> None:
        super().__init__(cfg, job)
        fit.require_fit(cfg, cfg.num_stages, 1, "none")  # P is fixed; D = 1 is the largest
        self.pool: dict[str, None] = {}  # ready nodes, in arrival order
        self.used: set[str] = set()
        self.width = 0  # pipelines running
        self.shapes: set[tuple[int, int, bool]] = set()  # (P, D, a node carries two stages)

    def used_nodes(self) -> int:
        return len(self.used)

    def on_events(self, t: float, lost: tuple[str, ...], ready: list[str],
                  index: int = -1) -> None:
        cfg, job = self.cfg, self.job
        for node in lost:
            self.pool.pop(node, None)
        for node in ready:
            self.pool[node] = None
        hit = not self.used.isdisjoint(lost)
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
        self.shapes.add((cfg.num_stages, fits, False))
        speeds = _speed_memo(cfg, "restart")
        it = speeds.get(fits)
        if it is None:
            it = speeds[fits] = plain_iteration_time(cfg, cfg.num_stages, fits)
        job.set_iteration(it)


def plain_iteration_time(cfg: SimConfig, num_stages: int, num_pipelines: int) -> float:
    """Seconds per iteration of P x D without redundancy: a measured shape time when the
    calibration has one (it applies to every policy alike), else the timing model."""
    measured = dict(cfg.shape_times).get((num_stages, num_pipelines, ((),) * num_pipelines))
    if measured is not None:
        return measured
    return iteration_time(cfg.model, cfg.schedule, num_stages, num_pipelines, ((),), False)


POLICIES: dict[str, type] = {
    "spotpipe": SpotpipePolicy,
    "bamboo": BambooPolicy,
    "checkpoint_restart": CheckpointRestartPolicy,
}
ALL_POLICIES = tuple(POLICIES) + ("on_demand",)


def make_policy(name: str, cfg: SimConfig, job: Job,
                planner: Planner | None = None) -> "Policy | BambooPolicy":
    cls = policy_class(name)
    if issubclass(cls, SpotpipePolicy):
        return cls(cfg, job, planner)
    return cls(cfg, job)


def policy_class(name: str) -> type:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {list(ALL_POLICIES)}") \
            from None


def checkpoint_interval(name: str, cfg: SimConfig) -> float:
    """spotpipe's shadows hold every iteration, so only in-flight work is ever lost; Bamboo's
    simulator keeps its steps through a fatal failure (it writes no checkpoints)."""
    if name == "bamboo" or (name == "spotpipe" and cfg.shadows):
        return math.inf
    return cfg.params.checkpoint_interval_s
