"""REST routes of the checkpoint registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_registry import service
from reprise_registry.models import CheckpointCreate, CheckpointPublic, CheckpointsPublic


def _session(request: Request) -> Iterator[Session]:
    engine: Engine = request.app.state.engine
    with Session(engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(_session)]
router = APIRouter(prefix="/v1", tags=["checkpoints"])


@router.post("/checkpoints", status_code=201, response_model=CheckpointPublic)
def begin_checkpoint(body: CheckpointCreate, session: SessionDep) -> CheckpointPublic:
    """Begin recording a checkpoint; it is restorable only once validated."""
    return CheckpointPublic.model_validate(service.create(session, data=body), from_attributes=True)


@router.get("/checkpoints/{checkpoint_id}", response_model=CheckpointPublic)
def get_checkpoint(checkpoint_id: int, session: SessionDep) -> CheckpointPublic:
    """One checkpoint."""
    return CheckpointPublic.model_validate(service.get(session, checkpoint_id=checkpoint_id), from_attributes=True)


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(
    job_id: str, session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> CheckpointsPublic:
    """A job's checkpoints, newest first."""
    rows = service.get_all_by_job(session, job_id=job_id, limit=limit)
    data = [CheckpointPublic.model_validate(row, from_attributes=True) for row in rows]
    return CheckpointsPublic(data=data, count=len(data))


@router.get("/jobs/{job_id}/checkpoints/latest", response_model=CheckpointPublic)
def latest_checkpoint(
    job_id: str, session: SessionDep, before_step: Annotated[int | None, Query(ge=0)] = None
) -> CheckpointPublic:
    """The newest validated checkpoint (404 when there is none); before_step asks for an older fallback."""
    found = service.latest_validated(session, job_id=job_id, before_step=before_step)
    return CheckpointPublic.model_validate(found, from_attributes=True)
