"""Warm standbys: interpreters started ahead of need that have imported the heavy modules and wait for a rank to run.

A cold rank start spends seconds before its first line of training: the interpreter, ``import torch``, then the
script. A standby has done the first two already; the agent hands it the rank's command line, environment and
directory (reprise_agent/launch/standby_boot.py runs them as ``python <script>`` would) and starts a new standby in the
background. A command is run on a standby only when it is that interpreter running a script or ``-m module`` with no
interpreter options, and the environment agrees with the standby's on what an interpreter reads before the script
runs (``PYTHON*`` variables, thread counts read at ``import torch``, the dynamic loader's); otherwise it starts cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources

from reprise_common.events import StandbyStatus
from reprise_common.logging import get_logger
from reprise_common.procs import die_with_parent, sample_process, signal_group, start_ticks

log = get_logger("reprise.agent.standby")

BOOT_SOURCE = resources.files("reprise_agent.launch").joinpath("standby_boot.py").read_text(encoding="utf-8")
READY = "reprise-standby ready"
READY_TIMEOUT_S = 300.0  # importing torch on a loaded host can take a minute; longer means something is wrong
RETRY_AFTER_S = 5.0  # after a standby died before it was ready: no tight loop of failing starts
IMPORT_TIME_VARS = frozenset(
    {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH", "MALLOC_CONF"}
)


def unfit_arguments(command: Sequence[str], env: Mapping[str, str], *, standby_env: Mapping[str, str]) -> str:
    """Why a command of the standbys' interpreter cannot run on one ("" when it can): interpreter options, or an
    environment that differs from the standby's in what the interpreter read before its assignment."""
    args = list(command[1:])
    if not args or args == ["-m"] or (args[0].startswith("-") and args[0] != "-m"):
        return "not a script or -m module (interpreter options start it cold)"
    differs = sorted(
        name
        for name in {*standby_env, *env}
        if (name.startswith("PYTHON") or name in IMPORT_TIME_VARS) and standby_env.get(name) != env.get(name)
    )
    return f"read before the script runs, and not as the standbys have it: {differs}" if differs else ""


@dataclass
class Standby:
    """One pre-started interpreter: its process, and whether it said it is ready."""

    proc: asyncio.subprocess.Process
    started: int | None
    env: dict[str, str]
    ready: bool = False
    failed_imports: list[str] = field(default_factory=list)

    def status(self) -> StandbyStatus:
        """How the node report shows it, with its memory now."""
        sample = sample_process(self.proc.pid)
        return StandbyStatus(
            pid=self.proc.pid,
            ready=self.ready,
            rss_bytes=sample.rss_bytes if sample is not None else None,
            failed_imports=self.failed_imports[:8],
        )


class StandbyPool:
    """Keeps `size` standbys of one interpreter ready; `take` hands one to a rank, or None to start it cold."""

    def __init__(
        self,
        *,
        python: str,
        size: int,
        preload: Sequence[str],
        env: Mapping[str, str] | None = None,
        refill_delay_s: float = 0.0,
    ) -> None:
        self.python = python
        self.size = size
        self.refill_delay_s = refill_delay_s
        self.preload = list(preload)
        self.env = dict(os.environ if env is None else env)
        self.taken = 0  # ranks started on a standby
        self._standbys: list[Standby] = []
        self._fill_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closed = False

    def start(self) -> None:
        """Begin keeping the pool full (in the background)."""
        if self.size > 0 and self._fill_task is None:
            self._fill_task = asyncio.create_task(self._keep_full(), name="standbys")

    def statuses(self) -> list[StandbyStatus]:
        """Every standby waiting now, ready or still importing."""
        return [s.status() for s in self._standbys if s.proc.returncode is None]

    def unfit(self, command: Sequence[str], env: Mapping[str, str]) -> str:
        """Why a command cannot run on one of this pool's standbys ("" when it can)."""
        found = shutil.which(command[0]) if command else None
        if found is None or os.path.realpath(found) != os.path.realpath(self.python):
            return f"not the standbys' interpreter ({self.python})"
        return unfit_arguments(command, env, standby_env=self.env)

    async def take(
        self, command: Sequence[str], env: Mapping[str, str], cwd: str | None
    ) -> asyncio.subprocess.Process | None:
        """A ready standby now running the command (None: none ready, or the command cannot run on one)."""
        if self.size == 0 or self._closed:
            return None
        why = self.unfit(command, env)
        if why:
            log.info("rank starts cold", extra={"reason": why})
            return None
        standby = next((s for s in self._standbys if s.ready and s.proc.returncode is None), None)
        if standby is None:
            return None
        self._standbys.remove(standby)
        self._wake.set()
        assert standby.proc.stdin is not None
        line = json.dumps({"argv": list(command), "env": dict(env), "cwd": cwd}) + "\n"
        try:
            standby.proc.stdin.write(line.encode())
            await standby.proc.stdin.drain()
            standby.proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it died just now: the rank starts cold instead
            return None
        self.taken += 1
        return standby.proc

    async def close(self) -> None:
        """Stop keeping the pool full and end every waiting standby."""
        self._closed = True
        if self._fill_task is not None:
            self._fill_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fill_task
        for standby in self._standbys:
            signal_group(standby.proc.pid, standby.started, signal.SIGKILL)
        for standby in self._standbys:
            with contextlib.suppress(ProcessLookupError):
                await standby.proc.wait()
        self._standbys.clear()

    async def _keep_full(self) -> None:
        first = True
        while not self._closed:
            self._standbys = [s for s in self._standbys if s.proc.returncode is None]
            if len(self._standbys) < self.size:
                if not first:  # the ranks that just took standbys start now: importing beside them slows them
                    await asyncio.sleep(self.refill_delay_s)
                if not await self._spawn():
                    await asyncio.sleep(RETRY_AFTER_S)
                continue
            first = False
            self._wake.clear()
            await self._wake.wait()

    async def _spawn(self) -> bool:
        """Start one standby and wait until it is ready; False when it died or never said so."""
        proc = await asyncio.create_subprocess_exec(
            self.python, "-c", BOOT_SOURCE, *self.preload,
            env=self.env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGKILL),  # like a rank: it goes when its agent goes
        )  # fmt: skip
        standby = Standby(proc, start_ticks(proc.pid), self.env)
        self._standbys.append(standby)
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
            said = json.loads(line)
            if said.get("ready") != READY:
                raise ValueError(line)
        except (TimeoutError, ValueError) as exc:
            log.warning("a standby did not become ready", extra={"error": repr(exc)[:300]})
            signal_group(proc.pid, standby.started, signal.SIGKILL)
            await proc.wait()
            return False
        standby.ready, standby.failed_imports = True, list(said.get("failed", []))
        if standby.failed_imports:
            log.warning("a standby could not import everything", extra={"failed": standby.failed_imports})
        return True
