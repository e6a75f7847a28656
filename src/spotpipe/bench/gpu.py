"""`spotpipe bench gpu`: what changes when the stages run on a GPU.

Three questions that only a GPU answers, each one a figure:

- Do a CPU copy and a GPU owner stay bit-identical? Shadows (and replicas with
  `replica.device: cpu`) apply the owner's gradients with the same optimizer on the CPU. The
  same updates are stepped on the CPU and on the GPU from the same state, for torch's fused
  AdamW, its per-tensor AdamW and SGD, and spotpipe's portable kernels
  (`optimizer.kernel: portable`), and the tensors whose bits differ are counted. The same
  for a bf16-autocast and an fp32 matrix product: what a replica's forward (eager
  redundancy, FRC) would compute on the CPU against the GPU.
- Can two workers share one GPU? Two processes form an NCCL group on the same device.
- Does the launch's memory estimate hold? `spotpipe train examples/gpt2_small.yaml` on one
  GPU (P = 1: one worker per GPU), fp32 and bf16: the estimate printed at launch against the
  worker's `torch.cuda.max_memory_allocated` (`peak_device_mib` in `worker_done`), and the
  throughput of each.

Needs a CUDA GPU; `--quick` steps smaller tensors and trains fewer iterations.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from spotpipe.bench.model import launch_estimates, throughput, train_example
from spotpipe.runfiles import read_jsonl
from spotpipe.runtime.optim import PortableAdamW, PortableSGD, rounded_sqrt

# a GPT-2 small block and a slice of its embedding: the shapes an optimizer steps
SHAPES = [(768,), (768, 2304), (2304,), (768, 768), (768, 3072), (3072,), (3072, 768),
          (12565, 768), (7, 13)]
QUICK_SHAPES = [(768,), (768, 768), (333, 77), (7, 13)]

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                                weight_decay=0.1, fused=True),
    "adamw_per_tensor": lambda ps: torch.optim.AdamW(ps, lr=3e-4, betas=(0.9, 0.95),
                                                     eps=1e-8, weight_decay=0.1,
                                                     foreach=False),
    "adamw_portable": lambda ps: PortableAdamW(ps, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                               weight_decay=0.1),
    "sgd_per_tensor": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1,
                                                 foreach=False),
    "sgd_portable": lambda ps: PortableSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
}


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p.detach())
            out.extend(v for _, v in sorted(optimizer.state[p].items())
                       if isinstance(v, torch.Tensor))
    return out


def optimizer_bits(make: Factory, shapes: list[tuple[int, ...]], steps: int,
                   device: torch.device) -> dict[str, Any]:
    """Step the same parameters with the same gradients on the CPU and on `device`; count the
    state tensors (parameters, moments) whose bits differ at the end."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    cpu = [torch.nn.Parameter(t.clone()) for t in init]
    dev = [torch.nn.Parameter(t.clone().to(device)) for t in init]
    opt_cpu, opt_dev = make(cpu), make(dev)
    base = opt_cpu.param_groups[0]["lr"]
    for step in range(steps):
        for a, b in zip(cpu, dev):
            g = torch.randn(a.shape, generator=gen) * 10.0 ** -(1 + step % 3)
            a.grad, b.grad = g, g.to(device)
        for opt in (opt_cpu, opt_dev):
            for group in opt.param_groups:  # a cosine schedule's changing rate
                group["lr"] = base * 0.5 * (1 + math.cos(math.pi * step / steps))
            opt.step()
    differ, elements, worst = 0, 0, 0.0
    pairs = list(zip(_state(opt_cpu), _state(opt_dev)))
    for a, b in pairs:
        b = b.cpu()
        if not torch.equal(a, b):
            differ += 1
            elements += int((a != b).sum())
            scale = a.abs().max().clamp_min(1e-30)
            worst = max(worst, float(((a - b).abs().max() / scale)))
    return {"tensors": len(pairs), "tensors_differ": differ, "elements_differ": elements,
            "max_relative_difference": worst}


def elementwise_bits(device: torch.device) -> dict[str, int]:
    """Elements (of a million) whose bits differ between the CPU and `device`, per basic
    operation and dtype: which operations a portable update may use."""
    gen = torch.Generator().manual_seed(2)
    a = torch.rand(1 << 20, generator=gen, dtype=torch.float64) + 1e-3
    b = torch.rand(1 << 20, generator=gen, dtype=torch.float64) + 1e-3
    ops = {"mul": torch.mul, "add": torch.add, "div": torch.div,
           "sqrt": lambda x, _: torch.sqrt(x)}
    out = {}
    for dtype in (torch.float32, torch.float64):
        x, y = a.to(dtype), b.to(dtype)
        for name, op in ops.items():
            here, there = op(x, y), op(x.to(device), y.to(device)).cpu()
            out[f"{name}_{str(dtype).removeprefix('torch.')}"] = int((here != there).sum())
        if dtype == torch.float32:
            out["rounded_sqrt_float32"] = int((rounded_sqrt(x)
                                               != rounded_sqrt(x.to(device)).cpu()).sum())
        there = torch._foreach_div([x.to(device)], [y.to(device)])[0].cpu()
        out[f"foreach_div_{str(dtype).removeprefix('torch.')}"] = int((torch.div(x, y)
                                                                       != there).sum())
    return out


def matmul_bits(device: torch.device) -> dict[str, Any]:
    """A layer's product on the CPU against `device`, fp32 (no TF32) and bf16 autocast."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 768, generator=gen), torch.randn(768, 768, generator=gen)
    out = {}
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for name, dtype in (("fp32", None), ("bf16_autocast", torch.bfloat16)):
            results = []
            for dev in (torch.device("cpu"), device):
                with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                    results.append((x.to(dev) @ w.to(dev)).float().cpu())
            a, b = results
            out[name] = {"elements_differ": int((a != b).sum()), "elements": a.numel()}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def _nccl_member(rank: int, path: str, queue: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=2)
        t = torch.ones(4, device="cuda:0")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        queue.put((rank, "ok", float(t[0])))
        dist.destroy_process_group()
    except Exception as exc:  # what NCCL says is the figure
        queue.put((rank, "error", f"{type(exc).__name__}: {str(exc)[:400]}"))


def two_ranks_one_gpu(timeout_s: float = 120.0) -> dict[str, Any]:
    """Whether NCCL forms a group of two processes on the one GPU (spotpipe's `auto` backend
    assumes it does not)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_nccl_member, args=(r, f"{tmp}/init", queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        answers = []
        try:
            for _ in procs:
                answers.append(queue.get(timeout=timeout_s))
        except Exception:
            answers.append((-1, "error", f"no answer within {timeout_s} s"))
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    ok = all(kind == "ok" for _, kind, _ in answers) and len(answers) == 2
    return {"works": ok, "answers": [f"rank {r}: {kind}: {what}" for r, kind, what in answers]}


def _train_on_gpu(out: Path, precision: str, iterations: int, extra: list[str]
                  ) -> dict[str, Any]:
    result = train_example(out, ["--set", "stages=1", "--set", "redundancy=none",
                                 "--set", f"precision={precision}",
                                 "--set", f"iterations={iterations}",
                                 "--set", "cluster.backend=nccl", *extra])
    samples_per_s, iteration_s = throughput(out)
    done = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "worker_done"]
    estimate = launch_estimates(result.stderr).get(0)
    peak = done[0].get("peak_device_mib") if done else None
    return {"samples_per_s": round(samples_per_s, 1), "iteration_s": round(iteration_s, 4),
            "estimate_mib": estimate, "peak_device_mib": peak,
            "peak_reserved_mib": done[0].get("peak_reserved_mib") if done else None,
            "estimate_over_peak": (round(estimate / peak, 3) if estimate and peak else None),
            "final_loss": read_jsonl(out / "metrics.jsonl")[-1]["loss"]}


def run(quick: bool = False) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise RuntimeError("it needs a CUDA GPU, and torch finds none on this machine")
    device = torch.device("cuda", 0)
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(device),
                               "torch": torch.__version__, "cuda": torch.version.cuda,
                               "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    shapes, steps = (QUICK_SHAPES, 5) if quick else (SHAPES, 20)
    bits = {}
    for name, make in OPTIMIZERS.items():
        bits[name] = optimizer_bits(make, shapes, steps, device)
        print(f"{name}: {bits[name]}", flush=True)
    figures["optimizer_cpu_against_gpu"] = bits
    figures["elementwise_cpu_against_gpu"] = elementwise_bits(device)
    print(f"elementwise: {figures['elementwise_cpu_against_gpu']}", flush=True)
    figures["matmul_cpu_against_gpu"] = matmul_bits(device)
    print(f"matmul: {figures['matmul_cpu_against_gpu']}", flush=True)
    figures["nccl_two_ranks_one_gpu"] = two_ranks_one_gpu()
    print(f"nccl, two ranks on one GPU: {figures['nccl_two_ranks_one_gpu']}", flush=True)
    # the example's data is bytes (256 tokens); longer blocks and larger micro-batches than
    # the CPU example, so that activations weigh in the estimate
    extra = ["--set", "data.block_size=512", "--set", "micro_batch_size=8"]
    iterations = 4 if quick else 12
    with tempfile.TemporaryDirectory(prefix="spotpipe-bench-gpu-") as tmp:
        for precision in ("fp32", "bf16"):
            row = _train_on_gpu(Path(tmp) / precision, precision, iterations, extra)
            figures[f"gpt2_small_{precision}"] = row
            print(f"gpt2-small {precision} on the GPU: {row}", flush=True)
    figures["bf16_over_fp32"] = round(figures["gpt2_small_bf16"]["samples_per_s"]
                                      / figures["gpt2_small_fp32"]["samples_per_s"], 3)
    return figures
