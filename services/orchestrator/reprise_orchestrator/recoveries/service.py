"""Data access for recoveries; every write of a recovery's steps is fenced against the job's highest fencing token,
and a new step is written only when the policy (recoveries/rules.py) accepts the transition."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlmodel import Session, col, select

from reprise_common.errors import RepriseError
from reprise_common.events import IncidentChange
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.recoveries import rules
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import StepData, StepRecord, Then, launched_epoch, relaunched_at
from reprise_orchestrator.recoveries.rules import Answer, Decision, Proposal
from reprise_orchestrator.recoveries.states import TERMINAL_STEPS, Outcome, RecoveryStep


class FencedOutError(RepriseError):
    """A newer fencing token owns the job: this writer must stand down."""


class TransitionRefusedError(RepriseError):
    """The policy refused a transition, or the recovery is not where the proposal says it is."""


def get_all_by_job(session: Session, *, job_id: str) -> Sequence[Recovery]:
    """A job's recoveries, newest first."""
    query = select(Recovery).where(Recovery.job_id == job_id).order_by(col(Recovery.started_at).desc())
    return session.exec(query).all()


def find_active(session: Session, *, job_id: str) -> Recovery | None:
    """The recovery of a job that has not ended, if any."""
    query = select(Recovery).where(Recovery.job_id == job_id, col(Recovery.step).not_in(list(TERMINAL_STEPS)))
    return session.exec(query).first()


def get_all_active_ids(session: Session) -> list[tuple[str, str]]:
    """(recovery id, job id) of every recovery that has not ended (what the reconciler looks at)."""
    query = select(Recovery.id, Recovery.job_id).where(col(Recovery.step).not_in(list(TERMINAL_STEPS)))
    return [(recovery_id, job_id) for recovery_id, job_id in session.exec(query).all()]


def knows_incident(session: Session, *, job_id: str, incident_id: str) -> bool:
    """True when a recovery of the job was started by, or has attached, this incident."""
    # Only the incident columns: a recovery's steps hold its placement, thousands of ranks at scale.
    query = select(Recovery.incident_id, Recovery.attached_incidents).where(Recovery.job_id == job_id)
    return any(started == incident_id or incident_id in attached for started, attached in session.exec(query).all())


def newest_for_incident(session: Session, *, job_id: str, incident_id: str) -> Recovery | None:
    """The newest recovery of the job that was started by, or attached, this incident."""
    query = select(Recovery.id, Recovery.incident_id, Recovery.attached_incidents).where(Recovery.job_id == job_id)
    query = query.order_by(col(Recovery.started_at).desc())
    for recovery_id, started, attached in session.exec(query).all():
        if started == incident_id or incident_id in attached:
            return session.get(Recovery, recovery_id)
    return None


def covering(
    session: Session, *, job_id: str, symptom_at: datetime, restart_epoch: int | None = None
) -> Recovery | None:
    """The latest recovery that already replaced the ranks a symptom came from, if any.

    A symptom of a restart epoch older than the one a recovery launched is about processes that recovery replaced,
    however late it was noticed; without an epoch, a symptom older than the recovery's relaunch is. Recoveries are
    read one at a time, newest first, and usually only the newest is: each holds its step data, which is large for a
    job of thousands of ranks, and a long job has many.
    """
    newest_first = select(Recovery.id).where(Recovery.job_id == job_id).order_by(col(Recovery.started_at).desc())
    for recovery_id in session.exec(newest_first).all():
        recovery = session.get_one(Recovery, recovery_id)
        epoch = launched_epoch(recovery.steps)
        if restart_epoch is not None and epoch is not None:
            if restart_epoch < epoch:
                return recovery
            return None  # the symptom's epoch is the one this recovery launched (or newer): a new fault
        relaunched = relaunched_at(recovery.steps)
        if relaunched is not None:
            return recovery if symptom_at < relaunched else None
    return None


def attach(session: Session, *, recovery: Recovery, incident_id: str) -> None:
    """Attach a duplicate incident to a recovery."""
    recovery.attached_incidents = [*recovery.attached_incidents, incident_id]
    session.add(recovery)
    session.commit()


def learn(session: Session, *, recovery_id: str, incident: IncidentChange) -> bool:
    """Keep the newest version of a running recovery's incident for its owner to re-plan by (no fence: it is news,
    not a decision); False when the recovery ended or already knows a version as new."""
    recovery = session.get(Recovery, recovery_id)
    if recovery is None or recovery.step in TERMINAL_STEPS:
        return False
    known = recovery.learned
    if known is not None and known.symptom_count >= incident.symptom_count:
        return False
    recovery.learned = incident
    session.add(recovery)
    session.commit()
    return True


def learned_incident(session: Session, *, recovery_id: str) -> IncidentChange | None:
    """The newest version of the recovery's incident that it was told about, if any (only that column is read)."""
    query = select(Recovery.learned).where(Recovery.id == recovery_id)  # type: ignore[type-var]
    learned: IncidentChange | None = session.exec(query).one_or_none()
    return learned


def _check_fence(session: Session, *, job_id: str, fence: int) -> None:
    # Only the fence column: the job's row holds its placement, thousands of ranks at scale.
    highest = session.exec(select(Job.max_fence).where(Job.id == job_id).with_for_update()).one()
    if highest != fence:
        raise FencedOutError(f"job {job_id} is owned by fence {highest}, not {fence}")


def create(session: Session, *, recovery: Recovery) -> Recovery:
    """Insert a recovery claimed under its fence."""
    _check_fence(session, job_id=recovery.job_id, fence=recovery.fence)
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery


def take_over(session: Session, *, recovery_id: str, fence: int, owner: str) -> Recovery:
    """Make the holder of `fence` (already claimed on the job) the recovery's owner."""
    recovery = _get(session, recovery_id)
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    recovery.fence, recovery.owner = fence, owner
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery


def _get(session: Session, recovery_id: str) -> Recovery:
    recovery = session.get(Recovery, recovery_id)
    if recovery is None:
        raise RepriseError(f"recovery {recovery_id} vanished")
    return recovery


def move(session: Session, *, recovery_id: str, fence: int, proposal: Proposal, at: datetime) -> Answer:
    """Ask the policy about a transition and, when it accepts, record the new step as begun (an end also finishes
    the recovery and sets the job's end state in the same transaction). FencedOutError when fenced out;
    TransitionRefusedError when the recovery is not at the proposal's step and attempt."""
    recovery = _get(session, recovery_id)
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    if (recovery.step, recovery.attempt) != (proposal.from_step, proposal.from_attempt):
        raise TransitionRefusedError(
            f"recovery {recovery_id} is at {recovery.step.value} (attempt {recovery.attempt}), not at "
            f"{proposal.from_step.value} (attempt {proposal.from_attempt})"
        )
    answer = rules.decide(proposal, recovery_id=recovery_id)
    if answer.decision is not Decision.ACCEPT:
        session.rollback()
        return answer
    end = proposal.to_step in TERMINAL_STEPS
    record = StepRecord(
        step=proposal.to_step,
        attempt=proposal.to_attempt,
        started_at=at,
        ended_at=at if end else None,
        outcome=proposal.outcome if end else None,
    )
    recovery.steps = [*recovery.steps, record]
    recovery.step, recovery.attempt = proposal.to_step, proposal.to_attempt
    if end:
        recovery.outcome, recovery.detail, recovery.finished_at = proposal.outcome, proposal.detail, at
        state = rules.END_STATE[proposal.to_step]
        detail = "" if proposal.outcome is Outcome.RECOVERED else proposal.detail
        jobs.update_fenced(
            session, job_id=recovery.job_id, fence=fence, commit=False, state=state, detail=detail, reserved_nodes=[]
        )
    session.add(recovery)
    session.commit()
    return answer


def end_step(
    session: Session,
    *,
    recovery_id: str,
    fence: int,
    step: RecoveryStep,
    attempt: int,
    at: datetime,
    data: StepData,
    then: Then,
    outcome: Outcome | None = None,
) -> None:
    """Record the end of the recovery's current step with its result; FencedOutError if fenced out."""
    recovery = _get(session, recovery_id)
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    current = recovery.steps[-1] if recovery.steps else None
    if current is None or (current.step, current.attempt) != (step, attempt) or recovery.step is not step:
        raise TransitionRefusedError(f"recovery {recovery_id} is not running {step.value} (attempt {attempt})")
    ended = current.model_copy(update={"ended_at": at, "data": data, "then": then, "outcome": outcome})
    recovery.steps = [*recovery.steps[:-1], ended]
    session.add(recovery)
    session.commit()
