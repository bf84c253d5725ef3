"""The notifier's FastAPI app: delivery routes, ops routes, and a lifespan that runs the workers and consumers."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI

from reprise_common import auth
from reprise_common.bus import Bus
from reprise_common.clock import Clock, SystemClock
from reprise_common.db import db_check, make_engine
from reprise_common.service import ERROR_RESPONSES, Background, add_error_handlers, add_ops_routes, nats_check
from reprise_notifier import schema
from reprise_notifier.deliveries import views as delivery_views
from reprise_notifier.deliveries.flows import DeliveryPolicy, Worker
from reprise_notifier.deliveries.transport import Transport
from reprise_notifier.ingest import Ingest, IngestRules
from reprise_notifier.routing import load_routing
from reprise_notifier.runtime import Runtime
from reprise_notifier.settings import NotifierSettings

SERVICE = "notifier"
# httpx logs every request with its URL at INFO, and a webhook URL is a secret: keep the client libraries quiet.
_URL_LOGGERS = ("httpx", "httpcore")


def build_runtime(
    settings: NotifierSettings,
    clock: Clock,
    *,
    environ: Mapping[str, str] | None = None,
    rng: random.Random | None = None,
) -> Runtime:
    """Wire routing (ConfigError if the routes are wrong), engine, bus, transport, ingest and workers."""
    for name in _URL_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    routing = load_routing(settings, environ)
    engine = make_engine(settings.database_url)
    bus = Bus.for_service(settings, SERVICE)
    transport = Transport(timeout_s=settings.http_timeout_s, clock=clock)
    policy = DeliveryPolicy.from_settings(settings)
    workers = {
        name: Worker(destination=destination, engine=engine, transport=transport, clock=clock, policy=policy, rng=rng)
        for name, destination in routing.destinations.items()
    }
    ingest = Ingest(
        engine=engine,
        routing=routing,
        clock=clock,
        rules=IngestRules(
            dashboard_url=settings.dashboard_url, incident_wait_deliveries=settings.incident_wait_deliveries
        ),
    )
    runtime = Runtime(settings, engine, bus, clock, routing, transport, ingest, workers, Background(bus))
    ingest.on_queued = runtime.wake
    return runtime


def create_app(
    settings: NotifierSettings,
    *,
    clock: Clock | None = None,
    environ: Mapping[str, str] | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    """The notifier app; its lifespan creates tables, sends from the outbox, consumes events, and stops cleanly."""
    runtime = build_runtime(settings, clock or SystemClock(), environ=environ, rng=rng)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(schema.upgrade, runtime.engine)
        await runtime.start_workers()
        runtime.background.start(runtime.start_consumers)
        try:
            yield
        finally:
            await runtime.background.stop()  # consumers settle what they hold, then NATS drains
            await runtime.stop()
            runtime.engine.dispose()

    app = FastAPI(
        title="Reprise notifier",
        summary="Slack and signed-webhook alerts for incidents and recoveries, delivered at least once.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.engine = runtime.engine  # what the routes read (reprise_common.db.SessionDep, deps.py)
    app.state.routing = runtime.routing
    add_error_handlers(app)
    checks = {
        "nats": nats_check(runtime.background),
        "database": db_check(runtime.engine),
        "consumers": runtime.consuming,
    }
    add_ops_routes(app, checks=checks)
    auth.install(app, auth.authority_keys(settings, runtime.bus))
    app.include_router(delivery_views.deliveries_router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(delivery_views.dead_letters_router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(delivery_views.destinations_router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    return app
