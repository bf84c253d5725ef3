"""An incident whose recovery brought its job back is mitigated; one whose recovery failed or was held stays open."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from reprise_common import subjects
from reprise_common.events import GpuXid, RecoveryChange
from reprise_detector.runtime import RECOVERIES_DURABLE

# `Harness` and `StartDetector` (tests/conftest.py) are passed in as fixtures; conftest is not importable here.
Harness = Any
StartDetector = Any


async def _recovery(h: Harness, job_id: str, incident_id: str, change: Literal["succeeded", "failed"]) -> None:
    """Publish the end of a recovery as the orchestrator does, and wait until the detector has read it."""
    outcome = "recovered" if change == "succeeded" else "detector_asked_for_a_human"
    event = RecoveryChange(
        source="orchestrator",
        change=change,
        recovery_id=f"rec-{job_id}",
        job_id=job_id,
        incident_id=incident_id,
        step="running" if change == "succeeded" else "held",
        fence=1,
        outcome=outcome,
    )
    await h.agents.publish(subjects.recovery(job_id, change), event)
    for _ in range(500):
        info = await h.agents.js.consumer_info(subjects.RECOVERIES_STREAM, RECOVERIES_DURABLE)
        if not info.num_pending and not info.num_ack_pending:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the detector did not read the recovery change")


async def test_a_recovered_incident_is_mitigated_and_a_held_one_stays_open(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    await h.place("job-b", [(0, "node-2", 0)])
    for node_id in ("node-1", "node-2"):
        await h.emit(node_id, GpuXid(source=node_id, node_id=node_id, gpu=0, xid=79))
    await h.settled()
    [recovered] = (await h.incidents(job_id="job-a"))["data"]
    [held] = (await h.incidents(job_id="job-b"))["data"]

    await _recovery(h, "job-a", recovered["id"], "succeeded")
    await _recovery(h, "job-b", held["id"], "failed")

    assert (await h.incident(recovered["id"]))["state"] == "mitigated"
    assert (await h.incident(held["id"]))["state"] == "open"
    assert [i["id"] for i in (await h.incidents(state="mitigated"))["data"]] == [recovered["id"]]
    assert [c.change for c in await h.changes("job-a")] == ["opened"]  # nothing the orchestrator would act on
