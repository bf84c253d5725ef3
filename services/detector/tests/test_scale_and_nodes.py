"""Two replicas sharing the load without double incidents; node reputation and quarantine; node and hang routes."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from reprise_common import subjects
from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import GpuXid, RankExited, RankStatus
from reprise_detector.partition import partition_of
from reprise_detector.runtime import EVENTS_DURABLE

Harness = Any  # tests/conftest.py
StartDetector = Any


async def test_two_replicas_split_the_jobs_and_open_each_incident_once(
    start_detector: StartDetector, database_url: str
) -> None:
    clock = ManualClock(utcnow())
    replicas = [
        await start_detector(database_url, clock=clock, partition_count=2, partition_index=i, watch_interval_s=3600)
        for i in range(2)
    ]
    jobs = [f"job-{n}" for n in range(8)]
    assert {partition_of(j, 2) for j in jobs} == {0, 1}  # both replicas own some
    for n, job in enumerate(jobs):
        await replicas[0].place(job, [(0, f"node-{n}", 0), (1, "node-shared", n)])
        assert await replicas[1].runtime.placements.wait_for_seq(replicas[1].runtime.placements.last_seq, timeout=5)
    h = replicas[0]
    for n, job in enumerate(jobs):  # one crash per job, plus a redelivered copy
        crash = RankExited(source=f"node-{n}", node_id=f"node-{n}", job_id=job, rank=0, exit_code=1)
        for _ in range(2):
            await h.agents.js.publish(subjects.node_event(f"node-{n}", crash.type), crash.to_bytes())
    # A GPU fault on the shared node hits every job: each replica handles its own jobs.
    await h.emit("node-shared", GpuXid(source="node-shared", node_id="node-shared", gpu=3, xid=79))
    await h.report("node-shared")
    for replica in replicas:
        await replica.settled()
    await replicas[1].place("job-late", [(0, "node-shared", 7)])
    seq = replicas[1].runtime.placements.last_seq
    assert await replicas[0].runtime.placements.wait_for_seq(seq, timeout=5)
    clock.advance(6)
    for replica in replicas:
        await replica.runtime.watcher.tick()  # node-shared is lost: one node-lost symptom per job, by its owner

    page = await h.incidents(limit=1000)
    assert sorted(i["job_id"] for i in page["data"]) == sorted([*jobs, "job-late"])
    for job in jobs:
        [incident] = [i for i in page["data"] if i["job_id"] == job]
        assert incident["category"] == "gpu_hardware" and incident["symptom_count"] == 3  # crash, XID, node lost
        assert [c.change for c in await h.changes(job) if c.change == "opened"] == ["opened"]
    assert {r.runtime.durable(EVENTS_DURABLE) for r in replicas} == {"detector-events-p0of2", "detector-events-p1of2"}
    assert [r.runtime.watcher.reports_seen for r in replicas] == [1, 1]  # every replica hears every report


async def test_two_xid_48_in_a_day_recommend_a_quarantine_once(start_detector: StartDetector, sqlite_url: str) -> None:
    h = await start_detector(sqlite_url)
    await h.place("job-a", [(0, "node-1", 0)])
    t0 = utcnow()
    await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=48, time=t0 - timedelta(hours=20)))
    await h.settled()
    assert await h.quarantines() == []
    for hours in (0, 0.1):  # a second and a third: still one recommendation
        await h.emit(
            "node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=48, time=t0 + timedelta(hours=hours))
        )
        await h.settled()
    await h.emit("node-2", GpuXid(source="node-2", node_id="node-2", gpu=0, xid=48))
    await h.settled()
    [recommendation] = await h.quarantines()
    assert (recommendation.node_id, recommendation.reason) == ("node-1", "repeated_xid")
    assert recommendation.fault_count == 2 and recommendation.job_ids == ["job-a"]

    health = (await h.client.get("/v1/node-health/node-1")).json()
    assert health["quarantine_recommended"] and health["fault_count"] == 3
    assert [r["reason"] for r in health["recommendations"]] == ["repeated_xid"]
    assert not (await h.client.get("/v1/node-health/node-2")).json()["quarantine_recommended"]
    assert (await h.client.get("/v1/node-health/nowhere")).status_code == 404


async def test_hardware_faults_in_three_jobs_recommend_a_quarantine(detector: Harness) -> None:
    h = detector
    for n, job in enumerate(("job-a", "job-b", "job-c")):
        await h.place(job, [(0, "node-1", n)])
        await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=n, xid=79))
        await h.settled()
        await h.place(job, [(0, "node-1", n)], epoch=1)
    [recommendation] = await h.quarantines()
    assert recommendation.reason == "faults_across_jobs"
    assert recommendation.job_ids == ["job-a", "job-b", "job-c"]


async def test_node_health_lists_reporting_nodes(detector: Harness) -> None:
    h = detector
    await h.report("node-7")
    await h.settled()
    body = (await h.client.get("/v1/node-health")).json()
    assert [(n["node_id"], n["state"]) for n in body["data"]] == [("node-7", "alive")]
    assert body["data"][0]["last_report_age_s"] < 5


async def test_a_hang_policy_can_be_set_read_and_must_be_valid(detector: Harness) -> None:
    c = detector.client
    assert (await c.get("/v1/jobs/job-a/hang-policy")).status_code == 404
    body = {"timeout_s": 120, "startup_s": 600, "evaluating_s": 3000, "loading_data_s": 50}
    put = await c.put("/v1/jobs/job-a/hang-policy", json=body)
    assert put.status_code == 200 and put.json()["timeout_s"] == 120 and put.json()["k"] is None
    assert (await c.get("/v1/jobs/job-a/hang-policy")).json()["startup_s"] == 600
    for bad in ({"timeout_s": -1}, {"evaluating_s": 86401}, {"k": 1e6}):
        assert (await c.put("/v1/jobs/job-a/hang-policy", json=bad)).status_code == 422, bad
    limits = await detector.runtime.watcher.overrides()
    assert limits["job-a"].timeout_s == 120 and limits["job-a"].startup_s == 600
    assert (limits["job-a"].evaluating_s, limits["job-a"].loading_data_s) == (3000, 50)
    assert limits["job-a"].checkpointing_s == detector.runtime.watcher.hangs.defaults.checkpointing_s


async def test_a_placement_carries_the_jobs_hang_timeout_and_rest_overrides_win(detector: Harness) -> None:
    await detector.place("job-p", [(0, "node-1", 0)], hang_timeout_s=42)
    await detector.place("job-q", [(0, "node-1", 1)], hang_timeout_s=42)
    put = await detector.client.put("/v1/jobs/job-q/hang-policy", json={"timeout_s": 7})
    assert put.status_code == 200
    limits = await detector.runtime.watcher.overrides()
    assert limits["job-p"].timeout_s == 42 and limits["job-q"].timeout_s == 7
    await detector.place("job-p", [(0, "node-1", 0)], epoch=1)  # a new placement without one drops it
    assert "job-p" not in await detector.runtime.watcher.overrides()


async def test_a_fault_after_a_relaunch_opens_a_new_incident_with_its_exit_code(detector: Harness) -> None:
    h = detector
    await h.place("job-r", [(0, "node-1", 0), (1, "node-2", 0)])
    await h.emit("node-2", RankExited(source="node-2", node_id="node-2", job_id="job-r", rank=1, exit_code=3))
    await h.settled()
    await h.place("job-r", [(0, "node-1", 0), (1, "node-2", 0)], epoch=1)  # the orchestrator relaunched the job
    await h.emit("node-1", RankExited(source="node-1", node_id="node-1", job_id="job-r", rank=0, exit_code=4))
    await h.settled()
    body = (await h.client.get("/v1/incidents", params={"job_id": "job-r"})).json()
    assert sorted((i["culprit_rank"], i["culprit_exit_code"]) for i in body["data"]) == [(0, 4), (1, 3)]


async def test_ranks_a_relaunch_dropped_or_moved_stop_counting_for_hangs(detector: Harness) -> None:
    h = detector
    await h.place("job-s", [(0, "node-1", 0), (1, "node-2", 0)])
    for node, rank in (("node-1", 0), ("node-2", 1)):
        await h.report(node, [RankStatus(job_id="job-s", rank=rank, step=90, phase="training", restart_epoch=0)])
    await h.settled()
    book = h.runtime.watcher.book
    assert set(book.jobs["job-s"].ranks) == {0, 1}
    await h.place("job-s", [(0, "node-1", 0)], epoch=1)  # node-2 was lost: the job shrank to one rank
    await h.report("node-2", [RankStatus(job_id="job-s", rank=1, step=90, phase="training", restart_epoch=0)])
    await h.settled()
    await h.runtime.watcher.tick()
    assert set(book.jobs["job-s"].ranks) == {0}  # rank 1 on node-2 can no longer look hung


async def test_a_detector_behind_on_reading_reports_calls_no_node_lost_and_no_hang_for_its_own_delay(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    """A detector whose report handling stalls (a restart meeting a large fleet, a burst) holds reports that arrived
    but are not read yet: their nodes are not silent and their ranks not stalled. A node that really goes silent is
    still lost, once the reading has caught up."""
    h = await start_detector(sqlite_url, node_lost_after_s=1.0, hang_floor_s=1.5, watch_interval_s=0.1)
    await h.place("job-r", [(0, "node-1", 0)])
    step = 0

    async def report() -> None:
        nonlocal step
        step += 1
        status = RankStatus(job_id="job-r", rank=0, step=step, phase="training", heartbeat_age_s=0.0)
        await h.report("node-1", [status])

    await report()
    await h.settled()
    follower = h.runtime.reports
    handle, gate = follower.handler, asyncio.Event()

    async def held(batch: dict[str, bytes]) -> None:
        await gate.wait()
        await handle(batch)

    follower.handler = held
    try:
        for _ in range(15):  # 3 s of reports every 0.2 s: the first is held, the rest wait behind it
            await report()
            await asyncio.sleep(0.2)
        assert follower.lag_s() > 2.0
        await h.runtime.watcher.tick()
        assert await h.open_incidents("job-r") == []
    finally:
        follower.handler = handle
        gate.set()
    await h.settled()
    await h.runtime.watcher.tick()
    assert await h.open_incidents("job-r") == []
    await asyncio.sleep(2.0)  # now node-1 is silent
    await h.runtime.watcher.tick()
    [lost] = await h.open_incidents("job-r")
    assert "node-1 lost" in lost["root_cause"], lost
