"""The job's clock and ledger: progress, pauses, rollbacks and where the time went.

Policies decide *what* happens at an event (a pause, a rollback, a new iteration time); this
class does the arithmetic of *how much* each costs, identically for every policy, so policies
differ only in their decisions. Time between events is split into five buckets:
- useful: running iterations that are kept, at the speed of the plain (non-redundant) schedule;
- redundant: the extra iteration time protection adds (forward redundant computation, lazy
  replication, and the stalls of periodic checkpoints, `checkpoint_cost_s` each);
- recovering: failover and reconfiguration pauses, and in-flight work replayed after them;
- restarting: restarts (from shadows or checkpoints) and the work they roll back;
- idle: nothing can run (booting, too few nodes).
"""

from __future__ import annotations

import math

BUCKETS = ("useful", "redundant", "recovering", "restarting", "idle")
_INF = math.inf


class Job:
    """Progress in iterations (a float: the fraction is the in-flight iteration)."""

    def __init__(self, samples_per_iteration: int, checkpoint_interval_s: float,
                 checkpoint_cost_s: float = 0.0) -> None:
        self.samples_per_iteration = samples_per_iteration
        self.interval = checkpoint_interval_s
        # a checkpoint stalls training this long every `interval` of running: charged as a
        # longer iteration (1 + cost / interval), so no policy can dodge it
        self.checkpoint_slowdown = 1.0 + (checkpoint_cost_s / checkpoint_interval_s
                                          if math.isfinite(checkpoint_interval_s) else 0.0)
        self.t = 0.0
        self.iters = 0.0
        self.kept_iters = 0.0  # progress saved in the last durable checkpoint
        self.iter_s: float | None = None
        self.plain_s = 0.0
        self.paused_until = 0.0
        self.pause_bucket = "recovering"
        self.run_since_ckpt = 0.0
        self.pending = [0.0, 0.0]  # useful, redundant run time since the last checkpoint
        self.buckets = dict.fromkeys(BUCKETS, 0.0)
        self.idle_bucket = "idle"  # where time goes while nothing runs (set_iteration(None))
        # Bamboo's value formula needs the time average of (samples/s) / ($/h) over the
        # time the job ran: the simulator sets `cost_rate` ($/h held) at every instant
        self.cost_rate = 0.0
        self.dollars = 0.0
        self.value_integral = 0.0  # integral of (samples/s) / ($/h) dt while running
        self.first_run_s: float | None = None
        self.last_run_s = 0.0
        self.dollars_at_last_run = 0.0
        # a job that ends after `goal` iterations (Bamboo's table runs to the end of its job):
        # time stops at the instant the goal is reached, `done_at`
        self.goal = math.inf
        self.done_at: float | None = None

    # -- time passes ----------------------------------------------------------------------
    def advance(self, t: float) -> None:
        # (the simulator's innermost call, several times per event of every run: written
        # with conditionals, not min/max, and the attributes read once)
        now = self.t
        dt = t - now
        if dt <= 0 or self.done_at is not None:
            return
        paused = self.paused_until - now
        if paused > 0:
            if paused > dt:
                paused = dt
            self.buckets[self.pause_bucket] += paused
            run = dt - paused
        else:
            run = dt
        iter_s = self.iter_s
        if self.goal < _INF and run > 0 and iter_s is not None \
                and self.iters + run / iter_s >= self.goal:
            past = run - (self.goal - self.iters) * iter_s  # run time after the goal
            run, dt, t = run - past, dt - past, t - past
            self.done_at = t
        cost_rate = self.cost_rate
        self.dollars += cost_rate * dt / 3600.0
        self.t = t
        if run <= 0:
            return
        if iter_s is None:
            self.buckets[self.idle_bucket] += run
            return
        if self.first_run_s is None:
            self.first_run_s = t - run
        self.last_run_s = t
        self.dollars_at_last_run = self.dollars
        if cost_rate > 0:
            self.value_integral += run * self.samples_per_iteration / iter_s / cost_rate
        self.iters += run / iter_s
        share = self.plain_s / iter_s
        pending = self.pending
        pending[0] += run * share
        pending[1] += run * (1.0 - share)
        self.run_since_ckpt += run
        if self.run_since_ckpt >= self.interval:
            left = self.run_since_ckpt % self.interval  # run time since the newest checkpoint
            self._checkpoint(self.iters - left / iter_s, iter_s, share)
            self.run_since_ckpt = left

    def _checkpoint(self, progress: float, iter_s: float, share: float) -> None:
        """A durable checkpoint when the job stood at `progress`: the runtime writes one at an
        iteration boundary (`checkpoint.every` counts iterations), so it holds the iterations
        completed by then, and the in-flight one stays at risk with what followed it."""
        kept = max(self.kept_iters, float(math.floor(progress + 1e-9)))
        self.kept_iters = kept
        since = min((self.iters - kept) * iter_s, self.pending[0] + self.pending[1])
        self._commit(since * share, since * (1.0 - share))

    def _commit(self, keep_useful: float, keep_redundant: float) -> None:
        """Move pending run time into the buckets, leaving what is not yet checkpointed."""
        self.buckets["useful"] += self.pending[0] - keep_useful
        self.buckets["redundant"] += self.pending[1] - keep_redundant
        self.pending = [keep_useful, keep_redundant]

    # -- what policies do -----------------------------------------------------------------
    def set_iteration(self, iter_s: float | None, plain_s: float | None = None,
                      idle_bucket: str = "idle") -> None:
        """The layout changed: new iteration time (None: nothing runs, and the time goes to
        `idle_bucket` until the next call)."""
        self.plain_s = iter_s if plain_s is None else plain_s
        self.iter_s = iter_s * self.checkpoint_slowdown if iter_s is not None else None
        self.idle_bucket = idle_bucket

    def end_pause(self) -> None:
        """A pause ends now, before the time it was set for."""
        self.paused_until = min(self.paused_until, self.t)

    def next_iteration_end(self) -> float | None:
        """When the iteration in flight completes at the present speed (None: none runs)."""
        if self.iter_s is None:
            return None
        left = math.floor(self.iters + 1e-9) + 1 - self.iters
        if left > 1.0 - 1e-9:  # one just ended: its end is now (after this instant's events)
            left = 0.0
        start = self.paused_until if self.paused_until > self.t else self.t
        return start + left * self.iter_s

    def end_in_flight_at(self, end_s: float) -> None:
        """The iteration in flight ends at `end_s` at the present speed, not when its work
        left says (a policy whose clock is coarser than this one's: Bamboo's whole ms)."""
        if self.iter_s is None or end_s <= self.t:
            return
        whole = math.floor(self.iters + 1e-9)
        self.iters = whole + 1 - (end_s - self.t) / self.iter_s

    def pause(self, seconds: float, bucket: str) -> None:
        """Stop computing for `seconds` from now (or from the end of a pause under way)."""
        start = self.paused_until if self.paused_until > self.t else self.t
        # one label per pause: an extended pause is counted under the newest reason
        self.paused_until = start + seconds
        self.pause_bucket = bucket

    def lose_in_flight(self, bucket: str, fraction: float = 1.0) -> None:
        """Drop `fraction` of the unfinished iteration's progress (a failover redoes it); its
        time goes to `bucket`. 1: the iteration is replayed whole; less when the survivors
        keep their share and only the lost stage's work is redone."""
        whole = math.floor(self.iters + 1e-9)
        lost = (self.iters - whole) * fraction
        if lost <= 0 or not self.iter_s:
            return
        seconds = lost * self.iter_s
        share = self.plain_s / self.iter_s
        self.pending[0] -= seconds * share
        self.pending[1] -= seconds * (1.0 - share)
        self.buckets[bucket] += seconds
        self.iters -= lost
        if whole < self.kept_iters:
            self.kept_iters = whole

    def roll_back_to_checkpoint(self, bucket: str) -> None:
        """Everything since the last durable checkpoint is lost and redone later."""
        self.buckets[bucket] += self.pending[0] + self.pending[1]
        self.pending = [0.0, 0.0]
        self.iters = self.kept_iters
        self.run_since_ckpt = 0.0

    def checkpoint_now(self) -> None:
        """A checkpoint of the current (whole-iteration) progress, e.g. a graceful restart."""
        self.kept_iters = self.iters
        self._commit(0.0, 0.0)
        self.run_since_ckpt = 0.0

    # -- results --------------------------------------------------------------------------
    def finish(self, t: float) -> dict[str, float]:
        self.advance(t)
        self._commit(0.0, 0.0)
        return dict(self.buckets)

    @property
    def samples(self) -> float:
        return self.iters * self.samples_per_iteration

    def throughput_now(self) -> float:
        if self.iter_s is None or self.paused_until > self.t:
            return 0.0
        return self.samples_per_iteration / self.iter_s
