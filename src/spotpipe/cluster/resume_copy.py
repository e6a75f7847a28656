"""A durable checkpoint carried to an agent whose host lacks the job's `--resume`.

Both ends of the copy, side by side: the coordinating agent seals a `ResumeOffer` under the
job's key (the checkpoint folder's name and the SHA-256 of every file it sends, the
manifest's included) and streams the files through the store under the checkpoint upload's
flow control (`checkpoint.transfer`); the agent takes them into its `OUT/resume/`, each file
checked as it arrives. Checking the copy as a checkpoint (MAC, model, data order) is the
caller's, as for any `--resume`.

A host is sent the stage folders its workers load, not the whole checkpoint: the ones holding
the layers of their stages and replicas in the job's first layout (`job.start_layers`), which
both ends work out alike. The copies of a P-stage checkpoint to P hosts then move about
(1 + replicas) / P of what whole copies moved, through the one store. A host's workers check
what they load against the manifest (`durable.verify` with their layers); nothing else reads
the copy (a node that joins later takes its state from its peers).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from spotpipe.checkpoint import durable
from spotpipe.checkpoint.fsync import sha256_file
from spotpipe.cluster.rendezvous import wait_get
from spotpipe.protocol import Channel, Refused, ResumeOffer, keys
from spotpipe.store.sealed import SealedStore


class Sent(NamedTuple):
    files: int
    bytes: int


def send(store: dist.Store, channel: Channel, agent: int, checkpoint: durable.Checkpoint, *,
         timeout_s: float, layers: Collection[int] | None = None) -> Sent:
    """Offer `checkpoint` to agent `agent` and stream its files (with `layers`, the manifest
    and the stage folders holding some of them); what went once all arrived whole. Raises
    (UploadRefused with the receiver's reason, or the store's error)."""
    folders = None if layers is None else durable.folders_holding(checkpoint.partition, layers)
    checksums = {**{name: digest for name, digest in checkpoint.manifest["checksums"].items()
                    if folders is None or durable.folder_of(name) in folders},
                 durable.MANIFEST: sha256_file(checkpoint.path / durable.MANIFEST)}
    offer = keys.resume_offer(agent)
    store.set(offer, channel.seal(ResumeOffer(checkpoint.path.name, checksums), at=offer))
    durable.transfer.send(SealedStore(store, channel.key), durable.transfer.Stream.resume(agent),
                          checkpoint.path, checksums, timeout_s=timeout_s)
    return Sent(len(checksums), sum((checkpoint.path / name).stat().st_size
                                    for name in checksums))


def receive(store: dist.Store, channel: Channel, agent: int, out: Path, *,
            timeout_s: float) -> Path | str:
    """The offered checkpoint taken into `out`/resume/: its folder, or what went wrong (no
    offer in time, one not sealed by the coordinator, a file that did not arrive whole)."""
    raw = wait_get(store, keys.resume_offer(agent), timeout_s)
    if raw is None:
        return f"the coordinating agent did not offer its copy within {timeout_s:.0f} s"
    try:
        offer = channel.open(raw, at=keys.resume_offer(agent), expect=ResumeOffer,
                             writers={"coordinator"}).message
    except Refused as why:
        return f"refused the coordinating agent's offer: {why.reason}"
    assert isinstance(offer, ResumeOffer)
    if not offer.name.startswith("iter_") or Path(offer.name).name != offer.name:
        return f"refused an offer of {offer.name!r}, not a checkpoint's name"
    folder = out / "resume" / offer.name
    problem = durable.transfer.receive(
        SealedStore(store, channel.key), durable.transfer.Stream.resume(agent),
        offer.checksums, folder, timeout_s=timeout_s)
    if problem:
        return f"the coordinating agent's checkpoint did not arrive whole: {problem}"
    return folder
