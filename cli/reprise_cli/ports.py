"""Ports for the servers and services the tests and the local stack start: choosing a free one, and getting past
another process taking it before ours binds it.

free_port() picks a port that is free now, at random below both the kernel's ephemeral range (the source ports of
outgoing connections) and the rendezvous ports the orchestrator draws from (29500 and up): no connection this host
opens can take it, however long before its process binds it (a Slurm allocation's agents bind theirs tens of seconds
after the stack chose them; a restarted server binds its port again). Another process's explicit bind can still
take it (a parallel run's server): launchers therefore start through with_port_retries, which tries again on other
ports when a try ends in PortTaken, and tell a process that lost its port (ManagedProcess.listening) from one that
failed for another reason.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from reprise_common.errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


CHOSEN_PORTS = range(10_000, 29_500)  # above the well-known defaults (8800, 4222, ...), below the rendezvous ports
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports() -> range:
    """The kernel's range of source ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = (int(word) for word in _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1", *, run: int = 1) -> int:
    """The first of `run` consecutive ports that are all free right now, outside the kernel's ephemeral range (see
    the module's docstring); the kernel's choice when 200 draws found none. Another process may still bind it
    before ours does: see with_port_retries."""
    ephemeral = ephemeral_ports()
    for _ in range(200):
        first = secrets.choice(range(CHOSEN_PORTS.start, CHOSEN_PORTS.stop - run + 1))
        clear = first + run <= ephemeral.start or first >= ephemeral.stop
        if clear and all(port_is_free(port, host) for port in range(first, first + run)):
            return first
    while True:  # the kernel's choice (in its ephemeral range)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            first = int(sock.getsockname()[1])
        if all(port_is_free(port, host) for port in range(first + 1, first + run)):
            return first


def free_stack_ports(defaults: dict[str, int], *, agents: int = 8) -> dict[str, int]:
    """A free port for every key of `defaults`, and for "agent" a base with `agents` free ports after it.

    The agents' run is chosen first and no other port may fall inside it (tests and benchmarks start whole stacks
    on free ports; a port chosen after them could land in the middle of their run otherwise).
    """
    base = free_port(run=agents)
    taken = set(range(base, base + agents))
    ports = {"agent": base}
    for key in defaults:
        if key == "agent":
            continue
        port = free_port()
        while port in taken:
            port = free_port()
        taken.add(port)
        ports[key] = port
    return ports


class PortTaken(ConfigError):
    """A port a process was to listen on is another process's: taken between free_port() choosing it and the bind,
    or before the launcher started (a port the user asked for)."""

    def __init__(self, message: str, *, port: int) -> None:
        super().__init__(message)
        self.port = port


def require_free_port(port: int, what: str) -> None:
    """Raise PortTaken when something listens on the port already."""
    if not port_is_free(port):
        raise PortTaken(f"port {port} for {what} is already in use", port=port)


PORT_ATTEMPTS = 3  # tries of a launch whose chosen port was taken before its process bound it


def with_port_retries(
    launch: Callable[[], T],
    *,
    before_retry: Callable[[PortTaken], None] | None = None,
    attempts: int = PORT_ATTEMPTS,
) -> T:
    """Run launch() again while it fails with PortTaken, at most `attempts` times in all: the one way the tests and
    launchers get past another process taking a port free_port() chose before their process bound it.

    launch() chooses its ports with free_port() and starts on them, so what it returns runs on the ports of the last
    try; before_retry(error), when given, runs between tries instead (to stop what the failed try left running and
    choose the ports again) for a launch that must not choose them itself.
    """
    for attempt in range(1, attempts):
        try:
            return launch()
        except PortTaken as taken:
            log.warning("%s: starting again on another port (try %d of %d)", taken, attempt + 1, attempts)
            if before_retry is not None:
                before_retry(taken)
    return launch()


_ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)  # Go, Redis, uvicorn, Slurm


def _listeners(port: int) -> set[str]:
    """The sockets listening on `port` on any address, named as /proc/<pid>/fd names them ("socket:[inode]")."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(f"socket:[{fields[9]}]")
    return found


def listens(pid: int, port: int) -> bool:
    """True when process `pid` itself holds a socket listening on `port` (not another process answering there)."""
    sockets = _listeners(port)
    if not sockets:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in sockets:
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def taken_port(ports: Sequence[int], output: str) -> int | None:
    """Which of `ports` was taken from a process that ended with this output: one another process listens on, or
    one its "address already in use" line names (else the first, when it says so without naming one); None when
    it ended for another reason."""
    said = [line for line in output.splitlines() if _ADDRESS_IN_USE.search(line)]
    taken = [port for port in ports if _listeners(port) or any(str(port) in line for line in said)]
    if taken:
        return taken[0]
    return ports[0] if said and ports else None
