"""Remembered incidents: small verbs with keyword-only arguments, no side effects beyond the session."""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.events import IncidentChange, IncidentChangeKind
from reprise_notifier.alerts.models import IncidentRecord


def get(session: Session, *, incident_id: str) -> IncidentRecord | None:
    """The incident as last heard of, or None when no event of it arrived yet."""
    return session.get(IncidentRecord, incident_id)


def remember(session: Session, *, event: IncidentChange) -> IncidentRecord:
    """Create or update the incident from one of its changes; an older change (a late redelivery) changes nothing."""
    record = session.get(IncidentRecord, event.incident_id)
    if record is None:
        record = IncidentRecord(
            id=event.incident_id,
            job_id=event.job_id,
            state=event.change.value,
            category=event.category,
            severity=event.severity,
            root_cause=event.root_cause,
            recommended_action=event.recommended_action,
            first_symptom_at=event.first_symptom_at,
            updated_at=event.time,
        )
    elif event.time < record.updated_at:
        return record
    record.state = "resolved" if event.change is IncidentChangeKind.RESOLVED else "open"
    record.category = event.category
    record.severity = event.severity
    record.root_cause = event.root_cause
    record.recommended_action = event.recommended_action
    record.remember_culprit(event.culprit)
    record.symptom_count = event.symptom_count
    record.first_symptom_at = min(record.first_symptom_at, event.first_symptom_at)
    record.updated_at = event.time
    session.add(record)
    return record
