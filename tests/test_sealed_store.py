"""The sealed store: values that are not protocol messages (torch's rendezvous of process
groups, layer metadata, shadow marks) carry a MAC under the job's key that binds their key.

A gloo group forms through it; an address squatted ahead of its rank is refused and the genuine
one taken when it comes; one written over the genuine address stops the group with an error
naming the key, never a connection to the forger's address.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from spotpipe.protocol.auth import Refused
from spotpipe.store.sealed import SealedStore, open_value, seal_value

KEY = b"k" * 32


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    yield store


def connect(server, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def landed(server, key: str) -> None:
    """Wait until `key`, set through another connection, is in the store: a TCPStore client's
    set does not wait for the server, so a write over or a delete of it through `server` could
    otherwise reach the store first and be undone by it."""
    server.get(key)


def forge(server, key: str, value: bytes | str) -> None:
    """Write `value` over `key` through `server` and wait until the store holds it (a set does
    not wait for the server: a read through another connection could come first)."""
    server.set(key, value)
    assert server.get(key) == (value.encode() if isinstance(value, str) else value)


def test_a_value_opens_only_under_its_own_key_and_the_jobs_key():
    blob = seal_value(KEY, "gen1/world/0/1", b"\x00address")
    assert open_value(KEY, "gen1/world/0/1", blob) == b"\x00address"
    with pytest.raises(Refused, match="gen1/world/0/0: bad seal"):
        open_value(KEY, "gen1/world/0/0", blob)  # another rank's key
    with pytest.raises(Refused, match="bad seal"):
        open_value(b"j" * 32, "gen1/world/0/1", blob)  # another job
    with pytest.raises(Refused, match="gen1/world/0/1: no seal"):
        open_value(KEY, "gen1/world/0/1", b"\x00address")
    tampered = blob[:-1] + b"X"
    with pytest.raises(Refused, match="bad seal"):
        open_value(KEY, "gen1/world/0/1", tampered)
    # a key name cannot run into its value: the length is part of what the MAC covers
    assert seal_value(KEY, "a/b", b"c") != seal_value(KEY, "a/", b"bc")


def test_records_round_trip_and_an_unsealed_one_is_refused_at_once(server):
    refused: list[Refused] = []
    sealed = SealedStore(connect(server), KEY, on_refused=refused.append)
    sealed.set("layers/node0/node1", '{"n": 3}')
    assert sealed.get("layers/node0/node1") == b'{"n": 3}'
    assert server.get("layers/node0/node1").startswith(b"spotpipe-seal/1")
    forge(server, "layers/node2/node1", '{"n": 300000000}')  # written without the key
    with pytest.raises(Refused, match="layers/node2/node1: no seal"):
        sealed.get("layers/node2/node1")
    assert len(refused) == 1
    assert sealed.check(["layers/node0/node1"]) and not sealed.check(["nothing"])


def _form(server, rank: int, size: int, out: dict, timeout_s: float = 30.0,
          wait_genuine_s: float = 30.0, on_refused=None) -> None:
    try:
        # (the connection keeps the default timeout: `timeout_s` bounds the group's forming,
        # and a loaded machine may take seconds to connect a client)
        sealed = SealedStore(connect(server), KEY, wait_genuine_s=wait_genuine_s,
                             on_refused=on_refused)
        group = dist.ProcessGroupGloo(dist.PrefixStore("gen1/world", sealed), rank, size,
                                      timedelta(seconds=timeout_s))
        t = torch.full((4,), float(rank + 1))
        group.allreduce([t]).wait()
        out[rank] = t
        out[f"keep{rank}"] = (sealed, group)  # (the store must outlive the group's use)
    except Exception as exc:  # reported to the test's thread
        out[f"error{rank}"] = exc


def test_a_gloo_group_forms_and_reduces_through_the_sealed_store(server):
    out: dict = {}
    threads = [threading.Thread(target=_form, args=(server, r, 3, out)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(out[r], torch.full((4,), 6.0)) for r in range(3)), out
    # what the store holds for a rank's address is sealed, not the address itself
    assert server.get("gen1/world/0/0").startswith(b"spotpipe-seal/1")


def test_an_address_squatted_ahead_of_its_rank_is_refused_and_the_genuine_one_taken(server):
    """Rank 0 comes first and finds a forged address for rank 1 (an attacker who read the
    generation from the store); rank 1 comes once rank 0 has refused it, and overwrites it."""
    forge(server, "gen1/world/0/1", b"forged: connect to 10.9.9.9 instead")
    out: dict = {}
    refused: list[Refused] = []
    seen = threading.Event()

    def on_refused(why: Refused) -> None:
        refused.append(why)
        seen.set()

    first = threading.Thread(target=_form, args=(server, 0, 2, out),
                             kwargs={"on_refused": on_refused})
    first.start()
    assert seen.wait(60), out  # rank 1 starts once rank 0 has refused the squatter
    assert "gen1/world/0/1: no seal" in str(refused[0])
    second = threading.Thread(target=_form, args=(server, 1, 2, out))
    second.start()
    first.join(60)
    second.join(60)
    assert torch.equal(out[0], torch.full((4,), 3.0)) and torch.equal(out[1], out[0]), out


def test_an_address_written_over_the_genuine_one_stops_the_group_naming_the_key(server):
    out: dict = {}
    second = threading.Thread(target=_form, args=(server, 1, 2, out),
                              kwargs={"timeout_s": 3, "wait_genuine_s": 0.5})
    second.start()
    server.wait(["gen1/world/0/1"])  # rank 1 has published its address
    genuine = server.get("gen1/world/0/1")
    # the genuine record copied from another key would not verify either
    forge(server, "gen1/world/0/1", genuine[:-3] + b"evil")
    _form(server, 0, 2, out, timeout_s=3, wait_genuine_s=0.5)
    second.join(60)
    # neither rank connects to the address it cannot verify (gloo reads every rank's key,
    # its own too)
    assert 0 not in out and 1 not in out, out
    for rank in (0, 1):
        assert "gen1/world/0/1" in str(out[f"error{rank}"]), out
        assert "no genuine value" in str(out[f"error{rank}"]), out


def _sending(sealed, iteration, stage, folder, checksums, **kw):
    """`transfer.send_stage` on a thread of its own (it waits for the receiver); a dict that
    gets its bytes sent, or its error."""
    from spotpipe.checkpoint import transfer

    out: dict = {}

    def send():
        try:
            out["sent"] = transfer.send_stage(sealed, iteration, stage, folder, checksums,
                                              timeout_s=kw.pop("timeout_s", 30.0), **kw)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    out["thread"] = thread
    return out


class _WaitsSeen:
    """A store that calls `seen` at each wait for `key` alone: where the code under test
    waits, told to the test."""

    def __init__(self, inner, key: str, seen) -> None:
        self.inner, self.key, self.seen = inner, key, seen

    def wait(self, keys, timeout=None):
        if keys == [self.key]:
            self.seen()
        return self.inner.wait(keys, timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _pieces_left(server, iteration, stage, upto=64) -> list[str]:
    base = f"spotpipe/checkpoint/files/{iteration}/{stage}/"
    names = ["meta", "verdict"] + [str(i) for i in range(upto)] + [f"ack{i}" for i in range(upto)]
    return [n for n in names if server.check([base + n])]


def test_stage_files_through_the_store_arrive_only_when_sealed(server, tmp_path):
    """The committing host takes a stage's files from the store (transfer.py): sealed ones
    arrive whole, and the sender hears so; a forged file list is what is wrong with the
    checkpoint, not a crash, and the sender hears that too."""
    import hashlib

    from spotpipe.checkpoint import transfer

    (tmp_path / "sent" / "stage1").mkdir(parents=True)
    (tmp_path / "sent" / "stage1" / "shard.bin").write_bytes(b"x" * 1000)
    checksums = {"stage1/shard.bin": hashlib.sha256(b"x" * 1000).hexdigest()}
    sealed = SealedStore(connect(server), KEY)
    sending = _sending(SealedStore(connect(server), KEY), 9, 1, tmp_path / "sent", checksums)
    assert transfer.receive_stage(sealed, 9, 1, checksums, tmp_path / "got", timeout_s=30) == ""
    sending["thread"].join(30)
    assert sending.get("sent") == 1000, sending
    assert (tmp_path / "got" / "stage1" / "shard.bin").read_bytes() == b"x" * 1000
    assert _pieces_left(server, 9, 1) == []
    landed_meta = "spotpipe/checkpoint/files/19/1/meta"
    forge(server, landed_meta, '{"files": [["stage1/shard.bin", 100000000]]}')  # before the sender
    problem = transfer.receive_stage(sealed, 19, 1, checksums, tmp_path / "got19", timeout_s=30)
    assert f"{landed_meta}: no seal" in problem, problem
    assert not (tmp_path / "got19").exists()
    # a sender that comes after the forger's list hears the refusal, and takes back its piece
    sending = _sending(SealedStore(connect(server), KEY), 19, 1, tmp_path / "sent", checksums)
    sending["thread"].join(30)
    assert isinstance(sending.get("error"), transfer.UploadRefused), sending
    assert "no seal" in str(sending["error"])
    assert _pieces_left(server, 19, 1) == []


@pytest.mark.parametrize("forged", ["list", "piece"])
def test_a_refused_stage_leaves_nothing_in_the_store(server, tmp_path, monkeypatch, forged):
    """Two files, one of them in many pieces: after a forged list or a forged piece, the
    sender hears why, and none of the stage's pieces, acknowledgements or verdict stays behind
    (a stage is up to GBs)."""
    import hashlib

    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 64)
    (tmp_path / "sent" / "stage2").mkdir(parents=True)
    blobs = {"stage2/a.bin": b"a" * (20 * 64 + 5), "stage2/b.bin": b"b" * 10}
    for name, data in blobs.items():
        (tmp_path / "sent" / name).write_bytes(data)
    checksums = {n: hashlib.sha256(d).hexdigest() for n, d in blobs.items()}
    sealed = SealedStore(connect(server), KEY)
    sending = _sending(SealedStore(connect(server), KEY), 7, 2, tmp_path / "sent", checksums,
                       window=4)
    landed(server, "spotpipe/checkpoint/files/7/2/3")  # the window is full: the sender waits
    if forged == "list":
        forge(server, "spotpipe/checkpoint/files/7/2/meta", '{"files": []}')
    else:
        forge(server, "spotpipe/checkpoint/files/7/2/2", b"D" + b"z" * 64)
    problem = transfer.receive_stage(sealed, 7, 2, checksums, tmp_path / "got", timeout_s=30)
    assert "no seal" in problem, problem
    sending["thread"].join(30)
    assert not sending["thread"].is_alive()
    assert isinstance(sending.get("error"), transfer.UploadRefused), sending
    assert "no seal" in str(sending["error"])
    assert _pieces_left(server, 7, 2) == []
    assert not list((tmp_path / "got").rglob("*.bin")) if (tmp_path / "got").exists() else True


def test_a_verdict_written_after_the_senders_stop_is_taken_back_too(server, tmp_path,
                                                                    monkeypatch):
    """The receiver refuses with two writes, a stop where the sender waits (the
    acknowledgement of the window's first piece) and then its verdict. A sender woken by the
    stop took back what it had put before the verdict came, and the verdict stayed in the
    store (a two-process CI run). Here the verdict goes only once the sender waits for it
    (the test is told where the sender waits), so the order is the one that failed."""
    import hashlib

    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 64)
    (tmp_path / "sent" / "stage2").mkdir(parents=True)
    data = b"a" * (20 * 64)
    (tmp_path / "sent" / "stage2" / "a.bin").write_bytes(data)
    checksums = {"stage2/a.bin": hashlib.sha256(data).hexdigest()}
    s = transfer.Stream.checkpoint(7, 2)
    awaits_verdict = threading.Event()
    refuse = transfer._refuse

    def refuse_in_two_steps(store, stream, taken, window, why):
        store.set(stream.ack(taken), transfer.STOP + why.encode())
        assert awaits_verdict.wait(30), "the sender did not wait for the verdict"
        refuse(store, stream, taken, window, why)

    monkeypatch.setattr(transfer, "_refuse", refuse_in_two_steps)
    sending = _sending(_WaitsSeen(SealedStore(connect(server), KEY), s.verdict,
                                  awaits_verdict.set), 7, 2, tmp_path / "sent", checksums,
                       window=4)
    landed(server, "spotpipe/checkpoint/files/7/2/3")  # the window is full: the sender waits
    forge(server, "spotpipe/checkpoint/files/7/2/meta", '{"files": []}')
    problem = transfer.receive_stage(SealedStore(connect(server), KEY), 7, 2, checksums,
                                     tmp_path / "got", timeout_s=30)
    assert "no seal" in problem, problem
    sending["thread"].join(30)
    assert isinstance(sending.get("error"), transfer.UploadRefused), sending
    assert _pieces_left(server, 7, 2) == []


def test_the_store_holds_a_window_of_a_stage_not_the_stage(server, tmp_path, monkeypatch):
    """Piece n goes only once piece n - window has been taken: with nobody taking, the sender
    stops at the window; the receiver then takes all of it."""
    import hashlib

    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    data = bytes(range(256)) * 20  # 52 pieces
    (tmp_path / "sent" / "stage0").mkdir(parents=True)
    (tmp_path / "sent" / "stage0" / "big.bin").write_bytes(data)
    checksums = {"stage0/big.bin": hashlib.sha256(data).hexdigest()}
    sending = _sending(SealedStore(connect(server), KEY), 3, 0, tmp_path / "sent", checksums,
                       window=5)
    landed(server, "spotpipe/checkpoint/files/3/0/4")
    # (the sender writes piece 5 only after the acknowledgement of piece 0, which nobody gave)
    assert _pieces_left(server, 3, 0) == ["meta", "0", "1", "2", "3", "4"]
    assert sending["thread"].is_alive()
    got = tmp_path / "got"
    assert transfer.receive_stage(SealedStore(connect(server), KEY), 3, 0, checksums, got,
                                  timeout_s=30, window=5) == ""
    sending["thread"].join(30)
    assert sending.get("sent") == len(data), sending
    assert (got / "stage0" / "big.bin").read_bytes() == data
    assert _pieces_left(server, 3, 0) == []


@pytest.mark.parametrize("how", ["sender gives up", "sender lost"])
def test_a_receiver_ends_when_its_sender_is_gone(server, tmp_path, monkeypatch, how):
    """A sender that stops half-way leaves a stop where its next piece would be; one that
    dies leaves nothing, and the coordinator's loop, which counts it lost, puts the stop there
    (`Receiving.lose`). Either way the receiver ends at once, not at its timeout."""
    import hashlib
    import time

    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    data = b"q" * 2000
    (tmp_path / "sent" / "stage1").mkdir(parents=True)
    (tmp_path / "sent" / "stage1" / "s.bin").write_bytes(data)
    checksums = {"stage1/s.bin": hashlib.sha256(data).hexdigest()}
    sealed = SealedStore(connect(server), KEY)
    receiving = transfer.Receiving()
    result: dict = {}
    receiver = threading.Thread(target=lambda: result.update(problem=transfer.receive_stage(
        SealedStore(connect(server), KEY), 4, 1, checksums, tmp_path / "got", timeout_s=600,
        window=4, node="node3", receiving=receiving)), daemon=True)
    receiver.start()
    s = transfer.Stream.checkpoint(4, 1)
    sealed.set(s.meta, '{"files": [["stage1/s.bin", 20]]}')
    for n in range(3):  # three pieces of twenty, then the sender stops
        sealed.set(s.piece(n), b"D" + b"q" * 100)
    landed(server, s.ack(2))
    started = time.monotonic()
    if how == "sender gives up":
        transfer._give_up(sealed, s, 3, 4, "the sender gave up: disk error", listed=True,
                          unheard=False)
        want = "disk error"
    else:
        receiving.lose("node3", sealed)
        want = "node3 was lost while it sent its stage"
    receiver.join(60)
    assert not receiver.is_alive() and time.monotonic() - started < 60
    assert want in result["problem"], result
    assert _pieces_left(server, 4, 1) == []
    assert not (tmp_path / "got" / "stage1" / "s.bin").exists()


class _CountingStore(dist.Store):
    """A store that counts the reads that reach it (what a squatter costs the real store)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.reads = inner, 0
        self.set_timeout(inner.timeout)

    def get(self, key: str) -> bytes:
        self.reads += 1
        return bytes(self.inner.get(key))


def test_a_standing_squatter_is_read_with_a_growing_interval(server):
    # a squatter that never goes: the reader gives up after wait_genuine_s, having read the
    # store at intervals doubling from 2 ms to 100 ms: 2+4+...+64 ms is 126 ms, then one read
    # per 100 ms, so at most about 11 reads in 0.6 s (300 at a fixed 2 ms)
    forge(server, "gen1/world/0/1", b"\x00squatter")
    counting = _CountingStore(connect(server))
    sealed = SealedStore(counting, KEY, wait_genuine_s=0.6)
    with pytest.raises(Refused, match="no genuine value within 0.6 s"):
        sealed.get("gen1/world/0/1")
    assert counting.reads <= 13, counting.reads
    # and a genuine value that comes at once is still taken at once (the first interval)
    forge(server, "gen1/world/0/2", b"\x00squatter")
    threading.Timer(0.01, lambda: connect(server).set(
        "gen1/world/0/2", seal_value(KEY, "gen1/world/0/2", b"genuine"))).start()
    assert SealedStore(connect(server), KEY, wait_genuine_s=5).get("gen1/world/0/2") == b"genuine"


def test_a_receiver_that_cannot_write_stops_its_sender(server, tmp_path, monkeypatch):
    """The committing host's disk fails (here: the folder is a file): the receive says so, and
    the sender hears it at its next wait instead of waiting out its timeout (600 s here)."""
    import hashlib
    import time

    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    data = b"w" * 3000
    (tmp_path / "sent" / "stage0").mkdir(parents=True)
    (tmp_path / "sent" / "stage0" / "w.bin").write_bytes(data)
    checksums = {"stage0/w.bin": hashlib.sha256(data).hexdigest()}
    sending = _sending(SealedStore(connect(server), KEY), 6, 0, tmp_path / "sent", checksums,
                       window=4, timeout_s=600)
    (tmp_path / "not_a_folder").write_text("")
    started = time.monotonic()
    problem = transfer.receive_stage(SealedStore(connect(server), KEY), 6, 0, checksums,
                                     tmp_path / "not_a_folder", timeout_s=30, window=4)
    assert "the files of stage 0:" in problem, problem
    sending["thread"].join(60)
    assert not sending["thread"].is_alive() and time.monotonic() - started < 60
    assert isinstance(sending.get("error"), transfer.UploadRefused), sending
    assert _pieces_left(server, 6, 0) == []


class _Watched:
    """A store whose waits say which key they begin on (`waited`, an event per key), and
    optionally hold until `gates[key]` opens, so that a test knows, not guesses, where a
    receive stands."""

    def __init__(self, inner, gates: dict | None = None) -> None:
        self.inner, self.gates, self.waited = inner, gates or {}, {}
        self._lock = threading.Lock()

    def began(self, key: str) -> threading.Event:
        with self._lock:
            return self.waited.setdefault(key, threading.Event())

    def wait(self, keys, timeout=None):
        for key in keys:
            self.began(key).set()
            if key in self.gates:
                assert self.gates[key].wait(60)
        return self.inner.wait(keys, timeout)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _stage_files(folder, stage: int, blobs: dict[str, bytes]) -> dict[str, str]:
    """Write `blobs` into stage `stage`'s folder under `folder`; their checksums, by the
    names a stage reports (`durable.stage_checksums`: "stage<s>/<file>")."""
    import hashlib

    (folder / f"stage{stage}").mkdir(parents=True, exist_ok=True)
    for name, data in blobs.items():
        (folder / f"stage{stage}" / name).write_bytes(data)
    return {f"stage{stage}/{n}": hashlib.sha256(d).hexdigest() for n, d in blobs.items()}


def test_a_node_lost_with_two_stages_on_their_way_ends_both_receives(server, tmp_path,
                                                                     monkeypatch):
    """A worker that holds two stages announces both and sends them one after the other:
    the committer waits for a piece of the first and for the list of the second at once.
    When the loop counts the node lost, both receives end (a `Receiving` that kept one wait
    per node kept the later one, and dropped it when the other's piece came: the second
    receive waited out its timeout, and the committer behind it)."""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    sums = {1: {"stage1/a.bin": "0" * 64}, 2: {"stage2/b.bin": "0" * 64}}
    receiving = transfer.Receiving()
    watched = {s: _Watched(SealedStore(connect(server), KEY)) for s in (1, 2)}
    results: dict = {}
    receivers = [threading.Thread(target=lambda s=s: results.update({s: transfer.receive_stage(
        watched[s], 5, s, sums[s], tmp_path / "got", timeout_s=600, window=4, node="node3",
        receiving=receiving)}), daemon=True) for s in (1, 2)]
    receivers[1].start()
    assert watched[2].began(transfer.Stream.checkpoint(5, 2).meta).wait(60)
    receivers[0].start()
    sealed = SealedStore(connect(server), KEY)
    s = transfer.Stream.checkpoint(5, 1)
    sealed.set(s.meta, '{"files": [["stage1/a.bin", 20]]}')
    for n in range(3):  # three pieces of the first stage, then the node is gone
        sealed.set(s.piece(n), b"D" + b"a" * 100)
    assert watched[1].began(s.piece(3)).wait(60)
    receiving.lose("node3", sealed)
    for receiver in receivers:
        receiver.join(60)
    assert not any(r.is_alive() for r in receivers), results
    assert results == {1: "node3 was lost while it sent its stage",
                       2: "node3 was lost while it sent its stage"}
    assert _pieces_left(server, 5, 1) == [] and _pieces_left(server, 5, 2) == []


def _failing_after(pieces: int):
    """`transfer.read_pieces` whose reading fails after `pieces` pieces (a disk error)."""
    from spotpipe.checkpoint import transfer

    real = transfer.read_pieces

    def read(path):
        for n, part in enumerate(real(path)):
            if n == pieces:
                raise OSError(f"{path.name}: disk error")
            yield part
    return read


@pytest.mark.parametrize("how", ["file missing", "before the receiver starts",
                                 "ahead of a receiver that lags"])
def test_a_sender_that_gives_up_ends_its_receiver_wherever_it_stands(server, tmp_path,
                                                                     monkeypatch, how):
    """The sender gives up (a file announced but not there, a disk error) while its receiver
    has not started yet (it starts when the loop reads the announcement) or is pieces behind:
    the receiver still ends at once, naming why, not at its timeout (600 s here), and nothing
    stays in the store. (A sender that removed the pieces not taken and left its stop in the
    next piece's place, or nothing before its list went, held such a receiver.)"""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    checksums = _stage_files(tmp_path / "sent", 1, {"s.bin": b"s" * 1000})  # 10 pieces
    if how == "file missing":
        (tmp_path / "sent" / "stage1" / "s.bin").unlink()
        want = "No such file"
    else:
        monkeypatch.setattr(transfer, "read_pieces", _failing_after(
            2 if how == "before the receiver starts" else 6))
        want = "s.bin: disk error"
    s = transfer.Stream.checkpoint(8, 1)
    gate = threading.Event()  # (a receiver that lags: it waits for piece 2 once the sender ended)
    store = _Watched(SealedStore(connect(server), KEY), {s.piece(2): gate})
    result: dict = {}
    receiver = threading.Thread(target=lambda: result.update(problem=transfer.receive_stage(
        store, 8, 1, checksums, tmp_path / "got", timeout_s=600, window=4)), daemon=True)
    if how == "ahead of a receiver that lags":
        receiver.start()
    sending = _sending(SealedStore(connect(server), KEY), 8, 1, tmp_path / "sent", checksums,
                       window=4, timeout_s=600)
    sending["thread"].join(60)
    assert want in str(sending.get("error")), sending
    gate.set()
    if how != "ahead of a receiver that lags":
        receiver.start()
    receiver.join(60)
    assert not receiver.is_alive(), "the receiver waits for a sender that gave up"
    assert want in result["problem"] and "the sender gave up" in result["problem"], result
    assert _pieces_left(server, 8, 1) == []
    assert not (tmp_path / "got" / "stage1" / "s.bin").exists()


def test_file_names_outside_a_stages_folder():
    from spotpipe.checkpoint.transfer import outside

    for name in ["stage1/a.distcp", "stage1/sub/a", "stage1/.metadata"]:
        assert not outside(name, "stage1"), name
    for name in ["stage0/a.distcp", "a.distcp", "manifest.json", "stage1", "stage1/",
                 "/stage1/a", "stage1/../stage0/a", "stage1/./a", "stage1//a", "stage10/a",
                 "../stage1/a", ""]:
        assert outside(name, "stage1"), name
    assert not outside("manifest.json") and not outside("stage0/a")  # (a whole checkpoint)
    assert outside("../a") and outside("/etc/passwd") and outside("a/../../b")


@pytest.mark.parametrize("name", ["stage0/x.bin", "manifest.json", "stage1/../stage0/x.bin"])
def test_a_stage_that_sends_a_file_outside_its_folder_is_refused(server, tmp_path, name):
    """Stage 1's upload names a file of stage 0, the manifest's place, or a way out of its
    folder: the receive refuses the stage naming the file, writes nothing, and its sender
    hears why (an upload that named stage 0's file wrote over it in the iteration's folder)."""
    import hashlib

    from spotpipe.checkpoint import transfer

    sent = tmp_path / "sent"
    (sent / "stage1").mkdir(parents=True)
    (sent / "stage0").mkdir()
    (sent / name).write_bytes(b"forged")
    checksums = {name: hashlib.sha256(b"forged").hexdigest()}
    sending = _sending(SealedStore(connect(server), KEY), 2, 1, sent, checksums)
    problem = transfer.receive_stage(SealedStore(connect(server), KEY), 2, 1, checksums,
                                     tmp_path / "got", timeout_s=30)
    assert problem == f"stage 1 sent a file outside its folder: {name!r}", problem
    sending["thread"].join(30)
    assert isinstance(sending.get("error"), transfer.UploadRefused), sending
    assert "outside its folder" in str(sending["error"])
    assert not (tmp_path / "got").exists() or not list((tmp_path / "got").rglob("*"))
    assert _pieces_left(server, 2, 1) == []


@pytest.mark.parametrize("forged", ["unsealed", "another iteration's", "another stage's",
                                    "not a piece", "truncated", "repeated"])
def test_a_bad_piece_fails_the_stage_naming_why_and_leaves_nothing(server, tmp_path,
                                                                    monkeypatch, forged):
    """Piece 1 of 3 is replaced before the receiver takes it: by a value not sealed, one
    sealed for the same piece of another iteration or another stage (replayed), a sealed
    value that is no piece, or a genuine-looking piece cut short or repeated (a buggy
    sender's). The receive says what is wrong (the key, or the file that arrived damaged),
    keeps no file, and goes on taking the pieces so that its sender hears the verdict;
    nothing stays in the store."""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    data = bytes(range(250))
    checksums = _stage_files(tmp_path / "sent", 1, {"s.bin": data})  # 3 pieces
    s = transfer.Stream.checkpoint(9, 1)
    key = s.piece(1)
    value = {"unsealed": b"D" + data[100:200],
             "another iteration's": seal_value(KEY, transfer.Stream.checkpoint(8, 1).piece(1),
                                               b"D" + data[100:200]),
             "another stage's": seal_value(KEY, transfer.Stream.checkpoint(9, 0).piece(1),
                                           b"D" + data[100:200]),
             "not a piece": seal_value(KEY, key, b"{}"),
             "truncated": seal_value(KEY, key, b"D" + data[100:150]),
             "repeated": seal_value(KEY, key, b"D" + data[:100])}[forged]
    want = {"unsealed": f"{key}: no seal", "another iteration's": f"{key}: bad seal",
            "another stage's": f"{key}: bad seal", "not a piece": f"{key}: not a piece",
            "truncated": "s.bin arrived damaged (checksum differs)",
            "repeated": "s.bin arrived damaged (checksum differs)"}[forged]
    gate = threading.Event()
    store = _Watched(SealedStore(connect(server), KEY), {key: gate})
    result: dict = {}
    receiver = threading.Thread(target=lambda: result.update(problem=transfer.receive_stage(
        store, 9, 1, checksums, tmp_path / "got", timeout_s=30, window=4)), daemon=True)
    receiver.start()
    sending = _sending(SealedStore(connect(server), KEY), 9, 1, tmp_path / "sent", checksums,
                       window=4)
    landed(server, s.piece(2))  # (all three are out: the sender waits for the verdict)
    forge(server, key, value)
    gate.set()
    receiver.join(30)
    sending["thread"].join(30)
    assert want in result["problem"], result
    assert isinstance(sending.get("error"), transfer.UploadRefused), sending
    assert want in str(sending["error"])
    assert not (tmp_path / "got" / "stage1" / "s.bin").exists()
    assert _pieces_left(server, 9, 1) == []


@pytest.mark.parametrize("meta", ["not json", '{"files": [["stage1/s.bin"]]}',
                                  '{"files": [["stage1/s.bin", 0]]}',
                                  '{"files": [["stage1/other.bin", 1]]}'])
def test_a_bad_file_list_fails_the_stage_naming_why(server, tmp_path, meta):
    """A sealed file list that is no JSON, lacks a file's pieces, gives it none, or names
    other files than the stage reported: refused with the reason, nothing written."""
    import hashlib

    from spotpipe.checkpoint import transfer

    checksums = {"stage1/s.bin": hashlib.sha256(b"").hexdigest()}
    s = transfer.Stream.checkpoint(3, 1)
    SealedStore(connect(server), KEY).set(s.meta, meta)
    problem = transfer.receive_stage(SealedStore(connect(server), KEY), 3, 1, checksums,
                                     tmp_path / "got", timeout_s=30)
    assert problem == {"not json": "the files of stage 1: an unreadable file list",
                       '{"files": [["stage1/s.bin"]]}':
                           "the files of stage 1: an unreadable file list",
                       '{"files": [["stage1/s.bin", 0]]}': "stage 1: a file in no pieces",
                       '{"files": [["stage1/other.bin", 1]]}':
                           "stage 1 sent other files than it reported"}[meta], problem
    assert not (tmp_path / "got").exists()


def test_checkpoints_in_flight_together_arrive_whole_and_leave_no_key(server, tmp_path,
                                                                       monkeypatch):
    """Two iterations' uploads of a stage at once (the first still on its way when the next
    starts), each with an empty file, files of exactly one and two pieces, one a byte over,
    and many small files: every file arrives as it was written, none mixed with the other
    iteration's, and after three rounds the store holds no more keys than before (a long job
    leaks nothing)."""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 64)
    before = server.num_keys()
    for round_ in range(3):
        stages = {}
        for t in (10 * round_ + 1, 10 * round_ + 2):
            blobs = {"empty.bin": b"", "one.bin": bytes([t]) * 64, "two.bin": bytes([t]) * 128,
                     "over.bin": bytes([t]) * 129,
                     **{f"small{i}.bin": bytes([t, i]) * 3 for i in range(30)}}
            stages[t] = (blobs, _stage_files(tmp_path / f"sent{t}", 1, blobs))
        results: dict = {}

        def receive(t: int) -> None:
            results[t] = transfer.receive_stage(SealedStore(connect(server), KEY), t, 1,
                                                stages[t][1], tmp_path / f"got{t}",
                                                timeout_s=30, window=3)
        receivers = [threading.Thread(target=receive, args=(t,), daemon=True) for t in stages]
        for receiver in receivers:
            receiver.start()
        senders = {t: _sending(SealedStore(connect(server), KEY), t, 1, tmp_path / f"sent{t}",
                               sums, window=3) for t, (_, sums) in stages.items()}
        for thread in receivers + [s["thread"] for s in senders.values()]:
            thread.join(60)
        assert results == {t: "" for t in stages}, results
        for t, (blobs, _) in stages.items():
            assert senders[t].get("sent") == sum(len(d) for d in blobs.values()), senders[t]
            for name, data in blobs.items():
                assert (tmp_path / f"got{t}" / "stage1" / name).read_bytes() == data, (t, name)
            assert _pieces_left(server, t, 1) == []
    assert server.num_keys() == before


def test_a_sender_that_fails_after_its_receiver_refused_leaves_nothing(server, tmp_path,
                                                                       monkeypatch):
    """The receiver refuses the stage (other files than announced) while the sender is
    between two pieces; the sender then fails to read its next piece before it reads the
    refusal: nobody will take what it put, so it leaves no piece and no stop behind."""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    monkeypatch.setattr(transfer, "read_pieces", _failing_after(3))
    checksums = _stage_files(tmp_path / "sent", 1, {"s.bin": b"s" * 1000})
    s = transfer.Stream.checkpoint(6, 1)

    class Held:  # the sender's store: its third piece waits until the receiver has ended
        def __init__(self, inner, gate):
            self.inner, self.gate = inner, gate

        def set(self, key, value):
            if key == s.piece(2):
                assert self.gate.wait(60)
            self.inner.set(key, value)

        def __getattr__(self, name):
            return getattr(self.inner, name)
    gate = threading.Event()
    sending = _sending(Held(SealedStore(connect(server), KEY), gate), 6, 1, tmp_path / "sent",
                       checksums, window=4, timeout_s=600)
    problem = transfer.receive_stage(SealedStore(connect(server), KEY), 6, 1,
                                     {"stage1/other.bin": "0" * 64}, tmp_path / "got",
                                     timeout_s=30, window=4)
    assert problem == "stage 1 sent other files than it reported"
    gate.set()
    sending["thread"].join(60)
    assert "s.bin: disk error" in str(sending.get("error")), sending
    assert _pieces_left(server, 6, 1) == []


def test_a_sender_gives_up_once_its_receivers_coordinator_is_gone_not_while_it_is_slow(
        server, tmp_path, monkeypatch):
    """The coordinating agent (its receive) dies mid-upload and says nothing: its lease lapses
    and the leader key goes, or names a successor. The sender gives up then, not at its
    timeout (600 s here), saying so, and leaves its stop in the list's place, where a
    successor that read the announcement again would start, and in the place of each piece
    the dead receiver did not take (a successor's receive that lags meets it there). A
    receiver that is merely slow (its office held throughout) is waited
    for however many of the sender's checks pass."""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    checksums = _stage_files(tmp_path / "sent", 1, {"s.bin": b"s" * 1000})  # 10 pieces
    server.set("leader", "agent0")
    checked = threading.Semaphore(0)

    def office() -> bytes | None:
        checked.release()
        return server.get("leader") if server.check(["leader"]) else None

    def sending(iteration: int) -> dict:
        watch = transfer.ReceiverWatch(office, every_s=0.05)
        return _sending(SealedStore(connect(server), KEY), iteration, 1, tmp_path / "sent",
                        checksums, window=4, timeout_s=600, receiver=watch)

    slow = sending(3)
    for _ in range(5):  # (the sender found the office held, five times over)
        assert checked.acquire(timeout=60)
    assert transfer.receive_stage(SealedStore(connect(server), KEY), 3, 1, checksums,
                                  tmp_path / "got", timeout_s=60, window=4) == ""
    slow["thread"].join(60)
    assert slow.get("sent") == 1000, slow
    for successor in ("vacant", "agent1"):
        orphan = sending(4)
        assert checked.acquire(timeout=60)  # (it waits for piece 0's acknowledgement)
        if successor == "vacant":
            server.delete_key("leader")  # the lease lapsed
        else:
            server.set("leader", successor)  # a successor took the office at once
        orphan["thread"].join(60)
        assert not orphan["thread"].is_alive(), "the sender waits for a receiver gone"
        error = orphan.get("error")
        assert isinstance(error, transfer.ReceiverGone), orphan
        assert "agent0" in str(error), error
        s = transfer.Stream.checkpoint(4, 1)
        assert SealedStore(connect(server), KEY).get(s.meta).startswith(transfer.STOP)
        # the stops (0-3: the pieces not taken, 0 also where a successor's receive waits
        # first; 4: the next piece), and only stops
        assert _pieces_left(server, 4, 1) == ["meta", "0", "1", "2", "3", "4"]
        for key in (s.meta, *[s.piece(i) for i in range(5)]):
            assert SealedStore(connect(server), KEY).get(key).startswith(transfer.STOP)
            server.delete_key(key)
        server.set("leader", "agent0")


def test_a_later_stage_of_a_node_waits_for_its_list_while_the_nodes_earlier_one_moves(
        server, tmp_path):
    """A node holding two stages announces both and sends them one after the other: the
    second's receive waited `timeout_s` for its file list, so a first stage that took
    longer to send lost the checkpoint. It waits on while pieces of that node's other
    streams are being taken (each turn of `timeout_s` that sees some), and no longer."""
    from spotpipe.checkpoint import transfer

    checksums = _stage_files(tmp_path / "sent", 1, {"s.bin": b"s" * 10})
    receiving = transfer.Receiving()
    turns = threading.Semaphore(0)

    result: dict = {}
    later = threading.Thread(target=lambda: result.update(problem=transfer.receive_stage(
        _WaitsSeen(SealedStore(connect(server), KEY), transfer.Stream.checkpoint(5, 1).meta,
                   turns.release), 5, 1, checksums, tmp_path / "got",
        timeout_s=0.3, node="node1", receiving=receiving)), daemon=True)
    later.start()
    for n in range(3):  # the node's earlier stage: a piece taken in each turn of the wait
        assert turns.acquire(timeout=30), f"the receive gave up after {n} turns"
        assert receiving.waiting("node1", f"earlier/{n}")
        receiving.done("node1", f"earlier/{n}")
    assert turns.acquire(timeout=30)
    sending = _sending(SealedStore(connect(server), KEY), 5, 1, tmp_path / "sent", checksums)
    later.join(60)
    sending["thread"].join(60)
    assert result == {"problem": ""} and sending.get("sent") == 10, (result, sending)
    # with nothing of the node moving, the wait is one turn of timeout_s, as before
    alone = transfer.receive_stage(SealedStore(connect(server), KEY), 6, 1, checksums,
                                   tmp_path / "got6", timeout_s=0.3, node="node1",
                                   receiving=receiving)
    assert "meta did not arrive" in alone, alone


def _two_pieces_taken(server, tmp_path, monkeypatch, receiver):
    """A sender of stage 1 of checkpoint 7 (10 pieces, window 4) watching the office of
    agent0, of which `receiver` took two pieces; returns once the sender waits for the third
    piece's acknowledgement (its stream, its `_sending` and the checksums)."""
    from spotpipe.checkpoint import transfer

    monkeypatch.setattr(transfer, "CHUNK", 100)
    checksums = _stage_files(tmp_path / "sent", 1, {"s.bin": b"s" * 1000})  # 10 pieces
    server.set("leader", "agent0")
    s = transfer.Stream.checkpoint(7, 1)
    watch = transfer.ReceiverWatch(
        lambda: server.get("leader") if server.check(["leader"]) else None, every_s=0.05)
    sending = _sending(SealedStore(connect(server), KEY), 7, 1, tmp_path / "sent", checksums,
                       window=4, timeout_s=600, receiver=watch)
    for n in range(2):
        transfer._take(receiver, s, n, 4, timedelta(seconds=30), "", None)
    landed(server, s.piece(5))  # (the sender went on to piece 5, and waits for ack 2)
    return s, sending, checksums


def test_a_successors_receive_under_way_ends_when_the_sender_gives_up_on_the_office(
        server, tmp_path, monkeypatch):
    """The coordinating agent took two pieces of a stage and died; its successor read the
    announcement again and started a receive, which read the file list (still there) and
    waits for the first piece, taken by the dead receiver long ago. The sender then gives up
    on the office change: its stop went in the list's place and the next piece's, so that
    receive waited out its whole timeout (`cluster.timeout_s`) for a piece that will never
    come. It ends at once, with the sender's reason."""
    from spotpipe.checkpoint import transfer

    dead = SealedStore(connect(server), KEY)  # the first coordinator: two pieces, then gone
    s, sending, checksums = _two_pieces_taken(server, tmp_path, monkeypatch, dead)
    at_first_piece = threading.Event()
    result: dict = {}
    successor = threading.Thread(target=lambda: result.update(problem=transfer.receive_stage(
        _WaitsSeen(SealedStore(connect(server), KEY), s.piece(0), at_first_piece.set), 7, 1,
        checksums, tmp_path / "got", timeout_s=3, window=4)), daemon=True)
    successor.start()
    assert at_first_piece.wait(30)
    server.set("leader", "agent1")  # the successor holds the office: the sender gives up
    sending["thread"].join(60)
    assert isinstance(sending.get("error"), transfer.ReceiverGone), sending
    successor.join(60)
    assert "lost its office" in result["problem"], result  # (not "... did not arrive")


def test_a_lagging_receive_ends_at_its_next_piece_when_the_sender_gives_up_on_the_office(
        server, tmp_path, monkeypatch):
    """A receive (the successor's, reading the announcement again) took two pieces and lags;
    the sender, four pieces ahead, gives up on the office change. It removed the pieces not
    taken, so that receive waited its whole timeout for piece 2; each is now the stop, and
    the receive ends there, with the sender's reason, and leaves no piece behind."""
    from spotpipe.checkpoint import transfer

    lagging = SealedStore(connect(server), KEY)
    s, sending, _ = _two_pieces_taken(server, tmp_path, monkeypatch, lagging)
    server.set("leader", "agent1")
    sending["thread"].join(60)
    assert isinstance(sending.get("error"), transfer.ReceiverGone), sending
    with pytest.raises(transfer._Ended, match="lost its office"):  # (not a 3 s timeout)
        transfer._take(lagging, s, 2, 4, timedelta(seconds=3), "", None)
    # what stays (until the job's end) is stops, no more keys than the pieces were
    assert _pieces_left(server, 7, 1) == ["meta", "0", "3", "4", "5", "6"]
    assert all(lagging.get(key).startswith(transfer.STOP)
               for key in (s.meta, *[s.piece(i) for i in (0, 3, 4, 5, 6)]))


class _WithOffice:
    """A TCPStore connection that reads keys as etcd's store does without waiting
    (`wait_until` for 0 s): where a sender's `ReceiverWatch` reads the coordinator's office."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def wait_until(self, keys, done, timeout_s):
        values = {k: self.inner.get(k) for k in keys if self.inner.check([k])}
        return values if done(values) else None

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_final_parameters_upload_gives_up_once_the_coordinators_office_is_lost(
        server, tmp_path, monkeypatch):
    """A worker under an agent sends its final stage to the coordinating agent's --out
    (`final_sender`); that agent dies before it answers. The sender watched nothing and
    waited `cluster.timeout_s` for the verdict (3 s here; 600 by default), where a
    checkpoint's upload gives up once the office is vacant or a successor's."""
    import types

    from spotpipe.checkpoint import transfer
    from spotpipe.cli.worker import final_sender
    from spotpipe.protocol import keys

    monkeypatch.setenv("SPOTPIPE_FINAL_UPLOAD", "1")
    server.set(keys.LEADER, "1")
    cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(timeout_s=3.0),
                                failover=types.SimpleNamespace(heartbeat_s=0.05))
    posted: list = []
    send = final_sender(cfg, "node0", _WithOffice(connect(server)),
                        types.SimpleNamespace(key=KEY), types.SimpleNamespace(post=posted.append))
    path = tmp_path / "stage0.safetensors"
    path.write_bytes(b"p" * 10)
    out: dict = {}

    def sending() -> None:
        try:
            send(0, path)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc
    thread = threading.Thread(target=sending, daemon=True)
    thread.start()
    landed(server, transfer.Stream.final(0).piece(0))  # (announced: it waits for the verdict)
    assert [p.stage for p in posted] == [0]
    server.delete_key(keys.LEADER)  # the coordinating agent's lease lapsed
    thread.join(60)
    assert isinstance(out.get("error"), transfer.ReceiverGone), out
    assert "agent 1" in str(out["error"]) and "(vacant)" in str(out["error"])
