"""Ingest stage: turn an agent event into an observation, with node identity taken from the subject."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from reprise_common import subjects
from reprise_common.events import DependencyFailed, Event, GpuLost, GpuXid, RankExited
from reprise_common.logging import get_logger
from reprise_detector.derived import DerivedSymptom, JobHung, NodeLost, RankStraggling

log = get_logger("reprise.detector.observe")

AgentSymptom = GpuXid | GpuLost | RankExited | DependencyFailed
SymptomEvent = AgentSymptom | DerivedSymptom
_LOG_TAIL_LINES = 5


class IngestError(ValueError):
    """An event that can never be used (bad subject or ids); it is dead-lettered, not retried."""


@dataclass(frozen=True)
class Observation:
    """One symptom as the detector sees it: who reported it (from the subject), what, and when."""

    event: SymptomEvent
    node_id: str
    kind: str
    time: datetime
    detail: str
    gpu: int | None = None
    job_id: str | None = None
    rank: int | None = None

    @property
    def event_id(self) -> str:
        """The id of the event this observation came from (the idempotency key)."""
        return self.event.event_id


def observe(event: Event, subject: str) -> Observation | None:
    """The observation for a symptom event, None for an event the detector does not use; IngestError if unusable."""
    if not isinstance(event, GpuXid | GpuLost | RankExited | DependencyFailed):
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
        case DependencyFailed():
            detail = f"{event.dependency}: {event.detail}"
            job_id = _job_token(event.job_id) if event.job_id is not None else None
    return Observation(
        event=event, node_id=node_id, kind=event.type, time=event.time, detail=detail, gpu=gpu, job_id=job_id, rank=rank
    )


def derived(symptom: DerivedSymptom) -> Observation:
    """The observation for a symptom the detector derived itself (the node id is already trusted)."""
    match symptom:
        case NodeLost():
            return Observation(
                event=symptom,
                node_id=symptom.node_id,
                kind=symptom.type,
                time=symptom.time,
                detail=f"no report for {symptom.silent_s:.1f} s (limit {symptom.limit_s:g} s)",
            )
        case JobHung():
            detail = (
                f"no step progress for {symptom.stalled_s:.1f} s "
                f"(limit {symptom.limit_s:.1f} s, {symptom.limit_reason}); "
                f"stopped together: ranks {symptom.stalled_ranks}; lagging: ranks {symptom.lagging_ranks}; "
                f"blamed: rank {symptom.rank} ({symptom.culprit_reason})"
            )
            return Observation(
                event=symptom,
                node_id=symptom.node_id,
                kind=symptom.type,
                time=symptom.time,
                detail=detail,
                job_id=symptom.job_id,
                rank=symptom.rank,
            )
        case RankStraggling():
            detail = f"step time {symptom.step_time_s:.3f} s vs job median {symptom.median_s:.3f} s"
            return Observation(
                event=symptom,
                node_id=symptom.node_id,
                kind=symptom.type,
                time=symptom.time,
                detail=detail,
                job_id=symptom.job_id,
                rank=symptom.rank,
            )


def _job_token(job_id: str) -> str:
    try:
        return subjects.token(job_id)
    except ValueError as exc:
        raise IngestError(f"an unusable job id: {exc}") from exc
