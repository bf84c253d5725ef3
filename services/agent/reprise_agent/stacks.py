"""Python stacks of a job's ranks, captured with py-spy before they are stopped for a hang.

py-spy reads a process's memory without stopping it (`--nonblocking`), so a rank frozen by SIGSTOP or stuck in a
collective is read as it is. Every rank is read at once and the whole capture is bounded: a rank not read in time
is reported with its error, and the stop goes on. Reading another process's memory needs ptrace rights over it
(root, or CAP_SYS_PTRACE in a container).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reprise_agent.launch.base import RankHandle
from reprise_common.events import STACK_FRAMES_MAX, STACK_THREADS_MAX, StackFrame, ThreadStack
from reprise_common.procs import signal_group, start_ticks


def find_py_spy(configured: Path | None = None) -> Path | None:
    """The py-spy executable: the configured one, else the one beside this interpreter, else on PATH."""
    if configured is not None:
        return configured
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return beside
    found = shutil.which("py-spy")
    return Path(found) if found else None


class Capture:
    """What one rank's capture found: its threads, or why there are none."""

    def __init__(self, rank: RankHandle) -> None:
        self.pid = rank.pid
        sample = rank.usage()
        self.proc_state = sample.state if sample else ""
        self.threads: list[ThreadStack] = []
        self.error = ""
        self.took_ms = 0.0


async def capture(ranks: Sequence[RankHandle], *, py_spy: Path | None, within_s: float) -> dict[int, Capture]:
    """Capture the stacks of every rank at once, by pid; no rank's capture outlasts `within_s`."""
    found = {rank.pid: Capture(rank) for rank in ranks}
    if py_spy is None:
        for one in found.values():
            one.error = "py-spy is not installed on this node"
        return found
    await asyncio.gather(*(_read(one, py_spy, within_s) for one in found.values()))
    return found


async def _read(one: Capture, py_spy: Path, within_s: float) -> None:
    began = time.monotonic()
    try:
        process = await asyncio.create_subprocess_exec(
            str(py_spy),
            "dump",
            "--pid",
            str(one.pid),
            "--json",
            "--nonblocking",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own group: a late answer is killed with anything it started
        )
    except OSError as exc:
        one.error = f"py-spy could not start: {exc}"
        return
    started = start_ticks(process.pid)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=within_s)
    except TimeoutError:
        signal_group(process.pid, started, signal.SIGKILL)
        await process.wait()
        one.error = f"py-spy did not answer within {within_s:g} s"
        return
    finally:
        one.took_ms = round((time.monotonic() - began) * 1000, 1)
    if process.returncode != 0:
        reason = err.decode(errors="replace").strip().splitlines()
        one.error = f"py-spy failed ({process.returncode}): {reason[-1] if reason else 'no message'}"[:2000]
        return
    try:
        one.threads = threads_of(json.loads(out))
    except (ValueError, TypeError, KeyError) as exc:
        one.error = f"py-spy's answer was unreadable: {exc}"[:2000]


def threads_of(dump: list[dict[str, Any]]) -> list[ThreadStack]:
    """py-spy's JSON dump as bounded thread stacks, the main thread (the process's own id) first."""
    threads = sorted(dump, key=lambda t: t.get("os_thread_id") != t.get("pid"))
    return [
        ThreadStack(
            thread_id=int(thread.get("thread_id") or 0),
            name=str(thread.get("thread_name") or "")[:256],
            active=bool(thread.get("active")),
            frames=[
                StackFrame(
                    function=str(frame.get("name") or "?")[:256],
                    file=str(frame.get("filename") or "?")[-1024:],
                    line=frame.get("line") if isinstance(frame.get("line"), int) and frame["line"] >= 0 else None,
                )
                for frame in thread.get("frames", [])[:STACK_FRAMES_MAX]
            ],
        )
        for thread in threads[:STACK_THREADS_MAX]
    ]
