"""A standby container's share of the node's CPU, set from the host on the container's cgroup.

A standby imports its modules at SCHED_IDLE, but the kernel weighs a thread's policy only against the threads of its
own cgroup, and each container is a cgroup of its own that the CPU controller weighs as the equal of every rank's
container. A node's standbys importing torch so took most of its CPU from the ranks (on the bench's 2 cores, 18
standby containers beside 4 ranks' left the ranks about 4/22 of it for over a minute). So while a standby waits, its
container's cgroup has the least weight the kernel allows, and the rank it becomes gets the weight it had back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from reprise_common.logging import get_logger

log = get_logger("reprise.agent.containers")

LEAST = {"cpu.weight": "1", "cpu.shares": "2"}  # cgroup v2's weight, v1's shares: the smallest each accepts


@dataclass(frozen=True)
class _Mount:
    fstype: str  # cgroup (v1) or cgroup2
    options: frozenset[str]  # a v1 hierarchy's controllers among them
    root: str  # the cgroup this mount shows at its mount point
    point: str


@dataclass(frozen=True)
class CpuShare:
    """A container's CPU weight file and the value it had before it was lowered."""

    path: Path
    normal: str

    @classmethod
    def lower(cls, pid: int) -> CpuShare | None:
        """Give the cgroup of process `pid` (a container's) the least CPU weight; None where it cannot be found or
        written (the standby then imports at the container's usual weight)."""
        path = cgroup_cpu_file(pid)
        if path is None:
            return None
        try:
            normal = path.read_text(encoding="ascii").strip()
            path.write_text(LEAST[path.name], encoding="ascii")
        except OSError as exc:
            log.warning("a standby container's CPU weight stays as it is", extra={"path": str(path), "error": str(exc)})
            return None
        return cls(path, normal)

    def restore(self) -> None:
        """Give the cgroup its weight back (the container may be gone already)."""
        with contextlib.suppress(OSError):
            self.path.write_text(self.normal, encoding="ascii")


def _mounts() -> list[_Mount]:
    try:
        return parse_mounts(Path("/proc/self/mountinfo").read_text(encoding="utf-8"))
    except OSError:
        return []


def parse_mounts(mountinfo: str) -> list[_Mount]:
    """The cgroup hierarchies in a /proc/<pid>/mountinfo."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1 :]
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append(_Mount(tail[0], frozenset(tail[2].split(",")), fields[3], fields[4]))
    return found


def cpu_files(cgroup: str, mounts: list[_Mount]) -> list[Path]:
    """Where the CPU weight of the cgroup a /proc/<pid>/cgroup names may be, in order: `cpu.shares` where the cpu
    controller is on a v1 hierarchy, `cpu.weight` on the unified (v2) one (on a hybrid host, the v2 one is missing)."""
    found = []
    for line in cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0":
            candidates = [(m, "cpu.weight") for m in mounts if m.fstype == "cgroup2"]
        elif "cpu" in controllers.split(","):
            candidates = [(m, "cpu.shares") for m in mounts if m.fstype == "cgroup" and "cpu" in m.options]
        else:
            continue
        for mount, name in candidates:
            if mount.root == "/":
                found.append(Path(mount.point + path) / name)
            elif path == mount.root or path.startswith(mount.root + "/"):
                found.append(Path(mount.point + path[len(mount.root) :]) / name)
    return found


def cgroup_cpu_file(pid: int) -> Path | None:
    """The file that holds the CPU weight of process `pid`'s cgroup; None when none is found."""
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8")
    except OSError:
        return None
    return next((file for file in cpu_files(cgroup, _mounts()) if file.is_file()), None)
