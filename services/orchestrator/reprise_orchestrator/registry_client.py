"""The orchestrator's view of the checkpoint registry: which checkpoint a job should resume from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class Registry(Protocol):
    """What the orchestrator asks of the checkpoint registry."""

    async def latest_validated(self, job_id: str) -> RestorePoint | None:
        """The newest validated checkpoint, or None when the job has none yet."""
        ...

    async def pin(self, checkpoint_id: int, *, holder: str, ttl_s: float) -> bool:
        """Keep retention away from a checkpoint while a recovery uses it."""
        ...

    async def unpin(self, checkpoint_id: int, *, holder: str) -> bool:
        """Release a recovery's pin."""
        ...

    async def load_failed(self, checkpoint_id: int, *, reason: str) -> bool:
        """Say that restoring a checkpoint failed."""
        ...

    async def ready(self) -> bool:
        """True when the registry answers."""
        ...

    async def close(self) -> None:
        """Close connections."""
        ...


class RegistryClient:
    """The registry over HTTP, with explicit timeouts."""

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

    async def pin(self, checkpoint_id: int, *, holder: str, ttl_s: float) -> bool:
        """Keep retention away from a checkpoint while a recovery uses it; False when the registry refused."""
        try:
            response = await self._client.post(
                f"/v1/checkpoints/{checkpoint_id}/pins", json={"holder": holder, "ttl_s": ttl_s}
            )
        except httpx.HTTPError:
            return False
        return response.status_code in (200, 201)

    async def unpin(self, checkpoint_id: int, *, holder: str) -> bool:
        """Release a recovery's pin (idempotent)."""
        try:
            response = await self._client.delete(f"/v1/checkpoints/{checkpoint_id}/pins/{holder}")
        except httpx.HTTPError:
            return False
        return response.status_code in (200, 204, 404)

    async def load_failed(self, checkpoint_id: int, *, reason: str) -> bool:
        """Tell the registry that restoring a checkpoint failed, so latest-validated falls back to the one before."""
        try:
            response = await self._client.post(f"/v1/checkpoints/{checkpoint_id}/load-failed", json={"reason": reason})
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def ready(self) -> bool:
        """True when the registry answers its readiness probe."""
        try:
            return (await self._client.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        """Close connections."""
        await self._client.aclose()
