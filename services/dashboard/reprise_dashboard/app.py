"""The dashboard's FastAPI app: the pages, /events (server-sent events), static assets and the ops routes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from reprise_common import auth
from reprise_common.bus import Bus
from reprise_common.clock import Clock, SystemClock
from reprise_common.errors import NotFoundError
from reprise_common.service import Background, add_ops_routes, nats_check
from reprise_dashboard import viewers
from reprise_dashboard.alerts import views as alert_views
from reprise_dashboard.incidents import views as incident_views
from reprise_dashboard.jobs import views as job_views
from reprise_dashboard.live import LiveFeed, event_stream
from reprise_dashboard.nodes import views as node_views
from reprise_dashboard.render import STATIC_DIR, page
from reprise_dashboard.runtime import Runtime, RuntimeDep
from reprise_dashboard.settings import DashboardSettings
from reprise_dashboard.upstreams import Upstreams

SERVICE = "dashboard"
# httpx logs each request with its headers' target at INFO; pages make many calls: keep the client libraries quiet.
_CLIENT_LOGGERS = ("httpx", "httpcore")


def build_runtime(
    settings: DashboardSettings, clock: Clock, *, transport: httpx.AsyncBaseTransport | None = None
) -> Runtime:
    """Wire the service clients, the bus and the live feed."""
    for name in _CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    bus = Bus.for_service(settings, SERVICE)
    upstreams = Upstreams(settings, transport=transport)
    return Runtime(settings, clock, upstreams, bus, LiveFeed(), Background(bus))


def create_app(
    settings: DashboardSettings, *, clock: Clock | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """The dashboard app; its lifespan follows NATS in the background and closes every stream and client at the end."""
    runtime = build_runtime(settings, clock or SystemClock(), transport=transport)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runtime.background.start(lambda: runtime.feed.start(runtime.bus))
        try:
            yield
        finally:
            runtime.feed.close()
            await runtime.background.stop()
            await runtime.upstreams.aclose()

    app = FastAPI(
        title="Reprise dashboard",
        summary="Jobs, incidents, recoveries and nodes for people, updated live.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    add_ops_routes(app, checks={"nats": nats_check(runtime.background), "live feed": runtime.feed.following_check})
    app.add_exception_handler(NotFoundError, _not_found)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_api_route(
        "/events",
        events,
        methods=["GET"],
        tags=["live"],
        response_class=StreamingResponse,
        summary="Server-sent events: every incident and recovery change as it happens",
    )
    for router in (job_views.router, incident_views.router, node_views.router, alert_views.router):
        app.include_router(router)
    viewers.install(
        app, settings.viewer_auth, keys=auth.authority_keys(settings, runtime.bus), header=settings.viewer_header
    )
    return app


async def events(runtime: RuntimeDep) -> StreamingResponse:
    """`event: incident` or `event: recovery`, the change as JSON in `data`; a comment every keepalive interval."""
    return StreamingResponse(
        event_stream(runtime.feed, keepalive_s=runtime.settings.sse_keepalive_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _not_found(request: Request, exc: Exception) -> HTMLResponse:
    return page(request, "not_found.html", {"section": "", "message": str(exc)}, status_code=404)
