"""A containerized rank's processes as the host sees them: the rank under the container's init, everything below
it, its pid inside its own namespace, and the init's exit status read as a process's return code."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from reprise_common.procs import start_ticks

CHILD_WAIT_S = 5.0  # how long the rank's process may take to appear under the container's init
SIGNAL_EXIT_BASE = 128  # tini (and a shell) exit with 128 + N when their child died of signal N


def exit_code(status: int) -> int:
    """The container's exit status as a process's return code: 128 + N (a signal death) becomes -N."""
    if SIGNAL_EXIT_BASE < status < SIGNAL_EXIT_BASE + 65:
        return -(status - SIGNAL_EXIT_BASE)
    return status


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text(encoding="ascii")
                found += [int(child) for child in text.split()]
    return found


def descendants(pid: int) -> Iterator[int]:
    """Every process below `pid`, parents before their children."""
    for child in _children(pid):
        yield child
        yield from descendants(child)


def namespace_pid(pid: int) -> int | None:
    """The process's pid inside its own (innermost) pid namespace."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return None


def rank_pid(init_pid: int) -> int:
    """The rank's process under the container's init (the init itself once the rank is gone, or never came)."""
    deadline = time.monotonic() + CHILD_WAIT_S
    while time.monotonic() < deadline and init_pid > 0:
        children = _children(init_pid)
        if children:
            return children[0]
        if start_ticks(init_pid) is None:
            break
        time.sleep(0.005)
    return init_pid


def kill_init(pid: int, started: int | None) -> bool:
    """SIGKILL a container's init from the host (every process of its pid namespace dies with it), only while `pid`
    is still the init that started at `started` (its start time): whether it was there to kill. Raises
    PermissionError where the host may not signal it (a container of another user's)."""
    if pid <= 0 or started is None or start_ticks(pid) != started:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True
