"""The orchestrator's FastAPI application and its background work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from redis.asyncio import Redis

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.db import db_check, make_engine
from reprise_common.service import (
    Background,
    add_error_handlers,
    add_ops_routes,
    nats_check,
    settle_garbage_collector,
)
from reprise_orchestrator import schema
from reprise_orchestrator.auth import flows as auth_flows
from reprise_orchestrator.auth import views as auth_views
from reprise_orchestrator.auth.audit import AuditMiddleware
from reprise_orchestrator.auth.dependencies import require_scope, require_scope_for_method
from reprise_orchestrator.auth.models import Scope
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.drills import views as drill_views
from reprise_orchestrator.drills.flows import DrillRunner
from reprise_orchestrator.jobs import views as job_views
from reprise_orchestrator.locks import RedisJobLocks
from reprise_orchestrator.nodes import views as node_views
from reprise_orchestrator.nodes.flows import QuarantineFlow
from reprise_orchestrator.nodes.inventory import Inventory
from reprise_orchestrator.recoveries.flows import RecoveryFlow
from reprise_orchestrator.recoveries.reconciler import Reconciler
from reprise_orchestrator.registry_client import RegistryClient
from reprise_orchestrator.settings import OrchestratorSettings

INCIDENTS_DURABLE = "orchestrator-incidents"
QUARANTINE_DURABLE = "orchestrator-quarantine"


def _redis_check(redis: Redis) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(await redis.ping())

    return check


def create_app(settings: OrchestratorSettings) -> FastAPI:
    """Build the app; consumers start once NATS is reachable."""
    clock = SystemClock()
    engine = make_engine(settings.database_url)
    redis = Redis.from_url(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
    bus = Bus.for_service(settings, "orchestrator")
    deps = Deps(
        settings=settings,
        engine=engine,
        bus=bus,
        locks=RedisJobLocks(redis, ttl_s=settings.lock_ttl_s),
        inventory=Inventory(clock=clock, stale_s=settings.node_stale_s),
        registry=RegistryClient(settings.registry_url, timeout_s=settings.http_timeout_s),
        clock=clock,
    )
    flow = RecoveryFlow(deps)
    reconciler = Reconciler(deps, flow, interval_s=settings.reconcile_interval_s)
    drills = DrillRunner(deps)
    background = Background(bus)
    tasks: list[asyncio.Task[None]] = []

    async def on_connected() -> None:
        await deps.inventory.start(Bus.for_service(settings, "orchestrator-reports", provision=False))
        bus.consumer(
            stream="INCIDENTS",
            durable=INCIDENTS_DURABLE,
            filter_subject=subjects.INCIDENTS_OPENED,
            handler=flow.on_incident,
            ack_wait_s=300.0,
            max_deliver=20,
        ).start()
        bus.consumer(
            stream="NODES",
            durable=QUARANTINE_DURABLE,
            filter_subject=subjects.NODE_QUARANTINE_ALL,
            handler=QuarantineFlow(deps).on_recommendation,
        ).start()
        tasks.append(asyncio.create_task(reconciler.run(), name="reconciler"))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(schema.upgrade, engine)
        auth_flows.bootstrap(deps)
        background.start(on_connected)
        settle_garbage_collector()
        yield
        await drills.stop()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await background.stop()
        await deps.inventory.stop()
        await deps.registry.close()
        await redis.aclose()
        engine.dispose()

    app = FastAPI(title="Reprise orchestrator", version="0.1.0", lifespan=lifespan)
    app.state.deps = deps
    app.state.inventory = deps.inventory
    app.state.reconciler = reconciler
    app.state.drills = drills
    add_ops_routes(app, checks={"nats": nats_check(bus), "redis": _redis_check(redis), "database": db_check(engine)})
    add_error_handlers(app)
    app.add_middleware(AuditMiddleware, engine=engine, clock=clock)
    # Which scope a route needs is decided by its method (auth/dependencies.py); ops routes and docs stay open.
    by_method = [Depends(require_scope_for_method)]
    app.include_router(job_views.router, dependencies=by_method)
    app.include_router(node_views.router, dependencies=by_method)
    app.include_router(drill_views.router, dependencies=by_method)
    app.include_router(auth_views.router, dependencies=[Depends(require_scope(Scope.ADMIN))])
    return app
