"""The agent's HTTP side: health, readiness, metrics and a status page for people."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from fastapi import FastAPI

from reprise_agent.agent import Agent
from reprise_agent.settings import AgentSettings
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.logging import get_logger
from reprise_common.service import Background, add_ops_routes, nats_check

log = get_logger("reprise.agent")


def chain_sigterm(first: Callable[[], None]) -> None:
    """Call `first` when SIGTERM arrives, then the handler installed before (uvicorn's, which starts the clean stop;
    the server installs it before the app's lifespan starts). Not outside the main thread (an app under a test
    client), where no signal handler can be set."""
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        first()
        if callable(previous):
            previous(signum, frame)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        log.info("SIGTERM not watched: the app does not run in the main thread")


def create_app(settings: AgentSettings) -> FastAPI:
    """Build the agent's app; the agent itself starts once NATS is reachable."""
    bus = Bus(
        url=settings.nats_url,
        service=f"agent-{settings.node_id}",
        nkey_seed_file=settings.nats_nkey_seed_file,
        inbox_prefix=subjects.inbox_prefix(settings.node_id),
        provision=False,
    )
    agent = Agent(settings, bus)
    background = Background(bus)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def on_sigterm() -> None:
            loop.call_soon_threadsafe(agent.terminating)

        chain_sigterm(on_sigterm)
        background.start(agent.start)
        yield
        if background.started.is_set():
            await agent.stop()
        await background.stop()

    app = FastAPI(title=f"Reprise agent {settings.node_id}", version="0.1.0", lifespan=lifespan)
    app.state.agent = agent
    add_ops_routes(app, checks={"nats": nats_check(background)})

    @app.get("/v1/status", tags=["agent"], summary="This node's GPUs, ranks and command state")
    async def status() -> dict[str, Any]:
        report = await agent.reporter.report()
        return {
            "node_id": agent.node_id,
            "gpu_backend": report.gpu_backend,
            "gpu_error": report.gpu_error,
            "spare": settings.spare,
            "gpus": [g.model_dump(mode="json") for g in report.gpus],
            "ranks": [r.model_dump(mode="json") for r in report.ranks],
            "standbys": [s.model_dump(mode="json") for s in report.standbys],
            "commands_executed": agent.book.executed,
            "outbox_depth": len(agent.outbox),
            "outbox_dropped": agent.outbox.dropped,
            "reports_skipped": agent.reporter.skipped,
        }

    return app
