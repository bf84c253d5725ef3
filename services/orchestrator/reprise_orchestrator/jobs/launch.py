"""Launching a job's ranks with a fresh rendezvous: publish the placement, then a fenced launch to every node; and
starting a pending job's first epoch under its lock."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError, ConflictError
from reprise_common.events import JobPlacement, LaunchArgs, LaunchReply, RankAssignment, StepSpan
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.backend import Answers, ComputeBackend, LaunchRequest
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState
from reprise_orchestrator.registry_client import RestorePoint

log = get_logger("reprise.orchestrator.jobs")
PORT_SPAN = 1000  # rendezvous ports are master_port_base .. master_port_base + PORT_SPAN - 1
PLACEMENT_HEADROOM_BYTES = 4096  # what the size check cannot know yet: the job id, the message id header


@dataclass(frozen=True)
class Rendezvous:
    """One restart epoch's rendezvous."""

    restart_epoch: int
    master_addr: str
    master_port: int


def master_port_for(base: int, *, job_id: str, epoch: int, taken: set[int]) -> int:
    """The job's port for an epoch: spread by job id, another one each epoch (a half-dead earlier group can never
    join the new one), and none that another active job's master on the same host holds."""
    start = zlib.crc32(job_id.encode()) + epoch
    for offset in range(PORT_SPAN):
        port = base + (start + offset) % PORT_SPAN
        if port not in taken:
            return port
    raise ConflictError(f"every rendezvous port from {base} to {base + PORT_SPAN - 1} is taken on this host")


def rendezvous_for(
    ranks: list[RankAssignment], *, job_id: str, epoch: int, inventory: Inventory, port_base: int, engine: Engine
) -> Rendezvous:
    """Rank 0's node hosts the rendezvous, on a port of this job and epoch that is free among the host's jobs.

    The job's own current port counts as taken, so a relaunch never reuses it; a resumed launch step computes the
    same port again (nothing it depends on changed)."""
    master = next(r for r in ranks if r.rank == 0)
    address = inventory.address(master.node_id)
    with Session(engine) as session:
        taken = service.master_ports_at(session, address=address)
    return Rendezvous(epoch, address, master_port_for(port_base, job_id=job_id, epoch=epoch, taken=taken))


def placement_event(job_id: str, spec: JobCreate, ranks: list[RankAssignment], *, restart_epoch: int) -> JobPlacement:
    """The placement a launch announces: every rank of the job, in one message."""
    return JobPlacement(
        source="orchestrator",
        job_id=job_id,
        restart_epoch=restart_epoch,
        world_size=len(ranks),
        ranks=ranks,
        hang_timeout_s=spec.policy.hang_timeout_s,
        labels=spec.labels,
    )


def check_placement_fits(bus: Bus, spec: JobCreate, ranks: list[RankAssignment]) -> None:
    """Refuse (ConflictError) a placement larger than NATS accepts: it could never be announced, so never launched."""
    size = len(placement_event("", spec, ranks, restart_epoch=0).to_bytes()) + PLACEMENT_HEADROOM_BYTES
    if size > bus.max_payload:
        raise ConflictError(
            f"the job's placement ({len(ranks)} ranks) needs a {size:,}-byte message, over the NATS server's "
            f"max_payload of {bus.max_payload:,} bytes: run fewer ranks or raise max_payload (deploy/nats/nats.conf)"
        )


async def launch(
    bus: Bus,
    backend: ComputeBackend,
    *,
    operation_id: str,
    job_id: str,
    fence: int,
    spec: JobCreate,
    ranks: list[RankAssignment],
    rendezvous: Rendezvous,
    restore: RestorePoint | None,
    skip_steps: StepSpan | None = None,
) -> Answers[LaunchReply]:
    """Publish the placement for the detector, then have the backend launch every rank; each node's answer."""
    placement = placement_event(job_id, spec, ranks, restart_epoch=rendezvous.restart_epoch)
    await bus.publish(subjects.placement(job_id), placement, msg_id=f"{operation_id}:placement")
    args = LaunchArgs(
        restart_epoch=rendezvous.restart_epoch,
        world_size=len(ranks),
        master_addr=rendezvous.master_addr,
        master_port=rendezvous.master_port,
        command=spec.command,
        env=spec.env,
        cwd=spec.working_dir,
        resume_checkpoint=restore.path if restore else None,
        resume_files=list(restore.files or ()) if restore else [],
        ranks=ranks,
        numeric=spec.policy.numeric.watch() if spec.policy.numeric else None,
        skip_steps=skip_steps,
        checkpoints=spec.checkpoints.watch() if spec.checkpoints else None,
        container=spec.container,
    )
    return await backend.launch(LaunchRequest(job_id=job_id, args=args), operation_id=operation_id, fence=fence)


async def start_job(deps: Deps, *, job_id: str, spec: JobCreate, ranks: list[RankAssignment]) -> None:
    """Launch a pending job's first epoch on `ranks` under its lock and a fresh fence; the job is RUNNING when every
    node confirmed, FAILED otherwise. ConflictError when another replica holds the job."""
    handle = await deps.locks.acquire(job_id, owner=deps.settings.replica_id)
    if handle is None:
        raise ConflictError(f"job {job_id} is locked by another replica")
    try:
        with Session(deps.engine) as session:
            if not service.claim_fence(session, job_id=job_id, fence=handle.fence, placement=ranks):
                raise ConflictError(f"job {job_id}: a newer fencing token already owns it")
        rendezvous = rendezvous_for(
            ranks,
            job_id=job_id,
            epoch=0,
            inventory=deps.inventory,
            port_base=deps.settings.master_port_base,
            engine=deps.engine,
        )
        answers = await launch(
            deps.bus,
            deps.compute,
            operation_id=f"{job_id}:submit",
            job_id=job_id,
            fence=handle.fence,
            spec=spec,
            ranks=ranks,
            rendezvous=rendezvous,
            restore=None,
        )
        state = JobState.RUNNING if answers.all_done else JobState.FAILED
        record = answers.record()
        with Session(deps.engine) as session:
            service.update_fenced(
                session,
                job_id=job_id,
                fence=handle.fence,
                state=state,
                detail="" if answers.all_done else f"the first launch was not done: {record.why_not_done()}",
                master_port=rendezvous.master_port,
                master_addr=rendezvous.master_addr,
            )
        if state is JobState.FAILED:
            log.error("job launch failed", extra={"job_id": job_id, "answers": record.model_dump()})
            with Session(deps.engine) as session:
                job = service.get(session, job_id=job_id)
            await end_placement(deps, job, operation_id=f"{job_id}:submit:failed", fence=handle.fence)
    finally:
        await deps.locks.release(handle)


async def end_placement(deps: Deps, job: Job, *, operation_id: str, fence: int) -> None:
    """The job runs nowhere now (completed, failed, held, cancelled, its allocation gone): tell the detector, which
    stops expecting progress from it, and, for a containerized job, the spares, which drop its standby containers."""
    event = JobPlacement(
        source="orchestrator",
        job_id=job.id,
        restart_epoch=job.restart_epoch,
        world_size=0,
        active=False,
        labels=job.labels,
    )
    try:
        await deps.bus.publish(subjects.placement(job.id), event, msg_id=operation_id)
    except BusError as exc:
        log.warning("could not publish the end of a placement", extra={"job_id": job.id, "error": str(exc)})
    if job.job_spec().container is not None:
        await deps.compute.drop_standbys(job.id, operation_id=operation_id, fence=fence)
