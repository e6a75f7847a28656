"""Which stages of each checkpoint's iteration are on disk, until every one is.

Each stage's owner writes its files and reports them with their hashes (`CheckpointSaved`),
and the coordinator commits the iteration once every stage of it is reported, never when one
of them could not be written (the previous checkpoint stays the newest). That is bookkeeping
with no process to talk to, so it is kept here, apart from the loop that reads the reports and
the committer that writes the manifest; it goes into the coordinator's books (`to_json`), so
that a successor commits a checkpoint whose stages were reported partly to its predecessor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spotpipe.checkpoint.transfer import outside

Checksums = dict[str, str]  # a file's path in the checkpoint -> its SHA-256
Partition = tuple[tuple[int, int], ...]  # the layer ranges of the stages
# the worker schemes (`checkpoint.scheme`) that write the durable tier; the shadows, which
# write it too, name no scheme in their events
DURABLE_SCHEMES = ("durable", "dcp_async")
# the layouts whose checkpoint writers are remembered (`CheckpointParts.writers`): a report
# that comes that many plans after its iteration's is refused (its writer is unknown)
KEPT_LAYOUTS = 8


def durable_tier(event: dict[str, Any]) -> bool:
    """Whether a checkpoint event is about the durable tier, the checkpoint committed here. A
    baseline scheme's (torch_save, checkfreq) writes files of its own: its failure says nothing
    of the shadows' checkpoint of the same iteration, which must still be committed."""
    return event.get("scheme") in (None, *DURABLE_SCHEMES)


@dataclass
class CheckpointParts:
    """The stages reported of each iteration not yet committed, the partition they were
    written under, and the iterations that will never be (one of their stages could not be
    written)."""

    parts: dict[int, dict[int, Checksums]] = field(default_factory=dict)  # iteration -> stage
    partitions: dict[int, Partition] = field(default_factory=dict)  # iteration -> its cut
    failed: set[int] = field(default_factory=set)  # a stage could not be written: never committed
    # the layouts the job ran, oldest first, each as (the first iteration it ran, the node
    # that owned each stage of pipeline 0, the one whose checkpoint reports count); the newest
    # KEPT_LAYOUTS, so that what is kept is bounded however many plans the job makes
    writers: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)

    def ran(self, first: int, owners: tuple[str, ...]) -> None:
        """The stages of pipeline 0 are owned by `owners` from iteration `first` on. A plan
        that resumes at or before where a layout kept here began (a roll back) replaces it:
        the iterations it ran from there on are run again, and their reports are the new
        owners' to give."""
        if self.writers and self.writers[-1] == (first, owners):
            return
        kept = [w for w in self.writers if w[0] < first]
        self.writers = kept[-(KEPT_LAYOUTS - 1):] + [(first, owners)]

    def writer_of(self, iteration: int, stage: int) -> str | None:
        """The node whose report of `stage` of `iteration` counts: the owner of that stage
        in the layout that ran the iteration; None where no layout kept here did (one too
        old, or a stage number past its depth)."""
        for first, owners in reversed(self.writers):
            if first <= iteration:
                return owners[stage] if 0 <= stage < len(owners) else None
        return None

    def saved(self, iteration: int, stage: int, checksums: Checksums,
              partition: Partition) -> Checksums | None:
        """Stage `stage` of `iteration`, one of `partition`'s, is on disk; once the last of
        them is, every stage's checksums, to commit (the iteration is then forgotten here).
        None before, and for an iteration that failed. The partition is the one its writers
        ran the iteration with: not the job's when the report comes, which a re-partition
        may have changed meanwhile. A stage number that is not one of the partition's is
        refused (counted, it would complete a checkpoint that lacks a stage), and so is a
        stage that reports a file outside its own folder (another stage's, the manifest's
        place, one out of the checkpoint): the commit would list it as that stage's."""
        if iteration in self.failed:
            return None
        if not 0 <= stage < len(partition):  # (counted, it completed a checkpoint lacking one)
            raise ValueError(f"checkpoint of iteration {iteration}: stage {stage} is not a "
                             f"stage of the partition it was written under, {list(partition)}")
        astray = sorted(name for name in checksums if outside(name, f"stage{stage}"))
        if astray:
            raise ValueError(f"checkpoint of iteration {iteration}: stage {stage} reported a "
                             f"file outside its folder stage{stage}/: {astray[0][:200]!r}")
        known = self.partitions.setdefault(iteration, partition)
        if known != partition:  # (one iteration runs with one partition: not a real case)
            raise ValueError(f"checkpoint of iteration {iteration}: stage {stage} was written "
                             f"under partition {list(partition)}, the stages before it under "
                             f"{list(known)}")
        parts = self.parts.setdefault(iteration, {})
        parts[stage] = dict(checksums)
        if len(parts) < len(partition):
            return None
        del self.parts[iteration], self.partitions[iteration]
        return {k: v for stage_sums in parts.values() for k, v in stage_sums.items()}

    def fail(self, iteration: int) -> None:
        """A stage of `iteration` could not be written: the iteration is never committed."""
        self.failed.add(iteration)
        self.parts.pop(iteration, None)
        self.partitions.pop(iteration, None)

    def to_json(self) -> dict[str, Any]:
        return {"parts": {str(t): {str(s): c for s, c in stages.items()}
                          for t, stages in self.parts.items()},
                "partitions": {str(t): [list(r) for r in p] for t, p in self.partitions.items()},
                "failed": sorted(self.failed),
                "writers": [[first, list(owners)] for first, owners in self.writers]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointParts:
        return cls({int(t): {int(s): dict(c) for s, c in stages.items()}
                    for t, stages in data.get("parts", {}).items()},
                   {int(t): tuple((int(a), int(b)) for a, b in p)
                    for t, p in data.get("partitions", {}).items()},
                   {int(t) for t in data.get("failed", [])},
                   [(int(first), tuple(str(n) for n in owners))
                    for first, owners in data.get("writers", [])])
