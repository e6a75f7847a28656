"""What a job leaves in its store per generation: run a P x D job on a throwaway etcd with a
regroup at every iteration boundary (so each iteration or two is a generation), keep its keys
at the end instead of deleting them, and print how many keys and bytes each group of keys
holds, per generation. A measurement, not a test: `python tests/store_growth.py [ITERS]`
(needs the etcd binary)."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from etcd3gw.client import Etcd3Client  # noqa: E402

from spotpipe.cluster.launcher import train  # noqa: E402
from spotpipe.data import ensure_demo_corpus  # noqa: E402
from spotpipe.faults import Fault  # noqa: E402
from spotpipe.store.etcd import EtcdStore  # noqa: E402

from conftest import tiny_config  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402
from test_failover import FAST  # noqa: E402


def family(key: str) -> str:
    """A key with its numbers taken out: the kind of record it is."""
    return re.sub(r"\d+", "N", key)


def main(iters: int) -> None:
    folder = Path(tempfile.mkdtemp())
    server = EtcdServer(folder / "data")
    server.start()
    kept: list[tuple[str, int]] = []

    def keep(store: EtcdStore) -> None:  # the job's end: list its keys instead
        client = Etcd3Client(host=store.host, port=store.port)
        for value, meta in client.get_prefix(store.prefix):
            kept.append((meta["key"].decode()[len(store.prefix):], len(value)))

    EtcdStore.delete_prefix = keep  # type: ignore[method-assign]
    os.environ["SPOTPIPE_TEST_REGROUP_EVERY_ITERATION"] = "1"
    try:
        corpus = ensure_demo_corpus(folder / "corpus.txt")
        cfg = tiny_config(corpus, stages=2, pipelines=2, redundancy="lazy",
                          **{**FAST, "iterations": iters, "cluster.store": "etcd",
                             "cluster.etcd_endpoint": server.endpoint})
        run = folder / "run"
        code = train(cfg, run, progress=False, faults=[Fault("fail", "node1", 6)])
        assert code == 0, code
    finally:
        server.stop()
    lines = [json.loads(x) for x in open(run / "metrics.jsonl")]
    generations = lines[-1]["generation"] + 1
    families: Counter[str] = Counter()
    size: Counter[str] = Counter()
    per_gen: Counter[int] = Counter()
    for key, n in kept:
        families[family(key)] += 1
        size[family(key)] += n + len(key)
        found = re.search(r"/gen(\d+)/", key)
        if found:
            per_gen[int(found.group(1))] += 1
    total = sum(n + len(k) for k, n in kept)
    in_gens = sum(per_gen.values())
    print(f"{iters} iterations, {generations} generations, {len(kept)} keys, {total} bytes")
    for name, count in families.most_common():
        print(f"  {count:6d} keys {size[name]:9d} B  {name}")
    print(f"generations with keys left: {sorted(per_gen)}")
    print(f"keys under gen{{g}}/: {in_gens}, {in_gens / generations:.1f} a generation; "
          f"bytes under gen{{g}}/: "
          f"{sum(n + len(k) for k, n in kept if '/gen' in k) / generations:.0f} a generation")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
