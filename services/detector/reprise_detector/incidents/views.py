"""Incident routes: list with filters, read one with its symptoms and stacks, resolve."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
from fastapi.exceptions import RequestValidationError

from reprise_common.db import SQL_INT_MAX, SessionDep
from reprise_common.errors import BusError
from reprise_common.events import Category
from reprise_common.service import IsoDateTime
from reprise_detector.deps import RuntimeDep
from reprise_detector.incidents import flows, service
from reprise_detector.incidents.models import (
    IncidentDetail,
    IncidentPublic,
    IncidentsPublic,
    IncidentState,
    RankStackPublic,
    SymptomPublic,
)

router = APIRouter(prefix="/v1/incidents", tags=["incidents"])


@router.get("", summary="List incidents, newest first")
def list_incidents(
    session: SessionDep,
    *,
    job_id: str | None = None,
    node_id: Annotated[str | None, Query(description="culprit node, or any node with a symptom")] = None,
    state: IncidentState | None = None,
    category: Category | None = None,
    since: Annotated[IsoDateTime | None, Query(description="opened at or after (ISO 8601 with a zone)")] = None,
    until: Annotated[IsoDateTime | None, Query(description="opened before (ISO 8601 with a zone)")] = None,
    offset: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> IncidentsPublic:
    """Incidents matching every given filter."""
    if since is not None and until is not None and since >= until:
        raise RequestValidationError(
            [{"loc": ("query", "until"), "msg": "until must be after since", "type": "value_error"}]
        )
    incidents, count = service.get_all(
        session,
        job_id=job_id,
        node_id=node_id,
        state=state,
        category=category,
        since=since,
        until=until,
        offset=offset,
        limit=limit,
    )
    return IncidentsPublic(data=[IncidentPublic.model_validate(i) for i in incidents], count=count)


@router.get("/{incident_id}", summary="One incident with its symptoms")
def read_incident(session: SessionDep, incident_id: str) -> IncidentDetail:
    """An incident and the symptoms attached to it; 404 if unknown."""
    incident = service.get(session, incident_id=incident_id)
    symptoms = [SymptomPublic.model_validate(s) for s in service.get_symptoms(session, incident_id=incident_id)]
    stacks = [RankStackPublic.model_validate(s) for s in service.get_stacks(session, incident_id=incident_id)]
    return IncidentDetail.model_validate(incident, update={"symptoms": symptoms, "stacks": stacks})


@router.post("/{incident_id}/acknowledge", summary="Acknowledge an incident (idempotent)")
async def acknowledge_incident(runtime: RuntimeDep, incident_id: str) -> IncidentPublic:
    """Mark an open incident acknowledged; a resolved one stays resolved; 404 if unknown."""
    return await flows.acknowledge(engine=runtime.engine, clock=runtime.clock, incident_id=incident_id)


@router.post("/{incident_id}/resolve", summary="Resolve an incident (idempotent)")
async def resolve_incident(runtime: RuntimeDep, incident_id: str) -> IncidentPublic:
    """Mark an incident resolved and announce it; 503 when the change could not be published (safe to repeat)."""
    try:
        return await flows.resolve(
            engine=runtime.engine,
            bus=runtime.bus,
            clock=runtime.clock,
            placements=runtime.placements,
            incident_id=incident_id,
        )
    except BusError as exc:
        raise HTTPException(
            status_code=503, detail=f"resolved, but not yet announced ({exc}); repeat the request"
        ) from exc
