"""Durable checkpoints as they reach the coordinator, from the first stage's report to the
commit: the stages reported per iteration (`CheckpointParts`), the stages that hosts which do
not see the checkpoint folder send through the store (`checkpoint.transfer`, received on the
committer's threads), and each iteration committed off the loop once whole (`Committer`),
said in the run's events.

The coordinator's loop hands it the workers' checkpoint records and gives it a turn each pass;
nothing else in the loop needs to know where a checkpoint stands. Its reports' bookkeeping
goes into the coordinator's books (`parts`), so that a successor commits a checkpoint whose
stages were reported partly to its predecessor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from spotpipe import job
from spotpipe.checkpoint import durable, transfer
from spotpipe.cluster.checkpoint_parts import KEPT_LAYOUTS, CheckpointParts
from spotpipe.cluster.committer import Committed, Committer
from spotpipe.config import Config
from spotpipe.plan import Layout
from spotpipe.protocol import CheckpointSaved, StageUpload
from spotpipe.store.sealed import SealedStore

Emit = Callable[[dict[str, Any]], None]


def uploads_at_once(stages: int) -> int:
    """The most stage uploads that can be under way together in a job of `stages` stages
    (the configured depth, which a re-partition never exceeds): one per stage of each layout
    whose checkpoint reports still count (`refusal`, KEPT_LAYOUTS), since only a stage's
    owner uploads it, and a worker's next checkpoint waits for its previous upload."""
    return KEPT_LAYOUTS * stages


class CheckpointIntake:
    """One per coordinator's loop, over the job's checkpoint folder `root`."""

    def __init__(self, cfg: Config, spec: job.RunSpec, root: Path, key: bytes | None,
                 now: Callable[[], float], emit: Emit) -> None:
        self.cfg, self.spec, self.root = cfg, spec, root
        self._now, self._emit = now, emit
        self.parts = CheckpointParts()  # stages on disk of checkpoints not committed
        self.committer = Committer(root, cfg.checkpoint.keep, key, now,
                                   uploads_at_once=uploads_at_once(cfg.stages))
        self.receiving = transfer.Receiving()  # uploads the committer's threads take
        self._here: SealedStore | None = None
        self._connect: Callable[[], SealedStore] | None = None

    def open(self, here: SealedStore, connect: Callable[[], SealedStore]) -> None:
        """The store, once the loop has it: `here`, the loop's own connection (a stop put for
        a lost sender's receive), and `connect`, a connection of its own for each receive."""
        self._here, self._connect = here, connect

    def ran(self, first: int, layout: Layout) -> None:
        """`layout` runs the job from iteration `first` on: its pipeline 0's owners write the
        checkpoints of those iterations (the loop says so after each turn that can plan)."""
        self.parts.ran(first, tuple(layout.owner(0, s) for s in range(layout.num_stages)))

    def refusal(self, message: CheckpointSaved | StageUpload, writer: str) -> str:
        """Why a stage's report or upload is not to be counted ("" when it is): it must come
        from the node it names (`writer`, who sealed it), and that node must have written
        the stage: its owner in pipeline 0 of the layout that ran the iteration, or the
        stage's shadow (shadows keep the launch partition). Another node's report would
        complete a checkpoint with files its writer never vouched for, and a receive started
        for it would write over the owner's stage folder, and be ended by that node's loss,
        not by its sender's."""
        kind, node, t, stage = message.TYPE, message.node, message.iteration, message.stage
        if writer != node:
            return f"a {kind} in the name of {node}"
        if node == f"shadow{stage}":
            return ""
        owner = self.parts.writer_of(t, stage)
        if owner == node:
            return ""
        return (f"a {kind} of stage {stage} of iteration {t}, which "
                + (f"{owner} wrote" if owner is not None else "no layout kept here ran"))

    def saved(self, message: CheckpointSaved) -> None:
        """Commit a checkpoint once every stage of its iteration is on disk (single writer).
        A stage uploaded by a host that does not see this folder was taken by the committer
        before this report came (`upload`)."""
        t = message.iteration
        partition = message.partition
        try:
            checksums = self.parts.saved(t, message.stage, message.checksums, partition)
        except ValueError as exc:  # (never committed: the previous checkpoint stays newest)
            self.parts.fail(t)
            self._emit({"time_s": self._now(), "kind": "checkpoint_failed", "node": "launcher",
                        "iteration": t, "message": str(exc)})
            return
        if checksums is None:
            return
        cfg = self.cfg
        info = {"partition": [list(r) for r in partition], "stages": len(partition),
                "pipelines": cfg.pipelines, "config_digest": cfg.digest(),
                "model_digest": cfg.model_digest(), "num_samples": self.spec.num_samples,
                "global_batch": cfg.global_batch, "seed": cfg.seed}
        self.committer.submit(t, info, checksums)  # (committed off the loop: committer.py)

    def upload(self, message: StageUpload) -> None:
        """A host that does not see this checkpoint folder sends a stage through the store:
        the committer takes its pieces as they come (transfer.py), even for an iteration that
        failed meanwhile, since the sender waits for each piece to be taken."""
        assert self._connect is not None, "open() first"
        t, connect = message.iteration, self._connect
        folder = durable.iter_dir(self.root, t, partial=True)
        self.committer.submit_step(t, lambda: transfer.receive_stage(
            connect(), t, message.stage, message.checksums, folder,
            timeout_s=self.cfg.cluster.timeout_s, node=message.node,
            receiving=self.receiving))

    def failed(self, iteration: int) -> None:
        """A stage of `iteration` could not be written: it is never committed."""
        self.parts.fail(iteration)

    def turn(self, dead: Iterable[str]) -> None:
        """A pass of the loop: end the receives waiting on a node counted gone, and say what
        got committed since."""
        if self._here is not None:
            for node in dead:  # (`lose` acts once per node)
                self.receiving.lose(node, self._here)
        self.committed()

    def committed(self) -> None:
        """Say what got committed since the last turn."""
        self.record(self.committer.finished())

    def idle(self) -> bool:
        """Nothing being received or committed: only the store's books hold this intake."""
        return self.committer.idle()

    def end(self, abandon: bool) -> None:
        """The loop is leaving: finish what was submitted (or, `abandon`, a deposed
        coordinator's successor does), and say so."""
        self.record(self.committer.abandon() if abandon else self.committer.close())

    def record(self, done: list[Committed]) -> None:
        for c in done:
            if c.path is None:  # the disk is full or failing: the previous one stays newest
                self._emit({"time_s": c.time_s, "kind": "checkpoint_failed",
                            "node": "launcher", "iteration": c.iteration,
                            "message": c.error})
            else:
                self._emit({"time_s": c.time_s, "kind": "checkpoint_committed",
                            "node": "launcher", "iteration": c.iteration,
                            "path": str(c.path),
                            # (commits are behind: this one left its retention to these)
                            **({"retention_left_to": list(c.retention_left_to)}
                               if c.retention_left_to else {})})
