"""Node side effects: acting on the detector's quarantine recommendations."""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.bus import Delivery, Outcome
from reprise_common.events import Event, NodeQuarantineRecommended
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.nodes import service

log = get_logger("reprise.orchestrator.nodes")
QUARANTINE_BY = "quarantine"


class QuarantineFlow:
    """Cordons a node the detector recommends quarantining (its running ranks stay until their next recovery)."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    async def on_recommendation(self, event: Event, delivery: Delivery) -> Outcome:
        """Cordon the node; idempotent, so a redelivered recommendation changes nothing."""
        if not isinstance(event, NodeQuarantineRecommended):
            return Outcome.ACK
        reason = f"quarantine recommended ({event.reason.value}): {event.detail}".strip()
        with Session(self.deps.engine) as session:
            changed = service.cordon(
                session, node_id=event.node_id, reason=reason[:2000], by=QUARANTINE_BY, now=self.deps.clock.now()
            )
        if changed:
            log.warning("node quarantined", extra={"node_id": event.node_id, "reason": reason})
        return Outcome.ACK
