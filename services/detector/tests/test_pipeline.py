"""The pipeline end to end: real nats-server, real database, the real app with its consumers."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from reprise_common import subjects
from reprise_common.events import DependencyFailed, GpuXid, JobPlacement, RankExited

# `Harness` and `StartDetector` (tests/conftest.py) are passed in as fixtures; conftest is not importable here.
Harness = Any
StartDetector = Any


async def test_xid_79_opens_one_incident_pointing_at_the_gpu_and_rank(
    start_detector: StartDetector, database_url: str
) -> None:
    h = await start_detector(database_url)
    await h.place("job-a", [(0, "node-1", 0), (1, "node-1", 1), (2, "node-2", 0), (3, "node-2", 1)])
    await h.emit("node-2", GpuXid(source="node-2", node_id="node-2", gpu=1, xid=79))
    await h.settled()

    page = await h.incidents(job_id="job-a")
    assert page["count"] == 1
    incident = page["data"][0]
    assert (incident["culprit_node_id"], incident["culprit_gpu"], incident["culprit_rank"]) == ("node-2", 1, 3)
    assert incident["category"] == "gpu_hardware"
    assert incident["recommended_action"] == "restart_exclude_node"
    assert incident["state"] == "open" and incident["symptom_count"] == 1
    assert incident["opened_at"].endswith(("+00:00", "Z"))

    changes = await h.changes("job-a")
    assert [c.change for c in changes] == ["opened"]
    assert changes[0].incident_id == incident["id"]
    assert changes[0].culprit.node_id == "node-2" and changes[0].culprit.rank == 3


async def test_a_redelivered_event_adds_nothing(start_detector: StartDetector, database_url: str) -> None:
    h = await start_detector(database_url)
    await h.place("job-a", [(0, "node-1", 0)])
    xid = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=48)
    for _ in range(2):  # raw publishes without Nats-Msg-Id: the stream keeps both, as after a redelivery
        await h.agents.js.publish(subjects.node_event("node-1", xid.type), xid.to_bytes())
    await h.settled()

    page = await h.incidents(job_id="job-a")
    assert page["count"] == 1
    assert page["data"][0]["symptom_count"] == 1
    assert len(h.symptoms(xid.event_id)) == 1
    assert [c.change for c in await h.changes("job-a")] == ["opened"]


async def test_a_crash_then_an_xid_is_one_incident_upgraded_to_hardware(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-1", 1)])
    crash = RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=1, exit_code=1, log_tail=["boom"])
    await h.emit("node-1", crash)
    await h.settled()
    first = (await h.incidents(job_id="job-a"))["data"][0]
    assert first["category"] == "application" and first["culprit_rank"] == 1 and first["culprit_gpu"] == 1

    await h.emit(
        "node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79, time=crash.time + timedelta(seconds=5))
    )
    await h.settled()
    page = await h.incidents(job_id="job-a")
    assert page["count"] == 1
    incident = page["data"][0]
    assert incident["id"] == first["id"]
    assert incident["category"] == "gpu_hardware"
    assert (incident["culprit_node_id"], incident["culprit_gpu"], incident["culprit_rank"]) == ("node-1", 0, 0)
    assert "XID 79" in incident["root_cause"]
    assert incident["symptom_count"] == 2
    detail = await h.incident(incident["id"])
    assert [s["kind"] for s in detail["symptoms"]] == ["rank.exited", "gpu.xid"]
    changes = await h.changes("job-a")
    assert [(c.change, c.category, c.symptom_count) for c in changes] == [
        ("opened", "application", 1),
        ("updated", "gpu_hardware", 2),
    ]


async def test_a_follow_on_symptom_joins_but_does_not_re_root(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    xid = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79)
    await h.emit("node-1", xid)
    await h.emit("node-1", RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=0, signal="SIGABRT"))
    await h.settled()
    page = await h.incidents(job_id="job-a")
    assert page["count"] == 1
    assert page["data"][0]["category"] == "gpu_hardware" and page["data"][0]["symptom_count"] == 2


async def test_a_root_cause_outside_the_window_opens_a_new_incident(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    h = await start_detector(sqlite_url, incident_window_s=0.5)
    await h.place("job-a", [(0, "node-1", 0)])
    await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=48))
    await asyncio.sleep(0.8)  # event times are bounded by their arrival: the window passes in real time
    await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79))
    await h.settled()
    assert (await h.incidents(job_id="job-a"))["count"] == 2


async def test_a_follow_on_symptom_without_an_incident_is_kept_as_a_symptom_only(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    channel_reset = GpuXid(source="node-1", node_id="node-1", gpu=0, xid=43)
    unplaced = GpuXid(source="node-9", node_id="node-9", gpu=0, xid=79)
    await h.emit("node-1", channel_reset)
    await h.emit("node-9", unplaced)
    await h.settled()
    assert (await h.incidents())["count"] == 0
    [kept] = h.symptoms(channel_reset.event_id)
    assert kept.incident_id is None and kept.job_id == "job-a" and not kept.root_cause_grade
    [orphan] = h.symptoms(unplaced.event_id)
    assert orphan.job_id is None and orphan.root_cause_grade


async def test_a_gpu_fault_affects_every_job_on_the_node_once(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-1", 1)])
    await h.place("job-b", [(0, "node-1", 2), (1, "node-2", 0)])
    xid = GpuXid(source="node-1", node_id="node-1", gpu=2, xid=74)
    for _ in range(2):
        await h.agents.js.publish(subjects.node_event("node-1", xid.type), xid.to_bytes())
    await h.settled()
    a = (await h.incidents(job_id="job-a"))["data"]
    b = (await h.incidents(job_id="job-b"))["data"]
    assert len(a) == 1 and len(b) == 1
    assert a[0]["culprit_rank"] is None  # job-a has no rank on GPU 2
    assert b[0]["culprit_rank"] == 0 and b[0]["category"] == "interconnect"
    assert len(h.symptoms(xid.event_id)) == 2


async def test_node_identity_comes_from_the_subject(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    await h.place("job-b", [(0, "node-2", 0)])
    spoofed = DependencyFailed(source="node-1", node_id="node-2", dependency="storage", detail="nfs timeout")
    await h.emit("node-1", spoofed)
    await h.settled()
    assert (await h.incidents(job_id="job-b"))["count"] == 0
    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert incident["culprit_node_id"] == "node-1" and incident["category"] == "dependency"


async def test_a_finished_jobs_unreachable_rendezvous_master_opens_nothing(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    await h.place("job-b", [(0, "node-2", 1)])
    done = RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=0, exit_code=0, log_tail=["done"])
    await h.emit("node-1", done)  # rank 0 finished: its rendezvous master is gone while rank 1 still tears down
    unreachable = DependencyFailed(
        source="node-2", node_id="node-2", dependency="rendezvous:job-a", detail="refused", job_id="job-a"
    )
    await h.emit("node-2", unreachable)
    await h.settled()
    assert (await h.incidents(job_id="job-a"))["count"] == 0
    assert (await h.incidents(job_id="job-b"))["count"] == 0  # another job on the same node is not concerned
    assert len(h.symptoms(unreachable.event_id)) == 1  # kept, as evidence for whatever opens next


async def test_an_unreachable_master_after_rank_0_crashed_is_evidence_not_the_root_cause(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    crash = RankExited(source="node-1", node_id="node-1", job_id="job-a", rank=0, exit_code=-9, log_tail=[])
    await h.emit("node-1", crash)
    await h.emit(
        "node-2",
        DependencyFailed(
            source="node-2",
            node_id="node-2",
            dependency="rendezvous:job-a",
            detail="refused",
            job_id="job-a",
            time=crash.time + timedelta(seconds=1),
        ),
    )
    await h.settled()
    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert (incident["culprit_node_id"], incident["culprit_rank"]) == ("node-1", 0)
    assert incident["category"] != "dependency" and incident["symptom_count"] == 2


async def test_a_malformed_event_is_dead_lettered_and_the_detector_keeps_working(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    await h.agents.js.publish(subjects.node_event("node-1", "gpu.xid"), b"{not json")
    await h.agents.js.publish(subjects.node_event("node-1", "gpu.xid"), b'{"type": "gpu.xid", "gpu": -1}')
    await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79))
    await h.settled()
    assert h.runtime.bus.dead_letter_count == 2
    assert (await h.agents.js.stream_info("DEADLETTER")).state.messages == 2
    assert (await h.incidents(job_id="job-a"))["count"] == 1


async def test_placements_are_reloaded_when_the_detector_restarts(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    first = await start_detector(sqlite_url)
    await first.place("job-a", [(0, "node-1", 0)], epoch=0)
    await first.place("job-a", [(0, "node-3", 0)], epoch=1)  # moved after a restart: node-1 is no longer its node
    await first.place("job-b", [(0, "node-1", 0)])
    await first.stop()

    second = await start_detector(sqlite_url)
    assert second.runtime.placements.jobs_on("node-3") == ["job-a"]
    assert second.runtime.placements.jobs_on("node-1") == ["job-b"]
    await second.emit("node-3", GpuXid(source="node-3", node_id="node-3", gpu=0, xid=79))
    await second.settled()
    assert (await second.incidents(job_id="job-a"))["data"][0]["culprit_node_id"] == "node-3"


async def test_an_inactive_placement_removes_the_job(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0)])
    assert h.runtime.placements.jobs_on("node-1") == ["job-a"]
    ended = JobPlacement(source="orchestrator", job_id="job-a", restart_epoch=0, world_size=0, active=False)
    seq = await h.agents.publish(subjects.placement("job-a"), ended)
    assert await h.runtime.placements.wait_for_seq(seq, timeout=10)
    assert h.runtime.placements.jobs_on("node-1") == []


async def test_incident_changes_carry_the_labels_of_the_jobs_placement(detector: Harness) -> None:
    h = detector
    labels = {"team": "ml", "example.com/tier": "gold"}
    await h.place("job-a", [(0, "node-1", 0)], labels=labels)
    await h.place("job-b", [(0, "node-2", 0)])  # a job without labels
    await h.emit("node-1", GpuXid(source="node-1", node_id="node-1", gpu=0, xid=79))
    await h.emit("node-2", GpuXid(source="node-2", node_id="node-2", gpu=0, xid=79))
    await h.settled()
    [opened] = await h.changes("job-a")
    assert (opened.change, opened.labels) == ("opened", labels)
    assert [c.labels for c in await h.changes("job-b")] == [{}]

    # The job ends (an inactive placement, labels and all); resolving its incident by hand still routes by them.
    await h.place("job-a", [], active=False, labels=labels)
    response = await h.client.post(f"/v1/incidents/{opened.incident_id}/resolve")
    assert response.status_code == 200, response.text
    assert [(c.change, c.labels) for c in await h.changes("job-a")] == [("opened", labels), ("resolved", labels)]


async def test_an_incident_names_the_launch_its_culprit_rank_belonged_to(
    start_detector: StartDetector, database_url: str
) -> None:
    h = await start_detector(database_url)
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])
    await h.emit(
        "node-2",
        RankExited(source="node-2", node_id="node-2", job_id="job-a", rank=1, exit_code=1, restart_epoch=3),
    )
    await h.settled()

    [incident] = (await h.incidents(job_id="job-a"))["data"]
    assert (incident["culprit_rank"], incident["culprit_restart_epoch"]) == (1, 3)
    [change] = await h.changes("job-a")
    assert (change.culprit.rank, change.culprit.restart_epoch) == (1, 3)  # what the orchestrator reads
