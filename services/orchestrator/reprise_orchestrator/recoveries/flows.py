"""The recovery flow: one incident → one recovery, run by whoever holds the job's lock and newest fence.

detected → locked → [stopping_ranks → isolating → placing → restoring → launching → verifying]+ → running (or failed,
or held for a human). The bracketed steps are one attempt (recoveries/steps.py); a failed launch or verification
starts the next attempt after a backoff. Every step is persisted with its start and end before the next begins;
every write and every agent command carries the fence, so an owner that paused past its lease changes nothing once a
newer owner exists. A recovery whose owner died is resumed from its last persisted step by the reconciler.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from typing import Any, Literal

from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Delivery
from reprise_common.bus import Outcome as Ack
from reprise_common.errors import BusError, RepriseError
from reprise_common.events import (
    Event,
    IncidentChange,
    JobPlacement,
    RecommendedAction,
    RecoveryChange,
    Severity,
    new_id,
)
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import ACTIVE_STATES, Job, JobState
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries import policy, service
from reprise_orchestrator.recoveries.models import TERMINAL_STEPS, Outcome, Recovery, RecoveryStep
from reprise_orchestrator.recoveries.service import FencedOutError
from reprise_orchestrator.recoveries.steps import RecoveryRun, RecoverySteps, StepResult, Then, stop_nodes

log = get_logger("reprise.orchestrator.recovery")
RecoveryChangeKind = Literal["started", "step", "succeeded", "failed"]
END_STATES = {
    RecoveryStep.RUNNING: JobState.RUNNING,
    RecoveryStep.FAILED: JobState.FAILED,
    RecoveryStep.HELD: JobState.HELD,
}
HOLD_OUTCOMES = frozenset({Outcome.CIRCUIT_BREAKER, Outcome.HUMAN_ASKED})


class LockLostError(RepriseError):
    """The job's lock lease could not be renewed: another replica may own the job now."""


class RecoveryFlow:
    """Consumes opened incidents and runs recoveries; resumes orphaned ones for the reconciler."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.steps = RecoverySteps(deps)
        self.running: set[str] = set()  # recovery ids this replica runs now

    async def on_incident(self, event: Event, delivery: Delivery) -> Ack:
        """Start a recovery for an opened incident, or attach it to the one already running (or that covered it)."""
        if not isinstance(event, IncidentChange) or event.change != "opened":
            return Ack.ACK
        if event.severity is Severity.WARNING or event.recommended_action is RecommendedAction.NONE:
            log.info("warning incident: no recovery", extra={"incident_id": event.incident_id, "job_id": event.job_id})
            return Ack.ACK
        with Session(self.deps.engine) as session:
            job = session.get(Job, event.job_id)
            if job is None or job.state not in ACTIVE_STATES:
                log.info("incident for a job that is not running", extra={"job_id": event.job_id})
                return Ack.ACK
            if self._attach_if_known(session, event):
                return Ack.ACK
        handle = await self.deps.locks.acquire(event.job_id, owner=self.deps.settings.replica_id)
        if handle is None:
            return Ack.RETRY  # another replica is starting a recovery; next time we attach to it
        try:
            run = self._claim(handle, event)
            if run is not None:
                await self._drive(run, start=0)
        finally:
            await self.deps.locks.release(handle)
        return Ack.ACK

    def _attach_if_known(self, session: Session, incident: IncidentChange) -> bool:
        if service.knows_incident(session, job_id=incident.job_id, incident_id=incident.incident_id):
            return True
        target = service.find_active(session, job_id=incident.job_id) or service.covering(
            session, job_id=incident.job_id, symptom_at=incident.first_symptom_at
        )
        if target is None:
            return False
        service.attach(session, recovery=target, incident_id=incident.incident_id)
        log.info(
            "incident attached to a recovery", extra={"recovery_id": target.id, "incident_id": incident.incident_id}
        )
        return True

    def _claim(self, handle: LockHandle, incident: IncidentChange) -> RecoveryRun | None:
        now = self.deps.clock.now()
        with Session(self.deps.engine) as session:
            if self._attach_if_known(session, incident):  # someone finished or started it while we took the lock
                return None
            job = jobs.get(session, job_id=incident.job_id)
            if job.state not in ACTIVE_STATES:
                return None
            if not jobs.claim_fence(session, job_id=incident.job_id, fence=handle.fence):
                log.warning("fence claim refused: a newer owner exists", extra={"job_id": incident.job_id})
                return None
            baseline = {"last_restore_step": job.last_restore_step, "no_progress_streak": job.no_progress_streak}
            recovery = Recovery(
                id=f"rec-{new_id()[:12]}",
                job_id=incident.job_id,
                incident_id=incident.incident_id,
                fence=handle.fence,
                owner=self.deps.settings.replica_id,
                step=RecoveryStep.LOCKED,
                steps=[
                    _entry(
                        RecoveryStep.DETECTED,
                        incident.first_symptom_at,
                        incident.time,
                        incident.model_dump(mode="json"),
                    ),
                    _entry(RecoveryStep.LOCKED, incident.time, now, {"baseline": baseline}),
                ],
            )
            service.create(session, recovery=recovery)
            jobs.update_fenced(
                session,
                job_id=incident.job_id,
                fence=handle.fence,
                state=JobState.RECOVERING,
                last_error=policy.error_signature(incident),
                same_error_streak=policy.same_error_streak(job, incident),
            )
            verdict = policy.admit(job, incident, job.job_spec().policy, now=now)
            job = jobs.get(session, job_id=incident.job_id)
            return RecoveryRun(handle, recovery.id, job, incident, baseline=baseline, admission=verdict)

    async def resume(self, handle: LockHandle, recovery_id: str) -> None:
        """Take over a recovery whose owner is gone and run it on from its last persisted step."""
        with Session(self.deps.engine) as session:
            recovery = session.get(Recovery, recovery_id)
            if recovery is None or recovery.step in TERMINAL_STEPS:
                return
            if not jobs.claim_fence(session, job_id=recovery.job_id, fence=handle.fence):
                return
            recovery = service.take_over(
                session, recovery_id=recovery_id, fence=handle.fence, owner=self.deps.settings.replica_id
            )
            job = jobs.get(session, job_id=recovery.job_id)
        incident = IncidentChange.model_validate(recovery.steps[0]["data"])
        run = RecoveryRun(handle, recovery.id, job, incident, attempt=recovery.attempt)
        run.baseline = recovery.steps[1]["data"].get("baseline", {})
        start = 0
        plan = [step for step, _ in self.steps.plan()]
        for entry in recovery.steps[2:]:
            if entry.get("attempt", 1) != run.attempt or entry["step"] not in plan:
                continue
            step = RecoveryStep(entry["step"])
            if entry["ended_at"] is None:
                start = plan.index(step)  # it began but did not end: run it again
                break
            run.adopt(step, entry["data"])
            start = plan.index(step) + 1
        log.info(
            "resuming an orphaned recovery",
            extra={"recovery_id": recovery_id, "from": plan[min(start, len(plan) - 1)].value},
        )
        await self._drive(run, start=start, resumed=True)

    async def _drive(self, run: RecoveryRun, *, start: int, resumed: bool = False) -> None:
        self.running.add(run.recovery_id)
        renewal = asyncio.create_task(self._renew(run), name=f"renew:{run.recovery_id}")
        try:
            verdict = run.admission
            if verdict.outcome is not None:
                await self._finish(run, _end_step(verdict.outcome), verdict.outcome, verdict.detail)
                return
            if not resumed:
                await self._publish(run, "started", RecoveryStep.LOCKED)
            await self._attempts(run, start)
        except (FencedOutError, LockLostError) as exc:
            log.warning("standing down: lost ownership of the job", extra={"job_id": run.job.id, "why": str(exc)})
        finally:
            self.running.discard(run.recovery_id)
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal

    async def _attempts(self, run: RecoveryRun, start: int) -> None:
        plan = self.steps.plan()
        index = start
        while index < len(plan):
            step, action = plan[index]
            result = await self._step(run, step, action)
            if result.then is Then.NEXT:
                index += 1
                continue
            if result.then is Then.STOP:
                assert result.outcome is not None
                await self._finish(run, _end_step(result.outcome), result.outcome, result.detail)
                return
            spec = run.job.job_spec().policy
            if run.attempt >= spec.max_attempts:
                await self._finish(
                    run, RecoveryStep.FAILED, Outcome.ATTEMPTS_SPENT, f"{run.attempt} attempts: {result.detail}"
                )
                return
            run.attempt += 1
            wait = spec.backoff_s(run.attempt - 1)
            log.warning(
                "recovery attempt failed", extra={"recovery_id": run.recovery_id, "why": result.detail, "wait_s": wait}
            )
            await asyncio.sleep(wait)
            index = 0
        await self._finish(run, RecoveryStep.RUNNING, Outcome.RECOVERED, "training progressing again")

    async def _renew(self, run: RecoveryRun) -> None:
        interval = self.deps.settings.lock_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            if not await self.deps.locks.extend(run.handle):
                run.lock_lost.set()
                return

    async def _step(self, run: RecoveryRun, step: RecoveryStep, action: Any) -> StepResult:
        if run.lock_lost.is_set():
            raise LockLostError(f"lock on job {run.job.id} lost before {step.value}")
        started = self.deps.clock.now()
        self._record(run, step, started, None)
        await self._publish(run, "step", step, started=started)
        result: StepResult = await action(run)
        self._record(run, step, started, self.deps.clock.now(), data=result.data)
        return result

    def _record(
        self, run: RecoveryRun, step: RecoveryStep, started: datetime, ended: datetime | None, **kwargs: Any
    ) -> None:
        with Session(self.deps.engine) as session:
            service.record_step(
                session,
                recovery_id=run.recovery_id,
                fence=run.handle.fence,
                step=step,
                started_at=started,
                ended_at=ended,
                attempt=run.attempt,
                **kwargs,
            )

    async def _finish(self, run: RecoveryRun, step: RecoveryStep, outcome: Outcome, detail: str) -> None:
        now = self.deps.clock.now()
        self._record(run, step, now, now, detail=detail, finished_at=now, outcome=outcome)
        with Session(self.deps.engine) as session:
            jobs.update_fenced(
                session,
                job_id=run.job.id,
                fence=run.handle.fence,
                state=END_STATES[step],
                detail=detail if step is not RecoveryStep.RUNNING else "",
            )
        if step is not RecoveryStep.RUNNING:
            await self._wind_down(run)
        await self._publish(
            run, "succeeded" if step is RecoveryStep.RUNNING else "failed", step, detail, outcome=outcome
        )
        if run.restore is not None:
            await self.deps.registry.unpin(run.restore.checkpoint_id, holder=run.recovery_id)
        log.info(
            "recovery finished", extra={"recovery_id": run.recovery_id, "outcome": outcome.value, "detail": detail}
        )

    async def _wind_down(self, run: RecoveryRun) -> None:
        """A job that failed or waits for a human runs nothing: stop what is left and tell the detector."""
        nodes_ = list(dict.fromkeys([r["node_id"] for r in run.job.placement] + [r.node_id for r in run.ranks]))
        await stop_nodes(self.deps, f"{run.recovery_id}:end", run.job.id, run.handle.fence, nodes_)
        await publish_inactive(self.deps, run.job, msg_id=f"{run.recovery_id}:inactive")

    async def _publish(
        self,
        run: RecoveryRun,
        change: RecoveryChangeKind,
        step: RecoveryStep,
        detail: str = "",
        *,
        outcome: Outcome | None = None,
        started: datetime | None = None,
    ) -> None:
        event = RecoveryChange(
            source="orchestrator",
            change=change,
            recovery_id=run.recovery_id,
            job_id=run.job.id,
            incident_id=run.incident.incident_id,
            step=step.value,
            fence=run.handle.fence,
            detail=detail,
            attempt=run.attempt,
            outcome=outcome.value if outcome else "",
            step_started_at=started,
            labels=run.job.labels,
        )
        try:
            await self.deps.bus.publish(
                subjects.recovery(run.job.id, change),
                event,
                msg_id=f"{run.recovery_id}:{run.attempt}:{change}:{step.value}",
            )
        except BusError as exc:  # the recovery itself matters more than its announcement
            log.warning("could not publish a recovery change", extra={"error": str(exc)})


async def publish_inactive(deps: Deps, job: Job, *, msg_id: str) -> None:
    """Tell the detector the job runs nowhere now (it stops expecting progress from it)."""
    event = JobPlacement(
        source="orchestrator",
        job_id=job.id,
        restart_epoch=job.restart_epoch,
        world_size=0,
        active=False,
        labels=job.labels,
    )
    try:
        await deps.bus.publish(subjects.placement(job.id), event, msg_id=msg_id)
    except BusError as exc:
        log.warning("could not publish the job's end", extra={"error": str(exc)})


def _end_step(outcome: Outcome | None) -> RecoveryStep:
    return RecoveryStep.HELD if outcome in HOLD_OUTCOMES else RecoveryStep.FAILED


def _entry(step: RecoveryStep, started: datetime, ended: datetime, data: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": step.value,
        "attempt": 1,
        "started_at": started.isoformat(),
        "ended_at": ended.isoformat(),
        "data": data,
    }
