"""Ingest stage: turn a symptom event into an observation, as its kind reads it (kinds/), with node identity taken from
the subject."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import cast

from prometheus_client import Counter

from reprise_common import subjects
from reprise_common.events import Event
from reprise_detector import kinds
from reprise_detector.kinds.base import Derived, Observation, SymptomEvent
from reprise_detector.node_clocks import NodeClocks

EVENT_TIMES_BOUNDED = Counter(
    "reprise_detector_event_times_bounded_total",
    "Agent events whose time was moved to fit their arrival: `arrival` (sent from a clock ahead of the server's), "
    "`skew` (more than the skew allowance behind it)",
    ["bound"],
)


class IngestError(ValueError):
    """An event that can never be used (bad subject or ids); it is dead-lettered, not retried."""


def bounded_time(sent: datetime, *, stored_ns: int, skew_s: float) -> datetime:
    """An event's time bounded by its arrival: never later than the stream stored it, nor earlier by more than skew_s.

    Agents' clocks are trusted only that far: one running ahead would otherwise date its own crash after a peer's
    that followed it. stored_ns 0 (unknown arrival) keeps the time as sent.
    """
    if not stored_ns:
        return sent
    arrived = datetime.fromtimestamp(stored_ns / 1_000_000_000, UTC)
    if sent > arrived:
        EVENT_TIMES_BOUNDED.labels("arrival").inc()
        return arrived
    earliest = arrived - timedelta(seconds=skew_s)
    if sent < earliest:
        EVENT_TIMES_BOUNDED.labels("skew").inc()
        return earliest
    return sent


def observe(
    event: Event, subject: str, *, stored_ns: int = 0, skew_s: float = 0.0, clocks: NodeClocks | None = None
) -> Observation | None:
    """The observation for a symptom event, as its kind reads it (kinds/); None for an event the detector does not
    use; IngestError if unusable.

    The node is the one the kind's subject authorises (an agent's own; the node a compute signal names). An agent's
    event is dated on the detector's clock by its node's measured offset (`clocks`, node_clocks.py), then bounded by
    its arrival (stored_ns, see bounded_time).
    """
    kind = kinds.of(event)
    if kind is None:
        return None
    symptom = cast(SymptomEvent, event)  # a kind's event: it has its type
    try:
        node_id = kind.node_of(symptom, subject)
    except ValueError as exc:
        raise IngestError(str(exc)) from exc
    scope = kind.scope(symptom)
    job_id = _job_token(scope.job_id) if scope.job_id is not None else None
    sent = clocks.corrected(node_id, event.time) if clocks is not None and kind.on_node_clock else event.time
    return Observation(
        event=symptom,
        node_id=node_id,
        kind=kind.type,
        time=bounded_time(sent, stored_ns=stored_ns, skew_s=skew_s),
        detail=kind.detail(symptom),
        gpu=scope.gpu,
        job_id=job_id,
        rank=scope.rank,
        blame=kind.blame(symptom),
    )


def derived(symptom: Derived) -> Observation:
    """The observation for a symptom the detector derived itself (the node id is already trusted), as its kind words
    it and with what it names (kinds/)."""
    scope = symptom.scope()
    return Observation(
        event=symptom,
        node_id=symptom.node_id,
        kind=symptom.type,
        time=symptom.time,
        detail=symptom.detail(),
        gpu=scope.gpu,
        job_id=scope.job_id,
        rank=scope.rank,
        blame=symptom.blame(),
    )


def _job_token(job_id: str) -> str:
    try:
        return subjects.token(job_id)
    except ValueError as exc:
        raise IngestError(f"an unusable job id: {exc}") from exc
