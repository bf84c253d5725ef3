"""A rank that exits 0 while the rest of its job trains on is a fault; a job whose ranks all exit 0 has finished."""

from __future__ import annotations

from typing import Any

from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import RankExited

# `Harness` and `StartDetector` (tests/conftest.py) are passed in as fixtures; conftest is not importable here.
Harness = Any
StartDetector = Any
GRACE_S = 10.0


def _clean_exit(node_id: str, job_id: str, rank: int, epoch: int = 0) -> RankExited:
    return RankExited(
        source=node_id, node_id=node_id, job_id=job_id, rank=rank, exit_code=0, log_tail=["done"], restart_epoch=epoch
    )


async def test_one_rank_exiting_cleanly_while_its_job_runs_on_opens_an_incident(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    clock = ManualClock(utcnow())
    h = await start_detector(sqlite_url, clock=clock, early_exit_grace_s=GRACE_S, watch_interval_s=3600)
    await h.place("job-a", [(0, "node-1", 0), (1, "node-2", 0)])  # rank 0 leaves, rank 1 trains on
    await h.place("job-b", [(0, "node-1", 1), (1, "node-2", 1)])  # finishes: both ranks exit 0
    await h.place("job-c", [(0, "node-1", 2), (1, "node-2", 2)])  # rank 0 leaves, then a recovery relaunches it
    for exited in (_clean_exit("node-1", "job-a", 0), _clean_exit("node-1", "job-b", 0)):
        await h.emit("node-1", exited)
    await h.emit("node-2", _clean_exit("node-2", "job-b", 1))
    await h.emit("node-1", _clean_exit("node-1", "job-c", 0))
    await h.settled()
    await h.place("job-c", [(0, "node-1", 2), (1, "node-2", 2)], epoch=1)

    clock.advance(GRACE_S - 1)
    await h.runtime.watcher.tick()
    await h.settled()
    assert (await h.incidents())["count"] == 0  # still within the grace

    clock.advance(2)
    await h.runtime.watcher.tick()
    await h.settled()
    [incident] = (await h.incidents())["data"]
    assert incident["job_id"] == "job-a" and incident["category"] == "early_exit"
    culprit = (incident["culprit_node_id"], incident["culprit_rank"], incident["culprit_restart_epoch"])
    assert culprit == ("node-1", 0, 0)
    assert incident["recommended_action"] == "restart_job"
    assert [c.change for c in await h.changes("job-a")] == ["opened"]

    clock.advance(GRACE_S)  # reported once
    await h.runtime.watcher.tick()
    await h.settled()
    assert (await h.incidents())["count"] == 1
