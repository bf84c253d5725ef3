"""API keys with scopes: the one scheme every HTTP service checks.

The orchestrator is the key authority: it stores keys (only their SHA-256), creates and revokes them, and answers
key checks on `reprise.auth.verify` (core NATS, queue group). Every other service checks a presented key with
`AuthorityKeys`, which asks the authority and caches the answer for a few seconds; no service ever sees another's
key table, and the key itself never travels on the bus (only its digest). Which scope a route needs is decided by
its method here, in one place: GET/HEAD read, POST/PUT/PATCH/DELETE operate, anything else admin (fail closed).

A service given the bootstrap admin key (REPRISE_ADMIN_API_KEY) accepts it without asking, so an operator can
still act on it while the authority is down; without the authority every other key is answered 503, never let in.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Protocol

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.events import Wire
from reprise_common.logging import get_logger

log = get_logger("reprise.auth")

KEY_PREFIX = "rpk"
ANONYMOUS = "anonymous"
REDACTED = "<redacted>"
MIN_ADMIN_KEY_LENGTH = 32
MIN_ADMIN_KEY_DISTINCT = 8  # refuses a repeated placeholder ("changeme" x 4); 32 random hex digits have ~14
MAX_PRESENTED_KEY = 512  # longer than any key we issue: refused before hashing
CHECK_TIMEOUT_S = 2.0
CACHE_ENTRIES = 4_096
NEGATIVE_TTL_S = 2.0  # an unknown key is asked again after this: a key created a moment ago works at once after


class Scope(StrEnum):
    """What a key may do; each scope implies the ones before it (read < operate < admin)."""

    READ = "read"
    OPERATE = "operate"
    ADMIN = "admin"


def granted(scopes: list[Scope]) -> list[str]:
    """Every scope a key holding `scopes` has, lowest first (as stored)."""
    order = list(Scope)
    highest = max((order.index(scope) for scope in scopes), default=-1)
    return [scope.value for scope in order[: highest + 1]]


SCOPE_BY_METHOD: dict[str, Scope] = {
    "GET": Scope.READ,
    "HEAD": Scope.READ,
    "POST": Scope.OPERATE,
    "PUT": Scope.OPERATE,
    "PATCH": Scope.OPERATE,
    "DELETE": Scope.OPERATE,
}


def scope_for_method(method: str) -> Scope:
    """The scope a route needs, by its method; an unexpected method needs admin (fail closed)."""
    return SCOPE_BY_METHOD.get(method.upper(), Scope.ADMIN)


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key, as stored and as checked over the bus."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id inside an `rpk_<id>_<secret>` key, or None for any other shape."""
    prefix, _, rest = key.partition("_")
    key_id, _, secret = rest.partition("_")
    return key_id if prefix == KEY_PREFIX and key_id and secret and len(key_id) <= 64 else None


@dataclass(frozen=True)
class Principal:
    """The key a request was authenticated with."""

    key_id: str
    name: str
    scopes: frozenset[str]

    def holds(self, scope: Scope) -> bool:
        """Whether this key has `scope` (stored scopes already include the lower ones)."""
        return scope.value in self.scopes


BOOTSTRAP = Principal(key_id="bootstrap", name="bootstrap", scopes=frozenset(granted([Scope.ADMIN])))


def principal_of(request: Request) -> Principal | None:
    """Who made this request (None when authentication is off)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal


def may_see_secrets(request: Request) -> bool:
    """Whether the caller may see secret values (job env): an operate key, or authentication off."""
    principal = principal_of(request)
    return principal is None or principal.holds(Scope.OPERATE)


# --- settings -----------------------------------------------------------------------------------------------


class AuthSettings(BaseSettings):
    """Mixin for every HTTP service: whether keys are required and how they are checked."""

    # hide_input_in_errors: a refused key must not be echoed into logs by the validation error.
    model_config = SettingsConfigDict(env_prefix="REPRISE_", extra="ignore", hide_input_in_errors=True)

    auth_enabled: bool = Field(default=True, description="require an API key on /v1 routes (false: open)")
    admin_api_key: SecretStr | None = Field(
        default=None, description="the bootstrap admin key (the orchestrator stores it hashed; others accept it)"
    )
    auth_cache_ttl_s: float = Field(
        default=10.0, ge=0, le=300, description="how long another service trusts the authority's answer on a key"
    )
    auth_stale_s: float = Field(
        default=300.0, ge=0, le=3600, description="how long a known-good key still works while the authority is down"
    )

    @field_validator("admin_api_key")
    @classmethod
    def _strong_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        return strong_key(value, "REPRISE_ADMIN_API_KEY")


def strong_key(value: SecretStr | None, setting: str) -> SecretStr | None:
    """A key chosen by an operator, refused when it is short or repetitive (never echoed)."""
    if value is None:
        return None
    key = value.get_secret_value()
    if len(key) < MIN_ADMIN_KEY_LENGTH or len(set(key)) < MIN_ADMIN_KEY_DISTINCT:
        raise ValueError(
            f"{setting} is too weak: use at least {MIN_ADMIN_KEY_LENGTH} random characters, "
            "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return value


# --- the key check on the bus -------------------------------------------------------------------------------


class KeyCheck(Wire):
    """Request on `reprise.auth.verify`: is the key with this digest live? (never the key itself)"""

    key_id: str | None = Field(default=None, max_length=64)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


class KeyCheckAnswer(Wire):
    """The authority's answer: the key's identity and scopes when it is live, else valid false."""

    valid: bool
    key_id: str = Field(default="", max_length=64)
    name: str = Field(default="", max_length=200)
    scopes: list[Scope] = Field(default_factory=list, max_length=3)

    def principal(self) -> Principal | None:
        """The principal this answer grants, or None."""
        if not self.valid:
            return None
        return Principal(key_id=self.key_id, name=self.name, scopes=frozenset(s.value for s in self.scopes))


class AuthUnavailableError(BusError):
    """The key authority could not be asked: the caller may repeat the request (503)."""


class KeyVerifier(Protocol):
    """Who a presented key is: a principal, None for an unknown or revoked key, AuthUnavailableError otherwise."""

    async def verify(self, key: str) -> Principal | None: ...


@dataclass
class _Cached:
    principal: Principal | None
    at: float


class AuthorityKeys:
    """Checks keys with the orchestrator over NATS; answers are cached, a known-good key survives a short outage."""

    def __init__(
        self,
        bus: Bus,
        *,
        admin_key: SecretStr | None = None,
        ttl_s: float = 10.0,
        stale_s: float = 300.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bus = bus
        self._admin_digest = hash_key(admin_key.get_secret_value()) if admin_key is not None else None
        self._ttl_s = ttl_s
        self._stale_s = stale_s
        self._monotonic = monotonic
        self._cache: OrderedDict[str, _Cached] = OrderedDict()

    async def verify(self, key: str) -> Principal | None:
        """The principal of `key`, from the cache while fresh, else from the authority."""
        digest = hash_key(key)
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return BOOTSTRAP
        now = self._monotonic()
        cached = self._cache.get(digest)
        ttl = self._ttl_s if cached is not None and cached.principal is not None else NEGATIVE_TTL_S
        if cached is not None and now - cached.at < ttl:
            return cached.principal
        try:
            answer = await self._bus.request(
                subjects.AUTH_VERIFY,
                KeyCheck(key_id=key_id_of(key), digest=digest),
                KeyCheckAnswer,
                timeout=CHECK_TIMEOUT_S,
            )
        except BusError as exc:
            if cached is not None and cached.principal is not None and now - cached.at < self._stale_s:
                return cached.principal  # known good a moment ago; revocation waits for the authority to be back
            raise AuthUnavailableError(
                f"cannot check the API key: the key authority (orchestrator) did not answer ({exc})"
            ) from exc
        principal = answer.principal()
        self._cache[digest] = _Cached(principal=principal, at=now)
        self._cache.move_to_end(digest)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return principal


def authority_keys(settings: AuthSettings, bus: Bus) -> AuthorityKeys | None:
    """How a service other than the orchestrator checks keys: with the authority, or not at all when auth is off."""
    if not settings.auth_enabled:
        return None
    return AuthorityKeys(
        bus, admin_key=settings.admin_api_key, ttl_s=settings.auth_cache_ttl_s, stale_s=settings.auth_stale_s
    )


# --- FastAPI dependencies -----------------------------------------------------------------------------------

# auto_error=False: a missing key is answered below with our own 401, the same for both headers.
_bearer = HTTPBearer(auto_error=False, description="an API key: `Authorization: Bearer rpk_...`")
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="an API key, as an alternative header")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
HeaderKeyDep = Annotated[str | None, Depends(_api_key_header)]


def install(app: FastAPI, verifier: KeyVerifier | None) -> None:
    """Make `verifier` check this app's keys; None turns authentication off (every route open)."""
    app.state.key_verifier = verifier
    if verifier is None:
        log.warning("authentication is off (REPRISE_AUTH_ENABLED=false): every route is open")


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


async def authenticate(request: Request, presented: str | None) -> Principal | None:
    """The caller's principal (also kept on request.state), or None when authentication is off; 401/503 otherwise."""
    verifier: KeyVerifier | None = request.app.state.key_verifier
    if verifier is None:
        return None
    if not presented:
        raise _unauthorized("missing API key: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")
    if len(presented) > MAX_PRESENTED_KEY:
        raise _unauthorized("invalid or revoked API key")
    try:
        principal = await verifier.verify(presented)
    except AuthUnavailableError as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from exc
    if principal is None:
        raise _unauthorized("invalid or revoked API key")
    request.state.principal = principal  # audit records and redaction name the caller from it
    return principal


async def _check(
    request: Request, bearer: HTTPAuthorizationCredentials | None, header: str | None, scope: Scope
) -> None:
    principal = await authenticate(request, bearer.credentials if bearer is not None else header)
    if principal is not None and not principal.holds(scope):
        raise HTTPException(
            status_code=403,
            detail=f"API key {principal.name!r} lacks the {scope.value!r} scope that "
            f"{request.method} {request.url.path} needs",
        )


def require_scope(scope: Scope) -> Callable[..., object]:
    """A dependency that lets a request through only with a live key holding `scope`."""

    async def dependency(request: Request, bearer: BearerDep, header_key: HeaderKeyDep) -> None:
        await _check(request, bearer, header_key, scope)

    return dependency


async def require_scope_for_method(request: Request, bearer: BearerDep, header_key: HeaderKeyDep) -> None:
    """The dependency of every domain router: GET/HEAD need read, POST/PUT/PATCH/DELETE need operate."""
    await _check(request, bearer, header_key, scope_for_method(request.method))


BY_METHOD = [Depends(require_scope_for_method)]
