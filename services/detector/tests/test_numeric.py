"""Numeric faults: a rank's NaN or loss spike opens one `numeric` incident with the fault's step; repeats that lead
from one node build its reputation, its peers' echoes do not."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from reprise_common.clock import utcnow
from reprise_common.events import NumericKind, RankNumeric

# `Harness` (tests/conftest.py) is passed in as a fixture; conftest is not importable here.
Harness = Any


def _nan(node: str, rank: int, step: int, *, job: str = "job-n", epoch: int = 0, later_ms: int = 0) -> RankNumeric:
    return RankNumeric(
        source=node,
        node_id=node,
        job_id=job,
        rank=rank,
        restart_epoch=epoch,
        metric="loss",
        kind=NumericKind.NAN,
        step=step,
        last_good_step=step - 1,
        time=utcnow() + timedelta(milliseconds=later_ms),
    )


async def test_a_nan_on_every_rank_is_one_numeric_incident_led_by_the_first_with_its_step(detector: Harness) -> None:
    await detector.place("job-n", [(0, "node-1", 0), (1, "node-2", 0)])
    await detector.emit("node-2", _nan("node-2", 1, 57))
    await detector.emit("node-1", _nan("node-1", 0, 58, later_ms=40))  # the NaN spread to its peer a step later
    await detector.emit("node-9", _nan("node-9", 0, 3))  # runs no rank of the job: does not count for it
    await detector.settled()
    [incident] = await detector.open_incidents("job-n")
    assert incident["category"] == "numeric" and incident["recommended_action"] == "restart_job"
    assert (incident["culprit_node_id"], incident["culprit_rank"], incident["culprit_fault_step"]) == ("node-2", 1, 57)
    assert "loss became NaN at step 57 (last fine at step 56)" in incident["root_cause"]
    assert incident["symptom_count"] == 2
    [change] = [c for c in await detector.changes("job-n") if c.change == "opened"]
    assert change.category == "numeric" and change.culprit.fault_step == 57  # what the orchestrator restores before


async def test_a_spike_says_what_it_was_measured_against(detector: Harness) -> None:
    await detector.place("job-s", [(0, "node-1", 0)])
    spike = _nan("node-1", 0, 120, job="job-s").model_copy(
        update={"kind": NumericKind.SPIKE, "value": 9.5, "median": 2.01, "z": 41.3}
    )
    await detector.emit("node-1", spike)
    await detector.settled()
    [incident] = await detector.open_incidents("job-s")
    assert "loss spiked to 9.5 (robust z 41.3 against a recent median of 2.01) at step 120" in incident["root_cause"]


async def test_numeric_faults_leading_from_one_node_three_times_recommend_its_quarantine(detector: Harness) -> None:
    for epoch in range(3):
        await detector.place("job-n", [(0, "node-1", 0), (1, "node-2", 0)], epoch=epoch)
        await detector.emit("node-1", _nan("node-1", 0, 10 + epoch, epoch=epoch))
        await detector.emit("node-2", _nan("node-2", 1, 11 + epoch, epoch=epoch, later_ms=40))  # its echo
        await detector.settled()
        if epoch < 2:
            assert await detector.quarantines() == []
    [recommendation] = await detector.quarantines()
    assert (recommendation.node_id, recommendation.reason) == ("node-1", "repeated_numeric")
    assert recommendation.fault_count == 3
    assert (await detector.client.get("/v1/node-health/node-1")).json()["fault_count"] == 3
    assert (await detector.client.get("/v1/node-health/node-2")).status_code == 404  # its echoes left no record
