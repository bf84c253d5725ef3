"""Who may look at the dashboard: a viewer signs in with an API key (any scope), or a reverse proxy vouches for them.

`REPRISE_VIEWER_AUTH` chooses: `key` (the default) asks for an API key on /login, checks it with the key authority
(the orchestrator, over NATS, as every service does) and keeps it in an HttpOnly, SameSite=Strict cookie, so each
later request is checked again (a revoked key stops working within the cache TTL); `proxy` trusts the header a
reverse proxy sets once it has signed the user in (`REPRISE_VIEWER_HEADER`, X-Forwarded-User by default), for a
dashboard that only the proxy can reach; `off` lets anyone who can reach the port in (a laptop, a test).

Whoever is let in sees what the dashboard's own read key sees: it never holds more than the read scope.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.middleware.base import BaseHTTPMiddleware, DispatchFunction, RequestResponseEndpoint

from reprise_common.auth import MAX_PRESENTED_KEY, AuthorityKeys, AuthUnavailableError
from reprise_dashboard.render import page

ViewerAuth = Literal["key", "proxy", "off"]
COOKIE = "reprise_key"
OPEN_PREFIXES = ("/healthz", "/readyz", "/metrics", "/static/", "/login", "/logout")
MAX_FORM_BYTES = 4_096


def install(app: FastAPI, mode: ViewerAuth, *, keys: AuthorityKeys | None, header: str) -> None:
    """Put the viewer check in front of every page and the live feed, and add /login and /logout; with
    authentication off (no keys) anyone may look, whatever the mode."""
    if keys is None or mode == "off":
        return
    app.state.viewer_keys = keys
    app.add_middleware(BaseHTTPMiddleware, dispatch=_proxy_gate(header) if mode == "proxy" else _key_gate(keys))
    if mode == "key":
        app.add_api_route("/login", login_page, methods=["GET"], include_in_schema=False)
        app.add_api_route("/login", login, methods=["POST"], include_in_schema=False)
        app.add_api_route("/logout", logout, methods=["POST"], include_in_schema=False)


def _open(path: str) -> bool:
    return path == "/login" or path.startswith(OPEN_PREFIXES)


def _proxy_gate(header: str) -> DispatchFunction:
    async def gate(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if _open(request.url.path) or request.headers.get(header, "").strip():
            return await call_next(request)
        return PlainTextResponse(f"sign in through the proxy in front of this dashboard (no {header})", 401)

    return gate


def _key_gate(keys: AuthorityKeys) -> DispatchFunction:
    async def gate(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if _open(request.url.path):
            return await call_next(request)
        key = request.cookies.get(COOKIE) or _bearer(request)
        try:
            known = await _known(keys, key)
        except AuthUnavailableError as exc:
            return PlainTextResponse(str(exc), 503)
        if known:
            return await call_next(request)
        if request.url.path == "/events" or request.method != "GET":
            return PlainTextResponse("sign in at /login", 401)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)

    return gate


async def _known(keys: AuthorityKeys, key: str | None) -> bool:
    """Whether `key` is a live key of any scope; AuthUnavailableError when the authority cannot be asked."""
    if not key or len(key) > MAX_PRESENTED_KEY:
        return False
    return await keys.verify(key) is not None


def _bearer(request: Request) -> str | None:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


def _safe_next(value: str | None) -> str:
    """Only a path on this dashboard: never another site (`//host`, `https://…`)."""
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/"


async def login_page(request: Request) -> HTMLResponse:
    """The sign-in form."""
    return page(request, "login.html", {"section": "", "next": _safe_next(request.query_params.get("next"))})


async def login(request: Request) -> Response:
    """Check the key; on success keep it in the session cookie and go where the viewer was going."""
    body = await request.body()
    form = parse_qs(body[:MAX_FORM_BYTES].decode(errors="replace"), max_num_fields=4)
    key = (form.get("key") or [""])[0].strip()
    target = _safe_next((form.get("next") or ["/"])[0])
    keys: AuthorityKeys = request.app.state.viewer_keys
    try:
        known = await _known(keys, key)
    except AuthUnavailableError as exc:
        return page(request, "login.html", {"section": "", "next": target, "error": str(exc)}, status_code=503)
    if not known:
        context = {"section": "", "next": target, "error": "invalid or revoked API key"}
        return page(request, "login.html", context, status_code=401)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(COOKIE, key, httponly=True, samesite="strict", secure=request.url.scheme == "https", path="/")
    return response


async def logout(request: Request) -> Response:
    """Forget the session cookie."""
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response
