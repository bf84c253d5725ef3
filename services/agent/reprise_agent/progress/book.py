"""The book of each rank's progress: step, heartbeat age, phase and step-time percentiles, fed by SDK messages.

Consumers subscribe to what they need (first heartbeat, checkpoints, metrics, in-place restart messages); the
percentiles are computed only when a report asks for them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reprise_agent.progress.messages import MessageKind, SdkMessage
from reprise_common.clock import Clock, SystemClock
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.progress")

STEP_WINDOW = 256
MAX_TRACKED_RANKS = 4096


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
    resumed: tuple[str, int | None, str] | None = None  # (via, step, why) of the rank's "resumed" message
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
    "resumed_via",
    "resumed_step",
    "resumed_why",
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
        elif message.kind is MessageKind.RESUMED:
            progress.resumed = (message.via, message.step, message.why)
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
            return dict.fromkeys(STATUS_FIELDS) | {"phase": "startup", "resumed_via": "", "resumed_why": ""}
        now = self.clock.monotonic()
        via, step, why = progress.resumed or ("", None, "")
        return {
            "step": progress.step,
            "heartbeat_age_s": _seconds(now - progress.beat_at if progress.beat_at is not None else None),
            "phase": progress.phase,
            "phase_age_s": _seconds(now - progress.phase_since),
            "step_time_p50_s": _seconds(progress.percentile(0.50)),
            "step_time_p99_s": _seconds(progress.percentile(0.99)),
            "step_time_last_s": _seconds(progress.step_times[-1] if progress.step_times else None),
            "resumed_via": via,
            "resumed_step": step,
            "resumed_why": why,
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
