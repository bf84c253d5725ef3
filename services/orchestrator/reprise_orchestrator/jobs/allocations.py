"""Jobs on a backend whose scheduler allocates the nodes (Slurm): submit an allocation, start the job when it runs, and
keep the platform's jobs and the scheduler's in step.

A new job is recorded PENDING and its allocation submitted (its nodes plus its spares; compute/allocation.py). The
allocation reconciler then, every pass (and at once when a replica starts, so a restart catches up):

- starts a pending job whose allocation runs, once the agents on its worker nodes report: the job's nodes are the
  allocation's workers (Slurm's order), its spares the allocation's other nodes; a job whose workers' agents have not
  reported `agent_start_timeout_s` after this replica first saw its allocation run fails, naming the silent nodes,
  and its allocation is then ended (an agent that cannot start is not waited for forever);
- fails a job whose allocation is gone (ended, or no longer known) while the platform still runs or awaits it;
- ends (scancel) an allocation whose platform job is over (completed, failed, cancelled);
- requeues the allocation of a job whose recovery is placing and has no spare left and cannot shrink, without the
  nodes drained or cordoned: the recovery's placement goes on when the new allocation's agents report.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from sqlmodel import Session

from reprise_common.errors import ConflictError, DependencyUnavailableError, RepriseError
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.allocation import AllocatingBackend, Allocation, AllocationRequest, AllocationState
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.launch import check_placement_fits, end_placement, start_job
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState, SlurmSpec
from reprise_orchestrator.jobs.placement import PlacementDecision, assign_ranks, replacements, replan
from reprise_orchestrator.nodes import service as nodes_service

log = get_logger("reprise.orchestrator.jobs")
WAITING_STATES = (JobState.PENDING, JobState.RUNNING, JobState.RECOVERING, JobState.HELD)
LONGEST_NODE = "n" * 64  # the longest node name the placement can hold (IdStr)
OVER_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


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
    section = spec.allocation_section(backend.name)
    slurm = section if isinstance(section, SlurmSpec) else SlurmSpec()
    with Session(deps.engine) as session:
        job = service.create(session, spec=spec, placement=[], backend=backend.name)
    request = AllocationRequest(
        job_id=job.id,
        workers=spec.node_count,
        spares=section.spares if section is not None else SlurmSpec().spares,
        partition=slurm.partition,
        account=slurm.account,
        time_limit_min=slurm.time_limit_min,
        extra_args=tuple(slurm.extra_args),
        output=slurm.output,
        section=section,
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


class RecoveryPlacing(Protocol):
    """Whether a job has an unfinished recovery at its placing step (recoveries' `is_placing`, given by the app:
    recoveries sit above jobs)."""

    def __call__(self, session: Session, *, job_id: str) -> bool: ...


@dataclass
class Reconciled:
    """What one pass did, by platform job id."""

    started: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


class AllocationReconciler:
    """Compares the platform's jobs on an allocating backend with the scheduler's allocations, and acts on each
    difference (see the module's docstring); one pass at start, then one every `interval_s`."""

    def __init__(
        self,
        deps: Deps,
        backend: AllocatingBackend,
        *,
        placing: RecoveryPlacing,
        interval_s: float,
        grace_s: float,
        agent_start_timeout_s: float = 180.0,
    ) -> None:
        self.deps = deps
        self.backend = backend
        self.placing = placing
        self.interval_s = interval_s
        self.grace_s = grace_s  # a job younger than this may not be known to the scheduler yet (sbatch in flight)
        self.agent_start_timeout_s = agent_start_timeout_s
        self._failing: str | None = None
        # (job, scheduler id) -> when this replica first saw that allocation run while the job was pending
        self._running_since: dict[tuple[str, str], datetime] = {}

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
            ours = service.get_all_by_backend(session, backend=self.backend.name, states=WAITING_STATES)
            over = service.states_of(session, job_ids=[a.job_id for a in allocations.values()])
        now = self.deps.clock.now()
        for job in ours:
            allocation = allocations.get(job.id)
            if allocation is not None and allocation.state is not AllocationState.ENDED:
                runs = allocation.state is AllocationState.RUNNING
                if runs and job.state is JobState.PENDING and await self._start(job, allocation):
                    done.started.append(job.id)
                elif runs and job.state is JobState.PENDING and await self._fail_if_agents_silent(job, allocation):
                    done.failed.append(job.id)
                elif runs and job.state is JobState.RECOVERING and await self._requeue_if_stuck(job):
                    done.requeued.append(job.id)
                continue
            if allocation is None and now - job.created_at < timedelta(seconds=self.grace_s):
                continue
            why = allocation.detail if allocation is not None else "no longer known to the scheduler"
            if await self._fail(job, f"its {self.backend.name} allocation is gone: {why}"):
                done.failed.append(job.id)
        for job_id, allocation in allocations.items():
            if allocation.state is not AllocationState.ENDED and over.get(job_id) in OVER_STATES:
                await self.backend.cancel(job_id)
                log.info("allocation of a finished job ended", extra={"job_id": job_id, "state": over[job_id]})
                done.cancelled.append(job_id)
        return done

    async def _start(self, job: Job, allocation: Allocation) -> bool:
        """Place the job on its allocation's workers once their agents report, and launch it; False while waiting."""
        spec = job.job_spec()
        assert spec.node_count is not None
        with Session(self.deps.engine) as session:
            cordoned = nodes_service.cordoned_ids(session)
        workers = set(self.deps.compute.pool(exclude=cordoned, job_id=job.id).workers)
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

    async def _fail_if_agents_silent(self, job: Job, allocation: Allocation) -> bool:
        """Fail a pending job whose allocation has run for `agent_start_timeout_s` (as this replica saw it) without its
        workers' agents reporting; the next pass ends the allocation (the job is over). False while within time."""
        now = self.deps.clock.now()
        since = self._running_since.setdefault((job.id, allocation.scheduler_id), now)
        if now - since < timedelta(seconds=self.agent_start_timeout_s):
            return False
        reporting = set(self.deps.compute.pool(job_id=job.id).usable())
        silent = [node for node in allocation.nodes if node not in reporting]
        detail = (
            f"the agents of its {self.backend.name} allocation {allocation.scheduler_id} did not report within "
            f"{self.agent_start_timeout_s:g} s of it running (not reporting usable: {', '.join(silent) or 'none'}): "
            "see the allocation's output for the agents' errors"
        )
        failed = await self._fail(job, detail)
        if failed:
            self._running_since.pop((job.id, allocation.scheduler_id), None)
        return failed

    async def _requeue_if_stuck(self, job: Job) -> bool:
        """Requeue the allocation of a job whose recovery is placing and can neither use a spare nor shrink (the
        placement the recovery computes waits for capacity), without its drained and cordoned nodes; the recovery's
        placement goes on when the new allocation's agents report. False when nothing was done."""
        with Session(self.deps.engine) as session:
            if not self.placing(session, job_id=job.id):
                return False
            cordoned = nodes_service.cordoned_ids(session)
            busy = service.busy_nodes(session, except_job=job.id)
        current = job.nodes()
        pool = self.deps.compute.pool(exclude=cordoned | busy, job_id=job.id)
        plan = replan(current, usable=pool.usable(), spares=replacements(pool, current), policy=job.job_spec().policy)
        if plan.decision is not PlacementDecision.WAIT:
            return False
        left_out = await self.backend.requeue(job.id, exclude=cordoned)
        if left_out is None:
            return False
        log.warning("spares ran out: allocation requeued", extra={"job_id": job.id, "excluded": left_out})
        return True

    async def _fail(self, job: Job, detail: str) -> bool:
        """Mark the job failed under its lock and a fresh fence (a recovery holding it is left to finish first)."""
        handle = await self.deps.locks.acquire(job.id, owner=self.deps.settings.replica_id)
        if handle is None:
            return False
        try:
            with Session(self.deps.engine) as session:
                if not service.claim_fence(session, job_id=job.id, fence=handle.fence):
                    return False
                if service.get(session, job_id=job.id).state not in WAITING_STATES:
                    return False
                service.update_fenced(session, job_id=job.id, fence=handle.fence, state=JobState.FAILED, detail=detail)
            log.error("job failed on its allocation", extra={"job_id": job.id, "detail": detail})
            await end_placement(
                self.deps, job, operation_id=f"{job.id}:allocation-gone:{handle.fence}", fence=handle.fence
            )
            return True
        finally:
            await self.deps.locks.release(handle)
