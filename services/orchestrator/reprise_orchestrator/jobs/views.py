"""REST routes for jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import AfterValidator

from reprise_common.labels import check_selector, parse_selector
from reprise_orchestrator.deps import DepsDep, SessionDep
from reprise_orchestrator.jobs import flows, service
from reprise_orchestrator.jobs.models import JobCreate, JobPublic, JobsPublic, JobState
from reprise_orchestrator.recoveries import service as recoveries
from reprise_orchestrator.recoveries.models import RecoveriesPublic, RecoveryPublic

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
LabelSelector = Annotated[str, AfterValidator(check_selector)]


def _public(job: object) -> JobPublic:
    return JobPublic.model_validate(job, from_attributes=True)


@router.post("", status_code=201, response_model=JobPublic)
async def submit_job(body: JobCreate, deps: DepsDep) -> JobPublic:
    """Register a job, place its ranks and launch them."""
    return _public(await flows.submit(deps, body))


@router.get("", response_model=JobsPublic)
def list_jobs(
    session: SessionDep,
    state: JobState | None = None,
    label: Annotated[
        list[LabelSelector] | None, Query(description="key=value; repeated, a job must carry every label given")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JobsPublic:
    """Jobs, newest first, optionally by state and by labels."""
    labels = [parse_selector(selector) for selector in label or []]
    data = [_public(job) for job in service.get_all(session, state=state, labels=labels, limit=limit)]
    return JobsPublic(data=data, count=len(data))


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: str, session: SessionDep) -> JobPublic:
    """One job."""
    return _public(service.get(session, job_id=job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
async def cancel_job(job_id: str, deps: DepsDep) -> JobPublic:
    """Cancel a job: any running recovery stands down, its ranks are stopped; idempotent."""
    return _public(await flows.cancel(deps, job_id))


@router.get("/{job_id}/recoveries", response_model=RecoveriesPublic)
def job_recoveries(job_id: str, session: SessionDep) -> RecoveriesPublic:
    """A job's recoveries with every step's start and end."""
    service.get(session, job_id=job_id)
    data = [
        RecoveryPublic.model_validate(r, from_attributes=True)
        for r in recoveries.get_all_by_job(session, job_id=job_id)
    ]
    return RecoveriesPublic(data=data, count=len(data))
