"""An agent's flags and their checks, torch-free.

`spotpipe agent` checks what it was given before it starts its workers' fork server or imports
torch (several seconds of CPU each): a mistyped flag, a missing token or an agent count that
cannot make the job's layout is said at once, and nothing has started."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from spotpipe.config import Config, parse_endpoint
from spotpipe.faults import Fault
from spotpipe.runfiles import blocking_file
from spotpipe.store.tls import EtcdTLS


class AgentError(RuntimeError):
    """Bad flags or an unusable rendezvous; nothing was started (exit 2)."""


@dataclass
class AgentOptions:
    backend: str  # "etcd" or "c10d"
    endpoint: str  # host:port
    rdzv_id: str
    min_nodes: int
    max_nodes: int
    out: Path
    nproc: int = 1
    node_rank: int = -1  # -1: by arrival
    local_addr: str = ""
    rdzv_timeout_s: float = 600.0
    progress: bool = True
    on_demand: bool = False  # the operator says this host is not preemptible (c10d's host)
    faults: tuple[Fault, ...] = ()  # injected into the workers this agent starts (by node name)
    # a durable checkpoint to start from: this host's workers load their stages from it
    resume: Path | None = None
    trust_checkpoint: bool = False  # load `resume` although its MAC does not vouch for it
    # torchrun's --max-restarts, per host: a worker that dies of a signal while its host
    # lives (the OOM killer, a crash) is replaced by a fresh node that joins the running job
    max_restarts: int = 0
    tls: EtcdTLS | None = None  # etcd over TLS (--rdzv-conf)


def parse_nnodes(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX', as torchrun's --nnodes."""
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise AgentError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise AgentError(f"--nnodes {text!r}: expected 1 <= MIN <= MAX")
    return low, high


def is_local(host: str) -> bool:
    """Whether `host` names an address of this machine (then it can be bound)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError:
                continue
    return False


def check_options(opts: AgentOptions, cfg: Config, overwrite: bool = False) -> str:
    """The join token, once every flag is known to fit the job; AgentError naming the first
    that does not. `opts.out` becomes absolute (the workers get it in their environment)."""
    token = os.environ.get("SPOTPIPE_JOIN_TOKEN", "")  # (str; any bytes, see protocol.auth)
    if not token:
        raise AgentError("SPOTPIPE_JOIN_TOKEN: set it to the job's shared secret on every host "
                         "(a node without it is refused)")
    if opts.backend not in ("etcd", "c10d"):
        raise AgentError(f"--rdzv-backend {opts.backend!r}: expected etcd or c10d")
    if opts.nproc < 1:
        raise AgentError(f"--nproc-per-node {opts.nproc}: expected >= 1")
    if opts.max_restarts < 0:
        raise AgentError(f"--max-restarts {opts.max_restarts}: expected >= 0")
    if opts.tls is not None and opts.backend != "etcd":
        raise AgentError("--rdzv-conf protocol=https: TLS is for --rdzv-backend etcd (the c10d "
                         "store speaks plain TCP: keep it on a private network)")
    if opts.backend == "etcd" and cfg.shadow.enabled:
        # (the shadows run beside the coordinator, `JobLoop._spawn_shadows`)
        raise AgentError(
            "shadow.enabled with --rdzv-backend etcd: the CPU shadows run beside the "
            "coordinator, which etcd elects among the job's hosts, any of which the job may "
            "lose; the shadows' state would go with it and a successor has none. Use "
            "--rdzv-backend c10d, whose store and coordinator live on the host said to be "
            "on-demand (--on-demand), or redundancy and durable checkpoints with etcd")
    world = cfg.stages * cfg.pipelines
    if opts.min_nodes * opts.nproc != world:
        raise AgentError(
            f"--nnodes {opts.min_nodes}:{opts.max_nodes}: the job starts with stages x pipelines"
            f" = {cfg.stages} x {cfg.pipelines} = {world} nodes, so MIN x --nproc-per-node "
            f"({opts.min_nodes} x {opts.nproc}) must be {world}; agents beyond MIN join later")
    if not -1 <= opts.node_rank < opts.min_nodes:
        raise AgentError(f"--node-rank {opts.node_rank}: expected 0..{opts.min_nodes - 1}, or "
                         "-1 (by order of arrival)")
    most = opts.max_nodes * opts.nproc  # nodes are named by rank, joiners after the first
    for f in opts.faults:
        if not f.node.startswith("node") or not f.node[4:].isdigit() or int(f.node[4:]) >= most:
            raise AgentError(f"--{f.kind} {f.node}@{f.iteration}: no node {f.node!r}; the "
                             f"job's nodes are node0..node{most - 1}")
        if f.iteration >= cfg.iterations:
            raise AgentError(f"--{f.kind} {f.node}@{f.iteration}: the job runs iterations "
                             f"0..{cfg.iterations - 1}")
    out = opts.out = opts.out.resolve()
    blocker = blocking_file(out)
    if blocker is not None:
        raise AgentError(f"--out {out}: is a file, not a folder" if blocker == out else
                         f"--out {out}: cannot be made, {blocker} is a file")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise AgentError(f"--out {out}: the folder exists and is not empty; pass --overwrite "
                         "to replace it")
    if opts.resume is not None:
        # (a host that lacks it is sent the coordinating agent's copy: `Agent._fetch_resume`)
        resume = opts.resume = opts.resume.resolve()
        if overwrite and out.exists() and resume.is_relative_to(out):
            raise AgentError(f"--out {out} --overwrite: the folder holds --resume ({resume}); "
                             "replacing it would delete it. Choose another --out")
    try:
        host, port = parse_endpoint(opts.endpoint)
    except ValueError as exc:
        raise AgentError(f"--rdzv-endpoint: {exc}") from None
    if opts.backend == "c10d" and is_local(host) and not opts.on_demand:
        # the store dies with its host, and the job with the store: a c10d store may only
        # live on a host the job cannot lose, which only the operator knows
        raise AgentError(
            f"--rdzv-backend c10d: this agent would host the job's store on {host}:{port}, "
            "and a host the job may lose (a spot host) takes the store and the whole job "
            "with it. Run this agent on an on-demand host and say so with --on-demand, or "
            "use --rdzv-backend etcd with etcd on on-demand machines")
    return token
