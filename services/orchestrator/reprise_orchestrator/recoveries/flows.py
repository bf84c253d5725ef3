"""The recovery flow: one incident → one recovery, run by whoever holds the job's lock and newest fence.

detected → locked → stopping_ranks → restoring → launching → running (or failed). Every step is persisted with its
start and end before the next begins; every write and every agent command carries the fence, so an owner that
paused past its lease changes nothing once a newer owner exists.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Delivery, Outcome
from reprise_common.errors import BusError, RepriseError
from reprise_common.events import (
    CommandAction,
    Event,
    IncidentChange,
    RankAssignment,
    RecommendedAction,
    RecoveryChange,
    Severity,
    new_id,
)
from reprise_common.logging import get_logger
from reprise_orchestrator.agents import command_nodes
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.launch import launch, rendezvous_for
from reprise_orchestrator.jobs.models import Job, JobState
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.models import Recovery, RecoveryStep
from reprise_orchestrator.recoveries.service import FencedOutError
from reprise_orchestrator.registry_client import RegistryUnavailableError, RestorePoint

log = get_logger("reprise.orchestrator.recovery")
RecoveryChangeKind = Literal["started", "step", "succeeded", "failed"]
PIN_TTL_S = 3600.0  # a pin outlives any sane recovery, and expires if its owner dies holding it


class LockLostError(RepriseError):
    """The job's lock lease could not be renewed: another replica may own the job now."""


class StepFailedError(RepriseError):
    """A step could not complete; the recovery fails with this reason."""


@dataclass
class _Run:
    """State of one recovery while it runs."""

    handle: LockHandle
    recovery_id: str
    job: Job
    incident: IncidentChange
    lock_lost: asyncio.Event = field(default_factory=asyncio.Event)
    restore: RestorePoint | None = None


class RecoveryFlow:
    """Consumes opened incidents and runs recoveries."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    async def on_incident(self, event: Event, delivery: Delivery) -> Outcome:
        """Start a recovery for an opened incident, or attach it to the one already running."""
        if not isinstance(event, IncidentChange) or event.change != "opened":
            return Outcome.ACK
        if event.severity is Severity.WARNING or event.recommended_action is RecommendedAction.NONE:
            log.info("warning incident: no recovery", extra={"incident_id": event.incident_id, "job_id": event.job_id})
            return Outcome.ACK
        with Session(self.deps.engine) as session:
            job = session.get(Job, event.job_id)
            if job is None or job.state not in (JobState.RUNNING, JobState.RECOVERING):
                log.info("incident for a job that is not running", extra={"job_id": event.job_id})
                return Outcome.ACK
            if self._attach_if_known(session, event):
                return Outcome.ACK
        handle = await self.deps.locks.acquire(event.job_id, owner=self.deps.settings.replica_id)
        if handle is None:
            return Outcome.RETRY  # another replica is starting a recovery; next time we attach to it
        try:
            await self._recover(handle, event)
        finally:
            await self.deps.locks.release(handle)
        return Outcome.ACK

    def _attach_if_known(self, session: Session, incident: IncidentChange) -> bool:
        if service.knows_incident(session, job_id=incident.job_id, incident_id=incident.incident_id):
            return True
        active = service.find_active(session, job_id=incident.job_id)
        if active is None:
            return False
        service.attach(session, recovery=active, incident_id=incident.incident_id)
        log.info("incident attached to running recovery", extra={"recovery_id": active.id})
        return True

    async def _recover(self, handle: LockHandle, incident: IncidentChange) -> None:
        run = self._claim(handle, incident)
        if run is None:
            return
        await self._publish(run, "started", RecoveryStep.LOCKED)
        renewal = asyncio.create_task(self._renew(run), name=f"renew:{run.recovery_id}")
        try:
            if run.job.restarts >= run.job.job_spec().policy.max_restarts:
                raise StepFailedError(f"restart budget spent ({run.job.restarts} restarts)")
            await self._step(run, RecoveryStep.STOPPING_RANKS, self._stop_ranks)
            await self._step(run, RecoveryStep.RESTORING, self._restoring)
            await self._step(run, RecoveryStep.LAUNCHING, self._launching)
            await self._finish(run, RecoveryStep.RUNNING, JobState.RUNNING, "training relaunched")
        except (FencedOutError, LockLostError) as exc:
            log.warning("standing down: lost ownership of the job", extra={"job_id": run.job.id, "why": str(exc)})
        except StepFailedError as exc:
            with contextlib.suppress(FencedOutError):
                await self._finish(run, RecoveryStep.FAILED, JobState.FAILED, str(exc))
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal

    def _claim(self, handle: LockHandle, incident: IncidentChange) -> _Run | None:
        now = self.deps.clock.now()
        with Session(self.deps.engine) as session:
            if self._attach_if_known(session, incident):  # someone finished or started it while we took the lock
                return None
            if not jobs.claim_fence(session, job_id=incident.job_id, fence=handle.fence):
                log.warning("fence claim refused: a newer owner exists", extra={"job_id": incident.job_id})
                return None
            recovery = Recovery(
                id=f"rec-{new_id()[:12]}",
                job_id=incident.job_id,
                incident_id=incident.incident_id,
                fence=handle.fence,
                owner=self.deps.settings.replica_id,
                step=RecoveryStep.LOCKED,
                steps=[
                    _entry(RecoveryStep.DETECTED, incident.first_symptom_at, incident.time),
                    _entry(RecoveryStep.LOCKED, incident.time, now),
                ],
            )
            service.create(session, recovery=recovery)
            jobs.update_fenced(session, job_id=incident.job_id, fence=handle.fence, state=JobState.RECOVERING)
            job = jobs.get(session, job_id=incident.job_id)
            return _Run(handle=handle, recovery_id=recovery.id, job=job, incident=incident)

    async def _renew(self, run: _Run) -> None:
        interval = self.deps.settings.lock_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            if not await self.deps.locks.extend(run.handle):
                run.lock_lost.set()
                return

    async def _step(self, run: _Run, step: RecoveryStep, action: Callable[[_Run], Awaitable[dict[str, Any]]]) -> None:
        if run.lock_lost.is_set():
            raise LockLostError(f"lock on job {run.job.id} lost before {step.value}")
        started = self.deps.clock.now()
        self._record(run, step, started, None)
        await self._publish(run, "step", step)
        data = await action(run)
        self._record(run, step, started, self.deps.clock.now(), data=data)

    def _record(
        self, run: _Run, step: RecoveryStep, started: datetime, ended: datetime | None, **kwargs: Any
    ) -> Recovery:
        with Session(self.deps.engine) as session:
            return service.record_step(
                session,
                recovery_id=run.recovery_id,
                fence=run.handle.fence,
                step=step,
                started_at=started,
                ended_at=ended,
                **kwargs,
            )

    async def _stop_ranks(self, run: _Run) -> dict[str, Any]:
        nodes = list(dict.fromkeys(r["node_id"] for r in run.job.placement))
        grace = self.deps.settings.stop_grace_s
        answers = await command_nodes(
            self.deps.bus,
            operation_id=run.recovery_id,
            job_id=run.job.id,
            fence=run.handle.fence,
            action=CommandAction.STOP,
            args_by_node={node: {"grace_s": grace} for node in nodes},
            timeout_s=self.deps.settings.command_timeout_s + grace,
        )
        if any(a.stale for a in answers):
            raise FencedOutError("an agent refused our fence as stale")
        # A node that does not answer is treated as stopped (it may be the dead one); its ranks are fenced anyway.
        return {"answers": [a.summary() for a in answers]}

    async def _restoring(self, run: _Run) -> dict[str, Any]:
        for attempt in range(3):
            try:
                run.restore = await self.deps.registry.latest_validated(run.job.id)
                break
            except RegistryUnavailableError as exc:
                if attempt == 2:
                    raise StepFailedError(str(exc)) from exc
                await asyncio.sleep(0.5 * (attempt + 1))
        if run.restore is None:
            return {"checkpoint": None, "note": "no validated checkpoint: the job restarts from its beginning"}
        pinned = await self.deps.registry.pin(run.restore.checkpoint_id, holder=run.recovery_id, ttl_s=PIN_TTL_S)
        if not pinned:
            log.warning("could not pin the restore checkpoint", extra={"checkpoint_id": run.restore.checkpoint_id})
        checkpoint = {"id": run.restore.checkpoint_id, "step": run.restore.step, "path": run.restore.path}
        return {"checkpoint": checkpoint, "pinned": pinned}

    async def _launching(self, run: _Run) -> dict[str, Any]:
        epoch = run.job.restart_epoch + 1
        ranks = [RankAssignment.model_validate(r) for r in run.job.placement]
        rendezvous = rendezvous_for(
            ranks, epoch=epoch, inventory=self.deps.inventory, port_base=self.deps.settings.master_port_base
        )
        answers = await launch(
            self.deps.bus,
            operation_id=run.recovery_id,
            job_id=run.job.id,
            fence=run.handle.fence,
            spec=run.job.job_spec(),
            ranks=ranks,
            rendezvous=rendezvous,
            restore=run.restore,
            timeout_s=self.deps.settings.command_timeout_s,
        )
        if any(a.stale for a in answers):
            raise FencedOutError("an agent refused our fence as stale")
        if not all(a.ok for a in answers):
            raise StepFailedError(f"launch not confirmed by every node: {[a.summary() for a in answers]}")
        with Session(self.deps.engine) as session:
            if not jobs.update_fenced(
                session,
                job_id=run.job.id,
                fence=run.handle.fence,
                restart_epoch=epoch,
                master_port=rendezvous.master_port,
                restarts=run.job.restarts + 1,
            ):
                raise FencedOutError("job taken over during launch")
        return {
            "restart_epoch": epoch,
            "master_port": rendezvous.master_port,
            "answers": [a.summary() for a in answers],
        }

    async def _finish(self, run: _Run, step: RecoveryStep, job_state: JobState, detail: str) -> None:
        now = self.deps.clock.now()
        self._record(run, step, now, now, detail=detail, finished_at=now)
        with Session(self.deps.engine) as session:
            jobs.update_fenced(session, job_id=run.job.id, fence=run.handle.fence, state=job_state)
        await self._publish(run, "succeeded" if step is RecoveryStep.RUNNING else "failed", step, detail)
        if run.restore is not None:
            await self.deps.registry.unpin(run.restore.checkpoint_id, holder=run.recovery_id)
        log.info("recovery finished", extra={"recovery_id": run.recovery_id, "step": step.value, "detail": detail})

    async def _publish(self, run: _Run, change: RecoveryChangeKind, step: RecoveryStep, detail: str = "") -> None:
        event = RecoveryChange(
            source="orchestrator",
            change=change,
            recovery_id=run.recovery_id,
            job_id=run.job.id,
            incident_id=run.incident.incident_id,
            step=step.value,
            fence=run.handle.fence,
            detail=detail,
        )
        try:
            await self.deps.bus.publish(
                subjects.recovery(run.job.id, change), event, msg_id=f"{run.recovery_id}:{change}:{step.value}"
            )
        except BusError as exc:  # the recovery itself matters more than its announcement
            log.warning("could not publish a recovery change", extra={"error": str(exc)})


def _entry(step: RecoveryStep, started: datetime, ended: datetime) -> dict[str, Any]:
    return {"step": step.value, "started_at": started.isoformat(), "ended_at": ended.isoformat(), "data": {}}
