"""The local stack's one supervisor: a server or service that crashes is started again, with backoff.

A crash is an exit nobody asked for: stop() was not called on the process and the stack did not hold it down. The
restart runs the same start() again, so a server comes back with its ports, config, credentials and data dir and its
clients reconnect by themselves. Restarts back off exponentially; too many crashes in a window is a crash loop, and
the supervisor gives up on that process with one line saying so rather than spinning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from reprise_common.clock import utcnow
from reprise_common.errors import ConfigError
from reprise_common.procs import describe_exit


class Supervisable(Protocol):
    """A server (NatsServer, RedisServer) or a service process (ManagedProcess) that can be started again."""

    log_path: Path

    def start(self) -> None:
        """Start it (again), the same way as the first time."""

    def crashed(self) -> int | None:
        """Its return code once it ended without being asked to stop, else None."""

    def alive(self) -> bool:
        """True while it runs."""


class Verdict(StrEnum):
    """What the supervisor does about a crash."""

    RESTART = "restart"
    CRASH_LOOP = "crash loop"  # too many crashes in the window: given up


class WatchState(StrEnum):
    """Where a supervised process stands."""

    RUNNING = "running"
    BACKOFF = "backoff"  # crashed, waiting for its restart
    HELD = "held"  # the stack wants it down (a simulated node loss): never restarted
    GAVE_UP = "gave up"  # crash loop


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff 0.5 s doubling to 30 s, back to 0.5 s after 60 s up; the 5th crash within 120 s is a crash loop."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0  # up this long before a crash: its restart counts from the first delay again
    crash_limit: int = 5
    window_s: float = 120.0

    def delay_s(self, attempt: int) -> float:
        """How long to wait before restart `attempt` (1, 2, ...) of a run of crashes."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (attempt - 1))

    def verdict(self, crashes_in_window: int) -> Verdict:
        """Restart, or give up once the crashes within window_s reach crash_limit."""
        return Verdict.CRASH_LOOP if crashes_in_window >= self.crash_limit else Verdict.RESTART


@dataclass
class _Watch:
    name: str
    unit: Supervisable
    started_at: float
    state: WatchState = WatchState.RUNNING
    attempt: int = 0  # restarts in the current run of crashes
    restart_at: float = 0.0
    crashes: list[float] = field(default_factory=list)  # monotonic times of the crashes within the window
    exit_told: bool = False  # a held process's exit was logged


def exit_reason(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL'."""
    code, signal_name = describe_exit(returncode)
    return f"signal {signal_name}" if signal_name else f"exit code {code}"


@dataclass
class Supervisor:
    """Watches every process of the stack from one thread and restarts the ones that crash (see RestartPolicy).

    Processes restarted here are forked by the supervisor's thread, and PR_SET_PDEATHSIG follows the forking thread:
    the thread therefore lives until stop(), which the stack calls just before it stops everything.
    """

    say: Callable[[str], None] = print
    log_path: Path | None = None  # every line also goes here, stamped
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    poll_s: float = 0.1
    clock: Callable[[], float] = time.monotonic
    _watches: dict[str, _Watch] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def watch(self, name: str, unit: Supervisable) -> None:
        """Supervise a process that runs now."""
        with self._lock:
            self._watches[name] = _Watch(name, unit, started_at=self.clock())

    def hold(self, name: str) -> None:
        """Never restart `name` again: the stack stops it, or lets it die, on purpose (a simulated node loss)."""
        with self._lock:
            self._watches[name].state = WatchState.HELD

    def release(self, name: str) -> None:
        """Supervise a held process again (the node was repaired): started at once by the supervisor's thread if it
        is down, watched as before if it still runs."""
        with self._lock:
            watch = self._watches[name]
            if watch.state is not WatchState.HELD:
                return
            watch.exit_told, watch.attempt, watch.crashes = False, 0, []
            if watch.unit.alive():
                watch.state = WatchState.RUNNING
            else:
                watch.state, watch.restart_at = WatchState.BACKOFF, self.clock()

    def state(self, name: str) -> WatchState:
        """Where a supervised process stands."""
        with self._lock:
            return self._watches[name].state

    def start(self) -> None:
        """Start watching, in a thread of its own."""
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="reprise-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (a restart under way finishes first); nothing is restarted after this returns."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            with self._lock:
                watches = list(self._watches.values())
            for watch in watches:
                if self._stopping.is_set():
                    return
                self._check(watch)

    def _check(self, watch: _Watch) -> None:
        with self._lock:
            state = watch.state
            returncode = watch.unit.crashed() if state in (WatchState.RUNNING, WatchState.HELD) else None
            if state is WatchState.HELD and returncode is not None and not watch.exit_told:
                watch.exit_told = True
                self._log(f"{watch.name} exited ({exit_reason(returncode)}), held down on purpose: not restarted")
                return
            if state is WatchState.RUNNING and returncode is not None:
                self._crashed(watch, exit_reason(returncode))
                return
            if state is not WatchState.BACKOFF or self.clock() < watch.restart_at:
                return
        self._restart(watch)

    def _crashed(self, watch: _Watch, reason: str) -> None:
        """Count a crash (or a failed restart) and schedule the next restart, or give up; under the lock."""
        now = self.clock()
        up_s = now - watch.started_at
        if up_s >= self.policy.stable_after_s:
            watch.attempt = 0
        watch.crashes = [t for t in watch.crashes if now - t < self.policy.window_s] + [now]
        if self.policy.verdict(len(watch.crashes)) is Verdict.CRASH_LOOP:
            watch.state = WatchState.GAVE_UP
            self._log(
                f"{watch.name} crashed ({reason}) {len(watch.crashes)} times within {self.policy.window_s:g} s: "
                f"crash loop, giving up on it (its log: {watch.unit.log_path})"
            )
            return
        watch.attempt += 1
        delay = self.policy.delay_s(watch.attempt)
        watch.state, watch.restart_at = WatchState.BACKOFF, now + delay
        self._log(f"{watch.name} crashed ({reason}) after {up_s:.1f} s up: restart {watch.attempt} in {delay:g} s")

    def _restart(self, watch: _Watch) -> None:
        """Start the process again, outside the lock (a server's start waits until it is ready)."""
        with self._lock:
            if watch.state is not WatchState.BACKOFF:  # held meanwhile
                return
        try:
            watch.unit.start()
        except (ConfigError, OSError) as exc:
            with self._lock:
                watch.started_at = self.clock()
                self._crashed(watch, f"restart {watch.attempt} failed: {exc}")
            return
        with self._lock:
            watch.started_at = self.clock()
            if watch.state is WatchState.BACKOFF:  # not held meanwhile
                watch.state = WatchState.RUNNING
            self._log(f"{watch.name} restarted (restart {watch.attempt})")

    def _log(self, text: str) -> None:
        line = f"supervisor: {text}"
        self.say(line)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as log:
                log.write(f"{utcnow().isoformat()} {line}\n")
