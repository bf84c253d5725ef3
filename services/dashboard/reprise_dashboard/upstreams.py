"""Calls to the services the dashboard shows, each with a timeout; a service that is down becomes a value, not a 500.

Every call answers a `Fetched`: the JSON body, or the service's name and why there is nothing (refused, timed out,
an error status, a body of the wrong shape), which the page shows in place of that section.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Generic, TypeVar

import httpx
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from reprise_common.logging import get_logger
from reprise_dashboard.settings import DashboardSettings

log = get_logger("reprise.dashboard.upstreams")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
UPSTREAM_ERRORS = Counter(
    "reprise_dashboard_upstream_errors_total", "Calls to a service that gave the page nothing", ["service", "kind"]
)


class Service(StrEnum):
    """The services the dashboard reads."""

    ORCHESTRATOR = "orchestrator"
    DETECTOR = "detector"
    REGISTRY = "checkpoint registry"
    NOTIFIER = "notifier"


@dataclass(frozen=True)
class Fetched(Generic[T]):
    """What one call gave: the data, or which service failed and why."""

    service: Service
    data: T | None = None
    error: str = ""
    status: int | None = None

    @property
    def ok(self) -> bool:
        """True when the service answered with usable data."""
        return not self.error

    @property
    def not_found(self) -> bool:
        """True when the service answered 404."""
        return self.status == 404

    def map(self, convert: Callable[[T], Any]) -> Fetched[Any]:
        """The same answer with its data converted; a body of the wrong shape becomes an error."""
        if not self.ok or self.data is None:
            return self
        try:
            return replace(self, data=convert(self.data))
        except (ValidationError, KeyError, TypeError, ValueError) as exc:
            UPSTREAM_ERRORS.labels(self.service.value, "shape").inc()
            log.info("unexpected answer", extra={"service": self.service.value, "error": str(exc)[:200]})
            return replace(self, data=None, error=f"the {self.service} answered in an unexpected shape")

    def items(self, model: type[M]) -> Fetched[list[M]]:
        """A `{"data": [...]}` page (or a plain list) parsed into models."""

        def parse(body: Any) -> list[M]:
            rows = body["data"] if isinstance(body, dict) else body
            return [model.model_validate(row) for row in rows]

        return self.map(parse)

    def one(self, model: type[M]) -> Fetched[M]:
        """One object parsed into a model."""
        return self.map(model.model_validate)


class Upstreams:
    """One HTTP client for every service, with the settings' timeout and the dashboard's read key."""

    def __init__(self, settings: DashboardSettings, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.timeout_s = settings.http_timeout_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(settings.http_timeout_s), transport=transport)
        self.base_urls: Mapping[Service, str] = {
            Service.ORCHESTRATOR: settings.orchestrator_url,
            Service.DETECTOR: settings.detector_url,
            Service.REGISTRY: settings.registry_url,
            Service.NOTIFIER: settings.notifier_url,
        }
        key = settings.read_api_key
        auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        self.headers: Mapping[Service, dict[str, str]] = dict.fromkeys(Service, auth)

    async def aclose(self) -> None:
        """Close the connections."""
        await self.http.aclose()

    async def get(self, service: Service, path: str, params: Mapping[str, Any] | None = None) -> Fetched[Any]:
        """GET a path of a service; never raises for a service that is down or answers an error."""
        url = self.base_urls[service] + path
        query = {k: v for k, v in (params or {}).items() if v is not None and v != ""}
        try:
            response = await self.http.get(url, params=query, headers=self.headers.get(service, {}))
        except httpx.TimeoutException:
            return self._failed(service, "timeout", f"the {service} did not answer within {self.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return self._failed(service, "unreachable", f"the {service} is unreachable ({type(exc).__name__})")
        if response.status_code >= 400:
            return self._error_status(service, response)
        try:
            return Fetched(service=service, data=response.json())
        except ValueError:
            return self._failed(service, "shape", f"the {service} answered something that is not JSON")

    def _error_status(self, service: Service, response: httpx.Response) -> Fetched[Any]:
        status = response.status_code
        if status == 404:
            return Fetched(service=service, error=f"not found at the {service}", status=404)
        if status in (401, 403):
            reason = f"the {service} refused the dashboard's API key ({status}): set REPRISE_READ_API_KEY"
            return self._failed(service, "auth", reason, status)
        return self._failed(service, "status", f"the {service} answered {status}: {_detail(response)}", status)

    def _failed(self, service: Service, kind: str, reason: str, status: int | None = None) -> Fetched[Any]:
        UPSTREAM_ERRORS.labels(service.value, kind).inc()
        log.info("a service gave the page nothing", extra={"service": service.value, "reason": reason})
        return Fetched(service=service, error=reason, status=status)


def _detail(response: httpx.Response) -> str:
    """The `detail` of an error answer, short."""
    try:
        detail = response.json().get("detail", "")
    except (ValueError, AttributeError):
        detail = response.text
    return str(detail)[:200]
