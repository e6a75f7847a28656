"""The layer profile: partitions at every depth cut from one measurement, and a profile read
from a file or a store record checked field by field."""

from __future__ import annotations

import json
import math

import pytest

from spotpipe import job
from spotpipe.plan.memory import LayerMemory
from spotpipe.plan.profile import LayerProfile, ProfileError

from conftest import tiny_config


def _profile(times=(1.0, 1.0, 1.0, 5.0), params=(10, 40, 40, 10)) -> LayerProfile:
    return LayerProfile(names=("wte", "h.0", "h.1", "head"), params=tuple(params),
                        memory=tuple(LayerMemory(p, 100.0, 64.0) for p in params),
                        times=None if times is None else tuple(times),
                        tied=(("0.wte.weight", "3.head.weight"),))


def test_every_depth_is_cut_from_the_same_profile(corpus):
    profile = _profile()
    timed = tiny_config(corpus, stages=3, **{"model.partition": "time"})
    # by hand: largest stage sum 5 at both depths; at P = 3 the first three layers split
    # 1+1 | 1 or 1 | 1+1 (both even), at P = 2 they stay together
    assert job.compute_partition(timed, profile, 2) == [(0, 3), (3, 4)]
    assert job.compute_partition(timed, profile, 3) in ([(0, 2), (2, 3), (3, 4)],
                                                        [(0, 1), (1, 3), (3, 4)])
    by_params = tiny_config(corpus, stages=2, **{"model.partition": "parameters"})
    assert job.compute_partition(by_params, profile) == [(0, 2), (2, 4)]  # 50 | 50
    uniform = tiny_config(corpus, stages=3)
    assert job.compute_partition(uniform, profile) == [(0, 2), (2, 3), (3, 4)]
    assert job.partition_at_depth(uniform, profile, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_method_that_needs_times_says_so_when_the_profile_has_none(corpus):
    cfg = tiny_config(corpus, stages=2, **{"model.partition": "time"})
    with pytest.raises(job.PartitionError, match="'time' needs the layers' profiled times"):
        job.compute_partition(cfg, _profile(times=None))


def test_a_tie_split_away_from_the_ends_is_refused_at_any_depth(corpus):
    profile = LayerProfile(names=(), params=(1, 1, 1, 1),
                           memory=tuple(LayerMemory(1, 1.0, 1.0) for _ in range(4)),
                           tied=(("1.w", "2.w"),))
    cfg = tiny_config(corpus, stages=2)
    assert job.partition_at_depth(cfg, profile, 2) == [(0, 2), (2, 4)]  # 1.w on stage 0
    with pytest.raises(job.PartitionError, match=r"tied parameter 1.w .* at P=4"):
        job.partition_at_depth(cfg, profile, 4)


def test_the_run_spec_travels_and_comes_back_equal():
    spec = job.RunSpec([(0, 3), (3, 4)], 64, _profile())
    assert job.RunSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    # the loss's part of the last layer's activations travels too, and a block's backward
    # working memory; a record written before either was kept (6, 7 entries a layer) reads
    # as none
    lossy = _profile()
    lossy = LayerProfile(lossy.names, lossy.params, lossy.memory[:-1] + (
        LayerMemory(10, 300.0, 0.0, 50.0, loss_bytes=200.0, backward_bytes=75.0),),
        lossy.times, lossy.tied)
    data = json.loads(json.dumps(lossy.to_json()))
    assert LayerProfile.from_json(data) == lossy
    data["memory"] = [row[:7] for row in data["memory"]]
    assert LayerProfile.from_json(data).memory[-1].backward_bytes == 0.0
    assert LayerProfile.from_json(data).memory[-1].loss_bytes == 200.0
    data["memory"] = [row[:6] for row in data["memory"]]
    assert LayerProfile.from_json(data).memory[-1].loss_bytes == 0.0
    hosts = job.RunSpec([(0, 3), (3, 4)], 64, _profile(), data_digest="0a" * 32)
    assert job.RunSpec.from_json(json.loads(json.dumps(hosts.to_json()))) == hosts
    older = spec.to_json()
    del older["data_digest"]  # (a run.json of a spotpipe from before the digest)
    assert job.RunSpec.from_json(older) == spec


@pytest.mark.parametrize("change, named", [
    (lambda d: d["profile"]["times"].__setitem__(2, math.nan), "times[2]"),
    (lambda d: d["profile"]["times"].__setitem__(0, -1.0), "times[0]"),
    (lambda d: d["profile"]["params"].__setitem__(1, "40"), "params[1]"),
    (lambda d: d["profile"]["memory"].__setitem__(3, [1, 2, 3, 4]), "memory[3]"),
    (lambda d: d["profile"]["memory"].__setitem__(1, [1, 2, 3, 4, 5, 1]), "memory[1][5]"),
    (lambda d: d["profile"]["times"].pop(), "times has 3 entries for 4 layers"),
    (lambda d: d["profile"].pop("params"), "params is missing"),
    (lambda d: d["profile"]["tied"].append(["a"]), "tied[1]"),
    (lambda d: d.__setitem__("partition", [[0, 3], [2, 4]]), "does not cover"),
    (lambda d: d.__setitem__("partition", [[0, 3]]), "does not cover"),
    (lambda d: d.__setitem__("num_samples", 0), "num_samples"),
    (lambda d: d.pop("profile"), "layer profile: not an object"),
    (lambda d: d.__setitem__("data_digest", "abc"), "data_digest"),
    (lambda d: d.__setitem__("data_digest", "Z" * 64), "data_digest"),
    (lambda d: d.__setitem__("data_digest", 7), "data_digest"),
])
def test_a_bad_run_spec_is_refused_naming_the_field(change, named):
    data = json.loads(json.dumps(job.RunSpec([(0, 3), (3, 4)], 64, _profile()).to_json()))
    change(data)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        job.RunSpec.from_json(data)


def test_a_profile_needs_a_layer():
    with pytest.raises(ProfileError, match="no layers"):
        LayerProfile(names=(), params=(), memory=())
