"""The built-in decoder-only GPT (nanoGPT style), written as a layer list.

Layers: ``Embedding`` (token + learned position embeddings), ``n_layer`` x ``Block``
(pre-LayerNorm causal self-attention and GELU MLP) and ``Head`` (final LayerNorm + linear to
the vocabulary). Each takes and returns one tensor, so any contiguous run of them is a stage.

Tied embeddings (``tie_embeddings=True``): the Head's weight IS the Embedding's ``wte``
weight (one Parameter) and ``LayeredModel.tied`` names the pair. When embedding and head sit on
different stages each stage holds a copy, and the runtime keeps the copies tied by summing
their gradients. With tying, training matches a single-process run to float tolerance, not bit
for bit (the two gradient contributions are summed in a different order); untied, it is
bit-identical.

Dropout (``dropout > 0``) draws from the torch RNG; the runtime seeds it per (iteration,
micro-batch, layer) (`spotpipe.model.precision.Draws`), so results stay bit-identical across
layouts and failovers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spotpipe.model.layered import LayeredModel


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class Embedding(nn.Module):
    """LongTensor (b, T) of token ids -> (b, T, C) token + position embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """(b, T, C) -> (b, T, C): pre-LayerNorm attention and MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """(b, T, C) -> (b, T, vocab_size) logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over every position: (b, T, V) logits against (b, T) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _init_weights(model: nn.Module, cfg: GPTConfig, gen: torch.Generator) -> None:
    """nanoGPT's init: normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    seen: set[int] = set()  # a tied weight is drawn once, at its first (embedding) use
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            nn.init.normal_(module.weight, mean=0.0, std=0.02, generator=gen)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    for name, param in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(param, mean=0.0, std=proj_std, generator=gen)


def build_gpt(cfg: GPTConfig, seed: int) -> LayeredModel:
    """A GPT whose weights are a pure function of (cfg, seed); the global RNG is left as is."""
    with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
        layers: list[nn.Module] = [Embedding(cfg)]
        layers += [Block(cfg) for _ in range(cfg.n_layer)]
        layers.append(Head(cfg))
    head_index = cfg.n_layer + 1
    tied: list[tuple[str, str]] = []
    if cfg.tie_embeddings:
        layers[head_index].lm_head.weight = layers[0].wte.weight  # type: ignore[union-attr]
        tied.append(("0.wte.weight", f"{head_index}.lm_head.weight"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _init_weights(nn.Sequential(*layers), cfg, gen)
    return LayeredModel(layers=layers, loss_fn=gpt_loss, tied=tied)
