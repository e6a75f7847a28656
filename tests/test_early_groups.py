"""Groups formed ahead of a generation (`spotpipe.runtime.early_groups`): taken when the
Decision says so, cancelled otherwise, and never handed out for another layout or generation.
The formation is a stand-in here (`_Former`), gated by events: what is checked is which
formations run, which are closed, and what `take` returns or raises."""

from __future__ import annotations

import threading

import pytest

from spotpipe.plan import Layout
from spotpipe.runtime.early_groups import EarlyGroups, layout_digest
from spotpipe.store.abort import AbortSignal, PeerFailure

A = Layout.build(2, 1, ["node0", "node2"])
B = Layout.build(2, 1, ["node2", "node0"])  # the same nodes, other stages: another layout


class _Groups:
    def __init__(self, generation: int, layout: Layout) -> None:
        self.generation, self.layout = generation, layout
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Former:
    """Forms `_Groups` once `release` lets it (or fails as told); ends at the abort."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[tuple[int, Layout]] = []
        self.made: list[_Groups] = []
        self.fail: str | None = None
        self.aborts: list[AbortSignal] = []
        self.given: dict[tuple[int, Layout], AbortSignal] = {}  # (each formation's thread)
        self._called = threading.Condition()

    def __call__(self, generation: int, layout: Layout, abort: AbortSignal) -> _Groups:
        with self._called:
            self.calls.append((generation, layout))
            self.aborts.append(abort)
            self.given[(generation, layout)] = abort
            self._called.notify_all()
        abort.wait(self.release)  # PeerFailure at the abort, as Comm's formation
        if self.fail:
            raise PeerFailure(self.fail)
        groups = _Groups(generation, layout)
        self.made.append(groups)
        return groups


def _called(former: _Former, count: int) -> None:
    """Wait until `count` formations have started (each runs on a thread of its own)."""
    with former._called:
        assert former._called.wait_for(lambda: len(former.calls) >= count, 30)


class _Generations:
    """Each generation's abort, as `runtime.generations` keeps them."""

    def __init__(self) -> None:
        self.aborts: dict[int, AbortSignal] = {}

    def __call__(self, generation: int) -> AbortSignal:
        return self.aborts.setdefault(generation, AbortSignal())


def _early(form, generations: _Generations | None = None) -> EarlyGroups:
    return EarlyGroups(form, generations or _Generations())


def test_taken_groups_are_the_ones_formed_ahead():
    former = _Former()
    early = _early(former)
    early.start(1, A)
    early.start(1, A)  # the same preparation read twice: one formation
    former.release.set()
    groups = early.take(1, A)
    assert (groups.generation, groups.layout) == (1, A) and not groups.closed
    assert former.calls == [(1, A)]
    assert early.pending == {}


def test_a_node_that_missed_the_preparation_forms_when_it_takes():
    former = _Former()
    former.release.set()
    groups = _early(former).take(3, B)
    assert former.calls == [(3, B)] and groups.layout == B


def test_the_layout_the_plan_names_is_taken_and_the_other_ended():
    former = _Former()
    early = _early(former)
    early.start(1, A)
    early.start(1, B)
    _called(former, 2)
    former.release.set()
    assert early.take(1, B).layout == B  # the one taken is the plan's...
    assert former.given[(1, A)].is_set  # ...and the other formation is ended
    assert sorted(layout_digest(layout) for _, layout in former.calls) == \
        sorted(layout_digest(layout) for layout in (A, B))


def test_a_formation_that_ends_after_it_was_cancelled_is_closed():
    started, release, closed = threading.Event(), threading.Event(), threading.Event()

    class Closing(_Groups):
        def close(self) -> None:
            closed.set()

    def form(generation: int, layout: Layout, abort: AbortSignal) -> _Groups:
        started.set()
        release.wait()  # (deaf to the abort: a formation that completes anyway)
        return Closing(generation, layout)

    early = _early(form)
    early.start(1, A)
    assert started.wait(10)
    early.discard("the plan took other groups", 1)
    release.set()
    assert closed.wait(10), "groups formed after the cancel were not closed"


def test_taking_a_generation_drops_older_preparations_and_keeps_later_ones():
    former = _Former()
    early = _early(former)
    early.start(1, A)
    early.start(2, B)  # the plan after the next one, prepared meanwhile
    early.start(0, B)  # an old one
    former.release.set()
    assert early.take(1, A).generation == 1
    assert early.pending == {2: (B,)}
    _called(former, 3)
    assert former.given[(0, B)].is_set  # generation 0's, cancelled
    assert early.take(2, B).generation == 2


def test_a_failed_formation_raises_at_take():
    former = _Former()
    former.fail = "connection reset by peer"
    former.release.set()
    early = _early(former)
    early.start(1, A)
    with pytest.raises(PeerFailure, match="connection reset"):
        early.take(1, A)


def test_the_generations_abort_ends_the_wait_for_a_formation():
    """A peer lost while the groups form: the generation's abort watcher triggers its abort,
    and `take` raises instead of waiting out the formation."""
    former, generations = _Former(), _Generations()  # never released: a dead peer's wait
    early = _early(former, generations)
    early.start(1, A)
    threading.Timer(0.05, generations(1).trigger, args=("node3 lost",)).start()
    with pytest.raises(PeerFailure, match="node3 lost"):
        early.take(1, A)
    assert early.pending == {}


def test_cancelling_a_preparation_does_not_end_its_generation():
    """The plan took other groups for generation 1 (or another layout replaced the prepared
    one): the formation ends, the generation's abort does not, or the generation would begin
    aborted."""
    former, generations = _Former(), _Generations()
    early = _early(former, generations)
    early.start(1, A)
    early.start(1, B)
    early.discard("the plan did not take them", 1)
    assert all(abort.is_set for abort in former.aborts)
    assert not generations(1).is_set


def test_discard_ends_the_preparations_through_its_generation_and_keeps_later_ones():
    """Generation 1's plan did not take groups formed ahead; generation 2's were prepared
    from that plan's layout (read early: the boards of a generation are watched before it
    begins) and are still the ones its plan takes. Cancelling them here while the peers
    formed them made this node form them a second time under the same prefix at `take`,
    and wait there for peers that were done (a CI run's re-partition, held 60 s)."""
    former = _Former()
    early = _early(former)
    early.start(1, A)
    early.start(2, B)
    _called(former, 2)
    early.discard("the plan did not take them", 1)
    assert early.pending == {2: (B,)}
    former.release.set()
    assert early.take(2, B).layout == B
    assert sorted(former.calls, key=lambda c: c[0]) == [(1, A), (2, B)]  # 2's formed once
    assert former.given[(1, A)].is_set and not former.given[(2, B)].is_set


def test_a_replaced_preparation_goes_on_until_its_generation_begins_and_may_be_taken():
    """Two preparations for generation 1 (a joiner's, then a second joiner's on standby):
    the first is not cancelled when the second comes, since the plan may still name it and
    its peers may have formed it with this node. Cancelling it made the node form the same
    layout a second time under the same store prefix and local-link names at `take` (a full
    suite's run: the listener's address in use, and a state transfer over groups paired with
    the abandoned formation, held 60 s). `take` keeps the one its plan names and ends the
    others."""
    former = _Former()
    early = _early(former)
    early.start(1, A)
    early.start(1, B)
    _called(former, 2)
    assert early.pending == {1: (A, B)} and not former.given[(1, A)].is_set
    former.release.set()
    assert early.take(1, A).layout == A
    assert sorted(former.calls, key=str) == sorted([(1, A), (1, B)], key=str)  # A formed once
    assert former.given[(1, B)].is_set and early.pending == {}


def test_the_nodes_end_discards_everything():
    former = _Former()
    early = _early(former)
    early.start(1, A)
    early.start(2, B)
    early.discard("the node is done", 2 ** 62)
    assert all(abort.is_set for abort in former.aborts) and early.pending == {}


def test_layout_digests_name_layouts_not_objects():
    assert layout_digest(A) == layout_digest(Layout.build(2, 1, ["node0", "node2"]))
    assert layout_digest(A) != layout_digest(B)


def test_a_preparation_read_after_its_generation_began_forms_nothing():
    """A watcher thread that reads a `Prepare` only after the node took that generation's
    groups (a loaded machine's scheduler) must not form them again: under the same store
    prefix, the new formation would read the rendezvous records of the groups in use."""
    former = _Former()
    former.release.set()
    early = _early(former)
    early.start(1, A)
    early.take(1, A)
    early.start(1, A)  # read late
    assert former.calls == [(1, A)] and early.pending == {}
    early.discard("the plan for generation 2 did not take them", 2)
    early.start(2, B)  # read after that plan
    assert former.calls == [(1, A)] and early.pending == {}
    early.start(3, B)  # a later generation's forms as usual
    assert early.pending == {3: (B,)}
