"""The norm gather is the commit; a node whose gather was cut short steps like the others.

The gather of the gradient norms is the last collective of an iteration: the replicas' and the
shadows' gradients are confirmed before it, and the clipping scale comes out of it. A failure
can cut one node's gather short while another node completes it (the dead node's data reached
one and not the other); the iteration is then committed (the Decision resumes after it), and
the node that missed the gather steps it from the Decision's record of the scale. Its step, and
the update of the replica it holds, must be the bits a completed gather gives.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import torch

from spotpipe.config import from_dict
from spotpipe.runtime import grads as gradlib
from spotpipe.runtime.executor import Executor, Wiring
from spotpipe.runtime.optim import build_optimizer
from spotpipe.runtime.local_link import Lease
from spotpipe.runtime.replica import ReplicaApplier, ReplicaStage, flatten_grads
from spotpipe.runtime.state import Holding, StageState


def _cfg(**optimizer):
    return from_dict({"model": {"kind": "gpt"}, "data": {"kind": "text", "path": "unused"},
                      "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": 0.5, **optimizer},
                      "stages": 2, "redundancy": "lazy"})


def _executor(cfg, module: torch.nn.Module, replica: torch.nn.Module) -> Executor:
    state = StageState(0, module, build_optimizer(module.parameters(), cfg),
                       list(module.parameters()))
    held = ReplicaStage.build(1, replica, cfg, torch.device("cpu"))
    holding = Holding(held, ReplicaApplier(held, cfg, None), owner="node1")
    comm = SimpleNamespace(generation=0, device=torch.device("cpu"),
                           abort=SimpleNamespace(check=lambda: None))
    wiring = Wiring(pipeline=0, num_stages=2, node_of_stage={0: "node0", 1: "node1"},
                    replica_holder={0: "node1"}, norm_segments=[], norm_width=0,
                    tied_partner={})
    return Executor(cfg=cfg, me="node0", stages={0: state}, wiring=wiring, comm=comm,
                    loss_fn=lambda y, t: y.sum(), loss_scale_div=1, holding=holding)


def _grads(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 3.0  # a norm well above the clip


def test_a_node_that_missed_the_gather_steps_from_the_decisions_scale():
    cfg = _cfg()
    torch.manual_seed(0)
    own, other = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)
    # the plain reference: clip_grad_norm_ over both stages, one optimizer step each
    ref_own, ref_other = copy.deepcopy(own), copy.deepcopy(other)
    _grads(ref_own, 1)
    _grads(ref_other, 2)
    params = list(ref_own.parameters()) + list(ref_other.parameters())
    torch.nn.utils.clip_grad_norm_(params, cfg.optimizer.grad_clip)
    for m in (ref_own, ref_other):
        build_optimizer(m.parameters(), cfg).step()
    # the scale a completed gather gave, as its record carries it
    unclipped_own, unclipped_other = copy.deepcopy(own), copy.deepcopy(other)
    _grads(unclipped_own, 1)
    _grads(unclipped_other, 2)
    total = gradlib.total_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad, 2.0) for m in (unclipped_own, unclipped_other)
         for p in m.parameters()]))
    scale = float(gradlib.clip_scale(total, cfg.optimizer.grad_clip))
    assert scale < 1.0  # the clipping bites

    # this node: its own gradients reduced but unclipped, the replica's gradient received
    # (confirmed before the gather), and its gather cut short
    ex = _executor(cfg, own, other)
    _grads(own, 1)
    ex._replica_recv = Lease(flatten_grads(list(unclipped_other.parameters())), None)
    ex.set_lr(0)
    ex.step(0, scale)
    ex.holding.applier.drain()
    for got, want in zip(own.parameters(), ref_own.parameters()):
        assert torch.equal(got, want)
    for got, want in zip(ex.holding.replica.module.parameters(), ref_other.parameters()):
        assert torch.equal(got, want)
    ex.holding.applier.close()


def test_a_node_that_missed_the_gather_reports_the_commit_it_adopted():
    """Stepped from the Decision's record, the iteration is committed on this node too, with
    that scale: its next report must say so, as the nodes that completed the gather do (they
    may be lost next, before a new shadow writer brings the scale to a shadow still holding
    the iteration's gradient)."""
    cfg = _cfg()
    own, other = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)
    ex = _executor(cfg, own, other)
    _grads(own, 1)
    ex._replica_recv = Lease(flatten_grads(list(other.parameters())), None)
    ex.step(0, 0.25)
    ex.holding.applier.drain()
    assert (ex.committed_through, ex.committed_clip_scale) == (0, 0.25)
    _grads(own, 3)
    ex._replica_recv = Lease(flatten_grads(list(other.parameters())), None)
    ex.step(1, "skip")
    ex.holding.applier.drain()
    assert ex.committed_through == 1 and math.isnan(ex.committed_clip_scale)
    ex.holding.applier.close()


def test_a_skipped_commit_is_skipped_by_a_node_that_missed_the_gather():
    cfg = _cfg()
    own, other = torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)
    before_own = [p.detach().clone() for p in own.parameters()]
    before_other = [p.detach().clone() for p in other.parameters()]
    ex = _executor(cfg, own, other)
    _grads(own, 1)
    _grads(other, 2)
    ex._replica_recv = Lease(flatten_grads(list(other.parameters())), None)
    ex.step(0, "skip")
    ex.holding.applier.drain()
    assert ex.stepped_through == 0
    for got, want in zip(own.parameters(), before_own):
        assert torch.equal(got, want)
    for got, want in zip(ex.holding.replica.module.parameters(), before_other):
        assert torch.equal(got, want)
    ex.holding.applier.close()



class RecordingComm:
    """The communication an executor asks for, in order; node1 answers as a peer would."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.generation, self.device = 0, torch.device("cpu")
        self.abort = SimpleNamespace(check=lambda: None)
        self.data_parallel: dict = {}

    def send_concatenated(self, parts, node, tag_, ring_slots):
        self.calls.append(f"send->{node}")

    def recv_lent(self, node, tag_):
        self.calls.append(f"recv<-{node}")
        # the peer's gradient: zeros (every parameter present, see the flags)
        return Lease(torch.tensor([0.0] * self.peer_values + [1.0] * self.peer_params), None)

    def wait(self, work):
        self.calls.append(f"wait:{work[0]}")

    def wait_all(self, works):
        self.calls.append("wait:" + ",".join(w[0] for w in works))

    def wait_sends(self):
        self.calls.append("wait_sends")

    def all_gather(self, tensor):
        self.calls.append("all_gather")
        return [tensor.clone(), torch.zeros_like(tensor)]

    def all_reduce(self, tensor):
        self.calls.append("all_reduce")


def test_the_replicas_gradients_are_confirmed_before_the_gather_that_commits():
    """The gather may be the commit only if every node holds its replica's gradient when it
    enters it; and then redundancy needs no collective of its own."""
    from spotpipe.runtime.executor import Microbatches
    from spotpipe.schedule import Instr, Op

    cfg = _cfg()
    own, other = torch.nn.Linear(6, 5), torch.nn.Linear(5, 1)
    ex = _executor(cfg, own, other)
    comm = ex.comm = RecordingComm()
    comm.peer_values = sum(p.numel() for p in other.parameters())
    comm.peer_params = len(list(other.parameters()))
    n = len(list(own.parameters()))
    ex.w.norm_segments = [(0, 0, n), (1, 0, 1)]
    ex.w.norm_width = n
    _grads(own, 1)
    stream = [Instr(Op.ALL_REDUCE, 0), Instr(Op.OPTIMIZER_STEP, 0)]
    ex.run(stream, Microbatches(inputs=[], targets=[]), 0)
    ex.holding.applier.drain()
    assert comm.calls == ["wait_sends", "send->node1", "recv<-node1", "wait_sends",
                          "all_gather"]
    assert ex.committed_through == 0 and ex.stepped_through == 0
    assert ex.holding.applier.applied == 0  # the replica took its step from the gradient
    ex.holding.applier.close()
