"""The REST API against the real app: filters, 422 on bad filters, 404, resolve, ops routes, OpenAPI."""

from __future__ import annotations

from typing import Any

import pytest

from reprise_common.events import GpuXid, RankExited

Harness = Any  # the `detector` fixture from tests/conftest.py


@pytest.fixture
async def seeded(detector: Harness) -> Harness:
    """Three jobs with one incident each: hardware on node-1, application on node-2, interconnect on node-3/4."""
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    await h.place("job-b", [(0, "node-2", 0)])
    await h.place("job-c", [(0, "node-3", 0), (1, "node-4", 0)])
    await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79))
    await h.emit("node-2", RankExited(source="node-2", node_id="node-2", job_id="job-b", rank=0, exit_code=1))
    await h.emit("node-3", GpuXid(source="node-3", node_id="node-3", gpu=0, xid=74))
    await h.emit("node-4", RankExited(source="node-4", node_id="node-4", job_id="job-c", rank=1, signal="SIGABRT"))
    await h.settled()
    return h


def _jobs(page: dict[str, Any]) -> list[str]:
    assert page["count"] == len(page["data"])
    return sorted(i["job_id"] for i in page["data"])


FILTER_CASES: list[tuple[dict[str, str], list[str]]] = [
    ({}, ["job-a", "job-b", "job-c"]),
    ({"job_id": "job-b"}, ["job-b"]),
    ({"node_id": "node-1"}, ["job-a"]),
    ({"node_id": "node-4"}, ["job-c"]),  # not the culprit, but a symptom came from there
    ({"category": "interconnect"}, ["job-c"]),
    ({"category": "application"}, ["job-b"]),
    ({"state": "open"}, ["job-a", "job-b", "job-c"]),
    ({"state": "resolved"}, []),
    ({"job_id": "job-a", "category": "application"}, []),
    ({"job_id": "nobody"}, []),
]


async def test_filters(seeded: Harness) -> None:
    for params, jobs in FILTER_CASES:
        assert _jobs(await seeded.incidents(**params)) == jobs, params


async def test_paging_reports_the_full_count(seeded: Harness) -> None:
    page = (await seeded.client.get("/v1/incidents", params={"limit": 2, "offset": 2})).json()
    assert page["count"] == 3 and len(page["data"]) == 1


BAD_FILTERS: list[dict[str, Any]] = [
    {"state": "closed"},
    {"category": "cosmic_rays"},
    {"limit": 0},
    {"limit": 5000},
    {"offset": -1},
    {"since": "yesterday"},
    {"since": "2026-01-01T00:00:00"},  # no zone
    {"since": "0.0"},  # a bare number was read as Unix seconds (found by tests/test_fuzz_openapi.py)
    {"until": "1700000000"},
    {"until": "2026-01-01T00:00:00Z", "since": "2026-01-02T00:00:00Z"},
]


async def test_a_bad_filter_is_422(detector: Harness) -> None:
    for params in BAD_FILTERS:
        response = await detector.client.get("/v1/incidents", params=params)
        assert response.status_code == 422, params
        assert next(iter(params)) in str(response.json()["detail"])


async def test_one_incident_with_its_symptoms(seeded: Harness) -> None:
    [incident] = (await seeded.incidents(job_id="job-c"))["data"]
    detail = await seeded.incident(incident["id"])
    assert detail["symptom_count"] == 2
    assert [(s["node_id"], s["kind"], s["category"]) for s in detail["symptoms"]] == [
        ("node-3", "gpu.xid", "interconnect"),
        ("node-4", "rank.exited", "application"),
    ]
    assert all(s["time"].endswith(("+00:00", "Z")) for s in detail["symptoms"])


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/incidents/nope"), ("POST", "/v1/incidents/nope/resolve")])
async def test_an_unknown_incident_is_404(detector: Harness, method: str, path: str) -> None:
    response = await detector.client.request(method, path)
    assert response.status_code == 404
    assert response.json() == {"detail": "no incident nope"}


async def test_resolve_is_idempotent_and_announced_once(seeded: Harness) -> None:
    h = seeded
    [incident] = (await h.incidents(job_id="job-b"))["data"]
    first = await h.client.post(f"/v1/incidents/{incident['id']}/resolve")
    again = await h.client.post(f"/v1/incidents/{incident['id']}/resolve")
    assert first.status_code == again.status_code == 200
    assert first.json()["state"] == "resolved" and first.json()["resolved_at"] == again.json()["resolved_at"]
    assert _jobs(await h.incidents(state="resolved")) == ["job-b"]
    assert [c.change for c in await h.changes("job-b")] == ["opened", "resolved"]

    # A resolved incident is closed for good: the next fault of the job opens a new one.
    await h.emit("node-2", RankExited(source="node-2", node_id="node-2", job_id="job-b", rank=0, exit_code=1))
    await h.settled()
    assert (await h.incidents(job_id="job-b", state="open"))["count"] == 1


async def test_ops_routes(detector: Harness) -> None:
    assert (await detector.client.get("/healthz")).json() == {"status": "ok"}
    ready = await detector.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"nats": "ok", "database": "ok"}
    assert (await detector.client.get("/metrics")).status_code == 200


async def test_openapi_documents_the_incident_routes(detector: Harness) -> None:
    spec = (await detector.client.get("/openapi.json")).json()
    assert {"/v1/incidents", "/v1/incidents/{incident_id}", "/v1/incidents/{incident_id}/resolve"} <= set(spec["paths"])
    assert spec["paths"]["/v1/incidents"]["get"]["tags"] == ["incidents"]
    assert "IncidentsPublic" in spec["components"]["schemas"]


async def test_time_range_filters(seeded: Harness) -> None:
    opened = sorted(i["opened_at"] for i in (await seeded.incidents())["data"])
    assert len(await _all(seeded, since=opened[0])) == 3
    assert await _all(seeded, until=opened[0]) == []
    latest = opened[-1]
    assert len(await _all(seeded, since=latest, until="2999-01-01T00:00:00Z")) == opened.count(latest)
    assert len(await _all(seeded, until=latest)) == 3 - opened.count(latest)


async def _all(h: Harness, **params: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = (await h.incidents(**params))["data"]
    return data


async def test_acknowledge_is_idempotent_and_resolve_wins(seeded: Harness) -> None:
    h = seeded
    [incident] = (await h.incidents(job_id="job-a"))["data"]
    first = (await h.client.post(f"/v1/incidents/{incident['id']}/acknowledge")).json()
    again = (await h.client.post(f"/v1/incidents/{incident['id']}/acknowledge")).json()
    assert first["state"] == again["state"] == "acknowledged"
    assert first["acknowledged_at"] == again["acknowledged_at"] is not None
    assert _jobs(await h.incidents(state="acknowledged")) == ["job-a"]
    await h.client.post(f"/v1/incidents/{incident['id']}/resolve")
    after = (await h.client.post(f"/v1/incidents/{incident['id']}/acknowledge")).json()
    assert after["state"] == "resolved"
    assert (await h.client.post("/v1/incidents/nope/acknowledge")).status_code == 404
