"""An incident that gets no recovery is acknowledged with its reason counted on /metrics, never dropped silently.

The orchestrator app on a real nats-server, Redis-compatible server and SQLite; incidents are published to the
INCIDENTS stream as the detector publishes them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import IncidentChange, RecommendedAction, new_id
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState

from . import incidents


@pytest.fixture
def client(nats_server: NatsServer, admin_client: Any) -> Iterator[TestClient]:
    with admin_client(nats_server.url, command_timeout_s=1.0) as test_client:
        yield test_client


def skipped(client: TestClient, reason: str) -> float:
    """How many incident changes the replica acknowledged without a recovery for `reason`."""
    text = client.get("/metrics").text
    found = re.search(rf'^reprise_orchestrator_incidents_skipped_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def _publish(url: str, incident: IncidentChange) -> None:
    bus = Bus(url=url, service="test-skips")
    await bus.connect(attempts=10)
    try:
        await bus.publish(subjects.incident(incident.job_id, incident.change), incident)
    finally:
        await bus.close()


def add_job(client: TestClient, state: JobState) -> str:
    """A job row in `state`, as the orchestrator would have left it."""
    spec = JobCreate(name="j", node_count=1, command=["true"])
    job_id = f"job-{new_id()[:12]}"
    with Session(client.app.state.deps.engine) as session:  # type: ignore[attr-defined]
        session.add(Job(id=job_id, name="j", spec=spec.model_dump(mode="json"), state=state, max_fence=4))
        session.commit()
    return job_id


@pytest.mark.parametrize(
    ("state", "overrides", "reason"),
    [
        (None, {}, "job_not_found"),
        (JobState.HELD, {}, "job_not_recoverable"),
        (JobState.COMPLETED, {}, "job_not_recoverable"),
        (JobState.RUNNING, {"recommended_action": RecommendedAction.NONE}, "not_actionable"),
    ],
    ids=["unknown-job", "held-job", "completed-job", "nothing-recommended"],
)
def test_an_incident_without_a_recovery_is_counted_with_its_reason(
    client: TestClient, nats_server: NatsServer, state: JobState | None, overrides: dict[str, Any], reason: str
) -> None:
    job_id = add_job(client, state) if state is not None else f"job-{new_id()[:12]}"
    before = skipped(client, reason)
    incident = incidents.incident(job_id=job_id, incident_id=f"inc-{new_id()[:12]}", **overrides)
    asyncio.run(_publish(nats_server.url, incident))

    counted = poll(lambda: skipped(client, reason), lambda n: n > before, timeout_s=15)
    assert counted == before + 1, (reason, before, counted)
    if state is not None:
        assert client.get(f"/v1/jobs/{job_id}/recoveries").json()["count"] == 0
        assert client.get(f"/v1/jobs/{job_id}").json()["state"] == state.value
