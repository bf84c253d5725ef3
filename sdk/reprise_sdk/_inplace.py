"""In-place restart: a surviving rank keeps its process (interpreter, imports, warm caches) across a recovery.

A script opts in by handing its training function to ``run``::

    def train(info: reprise_sdk.ResumeInfo) -> None:
        dist.init_process_group("gloo", init_method="env://")
        ...                                  # build the model, load info.checkpoint, train, heartbeat

    reprise_sdk.run(train)

``run`` calls ``train(resume())``. When a peer dies, the rank's next collective fails; when the agent orders a
restart (a numeric fault, a peer that is merely hung), the rank's next ``heartbeat`` raises ``RestartRequested``.
Either way ``run`` catches it, tears the process group down (NCCL's is aborted), shuts down the TCP connections the
training function left open (a destroyed gloo group keeps its own until the process exits, and peers blocked on them
would never leave their collective), tells the agent the rank is parked and waits for its new assignment: the agent
sends the environment of the new restart epoch (rank, world size, rendezvous, checkpoint), ``run`` puts it into
``os.environ`` and calls ``train`` again. Any other exception, or no assignment within ``REPRISE_SDK_PARK_S``
(default 120 s), ends the process as before: the agent then replaces the rank cold. The agent kills a rank that does
not park within the recovery's bound (stuck in a collective that cannot be aborted, a stopped process), so opting in
never makes a recovery slower than a cold one by more than that bound. A client the script keeps across restarts
(a metrics logger, a data service) is to be created before ``run``: connections made inside ``train`` belong to the
epoch.

Transport: the rank binds a Unix datagram socket of its own, ``<REPRISE_SDK_INBOX_DIR>/<pid>.sock`` (the agent's
directory, so only the agent's user can write to it), and says so to the agent with an ``inplace`` message on the SDK
socket. The agent writes JSON objects to it: ``{"k":"park"}`` (leave at the next heartbeat) and ``{"k":"assign",
"env":{...}}`` (the new epoch's environment). Outside Reprise, or without an inbox directory, ``run`` is
``train(resume())``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TypeVar

from . import _client
from ._client import RestartRequested
from ._resume import ResumeInfo, resume

INBOX_DIR_ENV = "REPRISE_SDK_INBOX_DIR"
PARK_ENV = "REPRISE_SDK_PARK_S"
DEFAULT_PARK_S = 120.0
# A rank other than 0 waits for rank 0's rendezvous store before it joins, at most this long (then torch's own connect,
# with its own timeout, takes over), trying every RENDEZVOUS_POLL_S.
RENDEZVOUS_WAIT_S = 30.0
RENDEZVOUS_POLL_S = 0.005
MAX_ORDER_BYTES = 256 * 1024
MAX_ENV_VARS = 4096
# What a failed collective says when a peer went away (gloo's TCP transport, NCCL's watchdog); a RuntimeError without
# one of these (a wrong dtype, a shape mismatch) is the script's own error and ends the process as before.
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "timed out",
    "communicator was aborted",
)
T = TypeVar("T")


class _Inbox:
    """This rank's end of the agent → rank channel: the orders the agent sends, read by a daemon thread."""

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path = path
        self.sock = sock
        self.assigned: dict[str, str] | None = None
        self.park_ordered = threading.Event()
        self.changed = threading.Condition()
        threading.Thread(target=self._read, name="reprise-sdk-inbox", daemon=True).start()

    @classmethod
    def open(cls, env: Mapping[str, str]) -> _Inbox | None:
        """Bind ``<inbox dir>/<pid>.sock``; None outside Reprise or when it cannot be bound (then: cold restarts)."""
        directory = env.get(INBOX_DIR_ENV, "")
        if not directory or not env.get(_client.SOCKET_ENV):
            return None
        path = os.path.join(directory, f"{os.getpid()}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            sock.bind(path)
        except OSError as exc:
            sock.close()
            _warn(f"no inbox at {path} ({exc}): this rank restarts cold")
            return None
        return cls(path, sock)

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_ORDER_BYTES)
            except OSError:
                return
            order = _parse_order(data)
            if order is None:
                continue
            kind, env = order
            with self.changed:
                if kind == "park":
                    self.park_ordered.set()
                    _client.restart_ordered = True
                else:
                    self.assigned = env
                self.changed.notify_all()

    def wait_assignment(self, within_s: float) -> dict[str, str] | None:
        """The next epoch's environment, or None when none came within `within_s`."""
        deadline = time.monotonic() + within_s
        with self.changed:
            while self.assigned is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)
            env, self.assigned = self.assigned, None
        self.park_ordered.clear()
        _client.restart_ordered = False
        return env

    def close(self) -> None:
        """Stop listening and remove the socket file."""
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _parse_order(data: bytes) -> tuple[str, dict[str, str]] | None:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if type(raw) is not dict:
        return None
    if raw.get("k") == "park":
        return "park", {}
    env = raw.get("env")
    if raw.get("k") != "assign" or type(env) is not dict or len(env) > MAX_ENV_VARS:
        return None
    if not all(type(k) is str and type(v) is str and k and "=" not in k and "\0" not in v for k, v in env.items()):
        return None
    return "assign", env


def peer_failure(exc: BaseException) -> bool:
    """True when `exc` (or an exception it was raised from or during) is a failed collective: a peer went away."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RestartRequested):
            return True
        if _is_distributed_error(current):
            return True
        if isinstance(current, RuntimeError | ConnectionError):
            text = str(current).lower()
            if any(marker in text for marker in PEER_FAILURE_MARKERS):
                return True
        current = current.__cause__ or current.__context__
    return False


def _is_distributed_error(exc: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    error = getattr(dist, "DistError", None) if dist is not None else None
    return isinstance(error, type) and isinstance(exc, error)


def _teardown_process_group() -> None:
    """Destroy the default process group if there is one (NCCL's is aborted first, so no collective stays stuck)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
                return
        dist.destroy_process_group()
    except Exception as exc:  # a group that cannot be torn down is left to the garbage collector
        _warn(f"the process group was not torn down cleanly ({type(exc).__name__}: {exc})")


def _park_s(env: Mapping[str, str]) -> float:
    try:
        return max(0.0, float(env.get(PARK_ENV) or DEFAULT_PARK_S))
    except ValueError:
        return DEFAULT_PARK_S


def _warn(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"reprise_sdk: {text}", file=sys.stderr, flush=True)


def run(train: Callable[[ResumeInfo], T]) -> T:
    """Call ``train(resume())``; after a peer's failure or the agent's order, call it again in this process with the
    new epoch's ``resume()``. Returns what ``train`` returned; re-raises any exception that is not a restart."""
    inbox = _Inbox.open(os.environ)
    if inbox is None:
        await_rendezvous(os.environ)
        return train(resume())
    try:
        _client.say("inplace", {})
        while True:
            sockets_before = _tcp_sockets()
            await_rendezvous(os.environ)
            try:
                return train(resume())
            except Exception as exc:
                if not (inbox.park_ordered.is_set() or peer_failure(exc)):
                    raise
                failure: BaseException = exc
            except RestartRequested as exc:
                failure = exc
            env = _park(inbox, failure, sockets_before)
            if env is None:
                raise failure
            os.environ.update(env)
            _client._reset()
    finally:
        inbox.close()


def await_rendezvous(env: Mapping[str, str], *, within_s: float = RENDEZVOUS_WAIT_S) -> bool:
    """For a rank other than 0 of a group of several: wait until rank 0's store accepts connections at
    MASTER_ADDR:MASTER_PORT, trying every 5 ms; False when it did not within `within_s` (or there is no such wait).

    torch's store client that finds nobody listening backs off for about half a second before it tries again, so a
    rank that comes back a moment before rank 0 (a standby, or a survivor re-entering first) would add that half second
    to every restart. Rank 0's store only accepts here: the connection is closed unused.
    """
    address, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    if env.get("RANK", "0") == "0" or env.get("WORLD_SIZE", "1") == "1" or not address:
        return False
    if not (port.isdigit() and 0 < int(port) < 65536):
        return False
    deadline = time.monotonic() + within_s
    while True:
        try:
            socket.create_connection((address, int(port)), timeout=0.5).close()
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(RENDEZVOUS_POLL_S)
        else:
            return True


def _tcp_sockets() -> set[int]:
    """The file descriptors of this process that are connected TCP sockets (empty where /proc is not there)."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(int(name)))  # a duplicate: closing it leaves the original open
        except (OSError, ValueError):
            continue
        with probe:  # a listener stays: gloo's listener thread aborts the process when its socket is shut down
            tcp = probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
            if tcp and not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found.add(int(name))
    return found


def _shut_down(descriptors: set[int]) -> None:
    """Shut down (not close: their owners still hold the descriptors) the TCP sockets among `descriptors`."""
    for fd in descriptors:
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe, contextlib.suppress(OSError):
            probe.shutdown(socket.SHUT_RDWR)


def _park(inbox: _Inbox, failure: BaseException, sockets_before: set[int]) -> dict[str, str] | None:
    """Tear the epoch down, tell the agent, wait for the next epoch's environment (None: none came in time)."""
    _teardown_process_group()
    # A destroyed gloo group keeps its connections open as long as the process lives, and a peer blocked on one of
    # them would wait in its collective until it is killed: shut down every TCP connection the training function
    # opened and left open, so each peer's collective fails at once and that peer parks too.
    _shut_down(_tcp_sockets() - sockets_before)
    why = "restart ordered" if isinstance(failure, RestartRequested) else f"{type(failure).__name__}: {failure}"
    _client.say("parked", {"why": why[:512]})
    # The failed frames hold the script's model, optimizer and tensors: clear their locals and collect while the
    # recovery goes on, so the memory of the last epoch is free before the next one builds its own (the traceback's
    # lines stay). After the agent has heard of the park: a full collection takes a while with torch loaded.
    traceback.clear_frames(failure.__traceback__)
    gc.collect()
    within = _park_s(os.environ)
    _warn(f"parked for a restart in place ({why[:200]}); waiting up to {within:g} s for the next epoch")
    return inbox.wait_assignment(within)
