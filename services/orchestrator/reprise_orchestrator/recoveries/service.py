"""Data access for recoveries; every write is fenced against the job's highest fencing token."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from reprise_common.errors import RepriseError
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.recoveries.models import TERMINAL_STEPS, Recovery, RecoveryStep


class FencedOutError(RepriseError):
    """A newer fencing token owns the job: this writer must stand down."""


def get_all_by_job(session: Session, *, job_id: str) -> Sequence[Recovery]:
    """A job's recoveries, newest first."""
    query = select(Recovery).where(Recovery.job_id == job_id).order_by(col(Recovery.started_at).desc())
    return session.exec(query).all()


def find_active(session: Session, *, job_id: str) -> Recovery | None:
    """The recovery of a job that has not ended, if any."""
    query = select(Recovery).where(Recovery.job_id == job_id, col(Recovery.step).not_in(list(TERMINAL_STEPS)))
    return session.exec(query).first()


def knows_incident(session: Session, *, job_id: str, incident_id: str) -> bool:
    """True when a recovery of the job was started by, or has attached, this incident."""
    return any(
        r.incident_id == incident_id or incident_id in r.attached_incidents
        for r in get_all_by_job(session, job_id=job_id)
    )


def attach(session: Session, *, recovery: Recovery, incident_id: str) -> None:
    """Attach a duplicate incident to a running recovery."""
    recovery.attached_incidents = [*recovery.attached_incidents, incident_id]
    session.add(recovery)
    session.commit()


def _check_fence(session: Session, *, job_id: str, fence: int) -> Job:
    job = session.exec(select(Job).where(Job.id == job_id).with_for_update()).one()
    if job.max_fence != fence:
        raise FencedOutError(f"job {job_id} is owned by fence {job.max_fence}, not {fence}")
    return job


def create(session: Session, *, recovery: Recovery) -> Recovery:
    """Insert a recovery claimed under its fence."""
    _check_fence(session, job_id=recovery.job_id, fence=recovery.fence)
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery


def record_step(
    session: Session,
    *,
    recovery_id: str,
    fence: int,
    step: RecoveryStep,
    started_at: datetime,
    ended_at: datetime | None,
    data: dict[str, Any] | None = None,
    detail: str | None = None,
    finished_at: datetime | None = None,
) -> Recovery:
    """Start or finish a step (same step twice updates its end); refused with FencedOutError if fenced out."""
    recovery = session.get(Recovery, recovery_id)
    if recovery is None:
        raise RepriseError(f"recovery {recovery_id} vanished")
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    entry = {
        "step": step.value,
        "started_at": started_at.isoformat(),
        "ended_at": ended_at.isoformat() if ended_at else None,
        "data": data or {},
    }
    steps = list(recovery.steps)
    if steps and steps[-1]["step"] == step.value:
        steps[-1] = entry
    else:
        steps.append(entry)
    recovery.steps = steps
    recovery.step = step
    if detail is not None:
        recovery.detail = detail
    if finished_at is not None:
        recovery.finished_at = finished_at
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery
