"""The rest of an iteration after a takeover (spotpipe.schedule.replay), checked as data.

A schedule runs in a random interleaving up to a random instant, one node dies (its messages in
flight are lost with it), its predecessor takes over, and the rest of every survivor's stream
must then run to the end without deadlock, with every receive matched, every input there before
it is used, and each stage's forward and backward of each micro-batch done exactly once over
the whole iteration.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest

from spotpipe.schedule import build_schedule, merged_schedule
from spotpipe.schedule.ir import RECV_OPS, SEND_OPS, Instr, Op
from spotpipe.schedule.replay import done_key, rest_of_iteration
from spotpipe.schedule.validate import _channel


def _run(streams: list[list[Instr]], rng: random.Random, budget: int | None, done, state):
    """Advance random unblocked actors; stop after `budget` steps (None: to the end)."""
    pcs = [0] * len(streams)
    queues: dict = defaultdict(deque)
    steps = 0
    while budget is None or steps < budget:
        ready = []
        for a, stream in enumerate(streams):
            if pcs[a] < len(stream):
                ins = stream[pcs[a]]
                if ins.op not in RECV_OPS or queues[_channel(ins)]:
                    ready.append(a)
        if not ready:
            stuck = {a: str(s[pcs[a]]) for a, s in enumerate(streams) if pcs[a] < len(s)}
            assert not stuck, f"deadlock: {stuck}"
            return pcs
        a = rng.choice(ready)
        ins = streams[a][pcs[a]]
        state(a, ins)
        if ins.op in RECV_OPS:
            got = queues[_channel(ins)].popleft()
            assert got == ins.mb, f"{ins} matched micro-batch {got}"
        elif ins.op in SEND_OPS:
            queues[_channel(ins)].append(ins.mb)
        if ins.op.value in ("forward", "backward", "recv_act", "recv_grad"):
            done[a].add(done_key(ins))
        pcs[a] += 1
        steps += 1
    return pcs


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_rest_of_iteration_completes_exactly_once(kind, p):
    m = 4
    rng = random.Random(f"{kind}{p}")
    base = build_schedule(kind, p, m)
    total = sum(len(s) for s in base.streams)
    for trial in range(60):
        lost = rng.randrange(p)
        cut = rng.randrange(total)
        done: dict[int, set] = defaultdict(set)
        _run([list(s) for s in base.streams], rng, cut, done, lambda a, ins: None)
        heir = (lost - 1) % p
        owners = [sorted({a, lost}) if a == heir else [a] for a in range(p) if a != lost]
        merged = merged_schedule(kind, m, owners)
        actor_of = {s: i for i, own in enumerate(merged.owners) for s in own}
        node_of_actor = [own[0] if len(own) == 1 else heir for own in merged.owners]
        # the heir's FRC produced the lost stage's outputs for micro-batches whose input it had
        frc = {mb for mb in range(m) if lost == 0 or ("forward", heir, mb) in done[heir]}
        rests = []
        for i, stream in enumerate(merged.streams):
            node = node_of_actor[i]
            rests.append(rest_of_iteration(
                stream, frozenset(done[node]),
                lambda q: frozenset(done[node_of_actor[actor_of[q]]]) if q != lost else frozenset(),
                fresh=[lost] if node == heir else [],
                frc_ready={lost: frc} if node == heir else None, last_stage=p - 1))
        # what the rest does, per stage, on top of what the survivors kept
        def kept(kind):
            return defaultdict(list, {q: sorted(mb for (op, s, mb) in done[q]
                                                if op == kind and s == q)
                                      for q in range(p) if q != lost})

        fwd, bwd = kept("forward"), kept("backward")
        have = defaultdict(set, {q: set(done[q]) for q in range(p) if q != lost})

        def state(actor, ins):
            s, mb = ins.stage, ins.mb
            held = have[s]
            if ins.op == Op.FORWARD:
                assert s == 0 or ("recv_act", s, mb) in held, f"{ins} before its input"
                fwd[s].append(mb)
                held.add(("forward", s, mb))
            elif ins.op in (Op.BACKWARD, Op.BRC_BACKWARD):
                if ins.op == Op.BRC_BACKWARD:
                    assert s == 0 or ("recv_act", s, mb) in held, f"{ins} before its input"
                    fwd[s].append(mb)
                    held.add(("forward", s, mb))
                assert ("forward", s, mb) in held, f"{ins} before its forward"
                assert s == p - 1 or ("recv_grad", s, mb) in held, f"{ins} before its gradient"
                bwd[s].append(mb)
                held.add(("backward", s, mb))
            elif ins.op == Op.SEND_ACT:
                assert ("forward", s, mb) in held or (s == lost and mb in frc), \
                    f"{ins} before its forward"
            elif ins.op == Op.SEND_GRAD:
                assert ("backward", s, mb) in held, f"{ins} before its backward"
            elif ins.op in RECV_OPS:
                held.add(done_key(ins))

        _run(rests, rng, None, defaultdict(set), state)
        for q in range(p):
            assert sorted(fwd[q]) == list(range(m)), (trial, q, "forwards", fwd[q])
            assert sorted(bwd[q]) == list(range(m)), (trial, q, "backwards", bwd[q])
            # gradient accumulation order, and with it the bits, is that of the plain loop
            assert bwd[q] == sorted(bwd[q]), (trial, q, bwd[q])


def test_the_rest_sends_frc_outputs_and_runs_brc():
    """A failure at the end of the forwards: the heir sends its FRC outputs at once, backward
    of the lost stage is BRC, and nothing the survivors did is repeated."""
    p, m = 3, 2
    base = build_schedule("gpipe", p, m)
    done = {a: {done_key(i) for i in s if i.op in (Op.FORWARD, Op.RECV_ACT)}
            for a, s in enumerate(base.streams)}
    merged = merged_schedule("gpipe", m, [[0, 1], [2]])
    rest = rest_of_iteration(merged.streams[0], frozenset(done[0]),
                             lambda q: frozenset(done[2]) if q == 2 else frozenset(),
                             fresh=[1], frc_ready={1: [0, 1]}, last_stage=2)
    ops = [str(i) for i in rest]
    assert "forward s0 m0" not in ops and "forward s1 m0" not in ops
    assert "send_act s1 m0 ->2" not in ops  # stage 2 received it before the failure
    assert ops.count("brc_backward s1 m0") == 1 and ops.count("brc_backward s1 m1") == 1
    assert ops[-2:] == ["all_reduce s0", "optimizer_step s0"]
    succ = rest_of_iteration(merged.streams[1], frozenset(done[2]),
                             lambda q: frozenset(), last_stage=2)
    assert [str(i) for i in succ][:3] == ["backward s2 m0", "send_grad s2 m0 ->1",
                                          "backward s2 m1"]
