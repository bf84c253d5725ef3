"""Incidents: the list with its filters, and one incident with root cause, culprit, evidence and its recovery."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse

from reprise_common.errors import NotFoundError
from reprise_common.events import Category
from reprise_common.settings import IdStr
from reprise_dashboard.incidents.models import stacks_of
from reprise_dashboard.jobs.views import recoveries_of, recovery_view
from reprise_dashboard.render import as_datetime, page
from reprise_dashboard.runtime import RuntimeDep
from reprise_dashboard.upstreams import Fetched, Service

router = APIRouter(tags=["pages"])
INCIDENT_STATES = ("open", "acknowledged", "mitigated", "resolved")  # the detector's IncidentState values
LIST_LIMIT = 100
SUPPRESSED = "suppress"  # the decision of a secondary symptom kept as evidence only


def detection_seconds(incident: Any) -> float | None:
    """Seconds from the first symptom to the incident's opening; None when either time is missing."""
    first, opened = as_datetime(incident.get("first_symptom_at")), as_datetime(incident.get("opened_at"))
    if first is None or opened is None:
        return None
    return max(0.0, (opened - first).total_seconds())


@router.get("/incidents", response_class=HTMLResponse, summary="Incidents, filtered by job, node, state, category")
async def incidents_page(
    request: Request,
    runtime: RuntimeDep,
    *,
    job_id: Annotated[str, Query(max_length=64)] = "",
    node_id: Annotated[str, Query(max_length=64)] = "",
    state: Annotated[str, Query(max_length=32)] = "",
    category: Annotated[str, Query(max_length=32)] = "",
) -> HTMLResponse:
    """Incidents newest first; the detector checks the filters (a bad one shows its answer on the page)."""
    filters = {"job_id": job_id, "node_id": node_id, "state": state, "category": category}
    incidents = await runtime.upstreams.get(Service.DETECTOR, "/v1/incidents", {**filters, "limit": LIST_LIMIT})
    context = {
        "section": "incidents",
        "incidents": incidents,
        "filters": filters,
        "states": INCIDENT_STATES,
        "categories": [c.value for c in Category],
    }
    return page(request, "incidents.html", context)


@router.get("/incidents/{incident_id}", response_class=HTMLResponse, summary="An incident with its evidence")
async def incident_page(incident_id: IdStr, request: Request, runtime: RuntimeDep) -> HTMLResponse:
    """Root cause, culprit node / GPU / rank, recovery, a hang's stacks, evidence with log tails, suppressed ones."""
    now = runtime.clock.now()
    incident = await runtime.upstreams.get(Service.DETECTOR, f"/v1/incidents/{incident_id}")
    if incident.not_found:
        raise NotFoundError(f"the detector knows no incident {incident_id}")
    symptoms: list[dict[str, Any]] = list(incident.data.get("symptoms", [])) if incident.ok and incident.data else []
    recovery: Any = None
    recoveries: Fetched[Any] = Fetched(service=Service.ORCHESTRATOR)
    if incident.ok and incident.data:
        recoveries = await recoveries_of(runtime, str(incident.data["job_id"]))
        linked = [r for r in recoveries.data or [] if r.concerns(incident_id)]
        recovery = recovery_view(linked[0], now=now) if linked else None
    context = {
        "section": "incidents",
        "incident_id": incident_id,
        "incident": incident,
        "evidence": [s for s in symptoms if s.get("decision") != SUPPRESSED],
        "suppressed": [s for s in symptoms if s.get("decision") == SUPPRESSED],
        "recoveries": recoveries,
        "recovery": recovery,
        "stacks": incident.map(stacks_of),  # a stack of the wrong shape is named in its section, the rest renders
        "detection_s": detection_seconds(incident.data) if incident.ok else None,
    }
    return page(request, "incident.html", context)
