"""A worker ended by the kernel's OOM killer is said so (spotpipe.cluster.oom): its cgroup's
count of OOM kills, read from fake cgroup trees here (no real OOM is provoked)."""

from __future__ import annotations

import os
import signal
import threading
import types
from pathlib import Path

import torch.distributed as dist

from spotpipe.cluster.agent import Agent
from spotpipe.cluster.oom import OomCount, counter_file, oom_cause, read_oom_kills
from spotpipe.cluster.supervisor import Supervisor
from spotpipe.protocol import Channel, keys

KEY = b"k" * 32

V1 = "12:pids:/\n4:memory:/job/a\n1:cpu,cpuacct:/\n0::/\n"  # (a hybrid host: v1's memory)
V2 = "0::/user.slice/job.scope\n"


def _tree(root: Path, proc_cgroup: str, counter: Path | None, text: str) -> Path:
    """A fake /sys/fs/cgroup under `root` holding `text` at `counter` (relative to it), and
    a fake /proc/self/cgroup; the latter's path."""
    if counter is not None:
        (root / counter).parent.mkdir(parents=True, exist_ok=True)
        (root / counter).write_text(text)
    root.mkdir(parents=True, exist_ok=True)
    proc = root / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return proc


def test_the_oom_kill_count_is_read_from_cgroup_v1_and_v2(tmp_path):
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    proc = _tree(tmp_path / "v1", V1, Path("memory/job/a/memory.oom_control"), v1)
    assert read_oom_kills(tmp_path / "v1", proc) == OomCount(
        3, tmp_path / "v1/memory/job/a/memory.oom_control")
    v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_group_kill 9\noom_kill 2\n"
    proc = _tree(tmp_path / "v2", V2, Path("user.slice/job.scope/memory.events"), v2)
    assert read_oom_kills(tmp_path / "v2", proc) == OomCount(
        2, tmp_path / "v2/user.slice/job.scope/memory.events")


def test_no_readable_count_says_nothing(tmp_path):
    # no counter file (v2's root cgroup has no memory.events), no memory cgroup listed, a
    # malformed or missing line, no /proc file: None, never an error
    assert read_oom_kills(tmp_path, _tree(tmp_path / "a", "0::/\n", None, "")) is None
    assert counter_file("3:cpu:/x\n5:pids:/\n") is None
    for text in ("oom_kill three\n", "oom_kill\n", "oom_kill -1\n", "oom 4\n", "garbage"):
        proc = _tree(tmp_path / "b", V2, Path("user.slice/job.scope/memory.events"), text)
        assert read_oom_kills(tmp_path / "b", proc) is None, text
    assert read_oom_kills(tmp_path, tmp_path / "absent") is None


def test_the_oom_killer_is_named_only_where_its_count_grew():
    file = Path("/sys/fs/cgroup/memory/job/memory.oom_control")
    assert oom_cause(OomCount(3, file), OomCount(4, file)) == (
        f"the kernel's out-of-memory killer: oom_kill 3 -> 4 in {file}")
    assert oom_cause(OomCount(4, file), OomCount(4, file)) == ""
    assert oom_cause(None, OomCount(4, file)) == oom_cause(OomCount(3, file), None) == ""
    assert oom_cause(OomCount(3, file), OomCount(4, Path("/elsewhere"))) == ""


def _crashed_message(why: str) -> tuple[list[str], str]:
    """What an agent says of a worker that died of SIGKILL with `why` (its supervisor's
    `exit_cause`), and the cause its `worker_crashed` event carries."""
    agent = Agent.__new__(Agent)
    said: list[str] = []
    agent.say, agent._lock, agent._restarts = said.append, threading.Lock(), 0
    agent.opts, agent._posted = types.SimpleNamespace(max_restarts=0), types.SimpleNamespace(t0=0)
    agent.channel, store = Channel(KEY, "agent2"), dist.HashStore()
    agent._crashed("node1", -signal.SIGKILL, store, why)
    event = Channel(KEY, "coordinator").open(store.get(keys.mailbox_slot(1)),
                                             at=keys.mailbox_slot(1)).message
    return said, event.details.get("cause", "")


def test_a_worker_that_the_oom_killer_ends_is_said_so_not_a_kill(tmp_path):
    """A worker SIGKILLed while its cgroup's OOM kill count grew: its supervisor's cause names
    the OOM killer, and the agent's word and event carry it (before: "died of SIGKILL"
    alone, as a `kill -9`). A node the supervisor killed itself is not put down to it."""
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    file = tmp_path / "memory.oom_control"
    count = [OomCount(3, file)]
    exited: dict[str, int] = {}
    done = threading.Event()

    def on_exit(node: str, code: int) -> None:
        exited[node] = code
        done.set()
    sup = Supervisor(tmp_path / "logs", on_exit, module="sleeper")
    sup.oom_kills = lambda: count[0]  # (the cgroup's count, as `oom.read_oom_kills` reads it)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    try:
        for node in ("node1", "node2"):
            sup.spawn(node, env)
        count[0] = OomCount(4, file)  # the kernel's OOM killer, then its SIGKILL
        os.kill(sup.procs["node1"].pid, signal.SIGKILL)
        assert done.wait(60) and exited == {"node1": -signal.SIGKILL}
        why = sup.exit_cause("node1", -signal.SIGKILL)
        assert why == f"the kernel's out-of-memory killer: oom_kill 3 -> 4 in {file}"
        said, cause = _crashed_message(why)
        assert said == [f"node1 died of SIGKILL ({why}) while its host lives; the job goes on "
                        "without it (--max-restarts N would start a fresh node in its place)"]
        assert cause == why
        assert sup.exit_cause("node1", 1) == ""
        done.clear()
        assert sup.kill("node2")  # (the count grew since it started, but this kill is ours)
        assert done.wait(60) and exited["node2"] == -signal.SIGKILL
        assert sup.exit_cause("node2", -signal.SIGKILL) == ""
    finally:
        sup.stop_all(grace_s=1.0)
