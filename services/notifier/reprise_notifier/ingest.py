"""From the INCIDENTS and RECOVERIES streams into the outbox: one transaction per batch, acknowledged only after it.

Each event becomes one alert, routed to its destinations; each (event, destination) pair is one delivery whose id
is derived from both, so an event delivered twice by JetStream adds nothing the second time. A recovery event whose
incident the notifier has not seen yet (the two streams are consumed independently) waits a few deliveries for it,
then goes out with what is known.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from reprise_common.clock import Clock
from reprise_common.consumer import Delivery as StreamDelivery
from reprise_common.consumer import Item, Outcome, Verdict
from reprise_common.db import session_scope
from reprise_common.events import IncidentChange, RecoveryChange
from reprise_common.logging import get_logger
from reprise_notifier import metrics
from reprise_notifier.alerts import flows as alert_flows
from reprise_notifier.alerts import service as incidents
from reprise_notifier.alerts.models import Alert
from reprise_notifier.deliveries import service as outbox
from reprise_notifier.deliveries.models import Delivery, delivery_id
from reprise_notifier.routing import Routing

log = get_logger("reprise.notifier.ingest")
ACK = Verdict(Outcome.ACK)


@dataclass(frozen=True)
class IngestRules:
    """Where incident links point and how long a recovery event waits for its incident."""

    dashboard_url: str = ""
    incident_wait_deliveries: int = 3


class Ingest:
    """The batch handler of the notifier's consumers."""

    def __init__(
        self,
        *,
        engine: Engine,
        routing: Routing,
        clock: Clock,
        rules: IngestRules,
        on_queued: Callable[[set[str]], None] = lambda _names: None,
    ) -> None:
        self.engine = engine
        self.routing = routing
        self.clock = clock
        self.rules = rules
        self.on_queued = on_queued  # wakes the workers of the destinations that got new alerts

    async def handle_batch(self, items: list[Item]) -> list[Verdict]:
        """Record the batch's alerts in the outbox in one transaction; every verdict is RETRY if that fails."""
        try:
            verdicts, queued = await asyncio.to_thread(self._commit, items)
        except SQLAlchemyError as exc:
            log.warning("outbox unavailable; events will be redelivered", extra={"error": type(exc).__name__})
            return [Verdict(Outcome.RETRY, "outbox unavailable")] * len(items)
        for destination, kind in queued:
            metrics.ALERTS_QUEUED.labels(destination, kind).inc()
        if queued:
            self.on_queued({destination for destination, _kind in queued})
        return verdicts

    def _commit(self, items: list[Item]) -> tuple[list[Verdict], list[tuple[str, str]]]:
        """Verdicts, and (destination, kind) of each delivery that is new."""
        now = self.clock.now()
        verdicts: list[Verdict] = []
        rows: list[Delivery] = []
        with session_scope(self.engine) as session:
            for item in items:
                event = item.event
                if isinstance(event, IncidentChange):
                    incidents.remember(session, event=event)
                    alert = alert_flows.from_incident(event, dashboard_url=self.rules.dashboard_url)
                elif isinstance(event, RecoveryChange):
                    found = self._recovery_alert(session, event, item.delivery)
                    if found is None:
                        verdicts.append(Verdict(Outcome.RETRY, "waiting for the incident of this recovery"))
                        continue
                    alert = found
                else:  # nothing else is published on these streams today; a newer event type is not ours
                    verdicts.append(ACK)
                    continue
                rows += self._deliveries(alert, now)
                verdicts.append(ACK)
            queued = [(d.destination, d.kind) for d in outbox.enqueue(session, deliveries=rows)]
        return verdicts, queued

    def _recovery_alert(self, session: Session, event: RecoveryChange, delivery: StreamDelivery) -> Alert | None:
        """The recovery's alert; None asks for a redelivery while its incident is not known yet."""
        record = incidents.get(session, incident_id=event.incident_id) if event.incident_id else None
        if record is None and event.incident_id and delivery.num_delivered < self.rules.incident_wait_deliveries:
            return None
        return alert_flows.from_recovery(event, record, dashboard_url=self.rules.dashboard_url)

    def _deliveries(self, alert: Alert, now: datetime) -> list[Delivery]:
        payload = alert.model_dump_json()
        return [
            Delivery(
                id=delivery_id(alert.event_id, destination.name),
                event_id=alert.event_id,
                destination=destination.name,
                kind=alert.kind.value,
                job_id=alert.job_id,
                incident_id=alert.incident_id,
                occurred_at=alert.occurred_at,
                created_at=now,
                payload=payload,
            )
            for destination in self.routing.destinations_for(alert)
        ]
