"""Incident side effects: announce changes on the bus (deduplicated by message id) and resolve incidents."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Engine

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.db import session_scope
from reprise_common.events import Category, Culprit, IncidentChange, IncidentChangeKind, RecommendedAction, Severity
from reprise_detector.incidents import service
from reprise_detector.incidents.models import Incident, IncidentPublic
from reprise_detector.placements import PlacementMap

SOURCE = "detector"


@dataclass(frozen=True)
class PendingChange:
    """An IncidentChange to publish once the database has committed it."""

    subject: str
    msg_id: str
    event: IncidentChange


def pending_change(
    incident: Incident, kind: IncidentChangeKind, *, seq: int, now: datetime, labels: Mapping[str, str]
) -> PendingChange:
    """The change event for an incident, with its job's labels; its id is stable per (incident, change, count)."""
    msg_id = f"{incident.id}:{kind.value}:{seq}"
    event = IncidentChange(
        event_id=msg_id,
        time=now,
        source=SOURCE,
        change=kind,
        incident_id=incident.id,
        job_id=incident.job_id,
        category=Category(incident.category),
        severity=Severity(incident.severity),
        root_cause=incident.root_cause,
        culprit=Culprit(
            node_id=incident.culprit_node_id,
            gpu=incident.culprit_gpu,
            rank=incident.culprit_rank,
            exit_code=incident.culprit_exit_code,
            restart_epoch=incident.culprit_restart_epoch,
            fault_step=incident.culprit_fault_step,
        ),
        recommended_action=RecommendedAction(incident.recommended_action),
        symptom_count=seq,
        first_symptom_at=incident.first_symptom_at,
        labels=dict(labels),
    )
    return PendingChange(subject=subjects.incident(incident.job_id, kind.value), msg_id=msg_id, event=event)


async def publish_changes(bus: Bus, changes: list[PendingChange]) -> None:
    """Publish committed changes in order; raises BusError so the caller can retry (the ids make that safe)."""
    for change in changes:
        await bus.publish(change.subject, change.event, msg_id=change.msg_id)


async def resolve(
    *, engine: Engine, bus: Bus, clock: Clock, placements: PlacementMap, incident_id: str
) -> IncidentPublic:
    """Resolve an incident and announce it; repeating it re-announces the same change, which the stream dedups."""

    def commit() -> tuple[IncidentPublic, PendingChange]:
        with session_scope(engine) as session:
            incident = service.resolve(session, incident_id=incident_id, now=clock.now())
            labels = placements.labels_of(incident.job_id)
            seq = incident.symptom_count
            change = pending_change(incident, IncidentChangeKind.RESOLVED, seq=seq, now=clock.now(), labels=labels)
            return IncidentPublic.model_validate(incident), change

    public, change = await asyncio.to_thread(commit)
    await publish_changes(bus, [change])
    return public


async def acknowledge(*, engine: Engine, clock: Clock, incident_id: str) -> IncidentPublic:
    """Acknowledge an incident (someone is on it); idempotent, and not announced: the incident itself is unchanged."""

    def commit() -> IncidentPublic:
        with session_scope(engine) as session:
            return IncidentPublic.model_validate(service.acknowledge(session, incident_id=incident_id, now=clock.now()))

    return await asyncio.to_thread(commit)
