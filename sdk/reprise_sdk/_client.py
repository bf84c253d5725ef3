"""The transport: one non-blocking Unix datagram socket per process, one compact JSON object per message.

Wire format, protocol version 1 (the agent's reader is ``reprise_agent.progress.messages.parse_message``)::

    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"hb","step":12,"t_ns":1767225600000000000,"phase":"","m":{"loss":0.5}}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"phase","t_ns":1767225600000000000,"phase":"checkpointing"}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"ckpt","step":12,"t_ns":...,"path":"/ckpt/12","files":["/ckpt/12/a"]}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"inplace","t_ns":...}              (reprise_sdk.run: can restart in place)
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"parked","t_ns":...,"why":"..."}   (waiting for the next epoch)

``t_ns`` is the sender's wall time (``time.time_ns()``); ``phase`` is "" while the script has set none. Heartbeats
are built by string formatting, not ``json.dumps``, because that is three times cheaper: the job id, phase and
metric names are JSON-escaped once, metric values are written with 9 significant digits (exact for float32) and
non-finite values as Python's json module writes them (NaN, Infinity, -Infinity).

Heartbeats are coalesced: one is sent at most every ``REPRISE_SDK_INTERVAL_S`` (default 0.1 s); the calls between only
remember their step and metrics, which the next heartbeat sent, a phase change, a checkpoint report or the end of
the process carries. Every datagram wakes the agent, and 8 ranks at 100 steps/s would otherwise cost the agent several
percent of a core in wake-ups alone; a step time is then the mean over the steps between two heartbeats.

The socket is connected once and written with ``send``: ``sendto`` would resolve the socket path on every call,
which measured as 40% of a heartbeat's cost. If the agent goes away (or restarts on the same path) the failed send
is counted and the socket is re-connected at most every 0.5 s, so a restarted agent is found again.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

PROTOCOL_VERSION = 1
SOCKET_ENV = "REPRISE_SDK_SOCKET"
INTERVAL_ENV = "REPRISE_SDK_INTERVAL_S"
DEFAULT_INTERVAL_S = 0.1
RECONNECT_INTERVAL_S = 0.5
PHASE_PATIENCE_S = 0.1  # a full agent queue delays a phase change by at most this long, then drops it
CHECKPOINT_PATIENCE_S = 2.0  # a checkpoint report is worth waiting for: the save itself took far longer
MAX_PHASE_CHARS = 128
_MAX_CACHED_NAMES = 1024
_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_time_ns = time.time_ns
_monotonic = time.monotonic


@dataclass(frozen=True, slots=True)
class SdkStats:
    """What the SDK did in this process: messages sent to the agent and messages dropped."""

    enabled: bool
    sent: int
    dropped: int


class _Channel:
    """This process's connection to the agent; ``sock`` is None outside Reprise (every call is a no-op)."""

    __slots__ = (
        "dropped",
        "finite",
        "head",
        "interval",
        "next_at",
        "path",
        "pending_metrics",
        "pending_step",
        "phase",
        "phase_json",
        "retry_at",
        "sent",
        "sock",
        "warned",
    )

    def __init__(self, path: str | None = None, head: str = "", interval: float = DEFAULT_INTERVAL_S) -> None:
        self.path = path
        self.head = head
        self.interval = interval
        self.next_at = 0.0
        self.pending_step: int | None = None
        self.pending_metrics: dict[str, float] = {}
        self.finite = True  # the float metrics of the last coalesced heartbeat were all finite
        self.sock: socket.socket | None = None
        self.phase = ""
        self.phase_json = '""'
        self.sent = 0
        self.dropped = 0
        self.retry_at = 0.0
        self.warned: set[str] = set()
        if path is not None:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            except OSError as exc:
                self.warn("socket", f"no socket for the agent ({exc}); progress is not reported")
                return
            sock.setblocking(False)
            self.sock = sock
            self.connect()

    def connect(self) -> bool:
        """Point the socket at the agent's path; False (and a later retry) when nobody listens there."""
        assert self.sock is not None and self.path is not None
        try:
            self.sock.connect(self.path)
        except OSError as exc:
            self.retry_at = time.monotonic() + RECONNECT_INTERVAL_S
            self.warn("unreachable", f"agent socket {self.path} unreachable ({exc}); messages are dropped until it is")
            return False
        return True

    def reconnect(self) -> bool:
        """After a failed send: connect again, at most every RECONNECT_INTERVAL_S; True when that worked."""
        return time.monotonic() >= self.retry_at and self.connect()

    def invalid(self, exc: Exception) -> None:
        """The script passed something the SDK cannot send: count it, say so once, do not raise."""
        self.dropped += 1
        self.warn(type(exc).__name__, f"message dropped: {exc}")

    def warn(self, key: str, text: str) -> None:
        """Tell the script's stderr once per kind of trouble; training output must not drown in it."""
        if key in self.warned:
            return
        self.warned.add(key)
        with contextlib.suppress(OSError, ValueError):
            print(f"reprise_sdk: {text}", file=sys.stderr, flush=True)


_channel: _Channel | None = None
_lock = threading.Lock()
_metric_keys: dict[str, str] = {}
restart_ordered = False  # set by the in-place restart's inbox (_inplace.py) when the agent orders a restart


class RestartRequested(BaseException):
    """Raised by ``heartbeat`` under ``reprise_sdk.run`` when the agent orders a restart in place; ``run`` catches it.

    A BaseException, so that a script's ``except Exception`` does not swallow it.
    """


def _open() -> _Channel:
    """Create this process's channel from the environment the agent set (once)."""
    global _channel  # noqa: PLW0603 - one channel per process is the point
    with _lock:
        if _channel is None:
            _channel = _new_channel(os.environ)
        return _channel


def _new_channel(env: Mapping[str, str]) -> _Channel:
    path = env.get(SOCKET_ENV, "")
    if not path:
        return _Channel()
    try:
        rank = int(env.get("RANK", "0"))
        epoch = int(env.get("REPRISE_RESTART_EPOCH", "0"))
        interval = max(0.0, float(env.get(INTERVAL_ENV) or DEFAULT_INTERVAL_S))
    except ValueError as exc:
        disabled = _Channel()
        disabled.warn("env", f"RANK, REPRISE_RESTART_EPOCH or {INTERVAL_ENV} is not a number ({exc}); nothing is sent")
        return disabled
    job = json.dumps(env.get("REPRISE_JOB_ID", ""))
    return _Channel(path, f'{{"v":{PROTOCOL_VERSION},"job":{job},"rank":{rank},"epoch":{epoch},"k":', interval)


def _reset() -> None:
    """Forget the channel so the next call reads the environment again (a forked child gets its own; a rank restarted
    in place has a new rank and epoch)."""
    global _channel, _lock  # noqa: PLW0603
    if _channel is not None and _channel.sock is not None:
        _channel.sock.close()
    _channel = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset)


def _encode_metrics(metrics: dict[str, float]) -> str:
    body = ""
    for name, value in metrics.items():
        key = _metric_keys.get(name)
        if key is None:
            key = json.dumps(str(name)) + ":"
            if len(_metric_keys) < _MAX_CACHED_NAMES:
                _metric_keys[name] = key
        text = "%.9g" % value  # noqa: UP031 - %-formatting takes any __float__ (numpy, 0-d tensors) and is fastest
        if text[-1] in "nf":  # nan, inf, -inf
            text = _NON_FINITE[text]
        body = f"{body},{key}{text}" if body else key + text
    return body


def heartbeat(step: int, **metrics: float) -> None:
    """Report that training step `step` finished, with optional metrics; never blocks, and never raises except
    RestartRequested under ``reprise_sdk.run`` once the agent ordered a restart in place."""
    if restart_ordered:
        raise RestartRequested(f"the agent ordered a restart in place (at step {step})")
    channel = _channel or _open()
    sock = channel.sock
    if sock is None:
        return
    now = _monotonic()
    if now < channel.next_at:  # carried by the next message sent: the agent needs no finer grain...
        for value in metrics.values():
            if value.__class__ is float and value - value:  # NaN or infinite: x - x is NaN then, and NaN is true
                if channel.finite:  # ...but the first NaN or infinity goes at once: its step is the fault's step
                    channel.finite = False
                    break
                channel.pending_step, channel.pending_metrics = step, metrics
                return
        else:
            channel.finite = True
            channel.pending_step, channel.pending_metrics = step, metrics
            return
    channel.next_at = now + channel.interval
    channel.pending_step = None
    _send_heartbeat(channel, sock, step, metrics)


def _send_heartbeat(channel: _Channel, sock: socket.socket, step: int, metrics: dict[str, float]) -> None:
    try:
        if metrics:
            data = (
                f'{channel.head}"hb","step":{step:d},"t_ns":{_time_ns()},"phase":{channel.phase_json},'
                f'"m":{{{_encode_metrics(metrics)}}}}}'
            ).encode()
        else:
            data = f'{channel.head}"hb","step":{step:d},"t_ns":{_time_ns()},"phase":{channel.phase_json}}}'.encode()
    except (TypeError, ValueError) as exc:  # a step that is not an integer, a metric that is not a number
        channel.invalid(exc)
        return
    try:
        sock.send(data)
    except BlockingIOError:  # the agent is alive but behind: the next heartbeat says the same, only newer
        channel.dropped += 1
        return
    except OSError:  # the agent is gone, or not there yet, or restarted on the same path
        if not channel.reconnect():
            channel.dropped += 1
            return
        try:
            sock.send(data)
        except OSError:
            channel.dropped += 1
            return
    channel.sent += 1


def _flush(channel: _Channel) -> None:
    """Send the heartbeat that coalescing held back, before a message that must not overtake it."""
    step = channel.pending_step
    if step is not None and channel.sock is not None:
        channel.pending_step = None
        channel.next_at = _monotonic() + channel.interval
        _send_heartbeat(channel, channel.sock, step, channel.pending_metrics)


@atexit.register
def _flush_at_exit() -> None:
    if _channel is not None:
        _flush(_channel)


class PhaseScope:
    """The phase just entered; as a context manager it restores the previous phase on exit."""

    __slots__ = ("name", "previous")

    def __init__(self, name: str, previous: str) -> None:
        self.name = name
        self.previous = previous

    def __enter__(self) -> PhaseScope:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _switch_phase(self.previous)


def phase(name: str) -> PhaseScope:
    """Enter a phase ("checkpointing", "eval", ...) so a long one is not taken for a hang; also a context manager."""
    name = str(name)[:MAX_PHASE_CHARS]
    return PhaseScope(name, _switch_phase(name))


def _switch_phase(name: str) -> str:
    channel = _channel or _open()
    _flush(channel)
    previous = channel.phase
    channel.phase, channel.phase_json = name, json.dumps(name)
    if channel.sock is not None:
        message = f'{channel.head}"phase","t_ns":{_time_ns()},"phase":{channel.phase_json}}}'
        _send_patiently(channel, channel.sock, message.encode(), PHASE_PATIENCE_S)
    return previous


def checkpoint_saved(
    path: str, step: int, files: list[str] | None = None, *, sha256: Mapping[str, tuple[int, str]] | None = None
) -> None:
    """Report that this rank finished writing its part of the checkpoint at `path` for `step`.

    `sha256` maps each file to its (size in bytes, SHA-256 hex digest), computed where the bytes are.
    """
    channel = _channel or _open()
    if channel.sock is None:
        return
    _flush(channel)
    try:
        body = {"step": int(step), "t_ns": _time_ns(), "path": os.fspath(path)}
        body["files"] = [os.fspath(f) for f in files or ()]
        if sha256:
            body["sha256"] = {os.fspath(f): [int(size), str(digest)] for f, (size, digest) in sha256.items()}
        message = channel.head + '"ckpt",' + json.dumps(body, separators=(",", ":"))[1:]
    except (TypeError, ValueError) as exc:
        channel.invalid(exc)
        return
    _send_patiently(channel, channel.sock, message.encode(), CHECKPOINT_PATIENCE_S)


def _send_patiently(channel: _Channel, sock: socket.socket, data: bytes, patience_s: float) -> None:
    """Send a message that no later message repeats: wait briefly for room, re-connect once if the agent moved."""
    deadline = time.monotonic() + patience_s
    reconnected = False
    while True:
        try:
            sock.send(data)
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.001)
                continue
            channel.dropped += 1
            channel.warn("full", f"agent queue stayed full for {patience_s} s; a phase or checkpoint report was lost")
            return
        except OSError as exc:
            if not reconnected and channel.connect():
                reconnected = True
                continue
            channel.dropped += 1
            channel.warn("lost", f"a phase or checkpoint report was lost ({exc})")
            return
        channel.sent += 1
        return


def say(kind: str, body: Mapping[str, str]) -> None:
    """Send a message of `kind` with string fields `body` (the in-place restart's "inplace" and "parked")."""
    channel = _channel or _open()
    if channel.sock is None:
        return
    _flush(channel)
    fields = "".join(f",{json.dumps(name)}:{json.dumps(value)}" for name, value in body.items())
    _send_patiently(channel, channel.sock, f'{channel.head}"{kind}","t_ns":{_time_ns()}{fields}}}'.encode(), 1.0)


def resumed(via: str, step: int | None, why: str) -> None:
    """Tell the agent where this rank's state came from after (re)joining: "peer" (at `step`) or "checkpoint"."""
    channel = _channel or _open()
    if channel.sock is None:
        return
    _flush(channel)
    body = {"t_ns": _time_ns(), "via": str(via)[:16], "why": str(why)[:512]}
    if step is not None:
        body["step"] = int(step)
    message = channel.head + '"resumed",' + json.dumps(body, separators=(",", ":"))[1:]
    _send_patiently(channel, channel.sock, message.encode(), 1.0)


def stats() -> SdkStats:
    """Messages this process sent to the agent and dropped (agent absent or behind, invalid arguments)."""
    channel = _channel or _open()
    return SdkStats(enabled=channel.sock is not None, sent=channel.sent, dropped=channel.dropped)
