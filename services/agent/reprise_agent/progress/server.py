"""The agent's end of the SDK: the Unix datagram socket ranks write to, and where it and the ranks' inboxes live."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import tempfile
from pathlib import Path

from prometheus_client import Counter

from reprise_agent.progress.book import ProgressBook
from reprise_agent.progress.messages import MalformedSdkMessage, parse_message
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.progress")

MAX_DATAGRAM = 256 * 1024  # above any datagram the sender's default socket buffer (208 KiB) lets through
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL

SDK_MESSAGES = Counter("reprise_agent_sdk_messages_total", "Datagrams received from the training SDK", ["result"])
_ACCEPTED = SDK_MESSAGES.labels(result="accepted")
_GARBAGE = SDK_MESSAGES.labels(result="garbage")


def default_socket_path(state_dir: Path) -> Path:
    """Where the agent's SDK socket lives: ``<state_dir>/sdk.sock``, absolute (ranks may run in another directory).

    A Unix socket path is limited to 107 bytes: a deeper state directory gets a short path in the temp directory
    instead, always the same for the same state directory.
    """
    path = state_dir.absolute() / "sdk.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"reprise-sdk-{digest}.sock"


def default_inbox_dir(state_dir: Path) -> Path:
    """Where ranks that restart in place bind their inboxes (``<pid>.sock``): ``<state_dir>/inbox``, or like the SDK
    socket a short directory in the temp directory when a pid's socket path there would pass the 107-byte limit."""
    path = state_dir.absolute() / "inbox"
    if len(os.fsencode(path / f"{2**22}.sock")) <= MAX_SOCKET_PATH:  # pids stay below 2**22 on Linux
        return path
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"reprise-inbox-{digest}"


class SdkServer:
    """The agent's end of the SDK: a Unix datagram socket at `path` feeding a ProgressBook.

    Waking the event loop costs far more than parsing a datagram, so after a wake-up the socket is read in batches:
    everything waiting is read, then the socket is read again every `batch_window_s` while datagrams keep coming,
    and watched again once it is quiet. With the SDK's 0.1 s heartbeat interval at most one heartbeat per rank waits
    in a 50 ms window, well within the kernel's queue (net.unix.max_dgram_qlen, 10 by default); a datagram that does
    not fit is refused to the sender, which counts it, never blocks the agent.
    """

    def __init__(self, path: Path, book: ProgressBook, *, batch_window_s: float = 0.05) -> None:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"SDK socket path {str(path)!r} is longer than {MAX_SOCKET_PATH} bytes, the limit of a Unix socket"
                " path: set REPRISE_SDK_SOCKET to a shorter one"
            )
        self.path = path
        self.book = book
        self.batch_window_s = batch_window_s
        self.received = 0
        self.garbage = 0
        self.last_garbage = ""
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._inode = 0
        self._buffer = bytearray(MAX_DATAGRAM)
        self._view = memoryview(self._buffer)

    async def start(self) -> None:
        """Bind the socket (replacing a stale one left by an earlier agent) and start reading it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(str(self.path))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._inode = self.path.stat().st_ino
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._on_readable)
        log.info("sdk socket bound", extra={"path": str(self.path)})

    def _on_readable(self) -> None:
        assert self._sock is not None and self._loop is not None
        self._drain()
        if self.batch_window_s > 0:
            self._loop.remove_reader(self._sock.fileno())
            self._timer = self._loop.call_later(self.batch_window_s, self._on_window_end)

    def _on_window_end(self) -> None:
        assert self._sock is not None and self._loop is not None
        if self._drain():
            self._timer = self._loop.call_later(self.batch_window_s, self._on_window_end)
        else:
            self._timer = None
            self._loop.add_reader(self._sock.fileno(), self._on_readable)

    def _drain(self, limit: int = 10_000) -> int:
        """Read and handle every datagram waiting (at most `limit`, so a flood cannot starve the loop)."""
        assert self._sock is not None
        recv_into, view = self._sock.recv_into, self._view
        for count in range(limit):
            try:
                size = recv_into(view)
            except BlockingIOError:
                return count
            except OSError as exc:
                log.warning("sdk socket read failed", extra={"error": str(exc)})
                return count
            self.handle(view[:size].tobytes())
        return limit

    def handle(self, data: bytes) -> None:
        """Parse and record one datagram; garbage is counted, never raised."""
        self.received += 1
        try:
            message = parse_message(data)
        except MalformedSdkMessage as exc:
            self.garbage += 1
            self.last_garbage = str(exc)
            _GARBAGE.inc()
            return
        _ACCEPTED.inc()
        self.book.record(message)

    def close(self) -> None:
        """Stop reading and remove the socket file."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                if self.path.stat().st_ino == self._inode:  # not a socket a newer agent bound at the same path
                    self.path.unlink()
