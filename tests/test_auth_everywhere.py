"""Every HTTP service requires an API key with the right scope, checked the same way: real apps, real NATS and Redis.

The orchestrator is the key authority; the detector, the registry and the notifier ask it over NATS. The routes are
taken from each app's own OpenAPI document, so a route added later is covered without touching this file.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlmodel import Session

from reprise_common.auth import REDACTED
from reprise_common.db import make_engine
from reprise_detector.app import create_app as create_detector
from reprise_detector.settings import DetectorSettings
from reprise_notifier.app import create_app as create_notifier
from reprise_notifier.settings import NotifierSettings
from reprise_orchestrator.app import create_app as create_orchestrator
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.settings import OrchestratorSettings
from reprise_registry.app import create_app as create_registry
from reprise_registry.settings import RegistrySettings

SERVICES = ("detector", "checkpoint-registry", "notifier")
# A read route of each service that answers 200 on an empty database.
LISTING = {"detector": "/v1/incidents", "checkpoint-registry": "/v1/jobs/j/checkpoints", "notifier": "/v1/deliveries"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _service_app(name: str, nats_url: str, root: Path, **auth: Any) -> FastAPI:
    """One of the services that ask the authority, on its own SQLite file."""
    common = {"nats_url": nats_url, "database_url": f"sqlite:///{root / name}.db", **auth}
    if name == "detector":
        return create_detector(DetectorSettings(**common))
    if name == "notifier":
        return create_notifier(NotifierSettings(**common), environ={})
    return create_registry(RegistrySettings(**common, consume_agent_events=False, validate_interval_s=3600.0))


@pytest.fixture
def admin_key(key_authority: OrchestratorSettings) -> str:
    """The authority's bootstrap admin key."""
    assert key_authority.admin_api_key is not None
    return key_authority.admin_api_key.get_secret_value()


@pytest.fixture
def platform(key_authority: OrchestratorSettings, tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """Opens apps on one NATS server: `platform("orchestrator")` is the authority; others take auth settings."""
    with ExitStack() as stack:

        def open_app(name: str, **auth: Any) -> TestClient:
            if name == "orchestrator":
                app = create_orchestrator(key_authority)
            else:
                app = _service_app(name, key_authority.nats_url, tmp_path, **auth)
            client = stack.enter_context(TestClient(app))
            _wait_connected(client)
            return client

        yield open_app


def _wait_connected(client: TestClient) -> None:
    """Until the app's NATS connection is up (its /readyz says nats ok)."""
    for _ in range(200):
        checks = client.get("/readyz").json().get("checks", {})
        if checks.get("nats") == "ok":
            return
        time.sleep(0.05)
    raise AssertionError("the app never connected to NATS")


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method, path) under /v1 the app serves, path parameters filled with a harmless value."""
    found = []
    for path, operations in app.openapi()["paths"].items():
        if not path.startswith("/v1/"):
            continue
        concrete = re.sub(r"\{[^}]+\}", "1", path)
        found += [(method.upper(), concrete) for method in operations]
    return found


@pytest.mark.parametrize("name", SERVICES)  # the orchestrator's own routes: services/orchestrator/tests/test_auth.py
def test_every_route_refuses_a_call_without_a_key_or_with_a_wrong_one(
    platform: Callable[..., TestClient], admin_key: str, name: str
) -> None:
    platform("orchestrator")
    client = platform(name, admin_api_key=admin_key)
    routes = _routes(client.app)  # type: ignore[arg-type]
    assert len(routes) >= 3, routes
    for method, path in routes:
        bare = client.request(method, path, json={})
        assert bare.status_code == 401, (method, path, bare.status_code, bare.text)
        wrong = client.request(method, path, json={}, headers=bearer("rpk_nope_" + secrets.token_urlsafe(32)))
        assert wrong.status_code == 401, (method, path, wrong.status_code, wrong.text)
    assert client.get(LISTING[name], headers=bearer(admin_key)).status_code == 200


@pytest.mark.parametrize("name", SERVICES)
def test_keys_made_at_the_authority_work_everywhere_with_their_scope_and_stop_when_revoked(
    platform: Callable[..., TestClient], admin_key: str, name: str
) -> None:
    authority = platform("orchestrator")
    service = platform(name, auth_cache_ttl_s=0)  # no bootstrap key here: every key is asked about
    made = {
        scope: authority.post(
            "/v1/api-keys", json={"name": f"{scope}-key", "scopes": [scope]}, headers=bearer(admin_key)
        ).json()
        for scope in ("read", "operate")
    }
    reader, operator = bearer(made["read"]["key"]), bearer(made["operate"]["key"])
    assert service.get(LISTING[name], headers=reader).status_code == 200
    mutating = [(m, p) for m, p in _routes(service.app) if m in {"POST", "PUT", "PATCH", "DELETE"}]  # type: ignore[arg-type]
    for method, path in mutating:  # the notifier only reads
        refused = service.request(method, path, json={}, headers=reader)
        assert refused.status_code == 403, (method, path, refused.text)
        assert "operate" in refused.json()["detail"]
        assert service.request(method, path, json={}, headers=operator).status_code not in (401, 403)

    for made_key in made.values():
        assert authority.delete(f"/v1/api-keys/{made_key['id']}", headers=bearer(admin_key)).status_code == 200
    assert service.get(LISTING[name], headers=reader).status_code == 401
    for method, path in mutating:
        gone = service.request(method, path, json={}, headers=operator)
        assert gone.status_code == 401, (method, path, gone.text)


def test_without_the_authority_a_known_key_holds_for_a_while_and_an_unknown_one_is_503(
    platform: Callable[..., TestClient], key_authority: OrchestratorSettings, admin_key: str
) -> None:
    with TestClient(create_orchestrator(key_authority)) as authority:
        _wait_connected(authority)
        key = authority.post("/v1/api-keys", json={"name": "r", "scopes": ["read"]}, headers=bearer(admin_key)).json()[
            "key"
        ]
        detector = platform("detector", admin_api_key=admin_key, auth_cache_ttl_s=0, auth_stale_s=600)
        assert detector.get("/v1/incidents", headers=bearer(key)).status_code == 200
    # The authority is gone: the key seen a moment ago still reads, a new one cannot be checked, the admin key works.
    assert detector.get("/v1/incidents", headers=bearer(key)).status_code == 200
    unknown = detector.get("/v1/incidents", headers=bearer("rpk_x_" + secrets.token_urlsafe(32)))
    assert unknown.status_code == 503, unknown.text
    assert "key authority" in unknown.json()["detail"]
    assert detector.get("/v1/incidents", headers=bearer(admin_key)).status_code == 200


def test_a_read_key_never_sees_job_env_values(
    platform: Callable[..., TestClient], admin_key: str, tmp_path: Path
) -> None:
    authority = platform("orchestrator")
    reader = bearer(
        authority.post("/v1/api-keys", json={"name": "r", "scopes": ["read"]}, headers=bearer(admin_key)).json()["key"]
    )
    spec = {"name": "secret-env", "nodes": ["node-1"], "command": ["true"], "env": {"WANDB_API_KEY": "s3cret"}}
    engine = make_engine(f"sqlite:///{tmp_path / 'orchestrator.db'}")
    with Session(engine) as session:  # a stored job as submit leaves it (placing needs agents this test has not)
        session.add(Job(id="job-env", name="secret-env", spec=spec))
        session.commit()
    engine.dispose()

    seen = authority.get("/v1/jobs/job-env", headers=reader)
    assert seen.status_code == 200, seen.text
    assert seen.json()["spec"]["env"] == {"WANDB_API_KEY": REDACTED}
    listed = authority.get("/v1/jobs", headers=reader).json()["data"]
    assert [row["id"] for row in listed] == ["job-env"]
    assert "s3cret" not in str(listed)
    assert authority.get("/v1/jobs/job-env", headers=bearer(admin_key)).json()["spec"]["env"] == {
        "WANDB_API_KEY": "s3cret"
    }
