"""A small client for the platform's public interfaces (REST and NATS), shared by the CLI demo and the tests."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import InjectFault, InjectReply

T = TypeVar("T")


class PlatformClient:
    """REST calls to the orchestrator, detector and registry; fault injection over NATS."""

    def __init__(
        self, *, orchestrator: str, detector: str, registry: str, nats_url: str, nkey_seed_file: Path | None = None
    ) -> None:
        self.http = httpx.Client(timeout=30.0)
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
        response = self.http.post(f"{self.orchestrator}/v1/jobs", json=body)
        response.raise_for_status()
        job: dict[str, Any] = response.json()
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        """One job."""
        body: dict[str, Any] = self.http.get(f"{self.orchestrator}/v1/jobs/{job_id}").raise_for_status().json()
        return body

    def recoveries(self, job_id: str) -> list[dict[str, Any]]:
        """A job's recoveries, newest first."""
        body = self.http.get(f"{self.orchestrator}/v1/jobs/{job_id}/recoveries").raise_for_status().json()
        return list(body["data"])

    def incidents(self, job_id: str) -> list[dict[str, Any]]:
        """A job's incidents."""
        body = self.http.get(f"{self.detector}/v1/incidents", params={"job_id": job_id}).raise_for_status().json()
        return list(body["data"])

    def latest_checkpoint(self, job_id: str) -> httpx.Response:
        """The registry's answer to a latest-validated query (200 or 404)."""
        return self.http.get(f"{self.registry}/v1/jobs/{job_id}/checkpoints/latest")

    def nodes(self) -> list[dict[str, Any]]:
        """The orchestrator's node inventory."""
        body: list[dict[str, Any]] = self.http.get(f"{self.orchestrator}/v1/nodes").raise_for_status().json()
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


def poll(fetch: Callable[[], T], done: Callable[[T], bool], *, timeout_s: float, interval_s: float = 0.1) -> T:
    """Fetch until done(value) holds; returns the last value either way."""
    deadline = time.monotonic() + timeout_s
    value = fetch()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = fetch()
    return value
