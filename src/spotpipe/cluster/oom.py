"""Whether the kernel's out-of-memory killer ended a worker, from its cgroup's count of them.

A worker the OOM killer ends dies of SIGKILL, as one ended by `kill -9` does: its exit code
cannot tell them apart, and the job said only "died of SIGKILL". Linux counts the OOM kills
of each memory cgroup: cgroup v2's `memory.events` has an `oom_kill N` line, in the process's
cgroup folder (/sys/fs/cgroup + the path after "0::" in /proc/self/cgroup); cgroup v1's
`memory.oom_control` has one too, under the memory controller's mount (/sys/fs/cgroup/memory
+ the path on /proc/self/cgroup's `memory` line). The supervisor reads the count when it
starts a worker and again when that worker dies of a SIGKILL it did not send: a count that
grew in between names the OOM killer. Workers share their supervisor's cgroup (a fork
inherits it), so the count is of the supervising process's cgroup; one OOM kill in it and an
unrelated `kill -9` of another of its workers at the same moment would both be named so.
Where no count can be read (no memory controller, a root cgroup v2 has no `memory.events`, a
file that does not parse), nothing more is said.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class OomCount:
    """A cgroup's count of OOM kills (`kills`), as read from `file`."""

    kills: int
    file: Path


def counter_file(proc_cgroup: str, root: Path = ROOT) -> Path | None:
    """The file that holds the OOM kill count of the cgroup that `proc_cgroup` (the text of
    /proc/<pid>/cgroup) names: cgroup v1's memory controller where one is listed (then the
    memory controller is v1's, even where a v2 hierarchy is mounted beside it), else v2's
    ("0::<path>"); None where neither is listed."""
    unified = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        relative = path.strip().lstrip("/")
        if "memory" in controllers.split(","):
            return root / "memory" / relative / "memory.oom_control"
        if hierarchy == "0" and not controllers:
            unified = root / relative / "memory.events"
    return unified


def parse_oom_kills(text: str) -> int | None:
    """The `oom_kill N` line's N in a `memory.events` (v2) or `memory.oom_control` (v1);
    None without one that parses (`oom_kill_disable`, v1's, and `oom_group_kill`, v2's, are
    other counts)."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == "oom_kill":
            try:
                kills = int(fields[1])
            except ValueError:
                return None
            return kills if kills >= 0 else None
    return None


def read_oom_kills(root: Path = ROOT, proc_cgroup: Path = PROC_CGROUP) -> OomCount | None:
    """The OOM kill count of this process's memory cgroup (`root`: where the cgroup
    hierarchies are mounted), or None where it cannot be read."""
    try:
        found = counter_file(proc_cgroup.read_text(), root)
        if found is None:
            return None
        kills = parse_oom_kills(found.read_text())
    except (OSError, UnicodeDecodeError):
        return None
    return OomCount(kills, found) if kills is not None else None


def oom_cause(before: OomCount | None, after: OomCount | None) -> str:
    """What a worker's SIGKILL is put down to, given the count read at its start (`before`)
    and at its death (`after`): the OOM killer where the count of the same file grew, else
    "" (nothing known)."""
    if before is None or after is None or before.file != after.file:
        return ""
    if after.kills <= before.kills:
        return ""
    return (f"the kernel's out-of-memory killer: oom_kill {before.kills} -> {after.kills} "
            f"in {after.file}")
