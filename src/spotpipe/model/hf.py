"""Hugging Face causal LMs (GPT-2 and Llama families) as layer lists.

The transformers model is built whole (randomly initialised from its config with the job seed,
or loaded from local safetensors; nothing is downloaded), then cut into single-tensor layers
that share its modules: the embedding, each decoder block, the final norm and the head. A
block wrapper recomputes what the model's forward hands every block (position ids, the causal
mask from transformers' own `create_causal_mask` or, for a sliding-window block, its
`create_sliding_window_causal_mask`, Llama's rotary embeddings from the model's
own rotary module), so a stage runs exactly the model's arithmetic, and a pipeline at D = 1
trains the same bits as a plain loop over the transformers model.

`LayeredModel.export_names` maps the layer names back to the transformers ones: the final
`model.safetensors` loads into the same model class with `from_pretrained`. Tied embeddings
(GPT-2's default) stay one Parameter inside the process and are recorded as a tied pair, so
the runtime keeps the copies on the first and last stage equal.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from spotpipe.model.gpt import gpt_loss
from spotpipe.model.layered import LayeredModel, find_tied


class HFModelError(ValueError):
    """A Hugging Face model that cannot be built or split: the message says which and why."""


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts, by module path inside the *ForCausalLM model."""

    embed: tuple[str, ...]  # token embedding first
    blocks: str
    norm: str
    head: str
    rotary: str = ""


FAMILIES = {
    "gpt2": Family(embed=("transformer.wte", "transformer.wpe", "transformer.drop"),
                   blocks="transformer.h", norm="transformer.ln_f", head="lm_head"),
    "llama": Family(embed=("model.embed_tokens",), blocks="model.layers", norm="model.norm",
                    head="lm_head", rotary="model.rotary_emb"),
}
for _name in ("mistral", "qwen2", "qwen3"):  # the Llama layout under other names
    FAMILIES[_name] = FAMILIES["llama"]


class Embedding(nn.Module):
    """Token ids -> hidden states: token (+ learned position, GPT-2) embeddings, dropout."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)
        self.names = list(parts)

    def forward(self, ids: Tensor) -> Tensor:
        first, *rest = self.names
        h = getattr(self, first)(ids)
        for name in rest:
            module = getattr(self, name)
            if isinstance(module, nn.Embedding):  # GPT-2's wpe: positions 0..T-1
                pos = torch.arange(ids.shape[1], device=h.device).unsqueeze(0)
                h = h + module(pos).to(h.device)
            else:
                h = module(h)
        return h


class Block(nn.Module):
    """One decoder block, given what the model's forward would pass it."""

    def __init__(self, block: nn.Module, config: Any, rotary: nn.Module | None,
                 sliding: bool = False) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config
        self.sliding = sliding

    def forward(self, h: Tensor) -> Tensor:
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = causal_mask(self.config, h, position_ids, self.sliding)
        extra = {}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(h, position_ids=position_ids)
        out = self.block(h, attention_mask=mask, position_ids=position_ids, use_cache=False,
                         **extra)
        return out[0] if isinstance(out, tuple) else out


def sliding_window(config: Any, index: int) -> bool:
    """Whether block `index` attends within `config.sliding_window` only, as the model's
    forward decides it: by `config.layer_types` where the config has them (Qwen2, Qwen3:
    the blocks from `max_window_layers` on, with `use_sliding_window`), else every block
    once a window is set (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


def causal_mask(config: Any, h: Tensor, position_ids: Tensor, sliding: bool = False) -> Any:
    """transformers' own causal mask (`sliding`: its sliding-window one) for a block's input
    without a cache. Its keyword names changed within 5.x (5.0: `input_embeds`,
    `cache_position`, `past_key_values`; 5.17: `inputs_embeds`, `past_key_values`; 5.25:
    `cache`), so they are read off its signature."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    create = create_sliding_window_causal_mask if sliding else create_causal_mask
    names = inspect.signature(create).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None,
                              "position_ids": position_ids}
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = h
    # (5.25 still takes `past_key_values`, deprecated, and warns when both are given)
    kwargs["cache" if "cache" in names else "past_key_values"] = None
    if "cache_position" in names:
        kwargs["cache_position"] = position_ids[0]
    return create(**kwargs)


def load_config(spec: str, overrides: dict[str, Any]) -> Any:
    """A transformers config: a local folder with config.json, or a model type (`gpt2`,
    `llama`, ...) with its defaults; `overrides` set fields on top."""
    from transformers import AutoConfig

    if Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise HFModelError(f"model.hf.config: {spec} has no config.json")
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    try:
        return AutoConfig.for_model(spec, **overrides)
    except ValueError as exc:
        raise HFModelError(f"model.hf.config: {spec!r} is neither a folder with config.json "
                           f"nor a transformers model type: {exc}") from None


def save_config(spec: str, overrides: dict[str, Any], folder: Path) -> None:
    """config.json for the final weights: the job's config naming the dtype they are in
    (fp32, `build_hf_model`), as `save_pretrained` writes a model's; `from_pretrained` builds
    the model in the dtype a config names, and would round the weights to a published
    config's bf16."""
    config = load_config(spec, overrides)
    config.dtype = torch.float32
    config.save_pretrained(folder)


def build_hf_model(config_spec: str, overrides: dict[str, Any], weights: str,
                   seed: int) -> tuple[nn.Module, Any]:
    """The whole transformers causal LM: from `weights` (a local safetensors file or a folder
    with model.safetensors) or randomly initialised with `seed`."""
    from transformers import AutoModelForCausalLM

    config = load_config(config_spec, overrides)
    if config.model_type not in FAMILIES:
        raise HFModelError(f"model.hf.config: model type {config.model_type!r} is not one "
                           f"spotpipe splits; known: {', '.join(sorted(FAMILIES))}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # fp32 master weights whatever dtype the config names (a published config.json names
        # the one its weights were saved in, which `from_config` would build the model in);
        # `precision` decides what the layers compute in
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if weights:
        _load_weights(model, Path(weights))
    model.train()
    return model, config


def _load_weights(model: nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise HFModelError(f"model.hf.weights: {file} does not exist")
    state = load_file(str(file))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not _tied_to_loaded(model, k, state)]
    if missing or result.unexpected_keys:
        raise HFModelError(f"model.hf.weights: {file} does not fit the model: missing "
                           f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def _tied_to_loaded(model: nn.Module, key: str, state: dict[str, Tensor]) -> bool:
    """Whether `key` is the same tensor as one that `state` filled: a tied head (GPT-2's
    lm_head), which a tied model's file leaves out. Whether the class can tie it is not
    enough: untied (`tie_word_embeddings: false`), the head is a tensor of its own, and
    without it in the file it would stay at its random init."""
    where = {name: id(t) for name, t in model.state_dict(keep_vars=True).items()}
    return any(where.get(other) == where[key] for other in state if other != key)


def split_hf(model: nn.Module, config: Any) -> LayeredModel:
    """Cut a *ForCausalLM model into [embedding, blocks..., final norm, head]."""
    family = FAMILIES[config.model_type]
    parts = {path.rsplit(".", 1)[-1]: model.get_submodule(path) for path in family.embed}
    rotary = model.get_submodule(family.rotary) if family.rotary else None
    layers: list[nn.Module] = [Embedding(parts)]
    layers += [Block(b, config, rotary, sliding_window(config, i))
               for i, b in enumerate(model.get_submodule(family.blocks))]
    layers += [model.get_submodule(family.norm), model.get_submodule(family.head)]
    names = [family.embed[0]] + [f"{family.blocks}.{i}" for i in range(len(layers) - 3)]
    return LayeredModel(layers=layers, loss_fn=gpt_loss, tied=find_tied(layers),
                        export_names=export_names(layers, model),
                        layer_names=names + [family.norm, family.head])


def export_names(layers: list[nn.Module], model: nn.Module) -> dict[str, str]:
    """Layer names ("3.block.attn.c_attn.weight") -> the model's own ("transformer.h.2...")."""
    where = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    out = {}
    for i, layer in enumerate(layers):
        for kind in ("parameters", "buffers"):
            for sub_name, sub in layer.named_modules(remove_duplicate=False):
                for leaf, _ in getattr(sub, f"named_{kind}")(recurse=False):
                    local = f"{sub_name}.{leaf}" if sub_name else leaf
                    owner = where[id(sub)]
                    out[f"{i}.{local}"] = f"{owner}.{leaf}" if owner else leaf
    return out
