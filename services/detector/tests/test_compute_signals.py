"""The compute backend's own failure signals as symptoms, on the real detector: ComputeSignals published on NATS as the
orchestrator's Slurm backend publishes them (stream COMPUTE), read through the detector's own durable consumer."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import Session, select

from reprise_common import subjects
from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import ComputeSignal, ComputeSignalKind
from reprise_detector.incidents.models import Symptom
from reprise_detector.runtime import COMPUTE_DURABLE

from .conftest import Harness, StartDetector, wait_until

JOB = "job-c"
BACKEND = "slurm"


def _signal(kind: ComputeSignalKind, *, node: str | None = None, job: str | None = None) -> ComputeSignal:
    return ComputeSignal(
        source="orchestrator", backend=BACKEND, kind=kind, node_id=node, job_id=job, detail=f"Slurm says {kind.value}"
    )


async def _announce(h: Harness, signal: ComputeSignal) -> None:
    """Publish a signal as the orchestrator does and wait until the detector has acknowledged it."""
    await h.agents.publish(subjects.compute_signal(BACKEND), signal)
    durable = h.runtime.durable(COMPUTE_DURABLE)

    async def handled() -> bool:
        info = await h.agents.js.consumer_info(subjects.COMPUTE_STREAM, durable)
        return info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq > 0

    assert await wait_until(handled), "the detector did not handle the compute signal"


@pytest.mark.parametrize(
    ("kind", "for_job"),
    [
        (ComputeSignalKind.NODE_DOWN, False),
        (ComputeSignalKind.NODE_NOT_RESPONDING, False),
        (ComputeSignalKind.NODE_FAIL, True),
    ],
)
async def test_a_node_the_scheduler_failed_opens_a_node_incident_that_excludes_it(
    detector: Harness, kind: ComputeSignalKind, for_job: bool
) -> None:
    await detector.place(JOB, [(0, "node-1", 0), (1, "node-2", 0)])
    await detector.place("job-elsewhere", [(0, "node-3", 0)])
    await _announce(detector, _signal(kind, node="node-2", job=JOB if for_job else None))
    [incident] = await detector.open_incidents(JOB)
    assert (incident["category"], incident["culprit_node_id"]) == ("node", "node-2")
    assert incident["recommended_action"] == "restart_exclude_node"
    assert incident["culprit_rank"] is None and BACKEND in incident["root_cause"]
    assert await detector.open_incidents("job-elsewhere") == []
    # What the orchestrator reads: node category and exclusion (left out of the placement, not cordoned).
    [opened] = await detector.changes(JOB)
    assert (opened.category, opened.recommended_action, opened.culprit.node_id) == (
        "node",
        "restart_exclude_node",
        "node-2",
    )


@pytest.mark.parametrize("kind", [ComputeSignalKind.PREEMPTED, ComputeSignalKind.TIME_LIMIT])
async def test_a_preemption_or_the_time_limit_is_an_incident_but_no_hardware_fault(
    detector: Harness, kind: ComputeSignalKind
) -> None:
    await detector.place(JOB, [(0, "node-1", 0), (1, "node-2", 0)])
    await _announce(detector, _signal(kind, job=JOB))
    [incident] = await detector.open_incidents(JOB)
    assert (incident["category"], incident["recommended_action"]) == ("dependency", "restart_job")
    assert incident["culprit_node_id"] is None  # nothing to leave out or cordon
    assert incident["root_cause"].startswith(f"job {JOB} ")


async def test_signals_about_jobs_and_nodes_outside_a_placement_open_nothing(detector: Harness) -> None:
    await detector.place(JOB, [(0, "node-1", 0), (1, "node-2", 0)])
    await _announce(detector, _signal(ComputeSignalKind.NODE_DOWN, node="node-9"))  # runs no job
    await _announce(detector, _signal(ComputeSignalKind.PREEMPTED, job="job-never-placed"))
    await _announce(detector, _signal(ComputeSignalKind.NODE_FAIL, node="node-9", job=JOB))  # not the job's node
    assert (await detector.incidents(limit=100))["data"] == []
    [kept] = [s for s in _all_symptoms(detector) if s.node_id == "node-9" and s.job_id is None]
    assert kept.kind == "compute.signal" and kept.incident_id is None  # a node-wide symptom, kept on its own


async def test_a_slurm_signal_after_reprise_saw_the_node_lost_joins_that_incident(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    # The detector's clock runs half a minute behind: the signal (dated by the server) comes after its node loss.
    clock = ManualClock(utcnow() - timedelta(seconds=30))
    h = await start_detector(sqlite_url, clock=clock, watch_interval_s=3600, hang_check_interval_s=3600)
    await h.place(JOB, [(0, "node-1", 0), (1, "node-2", 0)])
    for node in ("node-1", "node-2"):
        await h.report(node)
    await h.settled()
    clock.advance(5.5)
    await h.report("node-1")
    await h.settled()
    await h.runtime.watcher.tick()  # node-2's reports stopped: Reprise's own evidence
    [lost] = await h.open_incidents(JOB)
    assert lost["root_cause"].startswith("node node-2 lost: no report for")
    await _announce(h, _signal(ComputeSignalKind.NODE_NOT_RESPONDING, node="node-2"))
    await _announce(h, _signal(ComputeSignalKind.NODE_FAIL, node="node-2", job=JOB))
    [incident] = await h.open_incidents(JOB)
    assert incident["id"] == lost["id"] and incident["symptom_count"] == 3
    assert incident["root_cause"] == lost["root_cause"] and incident["culprit_node_id"] == "node-2"


def _all_symptoms(h: Harness) -> list[Symptom]:
    with Session(h.runtime.engine) as session:
        return list(session.exec(select(Symptom)).all())


async def test_a_silent_controller_is_a_warning_incident_with_nothing_to_restart(detector: Harness) -> None:
    await detector.place(JOB, [(0, "node-1", 0), (1, "node-2", 0)])
    await _announce(detector, _signal(ComputeSignalKind.CONTROLLER_UNAVAILABLE, job=JOB))
    [incident] = await detector.open_incidents(JOB)
    assert (incident["category"], incident["severity"], incident["recommended_action"]) == (
        "dependency",
        "warning",
        "none",  # the job runs on: an operator must know, no recovery would help
    )
    assert incident["culprit_node_id"] is None and "controller_unavailable" in incident["root_cause"]
