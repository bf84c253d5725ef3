"""REST routes for drills."""

from __future__ import annotations

from fastapi import APIRouter, Request

from reprise_orchestrator.deps import SessionDep
from reprise_orchestrator.drills import service
from reprise_orchestrator.drills.flows import DrillRunner
from reprise_orchestrator.drills.models import DrillCreate, DrillPublic, DrillsPublic
from reprise_orchestrator.jobs import service as jobs

router = APIRouter(prefix="/v1", tags=["drills"])


@router.post("/jobs/{job_id}/drills", status_code=202, response_model=DrillPublic)
async def start_drill(job_id: str, body: DrillCreate, request: Request) -> DrillPublic:
    """Inject a fault into a running job; the drill's record fills in as the recovery proceeds."""
    runner: DrillRunner = request.app.state.drills
    return DrillPublic.model_validate(await runner.start(job_id, body), from_attributes=True)


@router.get("/jobs/{job_id}/drills", response_model=DrillsPublic)
def list_drills(job_id: str, session: SessionDep) -> DrillsPublic:
    """A job's drills, newest first, with what each measured."""
    jobs.get(session, job_id=job_id)
    data = [DrillPublic.model_validate(d, from_attributes=True) for d in service.get_all_by_job(session, job_id=job_id)]
    return DrillsPublic(data=data, count=len(data))


@router.get("/drills/{drill_id}", response_model=DrillPublic)
def get_drill(drill_id: str, session: SessionDep) -> DrillPublic:
    """One drill."""
    return DrillPublic.model_validate(service.get(session, drill_id=drill_id), from_attributes=True)
