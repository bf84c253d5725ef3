"""Warm standbys in containers: for each containerized job, containers of its image started ahead of need, with the
job's mounts and limits, running the job's interpreter with the heavy modules imported (the standby boot of
launch/standby_boot.py) and waiting for a rank's assignment. A relaunch's rank then starts on one instead of a new
container that imports torch.

The assignment (argv, environment, directory, as for a process standby) is one JSON line written into a FIFO in the
standby's own inbox directory (mounted in the container, like a rank's inbox): the boot reads its stdin, which a
prelude points at that FIFO. The rank's environment is the image's with the rank's own on top. A job's standbys are
made from its latest launch (its launcher and one rank's environment as the template) and retired once none of its
ranks started here runs and none started for RETIRE_AFTER_S, or when a launch changes its container spec. A spare,
whose agent never ran the job, is told to `prepare` them (a PrepareStandbysCommand, once the job's launch trains):
held for the command's `hold_s` (renewed by each prepare), removed when told to drop them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import docker.errors
from docker.models.containers import Container

from reprise_agent.launch.container_cpu import CpuShare
from reprise_agent.launch.container_group import FILE, grant
from reprise_agent.launch.container_handle import ContainerHandle
from reprise_agent.launch.container_output import OUTPUT_ENV, POINT_OUTPUT, output_file, size
from reprise_agent.launch.standby import BOOT_SOURCE, READY, READY_TIMEOUT_S, RETRY_AFTER_S, unfit_arguments
from reprise_common.errors import RepriseError
from reprise_common.events import ContainerSpec, LaunchArgs, StandbyStatus
from reprise_common.logging import get_logger
from reprise_common.procs import process_alive, sample_process


class _Engine(Protocol):
    @property
    def gpus(self) -> bool: ...  # GPUs are device requests fixed when a container is made: no standby takes one

    @property
    def gid(self) -> int: ...  # the containers' group (launch/container_group.py)


class ContainerLauncher(Protocol):
    """What the pool needs of a job's container launcher (launch/containers.py's, which makes its standbys too)."""

    @property
    def engine(self) -> _Engine: ...

    @property
    def job(self) -> LaunchArgs: ...

    @property
    def spec(self) -> ContainerSpec: ...

    def link_inbox(self, pid: int, inbox: Path | None) -> Path | None: ...

    def new_inbox(self, env: Mapping[str, str]) -> Path | None: ...

    def env_changes(self, env: Mapping[str, str]) -> dict[str, str]: ...

    def run(
        self, argv: list[str], env: dict[str, str], changes: dict[str, str], cwd: str | None, inbox: Path | None
    ) -> tuple[Container, int, int]: ...


log = get_logger("reprise.agent.containers")

FIFO = "standby.fifo"  # in the standby's inbox directory: where its assignment arrives
FIFO_ENV = "REPRISE_STANDBY_FIFO"
# The boot reads its assignment from stdin: point it at the FIFO (read-write, so opening it does not wait for a writer).
# Its output (the ready line, then the rank's) goes into the output file where it has one.
PRELUDE = f"""import os as _o
_f = _o.open(_o.environ['{FIFO_ENV}'], _o.O_RDWR)
_o.dup2(_f, 0)
_o.close(_f)
{POINT_OUTPUT}"""
RETIRE_AFTER_S = 60.0  # a job none of whose ranks runs here, and none started for this long, needs no standby
CHECK_S = 5.0  # how often a full pool looks whether its job is over
READY_POLL_S = 0.05  # how often a standby's output file is read for its ready line
PREPARED_JOBS_MAX = 8  # jobs a node keeps standbys of before any of their ranks started here (a spare's)


@dataclass
class ContainerStandby:
    """One waiting container: its init, the interpreter's pid, its inbox, the environment it had before a rank's."""

    container: Container
    init_pid: int
    pid: int
    inbox: Path
    base_env: dict[str, str]
    share: CpuShare | None = None  # its container's CPU weight, lowered while it waits
    output: Path | None = None  # its output file (None: it cannot say it is ready)
    ready: bool = False


@dataclass
class JobStandbys:
    """One job's standbys and what they are made from."""

    launcher: ContainerLauncher
    python: str
    template: dict[str, str]
    standbys: list[ContainerStandby] = field(default_factory=list)
    handles: list[ContainerHandle] = field(default_factory=list)  # its ranks started here, on a standby or not
    last_start: float = field(default_factory=time.monotonic)
    hold_until: float = 0.0  # a prepared pool (a spare's): kept until then with no rank of the job here
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def over(self) -> bool:
        """None of its ranks runs here, and none started lately: the job ended (or moved)."""
        self.handles = [h for h in self.handles if h.returncode is None]
        idle_since = max(self.last_start + RETIRE_AFTER_S, self.hold_until)
        return not self.handles and time.monotonic() > idle_since


class ContainerStandbys:
    """Every containerized job's standbys on this node: `size` per job (none when 0), and never more than the job's
    ranks here (a launch's ranks on this node; a spare's: the most a node of the job runs), which is the most a fault
    can replace here at once. (One more, for a second fault before the first one's replacement is back, made the
    bench's standbys come later on its 2 cores, and fewer of its faults fit: docs/containers.md.)"""

    def __init__(self, *, size: int, preload: Sequence[str], refill_delay_s: float = 0.0) -> None:
        self.size = size
        self.preload = list(preload)
        self.refill_delay_s = refill_delay_s
        self.taken = 0
        self._jobs: dict[str, JobStandbys] = {}

    def keep(
        self, launcher: ContainerLauncher, argv: Sequence[str], env: Mapping[str, str], handle: ContainerHandle
    ) -> None:
        """After a rank of the job started: keep the job's standbys, made like this launch's ranks, ready."""
        job_id = env.get("REPRISE_JOB_ID", "")
        if self.size == 0 or not job_id or not env.get("REPRISE_SDK_INBOX_DIR") or launcher.engine.gpus:
            return  # a standby's GPU is fixed when it is created: not with real GPUs (yet)
        pool = self._jobs.get(job_id)
        if pool is not None and _made_by(pool) != _made_by(launcher):
            self._retire(job_id)
            pool = None
        if pool is None:
            pool = self._jobs[job_id] = JobStandbys(launcher, argv[0], dict(env))
            pool.task = asyncio.create_task(self._keep_full(job_id, pool), name=f"container-standbys:{job_id}")
        pool.launcher, pool.last_start = launcher, time.monotonic()
        pool.handles.append(handle)
        pool.wake.set()

    async def take(
        self, launcher: ContainerLauncher, argv: Sequence[str], env: Mapping[str, str], changes: dict[str, str],
        cwd: str | None,
    ) -> ContainerHandle | None:  # fmt: skip
        """A ready standby of the job now running the rank (None: none ready, or the command cannot run on one)."""
        pool = self._jobs.get(env.get("REPRISE_JOB_ID", ""))
        if pool is None or _made_by(pool) != _made_by(launcher):
            return None
        why = "not the job's interpreter" if not argv or argv[0] != pool.python else ""
        if why := why or unfit_arguments(argv, env, standby_env=pool.template):
            log.info("rank's container starts cold", extra={"reason": why})
            return None
        standby = next((s for s in pool.standbys if s.ready), None)
        if standby is None:
            return None
        pool.standbys.remove(standby)
        pool.wake.set()
        if standby.share is not None:
            standby.share.restore()  # the rank's container weighs as much as any other rank's
        _set_policy(standby.pid, os.SCHED_OTHER)  # the rank's own priority, all its threads
        since = time.time()  # its output from now on is the rank's (not its ready line)
        offset = size(standby.output)
        order = {"argv": list(argv), "env": {**standby.base_env, **env, **changes}, "cwd": cwd}
        if not _assign(standby.inbox / FIFO, order):
            await asyncio.to_thread(_remove, standby)
            return None
        handle = ContainerHandle(
            standby.container, init_pid=standby.init_pid, pid=standby.pid, inbox=standby.inbox, warm=True,
            env_changes=changes, output_file=standby.output,
        )  # fmt: skip
        handle.inbox_link = launcher.link_inbox(standby.pid, standby.inbox)
        handle.follow(asyncio.get_running_loop(), since=since, offset=offset)
        self.taken += 1
        return handle

    def prepare(
        self, launcher: ContainerLauncher, argv: Sequence[str], env: Mapping[str, str], *, hold_s: float
    ) -> int:
        """Keep the job's standbys ready before any rank of it starts here (a spare), for `hold_s` from now; how many
        this node keeps for it (0: none, e.g. with real GPUs, or too many jobs prepared already)."""
        job_id = env.get("REPRISE_JOB_ID", "")
        if self.size == 0 or not job_id or not env.get("REPRISE_SDK_INBOX_DIR") or launcher.engine.gpus:
            return 0
        pool = self._jobs.get(job_id)
        if pool is not None and _made_by(pool) != _made_by(launcher):
            self._retire(job_id)
            pool = None
        if pool is None:
            prepared = sum(1 for p in self._jobs.values() if p.hold_until > 0 and not p.handles)
            if prepared >= PREPARED_JOBS_MAX:
                log.warning("too many jobs' standbys prepared here: none for this one", extra={"job_id": job_id})
                return 0
            pool = self._jobs[job_id] = JobStandbys(launcher, argv[0], dict(env))
            pool.task = asyncio.create_task(self._keep_full(job_id, pool), name=f"container-standbys:{job_id}")
        pool.hold_until = max(pool.hold_until, time.monotonic() + hold_s)
        pool.launcher = launcher
        pool.wake.set()
        return self._target(pool)

    def drop(self, job_id: str) -> None:
        """Remove the job's standbys now (told so: it ended, or will not move here); a pool a rank of it started on
        here stays (the ranks' own idle rule retires it)."""
        pool = self._jobs.get(job_id)
        if pool is not None and not pool.handles:
            self._retire(job_id)

    def _target(self, pool: JobStandbys) -> int:
        """How many standbys the job keeps here."""
        return min(self.size, len(pool.launcher.job.ranks))

    def statuses(self) -> list[StandbyStatus]:
        """Every standby container waiting now, ready or still importing, as the node report shows process ones."""
        found = []
        for pool in self._jobs.values():
            for standby in pool.standbys:
                sample = sample_process(standby.pid)
                rss = sample.rss_bytes if sample is not None else None
                found.append(StandbyStatus(pid=standby.pid, ready=standby.ready, rss_bytes=rss))
        return found

    def ready(self, job_id: str) -> int:
        """How many of the job's standbys are ready now."""
        pool = self._jobs.get(job_id)
        return sum(s.ready for s in pool.standbys) if pool else 0

    async def _keep_full(self, job_id: str, pool: JobStandbys) -> None:
        while self._jobs.get(job_id) is pool:
            if pool.over():
                self._retire(job_id)
                return
            if len(pool.standbys) >= self._target(pool):
                pool.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pool.wake.wait(), CHECK_S)
                continue
            if pool.handles:  # the ranks that just started here import first (a spare's prepared pool has none)
                await asyncio.sleep(self.refill_delay_s)
            if self._jobs.get(job_id) is pool and not await self._spawn(pool):
                await asyncio.sleep(RETRY_AFTER_S)

    async def _spawn(self, pool: JobStandbys) -> bool:
        """Start one standby of the job and wait until it is ready; False when it failed."""
        launcher, inner = pool.launcher, pool.template["REPRISE_SDK_INBOX_DIR"]
        inbox = launcher.new_inbox(pool.template)
        if inbox is None:
            return False
        os.mkfifo(inbox / FIFO, 0o600)
        grant(inbox / FIFO, launcher.engine.gid, FILE)
        env = {**pool.template, "RANK": "standby", FIFO_ENV: f"{inner}/{FIFO}"}
        output = output_file(launcher.engine.gid, inbox, pool.template)
        if output is not None:
            env[OUTPUT_ENV] = output[1]
        changes = launcher.env_changes(pool.template)  # the SDK socket's directory mounted, as for its rank
        argv = [pool.python, "-c", PRELUDE + BOOT_SOURCE, *self.preload]
        run = asyncio.ensure_future(asyncio.to_thread(launcher.run, argv, env, changes, None, inbox))
        try:
            container, init_pid, pid = await asyncio.shield(run)
        except asyncio.CancelledError:  # retired meanwhile (dropped, or the agent stops): removed once it exists
            run.add_done_callback(lambda done: _remove_started(done, inbox))
            raise
        except RepriseError as exc:
            shutil.rmtree(inbox, ignore_errors=True)
            log.warning("a container standby could not start", extra={"error": str(exc)})
            return False
        # From the host: its imports wait for the node's ranks (it has no CAP_SYS_NICE), within its container and,
        # through its container's weight, beside the ranks' containers (launch/container_cpu.py).
        _set_policy(pid, os.SCHED_IDLE)
        share = CpuShare.lower(init_pid)
        own = {k: v for k, v in _environ(pid).items() if k not in env and k not in changes}  # the image's, the daemon's
        standby = ContainerStandby(container, init_pid, pid, inbox, own, share, output[0] if output else None)
        pool.standbys.append(standby)
        ready = await asyncio.to_thread(_await_ready, standby)
        if not ready or pool not in self._jobs.values():  # it failed, or its job's standbys were retired meanwhile
            with contextlib.suppress(ValueError):
                pool.standbys.remove(standby)
            await asyncio.to_thread(_remove, standby)
            return False
        standby.ready = True
        return True

    def _retire(self, job_id: str, *, wait: bool = False) -> None:
        """Remove the job's standbys: in a thread, unless `wait` (the agent stops)."""
        pool = self._jobs.pop(job_id, None)
        if pool is None:
            return
        if pool.task is not None and pool.task is not asyncio.current_task():
            pool.task.cancel()
        waiting, pool.standbys = pool.standbys, []
        if wait:
            for standby in waiting:
                _remove(standby)
        else:
            asyncio.get_running_loop().run_in_executor(None, _remove_all, waiting)

    def close(self) -> None:
        """Remove every waiting standby (the agent stops); one being created now is left to the next agent's sweep."""
        for job_id in list(self._jobs):
            self._retire(job_id, wait=True)


def _made_by(source: JobStandbys | ContainerLauncher) -> tuple[object, object]:
    """What a job's standbys are made from: its container spec and checkpoint directory (its mounts)."""
    launcher = source.launcher if isinstance(source, JobStandbys) else source
    return launcher.spec, launcher.job.checkpoints


def _set_policy(pid: int, policy: int) -> None:
    """Put every thread of a process to a scheduling policy (the agent may; the container may not leave SCHED_IDLE)."""
    with contextlib.suppress(OSError):
        for thread in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(thread), policy, os.sched_param(0))


def _environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (a container's: the image's, the daemon's defaults, what it was given)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {name: value for name, value in pairs}


def _assign(fifo: Path, order: Mapping[str, object]) -> bool:
    """Write the assignment into the standby's FIFO (it has it open for reading); False when it cannot."""
    data = (json.dumps(order) + "\n").encode()
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return os.write(fd, data) == len(data)  # at most a pipe's capacity (64 KiB), or it starts cold
    except OSError:
        return False
    finally:
        os.close(fd)


def _await_ready(standby: ContainerStandby) -> bool:
    """Wait for the standby's ready line, the first line of its output file (a read on this host every
    READY_POLL_S; through the daemon's log each look was two calls to it, which a node's standbys importing side by side
    kept busy); False when it exited, never said it, or has no output file."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while standby.output is not None and time.monotonic() < deadline:
        try:
            output = standby.output.read_bytes()
            if b"\n" in output:
                said = json.loads(output.split(b"\n", 1)[0])
                return isinstance(said, dict) and said.get("ready") == READY
            if not process_alive(standby.init_pid):
                return False
        except (OSError, ValueError):
            return False
        time.sleep(READY_POLL_S)
    return False


def _remove_started(done: asyncio.Future[tuple[Container, int, int]], inbox: Path) -> None:
    """Remove a standby whose creation finished after its job's standbys were retired."""
    if done.cancelled() or done.exception() is not None:
        shutil.rmtree(inbox, ignore_errors=True)
        return
    standby = ContainerStandby(done.result()[0], 0, 0, inbox, {})
    asyncio.get_running_loop().run_in_executor(None, _remove, standby)


def _remove_all(standbys: list[ContainerStandby]) -> None:
    for standby in standbys:
        _remove(standby)


def _remove(standby: ContainerStandby) -> None:
    with contextlib.suppress(docker.errors.DockerException, OSError):
        standby.container.remove(force=True)
    shutil.rmtree(standby.inbox, ignore_errors=True)
