"""Data access for checkpoints: keyword-only functions, one per question."""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from reprise_common.errors import NotFoundError
from reprise_registry.models import Checkpoint, CheckpointCreate, CheckpointState


def create(session: Session, *, data: CheckpointCreate) -> Checkpoint:
    """Begin a checkpoint (state: writing)."""
    checkpoint = Checkpoint.model_validate(data)
    session.add(checkpoint)
    session.commit()
    session.refresh(checkpoint)
    return checkpoint


def get(session: Session, *, checkpoint_id: int) -> Checkpoint:
    """One checkpoint, or NotFoundError."""
    checkpoint = session.get(Checkpoint, checkpoint_id)
    if checkpoint is None:
        raise NotFoundError(f"checkpoint {checkpoint_id} not found")
    return checkpoint


def get_all_by_job(session: Session, *, job_id: str, limit: int = 100) -> Sequence[Checkpoint]:
    """A job's checkpoints, newest step first."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(col(Checkpoint.step).desc()).limit(limit)
    return session.exec(query).all()


def latest_validated(session: Session, *, job_id: str, before_step: int | None = None) -> Checkpoint:
    """The newest validated checkpoint of a job (older than before_step when given), or NotFoundError."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.state == CheckpointState.VALIDATED)
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    found = session.exec(query.order_by(col(Checkpoint.step).desc()).limit(1)).first()
    if found is None:
        raise NotFoundError(f"no validated checkpoint for job {job_id}")
    return found
