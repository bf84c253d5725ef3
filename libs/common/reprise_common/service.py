"""What every HTTP service shares: /healthz, /readyz, /metrics, background connection, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from reprise_common.bus import Bus
from reprise_common.errors import BusError, ConflictError, NotFoundError, RepriseError, StaleFenceError
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


def add_ops_routes(app: FastAPI, *, checks: Mapping[str, ReadinessCheck]) -> None:
    """Add /healthz (the process is alive), /readyz (every dependency reachable) and /metrics (Prometheus)."""

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Readiness: every dependency is reachable")
    async def readyz() -> JSONResponse:
        results = await asyncio.gather(*(_run_check(check) for check in checks.values()))
        detail = {name: ("ok" if ok else "down") for name, ok in zip(checks, results, strict=True)}
        ready = all(results)
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": detail}, status_code=200 if ready else 503
        )

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


_STATUS_BY_ERROR: tuple[tuple[type[RepriseError], int], ...] = (
    (NotFoundError, 404),
    (StaleFenceError, 409),
    (ConflictError, 409),
    (BusError, 503),  # the message bus is unreachable: the caller may repeat the request
)


MAX_ECHO_CHARS = 200  # a 422 shows the offending input only when it is this short (as JSON)
MAX_ERRORS_SHOWN = 20  # and at most this many errors, then how many more there were


def add_error_handlers(app: FastAPI) -> None:
    """Map domain errors to HTTP answers in this one place: {"detail": message}; a request that fails validation
    gets a 422 naming each field (`loc`), without echoing a large input back."""

    async def handle(_request: Request, exc: Exception) -> JSONResponse:
        status = next((code for kind, code in _STATUS_BY_ERROR if isinstance(exc, kind)), 500)
        return JSONResponse({"detail": str(exc)}, status_code=status)

    for kind, _code in _STATUS_BY_ERROR:
        app.add_exception_handler(kind, handle)
    app.add_exception_handler(RequestValidationError, _unprocessable)


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


def nats_check(bus: Bus) -> ReadinessCheck:
    """Readiness of the NATS connection."""

    async def check() -> bool:
        return bus.connected

    return check


class Background:
    """Connects to NATS in the background (so /healthz answers at once), then runs the service's start hook."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._task: asyncio.Task[None] | None = None
        self.started = asyncio.Event()

    def start(self, on_connected: Callable[[], Awaitable[None]]) -> None:
        """Begin connecting; on_connected runs once the bus is up (consumers, responders)."""

        async def run() -> None:
            await self.bus.connect()
            await on_connected()
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
    )
    uvicorn.Server(config).run()
