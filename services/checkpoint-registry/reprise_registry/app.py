"""The registry's FastAPI application and its background work (validation, announcing, retention, NATS)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlalchemy import Engine

from reprise_common import auth, subjects
from reprise_common.bus import Bus
from reprise_common.db import db_check, make_engine
from reprise_common.service import ERROR_RESPONSES, Background, add_error_handlers, add_ops_routes, nats_check
from reprise_registry import db
from reprise_registry.advisor import views as advisor_views
from reprise_registry.checkpoints import announce
from reprise_registry.checkpoints import views as checkpoint_views
from reprise_registry.checkpoints.flows import Registration
from reprise_registry.deps import Deps
from reprise_registry.retention import views as retention_views
from reprise_registry.retention.service import run_retention
from reprise_registry.settings import RegistrySettings
from reprise_registry.validation import recheck
from reprise_registry.validation import views as validation_views
from reprise_registry.validation.service import run_validator

CHECKPOINTS_DURABLE = "registry-checkpoints"
PLACEMENTS_DURABLE = "registry-placements"


def create_app(settings: RegistrySettings) -> FastAPI:
    """Build the app; the schema is migrated to the newest revision on start."""
    write = db.make_write_engine(settings.database_url)
    read = make_engine(settings.database_url) if write.dialect.name == "sqlite" else write
    deps = Deps(settings=settings, engines=db.Engines(read=read, write=write))
    bus = Bus.for_service(settings, "checkpoint-registry")
    background = Background(bus)
    registration = Registration(deps.engines, on_committed=deps.validator_wake.set, roots=settings.checkpoint_roots)

    async def on_connected() -> None:
        if settings.consume_agent_events:
            _consume_agent_events(bus, registration)
        deps.announcer_wake.set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(db.upgrade, write)
        deps.loop = asyncio.get_running_loop()
        tasks = _start_tasks(deps, bus, write)
        background.start(on_connected)
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await background.stop()
        read.dispose()
        write.dispose()

    app = FastAPI(title="Reprise checkpoint registry", version="0.2.0", lifespan=lifespan)
    app.state.deps = deps
    app.state.engine = read
    add_ops_routes(app, checks={"database": db_check(read), "nats": nats_check(background)})
    add_error_handlers(app)
    auth.install(app, auth.authority_keys(settings, bus))
    app.include_router(checkpoint_views.router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(validation_views.router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(retention_views.router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(advisor_views.router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    return app


def _consume_agent_events(bus: Bus, registration: Registration) -> None:
    """Register checkpoints from the agents' events: the placements (which job runs where) and the saves."""
    bus.consumer(
        stream=subjects.PLACEMENTS_STREAM,
        durable=PLACEMENTS_DURABLE,
        filter_subject=subjects.PLACEMENTS_ALL,
        handler=registration.on_placement,
    ).start()
    bus.consumer(
        stream=subjects.AGENT_STREAM,
        durable=CHECKPOINTS_DURABLE,
        filter_subject=subjects.AGENT_CHECKPOINTS_SAVED,
        handler=registration.on_checkpoint_saved,
    ).start()


def _start_tasks(deps: Deps, bus: Bus, write: Engine) -> list[asyncio.Task[None]]:
    """The registry's background work: the validator (with its periodic re-check), the announcer, retention."""
    settings = deps.settings
    return [
        _task(
            run_validator(
                deps.engines,
                wake=deps.validator_wake,
                announced=deps.announcer_wake,
                sample_fraction=settings.validate_sample_fraction,
                workers=settings.hash_workers,
                interval_s=settings.validate_interval_s,
                roots=settings.checkpoint_roots,
                sweep=functools.partial(
                    recheck.sweep,
                    deps.engines,
                    requested=deps.rechecks,
                    plan=recheck.Reverify(
                        interval_s=settings.reverify_interval_s,
                        per_job=settings.reverify_per_job,
                        sample_fraction=settings.reverify_sample_fraction,
                    ),
                    roots=settings.checkpoint_roots,
                    workers=settings.hash_workers,
                ),
            ),
            "validator",
        ),
        _task(
            announce.run_publisher(write, bus, wake=deps.announcer_wake, interval_s=settings.announce_interval_s),
            "announcer",
        ),
        _task(run_retention(deps), "retention"),
    ]


def _task(coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    return asyncio.create_task(coroutine, name=name)
