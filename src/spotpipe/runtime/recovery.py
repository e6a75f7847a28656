"""A node's side of a recovery's exchange: the Report it posts and the Decision it waits for.

The coordinator decides every recovery from the survivors' reports (`plan.recovery`); a node
says where it stands and carries out what it is told. These are the two ends of that exchange,
out of `Worker`, which keeps only the order of the steps: what a report holds is a function of
the executor alone, and a Decision is read from its generation's board the same way by a node
that failed, one that was placed from standby and one that joins.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from spotpipe.plan.recovery import Decision
from spotpipe.protocol import Abort, Channel, DecisionRecord, Refused, Report, keys
from spotpipe.runtime.executor import Executor
from spotpipe.runtime.metrics_post import MetricsPost
from spotpipe.runtime.reshape import Progress
from spotpipe.schedule.replay import done_from, rest_of_iteration
from spotpipe.store import board
from spotpipe.store.mailbox import Outbox, finite

COORDINATOR = "coordinator"  # the writer name of every Decision and join answer

# what a node that has committed nothing reports (a joiner whose placement failed)
_NOTHING = {"iteration": -1, "position": 0, "instruction": "", "committed_through": -1,
            "stepped_through": -1, "done": (), "clip_scale": None, "flight": -1}


def scale_to_wire(scale: float | None) -> float | str | None:
    """A clipping scale as a record carries it: NaN (a skipped step) is "skip"."""
    return "skip" if scale is not None and math.isnan(scale) else scale


def standing(ex: Executor | None, metrics: MetricsPost) -> dict[str, Any]:
    """Where this node stands, as its Report's fields: what it committed and stepped, what it
    finished of the iteration in flight (the Decision's rest of the iteration builds on it),
    and the loss it computed but did not post."""
    if ex is None:
        return dict(_NOTHING)
    unposted, loss = metrics.unposted(ex)
    return {
        "iteration": ex.iteration, "position": ex.position,
        "instruction": (str(ex.current[ex.position]) if ex.position < len(ex.current)
                        else ""),
        "committed_through": ex.committed_through, "stepped_through": ex.stepped_through,
        "done": tuple(tuple(e) for e in ex.flight.done_list()) if ex.flight is not None
        else (),
        # the committed iteration's clipping scale: a new shadow writer brings it along
        "clip_scale": scale_to_wire(ex.committed_clip_scale),
        "flight": ex.flight.iteration if ex.flight is not None else -1,
        "committed_grad_norm": ex.committed_grad_norm,
        "unposted_iteration": unposted, "unposted_loss": finite(loss)}


def report_failure(store: dist.Store, protocol: Channel, outbox: Outbox, node: str,
                   generation: int, why: Exception, *, boundary: bool, leaving: bool,
                   formed: bool, progress: Progress, replica: int | None,
                   where: dict[str, Any]) -> None:
    """Wake the generation's other nodes (unless all saw the same boundary: no one sleeps on
    a peer then) and tell the coordinator where this node stands. After a plan this node
    could not carry out (`formed` False), the report says what it misses: the coordinator
    counts it out of the layout, it joins again, and nothing it has in flight is kept; one
    that misses only its replica (`replica`: the stage whose replica it holds) keeps its
    place."""
    if not boundary:
        board.publish(store, protocol, keys.abort_board(generation),
                      Abort(generation, f"{node}: {why}"[:300]), generation)
    outbox.post(Report(
        node=node, generation=generation, boundary=boundary, **where, formed=formed,
        lacking=tuple(progress.lacking), untouched=progress.untouched, replica=replica,
        leaving=leaving,
        reason=str(why)[:300], time_s=outbox.now()))


def read_decision(store: dist.Store, protocol: Channel, generation: int, timeout_s: float,
                  refused: Callable[[Refused], None]) -> tuple[Decision, bool]:
    """The coordinator's Decision for `generation`: the first record of its board that opens
    and parses (a forged one is skipped and said through `refused`), and whether its nodes
    take the groups formed ahead for it (`DecisionRecord.prepared`)."""
    for _, opened in board.read(store, keys.decision_board(generation), protocol,
                                on_refused=lambda why, _: refused(why), timeout_s=timeout_s,
                                expect=DecisionRecord, writers={COORDINATOR}):
        record = opened.message
        assert isinstance(record, DecisionRecord)
        try:
            return Decision.from_json(record.decision), record.prepared
        except (KeyError, TypeError, ValueError) as exc:
            refused(Refused(f"a decision that does not parse: {exc}", opened.writer))
    raise AssertionError("unreachable")  # (board.read waits until a record opens)


def rest_after_takeover(decision: Decision, me: str, stream: list, owner: Callable[[int], str],
                        promoted: list[int], frc_outputs: Any, last_stage: int) -> list:
    """This node's share of the in-flight iteration still to run after a takeover: what it
    finished stays, the promoted stages are redone (FRC outputs sent, BRC), and sends its
    peers already received are left out (`spotpipe.schedule.replay`). `owner(q)`: the node
    that owns stage q of this node's pipeline in the new layout."""
    assert decision.salvage is not None
    done = {n: done_from([list(e) for e in entries])
            for n, entries in decision.salvage.items()}
    frc: dict[int, list[int]] = {}
    for stage, mb in frc_outputs:
        frc.setdefault(stage, []).append(mb)
    return rest_of_iteration(stream, done.get(me, frozenset()),
                             lambda q: done.get(owner(q), frozenset()), fresh=promoted,
                             frc_ready=frc, last_stage=last_stage)
