"""Job side effects: submit (place and launch under the job's lock and a fresh fence)."""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.errors import ConflictError
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.launch import launch, rendezvous_for
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState
from reprise_orchestrator.jobs.placement import assign_ranks, choose_nodes

log = get_logger("reprise.orchestrator.jobs")


async def submit(deps: Deps, spec: JobCreate) -> Job:
    """Place a new job and launch it; the job is RUNNING when every node confirmed, FAILED otherwise."""
    nodes = choose_nodes(spec, deps.inventory)
    ranks = assign_ranks(nodes, ranks_per_node=spec.ranks_per_node, inventory=deps.inventory)
    with Session(deps.engine) as session:
        job = service.create(session, spec=spec)
        job_id = job.id
    handle = await deps.locks.acquire(job_id, owner=deps.settings.replica_id)
    if handle is None:
        raise ConflictError(f"job {job_id} is locked by another replica")
    try:
        with Session(deps.engine) as session:
            if not service.claim_fence(session, job_id=job_id, fence=handle.fence):
                raise ConflictError(f"job {job_id}: a newer fencing token already owns it")
        rendezvous = rendezvous_for(ranks, epoch=0, inventory=deps.inventory, port_base=deps.settings.master_port_base)
        answers = await launch(
            deps.bus,
            operation_id=f"{job_id}:submit",
            job_id=job_id,
            fence=handle.fence,
            spec=spec,
            ranks=ranks,
            rendezvous=rendezvous,
            restore=None,
            timeout_s=deps.settings.command_timeout_s,
        )
        state = JobState.RUNNING if all(a.ok for a in answers) else JobState.FAILED
        placement = [r.model_dump(mode="json") for r in ranks]
        with Session(deps.engine) as session:
            service.update_fenced(
                session,
                job_id=job_id,
                fence=handle.fence,
                state=state,
                placement=placement,
                master_port=rendezvous.master_port,
            )
        if state is JobState.FAILED:
            log.error("job launch failed", extra={"job_id": job_id, "answers": [a.summary() for a in answers]})
    finally:
        await deps.locks.release(handle)
    with Session(deps.engine) as session:
        return service.get(session, job_id=job_id)
