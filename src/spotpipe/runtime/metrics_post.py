"""An iteration's metrics line, as a node's last stage posts it.

The last stage of every pipeline holds its pipeline's share of the loss; they are all-reduced
over the pipelines, and pipeline 0's last stage posts the iteration's `Metrics` record, which
the job loop writes to metrics.jsonl.

This is its own piece because of what a failure can do to it: the posting can be cut short
after the iteration was committed elsewhere (this node in its norm gather when a peer that
completed it goes; a pipeline peer lost in the loss's all-reduce; this node lost between its
commit and its post). Then nothing else holds the loss: the node's failure report carries
what it computed and did not post (`MetricsPost.unposted`), and the coordinator writes the
line from the reports (`cluster.recovered_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

from spotpipe.config import Config
from spotpipe.protocol import Metrics
from spotpipe.runtime.comm import Comm
from spotpipe.runtime.executor import Executor, IterationResult
from spotpipe.runtime.state import NodeState
from spotpipe.store.mailbox import Outbox, finite


class MetricsPost:
    """Posts a node's iterations' metrics, and remembers the loss of one whose posting a
    failure cut short until the failure is reported."""

    def __init__(self, cfg: Config, state: NodeState, outbox: Outbox) -> None:
        self.cfg = cfg
        self.state = state
        self.outbox = outbox
        # (iteration, this pipeline's loss) while `post` posts it
        self._posting: tuple[int, float] | None = None

    def post(self, t: int, result: IterationResult, lr: float, dt: float, comm: Comm,
             replica_lag: Callable[[int], int] | None) -> None:
        """Iteration `t`'s part of this node in its metrics: nothing unless it owns a last
        stage; the all-reduce of the loss; and the record, from pipeline 0's last stage."""
        st = self.state
        p = st.layout.num_stages
        if p - 1 not in st.stages:
            return
        loss = result.loss_sum
        assert loss is not None  # (a last stage's result carries its loss)
        # (read before the all-reduce: on a GPU a read after one cut short could block)
        self._posting = (t, float(loss))
        comm.all_reduce_dp(p - 1, loss)
        if st.layout.owner(0, p - 1) != st.node:
            self._posting = None  # (its share is in pipeline 0's record)
            return
        cfg = self.cfg
        if result.skipped_stage is not None:  # one node says it; every node skipped alike
            self.outbox.event("step_skipped", iteration=t, stage=result.skipped_stage,
                              grad_norm=result.grad_norm, loss=float(loss))
        self.outbox.post(Metrics(
            iter=t, loss=finite(float(loss)), samples=(t + 1) * cfg.global_batch,
            time_s=self.outbox.now(), iter_time_s=round(dt, 6),
            samples_per_s=round(cfg.global_batch / dt, 3), lr=lr,
            grad_norm=finite(float(result.grad_norm)),
            live_nodes=len(st.layout.active_nodes), carriers=len(st.layout.carriers()),
            generation=st.generation, standby=len(st.layout.standby),
            replica_lag=replica_lag(t) if replica_lag is not None else None))
        self._posting = None

    def unposted(self, executor: Executor | None) -> tuple[int, float | None]:
        """The newest iteration whose loss this node computed whole (a last stage's owner)
        and did not post, with its pipeline's share ((-1, None): none): the one whose posting
        a failure cut short, or else the one in flight once every micro-batch has gone
        through this node's last stage."""
        if self._posting is not None:
            return self._posting
        last = self.state.layout.num_stages - 1
        if executor is None or executor.flight is None or last not in self.state.stages:
            return -1, None
        loss = executor.flight.whole_loss(last)
        return (-1, None) if loss is None else (executor.flight.iteration, loss)

    def reported(self) -> None:
        """The failure was reported: the coordinator has what this node could tell of it."""
        self._posting = None
