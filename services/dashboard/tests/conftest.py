"""Fixtures for dashboard tests: the real app served by uvicorn on a free port, settings for services that are down."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, HTTPException

from reprise_cli.servers import free_port
from reprise_dashboard.app import create_app
from reprise_dashboard.settings import DashboardSettings

Serve = Callable[[FastAPI], AbstractAsyncContextManager[str]]


@pytest.fixture
def down_settings() -> Callable[..., DashboardSettings]:
    """Settings whose services (and NATS) listen nowhere: every call is refused."""

    def make(**overrides: Any) -> DashboardSettings:
        base = {
            "nats_url": f"nats://127.0.0.1:{free_port()}",
            "orchestrator_url": f"http://127.0.0.1:{free_port()}",
            "detector_url": f"http://127.0.0.1:{free_port()}",
            "registry_url": f"http://127.0.0.1:{free_port()}",
            "notifier_url": f"http://127.0.0.1:{free_port()}",
            "http_timeout_s": 1.0,
            "viewer_auth": "off",  # who may look is tested in test_viewers.py
        }
        return DashboardSettings(**(base | overrides))

    return make


@pytest.fixture
async def in_process() -> AsyncIterator[Callable[[DashboardSettings], Any]]:
    """Run dashboards in process (lifespan included) and give an httpx client for each."""
    stops: list[Callable[[], Any]] = []

    async def start(settings: DashboardSettings) -> httpx.AsyncClient:
        app = create_app(settings)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dashboard")
        stops.append(lambda: lifespan.__aexit__(None, None, None))
        stops.append(client.aclose)
        return client

    yield start
    for stop in reversed(stops):
        await stop()


@pytest.fixture
def serve() -> Serve:
    """Serve an app with uvicorn on a free port (real HTTP, so /events streams); yields its base URL."""

    @asynccontextmanager
    async def serving(app: FastAPI) -> AsyncIterator[str]:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
        task = asyncio.create_task(server.serve())
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started, "uvicorn did not start"
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await task

    return serving


IncidentPage = Callable[[dict[str, Any]], Awaitable[str]]


@pytest.fixture
def incident_page(
    serve: Serve, in_process: Callable[[DashboardSettings], Any], down_settings: Callable[..., DashboardSettings]
) -> IncidentPage:
    """The dashboard's page of one incident, from a detector that answers `GET /v1/incidents/{id}` with `detail` (in
    the detector's shape) over real HTTP; the orchestrator is down."""

    async def page(detail: dict[str, Any]) -> str:
        detector = FastAPI()

        @detector.get("/v1/incidents/{incident_id}")
        async def incident(incident_id: str) -> dict[str, Any]:
            if incident_id != detail["id"]:
                raise HTTPException(404, "no such incident")
            return detail

        async with serve(detector) as detector_url:
            client = await in_process(down_settings(detector_url=detector_url))
            response = await client.get(f"/incidents/{detail['id']}")
        assert response.status_code == 200, response.text
        return str(response.text)

    return page


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) but never answers: a service that hangs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock.getsockname()[1]
