"""Stage and replica moves between nodes (`runtime.migrate.run`), over real gloo groups of
nodes that are threads of this process: what arrives is the sender's state, bit for bit."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from spotpipe.plan.transfers import Transfer
from spotpipe.runtime import migrate


class _Comm:
    """The part of a generation's `Comm` that state moves use, on a gloo group of threads."""

    def __init__(self, store: dist.Store, nodes: list[str], me: str) -> None:
        self.nodes, self.me, self.device = nodes, me, torch.device("cpu")
        self.store = store
        self.world = dist.ProcessGroupGloo(dist.PrefixStore("world", store), nodes.index(me),
                                           len(nodes), timedelta(seconds=30))

    def post_send(self, tensor, node, tag_):
        return self.world.send([tensor], self.nodes.index(node), tag_)

    def post_recv(self, tensor, node, tag_):
        return self.world.recv([tensor], self.nodes.index(node), tag_)

    def wait(self, work) -> None:
        work.wait()

    def wait_keys(self, keys, timeout_s, what) -> None:
        self.store.wait(keys, timedelta(seconds=timeout_s))

    @contextlib.contextmanager
    def waiting_on_peer(self):
        yield


def _as_nodes(nodes: list[str], part) -> dict[str, object]:
    """Run `part(comm, node)` on a thread per node; what each returned or raised, by node."""
    store, out = dist.HashStore(), {}

    def node(me: str) -> None:
        try:
            out[me] = part(_Comm(store, nodes, me), me)
        except Exception as exc:  # (the test looks at it)
            out[me] = exc

    threads = [threading.Thread(target=node, args=(n,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a node did not finish"
    return out


def _stage(dtypes: list[torch.dtype], trained: bool):
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(3, 3).to(d) for d in dtypes])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=False)
    if trained:
        for _ in range(2):
            for p in module.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
        for p in module.parameters():
            optimizer.state[p]["step"].fill_(257.0)  # (not a bf16 number)
    return module, optimizer


@pytest.mark.parametrize("dtypes", [[torch.bfloat16], [torch.bfloat16, torch.float32]],
                         ids=["bf16", "bf16+fp32"])
def test_stage_moves_keep_every_dtype_bit_for_bit(dtypes, monkeypatch):
    """A stage sent to two nodes (an owned copy, a replica) and kept locally as a replica
    arrives as the sender's bits, whatever its dtypes. Before, a stage travelled as one
    tensor in its first parameter's dtype into a float32 buffer: bf16 parameters arrived as
    whatever the buffer held (gloo fills a longer buffer from a shorter message silently),
    and every other tensor was rounded to bf16 (AdamW's step 257 became 256). The sender
    packs the stage once for both messages (it held a flat copy per transfer, the local one
    included, until every send was done)."""
    packs = []
    pack = migrate._pack
    monkeypatch.setattr(migrate, "_pack", lambda *a: packs.append(1) or pack(*a))
    source = _stage(dtypes, trained=True)
    plan = [Transfer("stage", 1, "a", "b"), Transfer("replica", 1, "a", "c"),
            Transfer("replica", 1, "a", "a")]

    def part(comm, me):
        have = {("stage", 1): source} if me == "a" else {}
        return migrate.run(plan, me, comm, have, lambda stage: _stage(dtypes, trained=False))

    got = _as_nodes(["a", "b", "c"], part)
    module, optimizer = source
    for node, key in (("b", ("stage", 1)), ("c", ("replica", 1)), ("a", ("replica", 1))):
        assert not isinstance(got[node], Exception), got[node]
        copy, copy_optimizer = got[node][key]
        for p, q in zip(module.parameters(), copy.parameters()):
            assert q.dtype == p.dtype and torch.equal(q, p), node
            state, copied = optimizer.state[p], copy_optimizer.state[q]
            assert sorted(copied) == sorted(state)
            for k in state:
                assert copied[k].dtype == state[k].dtype and torch.equal(copied[k], state[k])
    nbytes = sum(t.numel() * t.element_size() for t in migrate.stage_tensors(*source))
    assert got["b"][("bytes", -1)] == got["c"][("bytes", -1)] == nbytes
    assert got["a"][("bytes", -1)] == 0
    assert len(packs) == 1


@pytest.mark.parametrize("theirs,mine", [((3, 3), (3, 4)), ((2, 6), (3, 4))],
                         ids=["larger", "same-size-other-shape"])
def test_a_stage_built_otherwise_is_refused_naming_its_sender(theirs, mine):
    """A receiver whose stage differs from what its sender holds stops with an error that
    names the sender and the stage, and loads nothing (before: a shorter message filled part
    of its buffer silently, a longer one aborted the process in gloo, one of the same size
    was reshaped into the receiver's tensors)."""
    def build(shape: tuple[int, int]):
        module = torch.nn.Sequential(torch.nn.Linear(*shape, bias=False))
        return module, torch.optim.AdamW(module.parameters(), foreach=False)

    source = build(theirs)
    plan = [Transfer("replica", 2, "a", "b")]

    def part(comm, me):
        if me == "a":
            return migrate.run(plan, me, comm, {("stage", 2): source}, lambda s: build(theirs))
        try:
            return migrate.run(plan, me, comm, {}, lambda s: build(mine))
        finally:  # take the stage's bytes that the sender posted, so that its send completes
            comm.wait(comm.post_recv(torch.empty(1 << 12, dtype=torch.uint8), "a",
                                     migrate.tag(migrate.REPLICA_COPY, 2)))

    got = _as_nodes(["a", "b"], part)
    assert isinstance(got["b"], RuntimeError)
    assert "stage 2 from a" in str(got["b"]) and "built the stage differently" in str(got["b"])


def test_a_layer_of_another_shape_is_refused_naming_its_sender():
    """A re-partition's layer that does not fit the stage its receiver built stops the
    receiver with an error naming the layer and the node that sent it (it named only the
    parameter); the mismatched parameter is left as it was built."""
    from types import SimpleNamespace

    from spotpipe.plan import LayerMove

    def stage(width: int):
        module = torch.nn.Sequential(torch.nn.Linear(2, width))
        return module, torch.optim.AdamW(module.parameters(), foreach=False)

    model = SimpleNamespace(layers=[torch.nn.Linear(2, 2)])
    held, built = stage(2), stage(3)
    kept = built[0][0].weight.detach().clone()

    def part(comm, me):
        have = migrate.state_index([held] if me == "a" else [])
        want = migrate.state_index([built] if me == "b" else [])
        return migrate.exchange_layers([LayerMove(0, "a", "b")], me, comm, comm.store, "x",
                                       model, have, want, timeout_s=30)

    got = _as_nodes(["a", "b"], part)
    assert got["a"] == 0
    assert isinstance(got["b"], RuntimeError)
    assert "layer 0 from a" in str(got["b"]) and "0.weight" in str(got["b"])
    assert torch.equal(built[0][0].weight, kept)


def _stepped_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, foreach=False)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def _devices(optimizer: torch.optim.Optimizer) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            out.setdefault(key, set()).add(value.device.type)
    return out


def test_optimizer_state_follows_its_parameters_to_another_device():
    """`module.to` moves parameters, not the optimizer's state: a CPU replica promoted onto a
    GPU kept its moments on the CPU, and its first step as an owner would fail. (The meta
    device stands in for a GPU here: what matters is where each tensor ends up.) AdamW's step
    count stays on the CPU, as torch keeps it, unless the group is fused."""
    from spotpipe.runtime.optim import follow_parameters

    # as `module.to("cuda")` leaves them: the same parameters on the device, the state not
    # (`.to("meta")` would make new parameters: meta and CPU tensors do not swap their data)
    module = torch.nn.Linear(3, 2, device="meta")
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    for p in module.parameters():
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(p.shape),
                              "exp_avg_sq": torch.zeros(p.shape)}
    follow_parameters(optimizer)
    assert _devices(optimizer) == {"step": {"cpu"}, "exp_avg": {"meta"},
                                   "exp_avg_sq": {"meta"}}
    optimizer.param_groups[0]["fused"] = True
    follow_parameters(optimizer)
    assert _devices(optimizer)["step"] == {"meta"}


def test_a_layer_installed_on_another_device_keeps_its_step_count_on_the_cpu():
    """A re-partition installs a CPU replica's layer into a GPU stage: its step count went
    beside the parameter (the sender kept it beside its own, on the CPU), and each step of
    the stage then waited on the device to read it."""
    sent, sent_optimizer = _stepped_adamw()
    name = "0.weight"
    have = {name: (sent.weight, sent_optimizer)}
    meta, flat = migrate.pack_layers([name], have, torch.device("cpu"))
    value, state = migrate.unpack_layers(meta, flat)[name]
    target = torch.nn.Linear(3, 2, device="meta")
    target_optimizer = torch.optim.AdamW(target.parameters(), lr=0.1)
    migrate.install(name, value, state, {name: (target.weight, target_optimizer)})
    placed = target_optimizer.state[target.weight]
    assert placed["step"].device.type == "cpu"
    assert placed["exp_avg"].device.type == placed["exp_avg_sq"].device.type == "meta"


class _Blocking:
    """A transport whose send returns only once its receiver has taken the message, as
    NCCL's point-to-point operations on one stream do for large messages (gloo's sends
    never wait): a cycle of sends that wait on each other's receives hangs here too."""

    def __init__(self, nodes: list[str], me: str, mailboxes: dict,
                 timeout_s: float = 10.0) -> None:
        self.nodes, self.me, self.device = nodes, me, torch.device("cpu")
        self._boxes = mailboxes  # (src, dst, tag) -> a queue of (tensor, taken event)
        self._timeout_s = timeout_s

    def _box(self, src: str, dst: str, tag_: int):
        import queue

        return self._boxes.setdefault((src, dst, tag_), queue.Queue())

    def post_send(self, tensor, node, tag_):
        taken = threading.Event()
        self._box(self.me, node, tag_).put((tensor, taken))
        if not taken.wait(self._timeout_s):
            raise TimeoutError(f"{self.me}: its send to {node} was never taken")
        return None

    def post_recv(self, tensor, node, tag_):
        sent, taken = self._box(node, self.me, tag_).get(timeout=self._timeout_s)
        tensor.copy_(sent)
        taken.set()
        return None

    def wait(self, work) -> None:
        pass


def _on_blocking(nodes: list[str], running: list[str], plan: list[Transfer], have,
                 arrived=None, timeout_s: float = 10.0) -> dict[str, object]:
    """`migrate.run(plan)` on a thread per node of `running` (the others never take part),
    over `_Blocking`; what each returned or raised, by node. `have(me)`: its states."""
    boxes: dict = {}
    out: dict[str, object] = {}

    def node(me: str) -> None:
        comm = _Blocking(nodes, me, boxes, timeout_s=timeout_s)
        try:
            out[me] = migrate.run(plan, me, comm, have(me),
                                  lambda stage: _stage([torch.float32], trained=False), arrived)
        except Exception as exc:  # (the test looks at it)
            out[me] = exc

    threads = [threading.Thread(target=node, args=(n,), daemon=True) for n in running]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_two_nodes_that_send_each_other_a_stage_do_not_wait_on_each_other():
    """a sends b a stage while b sends a a replica (crossing moves of one plan): every send
    posted before any receive hung both on a transport whose sends wait to be taken (NCCL);
    the pairs now go in one order, the lower rank of each sending first."""
    source = _stage([torch.float32], trained=True)
    plan = [Transfer("stage", 0, "a", "b"), Transfer("replica", 1, "b", "a")]
    out = _on_blocking(["a", "b"], ["a", "b"], plan, lambda me: {
        ("stage", 0 if me == "a" else 1): source})
    assert not any(isinstance(v, Exception) for v in out.values()), out
    got_b, got_a = out["b"][("stage", 0)], out["a"][("replica", 1)]
    for copy in (got_b, got_a):
        assert all(torch.equal(p, q) for p, q in zip(copy[0].parameters(),
                                                     source[0].parameters()))


def test_a_receiver_holds_its_stage_before_it_waits_on_a_replicas_sender():
    """r is to receive the replica of stage 1 from x (the lower rank, so the first pair) and
    stage 0 from y; x never sends (hung, or lost). r receives stage 0 first all the same,
    then gives up on x: a failure there costs it the replica, not the stage it runs
    (`runtime.reshape` keeps what arrived; before, r waited on x first and lacked both)."""
    source = _stage([torch.float32], trained=True)
    plan = [Transfer("replica", 1, "x", "r"), Transfer("stage", 0, "y", "r")]
    arrived: list[tuple[str, int]] = []
    out = _on_blocking(["x", "y", "r"], ["y", "r"], plan,
                       lambda me: {("stage", 0): source} if me == "y" else {},
                       arrived=lambda kind, stage, _: arrived.append((kind, stage)),
                       timeout_s=1.0)
    assert not isinstance(out["y"], Exception), out["y"]
    assert isinstance(out["r"], Exception), out["r"]  # (x never sent the replica)
    assert arrived == [("stage", 0)]
