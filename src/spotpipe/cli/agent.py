"""`spotpipe agent CONFIG --rdzv-backend etcd|c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB
--nnodes MIN:MAX --out DIR [--resume PATH]`: the node agent, one per host (see
spotpipe/cluster/agent.py).

Flags follow torchrun's, and like torchrun's each may come from a PET_<FLAG> environment
variable (PET_RDZV_ENDPOINT, PET_NNODES, ...). The join token comes from SPOTPIPE_JOIN_TOKEN.
Exit codes: 0 the job completed, 1 it failed, 2 bad input or refused by the job.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from spotpipe.cli.argtypes import FAULT_FLAGS, add_fault_flags, positive_number


def _env(flag: str, default: str | None = None) -> str | None:
    return os.environ.get("PET_" + flag.upper().replace("-", "_"), default)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="node agent for multi-host jobs (one per host, as torchrun)")
    p.add_argument("config", help="YAML configuration file (the same on every host)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                   default=_env("rdzv_backend", "c10d"), choices=["etcd", "c10d"],
                   help="etcd: an etcd server; c10d: a TCPStore hosted by the agent on the "
                        "endpoint's host (default c10d)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                   default=_env("rdzv_endpoint"), metavar="HOST:PORT")
    p.add_argument("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf",
                   default=_env("rdzv_conf", ""), metavar="KEY=VALUE,...",
                   help="etcd over TLS, as torchrun's etcd rendezvous: protocol=https,"
                        "cacert=CA,cert=CERT,key=KEY (etcd started with --client-cert-auth "
                        "serves only hosts whose certificate its CA signed)")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=_env("rdzv_id"),
                   metavar="JOB", help="the job's id; agents with the same id form one job")
    p.add_argument("--nnodes", default=_env("nnodes"), metavar="MIN:MAX",
                   help="agents the job starts with (MIN) and at most admits (MAX)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int,
                   default=_env("nproc_per_node", "1"),
                   help="nodes (worker processes) this agent runs (default 1)")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                   default=_env("max_restarts", "0"),
                   help="workers of this host that die of a signal while the host lives (the "
                        "OOM killer, a crash) are replaced by fresh nodes joining the running "
                        "job, at most this many times (default 0: the job fails over without "
                        "them)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int,
                   default=_env("node_rank", "-1"),
                   help="this host's place among the MIN agents (default: order of arrival)")
    p.add_argument("--local-addr", "--local_addr", dest="local_addr",
                   default=_env("local_addr", ""), help="this host's address, for the record")
    p.add_argument("--rdzv-timeout", dest="rdzv_timeout", type=positive_number,
                   default=_env("rdzv_timeout", "600"),
                   help="seconds to wait for the other agents (default 600)")
    p.add_argument("--on-demand", dest="on_demand", action="store_true",
                   default=(_env("on_demand", "") or "") not in ("", "0"),
                   help="this host is on-demand (not preemptible): required of the agent that "
                        "hosts the c10d store")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a configuration key (every agent must use the same)")
    p.add_argument("--out", default=_env("out", "runs/agent"),
                   help="output folder (the coordinating agent writes the run's files here)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--resume", type=Path, default=None, metavar="PATH",
                   help="start from a durable checkpoint (a checkpoint folder, a checkpoints "
                        "folder or a run folder: its newest), on any P x D; every agent is "
                        "given the same one, at a path its host can read")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load --resume although its MAC does not vouch for it (only a "
                        "checkpoint whose origin you know)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    faults = p.add_argument_group(
        "fault injection into this host's workers (the same paths as real failures; a fault "
        "for a node another host runs does nothing here)")
    add_fault_flags(faults)
    p.set_defaults(func=run)


REQUIRED = ("rdzv_endpoint", "rdzv_id", "nnodes")


def run(args: argparse.Namespace) -> int:
    from spotpipe.cluster.agent_options import AgentError, AgentOptions, check_options, \
        parse_nnodes
    from spotpipe.config import ConfigError, load_config
    from spotpipe.faults import Fault, FaultSpecError
    from spotpipe.store.tls import TLSConfError, parse_conf

    try:  # every check that needs no torch, before anything starts (see agent_options)
        for flag in REQUIRED:
            if not getattr(args, flag):
                raise AgentError(f"--{flag.replace('_', '-')} is required (or "
                                 f"PET_{flag.upper()} in the environment)")
        low, high = parse_nnodes(args.nnodes)
        cfg = load_config(args.config, args.overrides)
        opts = AgentOptions(backend=args.rdzv_backend, endpoint=args.rdzv_endpoint,
                            rdzv_id=args.rdzv_id, min_nodes=low, max_nodes=high,
                            out=Path(args.out), nproc=args.nproc_per_node,
                            node_rank=args.node_rank, local_addr=args.local_addr,
                            rdzv_timeout_s=args.rdzv_timeout, progress=not args.no_progress,
                            on_demand=args.on_demand, resume=args.resume,
                            trust_checkpoint=args.trust_checkpoint,
                            max_restarts=args.max_restarts,
                            tls=parse_conf(args.rdzv_conf, "--rdzv-conf"),
                            faults=tuple(Fault.parse(kind, text) for kind in FAULT_FLAGS
                                         for text in getattr(args, kind)))
        check_options(opts, cfg, overwrite=args.overwrite)
    except (AgentError, ConfigError, FaultSpecError, TLSConfError) as exc:
        print(f"spotpipe agent: error: {exc}", file=sys.stderr)
        return 2
    from spotpipe.cluster.supervisor import prestart

    # the workers' fork server starts before this process imports torch, so that the two
    # imports overlap (as `spotpipe train` does)
    prestart(cfg)
    from spotpipe.cluster.agent import run_agent
    from spotpipe.cluster.launcher import LaunchError

    try:
        code = run_agent(opts, cfg, overwrite=args.overwrite)
    except (AgentError, LaunchError) as exc:
        print(f"spotpipe agent: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # (before its workers started: they take Ctrl-C as a notice)
        print("spotpipe agent: interrupted (Ctrl-C) before this host's workers started",
              file=sys.stderr)
        code = 130
    except Exception as exc:  # the rendezvous store went away, or a bug: say so, exit 1
        import traceback

        traceback.print_exc()
        print(f"spotpipe agent: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # threads blocked in store waits must not run interpreter teardown (see worker.py)
    os._exit(code)
