"""Ranks as child processes of the agent, each leading its own process group, started cold or on a warm standby."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from reprise_agent.launch.standby import StandbyPool
from reprise_common.procs import (
    ProcessSample,
    die_with_parent,
    oom_kill_count,
    sample_process,
    signal_group,
    start_ticks,
)


def io_chars(pid: int) -> int | None:
    """The bytes a process read and wrote through system calls so far (rchar + wchar); None when unreadable."""
    try:
        text = Path(f"/proc/{pid}/io").read_text(encoding="ascii")
    except OSError:
        return None
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    try:
        return int(fields["rchar"]) + int(fields["wchar"])
    except (KeyError, ValueError):
        return None


class ProcessHandle:
    """One rank process; its group is signalled only while its leader's pid is still its own (start time checked)."""

    def __init__(self, proc: asyncio.subprocess.Process, *, warm: bool = False) -> None:
        self.proc = proc
        self.warm = warm
        self.oom_baseline = oom_kill_count()
        self.started = start_ticks(proc.pid)  # its pid may be another process's once it has exited

    @property
    def pid(self) -> int:
        """The process's id (its group's too)."""
        return self.proc.pid

    @property
    def output(self) -> asyncio.StreamReader:
        """Its stdout, stderr joined in."""
        assert self.proc.stdout is not None
        return self.proc.stdout

    @property
    def returncode(self) -> int | None:
        """Its exit code, negative for a signal; None while it runs."""
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for its exit."""
        return await self.proc.wait()

    def signal(self, sig: int) -> None:
        """Signal its whole process group."""
        signal_group(self.proc.pid, self.started, sig)

    def terminate(self) -> None:
        """SIGTERM its group, then SIGCONT it (a frozen rank must run to handle its SIGTERM)."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL its group, members that outlived the leader included."""
        self.signal(signal.SIGKILL)

    def oom_killed(self) -> bool:
        """A SIGKILL while the kernel's OOM-kill counter moved since it started (the kernel says so only indirectly)."""
        if self.proc.returncode != -signal.SIGKILL or self.oom_baseline is None:
            return False
        now = oom_kill_count()
        return now is not None and now > self.oom_baseline

    def usage(self) -> ProcessSample | None:
        """Its state and CPU time from /proc."""
        return sample_process(self.proc.pid)

    def io_bytes(self) -> int | None:
        """Its system-call I/O from /proc."""
        return io_chars(self.proc.pid)

    def rank_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of an order to restart in place: a process sees it as given."""
        return dict(env)

    def record(self) -> dict[str, Any]:
        """Its pid and start time: enough to kill its group later, and never a stranger's."""
        return {"pid": self.proc.pid, "started": self.started}


class ProcessLauncher:
    """Starts each rank as a child process in a new session that dies with the agent; relaunches may take standbys."""

    def __init__(self, *, standbys: StandbyPool | None = None) -> None:
        self.standbys = standbys

    async def start(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | None, warm: bool) -> ProcessHandle:
        """Start the rank on a ready standby when allowed and one fits, else as a new interpreter."""
        full_env = {**os.environ, **env}
        proc = None
        if self.standbys is not None and warm:
            proc = await self.standbys.take(argv, full_env, cwd)
        if proc is not None:
            return ProcessHandle(proc, warm=True)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=full_env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGKILL),  # a lost agent means a lost node: its ranks go too
        )
        return ProcessHandle(proc)

    def kill_lost(self, record: Mapping[str, Any]) -> None:
        """SIGKILL the recorded group (its own process group; the pid may be reused by now)."""
        signal_group(int(record["pid"]), record.get("started"), signal.SIGKILL)
