"""Event times against the real detector: an agent's clock is trusted only as far as its events' arrival allows, and
an incident starts with its own root cause."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from reprise_common.clock import utcnow
from reprise_common.events import GpuXid, RankExited

# `Harness` and `StartDetector` (tests/conftest.py) are passed in as fixtures; conftest is not importable here.
Harness = Any
StartDetector = Any


def _crash(node_id: str, rank: int, *, time: datetime, line: str) -> RankExited:
    return RankExited(
        source=node_id, node_id=node_id, job_id="job-a", rank=rank, exit_code=1, log_tail=[line], time=time
    )


async def test_an_agent_clock_running_ahead_keeps_the_root_cause_of_its_own_crash(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    own = _crash("node-1", 0, time=utcnow() + timedelta(seconds=2), line="RuntimeError: bad batch")  # clock 2 s ahead
    await h.emit("node-1", own)
    await asyncio.sleep(0.3)
    await h.emit("node-2", _crash("node-2", 1, time=utcnow(), line="ValueError: peer failed on its own"))
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert (incident["culprit_node_id"], incident["culprit_rank"]) == ("node-1", 0)
    assert incident["symptom_count"] == 2
    assert datetime.fromisoformat(incident["first_symptom_at"]) <= datetime.fromisoformat(incident["opened_at"])
    [symptom] = h.symptoms(own.event_id)
    assert symptom.time < own.time - timedelta(seconds=1)  # dated by its arrival, not by the clock ahead


async def test_an_agent_clock_running_behind_is_trusted_only_by_the_skew_allowance(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h = await start_detector(sqlite_url, event_clock_skew_s=0.2)
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    await h.emit("node-2", _crash("node-2", 1, time=utcnow(), line="ValueError: the real first failure"))
    await asyncio.sleep(0.5)  # longer than the allowance
    behind = _crash("node-1", 0, time=utcnow() - timedelta(seconds=5), line="RuntimeError: later, clock 5 s behind")
    await h.emit("node-1", behind)
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert (incident["culprit_node_id"], incident["culprit_rank"]) == ("node-2", 1)
    [symptom] = h.symptoms(behind.event_id)
    assert symptom.time >= behind.time + timedelta(seconds=4)  # at most the allowance before its arrival


async def test_an_incident_starts_with_its_root_cause_not_an_earlier_unrelated_warning(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h = await start_detector(sqlite_url, event_clock_skew_s=60)  # so that the test can date the warning 13 s back
    await h.place("job-a", [(0, "node-1", 0)])
    warning = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=999, time=utcnow() - timedelta(seconds=13))
    await h.emit("node-1", warning)  # an XID the rules do not know: kept on its own, not a cause
    await h.settled()
    crash = _crash("node-1", 0, time=utcnow(), line="RuntimeError: bad batch")
    await h.emit("node-1", crash)
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    first_symptom = datetime.fromisoformat(incident["first_symptom_at"])
    assert first_symptom == crash.time
    assert first_symptom <= datetime.fromisoformat(incident["opened_at"])
    [changed] = await h.changes("job-a")
    assert changed.first_symptom_at == crash.time


async def test_an_incident_opened_from_a_future_dated_event_starts_no_later_than_its_opening(
    detector: Harness,
) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    await h.emit("node-1", _crash("node-1", 0, time=utcnow() + timedelta(seconds=30), line="RuntimeError: x"))
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert datetime.fromisoformat(incident["first_symptom_at"]) <= datetime.fromisoformat(incident["opened_at"])


def _xid(node_id: str, *, time: datetime) -> GpuXid:
    return GpuXid(source=node_id, node_id=node_id, gpu=0, xid=79, time=time)


async def _reports(h: Harness, ahead_s: float) -> None:
    """A few reports of each node, node-1's clock running `ahead_s` ahead: the detector measures its offset."""
    for _ in range(3):
        await h.report("node-1", time=utcnow() + timedelta(seconds=ahead_s))
        await h.report("node-2", time=utcnow())
        await asyncio.sleep(0.05)
    await h.settled()


async def test_a_culprit_clock_2_s_ahead_keeps_one_fault_one_incident_when_its_xid_arrives_after_the_relaunch(
    detector: Harness,
) -> None:
    """A peer's crash opened the incident and the job was relaunched in place before the culprit node's XID arrived;
    the XID, stamped by a clock 2 s ahead, is dated by the node's measured offset (before the relaunch), so it
    deepens the same incident instead of opening a second one (a second recovery)."""
    h = detector
    ranks = [(0, "node-1", 0), (1, "node-2", 0)]
    await h.place("job-a", ranks)
    await _reports(h, ahead_s=2.0)
    xid = _xid("node-1", time=utcnow() + timedelta(seconds=2))  # both happen now
    crash = _crash("node-2", 1, time=utcnow(), line="RuntimeError: bad batch")
    await h.emit("node-2", crash)
    await h.settled()
    await asyncio.sleep(0.3)
    await h.place("job-a", ranks, epoch=1)  # the recovery relaunched
    await h.emit("node-1", xid)
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert (incident["culprit_node_id"], incident["category"]) == ("node-1", "gpu_hardware"), incident
    [symptom] = h.symptoms(xid.event_id)
    assert abs(symptom.time - crash.time) < timedelta(seconds=0.5), (symptom.time, crash.time)


async def test_a_late_symptom_of_a_replaced_launch_never_opens_a_second_incident(detector: Harness) -> None:
    """The culprit's XID opened the incident and the job was relaunched without its node; a peer's crash of the old
    launch, dated after the relaunch (a clock ahead, or simply late), carries its launch's epoch: it is evidence of
    the replaced launch, not a new fault."""
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    await h.emit("node-1", _xid("node-1", time=utcnow() + timedelta(seconds=2)))
    await h.settled()
    await asyncio.sleep(0.3)
    await h.place("job-a", [(0, "node-3", 0), (1, "node-2", 0)], epoch=1)
    late = _crash("node-2", 1, time=utcnow(), line="RuntimeError: Gloo connectFullMesh failed")
    await h.emit("node-2", late.model_copy(update={"restart_epoch": 0}))
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert (incident["culprit_node_id"], incident["category"]) == ("node-1", "gpu_hardware"), incident
    fresh = _crash("node-2", 1, time=utcnow(), line="RuntimeError: bad batch")
    await h.emit("node-2", fresh.model_copy(update={"restart_epoch": 1}))  # the new launch's own fault still counts
    await h.settled()
    assert len((await h.incidents(job_id="job-a"))["data"]) == 2
