"""What every HTTP service shares: /healthz, /readyz, /metrics, background connection, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AwareDatetime, BaseModel, BeforeValidator

from reprise_common.bus import Bus

try:  # services with a database have the [db] extra
    from sqlalchemy.exc import OperationalError
except ImportError:  # pragma: no cover - the agent and dashboard have no database
    _DATABASE_ERRORS: tuple[type[Exception], ...] = ()
else:  # a connection refused, broken or timed out, a database locked past its timeout: worth retrying later
    _DATABASE_ERRORS = (OperationalError,)
from reprise_common.errors import (
    BusError,
    ConflictError,
    DependencyUnavailableError,
    NotFoundError,
    RepriseError,
    StaleFenceError,
)
from reprise_common.logging import get_logger
from reprise_common.settings import ServiceSettings

log = get_logger("reprise.service")
ReadinessCheck = Callable[[], Awaitable[bool]]
READINESS_TIMEOUT_S = 1.0


GC_YOUNG_THRESHOLD = 10_000  # allocations between collections of the youngest generation (CPython's default: 700)


def settle_garbage_collector() -> None:
    """Keep what start-up built (modules, routes, schemas, rules) out of every later garbage collection, and collect
    the young generation less often; a service calls this once its start-up is done.

    Start-up objects live as long as the process; a full collection scans them all and pauses the event loop
    meanwhile (100-500 ms in a service under load). And a batch of thousands of events is thousands of objects alive
    together: with the default threshold each one was scanned by dozens of young collections and promoted into the
    older generations, whose collections then scanned it again (260 ms of a 16,384-symptom storm's 1.8 s in the
    detector; 70-100 ms at 10,000).
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


class Readiness(BaseModel):
    """The answer of /readyz: ready or not, and each dependency's check."""

    status: Literal["ready", "not ready"]
    checks: dict[str, Literal["ok", "down"]]


def add_ops_routes(app: FastAPI, *, checks: Mapping[str, ReadinessCheck]) -> None:
    """Add /healthz (the process is alive), /readyz (every dependency reachable) and /metrics (Prometheus)."""

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["ops"],
        summary="Readiness: every dependency is reachable",
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "A dependency is down (the checks name it)"}},
    )
    async def readyz() -> JSONResponse:
        results = await asyncio.gather(*(_run_check(check) for check in checks.values()))
        detail = {name: ("ok" if ok else "down") for name, ok in zip(checks, results, strict=True)}
        ready = all(results)
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": detail}, status_code=200 if ready else 503
        )

    @app.get(
        "/metrics",
        tags=["ops"],
        summary="Prometheus metrics",
        response_class=PlainTextResponse,  # the text exposition format, not JSON
    )
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


_STATUS_BY_ERROR: tuple[tuple[type[RepriseError], int], ...] = (
    (NotFoundError, 404),
    (StaleFenceError, 409),
    (ConflictError, 409),
    (BusError, 503),  # the message bus is unreachable: the caller may repeat the request
    (DependencyUnavailableError, 503),  # so is a scheduler's controller (Slurm's): the body names it
)


class ErrorDetail(BaseModel):
    """The body of every error answer but a 422: what went wrong, for people."""

    detail: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorDetail, "description": description}


# What any /v1 route may answer besides its own results (`include_router(..., responses=ERROR_RESPONSES)`): the
# domain errors mapped above, a body FastAPI cannot parse (not JSON, not UTF-8) and a key that is refused.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("The body could not be parsed (not JSON, or not UTF-8)"),
    401: _error("No API key, or an unknown or revoked one"),
    403: _error("The API key lacks the scope the route needs"),
    404: _error("No such resource"),
    409: _error("The resource's state, or a newer fencing token, refuses the change"),
    503: _error(
        "The message bus, the key authority or a scheduler's controller is unreachable: the request may be repeated"
    ),
}

_BARE_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def _iso_8601(value: object) -> object:
    """Refuse a bare number where an ISO 8601 time is documented: pydantic would read it as Unix seconds."""
    if isinstance(value, int | float) or (isinstance(value, str) and _BARE_NUMBER.fullmatch(value)):
        raise ValueError("expected an ISO 8601 date-time with a zone, e.g. 2026-12-02T05:00:00Z")
    return value


# A time in a query or body: ISO 8601 with a zone, as the OpenAPI document says (format: date-time).
IsoDateTime = Annotated[AwareDatetime, BeforeValidator(_iso_8601)]

MAX_ECHO_CHARS = 200  # a 422 shows the offending input only when it is this short (as JSON)
MAX_ERRORS_SHOWN = 20  # and at most this many errors, then how many more there were


def add_error_handlers(app: FastAPI) -> None:
    """Map domain errors to HTTP answers in this one place: {"detail": message}; a request that fails validation
    gets a 422 naming each field (`loc`), without echoing a large input back."""

    async def handle(_request: Request, exc: Exception) -> JSONResponse:
        status = next((code for kind, code in _STATUS_BY_ERROR if isinstance(exc, kind)), 500)
        detail = str(exc)
        if isinstance(exc, DependencyUnavailableError):  # say what is down, whatever the message's wording
            log.warning("dependency unavailable", extra={"dependency": exc.dependency, "error": detail})
            detail = f"{exc.dependency} is unavailable: {detail}"
        return JSONResponse({"detail": detail}, status_code=status)

    for kind, _code in _STATUS_BY_ERROR:
        app.add_exception_handler(kind, handle)
    app.add_exception_handler(RequestValidationError, _unprocessable)
    for database_error in _DATABASE_ERRORS:
        app.add_exception_handler(database_error, _database_unavailable)


async def _database_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    """The service's database did not answer (refused, gone, locked): 503 naming it, never a 500 (other database
    errors are bugs, and stay 500s with their traceback in the log)."""
    cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:200]
    log.warning("database unavailable", extra={"error": cause})
    return JSONResponse({"detail": f"database unavailable: {cause}"}, status_code=503)


async def _unprocessable(_request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    shown = [_without_large_input(error) for error in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        shown.append({"type": "more_errors", "loc": [], "msg": f"{len(errors) - MAX_ERRORS_SHOWN} more errors"})
    return JSONResponse({"detail": jsonable_encoder(shown)}, status_code=422)


def _without_large_input(error: Mapping[str, Any]) -> dict[str, Any]:
    """One validation error with its input (and context) only when they are short."""
    kept = {key: value for key, value in error.items() if key not in ("input", "ctx", "url")}
    for key in ("input", "ctx"):
        if key in error and len(json.dumps(jsonable_encoder(error[key]), default=str)) <= MAX_ECHO_CHARS:
            kept[key] = error[key]
    return kept


async def _run_check(check: ReadinessCheck) -> bool:
    try:
        return await asyncio.wait_for(check(), timeout=READINESS_TIMEOUT_S)
    except Exception:  # a failing probe means "not ready", whatever the reason
        return False


def nats_check(background: Background) -> ReadinessCheck:
    """Readiness on NATS: connected, and the service's start hook (its consumers) ran to the end."""

    async def check() -> bool:
        return background.bus.connected and background.started.is_set()

    return check


class Background:
    """Connects to NATS in the background (so /healthz answers at once), then runs the service's start hook."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()
        self.failed: Exception | None = None  # why the start hook did not finish, if it did not

    def start(self, on_connected: Callable[[], Awaitable[None]]) -> None:
        """Begin connecting; on_connected runs once the bus is up (consumers, responders)."""

        async def run() -> None:
            try:
                await self.bus.connect()  # retries while NATS or JetStream is not up yet; raises only what lasts
                await on_connected()
            except Exception as exc:  # e.g. an identity that may not create a stream or a consumer: never consumes
                self.failed = exc
                log.exception("could not start consuming: not ready (fix the cause and restart the service)")
                return
            self.started.set()
            log.info("connected and consuming", extra={"nats": self.bus.url})

        self._task = asyncio.create_task(run(), name="connect")

    async def stop(self) -> None:
        """Stop consuming, let in-flight work finish, drain NATS."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.bus.close()


def run_http_service(app: FastAPI, settings: ServiceSettings) -> None:
    """Serve the app until SIGTERM or SIGINT; uvicorn then runs the app's lifespan shutdown (the clean stop)."""
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        timeout_keep_alive=int(settings.http_keep_alive_s),
    )
    uvicorn.Server(config).run()
