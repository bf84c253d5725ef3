"""A small client for the platform's public interfaces (REST and NATS), shared by the CLI demo and the tests."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from reprise_cli.topology import DEFAULT_PORTS
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import InjectFault, InjectReply

T = TypeVar("T")
LOCAL_HOST = "127.0.0.1"


class PlatformClient:
    """REST calls to the orchestrator, detector and registry; fault injection over NATS.

    Addresses default to the local stack's; `api_key` goes with every call (each service checks it).
    """

    def __init__(
        self,
        *,
        orchestrator: str = f"http://{LOCAL_HOST}:{DEFAULT_PORTS['orchestrator']}",
        detector: str = f"http://{LOCAL_HOST}:{DEFAULT_PORTS['detector']}",
        registry: str = f"http://{LOCAL_HOST}:{DEFAULT_PORTS['checkpoint-registry']}",
        nats_url: str = f"nats://{LOCAL_HOST}:{DEFAULT_PORTS['nats']}",
        nkey_seed_file: Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.http = httpx.Client(timeout=30.0, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.orchestrator = orchestrator
        self.detector = detector
        self.registry = registry
        self.nats_url = nats_url
        self.nkey_seed_file = nkey_seed_file

    def close(self) -> None:
        """Close connections."""
        self.http.close()

    def submit_job(
        self,
        *,
        name: str,
        node_count: int,
        ranks_per_node: int,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> dict[str, Any]:
        """Submit a job (the ticker workload unless a command is given); raises on a non-201 answer."""
        body = {
            "name": name,
            "node_count": node_count,
            "ranks_per_node": ranks_per_node,
            "command": command or [sys.executable, "-m", "reprise_cli.workloads.ticker"],
            "env": env or {},
        }
        return self.submit(body)

    def _orchestrator(self, method: str, path: str, **kwargs: Any) -> Any:
        """One orchestrator call with the API key; raises httpx.HTTPStatusError on an error answer."""
        response = self.http.request(method, f"{self.orchestrator}{path}", **kwargs)
        return response.raise_for_status().json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Submit a job given as the POST /v1/jobs body."""
        job: dict[str, Any] = self._orchestrator("POST", "/v1/jobs", json=spec)
        return job

    def jobs(
        self, *, state: str | None = None, labels: list[str] | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Jobs, newest first, optionally in one state and carrying every `key=value` label given."""
        params: dict[str, Any] = {"limit": limit} | ({"state": state} if state else {}) | {"label": labels or []}
        return list(self._orchestrator("GET", "/v1/jobs", params=params)["data"])

    def job(self, job_id: str) -> dict[str, Any]:
        """One job."""
        body: dict[str, Any] = self._orchestrator("GET", f"/v1/jobs/{job_id}")
        return body

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job: its ranks are stopped; answers the job."""
        body: dict[str, Any] = self._orchestrator("POST", f"/v1/jobs/{job_id}/cancel")
        return body

    def start_drill(self, job_id: str, *, fault: str, rank: int | None = None) -> dict[str, Any]:
        """Start a recovery drill on a running job; answers the drill as it starts."""
        body: dict[str, Any] = self._orchestrator(
            "POST", f"/v1/jobs/{job_id}/drills", json={"fault": fault, "rank": rank}
        )
        return body

    def drill(self, drill_id: str) -> dict[str, Any]:
        """One drill, with what it has measured so far."""
        body: dict[str, Any] = self._orchestrator("GET", f"/v1/drills/{drill_id}")
        return body

    def uncordon(self, node_id: str) -> dict[str, Any]:
        """Put a node back into service (POST /v1/nodes/{id}/uncordon)."""
        answer: dict[str, Any] = self._orchestrator("POST", f"/v1/nodes/{node_id}/uncordon")
        return answer

    def recoveries(self, job_id: str) -> list[dict[str, Any]]:
        """A job's recoveries, newest first."""
        return list(self._orchestrator("GET", f"/v1/jobs/{job_id}/recoveries")["data"])

    def incidents(self, job_id: str) -> list[dict[str, Any]]:
        """A job's incidents."""
        body = self.http.get(f"{self.detector}/v1/incidents", params={"job_id": job_id}).raise_for_status().json()
        return list(body["data"])

    def latest_checkpoint(self, job_id: str) -> httpx.Response:
        """The registry's answer to a latest-validated query (200 or 404)."""
        return self.http.get(f"{self.registry}/v1/jobs/{job_id}/checkpoints/latest")

    def nodes(self) -> list[dict[str, Any]]:
        """The orchestrator's node inventory."""
        body: list[dict[str, Any]] = self._orchestrator("GET", "/v1/nodes")
        return body

    def inject(self, fault: InjectFault, *, node_id: str) -> InjectReply:
        """Inject a simulated GPU fault into a node over NATS."""

        async def send() -> InjectReply:
            bus = Bus(url=self.nats_url, service="reprise-client", nkey_seed_file=self.nkey_seed_file)
            await bus.connect(attempts=5)
            try:
                return await bus.request(subjects.node_inject(node_id), fault, InjectReply, timeout=5.0)
            finally:
                await bus.close()

        return asyncio.run(send())


def step_seconds(step: dict[str, Any]) -> float | None:
    """How long a recovery step took, from its started_at and ended_at; None while it runs."""
    if step.get("ended_at") is None:
        return None
    return (datetime.fromisoformat(step["ended_at"]) - datetime.fromisoformat(step["started_at"])).total_seconds()


def poll(fetch: Callable[[], T], done: Callable[[T], bool], *, timeout_s: float, interval_s: float = 0.1) -> T:
    """Fetch until done(value) holds; returns the last value either way."""
    deadline = time.monotonic() + timeout_s
    value = fetch()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = fetch()
    return value
