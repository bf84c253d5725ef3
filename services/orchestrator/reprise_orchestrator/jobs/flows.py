"""Job side effects: submit (place and launch under the job's lock and a fresh fence), and completing finished jobs.

Cancelling a job preempts its recoveries, so it lives with them (recoveries/flows.py).
"""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.errors import ConflictError
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.allocation import AllocatingBackend
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import allocations, service
from reprise_orchestrator.jobs.launch import check_placement_fits, end_placement, start_job
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState
from reprise_orchestrator.jobs.placement import (
    assign_ranks,
    choose_nodes,
    container_fit,
    refuse_unrunnable_container,
)
from reprise_orchestrator.nodes import service as nodes_service

log = get_logger("reprise.orchestrator.jobs")
PLACEMENT_ATTEMPTS = 3  # a submission that loses its nodes to a concurrent one chooses again, this many times


async def submit(deps: Deps, spec: JobCreate) -> Job:
    """Place a new job and launch it; the job is RUNNING when every node confirmed, FAILED otherwise. A containerized
    job goes only to nodes whose agents run its container (ContainerRefusedError when none would). On a backend
    whose scheduler allocates the nodes (Slurm), the job's allocation is submitted and the job waits, PENDING, for it
    to run (jobs/allocations.py)."""
    if isinstance(deps.compute, AllocatingBackend):
        return await allocations.submit(deps, deps.compute, spec)
    with Session(deps.engine) as session:
        for _ in range(PLACEMENT_ATTEMPTS):
            unavailable = service.busy_nodes(session) | nodes_service.cordoned_ids(session)
            pool = deps.compute.pool(exclude=unavailable)
            fit = container_fit(spec, pool, deps.inventory)
            refuse_unrunnable_container(spec, pool, fit, deps.inventory)
            nodes = choose_nodes(spec, fit)
            ranks = assign_ranks(nodes, ranks_per_node=spec.ranks_per_node, inventory=deps.inventory)
            check_placement_fits(deps.bus, spec, ranks)
            job = service.create(session, spec=spec, placement=ranks, backend=deps.compute.name)
            earlier = service.placement_conflict(session, job)
            if earlier is None:
                break
            log.info("placed at the same moment as another job; choosing again", extra={"other_job": earlier})
            service.discard(session, job)  # never launched, no fence drawn: nothing else knows it
        else:
            raise ConflictError(f"the job's nodes were taken by other submissions {PLACEMENT_ATTEMPTS} times in a row")
        job_id = job.id
    await start_job(deps, job_id=job_id, spec=spec, ranks=ranks)
    with Session(deps.engine) as session:
        return service.get(session, job_id=job_id)


def finished_ranks(deps: Deps, job: Job) -> bool:
    """True when every rank of the job's current launch reported that it exited 0."""
    statuses = deps.inventory.ranks_of(job.id, restart_epoch=job.restart_epoch)
    wanted = {r.rank for r in job.placement}
    return bool(wanted) and all(
        rank in statuses and not statuses[rank].alive and statuses[rank].exit_code == 0 for rank in wanted
    )


def _all_seen_exited_zero(deps: Deps, job_id: str, epoch: int) -> bool:
    statuses = deps.inventory.ranks_of(job_id, restart_epoch=epoch).values()
    return bool(statuses) and all(not s.alive and s.exit_code == 0 for s in statuses)


async def complete_finished(deps: Deps) -> list[str]:
    """Mark running jobs whose ranks all exited 0 completed (under the job's lock and a new fence); their ids.

    A job being recovered is RECOVERING (set with the recovery's claim, under the same lock), so a job still RUNNING
    once the lock is ours has no recovery that could be relaunching it.
    """
    with Session(deps.engine) as session:
        # Every second: only a job whose ranks seen so far all exited 0 is loaded whole (thousands of ranks at scale).
        running = service.get_all_epochs(session, state=JobState.RUNNING)
        ids = [job_id for job_id, epoch in running if _all_seen_exited_zero(deps, job_id, epoch)]
        candidates = [service.get(session, job_id=job_id) for job_id in ids]
    done = []
    for job in candidates:
        if not finished_ranks(deps, job):
            continue
        handle = await deps.locks.acquire(job.id, owner=deps.settings.replica_id)
        if handle is None:
            continue  # a recovery (or another replica) holds it: look again next time
        try:
            with Session(deps.engine) as session:
                if service.get(session, job_id=job.id).state is not JobState.RUNNING:
                    continue
                if not service.claim_fence(session, job_id=job.id, fence=handle.fence):
                    continue
                service.update_fenced(session, job_id=job.id, fence=handle.fence, state=JobState.COMPLETED)
            operation = f"{job.id}:complete:{handle.fence}"
            await deps.compute.stop(job.id, job.nodes(), operation_id=operation, fence=handle.fence)
            await end_placement(deps, job, operation_id=operation, fence=handle.fence)
            log.info("job completed", extra={"job_id": job.id})
            done.append(job.id)
        finally:
            await deps.locks.release(handle)
    return done
