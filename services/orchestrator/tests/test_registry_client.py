"""The orchestrator's registry client against a real registry process: restore point, files, pin, unpin."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from reprise_cli.servers import ManagedProcess, free_port, wait_until
from reprise_orchestrator.registry_client import RegistryClient

KEY = secrets.token_urlsafe(32)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    process = ManagedProcess(
        "registry",
        [str(Path(sys.executable).parent / "reprise-registry")],
        tmp_path / "registry.log",
        {
            "REPRISE_HTTP_PORT": str(port),
            "REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'registry.db'}",
            "REPRISE_STATE_DIR": str(tmp_path / "state"),
            "REPRISE_NATS_URL": f"nats://127.0.0.1:{free_port()}",  # none there: the REST side works without it
            "REPRISE_ADMIN_API_KEY": KEY,  # accepted without the key authority, which this test does not run
        },
    )
    process.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(up, timeout_s=30), process.log_tail()
    yield url
    process.stop()


def _validated_checkpoint(url: str, root: Path) -> int:
    root.mkdir(parents=True)
    data = b"weights" * 100
    (root / "rank-00000.pt").write_bytes(data)
    (root / "COMMITTED").write_bytes(b"")
    body = {"job_id": "job-r", "step": 50, "path": str(root), "world_size": 1, "layout": "per_rank"}
    checkpoint_id = int(httpx.post(url + "/v1/checkpoints", json=body, headers=AUTH).raise_for_status().json()["id"])
    digest = hashlib.sha256(data).hexdigest()
    files = {"files": [{"path": "rank-00000.pt", "size_bytes": len(data), "digest": digest, "algorithm": "sha256"}]}
    httpx.put(f"{url}/v1/checkpoints/{checkpoint_id}/ranks/0", json=files, headers=AUTH).raise_for_status()
    httpx.post(f"{url}/v1/checkpoints/{checkpoint_id}/commit", headers=AUTH).raise_for_status()
    answer = (
        httpx.post(f"{url}/v1/checkpoints/{checkpoint_id}/validate", json={}, headers=AUTH).raise_for_status().json()
    )
    assert answer["state"] == "validated", answer
    return checkpoint_id


def _holders(url: str, checkpoint_id: int) -> list[str]:
    return [pin["holder"] for pin in httpx.get(f"{url}/v1/checkpoints/{checkpoint_id}/pins", headers=AUTH).json()]


async def test_restore_point_is_pinned_for_the_recovery_and_released(registry: str, tmp_path: Path) -> None:
    client = RegistryClient(registry, timeout_s=5, api_key=KEY)
    assert (await client.restore_point("job-r")).point is None
    checkpoint_id = _validated_checkpoint(registry, tmp_path / "ckpt")
    restore = (await client.restore_point("job-r")).point
    assert restore is not None and (restore.checkpoint_id, restore.step) == (checkpoint_id, 50)
    digest = hashlib.sha256(b"weights" * 100).hexdigest()
    assert [(f.path, f.size_bytes, f.algorithm, f.digest) for f in restore.files or ()] == [
        ("rank-00000.pt", 700, "sha256", digest)
    ]
    assert await client.restore_files(checkpoint_id) == restore.files

    assert await client.pin(checkpoint_id, holder="rec-1", ttl_s=60)
    assert await asyncio.to_thread(_holders, registry, checkpoint_id) == ["rec-1"]
    assert await client.unpin(checkpoint_id, holder="rec-1")
    assert await asyncio.to_thread(_holders, registry, checkpoint_id) == []
    assert not await client.pin(999_999, holder="rec-1", ttl_s=60)  # unknown checkpoint: refused, no exception
    await client.close()


async def test_a_checkpoint_that_vanished_is_skipped_and_named(registry: str, tmp_path: Path) -> None:
    client = RegistryClient(registry, timeout_s=5, api_key=KEY)
    checkpoint_id = _validated_checkpoint(registry, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "rank-00000.pt").unlink()
    pick = await client.restore_point("job-r")
    assert pick.point is None
    assert [(s.id, s.step, s.reason.split(":")[0]) for s in pick.skipped] == [(checkpoint_id, 50, "missing_file")]
    await client.close()
