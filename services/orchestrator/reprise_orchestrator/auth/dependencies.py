"""Who is calling and may they: the API key from the request, checked against the scope a route needs.

app.py applies these as router-level dependencies, so the domain views never see authentication. Which scope a
route needs is decided here, by HTTP method, in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from reprise_orchestrator.auth import service
from reprise_orchestrator.auth.models import Scope
from reprise_orchestrator.deps import get_deps

SCOPE_BY_METHOD: dict[str, Scope] = {
    "GET": Scope.READ,
    "HEAD": Scope.READ,
    "POST": Scope.OPERATE,
    "PUT": Scope.OPERATE,
    "PATCH": Scope.OPERATE,
    "DELETE": Scope.OPERATE,
}

# auto_error=False: a missing key is answered below with our own 401, the same for both headers.
_bearer = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer rpk_...`")
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key, as an alternative header")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
HeaderKeyDep = Annotated[str | None, Depends(_api_key_header)]


@dataclass(frozen=True)
class Principal:
    """The key a request was authenticated with."""

    key_id: str
    name: str
    scopes: frozenset[str]


def scope_for_method(method: str) -> Scope:
    """The scope a route needs, by its method; an unexpected method needs admin (fail closed)."""
    return SCOPE_BY_METHOD.get(method.upper(), Scope.ADMIN)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


def _authenticate(request: Request, bearer: HTTPAuthorizationCredentials | None, header_key: str | None) -> Principal:
    deps = get_deps(request)
    presented = bearer.credentials if bearer is not None else header_key
    if not presented:
        raise _unauthorized("missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
    with Session(deps.engine) as session:
        row = service.authenticate(session, key=presented, now=deps.clock.now())
        if row is None:
            raise _unauthorized("invalid or revoked API key")
        principal = Principal(key_id=row.id, name=row.name, scopes=frozenset(row.scopes))
    request.state.principal = principal  # the audit middleware names the caller from it
    return principal


def _check(request: Request, bearer: HTTPAuthorizationCredentials | None, header_key: str | None, scope: Scope) -> None:
    if not get_deps(request).settings.auth_enabled:
        return
    principal = _authenticate(request, bearer, header_key)
    if scope.value not in principal.scopes:
        raise HTTPException(
            status_code=403,
            detail=f"API key {principal.name!r} lacks the {scope.value!r} scope that "
            f"{request.method} {request.url.path} needs",
        )


def require_scope(scope: Scope) -> Callable[..., None]:
    """A dependency that lets a request through only with a live key holding `scope`."""

    def dependency(request: Request, bearer: BearerDep, header_key: HeaderKeyDep) -> None:
        _check(request, bearer, header_key, scope)

    return dependency


def require_scope_for_method(request: Request, bearer: BearerDep, header_key: HeaderKeyDep) -> None:
    """The dependency of every domain router: GET/HEAD need read, POST/PUT/PATCH/DELETE need operate."""
    _check(request, bearer, header_key, scope_for_method(request.method))
