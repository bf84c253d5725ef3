"""Incident and symptom data access: small verbs with keyword-only arguments, no side effects beyond the session."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_
from sqlmodel import Session, col, select

from reprise_common.db import insert_rows, page_newest_first
from reprise_common.errors import NotFoundError
from reprise_common.events import Category, Culprit, RankStacks, Severity, new_id
from reprise_detector import stacks
from reprise_detector.classify import Classification
from reprise_detector.incidents.models import ACTIVE_STATES, Incident, IncidentState, RankStack, Symptom
from reprise_detector.kinds.base import Observation


def get(session: Session, *, incident_id: str) -> Incident:
    """The incident with this id; NotFoundError if there is none."""
    incident = session.get(Incident, incident_id)
    if incident is None:
        raise NotFoundError(f"no incident {incident_id}")
    return incident


def get_all(
    session: Session,
    *,
    job_id: str | None = None,
    node_id: str | None = None,
    state: IncidentState | None = None,
    category: Category | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    offset: int = 0,
    limit: int = 100,
) -> tuple[list[Incident], int]:
    """Incidents matching every given filter, newest first, and how many match in all."""
    query = select(Incident)
    if job_id is not None:
        query = query.where(Incident.job_id == job_id)
    if node_id is not None:
        on_node = select(Symptom.incident_id).where(Symptom.node_id == node_id)
        query = query.where(or_(col(Incident.culprit_node_id) == node_id, col(Incident.id).in_(on_node)))
    if state is not None:
        query = query.where(Incident.state == state.value)
    if category is not None:
        query = query.where(Incident.category == category.value)
    if since is not None:
        query = query.where(col(Incident.opened_at) >= since)
    if until is not None:
        query = query.where(col(Incident.opened_at) < until)
    return page_newest_first(
        session, query, newest=Incident.opened_at, tiebreak=Incident.id, offset=offset, limit=limit
    )


def get_active(session: Session, *, incident_id: str, job_id: str) -> Incident | None:
    """The incident with this id if it is the job's and still active."""
    incident = session.get(Incident, incident_id)
    if incident is None or incident.job_id != job_id or incident.state not in ACTIVE_STATES:
        return None
    return incident


def get_active_for_job(
    session: Session, *, job_id: str, around: datetime, window_s: float, warning: bool = False
) -> Incident | None:
    """The job's newest open or acknowledged incident whose first symptom is within window_s of `around`, locked.

    Fatal (critical) and warning incidents are kept apart: a straggler warning never absorbs a crash.
    """
    fatal = col(Incident.severity) == Severity.CRITICAL.value
    query = (
        select(Incident)
        .where(Incident.job_id == job_id, col(Incident.state).in_([s.value for s in ACTIVE_STATES]))
        .where(~fatal if warning else fatal)
        .order_by(col(Incident.first_symptom_at).desc())
        .with_for_update()
    )
    for incident in session.exec(query):
        if abs((around - incident.first_symptom_at).total_seconds()) <= window_s:
            return incident
    return None


def get_recorded_for_job(session: Session, *, job_id: str, around: datetime, window_s: float) -> list[Symptom]:
    """The job's secondary symptoms kept without an incident within window_s of `around` (to adopt as evidence)."""
    low, high = around - timedelta(seconds=window_s), around + timedelta(seconds=window_s)
    query = select(Symptom).where(
        Symptom.job_id == job_id,
        col(Symptom.incident_id).is_(None),
        col(Symptom.time) >= low,
        col(Symptom.time) <= high,
    )
    return list(session.exec(query).all())


def get_symptoms_by_events(session: Session, *, event_ids: list[str]) -> dict[str, list[Symptom]]:
    """The symptoms already recorded for each of these events (absent: the event is new).

    Almost every event of a batch is new, so only their ids are looked up first (no ORM objects for rows that are
    not there); the symptoms of the few that were recorded are loaded after.
    """
    recorded: set[str] = set()
    connection = session.connection()
    for start in range(0, len(event_ids), 500):  # within SQLite's oldest limit on bound values
        chunk = event_ids[start : start + 500]
        recorded.update(
            connection.execute(select(col(Symptom.event_id)).where(col(Symptom.event_id).in_(chunk))).scalars()
        )
    found: dict[str, list[Symptom]] = {}
    if recorded:
        for symptom in session.exec(select(Symptom).where(col(Symptom.event_id).in_(sorted(recorded)))).all():
            found.setdefault(symptom.event_id, []).append(symptom)
    return found


def get_symptoms(session: Session, *, incident_id: str) -> list[Symptom]:
    """The symptoms attached to an incident, oldest first."""
    query = select(Symptom).where(Symptom.incident_id == incident_id).order_by(col(Symptom.time), col(Symptom.id))
    return list(session.exec(query).all())


def get_symptoms_by_event(session: Session, *, event_id: str) -> list[Symptom]:
    """The symptoms already recorded for an event (one per affected job); empty when the event is new."""
    return list(session.exec(select(Symptom).where(Symptom.event_id == event_id)).all())


def create(
    session: Session,
    *,
    job_id: str,
    classification: Classification,
    culprit: Culprit,
    first_symptom_at: datetime,
    now: datetime,
) -> Incident:
    """Open an incident for a job with the given root cause (its time, never later than the opening, starts it)."""
    first_symptom_at = min(first_symptom_at, now)
    incident = Incident(
        job_id=job_id,
        category=classification.category,
        severity=classification.severity,
        root_cause=classification.reason,
        recommended_action=classification.action,
        first_symptom_at=first_symptom_at,
        root_cause_at=first_symptom_at,
        opened_at=now,
        updated_at=now,
    )
    set_culprit(incident, culprit)
    session.add(incident)
    return incident


def upgrade(
    incident: Incident, *, classification: Classification, culprit: Culprit, at: datetime, now: datetime
) -> None:
    """Make a more fundamental (or an earlier) cause the incident's root cause."""
    incident.root_cause_at = at
    incident.first_symptom_at = min(incident.first_symptom_at, at, incident.opened_at)
    incident.category = classification.category
    incident.severity = classification.severity
    incident.root_cause = classification.reason
    incident.recommended_action = classification.action
    set_culprit(incident, culprit)
    incident.updated_at = now


def set_culprit(incident: Incident, culprit: Culprit) -> None:
    """Point the incident at a node, GPU and rank."""
    incident.culprit_node_id = culprit.node_id
    incident.culprit_gpu = culprit.gpu
    incident.culprit_rank = culprit.rank
    incident.culprit_exit_code = culprit.exit_code
    incident.culprit_restart_epoch = culprit.restart_epoch
    incident.culprit_fault_step = culprit.fault_step


def add_symptom(
    session: Session,
    *,
    observation: Observation,
    classification: Classification,
    job_id: str | None,
    incident: Incident | None,
    now: datetime,
    decision: str | None = None,
) -> Symptom:
    """Record a symptom for one affected job (or none), attached to an incident if given."""
    symptom = Symptom(
        event_id=observation.event_id,
        incident_id=incident.id if incident is not None else None,
        node_id=observation.node_id,
        job_id=job_id,
        kind=observation.kind,
        gpu=observation.gpu,
        rank=observation.rank,
        detail=observation.detail,
        time=observation.time,
        received_at=now,
        category=classification.category,
        severity=classification.severity,
        recommended_action=classification.action,
        root_cause_grade=classification.root_cause_grade,
        reason=classification.reason,
        decision=decision,
    )
    if incident is not None:
        incident.symptom_count += 1
        incident.updated_at = now
    session.add(symptom)
    return symptom


def symptom_row(
    *,
    observation: Observation,
    classification: Classification,
    job_id: str | None,
    incident_id: str | None,
    now: datetime,
    decision: str | None = None,
) -> dict[str, Any]:
    """A symptom as a plain row for a bulk insert (building ORM objects costs more than the insert in a storm)."""
    return {
        "id": new_id(),
        "event_id": observation.event_id,
        "incident_id": incident_id,
        "node_id": observation.node_id,
        "job_id": job_id,
        "kind": observation.kind,
        "gpu": observation.gpu,
        "rank": observation.rank,
        "detail": observation.detail,
        "time": observation.time,
        "received_at": now,
        "category": classification.category.value,
        "severity": classification.severity.value,
        "recommended_action": classification.action.value,
        "root_cause_grade": classification.root_cause_grade,
        "reason": classification.reason,
        "decision": decision,
        "change": None,
        "change_seq": None,
    }


def set_symptom_count(incident: Incident, *, count: int, now: datetime) -> None:
    """Record how many symptoms an incident has (once per batch: each attribute set on a row costs)."""
    incident.symptom_count = count
    incident.updated_at = now


def insert_symptoms(session: Session, rows: list[dict[str, Any]]) -> None:
    """Insert symptom rows in one statement (IntegrityError when an event was recorded for a job before)."""
    if rows:
        session.flush()  # the incidents the rows point at exist first
        insert_rows(session.connection(), Symptom, rows)
        rows.clear()


def adopt(incident: Incident, symptoms: list[Symptom], *, now: datetime) -> None:
    """Attach symptoms kept on their own to an incident that has just opened (they arrived before their cause).

    They are evidence, not causes, so they do not move the incident's start: an unrelated warning seconds earlier in
    the window would otherwise date it back.
    """
    for symptom in symptoms:
        symptom.incident_id = incident.id
        symptom.decision = "suppress"
    incident.symptom_count += len(symptoms)
    incident.updated_at = now


def acknowledge(session: Session, *, incident_id: str, now: datetime) -> Incident:
    """Acknowledge an open incident; acknowledging again, or a resolved incident, changes nothing."""
    incident = session.exec(select(Incident).where(Incident.id == incident_id).with_for_update()).first()
    if incident is None:
        raise NotFoundError(f"no incident {incident_id}")
    if incident.state == IncidentState.OPEN:
        incident.state = IncidentState.ACKNOWLEDGED
        incident.acknowledged_at = now
        incident.updated_at = now
    return incident


def mitigate(session: Session, *, incident_id: str, now: datetime) -> Incident | None:
    """Mark an open or acknowledged incident mitigated; None when there is no such incident (another detector's)."""
    incident = session.exec(select(Incident).where(Incident.id == incident_id).with_for_update()).first()
    if incident is not None and incident.state in ACTIVE_STATES:
        incident.state = IncidentState.MITIGATED
        incident.updated_at = now
    return incident


def resolve(session: Session, *, incident_id: str, now: datetime) -> Incident:
    """Resolve an incident; resolving a resolved incident changes nothing."""
    incident = session.exec(select(Incident).where(Incident.id == incident_id).with_for_update()).first()
    if incident is None:
        raise NotFoundError(f"no incident {incident_id}")
    if incident.state != IncidentState.RESOLVED:
        incident.state = IncidentState.RESOLVED
        incident.resolved_at = now
        incident.updated_at = now
    return incident


def add_stacks(session: Session, *, incident_id: str, job_id: str, event: RankStacks, now: datetime) -> RankStack:
    """Keep one rank's captured stacks with an incident."""
    row = RankStack(
        event_id=event.event_id,
        incident_id=incident_id,
        job_id=job_id,
        node_id=event.node_id,
        rank=event.rank,
        restart_epoch=event.restart_epoch,
        pid=event.pid,
        proc_state=event.proc_state,
        waits_in=stacks.waits_in(event.threads),
        error=event.error,
        capture_ms=event.capture_ms,
        captured_at=min(event.time, now),
        threads=list(event.threads),
    )
    session.add(row)
    session.flush()
    return row


def get_stacks(session: Session, *, incident_id: str) -> list[RankStack]:
    """The stacks captured for an incident, by rank."""
    query = select(RankStack).where(RankStack.incident_id == incident_id).order_by(col(RankStack.rank))
    return list(session.exec(query).all())


def stack_views(session: Session, *, incident_id: str) -> list[stacks.StackView]:
    """What the culprit rule reads of an incident's stacks."""
    return [
        stacks.StackView(
            rank=row.rank,
            node_id=row.node_id,
            proc_state=row.proc_state,
            waits_in=row.waits_in,
            top=stacks.top_frame(row.threads),
            error=row.error,
        )
        for row in get_stacks(session, incident_id=incident_id)
    ]
