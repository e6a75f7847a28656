"""The rest of an iteration after a takeover: what each node still has to do.

Bamboo's point is that a failure costs only the lost node's share of the in-flight iteration.
The survivors keep what they did (forwards, backwards, received tensors, accumulated
gradients); the node that promoted its replica of the lost stage redoes that stage's work:
outputs that forward redundant computation (FRC) already produced are sent on at once, and the
stage's backward runs as backward redundant computation (BRC: the forward recomputed with
autograd from the kept input, then the backward); the successor re-sends the input gradients
it kept; the reduction and the optimizer step then run once, as in any iteration.

Everything here is a pure function of the new layout's streams and of what each node reports
it has done (`Done`), so every node derives the same rest and the pieces fit: a send is
skipped exactly when its receiver already holds the message, so sends and receives stay
paired, and the filtered streams are a sub-order of a deadlock-free execution.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from spotpipe.schedule.ir import Instr, Op

# (op, stage, micro-batch) of the work a node finished in the in-flight iteration
Done = frozenset[tuple[str, int, int]]

# what survives a failure: compute and receipts (a send's fate is known only to its receiver)
KEPT_OPS = frozenset({Op.FORWARD, Op.BACKWARD, Op.RECV_ACT, Op.RECV_GRAD})

_RECEIPT = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD}


def done_key(ins: Instr) -> tuple[str, int, int]:
    return (ins.op.value, ins.stage, ins.mb)


def done_from(entries: Iterable[Sequence]) -> Done:
    """A node's report (JSON lists) as a Done set."""
    return frozenset((str(op), int(stage), int(mb)) for op, stage, mb in entries)


def rest_of_iteration(stream: Sequence[Instr], mine: Done,
                      done_of_stage: Callable[[int], Done], fresh: Iterable[int] = (),
                      frc_ready: Mapping[int, Iterable[int]] | None = None,
                      last_stage: int = -1) -> list[Instr]:
    """This node's instructions still to run in the in-flight iteration.

    `stream` is the node's stream in the new layout, `mine` what this node finished,
    `done_of_stage(q)` what the node that now owns stage q (of this pipeline) finished,
    `fresh` the stages this node took over (it did none of their work), `frc_ready[f]` the
    micro-batches of fresh stage f whose FRC outputs this node holds. FRC of the new replicas
    is left out: a second failure within the rest recomputes instead.
    """
    fresh = set(fresh)
    frc = {f: set(mbs) for f, mbs in (frc_ready or {}).items() if f in fresh and f != last_stage}
    out: list[Instr] = []
    for ins in stream:
        if ins.op in (Op.FRC_FORWARD, Op.BRC_BACKWARD):
            continue
        if ins.op in _RECEIPT:  # sent already iff the receiver holds it
            receipt = (_RECEIPT[ins.op].value, ins.peer, ins.mb)
            if receipt not in done_of_stage(ins.peer):
                out.append(ins)
            continue
        if ins.stage not in fresh and done_key(ins) in mine:
            continue
        if ins.stage in frc and ins.mb in frc[ins.stage]:
            if ins.op == Op.FORWARD:
                continue  # the FRC output is sent instead; BRC recomputes it with autograd
            if ins.op == Op.BACKWARD:
                out.append(Instr(Op.BRC_BACKWARD, ins.stage, ins.mb))
                continue
        out.append(ins)
    return out
