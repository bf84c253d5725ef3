"""The in-memory placement map: epochs, inactive placements, and rank/GPU lookups."""

from __future__ import annotations

from reprise_common.events import JobPlacement, RankAssignment
from reprise_detector.placements import PlacedRank, PlacementMap


def _placement(
    job_id: str, ranks: list[tuple[int, str, int | None]], *, epoch: int = 0, active: bool = True
) -> JobPlacement:
    assignments = [RankAssignment(rank=r, node_id=n, gpu=g, local_rank=0) for r, n, g in ranks]
    return JobPlacement(
        source="orchestrator",
        job_id=job_id,
        restart_epoch=epoch,
        world_size=len(ranks),
        ranks=assignments,
        active=active,
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
