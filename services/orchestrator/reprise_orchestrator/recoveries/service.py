"""Data access for recoveries; every write of a recovery's steps is fenced against the job's highest fencing token,
and a new step is written only when the policy (recoveries/rules.py) accepts the transition.

A recovery's steps are rows of `recovery_step`, numbered by `seq`; the recovery row says which is the newest. A step
begins with an insert and ends with an update of its own row, so no write rewrites the steps before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import bindparam, insert, update
from sqlalchemy import select as core_select
from sqlalchemy.engine import Connection, CursorResult
from sqlmodel import Session, col, select

from reprise_common.errors import RepriseError
from reprise_common.events import IncidentChange
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.recoveries import rules
from reprise_orchestrator.recoveries.models import Recovery, RecoveryStepRow
from reprise_orchestrator.recoveries.records import StepData, StepRecord, Then
from reprise_orchestrator.recoveries.rules import Answer, Decision, Proposal
from reprise_orchestrator.recoveries.states import TERMINAL_STEPS, Outcome, RecoveryStep

STEPS = RecoveryStepRow.__table__  # type: ignore[attr-defined]


class FencedOutError(RepriseError):
    """A newer fencing token owns the job: this writer must stand down."""


class TransitionRefusedError(RepriseError):
    """The policy refused a transition, or the recovery is not where the proposal says it is."""


# --- reading ----------------------------------------------------------------------------------------------------
def get_all_by_job(session: Session, *, job_id: str) -> Sequence[Recovery]:
    """A job's recoveries, newest first."""
    query = select(Recovery).where(Recovery.job_id == job_id).order_by(col(Recovery.started_at).desc())
    return session.exec(query).all()


def records(session: Session, *, recovery_id: str) -> list[StepRecord]:
    """A recovery's steps, in order, as typed records."""
    return records_of(session, recovery_ids=[recovery_id]).get(recovery_id, [])


def records_of(session: Session, *, recovery_ids: Iterable[str]) -> dict[str, list[StepRecord]]:
    """The steps of each of these recoveries, in order, in one query."""
    return {rid: [row.record() for row in rows] for rid, rows in _step_rows(session, recovery_ids).items()}


def records_as_read(session: Session, recoveries: Sequence[Recovery]) -> dict[str, list[StepRecord]]:
    """The steps of recoveries read just before, up to the newest step each row had then (`seq`): a transition
    committed between the two reads (each statement sees its own snapshot) must not show a step the recovery's row
    does not know yet."""
    upto = {r.id: r.seq for r in recoveries}
    rows = _step_rows(session, upto)
    return {rid: [row.record() for row in found if row.seq <= upto[rid]] for rid, found in rows.items()}


def _step_rows(session: Session, recovery_ids: Iterable[str]) -> dict[str, list[RecoveryStepRow]]:
    query = select(RecoveryStepRow).where(col(RecoveryStepRow.recovery_id).in_(list(recovery_ids)))
    found: dict[str, list[RecoveryStepRow]] = {}
    for row in session.exec(query.order_by(col(RecoveryStepRow.recovery_id), col(RecoveryStepRow.seq))).all():
        found.setdefault(row.recovery_id, []).append(row)
    return found


def find_active(session: Session, *, job_id: str) -> Recovery | None:
    """The recovery of a job that has not ended, if any."""
    query = select(Recovery).where(Recovery.job_id == job_id, col(Recovery.step).not_in(list(TERMINAL_STEPS)))
    return session.exec(query).first()


def get_all_active_ids(session: Session) -> list[tuple[str, str]]:
    """(recovery id, job id) of every recovery that has not ended (what the reconciler looks at)."""
    query = select(Recovery.id, Recovery.job_id).where(col(Recovery.step).not_in(list(TERMINAL_STEPS)))
    return [(recovery_id, job_id) for recovery_id, job_id in session.exec(query).all()]


def is_placing(session: Session, *, job_id: str) -> bool:
    """True when a recovery of the job has not finished and is at its placing step."""
    query = select(Recovery.id).where(
        Recovery.job_id == job_id, col(Recovery.finished_at).is_(None), Recovery.step == RecoveryStep.PLACING
    )
    return session.exec(query).first() is not None


def incident_of(session: Session, *, recovery_id: str) -> str | None:
    """The incident that started a recovery; None when there is no such recovery."""
    recovery = session.get(Recovery, recovery_id)
    return recovery.incident_id if recovery is not None else None


def knows_incident(session: Session, *, job_id: str, incident_id: str) -> bool:
    """True when a recovery of the job was started by, or has attached, this incident."""
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

    A symptom of a restart epoch older than the newest one a recovery launched is about processes that recovery
    replaced, however late it was noticed; without an epoch, a symptom older than the recovery's newest relaunch is.
    Only the launching steps are read, newest recovery first; usually only the newest recovery is.
    """
    newest_first = select(Recovery.id).where(Recovery.job_id == job_id).order_by(col(Recovery.started_at).desc())
    for recovery_id in session.exec(newest_first).all():
        launches = session.exec(
            select(RecoveryStepRow)
            .where(RecoveryStepRow.recovery_id == recovery_id, RecoveryStepRow.step == RecoveryStep.LAUNCHING.value)
            .order_by(col(RecoveryStepRow.seq))
        ).all()
        if not launches:
            continue
        epochs = [
            row.data.get("restart_epoch") for row in launches if row.ended_at is not None and row.then == Then.NEXT
        ]
        epoch = max((e for e in epochs if isinstance(e, int)), default=None)
        if restart_epoch is not None and epoch is not None:
            return session.get(Recovery, recovery_id) if restart_epoch < epoch else None
        return session.get(Recovery, recovery_id) if symptom_at < launches[-1].started_at else None
    return None


def learned_incident(session: Session, *, recovery_id: str) -> IncidentChange | None:
    """The newest version of the recovery's incident that it was told about, if any (only that column is read)."""
    query = select(Recovery.learned).where(Recovery.id == recovery_id)  # type: ignore[type-var]
    learned: IncidentChange | None = session.exec(query).one_or_none()
    return learned


def stored_fence(session: Session, *, job_id: str) -> int:
    """The job's highest fence as SQL holds it (0 for a job never fenced or not found)."""
    return session.exec(select(Job.max_fence).where(Job.id == job_id)).one_or_none() or 0


def stored_fences(session: Session) -> dict[str, int]:
    """job id → highest fence, for every job that has one (only those two columns are read)."""
    query = select(Job.id, Job.max_fence).where(col(Job.max_fence) > 0)
    return {job_id: fence for job_id, fence in session.exec(query).all()}


# --- writing ----------------------------------------------------------------------------------------------------
def insert_claimed(session: Session, *, recovery: Recovery, steps: Sequence[StepRecord]) -> None:
    """Add a claimed recovery with its first steps to the session's transaction (the caller commits)."""
    recovery.seq = len(steps) - 1
    session.add(recovery)
    session.flush()  # the recovery row before its step rows (their foreign key)
    session.execute(insert(STEPS), [_row(recovery.id, seq, record) for seq, record in enumerate(steps)])


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


def take_over(session: Session, *, recovery_id: str, fence: int, owner: str) -> Recovery:
    """Make the holder of `fence` (already claimed on the job) the recovery's owner."""
    recovery = session.get(Recovery, recovery_id)
    if recovery is None:
        raise RepriseError(f"recovery {recovery_id} vanished")
    _check_fence(session, job_id=recovery.job_id, fence=fence)
    recovery.fence, recovery.owner = fence, owner
    session.add(recovery)
    session.commit()
    session.refresh(recovery)
    return recovery


def _check_fence(session: Session, *, job_id: str, fence: int) -> None:
    # Only the fence column: the job's row holds its placement, thousands of ranks at scale.
    highest = session.exec(select(Job.max_fence).where(Job.id == job_id).with_for_update()).one()
    if highest != fence:
        raise FencedOutError(f"job {job_id} is owned by fence {highest}, not {fence}")


# The statements of a transition, built once. Enum columns are bound by name, as SQLAlchemy stores them.
_RECOVERIES = Recovery.__table__  # type: ignore[attr-defined]
_JOBS = Job.__table__  # type: ignore[attr-defined]
_HEAD = (
    core_select(
        _RECOVERIES.c.job_id,
        _RECOVERIES.c.step,
        _RECOVERIES.c.attempt,
        _RECOVERIES.c.seq,
        _RECOVERIES.c.learned,
        _JOBS.c.max_fence,
    )
    .join(_JOBS, _JOBS.c.id == _RECOVERIES.c.job_id)
    .where(_RECOVERIES.c.id == bindparam("rid"))
    .with_for_update(of=_JOBS)
)
_AT_STEP = (STEPS.c.recovery_id == bindparam("rid"), STEPS.c.seq == bindparam("at_seq"))
_ENDED_AT = core_select(STEPS.c.ended_at).where(*_AT_STEP)
_END_STEP = (
    update(STEPS)
    .where(*_AT_STEP, STEPS.c.ended_at.is_(None))
    .values(
        ended_at=bindparam("p_ended_at"),
        data=bindparam("p_data"),
        then=bindparam("p_then"),
        outcome=bindparam("p_outcome"),
    )
)
_INSERT_STEP = insert(STEPS)
_AT_RECOVERY = (_RECOVERIES.c.id == bindparam("rid"), _RECOVERIES.c.seq == bindparam("at_seq"))
_MOVE = (
    update(_RECOVERIES)
    .where(*_AT_RECOVERY)
    .values(step=bindparam("p_step"), attempt=bindparam("p_attempt"), seq=_RECOVERIES.c.seq + 1)
)
_FINISH = _MOVE.values(
    outcome=bindparam("p_outcome"), detail=bindparam("p_detail"), finished_at=bindparam("p_finished_at")
)


@dataclass(frozen=True)
class Ending:
    """The result a step ended with, to record before the transition that follows it."""

    step: RecoveryStep
    attempt: int
    data: StepData
    then: Then
    outcome: Outcome | None = None


@dataclass(frozen=True)
class Current:
    """Where a recovery is, as a transition reads it: its step and attempt, when that step ended, the news."""

    step: RecoveryStep
    attempt: int
    ended_at: datetime | None
    learned: IncidentChange | None


def transition(
    session: Session,
    *,
    recovery_id: str,
    fence: int,
    at: datetime,
    propose: Callable[[Current], Proposal],
    ending: Ending | None = None,
) -> tuple[Answer, Proposal]:
    """One transaction for one transition: record how the current step ended (if `ending`), ask `propose` for the
    next move with the recovery as it now is, ask the policy, and record the next step as begun only when it accepts
    (an end also finishes the recovery and sets the job's end state).

    FencedOutError when fenced out; TransitionRefusedError when the recovery is not at the step and attempt the
    ending or the proposal says. A transition runs for every step of every recovery, so its statements are built
    once (below) and run on the session's connection.
    """
    connection = session.connection()
    head = connection.execute(_HEAD, {"rid": recovery_id}).one_or_none()
    if head is None:
        raise RepriseError(f"recovery {recovery_id} vanished")
    job_id, step, attempt, seq, learned, highest = head
    if highest != fence:
        raise FencedOutError(f"job {job_id} is owned by fence {highest}, not {fence}")
    ended_at = _end_step(connection, recovery_id, ending, step=step, attempt=attempt, seq=seq, at=at)
    proposal = propose(Current(step=step, attempt=attempt, ended_at=ended_at, learned=learned))
    if (step, attempt) != (proposal.from_step, proposal.from_attempt):
        raise TransitionRefusedError(
            f"recovery {recovery_id} is at {step.value} (attempt {attempt}), not at "
            f"{proposal.from_step.value} (attempt {proposal.from_attempt})"
        )
    answer = rules.decide(proposal, recovery_id=recovery_id)
    if answer.decision is Decision.ACCEPT:
        _begin(session, recovery_id, job_id, seq, proposal, fence=fence, at=at)
    session.commit()
    return answer, proposal


def _end_step(
    connection: Connection,
    recovery_id: str,
    ending: Ending | None,
    *,
    step: RecoveryStep,
    attempt: int,
    seq: int,
    at: datetime,
) -> datetime | None:
    """Record how the current step ended (`ending`, at `at`) and say when it ended; without an ending, when it ended
    before (None while it runs). TransitionRefusedError when the ending is not the current step's, or it ended."""
    if ending is None:
        ended_at: datetime | None = connection.execute(
            _ENDED_AT, {"rid": recovery_id, "at_seq": seq}
        ).scalar_one_or_none()
        return ended_at
    if (ending.step, ending.attempt) != (step, attempt):
        raise TransitionRefusedError(f"recovery {recovery_id} is not running {ending.step.value} ({attempt})")
    ended = connection.execute(
        _END_STEP,
        {
            "rid": recovery_id,
            "at_seq": seq,
            "p_ended_at": at,
            "p_data": ending.data.model_dump(mode="json"),
            "p_then": ending.then.value,
            "p_outcome": ending.outcome.value if ending.outcome else None,
        },
    )
    if cast("CursorResult[Any]", ended).rowcount != 1:
        raise TransitionRefusedError(f"recovery {recovery_id}: its {step.value} step already ended")
    return at


def move(session: Session, *, recovery_id: str, fence: int, proposal: Proposal, at: datetime) -> Answer:
    """A transition whose proposal is known beforehand (an end imposed from outside, such as a cancel)."""
    answer, _ = transition(session, recovery_id=recovery_id, fence=fence, at=at, propose=lambda _: proposal)
    return answer


def _begin(
    session: Session, recovery_id: str, job_id: str, seq: int, proposal: Proposal, *, fence: int, at: datetime
) -> None:
    end = proposal.to_step in TERMINAL_STEPS
    record = StepRecord(
        step=proposal.to_step,
        attempt=proposal.to_attempt,
        started_at=at,
        ended_at=at if end else None,
        outcome=proposal.outcome if end else None,
    )
    connection = session.connection()
    connection.execute(_INSERT_STEP, [_row(recovery_id, seq + 1, record)])
    moved = {"rid": recovery_id, "at_seq": seq, "p_step": proposal.to_step.name, "p_attempt": proposal.to_attempt}
    if end:
        state = rules.END_STATE[proposal.to_step]
        detail = "" if proposal.outcome is Outcome.RECOVERED else proposal.detail
        jobs.update_fenced(
            session, job_id=job_id, fence=fence, commit=False, state=state, detail=detail, reserved_nodes=[]
        )
        outcome = proposal.outcome.name if proposal.outcome else None
        result = connection.execute(
            _FINISH, moved | {"p_outcome": outcome, "p_detail": proposal.detail, "p_finished_at": at}
        )
    else:
        result = connection.execute(_MOVE, moved)
    if cast("CursorResult[Any]", result).rowcount != 1:
        raise TransitionRefusedError(f"recovery {recovery_id} moved on meanwhile")


def _row(recovery_id: str, seq: int, record: StepRecord) -> dict[str, Any]:
    return {
        "recovery_id": recovery_id,
        "seq": seq,
        "step": record.step.value,
        "attempt": record.attempt,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "then": record.then.value,
        "outcome": record.outcome.value if record.outcome else None,
        "data": record.data.model_dump(mode="json"),
    }
