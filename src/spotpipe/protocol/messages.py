"""Every message between workers, shadows, agents and the coordinator, as typed data.

Each message is a frozen dataclass with a `TYPE` (its name on the wire) and a `VERSION`.
`to_json` gives the body that `spotpipe.protocol.auth` seals; `from_json` checks every field
against the dataclass's annotations and raises `MessageError` naming the field, so a reader
can drop a malformed record with an event instead of failing on a KeyError somewhere deep in
the coordinator. Fields that are themselves structured (a layout, a list of moves) are checked
here as JSON shapes and parsed by the layer that owns them (`spotpipe.plan.recovery`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from spotpipe.protocol.auth import proof, same_secret
from spotpipe.protocol.bounds import Unreadable, load_record

JSON = Any  # a JSON value: checked as such, interpreted by its owner


class MessageError(ValueError):
    """A message body that does not match its type."""


M = TypeVar("M", bound="Message")


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    def to_json(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls: type[M], body: Any, version: int | None = None) -> M:
        if version is not None and version != cls.VERSION:
            raise MessageError(f"{cls.TYPE}: unknown version {version} (this build reads "
                               f"version {cls.VERSION})")
        if not isinstance(body, dict):
            raise MessageError(f"{cls.TYPE}: body is not an object")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in body:
                if f.default is not dataclasses.MISSING or \
                        f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    continue
                raise MessageError(f"{cls.TYPE}: missing field {f.name!r}")
            values[f.name] = _check(body[f.name], hints[f.name], f"{cls.TYPE}.{f.name}")
        unknown = sorted(set(body) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise MessageError(f"{cls.TYPE}: unknown field(s) {', '.join(unknown)}")
        return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` as the annotation `hint` wants it (lists become tuples for tuple hints)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return _json_value(value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        last: MessageError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, where)
            except MessageError as exc:
                last = exc
        raise last or MessageError(f"{where}: unexpected null")
    if hint is bool:
        if not isinstance(value, bool):
            raise MessageError(f"{where}: expected true or false, got {_show(value)}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise MessageError(f"{where}: expected an integer, got {_show(value)}")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value):
            raise MessageError(f"{where}: expected a finite number, got {_show(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise MessageError(f"{where}: expected a string, got {_show(value)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list, got {_show(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:  # (a pair: its length too)
            if len(value) != len(args):
                raise MessageError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_check(v, a, f"{where}[{i}]")
                         for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object, got {_show(value)}")
        item = args[1] if len(args) == 2 else Any
        return {str(k): _check(v, item, f"{where}.{k}") for k, v in value.items()}
    raise MessageError(f"{where}: cannot check a field of type {hint!r}")  # a bug of ours


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise MessageError(f"{where}: not a finite number")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _json_value(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _json_value(v, f"{where}.{k}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------- worker -> coordinator

@dataclass(frozen=True)
class Report(Message):
    """Where a node stands after a failure or at a boundary, for the generation's agreement."""

    TYPE: ClassVar[str] = "report"
    node: str
    generation: int
    boundary: bool  # a change at an iteration boundary (every node saw the commit's flag)
    iteration: int
    position: int
    instruction: str
    committed_through: int
    stepped_through: int
    done: tuple[tuple[Any, ...], ...]  # what it finished of the iteration in flight
    # the committed iteration's clipping scale; "skip" when its step was skipped on every
    # node (non-finite gradients: the runtime's NaN scale, which JSON cannot carry)
    clip_scale: float | str | None
    flight: int  # the iteration in flight (-1: none)
    formed: bool  # False: the last plan failed before this node's generation formed
    lacking: tuple[str, ...]  # what the plan being carried out was to give it, and did not
    untouched: bool  # nothing of that plan changed this node's state yet
    replica: int | None  # the stage whose replica it holds (None: none)
    leaving: bool  # a preemption notice: it leaves
    reason: str
    time_s: float
    # the committed iteration's gradient norm (None: unknown here, or not finite)
    committed_grad_norm: float | None = None
    # a last stage's owner: the newest iteration whose loss it computed whole but did not
    # post as Metrics (-1: none; a failure cut the posting short), and its pipeline's share
    # of that loss (None: not finite). Should that iteration be committed, the coordinator
    # writes its metrics line from these (`spotpipe.cluster.recovered_metrics`).
    unposted_iteration: int = -1
    unposted_loss: float | None = None


@dataclass(frozen=True)
class JoinRequest(Message):
    """A node asking to join a running job. Its seal proves it holds the job's key (that is,
    the token); the token itself is not in it."""

    TYPE: ClassVar[str] = "join"
    node: str
    time_s: float
    config_digest: str
    model_digest: str
    config_keys: dict[str, str] = field(default_factory=dict)  # Config.key_digests()


@dataclass(frozen=True)
class Metrics(Message):
    """One iteration's figures, from the last stage's owner in pipeline 0."""

    TYPE: ClassVar[str] = "metrics"
    iter: int
    loss: float | None  # None: non-finite (see training.nonfinite)
    samples: int
    time_s: float
    iter_time_s: float
    samples_per_s: float
    lr: float
    grad_norm: float | None
    live_nodes: int  # the nodes that run stages (the layout's)
    carriers: int
    generation: int
    replica_lag: int | None = None
    standby: int = 0  # the nodes waiting on standby beside them


@dataclass(frozen=True)
class Notice(Message):
    """A node got a preemption notice (`source`: the signal or the cloud's service) during
    `generation`; it leaves at the next iteration boundary. Sent at once, not at that boundary,
    so that the coordinator can have the next generation's groups formed meanwhile
    (`Prepare`)."""

    TYPE: ClassVar[str] = "notice"
    node: str
    generation: int
    source: str
    time_s: float


@dataclass(frozen=True)
class Event(Message):
    """A cluster event for events.jsonl: `kind`, `node`, `time_s`, and free details (JSON)."""

    TYPE: ClassVar[str] = "event"
    kind: str
    node: str
    time_s: float
    details: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The line of events.jsonl."""
        return {"time_s": self.time_s, "kind": self.kind, "node": self.node, **self.details}


@dataclass(frozen=True)
class CheckpointSaved(Message):
    """A stage of a durable checkpoint is on disk, with its files' checksums."""

    TYPE: ClassVar[str] = "checkpoint_saved"
    node: str
    time_s: float
    iteration: int
    stage: int
    checksums: dict[str, str]
    # the layer ranges of the stages the iteration ran with: the checkpoint is cut by them,
    # whatever the job's partition when the coordinator hears of the stage (a re-partition
    # can come between an asynchronous write and its report)
    partition: tuple[tuple[int, int], ...]
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageUpload(Message):
    """A stage of a durable checkpoint is on its way through the store (its host does not see
    the committing host's folder): take its pieces as they come (`checkpoint/transfer.py`).
    Its `CheckpointSaved` follows once all of it has been taken."""

    TYPE: ClassVar[str] = "stage_upload"
    node: str
    time_s: float
    iteration: int
    stage: int
    checksums: dict[str, str]


# the most of an exit's cause a record may carry: a sentence or two (the fork server's end,
# the host); the coordinator writes it into the job's log line, events and final message
EXIT_CAUSE_CHARS = 400


def plain_text(text: str, limit: int) -> str:
    """`text` as one line of plain text of at most `limit` characters: what a sender puts in
    a field whose reader refuses anything else (`Exit.cause`). Characters that are not
    printable (newlines, terminal escapes, bidirectional overrides) become spaces."""
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Exit(Message):
    """A worker process ended, as its host's agent saw it. `cause`: what the agent knows of
    why, beyond the code (its fork server's end, which killed it; "": nothing more), shown
    where the local launcher shows its own (the job's log line, events and final message).
    It comes from another host through the store: refused unless it is one line of at most
    `EXIT_CAUSE_CHARS` printable characters, so that it cannot forge lines of the job's
    output or flood it."""

    TYPE: ClassVar[str] = "exit"
    node: str
    code: int
    cause: str = ""

    def __post_init__(self) -> None:
        if len(self.cause) > EXIT_CAUSE_CHARS:
            raise MessageError(f"exit.cause: {len(self.cause)} characters, over the "
                               f"{EXIT_CAUSE_CHARS} allowed")
        if not self.cause.isprintable():
            raise MessageError(f"exit.cause: not one line of plain text: {_show(self.cause)}")


@dataclass(frozen=True)
class Close(Message):
    """The coordinator is done with its mailbox (its reader thread may end)."""

    TYPE: ClassVar[str] = "close"


@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness and progress. No clock: its age is measured by the coordinator when a new beat
    arrives, on the coordinator's own clock, so clocks of other hosts do not matter."""

    TYPE: ClassVar[str] = "heartbeat"
    node: str
    state: str  # starting | busy | waiting | finishing (only busy can be hung)
    generation: int
    iteration: int = -1
    position: int = 0
    step: str = ""  # between instructions: the step it takes (`runtime.activity`)


@dataclass(frozen=True)
class Stalled(Message):
    """A node's own word that its main thread has computed at one instruction, without
    waiting on anything, for `still_s` seconds (its hang timeout), measured on its own clock
    from the moment the instruction began. It comes through the mailbox, which the coordinator
    reads as records arrive, so a hang is acted on at the timeout itself rather than at the
    next beat and check; the coordinator's own judgement from heartbeats remains for a node
    that cannot say so. It can fence only its writer."""

    TYPE: ClassVar[str] = "stalled"
    node: str
    generation: int
    iteration: int
    position: int
    still_s: float
    time_s: float
    step: str = ""  # stalled between instructions, in this step (carrying out a Decision)


# --------------------------------------------------------------------- coordinator -> nodes

@dataclass(frozen=True)
class Abort(Message):
    """A generation is over: every wait of it ends."""

    TYPE: ClassVar[str] = "abort"
    generation: int
    reason: str


@dataclass(frozen=True)
class Regroup(Message):
    """Change the layout at the next iteration boundary (a node joined; it can improve).
    `ended`: the generation ended (the coordinator's last record of the board, after its
    Decision), so a node's watcher of the board, which reads on past a first `Regroup` for
    the `Prepare`s after it, stops there."""

    TYPE: ClassVar[str] = "regroup"
    generation: int
    reason: str
    ended: bool = False


@dataclass(frozen=True)
class Prepare(Message):
    """Form the groups of `layout` (`plan.Layout` as JSON) for generation `generation + 1`
    now, while generation `generation` trains: the layout the planner gives the next
    boundary when it is known early (a node with a notice leaves, a node joined, the layout
    can improve). Posted on the generation's regroup board, and on the answer board of each
    waiting node it places. A guess, not an order: the nodes take these groups only if the
    Decision says so (`DecisionRecord.prepared`)."""

    TYPE: ClassVar[str] = "prepare"
    generation: int
    layout: dict[str, Any]


@dataclass(frozen=True)
class DecisionRecord(Message):
    """The coordinator's Decision for the generation it ends (`plan.recovery.Decision` as JSON:
    the plan layer parses it, so the wire and the planner share one definition)."""

    TYPE: ClassVar[str] = "decision"
    generation: int
    decision: dict[str, Any]
    # the Decision's layout is the one the generation's `Prepare` named: its nodes take the
    # groups they formed for it (every one of them, so that all meet in the same groups)
    prepared: bool = False


@dataclass(frozen=True)
class JoinAnswer(Message):
    """The coordinator's answer to a joining node."""

    TYPE: ClassVar[str] = "join_answer"
    node: str
    outcome: str  # placed | refused | finished
    generation: int = -1  # placed: the generation whose Decision places it
    message: str = ""
    # refused: the request it answers, as the incarnation of the process that asked (its
    # seal's; for a request without the key, the one its envelope claims). Anyone can ask in
    # a node's name: only the process that asked acts on the refusal, the node of that name
    # (another process) reads on.
    to: str = ""


@dataclass(frozen=True)
class Kill(Message):
    """The coordinator fences a node: its host's agent kills the process."""

    TYPE: ClassVar[str] = "kill"
    node: str
    reason: str


@dataclass(frozen=True)
class Mark(Message):
    """A node's mark in a step that every node must finish (a re-partition's exchange)."""

    TYPE: ClassVar[str] = "mark"
    node: str
    generation: int
    what: str


# --------------------------------------------------------------------- coordinator -> successor

@dataclass(frozen=True)
class CoordinatorState(Message):
    """What a successor needs to go on coordinating where the coordinator left off.

    The coordinator's books live in its process; when its host is lost, another agent wins
    the election and rebuilds them from the newest of these records (written, together with
    the run files' new lines and the mailbox slots it covers, in one store transaction at the
    end of every turn that changed something). `cursor` is how many mailbox slots the state
    has taken in: the successor reads on from the next one, so a record read but not yet
    taken in when the coordinator died is read again. Structured fields are JSON whose owner
    parses them (`spotpipe.cluster.succession`)."""

    TYPE: ClassVar[str] = "coordinator_state"
    cursor: int  # mailbox slots taken in (the successor reads on from cursor + 1)
    journal: int  # journal records written so far (the run files' lines)
    generation: int
    history: dict[str, Any]  # plan.recovery.History
    dead: tuple[str, ...]
    finished: tuple[str, ...]
    fenced: tuple[str, ...]
    left: tuple[str, ...]
    joining: tuple[str, ...]
    over: bool
    stop_message: str | None
    regroup_asked: int
    collecting: dict[str, Any] | None  # agreement in progress: generation, reasons, reports
    last_metrics: dict[str, Any] | None
    exited: dict[str, int]
    checkpoints: dict[str, Any]  # stages of uncommitted checkpoints, failed iterations
    admission: dict[str, Any]  # the agents admitted and their nodes
    time_s: float
    # the coordinator left its office on its host's notice, after that host's nodes had
    # left: its successor finds nothing lost (rather than a host gone with its lease)
    handed_over: bool = False
    left_on_notice: tuple[str, ...] = ()  # (of `left`: the nodes that had a notice)
    # metrics lines of committed iterations whose records a failure took, made from an
    # agreement's reports and not written yet (`spotpipe.cluster.recovered_metrics`)
    recovered_lines: tuple[dict[str, Any], ...] = ()
    first_iteration: int = 0  # the job's (a resumed checkpoint's next): its first line
    # nodes that exited 0 mid-job with no recovery under way: lost when one begins (their
    # exits were taken in, and will not come to a successor again)
    exited_early: tuple[str, ...] = ()
    # the layouts whose groups the nodes were asked to form ahead, with the generation that
    # asked, and the nodes whose notices came in a generation (`Coordinator._prepared_in`,
    # `_noticed`): {"generation": g, "layouts": [...]} and {"generation": g, "nodes": [...]}
    prepared_ahead: dict[str, Any] | None = None
    noticed: dict[str, Any] | None = None
    # what the lost nodes' launchers or agents said of why they died (`Exit.cause`), said
    # again in the stop's message should the agreement their loss began end the job
    causes: dict[str, str] = field(default_factory=dict)
    # journal records 1..journal_folded are in segments 1..journal_segments (`JournalSegment`);
    # the successor reads those, then the records after them
    journal_segments: int = 0
    journal_folded: int = 0


@dataclass(frozen=True)
class Journal(Message):
    """Lines the coordinator appended to the run's files in one turn (metrics.jsonl,
    events.jsonl): a successor on another host writes them again before its own, so the run's
    files continue on its host whole."""

    TYPE: ClassVar[str] = "journal"
    metrics: tuple[dict[str, Any], ...]
    events: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class JournalSegment(Message):
    """Journal records `first`..`last`, folded into one record as the run goes on
    (`spotpipe.cluster.journal`): without it a successor read one store key per turn of the
    whole run, and the store held every one of them. `packed` is their lines as zlib-compressed
    JSON, in base64 (a metrics line compresses about tenfold)."""

    TYPE: ClassVar[str] = "journal_segment"
    first: int
    last: int
    packed: str


# --------------------------------------------------------------------- the agents' rendezvous
#
# Written before the job's key exists (an agent arrives before the coordinator has published
# the job's instance id), so these travel unsealed, as `plain` records; each that a party acts
# on carries a proof of the token instead (`auth.proof`), checked by its reader.

@dataclass(frozen=True)
class AgentArrival(Message):
    """What an arriving agent brings: its host and nodes, and proofs instead of secrets."""

    TYPE: ClassVar[str] = "agent_arrival"
    host: str
    nproc: int
    node_rank: int  # -1: any free slot
    proof: str  # see `vouch`
    model_digest: str
    config_digest: str
    local_addr: str | None = None
    rejoin_of: int | None = None  # the arrival number this agent had before it was fenced
    config_keys: dict[str, str] = field(default_factory=dict)  # Config.key_digests()
    # the durable checkpoint its workers would start from (--resume), as its host found it:
    # the folder and the digest of its manifest ("" for both: it starts from iteration 0)
    resume_from: str = ""
    resume_digest: str = ""
    # given --resume, but its host does not have it: the coordinating agent sends its copy
    resume_fetch: bool = False
    # the SHA-256 of its host's copy of the data (`job.data_digest`; "": a factory dataset)
    data_digest: str = ""
    # fresh for each arrival: the record claims its slot (`cluster.rendezvous.arrive`), and
    # two agents of one host bring the same record otherwise, each taking the slot for its own
    nonce: str = ""


@dataclass(frozen=True)
class ResumeOffer(Message):
    """The coordinating agent's checkpoint on its way to an agent whose host lacks it (sealed
    under the job's key; its files follow through the store, `checkpoint.transfer`): the
    checkpoint folder's name and every file's SHA-256, the manifest's included."""

    TYPE: ClassVar[str] = "resume_offer"
    name: str
    checksums: dict[str, str]


@dataclass(frozen=True)
class ArrivalsClosed(Message):
    """The coordinating agent's marker in the next arrival slot: the job is over (it wakes the
    admission thread, which waits on that slot)."""

    TYPE: ClassVar[str] = "arrivals_closed"
    proof: str = ""


@dataclass(frozen=True)
class JobPosted(Message):
    """The job as the coordinating agent publishes it for every agent."""

    TYPE: ClassVar[str] = "job_posted"
    proof: str  # see `vouch`: this job holds the same token
    spec: dict[str, Any]  # job.RunSpec
    t0: float
    instance: str
    world: int
    config_digest: str
    model_digest: str
    checkpoint_probe: str = ""


@dataclass(frozen=True)
class Assignment(Message):
    """The coordinating agent's answer to an arrival: its ranks, or why it is refused."""

    TYPE: ClassVar[str] = "assignment"
    ranks: tuple[int, ...] = ()
    world: int = 0
    joining: bool = False
    refused: str = ""  # non-empty: refused, and why
    proof: str = ""


@dataclass(frozen=True)
class JobOver(Message):
    """The job's end, for every agent: how it ended, and how many agents should confirm."""

    TYPE: ClassVar[str] = "job_over"
    status: str  # completed | failed
    message: str = ""
    agents: int = 0
    proof: str = ""


@dataclass(frozen=True)
class FinalUpload(Message):
    """A worker under an agent sends its stage's final parameters, as it wrote them, to the
    coordinating agent's `--out` through the store (`checkpoint/transfer.py`, `Stream.final`):
    take its pieces as they come. Its `Exit` follows once they have been taken."""

    TYPE: ClassVar[str] = "final_upload"
    node: str  # the node that wrote it (and sends it: the record's writer)
    stage: int
    sha256: str


MESSAGES: dict[str, type[Message]] = {m.TYPE: m for m in (
    Report, JoinRequest, Metrics, Notice, Event, CheckpointSaved, StageUpload, Exit, Close,
    Heartbeat, Stalled, Abort, Regroup, Prepare, DecisionRecord, JoinAnswer, Kill, Mark,
    CoordinatorState, Journal, JournalSegment, AgentArrival, ArrivalsClosed, JobPosted,
    Assignment, JobOver, FinalUpload, ResumeOffer)}


def plain(message: Message) -> bytes:
    """An unsealed record (the rendezvous's): type, version and body, as JSON."""
    return json.dumps({"type": message.TYPE, "ver": message.VERSION,
                       "body": message.to_json()}, allow_nan=False).encode()


def vouch(message: M, token: str | bytes, key: str) -> M:
    """`message` with its `proof` set: an HMAC under the token over the store key it goes to
    and its body, so that a reader holding the token tells it from a forgery, or from a
    genuine record copied to another key (another arrival's slot, another job's id)."""
    return dataclasses.replace(message, proof=_proof_of(message, token, key))  # type: ignore


def vouched(message: Message, token: str | bytes, key: str) -> bool:
    """Whether `message` carries the proof `vouch` gives it (constant time)."""
    return same_secret(str(getattr(message, "proof", "")), _proof_of(message, token, key))


def _proof_of(message: Message, token: str | bytes, key: str) -> str:
    body = {k: v for k, v in message.to_json().items() if k != "proof"}
    return proof(token, key + "\n" + message.TYPE + "\n" + json.dumps(
        body, sort_keys=True, separators=(",", ":")))


def from_plain(blob: bytes | str, *expect: type[Message]) -> Message:
    """The message in an unsealed record, if it is one of `expect`; MessageError (naming what
    is wrong) for anything else: not JSON, another type, a field missing or mistyped."""
    try:
        fields = load_record(blob)  # (a cap on its size and its nesting: see bounds.py)
    except Unreadable as exc:
        raise MessageError(str(exc)) from None
    if not isinstance(fields, dict) or not isinstance(fields.get("type"), str) \
            or not isinstance(fields.get("ver"), int):
        raise MessageError("not a spotpipe record (no type or version)")
    cls = MESSAGES.get(fields["type"])
    if cls is None or (expect and cls not in expect):
        wanted = " or ".join(m.TYPE for m in expect)
        raise MessageError(f"a {fields['type'][:40]!r} record where {wanted} belongs")
    return cls.from_json(fields.get("body"), fields["ver"])


def parse(type_: str, version: int, body: Any) -> Message:
    cls = MESSAGES.get(type_)
    if cls is None:
        raise MessageError(f"unknown message type {type_!r}")
    return cls.from_json(body, version)
