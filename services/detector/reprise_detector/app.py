"""The detector's FastAPI app: incident routes, ops routes, and a lifespan that runs the consumers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from reprise_common.bus import Bus
from reprise_common.clock import Clock, SystemClock
from reprise_common.db import db_check, make_engine
from reprise_common.service import Background, add_error_handlers, add_ops_routes, nats_check
from reprise_detector.classify import load_rules
from reprise_detector.incidents import views as incident_views
from reprise_detector.incidents.models import create_tables
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.runtime import Runtime
from reprise_detector.settings import DetectorSettings

SERVICE = "detector"


def build_runtime(settings: DetectorSettings, clock: Clock) -> Runtime:
    """Wire the engine, bus, rules, placement map and pipeline; nothing connects yet."""
    engine = make_engine(settings.database_url)
    bus = Bus.for_service(settings, SERVICE)
    placements = PlacementMap()
    detector = Detector(
        engine=engine,
        bus=bus,
        placements=placements,
        rules=load_rules(settings.rules_path),
        window_s=settings.incident_window_s,
        clock=clock,
    )
    return Runtime(settings, engine, bus, clock, placements, detector, Background(bus))


def create_app(settings: DetectorSettings, *, clock: Clock | None = None) -> FastAPI:
    """The detector app; its lifespan creates tables, starts consuming, and stops cleanly."""
    runtime = build_runtime(settings, clock or SystemClock())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(create_tables, runtime.engine)
        runtime.background.start(runtime.start_consumers)
        try:
            yield
        finally:
            await runtime.background.stop()
            runtime.engine.dispose()

    app = FastAPI(
        title="Reprise detector",
        summary="Classifies node symptoms and opens one incident per fault per job.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    add_error_handlers(app)
    add_ops_routes(app, checks={"nats": nats_check(runtime.bus), "database": db_check(runtime.engine)})
    app.include_router(incident_views.router)
    return app
