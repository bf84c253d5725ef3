"""REST routes for jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import AfterValidator

from reprise_common.labels import check_selector, parse_selector
from reprise_orchestrator.deps import DepsDep, SessionDep
from reprise_orchestrator.jobs import flows, service
from reprise_orchestrator.jobs.models import JobCreate, JobPublic, JobsPublic, JobState

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
