"""A job spec has a bound on every value and no field the API does not know: refused with a 422 that names the
field, without echoing a huge input back (real app, NATS, Redis, SQLite)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from reprise_cli.servers import NatsServer

BASE: dict[str, Any] = {"name": "x", "node_count": 1, "command": ["true"]}
MEGABYTE = "v" * 1_000_000


@pytest.fixture
def client(nats_server: NatsServer, admin_client: Any) -> Iterator[TestClient]:
    with admin_client(nats_server.url, command_timeout_s=1.0) as test_client:
        yield test_client


def _locations(response: Any) -> list[str]:
    return [".".join(str(p) for p in err["loc"]) for err in response.json()["detail"]]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"nodez": 3}, "body.nodez"),  # a typo at the top
        ({"policy": {"max_restart": 5}}, "body.policy.max_restart"),  # a typo inside the policy
    ],
)
def test_an_unknown_field_is_refused_and_named(client: TestClient, extra: dict[str, Any], field: str) -> None:
    response = client.post("/v1/jobs", json=BASE | extra)
    assert response.status_code == 422, response.text
    assert field in _locations(response)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"env": {"BIG": MEGABYTE}}, "body.env"),
        ({"env": {f"V{i}": "1" for i in range(1_000)}}, "body.env"),
        ({"env": {"NOT A NAME": "1"}}, "body.env"),
        ({"command": ["x"] * 100_000}, "body.command"),
        ({"command": ["python", MEGABYTE]}, "body.command"),
        ({"command": ["python", "-c", "x" * 100_000], "env": {f"V{i}": "y" * 30_000 for i in range(8)}}, "body"),
        ({"policy": {"non_retryable_exit_codes": list(range(10_000))}}, "body.policy.non_retryable_exit_codes"),
        ({"node_count": 2**70}, "body.node_count"),
    ],
)
def test_values_past_their_bounds_are_refused_without_an_echo(
    client: TestClient, extra: dict[str, Any], field: str
) -> None:
    body = BASE | extra
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text[:500]
    assert any(loc.startswith(field) for loc in _locations(response)), _locations(response)
    assert len(response.content) < 4_096, f"the answer is {len(response.content)} bytes for a {len(json.dumps(body))}"
