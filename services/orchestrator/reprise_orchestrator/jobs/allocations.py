"""Jobs on a backend whose scheduler allocates the nodes (Slurm): submit an allocation, start the job when it runs.

A new job is recorded PENDING and its allocation submitted (its nodes plus its spares; compute/allocation.py). The
allocation reconciler then, every pass (and at once when a replica starts, so a restart catches up), starts a pending
job whose allocation runs, once the agents on its worker nodes report: the job's nodes are the allocation's workers
(Slurm's order), its spares the allocation's other nodes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sqlmodel import Session

from reprise_common.errors import ConflictError, DependencyUnavailableError, RepriseError
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.allocation import AllocatingBackend, Allocation, AllocationRequest, AllocationState
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.launch import check_placement_fits, start_job
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState, SlurmSpec
from reprise_orchestrator.jobs.placement import assign_ranks
from reprise_orchestrator.nodes import service as nodes_service

log = get_logger("reprise.orchestrator.jobs")
LONGEST_NODE = "n" * 64  # the longest node name the placement can hold (IdStr)


async def submit(deps: Deps, backend: AllocatingBackend, spec: JobCreate) -> Job:
    """Record the job PENDING and submit its allocation; a submission Slurm refuses (or never answers) fails the job
    with the reason and is raised (a 409, or a 503 naming the controller)."""
    if spec.nodes is not None:
        raise ConflictError(f"the {backend.name} backend allocates the nodes: give node_count, not a list of nodes")
    assert spec.node_count is not None
    longest = assign_ranks(
        [LONGEST_NODE] * spec.node_count, ranks_per_node=spec.ranks_per_node, inventory=deps.inventory
    )
    check_placement_fits(deps.bus, spec, longest)  # refused now, not once the allocation runs
    slurm = spec.slurm or SlurmSpec()
    with Session(deps.engine) as session:
        job = service.create(session, spec=spec, placement=[], backend=backend.name)
    request = AllocationRequest(
        job_id=job.id,
        workers=spec.node_count,
        spares=slurm.spares,
        partition=slurm.partition,
        account=slurm.account,
        time_limit_min=slurm.time_limit_min,
        extra_args=tuple(slurm.extra_args),
        output=slurm.output,
    )
    try:
        await backend.allocate(request)
    except RepriseError as exc:
        with Session(deps.engine) as session:  # fence 0: nothing has claimed the job yet
            service.update_fenced(
                session, job_id=job.id, fence=0, state=JobState.FAILED, detail=f"not allocated: {exc}"
            )
        if isinstance(exc, DependencyUnavailableError):
            raise
        raise ConflictError(f"job {job.id}: {backend.name} refused its allocation: {exc}") from exc
    with Session(deps.engine) as session:
        return service.get(session, job_id=job.id)


@dataclass
class Reconciled:
    """What one pass did, by platform job id."""

    started: list[str] = field(default_factory=list)


class AllocationReconciler:
    """Compares the platform's pending jobs on an allocating backend with the scheduler's allocations and starts
    those whose allocation runs; one pass at start, then one every `interval_s`."""

    def __init__(self, deps: Deps, backend: AllocatingBackend, *, interval_s: float) -> None:
        self.deps = deps
        self.backend = backend
        self.interval_s = interval_s
        self._failing: str | None = None

    async def run(self) -> None:
        """Reconcile until cancelled; a pass that fails is logged when failures start and end."""
        while True:
            try:
                await self.reconcile()
            except RepriseError as exc:
                if self._failing is None:
                    log.warning("allocations not reconciled", extra={"error": str(exc)})
                self._failing = str(exc)
            else:
                if self._failing is not None:
                    log.info("allocations reconciled again", extra={"after": self._failing})
                self._failing = None
            await asyncio.sleep(self.interval_s)

    async def reconcile(self) -> Reconciled:
        """One pass over the scheduler's allocations and the platform's jobs of this backend."""
        allocations = await self.backend.allocations()
        done = Reconciled()
        with Session(self.deps.engine) as session:
            pending = service.get_all_by_backend(session, backend=self.backend.name, states=[JobState.PENDING])
        for job in pending:
            allocation = allocations.get(job.id)
            runs = allocation is not None and allocation.state is AllocationState.RUNNING
            if runs and allocation is not None and await self._start(job, allocation):
                done.started.append(job.id)
        return done

    async def _start(self, job: Job, allocation: Allocation) -> bool:
        """Place the job on its allocation's workers once their agents report, and launch it; False while waiting."""
        spec = job.job_spec()
        assert spec.node_count is not None
        with Session(self.deps.engine) as session:
            cordoned = nodes_service.cordoned_ids(session)
        workers = set(self.deps.compute.pool(exclude=cordoned).workers)
        ready = [node for node in allocation.nodes if node in workers][: spec.node_count]
        if len(ready) < spec.node_count:
            return False  # the agents are starting (or a worker's agent is unhealthy): look again next pass
        ranks = assign_ranks(ready, ranks_per_node=spec.ranks_per_node, inventory=self.deps.inventory)
        try:
            await start_job(self.deps, job_id=job.id, spec=spec, ranks=ranks)
        except ConflictError as exc:  # another replica starts it
            log.info("allocated job not started here", extra={"job_id": job.id, "error": str(exc)})
            return False
        log.info("allocated job started", extra={"job_id": job.id, "nodes": ready, "allocation": allocation.nodes})
        return True
