"""GET /events over real HTTP: incident and recovery changes published on a real nats-server reach every stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
from fastapi import FastAPI

from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.events import Category, Culprit, IncidentChange, RecommendedAction, RecoveryChange, Severity
from reprise_dashboard.app import create_app
from reprise_dashboard.settings import DashboardSettings

Serve = Callable[[FastAPI], AbstractAsyncContextManager[str]]


def incident(job_id: str, incident_id: str) -> IncidentChange:
    """An incident opened as the detector announces it."""
    return IncidentChange(
        source="detector",
        change="opened",
        incident_id=incident_id,
        job_id=job_id,
        category=Category.GPU_HARDWARE,
        severity=Severity.CRITICAL,
        root_cause="XID 79: GPU 1 fell off the bus",
        culprit=Culprit(node_id="node-2", gpu=1, rank=3),
        recommended_action=RecommendedAction.RESTART_EXCLUDE_NODE,
        first_symptom_at=utcnow(),
    )


async def frames(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The stream's events (comments skipped), each as {"event", "id", "data"}."""
    frame: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line:
            if "event" in frame:
                yield frame
            frame = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            frame[field] = json.loads(value) if field == "data" else value


async def test_changes_on_nats_are_pushed_to_every_stream(
    nats_server: NatsServer, serve: Serve, down_settings: Callable[..., DashboardSettings]
) -> None:
    app = create_app(down_settings(nats_url=nats_server.url))
    platform = Bus(url=nats_server.url, service="test-platform")
    await platform.connect(attempts=20)
    try:
        async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=10) as client:
            for _ in range(500):  # the feed subscribes once NATS is connected
                if (await client.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            assert (await client.get("/readyz")).status_code == 200
            async with client.stream("GET", "/events") as first, client.stream("GET", "/events") as second:
                assert first.headers["content-type"].startswith("text/event-stream")
                streams = [frames(first), frames(second)]
                await platform.nc.publish(subjects.incident("job-7", "opened"), b"{not json")  # must not end a stream
                opened = incident("job-7", "inc-7")
                await platform.publish(subjects.incident("job-7", "opened"), opened)
                step = RecoveryChange(
                    source="orchestrator",
                    change="step",
                    recovery_id="rec-7",
                    job_id="job-7",
                    incident_id="inc-7",
                    step="stopping_ranks",
                    fence=2,
                )
                await platform.publish(subjects.recovery("job-7", "step"), step)
                for stream in streams:
                    # Two subjects, two subscriptions: their callbacks may run in either order.
                    got = {f["event"]: f for f in [await asyncio.wait_for(anext(stream), timeout=10) for _ in "ab"]}
                    assert {topic: f["id"] for topic, f in got.items()} == {
                        "incident": opened.event_id,
                        "recovery": step.event_id,
                    }
                    assert got["incident"]["data"]["incident_id"] == "inc-7"
                    assert got["incident"]["data"]["culprit"]["gpu"] == 1
                    assert got["recovery"]["data"]["step"] == "stopping_ranks"
                    assert got["recovery"]["data"]["job_id"] == "job-7"
    finally:
        await platform.close()
