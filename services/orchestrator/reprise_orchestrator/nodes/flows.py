"""Node side effects: cordons (the orchestrator's record and the compute backend's own), and the detector's
quarantine recommendations."""

from __future__ import annotations

from sqlmodel import Session

from reprise_common.bus import Delivery, Outcome
from reprise_common.events import Event, NodeQuarantineRecommended
from reprise_common.logging import get_logger
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.nodes import service

log = get_logger("reprise.orchestrator.nodes")
QUARANTINE_BY = "quarantine"


async def cordon(
    deps: Deps, *, node_id: str, reason: str, by: str, job_id: str | None = None, incident_id: str | None = None
) -> bool:
    """Give a node no new ranks, in the record and in the backend; False when it already was (the first reason
    stays, and the backend is told again: telling it twice is harmless).

    A recovery's cordon gives the incident it answers, and the backend is told it (`incident <id>: <reason>`), so a
    scheduler's own record of it (Slurm's drain reason in `sinfo -R`) leads an admin to the incident."""
    with Session(deps.engine) as session:
        changed = service.cordon(session, node_id=node_id, reason=reason, by=by, now=deps.clock.now(), job_id=job_id)
    await deps.compute.cordon(node_id, reason=f"incident {incident_id}: {reason}" if incident_id else reason)
    return changed


async def uncordon(deps: Deps, *, node_id: str) -> bool:
    """Make a cordoned node placeable again, in the record and in the backend; False when it was not cordoned."""
    with Session(deps.engine) as session:
        changed = service.uncordon(session, node_id=node_id, now=deps.clock.now())
    if changed:
        await deps.compute.uncordon(node_id)
    return changed


class QuarantineFlow:
    """Cordons a node the detector recommends quarantining (its running ranks stay until their next recovery)."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    async def on_recommendation(self, event: Event, delivery: Delivery) -> Outcome:
        """Cordon the node; idempotent, so a redelivered recommendation changes nothing."""
        if not isinstance(event, NodeQuarantineRecommended):
            return Outcome.ACK
        reason = f"quarantine recommended ({event.reason.value}): {event.detail}".strip()[:2000]
        if await cordon(self.deps, node_id=event.node_id, reason=reason, by=QUARANTINE_BY):
            log.warning("node quarantined", extra={"node_id": event.node_id, "reason": reason})
        return Outcome.ACK
