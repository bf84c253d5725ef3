"""Fixtures for notifier tests: the real app against a real nats-server, SQLite, and the Slack-compatible receiver."""

from __future__ import annotations

import asyncio
import inspect
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from reprise_cli.servers import NatsServer
from reprise_cli.slack_receiver import SlackReceiver
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.events import (
    Category,
    Culprit,
    Event,
    IncidentChange,
    RecommendedAction,
    RecoveryChange,
    Severity,
    new_id,
)
from reprise_notifier.app import create_app
from reprise_notifier.runtime import INCIDENTS_DURABLE, RECOVERIES_DURABLE, Runtime
from reprise_notifier.settings import NotifierSettings

# The part of a Slack webhook URL that is the secret; no log, answer or metric may ever contain it.
SECRET_PATH = "T0SECRET/B0SECRET/xoxSeCrEtToKeN0123456789"
MakeIncident = Callable[..., IncidentChange]
MakeRecovery = Callable[..., RecoveryChange]

# The bootstrap admin key every test service accepts without asking the key authority.
ADMIN_KEY = secrets.token_urlsafe(32)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _incident(
    job_id: str = "job-1",
    change: str = "opened",
    *,
    incident_id: str | None = None,
    root_cause: str = "XID 79: GPU fell off the bus",
    severity: Severity = Severity.CRITICAL,
    category: Category = Category.GPU_HARDWARE,
    culprit: Culprit | None = None,
    seq: int = 1,
    time: datetime | None = None,
    labels: dict[str, str] | None = None,
) -> IncidentChange:
    """An incident change as the detector publishes it."""
    incident_id = incident_id or f"inc-{new_id()[:10]}"
    now = time or utcnow()
    return IncidentChange(
        event_id=f"{incident_id}:{change}:{seq}",
        time=now,
        source="detector",
        change=change,  # type: ignore[arg-type]  # tests pass the literal values
        incident_id=incident_id,
        job_id=job_id,
        category=category,
        severity=severity,
        root_cause=root_cause,
        culprit=culprit or Culprit(node_id="node-2", gpu=1, rank=3),
        recommended_action=RecommendedAction.RESTART_EXCLUDE_NODE,
        symptom_count=seq,
        first_symptom_at=now - timedelta(seconds=2),
        labels=labels or {},
    )


def _recovery(
    of: IncidentChange,
    change: str = "succeeded",
    *,
    step: str = "running",
    detail: str = "training relaunched",
    labels: dict[str, str] | None = None,
) -> RecoveryChange:
    """A recovery change for an incident, as the orchestrator publishes it (with its job's labels: the incident's)."""
    return RecoveryChange(
        source="orchestrator",
        time=of.time + timedelta(seconds=40),
        change=change,  # type: ignore[arg-type]
        recovery_id=f"rec-{of.incident_id}",
        job_id=of.job_id,
        incident_id=of.incident_id,
        step=step,
        fence=2,
        detail=detail,
        labels=of.labels if labels is None else labels,
    )


@dataclass
class Harness:
    """A running notifier, an HTTP client on it, and a bus to play the detector and the orchestrator."""

    app: FastAPI
    client: httpx.AsyncClient
    platform: Bus
    stack: AsyncExitStack

    @property
    def runtime(self) -> Runtime:
        """The notifier's runtime."""
        runtime: Runtime = self.app.state.runtime
        return runtime

    async def stop(self) -> None:
        """Run the app's shutdown; safe to call twice."""
        await self.stack.aclose()

    async def publish(self, event: Event, *, msg_id: str | None = None) -> int:
        """Publish an incident or recovery change on its subject."""
        if isinstance(event, IncidentChange):
            subject = subjects.incident(event.job_id, event.change)
        else:
            assert isinstance(event, RecoveryChange)
            subject = subjects.recovery(event.job_id, event.change)
        return await self.platform.publish(subject, event, msg_id=msg_id)

    async def settled(self, timeout: float = 15.0) -> None:
        """Wait until both consumers have taken (and acknowledged) everything published so far."""

        async def done() -> bool:
            for stream, durable in (("INCIDENTS", INCIDENTS_DURABLE), ("RECOVERIES", RECOVERIES_DURABLE)):
                info = await self.platform.js.consumer_info(stream, durable)
                if info.num_pending or info.num_ack_pending:
                    return False
            return True

        deadline = asyncio.get_running_loop().time() + timeout
        while not await done():
            assert asyncio.get_running_loop().time() < deadline, "the notifier did not take every event in time"
            await asyncio.sleep(0.02)

    async def get(self, path: str, **params: Any) -> Any:
        """GET a route and return its JSON (asserting 200)."""
        response = await self.client.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()


StartNotifier = Callable[..., Awaitable[Harness]]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[SlackReceiver]:
    """The Slack-compatible receiver on a free port, recording to a JSONL file."""
    found = SlackReceiver(log_path=tmp_path / "slack.jsonl").start()
    yield found
    found.stop()


@pytest.fixture
async def start_notifier(nats_server: NatsServer, sqlite_url: str) -> AsyncIterator[StartNotifier]:
    """Start notifiers on the test's nats-server and database; each is stopped at the end."""
    async with AsyncExitStack() as stack:
        platform = Bus(url=nats_server.url, service="test-platform")
        await platform.connect(attempts=20)
        stack.push_async_callback(platform.close)

        async def start(*, environ: Mapping[str, str] | None = None, **overrides: Any) -> Harness:
            settings = NotifierSettings(
                nats_url=nats_server.url, database_url=sqlite_url, **{"admin_api_key": ADMIN_KEY, **overrides}
            )
            app = create_app(settings, environ=environ or {})
            own = AsyncExitStack()
            stack.push_async_callback(own.aclose)
            await own.enter_async_context(app.router.lifespan_context(app))
            client = await own.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://notifier", headers=ADMIN_HEADERS
                )
            )
            harness = Harness(app=app, client=client, platform=platform, stack=own)
            await harness.runtime.wait_started(timeout=15)
            return harness

        yield start


@pytest.fixture
def make_incident() -> MakeIncident:
    """Build incident changes as the detector publishes them."""
    return _incident


@pytest.fixture
def make_recovery() -> MakeRecovery:
    """Build recovery changes as the orchestrator publishes them."""
    return _recovery


@pytest.fixture
def secret_path() -> str:
    """The secret part of the test's Slack webhook URL."""
    return SECRET_PATH


@pytest.fixture
def slack_url(receiver: SlackReceiver, secret_path: str) -> str:
    """The receiver's webhook URL with the secret path."""
    return receiver.webhook_url(secret_path)


@pytest.fixture
def wait_for() -> Callable[..., Awaitable[None]]:
    """Poll until a predicate (plain or async) holds; the test fails otherwise."""

    async def wait(predicate: Callable[[], object], timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            assert loop.time() < deadline, "condition not reached in time"
            await asyncio.sleep(0.02)

    return wait
