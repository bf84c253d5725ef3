"""Hangs of a job without the SDK, on the real platform: its agents sample the ranks' stacks with py-spy, and the
detector calls the job hung when a rank waits in a collective for a peer blocked elsewhere, naming that peer; a
healthy run with a pause longer than the startup grace is not called hung (docs/detector.md, "Hangs without the
SDK"). Small limits, so that each test takes well under a minute once the ranks have imported torch."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.client import PlatformClient, poll
from reprise_cli.stack import Stack
from reprise_cli.topology import StackConfig
from reprise_common.clock import utcnow

pytestmark = [pytest.mark.stack, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parent / "stepless_job.py"
LIMIT_S = 6.0  # REPRISE_HANG_STEPLESS_S
SETTINGS = {
    "REPRISE_STACK_SAMPLE_S": "1",  # the agents sample every rank's stack each second
    "REPRISE_HANG_STEPLESS_S": f"{LIMIT_S:g}",
    "REPRISE_HANG_STEPLESS_GRACE_S": "2",
    # A short startup limit: without stack samples, a job that reports no steps is called hung once its ranks have
    # run this long, whatever they do (a plain script never leaves `startup`).
    "REPRISE_HANG_STARTUP_S": "20",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`reprise up` with two one-GPU workers and the small limits above."""
    state = tmp_path_factory.mktemp("stepless") / "state"
    with pytest.MonkeyPatch.context() as env:
        for name, value in SETTINGS.items():
            env.setenv(name, value)
        running = Stack(StackConfig(nodes=2, spares=0, gpus_per_node=1, state_dir=state), free_ports=True)
        try:
            running.start(timeout_s=90)
            yield running
        finally:
            running.stop()


def submit(client: PlatformClient, control: Path) -> dict[str, Any]:
    """The script on 2 nodes x 1 rank, steered by files in `control`; once both ranks took a step."""
    control.mkdir()
    command = [sys.executable, str(SCRIPT), "--control", str(control), "--step-s", "0.1"]
    job = client.submit({"name": "stepless", "node_count": 2, "ranks_per_node": 1, "command": command,
                         "env": {"OMP_NUM_THREADS": "1"}})  # fmt: skip
    poll(lambda: all((control / f"running-{r}").exists() for r in (0, 1)), bool, timeout_s=120)
    return job


def cancel(client: PlatformClient, job: dict[str, Any]) -> None:
    """End the job, so that the next test has the nodes."""
    client.cancel(job["id"])
    ended = ("cancelled", "completed", "failed")
    poll(lambda: client.job(job["id"])["state"], lambda state: state in ended, timeout_s=60)


def opened_since(client: PlatformClient, job_id: str, since: datetime) -> list[dict[str, Any]]:
    """The job's incidents opened at or after `since`."""
    return [i for i in client.incidents(job_id) if datetime.fromisoformat(i["opened_at"]) >= since]


def test_a_rank_blocked_in_python_while_its_peer_waits_in_all_reduce_is_called_hung_and_named(
    stack: Stack, tmp_path: Path
) -> None:
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 2, timeout_s=15)
        submitted = utcnow()
        job = submit(client, tmp_path / "control")
        early = client.incidents(job["id"])  # nothing while it trained
        blocked_at = utcnow()
        (tmp_path / "control" / "block-1").touch()  # rank 1 waits in Python, rank 0 in all_reduce for it
        found = poll(lambda: opened_since(client, job["id"], blocked_at), bool, timeout_s=LIMIT_S + 40)
        (tmp_path / "control" / "block-1").unlink()
        placement = {r["rank"]: r["node_id"] for r in client.job(job["id"])["placement"]}
        cancel(client, job)
    finally:
        client.close()
    assert early == [], early
    assert found, "no incident"
    incident = found[0]
    detected_s = (datetime.fromisoformat(incident["opened_at"]) - blocked_at).total_seconds()
    print(f"called hung {detected_s:.1f} s after rank 1 blocked (limit {LIMIT_S:g} s); {incident['root_cause']}")
    assert incident["category"] == "hang", incident
    assert (incident["culprit_rank"], incident["culprit_node_id"]) == (1, placement[1]), incident
    assert detected_s <= LIMIT_S + 15, detected_s
    assert datetime.fromisoformat(incident["opened_at"]) > submitted


def test_a_healthy_run_without_the_sdk_pausing_longer_than_its_grace_is_not_called_hung(
    stack: Stack, tmp_path: Path
) -> None:
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 2, timeout_s=15)
        job = submit(client, tmp_path / "control")
        # Rank 0 evaluates for 3 x the limit while rank 1 waits in a barrier, past the startup limit of a job without
        # stack samples, then both train on.
        (tmp_path / "control" / "pause").write_text(f"{3 * LIMIT_S:g}")
        poll(lambda: not (tmp_path / "control" / "pause").exists(), bool, timeout_s=10)
        time.sleep(3 * LIMIT_S + 8)
        incidents = client.incidents(job["id"])
        state = client.job(job["id"])["state"]
        cancel(client, job)
    finally:
        client.close()
    assert incidents == [], [i["root_cause"] for i in incidents]
    assert state == "running", state
