"""Only the nodes of a job's placement speak for the job: what others say about it is dropped, counted and logged."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY

from reprise_common.events import DependencyFailed, RankExited

# `Harness` and `StartDetector` (tests/conftest.py) are passed in as fixtures; conftest is not importable here.
Harness = Any
StartDetector = Any


def _dropped(reason: str) -> float:
    return REGISTRY.get_sample_value("reprise_detector_events_dropped_total", {"reason": reason}) or 0.0


def _crash(node_id: str, job_id: str, rank: int) -> RankExited:
    return RankExited(source=node_id, node_id=node_id, job_id=job_id, rank=rank, exit_code=1, log_tail=["boom"])


async def test_a_node_outside_a_jobs_placement_cannot_get_it_an_incident(detector: Harness) -> None:
    h = detector
    await h.place("job-a", [(0, "node-1", 0), (1, "node-1", 1)])
    before = {r: _dropped(r) for r in ("job_not_placed", "rank_not_on_node", "job_not_on_node")}
    await h.emit("node-2", _crash("node-2", "job-a", 0))  # rank 0 runs on node-1
    await h.emit("node-1", _crash("node-1", "job-a", 7))  # job-a has no rank 7
    await h.emit(
        "node-2",
        DependencyFailed(
            source="node-2", node_id="node-2", dependency="rendezvous:job-a", detail="refused", job_id="job-a"
        ),
    )
    await h.emit("node-1", _crash("node-1", "job-never-placed", 0))
    await h.settled()

    assert (await h.incidents())["count"] == 0
    assert _dropped("rank_not_on_node") - before["rank_not_on_node"] == 2
    assert _dropped("job_not_on_node") - before["job_not_on_node"] == 1
    assert _dropped("job_not_placed") - before["job_not_placed"] == 1

    await h.emit("node-1", _crash("node-1", "job-a", 1))  # the job's own node still opens one
    await h.settled()
    [incident] = (await h.incidents())["data"]
    assert (incident["job_id"], incident["culprit_node_id"], incident["culprit_rank"]) == ("job-a", "node-1", 1)
