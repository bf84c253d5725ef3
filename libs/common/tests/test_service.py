"""What the shared HTTP machinery documents matches what it answers (found by tests/test_fuzz_openapi.py)."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import TypeAdapter, ValidationError

from reprise_cli.client import poll
from reprise_cli.ports import free_port
from reprise_cli.servers import NatsServer
from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.service import Background, IsoDateTime, Readiness, add_ops_routes, nats_check

HTTPX_KEEPALIVE_S = 5.0  # how long httpx keeps an idle connection by default (httpx.Limits.keepalive_expiry)


async def _down() -> bool:
    return False


def test_ops_routes_document_their_content_types_and_the_503() -> None:
    app = FastAPI()
    add_ops_routes(app, checks={"nats": _down})
    paths = app.openapi()["paths"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]  # was application/json
    assert set(paths["/readyz"]["get"]["responses"]) == {"200", "503"}
    with TestClient(app) as client:
        answer = client.get("/readyz")
        metrics = client.get("/metrics")
    assert answer.status_code == 503
    assert Readiness.model_validate(answer.json()) == Readiness(status="not ready", checks={"nats": "down"})
    assert metrics.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("number", ["0.0", "1700000000", " -1e3 ", 0, 1.5])
def test_an_iso_time_refuses_a_bare_number(number: object) -> None:
    with pytest.raises(ValidationError, match="ISO 8601"):
        TypeAdapter(IsoDateTime).validate_python(number)


def test_an_iso_time_takes_iso_8601_with_a_zone() -> None:
    parsed = TypeAdapter(IsoDateTime).validate_python("2026-12-02T05:00:00Z")
    assert parsed == datetime(2026, 12, 2, 5, tzinfo=UTC)
    with pytest.raises(ValidationError):
        TypeAdapter(IsoDateTime).validate_python("2026-12-02T05:00:00")  # no zone


@pytest.mark.parametrize("fails", [False, True])
async def test_a_service_whose_start_hook_failed_is_not_ready_and_says_why(
    nats_server: NatsServer, fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    bus = Bus(url=nats_server.url, service="test-service")
    background = Background(bus)

    async def on_connected() -> None:
        if fails:  # e.g. a durable consumer its NATS identity may not create
            raise BusError("permissions violation for subscription to $JS.API.CONSUMER.CREATE.RECOVERIES")

    app = FastAPI()
    add_ops_routes(app, checks={"nats": nats_check(background)})
    background.start(on_connected)
    assert await poll_until(lambda: bus.connected and (background.started.is_set() or background.failed), timeout_s=10)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        answer = await client.get("/readyz")
    await background.stop()
    assert answer.status_code == (503 if fails else 200), answer.text
    assert ("could not start consuming" in caplog.text) is fails


async def test_a_service_whose_bus_cannot_provision_is_not_ready_and_says_why(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal while connecting (three replicas asked of a server that is not in a cluster) is recorded and logged,
    not lost with the background task."""
    bus = Bus(url=nats_server.url, service="test-service", replicas=3)
    background = Background(bus)

    async def on_connected() -> None:
        raise AssertionError("never reached: the streams could not be provisioned")

    background.start(on_connected)
    assert await poll_until(lambda: background.failed is not None, timeout_s=30)
    assert isinstance(background.failed, BusError)
    assert "could not start consuming" in caplog.text
    await background.stop()


def test_an_idle_connection_outlives_a_client_s_keep_alive(tmp_path: Path) -> None:
    """A client pools an idle connection for 5 s (httpx's default); a server that closes it at the same moment races
    the client's next request, which then fails as "Server disconnected without sending a response"."""
    port = free_port()
    serve = (
        "from fastapi import FastAPI\n"
        "from reprise_common.service import add_ops_routes, run_http_service\n"
        "from reprise_common.settings import ServiceSettings\n"
        "app = FastAPI()\n"
        "add_ops_routes(app, checks={})\n"
        f"run_http_service(app, ServiceSettings(http_port={port}, state_dir={str(tmp_path)!r}))\n"
    )
    server = subprocess.Popen([sys.executable, "-c", serve])
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        assert poll(lambda: _answers(url), bool, timeout_s=30), "the service never answered"
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/healthz")
        answer = conn.getresponse()
        assert answer.status == 200 and answer.read()
        time.sleep(HTTPX_KEEPALIVE_S + 1)
        assert conn.sock is not None
        conn.sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing to read: the connection is open, not closed (b"")
            conn.sock.recv(1, socket.MSG_PEEK)
        conn.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False
