"""Job API: a bad spec is refused with 422 naming the field; labels are kept, shown, filtered and put on events."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.client import poll
from reprise_cli.servers import NatsServer
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import Event, GpuStatus, JobPlacement, NodeReport, parse_event
from reprise_orchestrator.compute.backend import CommandRecord, NodeOutcome

LABELS = {"team": "ml", "example.com/tier": "gold", "empty": ""}


@pytest.fixture
def client(nats_server: NatsServer, admin_client: Any) -> Iterator[TestClient]:
    with admin_client(nats_server.url, command_timeout_s=1.0) as test_client:  # no agent answers: a launch fails fast
        yield test_client


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "command": ["true"]}, "body"),  # neither nodes nor node_count
        ({"name": "x", "node_count": 0, "command": ["true"]}, "node_count"),
        ({"name": "x", "node_count": 1, "command": []}, "command"),
        ({"name": "x", "nodes": ["bad node"], "command": ["true"]}, "nodes"),
        ({"name": "", "node_count": 1, "command": ["true"]}, "name"),
        ({"name": "x", "node_count": 1, "ranks_per_node": 0, "command": ["true"]}, "ranks_per_node"),
        ({"name": "x", "node_count": 1, "command": ["true"], "labels": {"team x": "ml"}}, "labels.team x.[key]"),
        ({"name": "x", "node_count": 1, "command": ["true"], "labels": {"Ex.com/team": "ml"}}, "labels.Ex.com/team"),
        ({"name": "x", "node_count": 1, "command": ["true"], "labels": {"team": "-ml"}}, "labels.team"),
        ({"name": "x", "node_count": 1, "command": ["true"], "labels": {"team": "m" * 64}}, "labels.team"),
        ({"name": "x", "node_count": 1, "command": ["true"], "labels": {"team": 7}}, "labels.team"),
        ({"name": "x", "node_count": 1, "command": ["true"], "labels": {f"k{i}": "v" for i in range(65)}}, "labels"),
    ],
)
def test_bad_spec_is_422_naming_the_field(client: TestClient, body: dict[str, object], field: str) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422
    locations = [".".join(str(p) for p in err["loc"]) for err in response.json()["detail"]]
    assert any(field in loc for loc in locations), locations


def test_unknown_nodes_are_a_conflict(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={"name": "x", "nodes": ["node-9"], "command": ["true"]})
    assert response.status_code == 409
    assert "node-9" in response.json()["detail"]


def test_unknown_job_is_404(client: TestClient) -> None:
    assert client.get("/v1/jobs/job-nope").status_code == 404


def test_readiness_names_each_dependency(client: TestClient) -> None:
    body = client.get("/readyz").json()
    assert set(body["checks"]) == {"nats", "redis", "database"}


async def _last_placement(nats_url: str, job_id: str) -> Event:
    bus = Bus(url=nats_url, service="test-jobs-api", provision=False)
    await bus.connect(attempts=10)
    try:
        message = await bus.js.get_last_msg("PLACEMENTS", subjects.placement(job_id))
        return parse_event(message.data)
    finally:
        await bus.close()


def test_labels_are_kept_shown_filtered_and_put_on_the_placement(client: TestClient, nats_server: NatsServer) -> None:
    assert poll(lambda: client.get("/readyz").status_code, lambda status: status == 200, timeout_s=15) == 200
    node = NodeReport(source="node-1", node_id="node-1", interval_s=1.0, gpu_backend="sim", gpus=[GpuStatus(index=0)])
    client.app.state.inventory.observe("node-1", node)  # type: ignore[attr-defined]  # as its report would
    labelled = client.post("/v1/jobs", json={"name": "a", "node_count": 1, "command": ["true"], "labels": LABELS})
    assert labelled.status_code == 201, labelled.text
    job = labelled.json()
    assert job["labels"] == LABELS and job["spec"]["labels"] == LABELS
    assert job["state"] == "failed"  # no agent answered the launch; the placement was published before it
    assert job["detail"].startswith("the first launch was not done: node-1: no_answer"), job["detail"]
    # No agent answered there, so node-1 is placeable again only once it reports again.
    client.app.state.inventory.observe("node-1", node)  # type: ignore[attr-defined]
    other = client.post("/v1/jobs", json={"name": "b", "node_count": 1, "command": ["true"], "labels": {"team": "web"}})
    client.app.state.inventory.observe("node-1", node)  # type: ignore[attr-defined]
    plain = client.post("/v1/jobs", json={"name": "c", "node_count": 1, "command": ["true"]})
    assert other.status_code == plain.status_code == 201
    assert client.get(f"/v1/jobs/{job['id']}").json()["labels"] == LABELS
    assert plain.json()["labels"] == {}

    placement = asyncio.run(_last_placement(nats_server.url, job["id"]))
    assert isinstance(placement, JobPlacement) and placement.labels == LABELS

    def listed(*selectors: str) -> list[str]:
        response = client.get("/v1/jobs", params={"label": list(selectors)})
        assert response.status_code == 200, response.text
        return [j["name"] for j in response.json()["data"]]

    assert listed() == ["c", "b", "a"]
    assert listed("team=ml") == ["a"]
    assert listed("team=web") == ["b"]
    assert listed("team=ml", "example.com/tier=gold") == ["a"]
    assert listed("team=ml", "example.com/tier=silver") == []
    assert listed("team=ml", "team=web") == []  # every selector must hold
    assert listed("empty=") == ["a"]  # an empty value is a value; a missing key is not
    assert listed("tier=gold") == []
    for bad in ("team", "team x=ml", "team=-ml"):
        response = client.get("/v1/jobs", params={"label": bad})
        assert response.status_code == 422, bad
        assert response.json()["detail"][0]["loc"] == ["query", "label", 0]


def test_why_a_launch_was_not_done_is_one_bounded_line() -> None:
    not_done = [NodeOutcome(node=f"node-{n}", result="failed", error="x" * 1000) for n in range(5)]
    said = CommandRecord(nodes=5, not_done=not_done).why_not_done()
    assert said.startswith("node-0: failed (" + "x" * 200 + "); node-1: failed") and said.endswith("; and 2 more")
    assert len(said) < 800 and "node-3" not in said
    assert CommandRecord(not_done=[NodeOutcome(node="a", result="no_answer")]).why_not_done() == "a: no_answer"
