"""Property-based requests from each HTTP service's own OpenAPI document (schemathesis), against the real app.

Each app runs in process (schemathesis' ASGI transport, lifespan included) on the real NATS, Redis and SQLite files
of the shared fixtures; the orchestrator runs beside the others as their key authority. For every operation, valid
and invalid inputs are generated with a fixed seed and sent with the bootstrap admin key, so they reach the handlers:
each answer must be no server error (< 500), a documented status code of the documented content type, with a body
that matches the documented schema, and invalid inputs must be refused. The same valid inputs without a valid key
must be answered 401. Each service's number of cases, server errors and statuses seen is printed in the terminal
summary ("OpenAPI fuzz", tests/conftest.py), passed or failed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Err
from schemathesis.python import asgi

from reprise_cli.servers import free_port
from reprise_dashboard.app import create_app as create_dashboard
from reprise_dashboard.settings import DashboardSettings
from reprise_detector.app import create_app as create_detector
from reprise_detector.settings import DetectorSettings
from reprise_notifier.app import create_app as create_notifier
from reprise_notifier.settings import NotifierSettings
from reprise_orchestrator.app import create_app as create_orchestrator
from reprise_orchestrator.settings import OrchestratorSettings
from reprise_registry.app import create_app as create_registry
from reprise_registry.settings import RegistrySettings

SERVICES = ("orchestrator", "detector", "checkpoint-registry", "notifier", "dashboard")
EXAMPLES = 8  # per operation and mode: bounded so the whole module stays well under a minute and a half here
UNAUTHENTICATED_EXAMPLES = 2
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
]
NEGATIVE_CHECKS = [*CHECKS, checks.negative_data_rejection]
# The dashboard's live feed is a server-sent event stream that never ends: a fuzzed request would only wait for its
# deadline. services/dashboard/tests/test_live.py streams it over real HTTP instead.
NOT_FUZZED = {"dashboard": {"GET /events"}}


@dataclass
class Tally:
    """What the fuzz sent to one service and what it found."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        """Answers of 500 or more."""
        return sum(count for status, count in self.statuses.items() if status >= 500)


def _app(name: str, authority: OrchestratorSettings, root: Path) -> FastAPI:
    """The service on the authority's NATS (and Redis), its own SQLite file; it accepts the bootstrap admin key."""
    if name == "orchestrator":
        return create_orchestrator(authority)
    common: dict[str, Any] = {
        "nats_url": authority.nats_url,
        "database_url": f"sqlite:///{root / name}.db",
        "admin_api_key": authority.admin_api_key,
    }
    if name == "detector":
        return create_detector(DetectorSettings(**common))
    if name == "notifier":
        return create_notifier(NotifierSettings(**common), environ={})
    if name == "checkpoint-registry":
        return create_registry(RegistrySettings(**common, consume_agent_events=False, validate_interval_s=3600.0))
    # The services the dashboard reads are not running: each page must still answer, naming what it could not get.
    upstreams = ("orchestrator", "detector", "registry", "notifier")
    nowhere: dict[str, Any] = {f"{upstream}_url": f"http://127.0.0.1:{free_port()}" for upstream in upstreams}
    return create_dashboard(DashboardSettings(**common, **nowhere, http_timeout_s=1.0))


def _wait_ready(get: Callable[[str], Any]) -> None:
    """Until the app's /readyz answers 200 (NATS connected, consumers started)."""
    for _ in range(200):
        if get("/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the app never became ready")


def _run(operation: Any, mode: GenerationMode, examples: int, send: Any) -> None:
    """`send` each of `examples` cases generated for the operation in `mode`, derandomized (the same every run)."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure shows the case as sent
    )
    def run(case: schemathesis.Case) -> None:
        send(case)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        # An operation without parameters or body (GET /healthz) has no input to make invalid.


def _fuzz(operation: Any, headers: dict[str, str], tally: Tally, *, authenticated_only: bool) -> None:
    """Valid and invalid cases with the admin key; then valid ones without it, which a /v1 route answers 401."""

    def sender(mode: GenerationMode, key: dict[str, str] | None) -> Any:
        def send(case: schemathesis.Case) -> None:
            response = case.call(headers=key)
            tally.cases += 1
            tally.statuses[response.status_code] += 1
            case.validate_response(
                response, checks=NEGATIVE_CHECKS if mode is GenerationMode.NEGATIVE else CHECKS, headers=key
            )
            if key is None:
                assert response.status_code == 401, f"{operation.label} without a key: {response.status_code}"

        return send

    runs: list[tuple[GenerationMode, dict[str, str] | None, int]] = [
        (GenerationMode.POSITIVE, headers, EXAMPLES),
        (GenerationMode.NEGATIVE, headers, EXAMPLES),
    ]
    if operation.path.startswith("/v1/") and not authenticated_only:
        runs.append((GenerationMode.POSITIVE, None, UNAUTHENTICATED_EXAMPLES))
    for mode, key, examples in runs:
        try:
            _run(operation, mode, examples, sender(mode, key))
        except (FailureGroup, AssertionError) as exc:  # every operation is tried; all failures are reported
            tally.failures.append(f"{operation.label} ({mode.value}, {'with' if key else 'without'} key): {exc}")


@pytest.fixture
def authority(key_authority: OrchestratorSettings) -> Iterator[OrchestratorSettings]:
    """The orchestrator running as the key authority (so an unknown key is answered 401, not 503)."""
    with TestClient(create_orchestrator(key_authority)) as client:
        _wait_ready(client.get)
        yield key_authority


@pytest.mark.parametrize("name", SERVICES)
def test_fuzzed_requests_get_no_server_error_and_answers_match_the_schema(
    name: str,
    key_authority: OrchestratorSettings,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    fuzz_report: list[str],
) -> None:
    assert key_authority.admin_api_key is not None
    headers = {"Authorization": f"Bearer {key_authority.admin_api_key.get_secret_value()}"}
    started = time.monotonic()
    tally = Tally()
    with ExitStack() as stack:
        if name != "orchestrator":  # the orchestrator is its own authority
            request.getfixturevalue("authority")
        app = _app(name, key_authority, tmp_path)
        stack.callback(asgi.shutdown_lifespans)  # schemathesis keeps an ASGI app's lifespan running until then
        schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=headers)
        with asgi.get_client(app) as client:  # type: ignore[arg-type]  # its ASGI type is narrower than Starlette's
            _wait_ready(client.get)
        for result in schema.get_all_operations():
            if isinstance(result, Err):
                raise result.err()  # a part of the document schemathesis cannot read is a defect too
            operation = result.ok()
            if operation.label not in NOT_FUZZED.get(name, set()):
                # The dashboard's viewer gate sends a viewer without a key to /login (services/dashboard/tests).
                _fuzz(operation, headers, tally, authenticated_only=name == "dashboard")
    fuzz_report.append(
        f"{name}: {tally.cases} cases, {tally.server_errors} server errors, {len(tally.failures)} failures, "
        f"statuses {dict(sorted(tally.statuses.items()))}, {time.monotonic() - started:.1f} s"
    )
    assert tally.cases > 0, f"no case was sent to the {name}"
    assert not tally.failures, f"{name}: {tally.cases} cases\n\n" + "\n\n".join(tally.failures)
