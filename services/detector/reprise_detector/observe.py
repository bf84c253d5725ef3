"""Ingest stage: turn an agent event into an observation, with node identity taken from the subject."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import Counter

from reprise_common import subjects
from reprise_common.events import (
    ComputeSignal,
    DependencyFailed,
    Event,
    GpuLost,
    GpuXid,
    NumericKind,
    RankExited,
    RankNumeric,
    RankParked,
    RankStacks,
)
from reprise_common.logging import get_logger
from reprise_detector import stacks
from reprise_detector.kinds.base import AgentSymptom, Derived, Observation
from reprise_detector.node_clocks import NodeClocks

log = get_logger("reprise.detector.observe")

_LOG_TAIL_LINES = 5
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
    """The observation for a symptom event, None for an event the detector does not use; IngestError if unusable.

    An agent's event is dated on the detector's clock by its node's measured offset (`clocks`, node_clocks.py), then
    bounded by its arrival (stored_ns, see bounded_time).
    """
    if isinstance(event, ComputeSignal):
        return compute_signal(event, subject, stored_ns=stored_ns, skew_s=skew_s)
    if not isinstance(event, AgentSymptom):
        return None
    try:
        node_id = subjects.node_from_agent_subject(subject)
    except ValueError as exc:
        raise IngestError(str(exc)) from exc
    if event.node_id != node_id:
        log.warning("payload node_id differs from the subject; using the subject", extra={"subject": subject})
    gpu: int | None = None
    job_id: str | None = None
    rank: int | None = None
    match event:
        case GpuXid():
            gpu, detail = event.gpu, event.message or f"XID {event.xid}"
        case GpuLost():
            gpu, detail = event.gpu, event.reason
        case RankExited():
            job_id, rank, detail = _job_token(event.job_id), event.rank, "\n".join(event.log_tail[-_LOG_TAIL_LINES:])
        case RankStacks():
            job_id, rank, detail = _job_token(event.job_id), event.rank, stacks.summary(event)
        case RankNumeric():
            job_id, rank, detail = _job_token(event.job_id), event.rank, numeric_summary(event)
        case RankParked():
            job_id, rank, detail = _job_token(event.job_id), event.rank, event.why
        case DependencyFailed():
            detail = f"{event.dependency}: {event.detail}"
            job_id = _job_token(event.job_id) if event.job_id is not None else None
    sent = clocks.corrected(node_id, event.time) if clocks is not None else event.time
    time = bounded_time(sent, stored_ns=stored_ns, skew_s=skew_s)
    return Observation(
        event=event, node_id=node_id, kind=event.type, time=time, detail=detail, gpu=gpu, job_id=job_id, rank=rank
    )


def compute_signal(event: ComputeSignal, subject: str, *, stored_ns: int, skew_s: float) -> Observation:
    """The observation for a failure signal of the compute backend (a cluster scheduler such as Slurm).

    Only the orchestrator may publish on a backend's signal subject (the server's permissions), so the node and job
    the signal names are taken as given, as a placement's are; the backend must be the subject's. A signal about a
    whole job (preempted, at its time limit, or a node failure that names no node) has no node: node_id "".
    """
    try:
        expected = subjects.compute_signal(event.backend)
        node_id = subjects.token(event.node_id) if event.node_id is not None else ""
    except ValueError as exc:
        raise IngestError(str(exc)) from exc
    if subject != expected:
        raise IngestError(f"a {event.backend} signal on {subject}, not on {expected}")
    job_id = _job_token(event.job_id) if event.job_id is not None else None
    time = bounded_time(event.time, stored_ns=stored_ns, skew_s=skew_s)
    detail = f"{event.backend} {event.kind.value}: {event.detail}" if event.detail else f"{event.backend} {event.kind}"
    return Observation(event=event, node_id=node_id, kind=event.type, time=time, detail=detail, job_id=job_id)


def numeric_summary(event: RankNumeric) -> str:
    """What a numeric fault was, in a few words: "loss became NaN at step 57 (last fine at 56)"."""
    match event.kind:
        case NumericKind.NAN:
            what = "became NaN"
        case NumericKind.INF:
            what = "became infinite"
        case NumericKind.SPIKE:
            what = f"spiked to {event.value:.4g} (robust z {event.z:g} against a recent median of {event.median:.4g})"
    last = f" (last fine at step {event.last_good_step})" if event.last_good_step is not None else ""
    return f"{event.metric} {what} at step {event.step}{last}"


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
    )


def _job_token(job_id: str) -> str:
    try:
        return subjects.token(job_id)
    except ValueError as exc:
        raise IngestError(f"an unusable job id: {exc}") from exc
