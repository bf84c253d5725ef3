"""One containerized rank's handle: its signals through its init's pid on the host, its exit from the kernel (the
daemon's word where the kernel's is not to be had), its output from a file in its inbox directory the rank writes
(through the daemon's log where it cannot): launch/containers.py starts it; launch/container_restart.py re-attaches a
later agent to it. docs/containers.md, "Exit and output"."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container

from reprise_agent.launch import kernel_exits
from reprise_agent.launch.container_output import OffsetFile
from reprise_agent.launch.container_procs import SIGNAL_EXIT_BASE, descendants, exit_code, kill_init
from reprise_agent.launch.processes import io_chars
from reprise_common.logging import get_logger
from reprise_common.procs import ProcessSample, oom_kill_count, process_alive, sample_process, start_ticks

log = get_logger("reprise.agent.containers")
# How long a rank whose container ended while its daemon was away waits for the daemon's word of its exit status (a
# daemon restarted with live restore has it) before it is reported killed: its peers' failures are reported meanwhile.
EXIT_WORD_S = 5.0
TAIL_MIN_S, TAIL_MAX_S = 0.02, 0.25  # how often the output file is read: soon after output, less often while quiet
TAIL_CHUNK = 64 * 1024
# How long an ended container is kept before it is removed: a rank's exit starts a recovery, and the daemon's work of
# removing a container (its mounts, its file system, its network) is not done beside the new epoch's first step.
REMOVE_AFTER_S = 2.0


@dataclass
class ContainerHandle:
    """One rank's container: its output, exit and signals, through its init's pid and the daemon."""

    container: Container
    init_pid: int
    pid: int
    inbox: Path | None = None  # the host directory mounted as the rank's inbox directory (removed with it)
    inbox_link: Path | None = None  # <inbox dir>/<pid>.sock, pointing at the socket the SDK binds in the container
    warm: bool = False
    env_changes: dict[str, str] = field(default_factory=dict)  # what its environment says otherwise than the host's
    output_file: Path | None = None  # where the rank writes its stdout and stderr (None: the daemon's log has them)
    returncode: int | None = None
    oom: bool = False
    output: asyncio.StreamReader = field(init=False)
    _exited: asyncio.Event = field(init=False)
    _ended: threading.Event = field(init=False)

    def __post_init__(self) -> None:
        self.started = start_ticks(self.pid)
        self.init_started = start_ticks(self.init_pid)
        self.oom_baseline = oom_kill_count()
        self._report_lock = threading.Lock()

    def follow(self, loop: asyncio.AbstractEventLoop, *, since: float | None = None, offset: int = 0) -> None:
        """Start the threads that copy its output (from byte `offset` of its output file, or from `since`, a Unix
        time, in the daemon's log: an adopted container's output is not copied twice) and wait for its exit (the
        SDK's calls block); on the loop. Its init's exit is watched in the kernel's events where this host has them."""
        self.output = asyncio.StreamReader()
        self._exited = asyncio.Event()
        self._ended = threading.Event()  # its exit status is known: by the kernel's word or the daemon's
        if self.output_file is not None:
            copy: Callable[[], None] = functools.partial(self._tail, loop, self.output_file, offset)
        else:
            copy = functools.partial(self._pump, loop, since)
        pump = threading.Thread(target=copy, name=f"ctr-out-{self.pid}", daemon=True)
        pump.start()
        if (watch := kernel_exits.shared()) is not None:
            watch.watch(self.init_pid, lambda status: self._kernel_exit(loop, status))
            if not self._init_alive():  # it ended before the watch began (its pid may be another's next): the daemon
                watch.forget(self.init_pid)  # tells that exit
        threading.Thread(target=self._wait, args=(loop, pump), name=f"ctr-wait-{self.pid}", daemon=True).start()

    def _tail(self, loop: asyncio.AbstractEventLoop, path: Path, offset: int) -> None:
        """Copy its output file from `offset` until its exit is known (every process that could write it is gone by
        then: they end with the container's init), then what is left; the offset copied is kept beside the file for
        an agent that adopts the container."""
        pause = TAIL_MIN_S
        try:
            with path.open("rb", buffering=0) as source, OffsetFile(path) as copied:
                source.seek(offset)
                while True:
                    ended = self._ended.is_set()
                    data = source.read(TAIL_CHUNK)
                    if data:
                        _tell(loop, self.output.feed_data, data)
                        offset += len(data)
                        copied.write(offset)
                        pause = TAIL_MIN_S
                        continue
                    if ended:
                        return
                    self._ended.wait(pause)
                    pause = min(pause * 2, TAIL_MAX_S)
        except OSError as exc:
            log.warning("container output lost", extra={"container": self.container.short_id, "error": str(exc)})
        finally:
            _tell(loop, self.output.feed_eof)

    def _pump(self, loop: asyncio.AbstractEventLoop, since: float | None) -> None:
        """Copy its output until it exits. A daemon that goes away ends the stream: once it answers again with the
        container still running (live restore), the output is taken up after the last line copied."""
        last: str | None = None  # the daemon's timestamp of the last line copied (RFC 3339, nanoseconds, UTC)
        try:
            while True:
                try:
                    stream = self.container.logs(
                        stream=True, follow=True, stdout=True, stderr=True, timestamps=True, since=since
                    )
                    for chunk in stream:
                        stamp, data = _stamped(chunk)
                        if last is not None and stamp is not None and stamp <= last:
                            continue  # copied before the daemon went away
                        last = stamp or last
                        _tell(loop, self.output.feed_data, data)
                except (docker.errors.DockerException, OSError) as exc:
                    log.warning(
                        "container output lost", extra={"container": self.container.short_id, "error": str(exc)}
                    )
                if not self._still_running():
                    return
                since = _unix_time(last) if last is not None else since
        finally:
            _tell(loop, self.output.feed_eof)

    def _still_running(self) -> bool:
        """After its output stream ended: False once its exit is known; True when the daemon answers again with the
        container running (the stream ended because the daemon went away, and it is back: live restore)."""
        while not self._ended.wait(0.2):
            try:
                self.container.client.ping()
                state = self.container.client.api.inspect_container(self.container.id)["State"]
            except (docker.errors.DockerException, OSError):
                continue
            if state.get("Running"):
                return True
        return False

    def _kernel_exit(self, loop: asyncio.AbstractEventLoop, wait_status: int) -> None:
        """The kernel's word of its init's exit (on the watch's thread). A SIGKILL while the kernel's OOM killer acted
        somewhere since the rank started is left to the daemon, which knows whether it acted in this container."""
        status = kernel_exits.container_status(wait_status)
        if status == SIGNAL_EXIT_BASE + signal.SIGKILL and oom_kill_count() != self.oom_baseline:
            return
        self._report(loop, status)

    def _report(self, loop: asyncio.AbstractEventLoop, status: int) -> None:
        """Tell its exit status once: the first word of it, the kernel's or the daemon's (they agree)."""
        with self._report_lock:
            if self._ended.is_set():
                return
            self._ended.set()
        _tell(loop, self._exit, exit_code(status))

    def _wait(self, loop: asyncio.AbstractEventLoop, pump: threading.Thread) -> None:
        """The exit is told as soon as the daemon reports it, unless the kernel did first (and, for a failure, whether
        the container saw an OOM kill); the container and its inbox are removed REMOVE_AFTER_S later, so their removal
        neither delays a recovery nor competes with the new epoch's start."""
        status = self._status()
        self._report(loop, status)
        if (watch := kernel_exits.shared()) is not None:
            watch.forget(self.init_pid)
        pump.join(timeout=5.0)
        threading.Event().wait(REMOVE_AFTER_S)
        with contextlib.suppress(docker.errors.DockerException, OSError):
            self.container.remove(force=True)
        self._forget_inbox()

    def _status(self) -> int:
        """Its exit status, from the daemon. A daemon that goes away is waited on again once it answers (with live
        restore the container ran on meanwhile). A container whose init ends while the daemon is away has its status
        from the daemon if it answers within EXIT_WORD_S (a daemon back with live restore read it from the
        container's shim); else it ended, as far as anyone can tell, by SIGKILL."""
        last_try = False
        while True:
            try:
                status = int(self.container.wait()["StatusCode"])
                if status != 0:
                    self.container.reload()
                    self.oom = bool(self.container.attrs["State"].get("OOMKilled"))
                return status
            except (docker.errors.DockerException, OSError) as exc:
                log.warning("docker lost a container", extra={"container": self.container.short_id, "error": str(exc)})
            if last_try:
                return SIGNAL_EXIT_BASE + signal.SIGKILL
            if not self._daemon_back():  # the init ended while the daemon was away
                last_try = True
                if not self._daemon_answers(within_s=EXIT_WORD_S):
                    log.warning(
                        "a container ended while its daemon was away; reported as killed",
                        extra={"container": self.container.short_id, "waited_s": EXIT_WORD_S},
                    )
                    return SIGNAL_EXIT_BASE + signal.SIGKILL

    def _daemon_back(self) -> bool:
        """Until the daemon answers again (True) or the container's init ends (False)."""
        while self._init_alive():
            threading.Event().wait(0.2)
            if self._daemon_answers(within_s=0.0):
                return True
        return False

    def _daemon_answers(self, *, within_s: float) -> bool:
        """Whether the daemon answers a ping within `within_s` (asked every 0.2 s; once for 0)."""
        deadline = time.monotonic() + within_s
        while True:
            with contextlib.suppress(docker.errors.DockerException, OSError):
                self.container.client.ping()
                return True
            if time.monotonic() >= deadline:
                return False
            threading.Event().wait(0.2)

    def _init_alive(self) -> bool:
        """Its init still runs: the same process (by its start time), not a zombie nobody reaped (a shim gone too)."""
        return (
            self.init_started is not None
            and start_ticks(self.init_pid) == self.init_started
            and process_alive(self.init_pid)
        )

    def _exit(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def _forget_inbox(self) -> None:
        if self.inbox_link is not None:
            with contextlib.suppress(OSError):
                self.inbox_link.unlink()
        if self.inbox is not None:
            shutil.rmtree(self.inbox, ignore_errors=True)

    async def wait(self) -> int:
        """Wait for the container's exit; its code as a process's (negative: a signal)."""
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def signal(self, sig: int) -> None:
        """SIGKILL: the whole container. Another signal: every process of the rank (not its init, which would pass
        it on again), as a process group would get it; nothing once the container's init is gone."""
        if sig == signal.SIGKILL:
            self.kill()
            return
        if not self._init_alive():
            return
        for pid in list(descendants(self.init_pid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def terminate(self) -> None:
        """SIGTERM, then SIGCONT (a frozen rank must run to handle its SIGTERM)."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kill the container: its init dies, and with it every process in its pid namespace. SIGKILL to the init from
        the host (the one this handle started, by its start time), at once: asking the daemon held the agent's loop
        for its round trip (0.1 s under load, and an XID's report waited behind it). The daemon sees the same exit
        (137). Through the daemon when the host cannot tell the init (no start time read) or may not signal it."""
        if self._exited.is_set():
            return
        if self.init_started is not None:
            try:
                kill_init(self.init_pid, self.init_started)  # False: it ended already
                return
            except PermissionError:
                pass  # the container runs as a user the agent may not signal: the daemon may
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            self.container.kill()

    def oom_killed(self) -> bool:
        """The daemon's word: the container's memory cgroup hit its limit and the kernel killed in it."""
        return self.oom

    def usage(self) -> ProcessSample | None:
        """The rank process's state and CPU time from /proc."""
        return sample_process(self.pid) if start_ticks(self.pid) == self.started else None

    def io_bytes(self) -> int | None:
        """The rank process's system-call I/O from /proc."""
        return io_chars(self.pid) if start_ticks(self.pid) == self.started else None

    def rank_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of an order to restart in place, as the rank sees it in its container."""
        return {**env, **self.env_changes}

    def record(self) -> dict[str, Any]:
        """What a later agent needs to adopt the container (or remove it): its id, the rank's pid and start time, its
        init's, and its inbox."""
        return {
            "pid": self.pid, "started": self.started, "container_id": self.container.id, "init_pid": self.init_pid,
            "init_started": self.init_started, "inbox": _text(self.inbox), "inbox_link": _text(self.inbox_link),
            "env_changes": self.env_changes, "output_file": _text(self.output_file),
        }  # fmt: skip


def _tell(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
    """Call back on the loop; nothing once it closed (its agent is gone, or, in a test, its supervisor)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _stamped(chunk: bytes) -> tuple[str | None, bytes]:
    """A chunk of a timestamped log stream (one message each) as its timestamp and its text."""
    head, space, rest = chunk.partition(b" ")
    if not space or not head.endswith(b"Z") or b"T" not in head:
        return None, chunk
    return head.decode("ascii", errors="replace"), rest


def _unix_time(stamp: str) -> float:
    """The daemon's timestamp (``2026-12-06T23:40:00.123456789Z``) as a Unix time, a microsecond early (a float
    cannot hold nanoseconds): the lines from there on that were copied already are told by their timestamps."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp()
    return seconds + float(f"0.{fraction or 0}") - 1e-6


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)
