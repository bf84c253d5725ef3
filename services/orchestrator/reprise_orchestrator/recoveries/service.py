"""Data access for recoveries; every write is fenced against the job's highest fencing token."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlmodel import Session, col, select

from reprise_common.errors import RepriseError
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.recoveries.models import TERMINAL_STEPS, Outcome, Recovery, RecoveryStep


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


def get_all_active_ids(session: Session) -> list[tuple[str, str]]:
    """(recovery id, job id) of every recovery that has not ended (what the reconciler looks at)."""
    query = select(Recovery.id, Recovery.job_id).where(col(Recovery.step).not_in(list(TERMINAL_STEPS)))
    return [(recovery_id, job_id) for recovery_id, job_id in session.exec(query).all()]


def knows_incident(session: Session, *, job_id: str, incident_id: str) -> bool:
    """True when a recovery of the job was started by, or has attached, this incident."""
    # Only the incident columns: a recovery's steps hold its placement, thousands of ranks at scale.
    query = select(Recovery.incident_id, Recovery.attached_incidents).where(Recovery.job_id == job_id)
    return any(started == incident_id or incident_id in attached for started, attached in session.exec(query).all())


def covering(session: Session, *, job_id: str, symptom_at: datetime) -> Recovery | None:
    """The latest recovery that already stopped the ranks a symptom at `symptom_at` came from, if any.

    A symptom older than a recovery's relaunch is about processes that recovery replaced: it is not a new fault.
    Recoveries are read one at a time, newest first, and usually only the newest is: each holds its step data, which
    is large for a job of thousands of ranks, and a long job has many.
    """
    newest_first = select(Recovery.id).where(Recovery.job_id == job_id).order_by(col(Recovery.started_at).desc())
    for recovery_id in session.exec(newest_first).all():
        recovery = session.get_one(Recovery, recovery_id)
        relaunched = next((s["started_at"] for s in recovery.steps if s["step"] == RecoveryStep.LAUNCHING), None)
        if relaunched is not None and symptom_at < datetime.fromisoformat(relaunched):
            return recovery
        if relaunched is not None:
            return None  # the newest relaunch is older than the symptom: it is a new fault
    return None


def attach(session: Session, *, recovery: Recovery, incident_id: str) -> None:
    """Attach a duplicate incident to a running recovery."""
    recovery.attached_incidents = [*recovery.attached_incidents, incident_id]
    session.add(recovery)
    session.commit()


def _check_fence(session: Session, *, job_id: str, fence: int) -> None:
    # Only the fence column: the job's row holds its placement, thousands of ranks at scale.
    highest = session.exec(select(Job.max_fence).where(Job.id == job_id).with_for_update()).one()
    if highest != fence:
        raise FencedOutError(f"job {job_id} is owned by fence {highest}, not {fence}")


def create(session: Session, *, recovery: Recovery) -> Recovery:
    """Insert a recovery claimed under its fence."""
    _check_fence(session, job_id=recovery.job_id, fence=recovery.fence)
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery


def take_over(session: Session, *, recovery_id: str, fence: int, owner: str) -> Recovery:
    """Make the holder of `fence` (already claimed on the job) the recovery's owner."""
    recovery = _get(session, recovery_id)
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    recovery.fence, recovery.owner = fence, owner
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery


def _get(session: Session, recovery_id: str) -> Recovery:
    recovery = session.get(Recovery, recovery_id)
    if recovery is None:
        raise RepriseError(f"recovery {recovery_id} vanished")
    return recovery


def record_step(
    session: Session,
    *,
    recovery_id: str,
    fence: int,
    step: RecoveryStep,
    started_at: datetime,
    ended_at: datetime | None,
    attempt: int,
    data: dict[str, Any] | None = None,
    detail: str | None = None,
    finished_at: datetime | None = None,
    outcome: Outcome | None = None,
) -> None:
    """Start or finish a step (same step and attempt twice updates its end); FencedOutError if fenced out."""
    recovery = _get(session, recovery_id)
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    entry = {
        "step": step.value,
        "attempt": attempt,
        "started_at": started_at.isoformat(),
        "ended_at": ended_at.isoformat() if ended_at else None,
        "data": data or {},
    }
    steps = list(recovery.steps)
    if steps and steps[-1]["step"] == step.value and steps[-1].get("attempt", 1) == attempt:
        steps[-1] = entry
    else:
        steps.append(entry)
    recovery.steps = steps
    recovery.step = step
    recovery.attempt = attempt
    if outcome is not None:
        recovery.outcome = outcome
    if detail is not None:
        recovery.detail = detail
    if finished_at is not None:
        recovery.finished_at = finished_at
    session.add(recovery)
    session.commit()
