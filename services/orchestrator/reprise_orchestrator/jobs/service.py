"""Data access for jobs: keyword-only functions; writes that follow a recovery are fenced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import update
from sqlalchemy.engine import CursorResult
from sqlmodel import Session, col, select

from reprise_common.clock import utcnow
from reprise_common.errors import NotFoundError
from reprise_common.events import new_id
from reprise_orchestrator.jobs.models import ACTIVE_STATES, Job, JobCreate, JobState


def create(session: Session, *, spec: JobCreate, placement: list[dict[str, Any]]) -> Job:
    """Record a new job with its planned placement (pending until launched)."""
    job = Job(
        id=f"job-{new_id()[:12]}",
        name=spec.name,
        ranks_per_node=spec.ranks_per_node,
        working_dir=spec.working_dir,
        checkpoint_dir=spec.checkpoint_dir,
        spec=spec.model_dump(mode="json"),
        placement=placement,
    )
    session.add(job)
    session.commit()
    session.refresh(job)
    return job


def get(session: Session, *, job_id: str) -> Job:
    """One job, or NotFoundError."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"job {job_id} not found")
    return job


def get_all(session: Session, *, state: JobState | None = None, limit: int = 100) -> Sequence[Job]:
    """Jobs, newest first."""
    query = select(Job).order_by(col(Job.created_at).desc()).limit(limit)
    if state is not None:
        query = query.where(Job.state == state)
    return session.exec(query).all()


def claim_fence(session: Session, *, job_id: str, fence: int) -> bool:
    """Compare-and-set: record `fence` as the job's highest only if it is higher than any before it."""
    statement = update(Job).where(col(Job.id) == job_id, col(Job.max_fence) < fence).values(max_fence=fence)
    result = session.execute(statement)
    session.commit()
    return cast("CursorResult[Any]", result).rowcount == 1


def update_fenced(session: Session, *, job_id: str, fence: int, **values: Any) -> bool:
    """Update a job only while `fence` is still its highest; False means a newer owner took over."""
    statement = (
        update(Job).where(col(Job.id) == job_id, col(Job.max_fence) == fence).values(**values, updated_at=utcnow())
    )
    result = session.execute(statement)
    session.commit()
    return cast("CursorResult[Any]", result).rowcount == 1


def busy_nodes(session: Session, *, except_job: str | None = None) -> set[str]:
    """Nodes that active jobs (other than `except_job`) run on."""
    query = select(Job).where(col(Job.state).in_(list(ACTIVE_STATES | {JobState.PENDING})))
    return {rank["node_id"] for job in session.exec(query).all() if job.id != except_job for rank in job.placement}
