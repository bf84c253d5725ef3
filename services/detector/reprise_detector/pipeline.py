"""The detector pipeline: ingest -> classify -> correlate -> persist -> publish, one agent event at a time."""

from __future__ import annotations

import asyncio
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import Session

from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.clock import Clock
from reprise_common.db import session_scope
from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import Event
from reprise_common.logging import get_logger
from reprise_detector.classify import Classification, RuleBook
from reprise_detector.correlate import Decision, Target, decide, targets
from reprise_detector.incidents import service
from reprise_detector.incidents.flows import PendingChange, pending_change, publish_changes
from reprise_detector.incidents.models import IncidentChangeKind, Symptom
from reprise_detector.observe import IngestError, Observation, observe
from reprise_detector.placements import PlacementMap

log = get_logger("reprise.detector.pipeline")


class Detector:
    """Turns agent symptoms into incidents; every stage is idempotent per event id."""

    def __init__(
        self, *, engine: Engine, bus: Bus, placements: PlacementMap, rules: RuleBook, window_s: float, clock: Clock
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.placements = placements
        self.rules = rules
        self.window_s = window_s
        self.clock = clock

    async def handle(self, event: Event, delivery: Delivery) -> Outcome:
        """Consumer handler for agent events; acknowledges only after the database commit and the publish."""
        try:
            observation = observe(event, delivery.subject)
        except IngestError as exc:
            raise MalformedEventError(str(exc)) from exc
        if observation is None:
            return Outcome.ACK
        classification = self.rules.classify(observation.event)
        affected = targets(observation, self.placements)
        try:
            changes = await asyncio.to_thread(self.persist, observation, classification, affected)
        except OperationalError as exc:
            log.warning("database unavailable; will retry", extra={"error": str(exc).splitlines()[0]})
            return Outcome.RETRY
        try:
            await publish_changes(self.bus, changes)
        except BusError as exc:
            log.warning("could not publish incident changes; will retry", extra={"error": str(exc)})
            return Outcome.RETRY
        return Outcome.ACK

    def persist(
        self, observation: Observation, classification: Classification, affected: list[Target]
    ) -> list[PendingChange]:
        """Record the symptom and its incident changes in one transaction; a repeated event replays its changes."""
        try:
            with session_scope(self.engine) as session:
                existing = service.get_symptoms_by_event(session, event_id=observation.event_id)
                if existing:
                    return self._replay(session, existing)
                return self._correlate(session, observation, classification, affected)
        except IntegrityError:
            # The same event was committed concurrently (another delivery); replay what that one recorded.
            with session_scope(self.engine) as session:
                existing = service.get_symptoms_by_event(session, event_id=observation.event_id)
                if not existing:
                    raise
                return self._replay(session, existing)

    def _correlate(
        self, session: Session, observation: Observation, classification: Classification, affected: list[Target]
    ) -> list[PendingChange]:
        now = self.clock.now()
        if not affected:
            service.add_symptom(
                session, observation=observation, classification=classification, job_id=None, incident=None, now=now
            )
            return []
        changes = [self._apply(session, observation, classification, target, now) for target in affected]
        return [change for change in changes if change is not None]

    def _apply(
        self, session: Session, observation: Observation, classification: Classification, target: Target, now: datetime
    ) -> PendingChange | None:
        incident = service.get_active_for_job(
            session, job_id=target.job_id, around=observation.time, window_s=self.window_s
        )
        decision = decide(classification, incident)
        if decision is Decision.OPEN:
            incident = service.create(
                session,
                job_id=target.job_id,
                classification=classification,
                culprit=target.culprit,
                first_symptom_at=observation.time,
                now=now,
            )
        elif decision is Decision.UPGRADE and incident is not None:
            service.upgrade(incident, classification=classification, culprit=target.culprit, now=now)
        joined = incident if decision is not Decision.RECORD else None
        symptom = service.add_symptom(
            session,
            observation=observation,
            classification=classification,
            job_id=target.job_id,
            incident=joined,
            now=now,
        )
        log.info(
            "symptom correlated",
            extra={"event_id": observation.event_id, "job_id": target.job_id, "decision": decision.value},
        )
        if joined is None:
            return None
        kind = IncidentChangeKind.OPENED if decision is Decision.OPEN else IncidentChangeKind.UPDATED
        symptom.change, symptom.change_seq = kind, joined.symptom_count
        return pending_change(joined, kind, seq=joined.symptom_count, now=now)

    def _replay(self, session: Session, existing: list[Symptom]) -> list[PendingChange]:
        now = self.clock.now()
        changes: list[PendingChange] = []
        for symptom in existing:
            if symptom.incident_id is None or symptom.change is None or symptom.change_seq is None:
                continue
            incident = service.get(session, incident_id=symptom.incident_id)
            kind = IncidentChangeKind(symptom.change)
            changes.append(pending_change(incident, kind, seq=symptom.change_seq, now=now))
        log.info("event already recorded; replaying its changes", extra={"changes": len(changes)})
        return changes
