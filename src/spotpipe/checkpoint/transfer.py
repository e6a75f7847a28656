"""Stage files of a durable checkpoint carried to the committing host through the job's store.

Under `spotpipe agent`, the coordinating agent commits every checkpoint in its own
`checkpoint.dir`. When another host does not see that folder (the probe each agent makes at
start says so), its workers write their stage as usual, announce it (`StageUpload`) and stream
its files through the store in pieces (etcd refuses requests over 1.5 MiB), on a thread of
their own (`schemes.Uploader`). The coordinator's committer takes the pieces as they come,
checks each file's SHA-256 against the checksums the worker announced, writes and fsyncs them
into the uncommitted folder, and gives its verdict; the worker reports the stage
(`CheckpointSaved`) once it has heard it. A file that is missing or damaged fails the whole
checkpoint: nothing of that iteration is committed.

Flow control: the sender puts piece n only once the receiver has taken piece n - WINDOW, so
the store holds WINDOW pieces of a stage, and each end one piece in memory: a stage is GBs for
real models, and a TCPStore keeps its keys in its host's memory. Whichever end stops early
says so where the other waits next (a stop in place of the next piece, or of the next
acknowledgement), and the coordinator's loop puts one there for a sender it counts lost
(`Receiving`), so that nobody waits out `cluster.timeout_s` for a peer that is gone. A
receiver whose host is lost says nothing: its sender watches the coordinator's office instead
(`ReceiverWatch`: on etcd, the leader key, under the coordinating agent's lease), and gives up
once the office is no longer the one it sent to (vacant, or a successor's), not while a slow
receiver still holds it. (On the c10d store the store lives with the coordinator: its loss
ends the sender's wait by itself.)
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError

from spotpipe.checkpoint.fsync import fsync_path, sha256_file
from spotpipe.protocol import FinalUpload
from spotpipe.protocol.keys import LEADER
from spotpipe.protocol.auth import Refused

CHUNK = 512 * 1024  # etcd refuses requests over 1.5 MiB; base64 makes 512 KiB about 683 KiB
WINDOW = 8  # pieces of one stage in the store at once (4 MiB), whatever the stage's size
DATA, STOP = b"D", b"X"  # a piece's first byte: its bytes follow, or why the stream ends


class UploadRefused(RuntimeError):
    """The committing host did not take a stage (its reason)."""


class ReceiverGone(RuntimeError):
    """The coordinator that took a stage's announcement lost its office mid-upload: its
    receive will take no more pieces."""


class ReceiverWatch:
    """Whether the coordinator a sender streams to still holds its office, as the store tells
    (`office`: the leader key's value now, None while vacant), checked every `every_s` of a
    wait for the receiver. The office it holds when the sender starts is the receiver's (one
    vacant then is the next holder's, who reads the announcement from the mailbox)."""

    def __init__(self, office: Callable[[], bytes | None], every_s: float) -> None:
        self._office, self.every_s = office, every_s
        self.holder = office()

    @classmethod
    def of(cls, store: Any, every_s: float) -> ReceiverWatch | None:
        """The watch for `store` (sealed or not); None where there is no office to watch:
        the c10d store lives in the coordinator's process, and a wait on it ends with it."""
        raw = getattr(store, "inner", store)
        if not hasattr(raw, "wait_until"):  # (etcd's: a read that does not wait, below)
            return None
        return cls(lambda: (raw.wait_until([LEADER], lambda _: True, 0.0) or {}).get(LEADER),
                   every_s)

    def gone(self) -> str:
        """Why the receiver is gone ("" while its coordinator holds the office)."""
        now = self._office()
        if self.holder is None:
            self.holder = now
            return ""
        if now == self.holder:
            return ""
        who = self.holder.decode(errors="replace")
        return (f"the coordinator that took the stage (agent {who}) lost its office mid-upload "
                + ("(vacant)" if now is None else
                   f"(now agent {now.decode(errors='replace')}'s)"))


class _Ended(Exception):
    """The stream ends before its last piece: the sender gave up, was lost, or is too late."""


@dataclass(frozen=True)
class Stream:
    """The store keys of one stage's files on their way: their list, their pieces in order
    across the files, the receiver's acknowledgements and its verdict."""

    base: str
    stage: int

    @classmethod
    def checkpoint(cls, iteration: int, stage: int) -> "Stream":
        return cls(f"spotpipe/checkpoint/files/{iteration}", stage)

    @classmethod
    def resume(cls, agent: int) -> "Stream":
        """A whole checkpoint, to an agent whose host lacks the job's --resume."""
        return cls("spotpipe/resume", agent)

    @classmethod
    def final(cls, stage: int) -> "Stream":
        """The run's final parameters of one stage, for the coordinating agent's `--out`."""
        return cls("spotpipe/final", stage)

    def key(self, part: str) -> str:
        return f"{self.base}/{self.stage}/{part}"

    @property
    def meta(self) -> str:
        return self.key("meta")

    @property
    def verdict(self) -> str:
        return self.key("verdict")

    def piece(self, n: int) -> str:
        return self.key(str(n))

    def ack(self, n: int) -> str:
        return self.key(f"ack{n}")


def pieces_of(size: int) -> int:
    """How many pieces a file of `size` bytes travels in (an empty file: one empty piece)."""
    return max(1, -(-size // CHUNK))


def send_stage(store: Any, iteration: int, stage: int, folder: Path,
               checksums: dict[str, str], *, timeout_s: float, window: int = WINDOW,
               receiver: ReceiverWatch | None = None) -> int:
    """`send` of one stage of the checkpoint of `iteration`."""
    return send(store, Stream.checkpoint(iteration, stage), folder, checksums,
                timeout_s=timeout_s, window=window, receiver=receiver)


def receive_stage(store: Any, iteration: int, stage: int, checksums: dict[str, str],
                  folder: Path, *, timeout_s: float, window: int = WINDOW, node: str = "",
                  receiving: Receiving | None = None) -> str:
    """`receive` of one stage of the checkpoint of `iteration`."""
    return receive(store, Stream.checkpoint(iteration, stage), checksums, folder,
                   timeout_s=timeout_s, window=window, node=node, receiving=receiving,
                   within=f"stage{stage}")


def send_final(store: Any, post: Callable[[FinalUpload], None], node: str, stage: int,
               path: Path, *, timeout_s: float, receiver: ReceiverWatch | None = None) -> int:
    """Send the final parameters of `stage`, written by `node` at `path`, to the coordinating
    agent's `--out`: announced (`FinalUpload`, which starts the receiver) and streamed like a
    checkpoint's stage. The worker that wrote it sends it, while its beats say "finishing":
    the send, however long, is judged as the node is (a host lost meanwhile stops beating),
    and each stage goes once, from its one writer. (An agent that sent its workers' files
    after their exits sent a stage once per worker of its host, two sends on one stream's
    keys, and beat for none of them.) With `receiver` (made before the announcement: the
    office then is the receiver's), it gives up once the coordinating agent loses its office,
    as a checkpoint's stage does."""
    sha = sha256_file(path)
    post(FinalUpload(node, stage, sha))
    return send(store, Stream.final(stage), path.parent, {path.name: sha}, timeout_s=timeout_s,
                receiver=receiver)


def send(store: Any, s: Stream, folder: Path, checksums: dict[str, str], *,
         timeout_s: float, window: int = WINDOW, receiver: ReceiverWatch | None = None) -> int:
    """Send the files of one written stage (`checksums`' names, relative to the iteration's
    folder `folder`) through the store (sealed: `store/sealed.py`); return the bytes sent once
    the committing host has written and checked all of them (`receive_stage`), or raise
    UploadRefused with its reason.

    Each file is read a piece at a time, and piece n goes only once the receiver has taken
    piece n - `window`: the store holds `window` pieces of the stage, not the stage (a TCPStore
    keeps its keys in its host's memory; etcd has a quota), and neither end holds more than a
    piece. The receiver starts when the worker's `StageUpload` reaches the coordinator, and
    every one it is told of runs, so a sender waits at most `timeout_s` for each piece's turn,
    and with `receiver`, only while the receiver's coordinator holds its office
    (ReceiverGone once it does not)."""
    timeout = timedelta(seconds=timeout_s)
    n = sent = 0
    listed = unheard = False  # (the list is out; waiting for the receiver)
    try:
        files = [(name, pieces_of((folder / name).stat().st_size)) for name in sorted(checksums)]
        store.set(s.meta, json.dumps({"files": [list(f) for f in files]}))
        listed = True
        for name, parts in files:
            count = 0
            for part in read_pieces(folder / name):
                if count == parts:
                    raise OSError(f"{name} grew while it was sent")
                if n >= window:
                    unheard = True
                    _acknowledged(store, s, n - window, timeout, receiver)
                    unheard = False
                store.set(s.piece(n), DATA + part)
                n, count, sent = n + 1, count + 1, sent + len(part)
            if count != parts:
                raise OSError(f"{name} shrank while it was sent")
        unheard = True
        _await(store, s.verdict, timeout, receiver)
        verdict = store.get(s.verdict).decode(errors="replace")
    except UploadRefused:  # a stop from the receiver: it has ended, and reads no stop of ours
        _take_back(store, s, n, window)
        raise
    except BaseException as exc:
        _give_up(store, s, n, window, f"the sender gave up: {exc}"[:300], listed=listed,
                 unheard=unheard)
        raise
    if verdict:  # (what the receiver did not take, if it refused before the end)
        _take_back(store, s, n, window)
        raise UploadRefused(verdict)
    for key in [s.ack(i) for i in range(max(0, n - window), n)] + [s.verdict]:
        store.delete_key(key)
    return sent


def _acknowledged(store: Any, s: Stream, n: int, timeout: timedelta,
                  receiver: ReceiverWatch | None) -> None:
    _await(store, s.ack(n), timeout, receiver)
    answer = store.get(s.ack(n))
    if answer.startswith(STOP):
        # the receiver writes its verdict right after this stop (`_refuse`): waited for, so
        # that taking back what this end put removes it too (it stayed behind when it came
        # after the take-back: seen in a two-process CI run)
        try:
            _await(store, s.verdict, timeout, receiver)
        except (DistStoreError, ReceiverGone):
            pass  # (the receiver ended between the two: nothing more comes)
        raise UploadRefused(answer[1:].decode(errors="replace"))


def _await(store: Any, key: str, timeout: timedelta, receiver: ReceiverWatch | None) -> None:
    """Wait up to `timeout` for the receiver's `key`, in turns of `receiver.every_s` between
    which its coordinator's office is checked: ReceiverGone once it is lost (a timed-out wait
    leaves the connection usable, on etcd as on a TCPStore)."""
    if receiver is None:
        store.wait([key], timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([key], timedelta(seconds=max(0.001, min(left, receiver.every_s))))
            return
        except DistStoreError:  # a turn without the key (the store gone: raised at once)
            if left <= receiver.every_s:
                raise
        why = receiver.gone()
        if why:
            raise ReceiverGone(why)


def _take_back(store: Any, s: Stream, n: int, window: int) -> None:
    """Remove what a sender of `n` pieces put and the receiver, which has ended, did not
    take. Best effort: the store may be what failed."""
    try:  # (pieces before n - window were taken: piece n - 1 went after their acknowledgement)
        for key in [s.meta, s.verdict] + [s.piece(i) for i in range(max(0, n - window), n)] + \
                [s.ack(i) for i in range(max(0, n - 2 * window), n + 1)]:
            store.delete_key(key)
    except Exception:  # noqa: BLE001 - the error that stopped the upload is the one to report
        pass


def _give_up(store: Any, s: Stream, n: int, window: int, why: str, *, listed: bool,
             unheard: bool) -> None:
    """A sender that stops early (after `n` pieces) says `why` where the receiver waits next,
    so that it ends now instead of at its timeout, and with it the committer behind it.

    Its own failure (a file it cannot read, or that changed): the pieces the receiver has not
    taken yet stay for it to take, and the stop goes after them, or in the list's place when
    the list did not go: the receiver may be that far behind, or not started yet (it starts
    when the loop reads the announcement), and a piece removed under it would hold it for
    `timeout_s`. The receiver removes the stop when it meets it (`receive`). A receiver that
    has ended (its verdict is there) takes nothing more: what it did not take is removed.
    When the receiver did not answer in time (`unheard`: it may never come, or its
    coordinator lost the office), each piece it has not taken is replaced by the stop, and
    the stop goes in the next piece's place, the list's, and the first piece's too: a
    successor's receive that read the list before the stop waits for piece 0, which the
    receiver before it took long ago, and one that lags waits for the first piece it has not
    taken (removed, it waited `cluster.timeout_s` for it). No more keys than the pieces took.
    A stop the store does not take: everything is removed. Best effort: the store may be
    what failed."""
    stop = STOP + why.encode()
    try:
        if store.check([s.verdict]):  # (it refused what came, and this end has not read it)
            _take_back(store, s, n, window)
            return
        if not unheard:
            store.set(s.piece(n) if listed else s.meta, stop)
            return
        untaken = [s.piece(i) for i in range(max(0, n - window), n) if store.check([s.piece(i)])]
        _take_back(store, s, n, window)
        for key in dict.fromkeys([*untaken, s.piece(n), s.meta, s.piece(0)]):
            store.set(key, stop)
    except Exception:  # noqa: BLE001 - the error that stopped the upload is the one to report
        _take_back(store, s, n, window)


def read_pieces(path: Path) -> Iterator[bytes]:
    """The file in pieces of at most CHUNK bytes (one empty piece for an empty file)."""
    with open(path, "rb") as f:
        part = f.read(CHUNK)
        yield part
        while part := f.read(CHUNK):
            yield part


class FileWriter:
    """A file written as its pieces come, hashed on the way and fsynced at the end: the
    receiver holds a piece at a time, not the file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self._file, self._digest = path, open(path, "wb"), hashlib.sha256()

    def write(self, part: bytes) -> None:
        self._digest.update(part)
        self._file.write(part)

    def close(self, sha256: str) -> str:
        """"" when the bytes have the SHA-256 `sha256`, else what is wrong (the file removed)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._digest.hexdigest() != sha256:
            self.path.unlink(missing_ok=True)
            return f"{self.path.name} arrived damaged (checksum differs)"
        fsync_path(self.path.parent)
        return ""

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class Receiving:
    """Which pieces the committing host waits for, by sending node, so that the coordinator's
    loop can end the waits when it counts that node lost: a sender that died mid-stage would
    otherwise hold the committer (and every commit after it) for `cluster.timeout_s`. A node
    may have several streams under way (a worker that holds two stages announces both at
    once and sends them one after the other): each of their waits is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, set[str]] = {}  # node -> the keys of the pieces awaited
        self._lost: set[str] = set()
        self._moved: dict[str, int] = {}  # node -> waits of its streams ended so far

    def waiting(self, node: str, key: str) -> bool:
        """About to wait for `key` from `node`; False when `node` is lost already."""
        with self._lock:
            if node in self._lost:
                return False
            self._waiting.setdefault(node, set()).add(key)
            return True

    def lose(self, node: str, store: Any) -> None:
        """`node` is gone: a stop in place of each piece awaited from it (sealed `store`)."""
        with self._lock:
            if node in self._lost:
                return
            self._lost.add(node)
            for key in sorted(self._waiting.pop(node, ())):
                store.set(key, STOP + f"{node} was lost while it sent its stage".encode())

    def moved(self, node: str) -> int:
        """How many waits for `node`'s pieces have ended (a count that grows while any of
        its streams moves: `_list_arrived`)."""
        with self._lock:
            return self._moved.get(node, 0)

    def done(self, node: str, *keys: str) -> None:
        """No longer waiting for `keys` from `node` (taken, or the receive ended)."""
        with self._lock:
            self._moved[node] = self._moved.get(node, 0) + 1
            awaited = self._waiting.get(node, set())
            awaited.difference_update(keys)
            if not awaited:
                self._waiting.pop(node, None)


def receive(store: Any, s: Stream, checksums: dict[str, str], folder: Path, *,
            timeout_s: float, window: int = WINDOW, node: str = "",
            receiving: Receiving | None = None, within: str = "") -> str:
    """Write the stage's files from the store into `folder` (the iteration's uncommitted
    folder) as their pieces come, each file checked against `checksums`; "" when whole, else
    what is wrong. With `within`, every file must be in that subfolder of `folder` (a stage's
    own: one that named another stage's files would overwrite them). Each piece is taken out
    of the store and acknowledged at once (the sender waits for that, `send_stage`), also
    after a problem, so that the sender is never left waiting: it hears the verdict. `store`
    is sealed (`store/sealed.py`): a record written without the job's key is what is wrong,
    never a crash."""
    stage = s.stage
    timeout = timedelta(seconds=timeout_s)
    taken = 0
    out: FileWriter | None = None
    try:
        _list_arrived(store, s.meta, timeout, node, receiving)
        _no_longer_waiting(node, s.meta, receiving)  # (the sender is there: its list came)
        files = _file_list(store, s, stage, checksums, within)
        problem = ""
        for name, parts in files:
            out = FileWriter(folder / name) if not problem else None
            for _ in range(parts):
                try:
                    part = _take(store, s, taken, window, timeout, node, receiving)
                except Refused as why:
                    problem, part = problem or str(why), None
                taken += 1
                if out is not None and part is None:
                    out.discard()
                    out = None
                elif out is not None:
                    out.write(part)  # type: ignore[arg-type]
            if out is not None:
                problem, out = out.close(checksums[name]), None
    except UploadRefused as why:  # the file list: told to the sender at its next wait
        _refuse(store, s, taken, window, str(why))
        return str(why)
    except _Ended as why:  # the sender is gone, or gave up: nobody waits for a verdict
        _clear_after_stop(store, s, taken, window)
        return str(why)
    except Exception as exc:  # noqa: BLE001 - the store or this disk failed: not whole
        why = f"the files of stage {stage}: {str(exc).splitlines()[0][:300]}"
        try:  # (a full disk here: the sender stops at its next wait instead of its timeout)
            _refuse(store, s, taken, window, why)
        except Exception:  # noqa: BLE001 - the store itself is what failed
            pass
        return why
    finally:
        if out is not None:  # ended half-way through a file: no file of the checkpoint
            out.discard()
        if receiving is not None:  # (what it waited for when it ended, if anything)
            receiving.done(node, s.meta, s.piece(taken))
    store.delete_key(s.meta)
    store.set(s.verdict, problem)
    return problem


def _clear_after_stop(store: Any, s: Stream, taken: int, window: int) -> None:
    """Remove the stream's keys once a stop ended it (or the wait for a piece did): the last
    acknowledgements, and the pieces a sender may have put past this end's place, its stop
    among them (`_give_up`: up to `window` ahead)."""
    for key in [s.meta] + [s.ack(i) for i in range(max(0, taken - window), taken)] + \
            [s.piece(i) for i in range(taken, taken + window + 1)]:
        store.delete_key(key)


def _file_list(store: Any, s: Stream, stage: int, checksums: dict[str, str],
               within: str) -> list[tuple[str, int]]:
    try:
        raw = store.get(s.meta)
        if raw.startswith(STOP):  # the loop's, for a sender lost before its list came
            raise _Ended(raw[1:].decode(errors="replace"))
        body = json.loads(raw)
        files = [(str(name), int(parts)) for name, parts in body["files"]]
    except Refused as why:
        raise UploadRefused(f"the files of stage {stage}: {why}") from None
    except (ValueError, KeyError, TypeError):
        raise UploadRefused(f"the files of stage {stage}: an unreadable file list") from None
    if sorted(name for name, _ in files) != sorted(checksums):
        raise UploadRefused(f"stage {stage} sent other files than it reported")
    astray = [name for name, _ in files if outside(name, within)]
    if astray:
        raise UploadRefused(f"stage {stage} sent a file outside its folder: {astray[0]!r}")
    if any(parts < 1 for _, parts in files):
        raise UploadRefused(f"stage {stage}: a file in no pieces")
    return files


def outside(name: str, within: str = "") -> bool:
    """Whether the file `name` (a path relative to a checkpoint's folder) is not a plain
    relative path (none of its parts empty, "." or ".."), or not in the subfolder `within`
    (a stage's, "stage3"; "": anywhere in the folder). A stage's files named otherwise would
    be written, or committed, over another stage's or outside the checkpoint."""
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return True
    return bool(within) and (len(parts) < 2 or parts[0] != within)


def _list_arrived(store: Any, key: str, timeout: timedelta, node: str,
                  receiving: Receiving | None) -> None:
    """The file list's wait. A node sends the stages it announced one after the other (a
    node that took over a stage holds two), so a later one's list comes only once the
    earlier ones are through, however long they take: the wait goes on for another
    `timeout` each time one ends while pieces of that node's other streams were being taken
    (`Receiving.moved`), and ends as any other at the node's loss."""
    while True:
        moved = receiving.moved(node) if receiving is not None else 0
        try:
            _arrived(store, key, timeout, node, receiving)
            return
        except _Ended:
            if receiving is None or receiving.moved(node) == moved:
                raise


def _arrived(store: Any, key: str, timeout: timedelta, node: str,
             receiving: Receiving | None) -> None:
    if receiving is not None and not receiving.waiting(node, key):
        raise _Ended(f"{node} was lost while it sent its stage")
    try:
        store.wait([key], timeout)
    except Exception as exc:  # noqa: BLE001 - a timeout, or the store gone
        raise _Ended(f"{key} did not arrive ({str(exc).splitlines()[0][:200]})") from None


def _take(store: Any, s: Stream, n: int, window: int, timeout: timedelta, node: str,
          receiving: Receiving | None) -> bytes:
    """Piece n's bytes, taken out of the store and acknowledged (Refused: not sealed)."""
    key = s.piece(n)
    _arrived(store, key, timeout, node, receiving)
    try:
        raw = store.get(key)
    except Refused:
        _no_longer_waiting(node, key, receiving)
        store.delete_key(key)
        _acknowledge(store, s, n, window)  # (the sender goes on, and hears the verdict)
        raise
    _no_longer_waiting(node, key, receiving)
    store.delete_key(key)
    if raw.startswith(STOP):
        raise _Ended(raw[1:].decode(errors="replace"))
    _acknowledge(store, s, n, window)
    if not raw.startswith(DATA):
        raise Refused(f"{key}: not a piece of a stage")
    return raw[1:]


def _no_longer_waiting(node: str, key: str, receiving: Receiving | None) -> None:
    """Between reading a piece and removing it: a stop the loop writes up to here lands on
    the piece and goes with it; from here on the loop writes none for it (`Receiving`)."""
    if receiving is not None:
        receiving.done(node, key)


def _acknowledge(store: Any, s: Stream, n: int, window: int) -> None:
    store.set(s.ack(n), DATA)
    if n >= window:  # (the sender has read it: it wrote piece n after it)
        store.delete_key(s.ack(n - window))


def _refuse(store: Any, s: Stream, taken: int, window: int, why: str) -> None:
    """Stop the sender at its next wait (the acknowledgement of piece `taken`, or the verdict)
    and remove what it put that this end did not take: with the window, pieces up to
    `taken + window`."""
    store.set(s.ack(taken), STOP + why.encode())
    store.set(s.verdict, why)
    for key in [s.meta] + [s.piece(i) for i in range(taken, taken + window)]:
        store.delete_key(key)


# ---------------------------------------------------------------------- is the folder shared?

def probe_name(job: str) -> str:
    return f".spotpipe-probe-{job}"


def check_writable(root: Path) -> None:
    """Write, read back and remove a file in `root` (OSError when it cannot be done)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".spotpipe-probe-{os.getpid()}"
    nonce = os.urandom(16).hex()
    path.write_text(nonce)
    try:
        if path.read_text() != nonce:
            raise OSError(f"{path}: reads back other bytes than were written")
    finally:
        path.unlink(missing_ok=True)


def sees_probe(root: Path, job: str, nonce: str) -> bool:
    """Whether `root` holds the probe the committing host wrote (the same folder, shared)."""
    try:
        return (root / probe_name(job)).read_text() == nonce
    except OSError:
        return False
