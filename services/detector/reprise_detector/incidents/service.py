"""Incident and symptom data access: small verbs with keyword-only arguments, no side effects beyond the session."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, or_
from sqlmodel import Session, col, select

from reprise_common.errors import NotFoundError
from reprise_common.events import Category, Culprit
from reprise_detector.classify import Classification
from reprise_detector.incidents.models import ACTIVE_STATES, Incident, IncidentState, Symptom
from reprise_detector.observe import Observation


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
    count = session.exec(select(func.count()).select_from(query.subquery())).one()
    page = query.order_by(col(Incident.opened_at).desc(), col(Incident.id)).offset(offset).limit(limit)
    return list(session.exec(page).all()), int(count)


def get_active_for_job(session: Session, *, job_id: str, around: datetime, window_s: float) -> Incident | None:
    """The job's newest open or acknowledged incident whose first symptom is within window_s of `around`, locked."""
    query = (
        select(Incident)
        .where(Incident.job_id == job_id, col(Incident.state).in_([s.value for s in ACTIVE_STATES]))
        .order_by(col(Incident.first_symptom_at).desc())
        .with_for_update()
    )
    for incident in session.exec(query):
        if abs((around - incident.first_symptom_at).total_seconds()) <= window_s:
            return incident
    return None


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
    """Open an incident for a job with the given root cause."""
    incident = Incident(
        job_id=job_id,
        category=classification.category,
        severity=classification.severity,
        root_cause=classification.reason,
        recommended_action=classification.action,
        first_symptom_at=first_symptom_at,
        opened_at=now,
        updated_at=now,
    )
    set_culprit(incident, culprit)
    session.add(incident)
    return incident


def upgrade(incident: Incident, *, classification: Classification, culprit: Culprit, now: datetime) -> None:
    """Make a more fundamental cause the incident's root cause."""
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


def add_symptom(
    session: Session,
    *,
    observation: Observation,
    classification: Classification,
    job_id: str | None,
    incident: Incident | None,
    now: datetime,
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
    )
    if incident is not None:
        incident.symptom_count += 1
        incident.updated_at = now
    session.add(symptom)
    return symptom


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
