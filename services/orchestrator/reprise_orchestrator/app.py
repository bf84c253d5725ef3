"""The orchestrator's FastAPI application and its background work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from redis.asyncio import Redis

from reprise_common import auth, subjects
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.consumer import side_by_side
from reprise_common.db import db_check, make_engine
from reprise_common.errors import BusError
from reprise_common.events import ComputeSignal
from reprise_common.logging import get_logger
from reprise_common.service import (
    ERROR_RESPONSES,
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
from reprise_orchestrator.auth.keys import LocalKeys
from reprise_orchestrator.compute.allocation import AllocatingBackend
from reprise_orchestrator.compute.backend import ComputeBackend
from reprise_orchestrator.compute.choose import BackendContext, open_backend
from reprise_orchestrator.deps import Deps
from reprise_orchestrator.drills import views as drill_views
from reprise_orchestrator.drills.flows import DrillRunner
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs import views as job_views
from reprise_orchestrator.jobs.allocations import AllocationReconciler
from reprise_orchestrator.locks import RedisJobLocks
from reprise_orchestrator.nodes import views as node_views
from reprise_orchestrator.nodes.flows import QuarantineFlow
from reprise_orchestrator.recoveries import service as recoveries
from reprise_orchestrator.recoveries import views as recovery_views
from reprise_orchestrator.recoveries.claims import Claims, job_of
from reprise_orchestrator.recoveries.flows import RecoveryFlow
from reprise_orchestrator.recoveries.reconciler import Reconciler
from reprise_orchestrator.recoveries.runner import RecoveryRunner
from reprise_orchestrator.registry_client import RegistryClient
from reprise_orchestrator.settings import OrchestratorSettings

log = get_logger("reprise.orchestrator")
INCIDENTS_DURABLE = "orchestrator-incidents"
INCIDENT_UPDATES_DURABLE = "orchestrator-incident-updates"
QUARANTINE_DURABLE = "orchestrator-quarantine"
# A claim takes milliseconds; an incident waits (redelivered with a growing delay: 0.5 s, 1 s, ...) only while its job
# is locked by another replica's claim or every replica runs as many recoveries as it may. 50 deliveries span ~10 min.
INCIDENT_MAX_DELIVER = 50
INCIDENT_BATCH = 256


def _redis_check(redis: Redis) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(await redis.ping())

    return check


def _announce(bus: Bus, compute: ComputeBackend) -> Callable[[ComputeSignal], Awaitable[None]]:
    """Publish each failure signal of the compute backend for the rest of the platform (deduplicated by its id)."""

    async def emit(signal: ComputeSignal) -> None:
        log.warning("compute backend signal", extra={"kind": signal.kind.value, "node_id": signal.node_id})
        try:
            await bus.publish(subjects.compute_signal(compute.name), signal)
        except BusError as exc:
            log.warning("could not publish a compute signal", extra={"error": str(exc)})

    return emit


def build_deps(settings: OrchestratorSettings, redis: Redis) -> Deps:
    """The replica's collaborators, its compute backend the one the settings name."""
    clock = SystemClock()
    bus = Bus.for_service(settings, "orchestrator")
    inventory = Inventory(clock=clock, stale_s=settings.node_stale_s)
    return Deps(
        settings=settings,
        engine=make_engine(settings.database_url),
        bus=bus,
        locks=RedisJobLocks(redis, ttl_s=settings.lock_ttl_s),
        compute=open_backend(BackendContext(settings=settings, bus=bus, inventory=inventory, clock=clock)),
        inventory=inventory,
        registry=RegistryClient(
            settings.registry_url, timeout_s=settings.http_timeout_s, api_key=_registry_key(settings)
        ),
        clock=clock,
    )


def create_app(settings: OrchestratorSettings) -> FastAPI:
    """Build the app; consumers start once NATS is reachable."""
    redis = _redis_client(settings)
    deps = build_deps(settings, redis)
    bus, engine = deps.bus, deps.engine
    flow = RecoveryFlow(deps)
    runner = RecoveryRunner(flow, deps.locks, limit=settings.max_concurrent_recoveries)
    claims = Claims(deps, flow, runner)
    reconciler = Reconciler(deps, runner, interval_s=settings.reconcile_interval_s)
    drills = DrillRunner(deps)
    allocations = _allocation_reconciler(deps)
    background = Background(bus)
    keys = LocalKeys(engine, deps.clock)
    tasks: list[asyncio.Task[None]] = []

    async def on_connected() -> None:
        tasks.extend(await _start_work(deps, keys=keys, claims=claims, reconciler=reconciler, allocations=allocations))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(schema.upgrade, engine)
        auth_flows.bootstrap(deps)
        background.start(on_connected)
        settle_garbage_collector()
        yield
        await drills.stop()
        await runner.stop()  # unfinished recoveries are released to the other replicas' reconcilers
        await _stop_work(deps, tasks=tasks, background=background, redis=redis)

    app = FastAPI(title="Reprise orchestrator", version="0.1.0", lifespan=lifespan)
    app.state.deps = deps
    app.state.inventory = deps.inventory
    app.state.reconciler = reconciler
    app.state.runner = runner
    app.state.drills = drills
    add_ops_routes(
        app, checks={"nats": nats_check(background), "redis": _redis_check(redis), "database": db_check(engine)}
    )
    add_error_handlers(app)
    app.add_middleware(AuditMiddleware, engine=engine, clock=deps.clock)
    _mount_routes(app, keys if settings.auth_enabled else None)
    return app


def _redis_client(settings: OrchestratorSettings) -> Redis:
    """The client of the lock store, as the settings' ACL user when they name a password."""
    password = settings.redis_password.get_secret_value() if settings.redis_password is not None else None
    return Redis.from_url(
        settings.redis_url,
        username=settings.redis_username,
        password=password,
        socket_timeout=2.0,
        socket_connect_timeout=2.0,
    )


async def _start_work(
    deps: Deps,
    *,
    keys: LocalKeys,
    claims: Claims,
    reconciler: Reconciler,
    allocations: AllocationReconciler | None,
) -> list[asyncio.Task[None]]:
    """Once NATS is reachable: the key authority, the node reports, the incident and quarantine consumers, and the
    replica's background tasks (returned, to be cancelled at shutdown)."""
    bus, settings, compute = deps.bus, deps.settings, deps.compute
    tasks: list[asyncio.Task[None]] = []
    await bus.serve(subjects.AUTH_VERIFY, keys.answer, queue=subjects.AUTH_VERIFY_QUEUE)  # the key authority
    await deps.inventory.start(
        Bus.for_service(settings, "orchestrator-reports", provision=False, identity="orchestrator")
    )
    for durable, subject, handler in (
        (INCIDENTS_DURABLE, subjects.INCIDENTS_OPENED, claims.on_opened),
        (INCIDENT_UPDATES_DURABLE, subjects.INCIDENTS_UPDATED, claims.on_updated),
    ):
        bus.batch_consumer(
            stream=subjects.INCIDENTS_STREAM,
            durable=durable,
            filter_subject=subject,
            handler=side_by_side(handler, key=job_of),  # different jobs' claims at once, one job's in order
            batch=INCIDENT_BATCH,
            max_deliver=INCIDENT_MAX_DELIVER,
        ).start()
    bus.consumer(
        stream=subjects.NODES_STREAM,
        durable=QUARANTINE_DURABLE,
        filter_subject=subjects.NODE_QUARANTINE_ALL,
        handler=QuarantineFlow(deps).on_recommendation,
    ).start()
    tasks.append(asyncio.create_task(reconciler.run(), name="reconciler"))
    tasks.append(asyncio.create_task(compute.watch(_announce(bus, compute)), name="compute-signals"))
    if allocations is not None:  # its first pass now: a restarted replica catches up at once
        tasks.append(asyncio.create_task(allocations.run(), name="allocations"))
    return tasks


async def _stop_work(deps: Deps, *, tasks: list[asyncio.Task[None]], background: Background, redis: Redis) -> None:
    """Cancel the background tasks, then close the bus, the node reports, the registry, the backend and the stores."""
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await background.stop()
    await deps.inventory.stop()
    await deps.registry.close()
    await deps.compute.close()
    await redis.aclose()
    deps.engine.dispose()


def _allocation_reconciler(deps: Deps) -> AllocationReconciler | None:
    """The reconciler of jobs and allocations when the backend's scheduler allocates nodes (Slurm); else None."""
    if not isinstance(deps.compute, AllocatingBackend):
        return None
    settings = deps.settings
    interval, grace = settings.slurm_poll_interval_s, 3 * settings.slurm_command_timeout_s
    timeout = settings.slurm_agent_start_timeout_s
    return AllocationReconciler(
        deps,
        deps.compute,
        placing=recoveries.is_placing,
        interval_s=interval,
        grace_s=grace,
        agent_start_timeout_s=timeout,
    )


def _registry_key(settings: OrchestratorSettings) -> str | None:
    """The key presented to the registry: its own setting, else the bootstrap admin key."""
    chosen = settings.registry_api_key or settings.admin_api_key
    return chosen.get_secret_value() if chosen is not None else None


def _mount_routes(app: FastAPI, keys: LocalKeys | None) -> None:
    """The /v1 routers behind their keys: which scope a route needs is decided by its method (reprise_common.auth),
    keys and the audit trail need admin; ops routes and docs stay open."""
    auth.install(app, keys)
    for router in (job_views.router, recovery_views.router, node_views.router, drill_views.router):
        app.include_router(router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(
        auth_views.router, dependencies=[Depends(auth.require_scope(auth.Scope.ADMIN))], responses=ERROR_RESPONSES
    )
