"""Process helpers shared by the launcher and the agent."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn asking the kernel to send `sig` to the child when its parent dies (no orphans).

    libc is loaded here, in the parent: the child only calls prctl, so forking from a thread (the launcher's
    supervisor) cannot deadlock on a loader lock another thread held. The kernel's "parent" is the forking thread.
    """
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return lambda: None

    def preexec() -> None:
        with contextlib.suppress(Exception):
            prctl(_PR_SET_PDEATHSIG, sig)

    return preexec


def describe_exit(returncode: int) -> tuple[int | None, str | None]:
    """Split a subprocess return code into (exit code, signal name): negative codes are signals."""
    if returncode < 0:
        try:
            return None, signal.Signals(-returncode).name
        except ValueError:
            return None, f"SIG{-returncode}"
    return returncode, None


def oom_kill_count(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (Linux 4.13+), or None if it does not say."""
    try:
        for line in vmstat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class ProcessSample:
    """A process as /proc/<pid>/stat shows it at one moment."""

    state: str  # R running, S sleeping, D uninterruptible sleep, T stopped, t traced, Z zombie
    cpu_s: float  # user + system CPU seconds so far, every thread included
    rss_bytes: int = 0  # resident memory


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _stat_fields(pid: int, proc: Path = Path("/proc")) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (the state first), or none when the process is gone."""
    try:
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def sample_process(pid: int, proc: Path = Path("/proc")) -> ProcessSample | None:
    """The process's scheduler state and CPU time, or None when it is gone or /proc cannot say."""
    fields = _stat_fields(pid, proc)
    try:
        return ProcessSample(
            state=fields[0], cpu_s=(int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, rss_bytes=int(fields[21]) * _PAGE
        )
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When the process started, in clock ticks since boot (it tells a process from a later one given the same pid),
    or None when it is gone or /proc cannot say."""
    try:
        return int(_stat_fields(pid, proc)[19])
    except (IndexError, ValueError):
        return None


def signal_group(pgid: int, started: int | None, sig: int, proc: Path = Path("/proc")) -> None:
    """Signal the process group a process started at `started` (its leader, `pgid`) leads or led, never another one.

    pids are reused (pid_max is 32,768 on many hosts), so a group id recorded earlier may name a stranger's group by
    now. While the old group has a member the kernel keeps its id reserved; once it is empty, a new process may get
    that pid and lead a group of its own. So the signal goes only when no process has that pid (the leader is gone,
    but members may remain) or the process of that pid is the recorded one (same start time; an unknown start time
    proves nothing).
    """
    now = start_ticks(pgid, proc)
    if now is not None and now != started:
        return  # the pid belongs to a later process (or cannot be told from one): the recorded group is gone
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def process_alive(pid: int) -> bool:
    """True while a process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"
