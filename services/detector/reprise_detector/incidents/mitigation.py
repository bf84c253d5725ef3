"""Recovery outcomes from the orchestrator: an incident whose recovery brought its job back is mitigated.

A recovery that failed or was held (it waits for a person) leaves its incident open. Nothing is published: the
`IncidentChange` schema carries no state, and an `updated` change would tell the orchestrator its incident learned
more.
"""

from __future__ import annotations

import asyncio

from sqlalchemy.engine import Engine

from reprise_common.bus import Delivery, Outcome
from reprise_common.clock import Clock
from reprise_common.db import session_scope
from reprise_common.errors import MalformedEventError
from reprise_common.events import Event, RecoveryChange, RecoveryChangeKind
from reprise_common.logging import get_logger
from reprise_detector.incidents import service
from reprise_detector.incidents.models import IncidentState
from reprise_detector.partition import Partition

log = get_logger("reprise.detector.mitigation")


class RecoveryOutcomes:
    """Consumer handler for the RECOVERIES stream: mitigates the incidents of this replica's jobs that recovered."""

    def __init__(self, *, engine: Engine, clock: Clock, partition: Partition) -> None:
        self.engine = engine
        self.clock = clock
        self.partition = partition

    async def handle(self, event: Event, delivery: Delivery) -> Outcome:
        """Mitigate the incident of a succeeded recovery; every other change is only read."""
        if not isinstance(event, RecoveryChange):
            raise MalformedEventError(f"a {event.model_dump().get('type')} event on the recoveries stream")
        succeeded = event.change is RecoveryChangeKind.SUCCEEDED
        if not succeeded or event.incident_id is None or not self.partition.owns_job(event.job_id):
            return Outcome.ACK
        mitigated = await asyncio.to_thread(self._mitigate, event.incident_id)
        if mitigated:
            log.info(
                "incident mitigated by its recovery",
                extra={"incident_id": event.incident_id, "recovery_id": event.recovery_id, "outcome": event.outcome},
            )
        return Outcome.ACK

    def _mitigate(self, incident_id: str) -> bool:
        with session_scope(self.engine) as session:
            incident = service.mitigate(session, incident_id=incident_id, now=self.clock.now())
            return incident is not None and incident.state == IncidentState.MITIGATED
