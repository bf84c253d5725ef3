"""Symptoms that do not count for the job they name: counted by reason and logged at a bounded rate, never lost
silently."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import Counter

from reprise_common.clock import Clock
from reprise_common.logging import get_logger
from reprise_detector.correlate import OutOfPlacement
from reprise_detector.kinds.base import Observation

log = get_logger("reprise.detector.drops")
LOG_EVERY_S = 60.0
EVENTS_DROPPED = Counter(
    "reprise_detector_events_dropped_total",
    "Symptoms about a job that came from outside the job's placement, so were not counted for it",
    ["reason"],
)


class Drops:
    """Counts dropped symptoms per reason; logs each reason at most once a minute, with how many since its last log."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.total: Tally[OutOfPlacement] = Tally()
        self._unlogged: Tally[OutOfPlacement] = Tally()
        self._logged_at: dict[OutOfPlacement, float] = {}

    def note(self, reason: OutOfPlacement, observation: Observation) -> None:
        """Count one dropped symptom, and log it unless this reason was logged less than a minute ago."""
        EVENTS_DROPPED.labels(reason.value).inc()
        self.total[reason] += 1
        self._unlogged[reason] += 1
        now = self.clock.monotonic()
        last = self._logged_at.get(reason)
        if last is not None and now - last < LOG_EVERY_S:
            return
        self._logged_at[reason] = now
        log.warning(
            "dropped symptoms about a job from outside its placement",
            extra={
                "reason": reason.value,
                "dropped": self._unlogged.pop(reason),  # since the last log of this reason
                "node_id": observation.node_id,
                "job_id": observation.job_id,
                "rank": observation.rank,
                "kind": observation.kind,
                "event_id": observation.event_id,
            },
        )
