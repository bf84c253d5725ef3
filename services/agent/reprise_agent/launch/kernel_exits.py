"""The kernel's own word of a process's exit: the proc connector, a netlink multicast to which the kernel sends an event
for every task that exits, with its wait status (docs/containers.md, "Exit and output").

A containerized rank's exit is otherwise known only once the Docker daemon reports it (30-90 ms after the exit, more
under load, and never while the daemon is away); its container's init, a process on this host, is watched here
instead. Subscribing needs CAP_NET_ADMIN in the host's first user and pid namespaces: an agent without it (a non-root
agent, an agent in a container) gets None from `shared()`, and its ranks' exits come from the daemon as before. Events
the socket had no room for are lost: the daemon's word, which every rank still waits for, then tells the exit.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import socket
import struct
import threading
from collections.abc import Callable

from reprise_common.logging import get_logger

log = get_logger("reprise.agent.containers")

NETLINK_CONNECTOR = 11
CN_IDX_PROC = CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
NLMSG_DONE = 3
PROC_EVENT_EXIT = 0x80000000
SO_RCVBUFFORCE = 33
RECEIVE_BUFFER = 4 << 20  # bytes: a burst of exits (a node's ranks ending together) does not overflow it
READ_TIMEOUT_S = 1.0  # how often the reading thread looks whether it was closed

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, sequence, ack, length, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp (ns)
_EXIT = struct.Struct("=IIII")  # pid, tgid, exit code (a wait status), exit signal

ExitCallback = Callable[[int], None]


def container_status(wait_status: int) -> int:
    """A process's wait status as a container's exit status: the exit code, or 128 + the signal that ended it."""
    if wait_status & 0x7F:
        return 128 + (wait_status & 0x7F)
    return (wait_status >> 8) & 0xFF


def _request(operation: int) -> bytes:
    body = struct.pack("=I", operation)
    message = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(body), 0) + body
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(message), NLMSG_DONE, 0, 0, 0) + message


def parse_exits(datagram: bytes) -> list[tuple[int, int, int]]:
    """The exits a connector datagram tells: (pid, thread group id, wait status) each."""
    found, offset = [], 0
    while offset + _NLMSGHDR.size <= len(datagram):
        length = _NLMSGHDR.unpack_from(datagram, offset)[0]
        if length < _NLMSGHDR.size:
            break
        event = offset + _NLMSGHDR.size + _CN_MSG.size
        if event + _EVENT.size + _EXIT.size <= offset + length:
            what = _EVENT.unpack_from(datagram, event)[0]
            if what == PROC_EVENT_EXIT:
                pid, tgid, status, _signal = _EXIT.unpack_from(datagram, event + _EVENT.size)
                found.append((pid, tgid, status))
        offset += (length + 3) & ~3
    return found


class ExitWatch:
    """One subscription of this process to the kernel's exit events, read by one thread, for the processes watched."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._watched: dict[int, ExitCallback] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._read, name="kernel-exits", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls) -> ExitWatch | None:
        """Subscribe; None where the kernel refuses it (no CAP_NET_ADMIN, not in the host's namespaces) or lacks it."""
        sock = None
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
            sock.bind((0, CN_IDX_PROC))
            sock.send(_request(PROC_CN_MCAST_LISTEN))
            sock.settimeout(READ_TIMEOUT_S)
        except (OSError, AttributeError) as exc:  # AttributeError: no AF_NETLINK (not Linux)
            if sock is not None:
                sock.close()
            log.info("no kernel exit events here: exits come from the daemon", extra={"error": str(exc)})
            return None
        return cls(sock)

    def watch(self, pid: int, callback: ExitCallback) -> None:
        """Call `callback(wait status)` (on the reading thread) when process `pid` exits. Watch it while it runs: an
        exit before this call is not told."""
        with self._lock:
            self._watched[pid] = callback

    def forget(self, pid: int) -> None:
        """Stop watching `pid` (its exit is known by other means)."""
        with self._lock:
            self._watched.pop(pid, None)

    def _read(self) -> None:
        while True:
            try:
                datagram = self._sock.recv(65536)
            except TimeoutError:
                if self._closed:
                    return
                continue
            except OSError as exc:
                if exc.errno == errno.ENOBUFS and not self._closed:  # events were lost: the daemon tells those exits
                    log.warning("kernel exit events lost (receive buffer full)")
                    continue
                return  # closed
            for pid, tgid, status in parse_exits(datagram):
                if pid != tgid:
                    continue  # a thread other than the process's first
                with self._lock:
                    callback = self._watched.pop(pid, None)
                if callback is not None:
                    try:
                        callback(status)
                    except Exception:  # one watcher's failure must not end the others' watch
                        log.exception("a kernel exit callback failed", extra={"pid": pid})

    def close(self) -> None:
        """Unsubscribe; the reading thread ends within READ_TIMEOUT_S."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.send(_request(PROC_CN_MCAST_IGNORE))


_shared_lock = threading.Lock()


@functools.cache
def _open_shared() -> ExitWatch | None:
    return ExitWatch.open()


def shared() -> ExitWatch | None:
    """This process's one subscription (opened on first use; None where the kernel refuses it)."""
    with _shared_lock:
        return _open_shared()
