"""Training progress from the SDK: the Unix datagram socket ranks write to, and the book of each rank's progress.

The SDK (``reprise_sdk``) sends one compact JSON object per datagram, protocol version 1::

    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"hb","step":12,"t_ns":1767225600000000000,"phase":"","m":{"loss":0.5}}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"phase","t_ns":1767225600000000000,"phase":"checkpointing"}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"ckpt","step":12,"t_ns":...,"path":"/ckpt/12","files":["/ckpt/12/a"]}

Unknown fields are ignored; a newer protocol version, an unknown kind or anything unparsable is counted and dropped.
Eight ranks heartbeating every 10 ms are 800 datagrams a second: parsing is one ``json.loads`` and a few type checks,
and the percentiles are computed only when a report asks for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import socket
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from reprise_common.clock import Clock, SystemClock
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.progress")

PROTOCOL_VERSION = 1
STEP_WINDOW = 256
MAX_DATAGRAM = 256 * 1024  # above any datagram the sender's default socket buffer (208 KiB) lets through
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL
MAX_TRACKED_RANKS = 4096
_MAX_TEXT = 4096

SDK_MESSAGES = Counter("reprise_agent_sdk_messages_total", "Datagrams received from the training SDK", ["result"])
_ACCEPTED = SDK_MESSAGES.labels(result="accepted")
_GARBAGE = SDK_MESSAGES.labels(result="garbage")


class MessageKind(StrEnum):
    """What an SDK message reports."""

    HEARTBEAT = "hb"
    PHASE = "phase"
    CHECKPOINT = "ckpt"
    IN_PLACE = "inplace"  # the rank runs under reprise_sdk.run: it can restart in place
    PARKED = "parked"  # the rank left its training function and waits for the next epoch (`why`: what it caught)


class MalformedSdkMessage(ValueError):
    """A datagram that is not a version-1 SDK message; the reason says what was wrong."""


@dataclass(frozen=True, slots=True)
class SdkMessage:
    """One parsed SDK message; `sent_ns` is the sender's wall time, `phase` "" when the script set none."""

    kind: MessageKind
    job_id: str
    rank: int
    restart_epoch: int
    sent_ns: int
    step: int | None = None
    phase: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    path: str = ""
    files: tuple[str, ...] = ()
    sha256: tuple[tuple[str, int, str], ...] = ()  # (file, size, SHA-256 hex) computed by the writer
    why: str = ""  # a parked rank's reason


def parse_message(data: bytes) -> SdkMessage:
    """Parse one datagram, or raise MalformedSdkMessage with a one-line reason."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise MalformedSdkMessage(f"not JSON: {exc}") from None
    if type(raw) is not dict:
        raise MalformedSdkMessage("not a JSON object")
    if raw.get("v") != PROTOCOL_VERSION:
        raise MalformedSdkMessage(f"protocol version {raw.get('v')!r} not supported (this reader knows 1)")
    try:
        kind = MessageKind(str(raw.get("k")))
    except ValueError:
        raise MalformedSdkMessage(f"unknown kind {raw.get('k')!r}") from None
    job_id = _text(raw, "job")
    if not job_id:
        raise MalformedSdkMessage("job is empty")
    rank, epoch, sent_ns = _count(raw, "rank"), _count(raw, "epoch"), _count(raw, "t_ns")
    if kind is MessageKind.PHASE:
        return SdkMessage(kind, job_id, rank, epoch, sent_ns, phase=_text(raw, "phase"))
    if kind is MessageKind.IN_PLACE or kind is MessageKind.PARKED:
        return SdkMessage(kind, job_id, rank, epoch, sent_ns, why=_text(raw, "why"))
    step = _count(raw, "step")
    if kind is MessageKind.HEARTBEAT:
        return SdkMessage(kind, job_id, rank, epoch, sent_ns, step, phase=_text(raw, "phase"), metrics=_metrics(raw))
    path, files = _text(raw, "path"), raw.get("files", [])
    if not path:
        raise MalformedSdkMessage("path is empty")
    if type(files) is not list or not all(type(f) is str for f in files):
        raise MalformedSdkMessage("files is not a list of strings")
    return SdkMessage(kind, job_id, rank, epoch, sent_ns, step, path=path, files=tuple(files), sha256=_sha256(raw))


def _sha256(raw: dict[str, Any]) -> tuple[tuple[str, int, str], ...]:
    digests = raw.get("sha256", {})
    if type(digests) is not dict:
        raise MalformedSdkMessage("sha256 is not an object")
    found = []
    for name, entry in digests.items():
        if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not int or type(entry[1]) is not str:
            raise MalformedSdkMessage(f"sha256 entry for {name!r} is not [size, hex digest]")
        found.append((name, entry[0], entry[1]))
    return tuple(found)


def _count(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if type(value) is not int or value < 0:
        raise MalformedSdkMessage(f"{name} is not a non-negative integer: {value!r}")
    return value


def _text(raw: dict[str, Any], name: str) -> str:
    value = raw.get(name, "")
    if type(value) is not str or len(value) > _MAX_TEXT:
        raise MalformedSdkMessage(f"{name} is not a string of at most {_MAX_TEXT} characters")
    return value


def _metrics(raw: dict[str, Any]) -> dict[str, float]:
    metrics = raw.get("m")
    if metrics is None:
        return {}
    if type(metrics) is not dict:
        raise MalformedSdkMessage("m is not an object")
    try:
        return {k: float(v) for k, v in metrics.items() if type(v) in (int, float)}
    except OverflowError:  # an integer too large for a float
        raise MalformedSdkMessage("a metric is out of range") from None


# --- the book ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RankProgress:
    """What the SDK told us about one rank; times are the agent's monotonic clock unless named otherwise."""

    phase: str
    phase_since: float
    restart_epoch: int | None = None  # as the rank's SDK reported it (None until it reports anything)
    step: int | None = None
    beat_at: float | None = None
    step_base_ns: int | None = None  # sender time when `step` was first reported (None: no base, e.g. after a phase)
    step_base_at: float | None = None  # our time of the same moment, used when the sender's clock stepped back
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    metrics: dict[str, float] = field(default_factory=dict)
    _ordered: list[float] | None = None

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile of the step-time window (sorted once per new sample, on demand)."""
        if not self.step_times:
            return None
        if self._ordered is None:
            self._ordered = sorted(self.step_times)
        ordered = self._ordered
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


CheckpointCallback = Callable[[SdkMessage], None]
STATUS_FIELDS = (
    "step",
    "heartbeat_age_s",
    "phase",
    "phase_age_s",
    "step_time_p50_s",
    "step_time_p99_s",
    "step_time_last_s",
)


class ProgressBook:
    """Each rank's step, heartbeat age, phase and step-time statistics, fed by SDK messages."""

    def __init__(self, clock: Clock | None = None, *, max_ranks: int = MAX_TRACKED_RANKS) -> None:
        self.clock: Clock = clock or SystemClock()
        self.max_ranks = max_ranks
        self.refused = 0  # messages for new ranks beyond max_ranks
        self.stale = 0  # messages from an earlier restart epoch than the rank's latest
        self._jobs: dict[str, dict[int, RankProgress]] = {}
        self._tracked = 0
        self._checkpoint_callbacks: list[CheckpointCallback] = []
        self._training_callbacks: list[Callable[[str], None]] = []
        self._training_jobs: set[str] = set()
        self._rank_callbacks: list[Callable[[str, int], None]] = []
        self._metrics_callbacks: list[Callable[[SdkMessage], None]] = []
        self._restart_callbacks: list[Callable[[SdkMessage], None]] = []

    def on_metrics(self, callback: Callable[[SdkMessage], None]) -> None:
        """Call `callback(message)` for every heartbeat of the rank's current launch that carries metrics."""
        self._metrics_callbacks.append(callback)

    def on_restart_message(self, callback: Callable[[SdkMessage], None]) -> None:
        """Call `callback(message)` for every in-place restart message ("inplace", "parked"); they are no progress."""
        self._restart_callbacks.append(callback)

    def on_rank_training(self, callback: Callable[[str, int], None]) -> None:
        """Call `callback(job_id, rank)` at each rank's first heartbeat of a launch (its restart epoch)."""
        self._rank_callbacks.append(callback)

    def on_first_heartbeat(self, callback: Callable[[str], None]) -> None:
        """Call `callback(job_id)` once when a job's first heartbeat arrives (it is past its rendezvous)."""
        self._training_callbacks.append(callback)

    def on_checkpoint_saved(self, callback: CheckpointCallback) -> None:
        """Call `callback(message)` for every checkpoint a rank reports."""
        self._checkpoint_callbacks.append(callback)

    def begin(self, job_id: str, rank: int, *, restart_epoch: int | None = None) -> None:
        """A rank was launched: its startup phase starts now, unless it already reported from this restart epoch."""
        progress = self._jobs.get(job_id, {}).get(rank)
        if progress is not None and restart_epoch is not None and progress.restart_epoch == restart_epoch:
            return
        fresh = self._track(job_id, rank)
        if fresh is not None:
            fresh.restart_epoch = restart_epoch

    def forget(self, job_id: str) -> None:
        """Drop everything known of a job's ranks (stopped, or about to be relaunched)."""
        ranks = self._jobs.pop(job_id, {})
        self._tracked -= len(ranks)
        self._training_jobs.discard(job_id)

    def record(self, message: SdkMessage) -> None:
        """Apply one SDK message; a rank's first message from a newer restart epoch starts its progress afresh."""
        if message.kind is MessageKind.IN_PLACE or message.kind is MessageKind.PARKED:
            _notify(self._restart_callbacks, "restart message", message.job_id, message)
            return
        ranks = self._jobs.get(message.job_id)
        progress = ranks.get(message.rank) if ranks is not None else None
        known_epoch = progress.restart_epoch if progress is not None else None
        if known_epoch is not None and message.restart_epoch != known_epoch:
            if message.restart_epoch < known_epoch:
                self.stale += 1  # a rank of an earlier launch, still talking while it is stopped
                return
            progress = None
        if progress is None:
            progress = self._track(message.job_id, message.rank)
            if progress is None:
                self.refused += 1
                return
        progress.restart_epoch = message.restart_epoch
        now = self.clock.monotonic()
        if message.kind is MessageKind.HEARTBEAT:
            self._heartbeat(progress, message, now)
        elif message.kind is MessageKind.PHASE:
            self._phase(progress, message.phase or ("training" if progress.step is not None else "startup"), now)
            progress.step_base_ns = progress.step_base_at = None  # a step spanning a phase change is no step time
        else:
            self._checkpoint(message)

    def _track(self, job_id: str, rank: int) -> RankProgress | None:
        ranks = self._jobs.setdefault(job_id, {})
        if rank not in ranks:
            if self._tracked >= self.max_ranks:
                if not ranks:
                    del self._jobs[job_id]
                return None
            self._tracked += 1
        progress = ranks[rank] = RankProgress(phase="startup", phase_since=self.clock.monotonic())
        return progress

    @staticmethod
    def _phase(progress: RankProgress, phase: str, now: float) -> None:
        if phase != progress.phase:
            progress.phase = phase
            progress.phase_since = now

    def _heartbeat(self, progress: RankProgress, message: SdkMessage, now: float) -> None:
        step = message.step
        assert step is not None
        first_of_rank = progress.beat_at is None
        if step != progress.step:
            previous = progress.step
            if previous is not None and step > previous and progress.step_base_ns is not None:
                elapsed = (message.sent_ns - progress.step_base_ns) / 1e9
                if elapsed <= 0 and progress.step_base_at is not None:  # the sender's wall clock stepped back
                    elapsed = now - progress.step_base_at
                if elapsed > 0:
                    progress.step_times.append(elapsed / (step - previous))
                    progress._ordered = None
            progress.step = step
            progress.step_base_ns = message.sent_ns
            progress.step_base_at = now
        elif progress.step_base_ns is None:  # first heartbeat after a phase: the step clock starts here
            progress.step_base_ns = message.sent_ns
            progress.step_base_at = now
        progress.beat_at = now
        self._phase(progress, message.phase or "training", now)
        if first_of_rank:
            _notify(self._rank_callbacks, "rank-training", message.job_id, message.job_id, message.rank)
        if message.job_id not in self._training_jobs:
            self._training_jobs.add(message.job_id)
            _notify(self._training_callbacks, "first-heartbeat", message.job_id, message.job_id)
        if message.metrics:
            progress.metrics = message.metrics
            _notify(self._metrics_callbacks, "metrics", message.job_id, message)

    def _checkpoint(self, message: SdkMessage) -> None:
        assert message.step is not None
        _notify(self._checkpoint_callbacks, "checkpoint", message.job_id, message)

    def status_fields(self, job_id: str, rank: int) -> dict[str, Any]:
        """This rank's RankStatus progress fields: ``RankStatus(..., **book.status_fields(job_id, rank))``."""
        progress = self._jobs.get(job_id, {}).get(rank)
        if progress is None:
            return dict.fromkeys(STATUS_FIELDS) | {"phase": "startup"}
        now = self.clock.monotonic()
        return {
            "step": progress.step,
            "heartbeat_age_s": _seconds(now - progress.beat_at if progress.beat_at is not None else None),
            "phase": progress.phase,
            "phase_age_s": _seconds(now - progress.phase_since),
            "step_time_p50_s": _seconds(progress.percentile(0.50)),
            "step_time_p99_s": _seconds(progress.percentile(0.99)),
            "step_time_last_s": _seconds(progress.step_times[-1] if progress.step_times else None),
        }

    def metrics(self, job_id: str, rank: int) -> dict[str, float]:
        """The metrics of the rank's last heartbeat that carried any."""
        progress = self._jobs.get(job_id, {}).get(rank)
        return dict(progress.metrics) if progress is not None else {}

    def restart_epoch(self, job_id: str, rank: int) -> int | None:
        """The restart epoch the rank's SDK reported (from REPRISE_RESTART_EPOCH), if it reported anything."""
        progress = self._jobs.get(job_id, {}).get(rank)
        return progress.restart_epoch if progress is not None else None


def _notify(callbacks: list[Callable[..., None]], what: str, job_id: str, *args: Any) -> None:
    """Call each consumer; one that fails is logged and must not stop the datagram reader or the others."""
    for callback in callbacks:
        try:
            callback(*args)
        except Exception:
            log.exception(f"{what} callback failed", extra={"job_id": job_id})


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(max(value, 0.0), 6)


# --- the socket -------------------------------------------------------------------------------------------------
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
