"""REST routes for a job's recoveries, and for cancelling a job (which preempts its recoveries)."""

from __future__ import annotations

from fastapi import APIRouter

from reprise_orchestrator.deps import DepsDep, SessionDep
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import JobPublic
from reprise_orchestrator.recoveries import flows, service
from reprise_orchestrator.recoveries.models import RecoveriesPublic, RecoveryPublic

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("/{job_id}/cancel", response_model=JobPublic)
async def cancel_job(job_id: str, deps: DepsDep) -> JobPublic:
    """Cancel a job: any running recovery stands down, its ranks are stopped; idempotent."""
    return JobPublic.model_validate(await flows.cancel(deps, job_id), from_attributes=True)


@router.get("/{job_id}/recoveries", response_model=RecoveriesPublic)
def job_recoveries(job_id: str, session: SessionDep) -> RecoveriesPublic:
    """A job's recoveries with every step's start, end and typed result."""
    jobs.get(session, job_id=job_id)
    found = service.get_all_by_job(session, job_id=job_id)
    steps = service.records_as_read(session, found)
    data = [RecoveryPublic.model_validate(r.model_dump() | {"steps": steps.get(r.id, [])}) for r in found]
    return RecoveriesPublic(data=data, count=len(data))
