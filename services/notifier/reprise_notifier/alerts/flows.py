"""From events to alerts: an incident change or a recovery change, joined with what is known of the incident."""

from __future__ import annotations

from reprise_common.events import (
    Category,
    IncidentChange,
    RecommendedAction,
    RecoveryChange,
    RecoveryChangeKind,
    Severity,
)
from reprise_notifier.alerts.models import INCIDENT_KINDS, RECOVERY_KINDS, Alert, AlertKind, IncidentRecord

STACKS_ANCHOR = "stacks"  # the id of the incident page's section that shows the ranks' Python stacks


def incident_link(dashboard_url: str, incident_id: str | None) -> str:
    """The incident's page on the dashboard, or "" when there is no dashboard or no incident."""
    if not dashboard_url or not incident_id:
        return ""
    return f"{dashboard_url}/incidents/{incident_id}"


def stacks_link(dashboard_url: str, incident_id: str | None, category: Category | None) -> str:
    """The Stacks section of a hang's incident page, or "" for another category or without a dashboard."""
    if category is not Category.HANG:
        return ""
    link = incident_link(dashboard_url, incident_id)
    return f"{link}#{STACKS_ANCHOR}" if link else ""


def from_incident(event: IncidentChange, *, dashboard_url: str) -> Alert:
    """The alert an incident change raises."""
    return Alert(
        event_id=event.event_id,
        kind=INCIDENT_KINDS[event.change],
        job_id=event.job_id,
        occurred_at=event.time,
        incident_id=event.incident_id,
        category=event.category,
        severity=event.severity,
        root_cause=event.root_cause,
        culprit=event.culprit,
        recommended_action=event.recommended_action,
        symptom_count=event.symptom_count,
        first_symptom_at=event.first_symptom_at,
        labels=event.labels,
        link=incident_link(dashboard_url, event.incident_id),
        stacks_link=stacks_link(dashboard_url, event.incident_id, event.category),
    )


def from_recovery(event: RecoveryChange, record: IncidentRecord | None, *, dashboard_url: str) -> Alert:
    """The alert a recovery change raises, with the incident's root cause and culprit when the incident is known."""
    kind = RECOVERY_KINDS[event.change]
    alert = Alert(
        event_id=event.event_id,
        kind=kind,
        job_id=event.job_id,
        occurred_at=event.time,
        incident_id=event.incident_id,
        recovery_id=event.recovery_id,
        step=event.step,
        action_taken=action_taken(event),
        labels=event.labels,
        link=incident_link(dashboard_url, event.incident_id),
    )
    if record is None:
        return alert
    recovered = kind is AlertKind.RECOVERED
    category = Category(record.category)  # read back from SQL as plain strings
    return alert.model_copy(
        update={
            "category": category,
            "severity": Severity(record.severity),
            "root_cause": record.root_cause,
            "culprit": record.culprit(),
            "recommended_action": RecommendedAction(record.recommended_action),
            "symptom_count": record.symptom_count,
            "first_symptom_at": record.first_symptom_at,
            "time_to_recover_s": time_to_recover(event, record) if recovered else None,
            "stacks_link": stacks_link(dashboard_url, event.incident_id, category),
        }
    )


def action_taken(event: RecoveryChange) -> str:
    """What the orchestrator did, in one line."""
    where = f"recovery {event.recovery_id} (fence {event.fence})"
    if event.change is RecoveryChangeKind.SUCCEEDED:
        return f"{where}: {event.detail or 'training relaunched'}"
    if event.change is RecoveryChangeKind.FAILED:
        return f"{where} failed at {event.step.value}: {event.detail or 'no detail'}"
    return f"{where}: {event.step.value}" + (f" ({event.detail})" if event.detail else "")


def time_to_recover(event: RecoveryChange, record: IncidentRecord) -> float:
    """Seconds from the incident's first symptom to the recovery's end."""
    return max(0.0, (event.time - record.first_symptom_at).total_seconds())
