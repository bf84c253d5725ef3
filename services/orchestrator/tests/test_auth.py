"""API keys and scopes against the real app (real NATS, Redis, SQLite): who may call what, and the audit trail."""

from __future__ import annotations

import re
import secrets
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi import APIRouter, Depends, FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError

from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import NatsServer
from reprise_common.auth import require_scope_for_method
from reprise_orchestrator.app import create_app
from reprise_orchestrator.settings import OrchestratorSettings

ADMIN_KEY = secrets.token_urlsafe(32)
OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
ADMIN_PREFIXES = ("/v1/api-keys", "/v1/audit")
SCOPE_ORDER = ["read", "operate", "admin"]


def _failing_router() -> APIRouter:
    """A job route whose handler raises an unhandled error, mounted the way app.py mounts domain routers."""
    router = APIRouter(prefix="/v1/jobs")

    @router.post("/{job_id}/explode")
    def explode(job_id: str) -> None:
        raise RuntimeError(f"handler failed for {job_id}")

    return router


@pytest.fixture
def settings(nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path) -> OrchestratorSettings:
    return OrchestratorSettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'o.db'}",
        admin_api_key=ADMIN_KEY,
    )


def _app(settings: OrchestratorSettings) -> FastAPI:
    app = create_app(settings)
    app.include_router(_failing_router(), dependencies=[Depends(require_scope_for_method)])
    return app


@pytest.fixture
def app(settings: OrchestratorSettings) -> FastAPI:
    return _app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create_key(client: TestClient, scope: str, name: str | None = None) -> dict[str, str]:
    response = client.post(
        "/v1/api-keys", json={"name": name or f"{scope}-key", "scopes": [scope]}, headers=_auth(ADMIN_KEY)
    )
    assert response.status_code == 201, response.text
    body: dict[str, str] = response.json()
    return body


def _routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method, concrete path) the app serves outside the open ops and docs routes, from its OpenAPI."""
    found = []
    for template, operations in app.openapi()["paths"].items():
        if template not in OPEN_PATHS:
            path = re.sub(r"\{[^}]+\}", "x", template)
            found += [(method.upper(), path) for method in operations]
    return found


def _needed(method: str, path: str) -> str:
    if path.startswith(ADMIN_PREFIXES):
        return "admin"
    return "read" if method in ("GET", "HEAD") else "operate"


# --- who may call what ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["none", "wrong", "revoked"])
def test_every_route_refuses_a_missing_wrong_or_revoked_key_with_401(
    client: TestClient, app: FastAPI, kind: str
) -> None:
    headers = {}
    if kind == "wrong":
        headers = _auth(ADMIN_KEY[:-1] + ("A" if ADMIN_KEY[-1] != "A" else "B"))
    elif kind == "revoked":
        created = _create_key(client, "admin")
        assert client.delete(f"/v1/api-keys/{created['id']}", headers=_auth(ADMIN_KEY)).status_code == 200
        headers = _auth(created["key"])
    routes = _routes(app)
    wrong = []
    for method, path in routes:
        response = client.request(method, path, headers=headers)
        if response.status_code != 401 or response.headers.get("www-authenticate") != "Bearer":
            wrong.append((method, path, response.status_code))
    assert wrong == [], f"expected 401 with WWW-Authenticate: Bearer: {wrong}"
    assert {("POST", "/v1/jobs"), ("GET", "/v1/nodes"), ("GET", "/v1/audit")} <= set(routes)


@pytest.mark.parametrize("scope", SCOPE_ORDER)
def test_each_scope_reaches_exactly_the_routes_it_implies(client: TestClient, app: FastAPI, scope: str) -> None:
    key = _create_key(client, scope)["key"]
    routes = _routes(app)
    wrong = []
    for method, path in routes:
        needed = _needed(method, path)
        allowed = SCOPE_ORDER.index(scope) >= SCOPE_ORDER.index(needed)
        response = client.request(method, path, headers=_auth(key))
        if allowed and response.status_code in (401, 403):
            wrong.append((method, path, response.status_code, "should pass"))
        if not allowed and (response.status_code != 403 or repr(needed) not in response.json()["detail"]):
            wrong.append((method, path, response.status_code, f"should be 403 naming {needed!r}"))
    assert wrong == [], wrong
    expected = {
        ("GET", "/v1/jobs"),
        ("GET", "/v1/jobs/x"),
        ("GET", "/v1/jobs/x/recoveries"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/nodes"),
        ("POST", "/v1/api-keys"),
        ("GET", "/v1/api-keys"),
        ("DELETE", "/v1/api-keys/x"),
        ("GET", "/v1/audit"),
    }
    assert expected <= set(routes), expected - set(routes)


def test_403_says_which_scope_is_missing(client: TestClient) -> None:
    reader = _create_key(client, "read", name="dashboard")
    response = client.post("/v1/jobs", json={}, headers=_auth(reader["key"]))
    assert response.status_code == 403
    assert response.json()["detail"] == "API key 'dashboard' lacks the 'operate' scope that POST /v1/jobs needs"
    operator = _create_key(client, "operate")
    assert "'admin'" in client.get("/v1/audit", headers=_auth(operator["key"])).json()["detail"]


def test_x_api_key_header_works_and_other_schemes_do_not(client: TestClient) -> None:
    assert client.get("/v1/jobs", headers={"X-API-Key": ADMIN_KEY}).status_code == 200
    assert client.get("/v1/jobs", headers={"Authorization": f"Basic {ADMIN_KEY}"}).status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": f"bearer {ADMIN_KEY}"}).status_code == 200


def test_ops_routes_and_api_docs_stay_open(client: TestClient) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"):
        assert client.get(path).status_code in (200, 503), path  # /readyz may wait for NATS: never 401
    schemes = client.get("/openapi.json").json()["components"]["securitySchemes"]
    assert {"HTTPBearer", "APIKeyHeader"} <= set(schemes)


# --- keys ----------------------------------------------------------------------------------------------------------
def test_a_new_key_is_shown_once_and_never_listed(client: TestClient) -> None:
    created = _create_key(client, "operate", name="ci")
    assert created["key"].startswith(f"rpk_{created['id']}_")
    assert len(created["key"]) > 40 and created["scopes"] == ["read", "operate"]
    listing = client.get("/v1/api-keys", headers=_auth(ADMIN_KEY))
    rows = {row["id"]: row for row in listing.json()["data"]}
    assert set(rows) == {"bootstrap", created["id"]}
    assert created["key"] not in listing.text and ADMIN_KEY not in listing.text
    assert not {"key", "hash"} & set(rows[created["id"]])
    assert client.get("/v1/jobs", headers=_auth(created["key"])).status_code == 200
    used = client.get("/v1/api-keys", headers=_auth(ADMIN_KEY)).json()["data"]
    assert next(r for r in used if r["id"] == created["id"])["last_used_at"] is not None


def test_a_revoked_key_is_refused_and_revoking_again_is_harmless(client: TestClient) -> None:
    created = _create_key(client, "operate")
    assert client.get("/v1/jobs", headers=_auth(created["key"])).status_code == 200
    first = client.delete(f"/v1/api-keys/{created['id']}", headers=_auth(ADMIN_KEY))
    assert first.status_code == 200 and first.json()["revoked_at"] is not None
    refused = client.get("/v1/jobs", headers=_auth(created["key"]))
    assert refused.status_code == 401 and refused.json()["detail"] == "invalid or revoked API key"
    again = client.delete(f"/v1/api-keys/{created['id']}", headers=_auth(ADMIN_KEY))
    assert again.json()["revoked_at"] == first.json()["revoked_at"]
    assert client.delete("/v1/api-keys/nope", headers=_auth(ADMIN_KEY)).status_code == 404


def test_keys_that_almost_match_are_refused(client: TestClient) -> None:
    key = _create_key(client, "admin")["key"]
    other = _create_key(client, "admin")
    prefix, key_id, secret = key.split("_", 2)
    flipped = secret[:-1] + ("a" if secret[-1] != "a" else "b")
    near_misses = [
        key[:-1],  # a prefix of the key
        key + "x",  # the key with more after it
        f"{prefix}_{key_id}_{flipped}",  # one character of the secret differs
        f"{prefix}_{other['id']}_{secret}",  # the right secret under another key's id
        f"{prefix}_{key_id}_{other['key'].split('_', 2)[2]}",  # another key's secret under this id
        key.upper(),
        secret,  # the secret alone
        f"{prefix}_{key_id}_",
        ADMIN_KEY[:16],
    ]
    answers = {candidate: client.get("/v1/jobs", headers=_auth(candidate)).status_code for candidate in near_misses}
    assert set(answers.values()) == {401}, answers
    assert client.get("/v1/jobs", headers=_auth(key)).status_code == 200


def test_scopes_are_validated(client: TestClient) -> None:
    bad = client.post("/v1/api-keys", json={"name": "x", "scopes": ["root"]}, headers=_auth(ADMIN_KEY))
    assert bad.status_code == 422
    empty = client.post("/v1/api-keys", json={"name": "x", "scopes": []}, headers=_auth(ADMIN_KEY))
    assert empty.status_code == 422


# --- audit ---------------------------------------------------------------------------------------------------------
def _audit(client: TestClient, **params: str) -> list[dict[str, object]]:
    response = client.get("/v1/audit", params=params, headers=_auth(ADMIN_KEY))
    assert response.status_code == 200, response.text
    rows: list[dict[str, object]] = response.json()["data"]
    return rows


def test_audit_records_allowed_and_refused_mutating_calls(client: TestClient) -> None:
    reader = _create_key(client, "read", name="reader")
    operator = _create_key(client, "operate", name="operator")
    spec = {"name": "x", "nodes": ["node-9"], "command": ["true"]}
    assert client.post("/v1/jobs", json=spec, headers=_auth(operator["key"])).status_code == 409  # allowed, refused
    assert client.post("/v1/jobs", json=spec, headers=_auth(reader["key"])).status_code == 403
    assert client.post("/v1/jobs", json=spec).status_code == 401
    assert client.get("/v1/jobs", headers=_auth(operator["key"])).status_code == 200  # reads are not audited

    rows = _audit(client, limit="3")
    seen = [(r["method"], r["path"], r["status"], r["actor"], r["key_id"]) for r in rows]
    assert seen == [  # newest first
        ("POST", "/v1/jobs", 401, "anonymous", None),
        ("POST", "/v1/jobs", 403, "reader", reader["id"]),
        ("POST", "/v1/jobs", 409, "operator", operator["id"]),
    ]
    assert all(r["client"] == "testclient" and r["job_id"] is None for r in rows)
    creations = _audit(client, actor="bootstrap")
    assert [(r["method"], r["path"], r["status"]) for r in creations] == [("POST", "/v1/api-keys", 201)] * 2
    assert [r["status"] for r in _audit(client, actor=reader["id"])] == [403]


def test_audit_records_a_handler_that_raised_with_the_job_id(client: TestClient) -> None:
    operator = _create_key(client, "operate", name="operator")
    assert client.post("/v1/jobs/job-42/explode", headers=_auth(operator["key"])).status_code == 500
    assert client.post("/v1/jobs/job-42/explode").status_code == 401
    rows = _audit(client, job_id="job-42")
    assert [(r["status"], r["actor"], r["path"]) for r in rows] == [
        (401, "anonymous", "/v1/jobs/job-42/explode"),
        (500, "operator", "/v1/jobs/job-42/explode"),
    ]
    assert _audit(client, job_id="job-other") == []


def test_audit_since_filter(client: TestClient) -> None:
    client.post("/v1/jobs", json={})
    now = datetime.now(UTC)
    assert len(_audit(client, since=(now - timedelta(minutes=5)).isoformat())) >= 1
    assert _audit(client, since=(now + timedelta(minutes=5)).isoformat()) == []
    naive = client.get("/v1/audit", params={"since": "2026-01-01T00:00:00"}, headers=_auth(ADMIN_KEY))
    assert naive.status_code == 422
    # A bare number was read as Unix seconds (found by tests/test_fuzz_openapi.py): ISO 8601 only, as documented.
    number = client.get("/v1/audit", params={"since": "0.0"}, headers=_auth(ADMIN_KEY))
    assert number.status_code == 422, number.text
    assert number.json()["detail"][0]["loc"] == ["query", "since"]


def test_no_key_or_body_is_stored(client: TestClient, settings: OrchestratorSettings) -> None:
    created = _create_key(client, "operate")
    body = {"name": "x", "nodes": ["node-9"], "command": ["true"], "env": {"HF_TOKEN": "hf-very-secret-value"}}
    client.post("/v1/jobs", json=body, headers=_auth(created["key"]))
    client.post("/v1/jobs?token=query-secret", json=body, headers=_auth(created["key"]))
    database = Path(settings.database_url.removeprefix("sqlite:///"))
    with sqlite3.connect(database) as conn:
        dump = "\n".join(conn.iterdump())
        audit_rows = conn.execute("SELECT * FROM auditrecord").fetchall()
    for secret in (created["key"], ADMIN_KEY, created["key"].split("_", 2)[2]):
        assert secret not in dump
    assert len(audit_rows) == 3  # the key's creation and the two submissions
    assert "hf-very-secret-value" not in str(audit_rows) and "query-secret" not in str(audit_rows)


# --- bootstrap and settings ----------------------------------------------------------------------------------------
def _keys(settings: OrchestratorSettings, key: str) -> tuple[int, list[dict[str, str]]]:
    with TestClient(_app(settings)) as client:
        response = client.get("/v1/api-keys", headers=_auth(key))
        return response.status_code, response.json().get("data", [])


def test_bootstrap_key_is_created_once_across_restarts(settings: OrchestratorSettings) -> None:
    status, first = _keys(settings, ADMIN_KEY)
    assert status == 200 and [(k["id"], k["name"], k["scopes"]) for k in first] == [
        ("bootstrap", "bootstrap", ["read", "operate", "admin"])
    ]
    status, second = _keys(settings, ADMIN_KEY)
    assert status == 200 and second[0]["created_at"] == first[0]["created_at"] and len(second) == 1


def test_a_new_bootstrap_value_replaces_the_old_one(settings: OrchestratorSettings) -> None:
    assert _keys(settings, ADMIN_KEY)[0] == 200
    rotated = settings.model_copy(update={"admin_api_key": SecretStr("n" + ADMIN_KEY)})
    assert _keys(rotated, ADMIN_KEY)[0] == 401
    status, keys = _keys(rotated, "n" + ADMIN_KEY)
    assert status == 200 and [k["id"] for k in keys] == ["bootstrap"]


def test_a_revoked_bootstrap_key_stays_revoked_after_a_restart(settings: OrchestratorSettings) -> None:
    with TestClient(_app(settings)) as client:
        spare_admin = _create_key(client, "admin")["key"]
        assert client.delete("/v1/api-keys/bootstrap", headers=_auth(ADMIN_KEY)).status_code == 200
    assert _keys(settings, ADMIN_KEY)[0] == 401
    status, keys = _keys(settings, spare_admin)
    assert status == 200 and next(k for k in keys if k["id"] == "bootstrap")["revoked_at"] is not None


@pytest.mark.parametrize("weak", ["short-but-secret", "changeme" * 4, "a" * 64])
def test_weak_admin_keys_are_refused_without_echoing_them(weak: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPRISE_ADMIN_API_KEY", weak)
    with pytest.raises(ValidationError) as refused:
        OrchestratorSettings()
    assert "REPRISE_ADMIN_API_KEY is too weak" in str(refused.value)
    assert weak not in str(refused.value)


def test_with_auth_disabled_routes_are_open_and_still_audited(settings: OrchestratorSettings) -> None:
    with TestClient(_app(settings.model_copy(update={"auth_enabled": False}))) as client:
        assert client.get("/v1/jobs").status_code == 200
        assert client.post("/v1/jobs", json={}).status_code == 422
        rows = client.get("/v1/audit").json()["data"]
    assert [(r["method"], r["status"], r["actor"]) for r in rows] == [("POST", 422, "anonymous")]
