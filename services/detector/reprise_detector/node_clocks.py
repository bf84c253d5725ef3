"""How far each node's clock is off the detector's, measured from its reports, so that its events are dated on the
detector's clock.

Every report carries the time its agent sent it. `sent - received` is the node's clock offset minus the report's
transit time, and a transit time is never negative, so the largest value over recent reports is the offset minus the
shortest transit: within milliseconds of the offset on a network that delivers some report promptly. An event's
corrected time is its own time minus that offset. Offsets within TRUST_S are left alone (noise: transit, a batch that
waited); a node's offset is followed through clock steps by keeping the largest value of the current and the
previous BUCKET_S only. A node not heard yet has no offset: its events keep their own times, bounded by their arrival
as before (observe.bounded_time).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

TRUST_S = 0.25  # a node's clock this close to the detector's is taken as it is
BUCKET_S = 60.0  # the offset is the largest sample of the current bucket and the one before


@dataclass
class _Samples:
    started: float  # when the current bucket began (the detector's monotonic clock)
    current: float
    previous: float | None = None


class NodeClocks:
    """Each node's clock offset against the detector's, from its reports' send times."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Samples] = {}

    def saw(self, node_id: str, sent: datetime, received: datetime, *, now: float) -> None:
        """A report of `node_id` sent at `sent` (its clock) was read at `received` (the detector's wall clock);
        `now` is the detector's monotonic clock."""
        sample = (sent - received).total_seconds()
        samples = self._nodes.get(node_id)
        if samples is None:
            self._nodes[node_id] = _Samples(started=now, current=sample)
        elif now - samples.started >= BUCKET_S:
            samples.previous = samples.current if now - samples.started < 2 * BUCKET_S else None
            samples.started, samples.current = now, sample
        elif sample > samples.current:
            samples.current = sample

    def offset_s(self, node_id: str) -> float:
        """How far the node's clock runs ahead of the detector's (negative: behind); 0 within TRUST_S or unknown."""
        samples = self._nodes.get(node_id)
        if samples is None:
            return 0.0
        offset = samples.current if samples.previous is None else max(samples.current, samples.previous)
        return offset if abs(offset) > TRUST_S else 0.0

    def corrected(self, node_id: str, time: datetime) -> datetime:
        """A time the node stamped, on the detector's clock."""
        offset = self.offset_s(node_id)
        return time - timedelta(seconds=offset) if offset else time
