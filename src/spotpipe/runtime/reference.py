"""The plain single-process PyTorch loop that a pipeline run must reproduce.

This is the definition of "the same result": the unpartitioned model, the same samples in the
same micro-batches (global micro-batch j = pipeline * M + m), each loss divided by M * D and
accumulated, torch's own clip_grad_norm_, then one optimizer step. Tests and benchmarks compare
pipeline runs against it; nothing here knows about stages.
"""

from __future__ import annotations

import torch
from torch import nn

from spotpipe.config import Config
from spotpipe.data import collate
from spotpipe import job
from spotpipe.runtime.optim import build_optimizer, set_lr
from spotpipe.runtime.precision import Draws, Precision, loss_of, run_layers


def train_reference(cfg: Config, iterations: int | None = None,
                    skip: frozenset[int] = frozenset(),
                    device: torch.device | str = "cpu") -> tuple[nn.Module, list[float]]:
    """Train the unpartitioned model on `device`; return it and the loss of every iteration.
    The steps of the iterations in `skip` are not applied (their gradients are dropped), as
    `training.nonfinite: skip` does."""
    torch.set_num_threads(cfg.cluster.threads_per_worker)
    device = torch.device(device)
    layered = job.build_model(cfg)
    model = layered.to_sequential().to(device)
    dataset = job.build_dataset(cfg)
    sampler = job.build_sampler(cfg, dataset)
    optimizer = build_optimizer(model.parameters(), cfg)
    precision = Precision.of(cfg)
    ls = cfg.loss_scale
    # fp16: torch's own scaler, which the pipeline's must reproduce
    scaler = torch.amp.GradScaler(device.type, init_scale=ls.init, growth_factor=ls.growth_factor,
                                  backoff_factor=ls.backoff_factor,
                                  growth_interval=ls.growth_interval,
                                  enabled=precision.scaled)
    m, d = cfg.num_microbatches, cfg.pipelines
    losses = []
    for t in range(cfg.iterations if iterations is None else iterations):
        set_lr(optimizer, cfg, t)
        total = 0.0
        for pipeline in range(d):
            for k, idx in enumerate(sampler.pipeline_microbatches(t, pipeline, d, m)):
                x, y = (v.to(device) for v in collate(dataset, idx))
                draws = Draws(cfg.seed, t, pipeline * m + k)  # (dropout's masks, as a stage's)
                loss = loss_of(layered.loss_fn, run_layers(model, x, precision, draws), y,
                               precision) / (m * d)
                scaler.scale(loss).backward()
                total += float(loss.detach())
        scaler.unscale_(optimizer)
        if cfg.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        if t not in skip:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return model, losses
