"""Iteration time of a layout, from the very streams the runtime executes.

A layout's shape (depth P, width D, which stages run merged on their predecessor's node, and
whether replicas run eager forward redundant computation) fixes its iteration time. Per
pipeline the streams are built exactly as `spotpipe.runtime.node.node_schedule` builds them:

- every node runs one stage: `build_schedule(kind, P, M)`, and with eager redundancy
  `with_frc(schedule, placement_costs)`, where the placement costs are what the runtime uses
  (the parameters each stage multiplies by as its forward cost, twice that as backward, no
  comm): FRC of every replica but the last stage's, or of every one as Bamboo's engine runs
  it (`frc_every_stage`, for the reproduction of Bamboo);
- some node carries two stages after a takeover: `merged_schedule(kind, M, actors)` with the
  actors' stages sorted and the actors ordered by their first stage, and no FRC anywhere in
  that pipeline (the runtime stops FRC until the layout is rebalanced);

then `spotpipe.schedule.simulate` times those streams with the model's time costs (an FRC
costs its replica stage's forward). `spotpipe.sim.fastsched` does the placement, the merge
and the timing with the same results, 5-50x faster (the schedule package's placement
re-times the schedule after every insertion: seconds for M = 128). Placed schedules are
cached by (kind, P, M, placement costs) and iteration times by shape: the simulator pays a
dictionary lookup per reconfiguration. `warm` lets a sweep time the common shapes once, in
parallel, before forking.

Other modelling choices: the global batch is fixed (D pipelines each run ceil(G / D)
micro-batches); the data-parallel all-reduce is a ring over D pipelines of the largest
actor's gradient bytes; a synchronous step waits for the slowest pipeline.
"""

from __future__ import annotations

from functools import lru_cache
from math import ceil
from pathlib import Path

from spotpipe.plan.layout import uniform_partition
from spotpipe.schedule import Schedule, StageCosts
from spotpipe.sim.fastsched import base_schedule, iteration_s, merged_iteration_s, with_frc
from spotpipe.sim.models import ModelCosts

# (kind, P, M, placement sizes, FRC) -> schedule with FRC placed; filled lazily or by warm-up
_PLACED: dict[tuple, Schedule] = {}
# (model, kind, P, D, merged, FRC) -> seconds of one pipeline's iteration; FRC: "none",
# "served" (`frc_serves`' replicas) or "every" (every replica, as Bamboo: `_frc`)
_TIMES: dict[tuple, float] = {}


@lru_cache(maxsize=None)
def stage_costs(model: ModelCosts, num_stages: int) -> tuple[tuple[float, ...], tuple[float, ...],
                                                            tuple[float, ...]]:
    """Per-stage forward, backward seconds and gradient bytes, layers split uniformly."""
    return (_stage_sums(model.forward_s, num_stages), _stage_sums(model.backward_s, num_stages),
            _stage_sums(model.param_bytes, num_stages))


def _stage_sums(per_layer: tuple[float, ...], num_stages: int) -> tuple[float, ...]:
    """`per_layer` summed over each stage of the uniform split the simulator assumes."""
    return tuple(sum(per_layer[a:b]) for a, b in uniform_partition(len(per_layer), num_stages))


def microbatches_per_pipeline(model: ModelCosts, num_pipelines: int) -> int:
    return max(1, ceil(model.global_microbatches / max(1, num_pipelines)))


def placement_sizes(model: ModelCosts, num_stages: int) -> tuple[float, ...]:
    """The runtime's FRC placement costs: per stage, the parameters its layers multiply by
    (`ModelCosts.placement_weights`, at least 1), as floats.

    A model without them (a measured profile) counts its parameters: `param_bytes` are fp16
    gradient bytes (2 per parameter), and placement is invariant to scale.
    """
    if model.placement_weights:
        return tuple(float(max(1.0, w)) for w in _stage_sums(model.placement_weights, num_stages))
    return tuple(float(max(1.0, b / 2.0)) for b in stage_costs(model, num_stages)[2])


def placement_key(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                  frc: str = "served") -> tuple:
    return (kind, num_stages, microbatches_per_pipeline(model, num_pipelines),
            placement_sizes(model, num_stages), frc)


def placed_schedule(key: tuple) -> Schedule:
    """`with_frc` of the plain schedule with the runtime's placement costs (cached)."""
    sched = _PLACED.get(key)
    if sched is None:
        kind, p, m, sizes, frc = key
        costs = StageCosts(sizes, tuple(2.0 * s for s in sizes))
        sched = _PLACED[key] = with_frc(base_schedule(kind, p, m), costs,
                                        every_stage=frc == "every")
    return sched


def _frc(redundant: bool, every_stage: bool) -> str:
    return "none" if not redundant else "every" if every_stage else "served"


def warm(model: ModelCosts, kind: str, num_stages: int, widths: range,
         processes: int = 1) -> None:
    """Time the plain redundant shapes of these widths before a sweep forks, in parallel.

    These are the shapes every run meets, and the slow ones (FRC placement); what is not
    on disk yet is computed by `processes` workers, largest first, and kept in memory so
    that forked sweep workers inherit it.
    """
    keys = [(model, kind, num_stages, d, (), _frc(num_stages > 1, False)) for d in widths]
    todo = [k for k in keys if k not in _TIMES and _disk_get(k) is None]
    if processes > 1 and len(todo) > 1:
        import multiprocessing as mp

        todo.sort(key=lambda k: k[3])  # narrow = more micro-batches = slower placement
        with mp.get_context("fork").Pool(min(processes, len(todo))) as pool:
            for key, value in zip(todo, pool.starmap(_compute_and_store, todo, chunksize=1)):
                _TIMES[key] = value
    for key in keys:
        _pipeline_time(*key)


def _compute_and_store(*key) -> float:
    value = _compute_pipeline_time(*key)
    _disk_put(key, value)
    return value


def pipeline_time(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                  merged: tuple, redundant: bool, *,
                  frc_every_stage: bool = False) -> float:
    """Seconds of one iteration of one pipeline of this shape (merged: stages run by their
    predecessor's node; redundant: eager FRC, `frc_every_stage` as Bamboo runs it)."""
    if merged or num_stages < 2:
        redundant = False  # a pipeline with a carrier runs no FRC (see the module doc)
    return _pipeline_time(model, kind, num_stages, num_pipelines, merged,
                          _frc(redundant, frc_every_stage))


def _pipeline_time(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                   merged: tuple, frc: str) -> float:
    key = (model, kind, num_stages, num_pipelines, merged, frc)
    value = _TIMES.get(key)
    if value is None:
        value = _disk_get(key)
        if value is None:
            value = _compute_and_store(*key)
        _TIMES[key] = value
    return value


def _compute_pipeline_time(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                           merged: tuple, frc: str) -> float:
    fwd, bwd, byt = stage_costs(model, num_stages)
    actors = _actors(num_stages, merged)
    m = microbatches_per_pipeline(model, num_pipelines)
    biggest = max(sum(byt[s] for s in a) for a in actors)
    ring = 2.0 * (num_pipelines - 1) / num_pipelines if num_pipelines > 1 else 0.0
    costs = StageCosts(fwd, bwd, comm=model.activation_bytes / model.network_bytes_s,
                       all_reduce=ring * biggest / model.network_bytes_s,
                       optimizer=biggest * model.optimizer_s_per_byte)
    if len(actors) < num_stages:  # (the merged streams, timed without building them)
        return merged_iteration_s(kind, m, actors, costs)
    if frc != "none" and num_stages > 1:
        sched = placed_schedule(placement_key(model, kind, num_stages, num_pipelines, frc))
    else:
        sched = base_schedule(kind, num_stages, m)
    return iteration_s(sched, costs)


def iteration_time(model: ModelCosts, kind: str, num_stages: int, num_pipelines: int,
                   merged: tuple[tuple[int, ...], ...], redundant: bool, *,
                   frc_every_stage: bool = False) -> float:
    """A synchronous data-parallel step waits for the slowest pipeline."""
    if num_pipelines < 1:
        raise ValueError("no pipeline runs")
    return max(pipeline_time(model, kind, num_stages, num_pipelines, m, redundant,
                             frc_every_stage=frc_every_stage)
               for m in set(merged))


def _actors(num_stages: int, merged: tuple) -> list[list[int]]:
    """Stages grouped by the node that runs them, as the runtime orders them: each node's
    stages ascending, nodes by their first stage. A merged stage runs on its predecessor's
    node (stage 0 merged: on the last stage's node); a pipeline whose nodes run stages
    apart gives its nodes' stages instead (`Layout.shape_key`)."""
    if merged and isinstance(merged[0], tuple):
        return [list(stages) for stages in merged]
    merged_set = set(merged)
    if len(merged_set) >= num_stages:
        return [list(range(num_stages))]
    groups: list[list[int]] = []
    for s in range(num_stages):
        if s in merged_set and groups:
            groups[-1].append(s)
        else:
            groups.append([s])
    if 0 in merged_set:  # stage 0 runs on the last stage's node: fold the last group into it
        last = groups.pop()
        groups[0] = last + groups[0]
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


# -- a cache of pipeline times on disk ----------------------------------------------------
# A shape's time is a pure function of (costs, kind, P, D, merged, FRC) and of the
# schedule code. Placing FRC for M = 128 takes seconds and a sweep meets hundreds of merged
# shapes, so times are kept on disk, one small JSON per shape, named by a hash of the inputs
# *and of the source of spotpipe.schedule* (any change to the schedule code invalidates
# them). SPOTPIPE_SIM_CACHE=off disables it; SPOTPIPE_SIM_CACHE=DIR moves it (default
# $XDG_CACHE_HOME/spotpipe/sim-shapes). Workers of a sweep share it, so a shape is timed once.

CACHE_STATS = {"hits": 0, "misses": 0}
_CODE_HASH: str | None = None


def cache_dir() -> Path | None:
    import os
    from pathlib import Path

    env = os.environ.get("SPOTPIPE_SIM_CACHE", "")
    if env.lower() in ("off", "0", "no", "false"):
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "spotpipe" / "sim-shapes"


def _code_hash() -> str:
    global _CODE_HASH
    if _CODE_HASH is None:
        import hashlib
        from pathlib import Path

        import spotpipe.schedule as sched_pkg

        h = hashlib.sha256()
        for f in sorted(Path(sched_pkg.__file__).parent.glob("*.py")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        h.update(Path(__file__).read_bytes())
        h.update((Path(__file__).parent / "fastsched.py").read_bytes())
        _CODE_HASH = h.hexdigest()
    return _CODE_HASH


def _disk_path(key: tuple) -> Path | None:
    import hashlib

    d = cache_dir()
    if d is None:
        return None
    digest = hashlib.sha256((_code_hash() + repr(key)).encode()).hexdigest()[:40]
    return d / f"{digest}.json"


def _disk_get(key: tuple) -> float | None:
    import json

    path = _disk_path(key)
    if path is not None:
        try:
            raw = json.loads(path.read_text())
            if raw.get("key") == repr(key[1:]) and isinstance(raw.get("iteration_s"), float):
                CACHE_STATS["hits"] += 1
                return raw["iteration_s"]
        except (OSError, ValueError, AttributeError):
            pass
    CACHE_STATS["misses"] += 1
    return None


def _disk_put(key: tuple, value: float) -> None:
    import json
    import os
    import tempfile

    path = _disk_path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": repr(key[1:]), "model": key[0].name, "iteration_s": value}, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs time
