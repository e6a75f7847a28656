"""The initial weights, written once per host, and models that hold only some of their layers.

Every worker used to build the whole model (random init from the seed, or a transformers
model) and then let go of the layers it does not own: each process's memory peaked at the
whole model at start, so a host starting eight workers of a 1.5B-parameter model needed eight
copies of it at once, and each spent the seconds of a full initialisation. Instead, the
launcher (or a node agent), which builds the model anyway to check the job, writes its tensors
to one safetensors file in the run folder; a worker builds the model on the meta device (the
structure, names and ties, no memory) and reads from the file only the layers it will hold,
plus every buffer (small, and a template's layers must be copyable into any stage later).
The values are the very bytes the whole build gives, so training is bit for bit the same.

The file is checked against the job (its metadata names the model digest and seed) and tensor
by tensor against the template: a stale or foreign file raises InitialFileError naming the file
and the tensor, and the worker builds the model whole instead (`job.build_model_holding`), never
training on something else. It is safetensors, never pickle: reading it runs no code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from spotpipe.model.layered import LayeredModel

INITIAL_FILE = "initial.safetensors"


class InitialFileError(RuntimeError):
    """The initial weights file does not fit this job's model."""


def _first_names(model: LayeredModel) -> dict[int, str]:
    """Each parameter's global name where the unpartitioned model first meets it (a tied
    weight is stored once, under its first name)."""
    out: dict[int, str] = {}
    for name, p in model.to_sequential().named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


def save_initial(model: LayeredModel, path: Path, identity: str) -> None:
    """Every parameter (once) and every buffer of `model`, under their global names; written
    beside and renamed into place, so a reader never sees half a file. `identity` says which
    job's model this is (the reader checks it)."""
    tensors: dict[str, torch.Tensor] = {}
    seq = model.to_sequential()
    for name, p in seq.named_parameters():
        tensors[name] = p.detach().contiguous()
    for name, b in seq.named_buffers():
        tensors[f"buffer:{name}"] = b.detach().contiguous()
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={"identity": identity})
    os.replace(tmp, path)


def load_held(model: LayeredModel, path: Path, identity: str, layers: Iterable[int]) -> None:
    """Fill `model` (built on the meta device) from the file at `path`: every buffer, and the
    parameters of `layers`; the other parameters stay on meta. A tie keeps one Parameter."""
    held = set(layers)
    names = _first_names(model)
    wanted = {id(p) for i in held for p in model.layers[i].parameters()}
    with safe_open(str(path), framework="pt") as f:
        found = (f.metadata() or {}).get("identity")
        if found != identity:
            raise InitialFileError(f"{path} holds the initial weights of another job's model "
                                   f"({found!r}, this job's: {identity!r})")
        keys = set(f.keys())

        def read(key: str, like: torch.Tensor) -> torch.Tensor:
            if key not in keys:
                raise InitialFileError(f"{path} has no tensor {key!r}")
            value = f.get_tensor(key)
            if value.shape != like.shape or value.dtype != like.dtype:
                raise InitialFileError(
                    f"{path}: tensor {key!r} is {value.dtype} {tuple(value.shape)}, the model "
                    f"wants {like.dtype} {tuple(like.shape)}")
            return value

        swap_tensors(model.layers, "_parameters", lambda p: id(p) in wanted,
                     lambda p: nn.Parameter(read(names[id(p)], p),
                                            requires_grad=p.requires_grad))
        buffers: dict[int, str] = {}  # a shared buffer (one rotary module) is stored once
        for name, b in model.to_sequential().named_buffers(remove_duplicate=False):
            buffers.setdefault(id(b), name)
        swap_tensors(model.layers, "_buffers", lambda b: b.is_meta,
                     lambda b: read(f"buffer:{buffers[id(b)]}", b))


def meta_outside_state(model: LayeredModel) -> str | None:
    """Where a model built on the meta device holds a meta tensor that the file cannot fill:
    a plain tensor attribute of a layer's module (not a parameter or buffer, so not in any
    state), or any tensor of a loss module. Such a model must be built whole; None when
    there is none."""
    def plain(module: nn.Module) -> str | None:
        for name, value in vars(module).items():
            # a module's own tables (`_parameters`, `_buffers`, hooks) are its state
            if isinstance(value, dict):
                values = [] if name.startswith("_") else list(value.values())
            elif isinstance(value, (list, tuple)):
                values = list(value)
            else:
                values = [value]
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
                return name
        return None

    for i, layer in enumerate(model.layers):
        for sub_name, sub in layer.named_modules():
            found = plain(sub)
            if found:
                where = f"{sub_name}." if sub_name else ""
                return f"layer {i} keeps a tensor outside its state: {where}{found}"
    if isinstance(model.loss_fn, nn.Module):
        loss = model.loss_fn
        if any(t.is_meta for t in [*loss.parameters(), *loss.buffers()]) or any(
                plain(m) for m in loss.modules()):
            return f"the loss ({type(loss).__name__}) holds tensors"
    return None


def swap_tensors(modules: Iterable[nn.Module], slot: str, which: Callable[[torch.Tensor], bool],
                 make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace each tensor in the `slot` dict (`_parameters` or `_buffers`) of every submodule
    that `which` selects by `make(old)`, the same new one wherever the old one was shared."""
    swapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for sub in (m for module in modules for m in module.modules()):
        table = getattr(sub, slot)
        for name, t in list(table.items()):
            if t is None or not (id(t) in swapped or which(t)):
                continue
            if id(t) not in swapped:
                swapped[id(t)] = (t, make(t))
            table[name] = swapped[id(t)][1]
