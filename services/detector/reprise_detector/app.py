"""The detector's FastAPI app: incident routes, ops routes, and a lifespan that runs the consumers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from reprise_common import auth
from reprise_common.bus import Bus
from reprise_common.clock import Clock, SystemClock
from reprise_common.db import db_check, make_engine
from reprise_common.service import (
    ERROR_RESPONSES,
    Background,
    add_error_handlers,
    add_ops_routes,
    nats_check,
    settle_garbage_collector,
)
from reprise_detector import kinds, schema
from reprise_detector.classify import RuleBook, load_rules
from reprise_detector.incidents import views as incident_views
from reprise_detector.nodes import views as node_views
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.peers import PeerErrors
from reprise_detector.nodes.reputation import ReputationRules
from reprise_detector.nodes.witnesses import Witnesses
from reprise_detector.partition import Partition
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.progress.book import ProgressBook
from reprise_detector.progress.hangs import HangWatch
from reprise_detector.progress.limits import HangLimits
from reprise_detector.progress.stragglers import StragglerWatch
from reprise_detector.runtime import Runtime
from reprise_detector.settings import DetectorSettings
from reprise_detector.stack_hangs import SteplessJudge
from reprise_detector.watch import Watcher

SERVICE = "detector"


def build_runtime(settings: DetectorSettings, clock: Clock) -> Runtime:
    """Wire the engine, bus, rules, placement map, pipeline and watch stages; nothing connects yet."""
    engine = make_engine(settings.database_url)
    bus = Bus.for_service(settings, SERVICE)
    placements = PlacementMap()
    partition = Partition(settings.partition_index, settings.partition_count)
    rules = load_rules(settings.rules_path)
    liveness = _liveness(settings, clock)
    peers = _peers(settings, clock, placements=placements, liveness=liveness, rules=rules)
    detector = Detector(
        engine=engine,
        bus=bus,
        placements=placements,
        rules=rules,
        window_s=settings.incident_window_s,
        clock=clock,
        clock_skew_s=settings.event_clock_skew_s,
        early_exit_grace_s=settings.early_exit_grace_s,
        peers=peers,
        liveness=liveness,
        partition=partition,
        reputation_rules=_reputation_rules(settings),
        producers=kinds.producers(clock=clock, rules=rules.derived),  # the derived kinds' own (kinds/)
    )
    book = ProgressBook(clock)
    watcher = Watcher(
        detector=detector,
        placements=placements,
        partition=partition,
        liveness=liveness,
        book=book,
        hangs=_hang_watch(settings, clock, book),
        stragglers=StragglerWatch(
            clock=clock, book=book, factor=settings.straggler_factor, reports=settings.straggler_reports
        ),
        engine=engine,
        clock=clock,
        hang_check_interval_s=settings.hang_check_interval_s,
        bus=bus,
        peers=peers,
        clocks=detector.clocks,
        producers=detector.producers,
    )
    watcher.hangs.unheard = liveness.unheard
    liveness.witness = Witnesses(
        placements=placements, book=book, window_s=settings.node_witness_window_s, settle=watcher.settle
    )
    return Runtime(settings, engine, bus, clock, placements, detector, Background(bus), partition, watcher)


def _liveness(settings: DetectorSettings, clock: Clock) -> Liveness:
    """Every node's liveness, judged by the settings' limits."""
    return Liveness(
        clock=clock,
        lost_after_s=settings.node_lost_after_s,
        reconnect_grace_s=settings.reconnect_grace_s,
        unreachable_after_s=settings.node_unreachable_after_s,
        hold_max_s=settings.node_hold_max_s,
    )


def _peers(
    settings: DetectorSettings, clock: Clock, *, placements: PlacementMap, liveness: Liveness, rules: RuleBook
) -> PeerErrors:
    """The peers' errors that are early evidence of a node's loss, weighed by the settings."""
    return PeerErrors(
        clock=clock,
        placements=placements,
        liveness=liveness,
        rules=rules,
        keep_s=settings.node_lost_after_s,
        factor=settings.node_lost_peer_factor,
    )


def _reputation_rules(settings: DetectorSettings) -> ReputationRules:
    """When a node's faults make it a quarantine candidate, from the settings."""
    return ReputationRules(
        xid=settings.reputation_xid,
        xid_count=settings.reputation_xid_count,
        jobs=settings.reputation_jobs,
        numeric_count=settings.reputation_numeric_count,
        window_s=settings.reputation_window_s,
    )


def _hang_watch(settings: DetectorSettings, clock: Clock, book: ProgressBook) -> HangWatch:
    """The hang stage with the settings' default limits, ranks without steps timed by their stack samples."""
    limits = HangLimits(
        floor_s=settings.hang_floor_s,
        k=settings.hang_k,
        startup_s=settings.hang_startup_s,
        checkpointing_s=settings.hang_checkpointing_s,
        evaluating_s=settings.hang_evaluating_s,
        loading_data_s=settings.hang_loading_data_s,
    )
    stepless = SteplessJudge(limit_s=settings.hang_stepless_s, grace_s=settings.hang_stepless_grace_s)
    return HangWatch(clock=clock, book=book, defaults=limits, stepless=stepless)


def create_app(settings: DetectorSettings, *, clock: Clock | None = None) -> FastAPI:
    """The detector app; its lifespan creates tables, starts consuming, and stops cleanly."""
    runtime = build_runtime(settings, clock or SystemClock())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(schema.upgrade, runtime.engine)
        runtime.background.start(runtime.start_consumers)
        settle_garbage_collector()
        try:
            yield
        finally:
            await runtime.stop()
            await runtime.background.stop()
            runtime.engine.dispose()

    app = FastAPI(
        title="Reprise detector",
        summary="Classifies node symptoms and opens one incident per fault per job.",
        version="0.1.0",
        lifespan=lifespan,
    )
    served: node_views.NodesView = runtime  # the routes read it through their protocols (deps.py)
    app.state.runtime = served
    app.state.engine = runtime.engine  # the shared library's SessionDep reads it
    add_error_handlers(app)
    add_ops_routes(app, checks={"nats": nats_check(runtime.background), "database": db_check(runtime.engine)})
    auth.install(app, auth.authority_keys(settings, runtime.bus))
    app.include_router(incident_views.router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(node_views.router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    app.include_router(node_views.jobs_router, dependencies=auth.BY_METHOD, responses=ERROR_RESPONSES)
    return app
