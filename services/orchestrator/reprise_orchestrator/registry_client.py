"""The orchestrator's view of the checkpoint registry: which checkpoint a job should resume from."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from reprise_common.errors import RepriseError


class RegistryUnavailableError(RepriseError):
    """The registry did not answer; a restore cannot be decided without it."""


@dataclass(frozen=True)
class RestorePoint:
    """A validated checkpoint to resume from."""

    checkpoint_id: int
    step: int
    path: str


class RegistryClient:
    """HTTP client with explicit timeouts."""

    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self._client = httpx.AsyncClient(base_url=base_url, timeout=timeout_s)

    async def latest_validated(self, job_id: str) -> RestorePoint | None:
        """The newest validated checkpoint, or None when the job has none yet."""
        try:
            response = await self._client.get(f"/v1/jobs/{job_id}/checkpoints/latest")
        except httpx.HTTPError as exc:
            raise RegistryUnavailableError(f"checkpoint registry unreachable: {exc!r}") from exc
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise RegistryUnavailableError(f"checkpoint registry answered {response.status_code}")
        body = response.json()
        return RestorePoint(checkpoint_id=int(body["id"]), step=int(body["step"]), path=str(body["path"]))

    async def ready(self) -> bool:
        """True when the registry answers its readiness probe."""
        try:
            return (await self._client.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        """Close connections."""
        await self._client.aclose()
