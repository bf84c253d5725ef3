"""Who may look at the dashboard: sign-in with an API key checked by the key authority, or a proxy's header."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from reprise_dashboard.app import create_app
from reprise_dashboard.settings import DashboardSettings
from reprise_orchestrator.app import create_app as create_orchestrator
from reprise_orchestrator.settings import OrchestratorSettings

Open = Callable[..., Any]


@pytest.fixture
def admin(key_authority: OrchestratorSettings) -> dict[str, str]:
    """Headers with the authority's bootstrap admin key."""
    assert key_authority.admin_api_key is not None
    return {"Authorization": f"Bearer {key_authority.admin_api_key.get_secret_value()}"}


@pytest.fixture
async def apps(
    key_authority: OrchestratorSettings, down_settings: Callable[..., DashboardSettings]
) -> AsyncIterator[Open]:
    """`apps("orchestrator")` starts the key authority; `apps("dashboard", **settings)` a dashboard on the same NATS."""
    async with AsyncExitStack() as stack:

        async def open_app(name: str, **overrides: Any) -> httpx.AsyncClient:
            if name == "orchestrator":
                app = create_orchestrator(key_authority)
            else:
                app = create_app(down_settings(nats_url=key_authority.nats_url, **{"auth_cache_ttl_s": 0, **overrides}))
            await stack.enter_async_context(app.router.lifespan_context(app))
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dashboard")
            )
            for _ in range(200):
                if (await client.get("/readyz")).json()["checks"].get("nats") == "ok":
                    return client
                await asyncio.sleep(0.05)
            raise AssertionError(f"{name} never connected to NATS")

        yield open_app


async def _key(authority: httpx.AsyncClient, admin: dict[str, str], scope: str = "read") -> dict[str, str]:
    made = await authority.post("/v1/api-keys", json={"name": f"viewer-{scope}", "scopes": [scope]}, headers=admin)
    assert made.status_code == 201, made.text
    result: dict[str, str] = made.json()
    return result


async def test_a_viewer_signs_in_with_a_key_and_is_shut_out_once_it_is_revoked(
    apps: Open, admin: dict[str, str]
) -> None:
    authority = await apps("orchestrator")
    dashboard = await apps("dashboard", viewer_auth="key")
    away = await dashboard.get("/jobs/job-1?tab=x")
    assert away.status_code == 303 and away.headers["location"] == "/login?next=%2Fjobs%2Fjob-1%3Ftab%3Dx"
    assert (await dashboard.get("/events")).status_code == 401
    assert (await dashboard.get("/healthz")).status_code == 200
    assert "Sign in" in (await dashboard.get("/login")).text

    wrong = await dashboard.post("/login", data={"key": "rpk_x_" + secrets.token_urlsafe(32), "next": "/"})
    assert wrong.status_code == 401 and "invalid or revoked API key" in wrong.text

    key = await _key(authority, admin)
    signed = await dashboard.post("/login", data={"key": key["key"], "next": "/incidents"})
    assert signed.status_code == 303 and signed.headers["location"] == "/incidents"
    cookie = signed.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert (await dashboard.get("/")).status_code == 200  # the cookie jar sends the key back
    dashboard.cookies.clear()
    assert (await dashboard.get("/")).status_code == 303
    bearer = {"Authorization": f"Bearer {key['key']}"}
    assert (await dashboard.get("/", headers=bearer)).status_code == 200  # a script may send the key instead

    assert (await authority.delete(f"/v1/api-keys/{key['id']}", headers=admin)).status_code == 200
    assert (await dashboard.get("/", headers=bearer)).status_code == 303


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/\\evil.example"])
async def test_sign_in_never_sends_the_viewer_to_another_site(apps: Open, admin: dict[str, str], target: str) -> None:
    authority = await apps("orchestrator")
    dashboard = await apps("dashboard", viewer_auth="key")
    signed = await dashboard.post("/login", data={"key": (await _key(authority, admin))["key"], "next": target})
    assert signed.status_code == 303 and signed.headers["location"] == "/"


async def test_without_the_authority_sign_in_says_so(apps: Open) -> None:
    dashboard = await apps("dashboard", viewer_auth="key")
    answer = await dashboard.post("/login", data={"key": "rpk_x_" + secrets.token_urlsafe(32)})
    assert answer.status_code == 503 and "key authority" in answer.text


async def test_behind_a_proxy_its_header_is_required(apps: Open) -> None:
    dashboard = await apps("dashboard", viewer_auth="proxy", viewer_header="X-Auth-Request-User")
    refused = await dashboard.get("/")
    assert refused.status_code == 401 and "X-Auth-Request-User" in refused.text
    assert (await dashboard.get("/", headers={"X-Auth-Request-User": "ana@example.com"})).status_code == 200
    assert (await dashboard.get("/login")).status_code == 404  # no key sign-in in proxy mode
