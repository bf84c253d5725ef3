"""What one running detector holds, shared by the lifespan, the consumers and the routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import nats.js.errors
from fastapi import Depends, Request
from nats.js.api import DeliverPolicy
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.db import session_scope
from reprise_common.logging import get_logger
from reprise_common.service import Background
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.settings import DetectorSettings

log = get_logger("reprise.detector.runtime")

PLACEMENTS_STREAM = "PLACEMENTS"
AGENT_STREAM = "AGENT"
PLACEMENTS_DURABLE = "detector-placements"
EVENTS_DURABLE = "detector-events"
PLACEMENTS_CATCH_UP_S = 10.0


@dataclass
class Runtime:
    """The detector's engine, bus, clock, placement map and pipeline."""

    settings: DetectorSettings
    engine: Engine
    bus: Bus
    clock: Clock
    placements: PlacementMap
    detector: Detector
    background: Background

    async def start_consumers(self) -> None:
        """Load every job's last placement, then consume agent events (so early symptoms find their jobs)."""
        # The placement map lives in memory: replay the last placement of every job on each start, which a durable
        # consumer only does when it is created, so drop the one a previous run left behind.
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.js.delete_consumer(PLACEMENTS_STREAM, PLACEMENTS_DURABLE)
        info = await self.bus.js.stream_info(PLACEMENTS_STREAM)
        self.bus.consumer(
            stream=PLACEMENTS_STREAM,
            durable=PLACEMENTS_DURABLE,
            filter_subject=subjects.PLACEMENTS_ALL,
            handler=self.placements.handle,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ).start()
        if info.state.messages and not await self.placements.wait_for_seq(
            info.state.last_seq, timeout=PLACEMENTS_CATCH_UP_S
        ):
            log.warning("placements not fully loaded before consuming events", extra={"seq": self.placements.last_seq})
        self.bus.consumer(
            stream=AGENT_STREAM,
            durable=EVENTS_DURABLE,
            filter_subject=subjects.AGENT_EVENTS,
            handler=self.detector.handle,
        ).start()

    async def wait_started(self, timeout: float) -> None:
        """Wait until NATS is connected and the consumers run; TimeoutError otherwise."""
        await asyncio.wait_for(self.background.started.wait(), timeout=timeout)


def get_runtime(request: Request) -> Runtime:
    """The running detector, for a route."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """A database session for one request."""
    with session_scope(runtime.engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
