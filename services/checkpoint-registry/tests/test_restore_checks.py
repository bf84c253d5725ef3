"""Restore-time checks and re-verification: a checkpoint that lost a file or a byte after validation is never handed
out for a restore, on SQLite and PostgreSQL."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from reprise_registry.validation.recheck import Reverify, reverify_due

WriteCheckpoint = Callable[..., dict[str, Any]]


def _validated(client: TestClient, write_checkpoint: WriteCheckpoint, job_id: str, steps: list[int]) -> dict[int, Any]:
    checkpoints = {}
    for step in steps:
        checkpoint = write_checkpoint(client, job_id=job_id, step=step)
        answer = client.post(f"/v1/checkpoints/{checkpoint['id']}/validate")
        assert answer.json()["state"] == "validated", answer.text
        checkpoints[step] = checkpoint
    return checkpoints


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only a digest can tell
    path.write_bytes(bytes(data))


def _state(client: TestClient, checkpoint_id: int) -> str:
    state: str = client.get(f"/v1/checkpoints/{checkpoint_id}").json()["state"]
    return state


def _restore_point(client: TestClient, job_id: str, **params: int) -> dict[str, Any]:
    answer = client.post(f"/v1/jobs/{job_id}/restore-point", params=params)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def test_a_restore_skips_checkpoints_that_vanished_or_shrank_and_marks_them_corrupt(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    checkpoints = _validated(client, write_checkpoint, "job-r", [100, 200, 300])
    shutil.rmtree(checkpoints[300]["root"])  # the whole directory deleted after validation
    (checkpoints[200]["root"] / "rank-00001.pt").write_bytes(b"short")  # one file truncated

    picked = _restore_point(client, "job-r")

    assert picked["checkpoint"]["step"] == 100
    assert [(s["step"], s["reason"].split(":")[0]) for s in picked["skipped"]] == [
        (300, "missing_marker"),
        (200, "size_mismatch"),
    ]
    assert _state(client, checkpoints[300]["id"]) == _state(client, checkpoints[200]["id"]) == "corrupt"
    assert client.get("/v1/jobs/job-r/checkpoints/latest").json()["step"] == 100
    files = {(f["path"], f["rank"]): f for f in picked["files"]}
    assert set(files) == {("rank-00000.pt", 0), ("rank-00001.pt", 1)}
    assert all(len(f["digest"]) == 64 and f["algorithm"] == "blake3" for f in files.values())
    assert picked["digests_checked"] is False


def test_a_flipped_byte_passes_the_presence_check_but_not_a_full_one(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    checkpoints = _validated(client, write_checkpoint, "job-f", [100, 200])
    _flip_byte(checkpoints[200]["root"] / "rank-00000.pt")

    # Sizes agree: the registry hands it out with the manifest, and the ranks' load checks the digests.
    assert _restore_point(client, "job-f")["checkpoint"]["step"] == 200
    # A manifest larger than the caller can carry is re-hashed here in full first.
    picked = _restore_point(client, "job-f", carry_files=1)
    assert picked["checkpoint"]["step"] == 100 and picked["digests_checked"] is True and picked["files"] == []
    assert picked["skipped"][0]["reason"].startswith("digest_mismatch")


def test_a_failed_load_has_every_file_re_hashed(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    checkpoints = _validated(client, write_checkpoint, "job-l", [100, 200, 300])
    _flip_byte(checkpoints[300]["root"] / "rank-00001.pt")

    client.post(f"/v1/checkpoints/{checkpoints[300]['id']}/load-failed", json={"reason": "digest differs on rank 1"})
    client.post(f"/v1/checkpoints/{checkpoints[200]['id']}/load-failed", json={"reason": "a flaky read"})

    deadline = time.monotonic() + 10
    while _state(client, checkpoints[300]["id"]) != "corrupt":
        assert time.monotonic() < deadline, "the failed checkpoint was not re-hashed within 10 s"
        time.sleep(0.05)
    # Intact files stay validated (a load that failed for another reason is only skipped).
    assert _state(client, checkpoints[200]["id"]) == "validated"
    assert client.get("/v1/jobs/job-l/checkpoints/latest").json()["step"] == 100


def test_the_periodic_sweep_re_verifies_the_newest_checkpoints_of_each_job(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    first = _validated(client, write_checkpoint, "job-p", [100, 200, 300])
    other = _validated(client, write_checkpoint, "job-q", [100])
    for checkpoint in (first[100], first[300], other[100]):
        _flip_byte(checkpoint["root"] / "rank-00000.pt")
    engines = client.app.state.deps.engines  # type: ignore[attr-defined]
    roots = client.app.state.deps.settings.checkpoint_roots  # type: ignore[attr-defined]

    plan = Reverify(interval_s=3600, per_job=2, sample_fraction=1.0)
    assert reverify_due(engines, plan=plan, roots=roots) == 0  # verified just now: not due yet
    plan = Reverify(interval_s=0.001, per_job=2, sample_fraction=1.0)
    assert reverify_due(engines, plan=plan, roots=roots) == 3

    assert [_state(client, first[step]["id"]) for step in (100, 200, 300)] == ["validated", "validated", "corrupt"]
    assert _state(client, other[100]["id"]) == "corrupt"
    assert client.get("/v1/jobs/job-p/checkpoints/latest").json()["step"] == 200


def test_no_checkpoint_to_restore_is_an_empty_answer(client: TestClient, write_checkpoint: WriteCheckpoint) -> None:
    assert _restore_point(client, "job-none") == {
        "checkpoint": None,
        "files": [],
        "digests_checked": False,
        "skipped": [],
    }
    only = _validated(client, write_checkpoint, "job-gone", [100])
    shutil.rmtree(only[100]["root"])
    picked = _restore_point(client, "job-gone")
    assert picked["checkpoint"] is None and [s["id"] for s in picked["skipped"]] == [only[100]["id"]]


def test_a_restore_before_a_step_picks_the_newest_older_checkpoint_and_leaves_newer_ones_alone(
    client: TestClient, write_checkpoint: WriteCheckpoint
) -> None:
    checkpoints = _validated(client, write_checkpoint, "job-b", [100, 200, 300])
    shutil.rmtree(checkpoints[100]["root"])  # gone after validation: the next older one is not there either

    assert _restore_point(client, "job-b", before_step=300)["checkpoint"]["step"] == 200  # a NaN at step 300
    assert _restore_point(client, "job-b", before_step=201)["checkpoint"]["step"] == 200
    nothing = _restore_point(client, "job-b", before_step=200)
    assert nothing["checkpoint"] is None and [s["step"] for s in nothing["skipped"]] == [100]
    assert _state(client, checkpoints[300]["id"]) == "validated"  # passed over, not judged
    assert _restore_point(client, "job-b")["checkpoint"]["step"] == 300
    refused = client.post("/v1/jobs/job-b/restore-point", params={"before_step": -1})
    assert refused.status_code == 422 and "before_step" in refused.text
