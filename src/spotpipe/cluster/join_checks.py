"""Whether a node or a whole host may join this job: checks shared by a worker joining a
running job (`Coordinator.join`) and an agent arriving at the rendezvous
(`Coordinating._problem`), each refusal a sentence that names what differs."""

from __future__ import annotations

from typing import Any

from spotpipe import job
from spotpipe.config import HOST_DECIDED, Config, differing_keys


def join_problem(cfg: Config, *, token_ok: bool, model_digest: str | None,
                 config_digest: str | None,
                 config_keys: dict[str, str] | None = None) -> str | None:
    """Why a node (a worker, or a whole node agent) may not join this job, or None.

    The same three checks guard a worker joining a running job and an agent arriving at the
    rendezvous: the shared secret, then the model and the configuration it would train.
    `config_keys` (the node's `Config.key_digests()`) lets the refusal name what differs."""
    if not token_ok:
        return "it did not present this job's join token"
    if model_digest != cfg.model_digest():
        return "it runs another model or optimizer" + _naming(cfg, config_keys)
    if config_digest != cfg.digest():
        return "it runs another configuration" + _naming(cfg, config_keys)
    return None


def _naming(cfg: Config, config_keys: dict[str, str] | None) -> str:
    """`` (keys differ: ...)`` for a refusal, with a hint where `auto` settled a key on each
    host from what the host has (a host with GPUs and one without choose other backends)."""
    keys = differing_keys(cfg, config_keys) if config_keys else []
    if not keys:
        return ""
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    hints = [f"{k} is settled on each host from {HOST_DECIDED[k]} when it is 'auto' (here: "
             f"{_value(cfg, k)}); set it to one value in every host's configuration"
             for k in keys if k in HOST_DECIDED]
    return f" ({shown} differ{'s' if len(keys) == 1 else ''}" + \
        "".join(f"; {h}" for h in hints) + ")"


def _value(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def data_problem(cfg: Config, theirs: str, ours: str) -> str | None:
    """Why a host whose copy of the data has the digest `theirs` (`job.data_digest`) may not
    join a job whose data has `ours`, or None. A sample's inputs are read on its pipeline's
    first stage and its targets on the last, often on two hosts: copies of one length but
    other contents would train on mismatched pairs without an error."""
    if theirs == ours:
        return None
    return (f"its copy of {job.data_source(cfg)} is not the coordinating agent's (SHA-256 "
            f"{theirs[:12] or 'none'}..., the job's {ours[:12] or 'none'}...): every host must "
            "read the same data")
