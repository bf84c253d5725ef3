"""The in-memory placement map: epochs, inactive placements, and rank/GPU lookups."""

from __future__ import annotations

from reprise_common.events import JobPlacement, RankAssignment
from reprise_detector.placements import PlacedRank, PlacementMap


def _placement(
    job_id: str,
    ranks: list[tuple[int, str, int | None]],
    *,
    epoch: int = 0,
    active: bool = True,
    labels: dict[str, str] | None = None,
) -> JobPlacement:
    assignments = [RankAssignment(rank=r, node_id=n, gpu=g, local_rank=0) for r, n, g in ranks]
    return JobPlacement(
        source="orchestrator",
        job_id=job_id,
        restart_epoch=epoch,
        world_size=len(ranks),
        ranks=assignments,
        active=active,
        labels=labels or {},
    )


def test_lookups() -> None:
    placements = PlacementMap()
    placements.apply(_placement("job-a", [(0, "node-1", 0), (1, "node-1", 1), (2, "node-2", 0)]))
    placements.apply(_placement("job-b", [(0, "node-1", 2)]))
    assert placements.jobs_on("node-1") == ["job-a", "job-b"]
    assert placements.rank_on_gpu(job_id="job-a", node_id="node-1", gpu=1) == 1
    assert placements.rank_on_gpu(job_id="job-a", node_id="node-1", gpu=2) is None
    assert placements.rank_on_gpu(job_id="job-a", node_id="node-1", gpu=None) is None
    assert placements.gpu_of(job_id="job-a", node_id="node-2", rank=2) == 0
    assert placements.gpu_of(job_id="job-a", node_id="node-2", rank=0) is None


def test_a_newer_epoch_replaces_and_an_older_one_is_ignored() -> None:
    placements = PlacementMap()
    assert placements.apply(_placement("job-a", [(0, "node-1", 0)], epoch=1))
    assert placements.apply(_placement("job-a", [(0, "node-2", 0)], epoch=2))
    assert not placements.apply(_placement("job-a", [(0, "node-1", 0)], epoch=1))
    assert placements.jobs_on("node-1") == []
    assert placements.jobs_on("node-2") == ["job-a"]


def test_an_inactive_placement_removes_only_that_job() -> None:
    placements = PlacementMap()
    placements.apply(_placement("job-a", [(0, "node-1", 0)]))
    placements.apply(_placement("job-b", [(0, "node-1", 1)]))
    placements.apply(_placement("job-a", [], active=False))
    assert placements.on_node("node-1") == [PlacedRank(job_id="job-b", rank=0, gpu=1)]


def test_two_ranks_on_one_gpu_name_no_single_culprit() -> None:
    placements = PlacementMap()
    placements.apply(_placement("job-a", [(0, "node-1", 0), (1, "node-1", 0)]))
    assert placements.rank_on_gpu(job_id="job-a", node_id="node-1", gpu=0) is None


def test_labels_follow_the_latest_placement_and_outlive_the_job() -> None:
    placements = PlacementMap()
    assert placements.labels_of("job-a") == {}  # never placed
    placements.apply(_placement("job-a", [(0, "node-1", 0)], epoch=1, labels={"team": "ml"}))
    placements.apply(_placement("job-b", [(0, "node-2", 0)], labels={"team": "web"}))
    assert placements.labels_of("job-a") == {"team": "ml"}
    assert not placements.apply(_placement("job-a", [(0, "node-1", 0)], epoch=0, labels={"team": "old"}))
    assert placements.labels_of("job-a") == {"team": "ml"}  # a stale placement changes nothing
    placements.apply(_placement("job-a", [], epoch=1, active=False, labels={"team": "ml", "env": "prod"}))
    assert placements.labels_of("job-a") == {"team": "ml", "env": "prod"}  # kept once the job runs nowhere
    assert placements.jobs_on("node-1") == []
    assert placements.labels_of("job-b") == {"team": "web"}
