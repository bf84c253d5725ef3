"""Alerts: what the notifier gave up on (dead letters) and each destination's backlog, by name, never by URL."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from reprise_dashboard.render import page
from reprise_dashboard.runtime import RuntimeDep
from reprise_dashboard.upstreams import Service

router = APIRouter(tags=["pages"])
DEAD_LETTERS = 100


@router.get("/alerts", response_class=HTMLResponse, summary="Alerts: the notifier's dead letters and destinations")
async def alerts_page(request: Request, runtime: RuntimeDep) -> HTMLResponse:
    """Alerts given up on, newest first, with the reason; destinations with their backlog (URLs never shown)."""
    dead_letters, destinations = await asyncio.gather(
        runtime.upstreams.get(Service.NOTIFIER, "/v1/dead-letters", {"limit": DEAD_LETTERS}),
        runtime.upstreams.get(Service.NOTIFIER, "/v1/destinations"),
    )
    context = {"section": "alerts", "dead_letters": dead_letters, "destinations": destinations}
    return page(request, "alerts.html", context)
