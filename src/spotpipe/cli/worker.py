"""The worker process's entry point: one per node, started by the launcher or an agent as
torchrun starts one (`python -m spotpipe.cli.worker`).

Environment, as torchrun sets it: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK; plus
SPOTPIPE_STORE and SPOTPIPE_STORE_PREFIX (tcp, or etcd at MASTER_ADDR:MASTER_PORT with the
job's key prefix), SPOTPIPE_RUN_DIR (the run's output folder, holding config.yaml and
run.json written by the launcher), SPOTPIPE_T0 (the launcher's start time, so all records
share one clock), SPOTPIPE_JOIN_TOKEN and SPOTPIPE_INSTANCE (the job's key is derived from
them; neither is ever written to the store), SPOTPIPE_FAULTS (injected faults, JSON),
SPOTPIPE_RESUME (a durable checkpoint to start from), from an agent SPOTPIPE_CHECKPOINT_UPLOAD
(this host does not see the checkpoint folder: stream the stages) and SPOTPIPE_FINAL_UPLOAD
(stream the final stages to the coordinating agent), and from the local launcher only
SPOTPIPE_JOIN_GATED (a node started early that asks to join when its gate opens) and
SPOTPIPE_START_AFTER (the nodes so started, which the first nodes wait to have booted).

It is here, above the runtime, because it joins the runtime to what sits above it: the
checkpoint schemes and the durable tier, handed to the worker as boundary hooks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from spotpipe import job
from spotpipe.checkpoint import durable, registry, schemes
from spotpipe.config import Config, load_config
from spotpipe.faults import Fault
from spotpipe.protocol import Channel, channel_from_env
from spotpipe.runtime import replica, stacks
from spotpipe.runtime.faults import per_node, skew_clock
from spotpipe.runtime.hooks import SendFinal, StagePair
from spotpipe.runtime.standby import JoinRefused
from spotpipe.runtime.worker import JobStopped, Worker
from spotpipe.store.address import StoreAddress
from spotpipe.store.mailbox import Outbox
from spotpipe.store.sealed import SealedStore


def restore_from(path: Path, pairs: list[StagePair]) -> int:
    """The durable tier's restore (any P x D): verify, then load each stage it is given. The
    folders it loads must be there whole; a host's copy may lack the others (an agent's,
    `cluster.resume_copy`)."""
    ckpt = durable.verify(path, layers=set().union(*(durable.layers_of(m) for m, _ in pairs)))
    fresh = [k for module, optimizer in pairs for k in durable.load_stage(ckpt, module,
                                                                          optimizer)]
    if fresh:
        print(f"spotpipe worker: {ckpt.path} holds no fp16 loss scale (written in another "
              f"precision): the scale starts at loss_scale.init ({len(fresh)} tensors)",
              file=sys.stderr)
    return ckpt.next_iteration


def final_sender(cfg: Config, node: str, store: Any, channel: Channel,
                 outbox: Outbox) -> SendFinal | None:
    """Under an agent (SPOTPIPE_FINAL_UPLOAD=1) the run's result is kept in the coordinating
    agent's --out, perhaps on another host: each final stage goes there through the store."""
    if os.environ.get("SPOTPIPE_FINAL_UPLOAD") != "1":
        return None
    sealed = SealedStore(store, channel.key)

    def send(stage: int, path: Path) -> None:
        # (given up once the coordinating agent it announces the stage to is gone, as a
        # checkpoint's upload is: `schemes.Uploader`)
        receiver = durable.transfer.ReceiverWatch.of(sealed, every_s=cfg.failover.heartbeat_s)
        durable.transfer.send_final(sealed, outbox.post, node, stage, path,
                                    timeout_s=cfg.cluster.timeout_s, receiver=receiver)
    return send


def main() -> int:
    rank = int(os.environ["RANK"])
    run_dir = Path(os.environ["SPOTPIPE_RUN_DIR"])
    t0 = float(os.environ.get("SPOTPIPE_T0", time.time()))
    cfg = load_config(os.environ.get("SPOTPIPE_CONFIG") or run_dir / "config.yaml")
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    spec = job.RunSpec.from_json(json.loads((run_dir / "run.json").read_text()))
    faults = [Fault(**f) for f in json.loads(os.environ.get("SPOTPIPE_FAULTS", "[]"))]
    address = StoreAddress.from_env()
    store = address.connect(cfg.cluster.timeout_s)
    node = f"node{rank}"
    stacks.install()  # `kill -USR1` writes this worker's stacks to its log
    # a terminal's Ctrl-C reaches the whole process group; a worker's end is its supervisor's
    # to decide (it stops its workers, then says the job was interrupted): a worker dying of
    # it first would be taken for a failure, and the job said to have failed for it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # test knobs: a host whose clock is off, a replica update starved of CPU
    offset = per_node(os.environ.get("SPOTPIPE_TEST_CLOCK_OFFSET", ""), node)
    if offset:
        skew_clock(offset)
    replica.DELAY_S = per_node(os.environ.get("SPOTPIPE_TEST_REPLICA_DELAY", ""), node)
    channel = channel_from_env(node)
    outbox = Outbox(store, channel, t0)
    worker = None
    try:
        worker = Worker(cfg, spec, run_dir, node, store, t0, faults, address=address,
                        channel=channel, restore=restore_from, checkpoints=None,
                        send_final=final_sender(cfg, node, store, channel, outbox))
        worker.checkpoints = registry.build(schemes.SchemeContext(
            cfg, node, run_dir, worker.channel.event, worker.sealed, "spotpipe",
            lambda: worker.failures, inject=worker.inject,
            upload=os.environ.get("SPOTPIPE_CHECKPOINT_UPLOAD") == "1",
            upload_store=lambda: SealedStore(address.connect(cfg.cluster.timeout_s),
                                             channel.key)))
        worker.train(joining=os.environ.get("SPOTPIPE_JOIN") == "1")
        # test knob: an error in a node after a plan let it go (what its teardown may raise)
        if worker.left and per_node(os.environ.get("SPOTPIPE_TEST_ERROR_AFTER_LEAVING", ""),
                                    node):
            raise RuntimeError("an error after leaving (SPOTPIPE_TEST_ERROR_AFTER_LEAVING)")
    except JoinRefused as exc:
        print(f"spotpipe: {exc}", file=sys.stderr)
        return 2
    except JobStopped as exc:
        outbox.event("worker_stopped", message=str(exc))
        return 3
    except Exception as exc:  # reported to the launcher, which stops the job with the message
        traceback.print_exc()
        outbox.event("worker_error", message=f"{type(exc).__name__}: {exc}")
        return 1
    except SystemExit as exc:
        # user code (a model, a data set, a library) ended the process: with code 0 the
        # launcher would take it for a node done at the job's end, and wait for it in vain
        traceback.print_exc()
        outbox.event("worker_error", message=f"SystemExit: sys.exit({exc.code!r}) called "
                                             "while training (a worker ends only with the job)")
        return 1
    return 0


def exit_now(code: int) -> None:
    """Every file is closed and every record posted by now. Interpreter teardown of torch and
    gloo takes seconds on a small machine and decides nothing, so skip it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
