"""Fixtures for detector tests: the real app (lifespan and all) against a real nats-server and a real database."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI
from sqlmodel import Session, select

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.events import (
    Event,
    IncidentChange,
    JobPlacement,
    NodeQuarantineRecommended,
    NodeReport,
    RankAssignment,
    RankStatus,
    parse_event,
)
from reprise_detector.app import create_app
from reprise_detector.incidents.models import Symptom
from reprise_detector.runtime import EVENTS_DURABLE, Runtime
from reprise_detector.settings import DetectorSettings

E = TypeVar("E", bound=Event)


async def wait_until(predicate: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> bool:
    """Poll an async predicate until it holds or the timeout passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.02)
    return await predicate()


# The bootstrap admin key every test service accepts without asking the key authority.
ADMIN_KEY = secrets.token_urlsafe(32)
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Published:
    """How many node reports the tests' agents have published: every running detector receives each one."""

    reports: int = 0


@dataclass
class Harness:
    """A running detector, an HTTP client on it, and a bus to play the agents and the orchestrator."""

    app: FastAPI
    client: httpx.AsyncClient
    agents: Bus
    stack: AsyncExitStack
    published: Published
    reports_before: int  # reports published before this detector subscribed: it never sees them

    async def stop(self) -> None:
        """Close the client and run the app's shutdown (consumers stop, NATS drains); safe to call twice."""
        await self.stack.aclose()

    @property
    def runtime(self) -> Runtime:
        """The detector's runtime."""
        runtime: Runtime = self.app.state.runtime
        return runtime

    async def place(
        self,
        job_id: str,
        ranks: list[tuple[int, str, int]],
        *,
        epoch: int = 0,
        hang_timeout_s: float | None = None,
        active: bool = True,
        labels: dict[str, str] | None = None,
    ) -> None:
        """Publish a placement: (rank, node, gpu) per rank, and wait until the detector has applied it."""
        assignments = [RankAssignment(rank=r, node_id=n, gpu=g, local_rank=g) for r, n, g in ranks]
        placement = JobPlacement(
            source="orchestrator",
            job_id=job_id,
            restart_epoch=epoch,
            world_size=len(ranks),
            ranks=assignments,
            hang_timeout_s=hang_timeout_s,
            active=active,
            labels=labels or {},
        )
        seq = await self.agents.publish(subjects.placement(job_id), placement)
        assert await self.runtime.placements.wait_for_seq(seq, timeout=10)

    async def emit(self, node_id: str, event: Event) -> int:
        """Publish an agent event on the node's subject, as its agent would."""
        return await self.agents.publish(subjects.node_event(node_id, event.type), event)

    async def settled(self, timeout: float = 30.0) -> None:
        """Wait until the detector has acknowledged every agent event and handled every report published so far."""
        reports = self.runtime.reports
        assert reports is not None
        expected = self.published.reports - self.reports_before
        await self.agents.nc.flush()  # the server has every report published so far, and sends them in order

        async def done() -> bool:
            info = await self.agents.js.consumer_info("AGENT", self.runtime.durable(EVENTS_DURABLE))
            if info.num_ack_pending or info.num_pending:
                return False
            return reports.received >= expected and reports.idle

        if not await wait_until(done, timeout):
            info = await self.agents.js.consumer_info("AGENT", self.runtime.durable(EVENTS_DURABLE))
            raise AssertionError(
                "the detector did not handle every event in time: "
                f"events pending {info.num_pending}, unacknowledged {info.num_ack_pending}; "
                f"reports received {reports.received} of {expected}, handled {reports.handled}, idle {reports.idle}; "
                f"connections made: detector {self.runtime.bus.generation}, agents {self.agents.generation}"
            )

    async def report(self, node_id: str, ranks: list[RankStatus] | None = None, **fields: Any) -> None:
        """Publish a node report as the node's agent would."""
        report = NodeReport(
            source=node_id, node_id=node_id, interval_s=1.0, gpu_backend="sim", ranks=ranks or [], **fields
        )
        await self.report_bytes(node_id, report.to_bytes())

    async def report_bytes(self, node_id: str, data: bytes) -> None:
        """Publish a node report's payload, well-formed or not, on the node's report subject (core NATS)."""
        await self.agents.nc.publish(subjects.node_report(node_id), data)
        self.published.reports += 1

    async def open_incidents(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """Every incident (of a job), newest first."""
        params = {"job_id": job_id} if job_id else {}
        data: list[dict[str, Any]] = (await self.incidents(**params, limit=1000))["data"]
        return data

    async def incidents(self, **params: Any) -> dict[str, Any]:
        """GET /v1/incidents with filters."""
        response = await self.client.get("/v1/incidents", params=params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def incident(self, incident_id: str) -> dict[str, Any]:
        """GET /v1/incidents/{id}."""
        response = await self.client.get(f"/v1/incidents/{incident_id}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def symptoms(self, event_id: str) -> list[Symptom]:
        """Every symptom row recorded for an event."""
        with Session(self.runtime.engine) as session:
            return list(session.exec(select(Symptom).where(Symptom.event_id == event_id)).all())

    async def changes(self, job_id: str) -> list[IncidentChange]:
        """Every IncidentChange stored on the INCIDENTS stream for a job, in order."""
        return await self._stored(f"reprise.incident.{job_id}.>", "INCIDENTS", IncidentChange)

    async def quarantines(self) -> list[NodeQuarantineRecommended]:
        """Every quarantine recommendation stored on the NODES stream not read before, in order."""
        return await self._stored(subjects.NODE_QUARANTINE_ALL, "NODES", NodeQuarantineRecommended)

    async def _stored(self, subject: str, stream: str, kind: type[E]) -> list[E]:
        sub = await self.agents.js.pull_subscribe(subject, stream=stream)
        found: list[E] = []
        try:
            while True:
                for msg in await sub.fetch(100, timeout=0.3):
                    event = parse_event(msg.data)
                    assert isinstance(event, kind)
                    found.append(event)
                    await msg.ack()
        except TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        return found


StartDetector = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start_detector(nats_server: NatsServer) -> AsyncIterator[StartDetector]:
    """Start detectors on the test's nats-server (each with its own lifespan); all are stopped at the end."""
    async with AsyncExitStack() as stack:
        agents = Bus(url=nats_server.url, service="test-agents")
        await agents.connect(attempts=20)
        stack.push_async_callback(agents.close)
        published = Published()

        async def start(database_url: str, clock: Clock | None = None, **overrides: Any) -> Harness:
            settings = DetectorSettings(
                nats_url=nats_server.url, database_url=database_url, **{"admin_api_key": ADMIN_KEY, **overrides}
            )
            app = create_app(settings, clock=clock)
            own = AsyncExitStack()
            stack.push_async_callback(own.aclose)
            await own.enter_async_context(app.router.lifespan_context(app))
            client = await own.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://detector", headers=ADMIN_HEADERS
                )
            )
            harness = Harness(
                app=app, client=client, agents=agents, stack=own, published=published, reports_before=published.reports
            )
            await harness.runtime.wait_started(timeout=15)
            return harness

        yield start


@pytest.fixture
async def detector(start_detector: StartDetector, sqlite_url: str) -> Harness:
    """A detector on SQLite."""
    return await start_detector(sqlite_url)
