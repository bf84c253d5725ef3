"""The incident consumers: claim a recovery for an incident, or tell a running recovery what its incident learned.

A handler only claims: it takes the job's lock and a fence, persists the recovery as `locked`, hands it to the
replica's runner and acknowledges; it never holds a delivery for longer than the claim takes. An incident whose
recovery already runs (or already replaced the ranks it is about) attaches to that recovery instead. An incident
that gets no recovery (its job is gone or cannot be recovered, or it is for people) is logged and counted with its
reason (`Skip`, on /metrics); one whose fence SQL refuses draws a higher fence (recoveries/fences.py) and claims.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from enum import StrEnum

from prometheus_client import Counter
from sqlmodel import Session

from reprise_common.bus import Delivery
from reprise_common.bus import Outcome as Ack
from reprise_common.events import Event, IncidentChange, IncidentChangeKind, RecommendedAction, Severity, new_id
from reprise_common.logging import get_logger
from reprise_common.report_view import RankSeen
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import ACTIVE_STATES, Job, JobState
from reprise_orchestrator.locks import LockHandle, LockStoreUnavailableError
from reprise_orchestrator.recoveries import facts, fences, service
from reprise_orchestrator.recoveries.fences import Refused
from reprise_orchestrator.recoveries.flows import RecoveryFlow, Started
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import Baseline, Locked, StepRecord, incident_of
from reprise_orchestrator.recoveries.run import RecoveryRun
from reprise_orchestrator.recoveries.runner import RecoveryRunner
from reprise_orchestrator.recoveries.states import TERMINAL_STEPS, Outcome, RecoveryStep

log = get_logger("reprise.orchestrator.claims")
INCIDENTS_SKIPPED = Counter(
    "reprise_orchestrator_incidents_skipped_total",
    "Incident changes acknowledged without a recovery of their own, by reason",
    ["reason"],
)


class Skip(StrEnum):
    """Why an incident change was acknowledged without a recovery (never silently: each is logged and counted)."""

    NOT_ACTIONABLE = "not_actionable"  # a warning, or nothing recommended: for people, not for recoveries
    JOB_NOT_FOUND = "job_not_found"
    JOB_NOT_RECOVERABLE = "job_not_recoverable"  # pending, held for a human, or ended


class Claims:
    """Turns incident changes into claimed recoveries, run side by side by the runner."""

    def __init__(self, deps: Deps, flow: RecoveryFlow, runner: RecoveryRunner) -> None:
        self.deps = deps
        self.flow = flow
        self.runner = runner

    async def on_opened(self, event: Event, delivery: Delivery) -> Ack:
        """Claim a recovery for an opened incident, or attach it to the recovery that already answers it."""
        if (
            not isinstance(event, IncidentChange)
            or event.change is not IncidentChangeKind.OPENED
            or not _actionable(event)
        ):
            return Ack.ACK
        with Session(self.deps.engine) as session:
            if self._attach_if_known(session, event):
                return Ack.ACK
        return await self._claim(event, fresh=False)

    async def on_updated(self, event: Event, delivery: Delivery) -> Ack:
        """Give a running recovery the newest version of its incident; after a recovery ended, a version that knows
        more (a deeper cause, a culprit node to leave out) is a fault that recovery did not answer: claim another."""
        if (
            not isinstance(event, IncidentChange)
            or event.change is not IncidentChangeKind.UPDATED
            or not _actionable(event)
        ):
            return Ack.ACK
        with Session(self.deps.engine) as session:
            recovery = service.newest_for_incident(session, job_id=event.job_id, incident_id=event.incident_id)
            if recovery is None:  # the opened change is not claimed yet (or never was): claim with what is known now
                return Ack.ACK if self._attach_if_known(session, event) else await self._claim(event, fresh=False)
            if recovery.step not in TERMINAL_STEPS:
                if service.learn(session, recovery_id=recovery.id, incident=event):
                    self.flow.notify(recovery.id)
                return Ack.ACK
            answered = recovery.learned or incident_of(service.records(session, recovery_id=recovery.id))
            if recovery.outcome is not Outcome.RECOVERED or not facts.learned(answered, event):
                return Ack.ACK
        log.info("the incident learned more after its recovery ended", extra={"incident_id": event.incident_id})
        return await self._claim(event, fresh=True)

    def _attach_if_known(self, session: Session, incident: IncidentChange) -> bool:
        if service.knows_incident(session, job_id=incident.job_id, incident_id=incident.incident_id):
            return True
        target = service.find_active(session, job_id=incident.job_id) or service.covering(
            session,
            job_id=incident.job_id,
            symptom_at=incident.first_symptom_at,
            restart_epoch=incident.culprit.restart_epoch,
        )
        if target is None:
            return False
        service.attach(session, recovery=target, incident_id=incident.incident_id)
        log.info(
            "incident attached to a recovery", extra={"recovery_id": target.id, "incident_id": incident.incident_id}
        )
        return True

    async def _claim(self, incident: IncidentChange, *, fresh: bool) -> Ack:
        """Lock, fence, persist the recovery as locked, hand it to the runner; RETRY when the job is busy here or
        elsewhere, or this replica runs as many recoveries as it may (another replica may take it meanwhile).

        A fence SQL refuses means the lock store's counter is behind (it lost its data): the counter is floored to
        the stored fence and a fresh fence drawn under the same lock. An incident acknowledged without a recovery
        of its own has a reason, logged and counted (`Skip`)."""
        if not self.runner.has_room():
            return Ack.RETRY
        try:
            return await self._claim_locked(incident, fresh=fresh)
        except LockStoreUnavailableError as exc:  # nothing was claimed: the incident waits for the store
            log.warning(
                "lock store unreachable: the incident is retried", extra={"job_id": incident.job_id, "error": str(exc)}
            )
            return Ack.RETRY

    async def _claim_locked(self, incident: IncidentChange, *, fresh: bool) -> Ack:
        handle = await self.deps.locks.acquire(incident.job_id, owner=self.deps.settings.replica_id)
        if handle is None:
            return Ack.RETRY  # another replica is claiming or running one; next time we attach to it
        started = False
        try:
            held, claimed = await fences.claim_under_fresh_fences(
                self.deps, handle, lambda fenced: self._persist(fenced, incident, fresh=fresh), where="claim"
            )
            if held is None:
                return Ack.RETRY  # the lock is gone (lost, or the lease ran out): claim again, or attach, later
            handle = held
            if isinstance(claimed, Refused):
                log.warning("fence claim refused at every attempt", extra={"job_id": incident.job_id})
                return Ack.RETRY
            if isinstance(claimed, Skip):
                skipped(incident, claimed)
                return Ack.ACK
            started = claimed is not None and self.runner.start(handle, claimed[0].recovery_id, claimed)
        finally:
            if not started:  # nothing claimed, or the runner filled up meanwhile (the reconciler resumes it)
                await self.deps.locks.release(handle)
        return Ack.ACK

    def _persist(self, handle: LockHandle, incident: IncidentChange, *, fresh: bool) -> Started | Skip | Refused | None:
        """Claim the recovery in one transaction; what the run starts from (no need to read it back). None when a
        recovery of the job answers the incident already; a Skip when the job cannot be recovered; Refused when SQL
        holds a fence at or above the handle's."""
        now = self.deps.clock.now()
        with Session(self.deps.engine, expire_on_commit=False) as session:
            if not fresh and self._attach_if_known(session, incident):  # it was claimed while we took the lock
                return None
            job = session.get(Job, incident.job_id)
            if job is None:
                return Skip.JOB_NOT_FOUND
            if job.state not in ACTIVE_STATES:
                return Skip.JOB_NOT_RECOVERABLE
            active = service.find_active(session, job_id=job.id) if fresh else None
            if active is not None:  # a recovery began meanwhile: it takes the news instead
                if service.learn(session, recovery_id=active.id, incident=incident):
                    self.flow.notify(active.id)
                return None
            streak = facts.same_error_streak(job, incident)
            claimed = jobs.claim_fence(
                session,
                job_id=incident.job_id,
                fence=handle.fence,
                commit=False,
                state=JobState.RECOVERING,
                last_error=facts.error_signature(incident),
                same_error_streak=streak,
                updated_at=now,
            )
            if not claimed:
                session.rollback()
                return Refused(fence=handle.fence, stored=service.stored_fence(session, job_id=incident.job_id))
            return self._insert(session, handle, job, incident, streak=streak, now=now)

    def _insert(
        self, session: Session, handle: LockHandle, job: Job, incident: IncidentChange, *, streak: int, now: datetime
    ) -> Started:
        """Insert the claimed recovery, its detected and locked steps, and commit with the fence claimed; what the run
        starts from."""
        baseline = Baseline(
            last_restore_step=job.last_restore_step,
            no_progress_streak=job.no_progress_streak,
            same_error_streak=streak,
            sdk_seen=_sdk_seen_in(self.deps.inventory.ranks_of(job.id, restart_epoch=job.restart_epoch).values()),
        )
        recovery = Recovery(
            id=f"rec-{new_id()[:12]}",
            job_id=incident.job_id,
            incident_id=incident.incident_id,
            fence=handle.fence,
            owner=self.deps.settings.replica_id,
            step=RecoveryStep.LOCKED,
        )
        detected = StepRecord(
            step=RecoveryStep.DETECTED, started_at=incident.first_symptom_at, ended_at=incident.time, data=incident
        )
        locked = StepRecord(
            step=RecoveryStep.LOCKED, started_at=incident.time, ended_at=now, data=Locked(baseline=baseline)
        )
        service.insert_claimed(session, recovery=recovery, steps=[detected, locked])
        session.commit()  # with the fence claimed and the job recovering, in one transaction
        run = RecoveryRun(handle, recovery.id, job, incident, baseline, step=RecoveryStep.LOCKED)
        return run, locked


def _sdk_seen_in(ranks: Iterable[RankSeen]) -> bool:
    """True when a rank reported progress through the SDK (a heartbeat)."""
    return any(r.heartbeat_age_s is not None or r.step is not None for r in ranks)


def job_of(event: Event) -> str:
    """The job an incident change is about (claims of one job are made one after the other)."""
    return event.job_id if isinstance(event, IncidentChange) else ""


def _actionable(incident: IncidentChange) -> bool:
    """Warnings and incidents that recommend nothing are for people, not for recoveries."""
    if incident.severity is Severity.WARNING or incident.recommended_action is RecommendedAction.NONE:
        skipped(incident, Skip.NOT_ACTIONABLE)
        return False
    return True


def skipped(incident: IncidentChange, reason: Skip) -> None:
    """Count and log an incident change acknowledged without a recovery of its own."""
    INCIDENTS_SKIPPED.labels(reason.value).inc()
    extra = {"incident_id": incident.incident_id, "job_id": incident.job_id, "reason": reason.value}
    if reason is Skip.NOT_ACTIONABLE:
        log.info("incident needs no recovery", extra=extra)
    else:
        log.warning("incident acknowledged without a recovery", extra=extra)
