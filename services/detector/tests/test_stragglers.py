"""Stragglers on the real detector: each launch's slow rank is a warning of its own.

A job restored from an older checkpoint runs the same steps again, so the same rank can turn slow at the same step in
the next launch; that is a new straggler, not a redelivery of the last launch's.
"""

from __future__ import annotations

from typing import Any

from reprise_common import subjects
from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import JobPlacement, RankAssignment, RankStatus

Harness = Any  # tests/conftest.py
StartDetector = Any
JOB, NODE = "job-s", "node-1"
RANKS = (0, 1, 2)


async def _place(h: Harness, clock: ManualClock, epoch: int) -> None:
    """Place the job's three ranks on the node at the detector's (manual) time, as a recovery's relaunch does."""
    ranks = [RankAssignment(rank=r, node_id=NODE, gpu=r, local_rank=r) for r in RANKS]
    placement = JobPlacement(
        source="orchestrator", time=clock.now(), job_id=JOB, restart_epoch=epoch, world_size=len(RANKS), ranks=ranks
    )
    seq = await h.agents.publish(subjects.placement(JOB), placement)
    assert await h.runtime.placements.wait_for_seq(seq, timeout=10)


async def _reports(h: Harness, clock: ManualClock, *, epoch: int, slow_s: float, count: int) -> None:
    """`count` reports of the three ranks at step 100, rank 2 taking `slow_s` a step against 1 s for the others."""
    for _ in range(count):
        clock.advance(1)
        statuses = [
            RankStatus(
                job_id=JOB,
                rank=r,
                restart_epoch=epoch,
                step=100,
                phase="training",
                heartbeat_age_s=0,
                step_time_last_s=slow_s if r == 2 else 1.0,
            )
            for r in RANKS
        ]
        await h.report(NODE, statuses)
        await h.settled()


async def test_the_same_rank_slow_at_the_same_step_after_a_restart_is_a_new_straggler(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    clock = ManualClock(utcnow())
    h = await start_detector(sqlite_url, clock=clock, watch_interval_s=3600, node_lost_after_s=3600)
    await _place(h, clock, 0)
    # A node's reports are folded 4 s apart (the first fold after a lookup sooner, at a random moment): two slow looks
    # 4 s apart make a straggler of 5 reports, within 9 reports of the first slow one.
    await _reports(h, clock, epoch=0, slow_s=3.0, count=9)
    [first] = await h.open_incidents(JOB)
    assert (first["severity"], first["culprit_rank"]) == ("warning", 2)
    await _reports(h, clock, epoch=0, slow_s=1.0, count=1)  # it caught up: a new slow streak is a new straggler
    clock.advance(10)
    await _place(h, clock, 1)  # restarted from an older checkpoint: step 100 comes again
    await _reports(h, clock, epoch=1, slow_s=3.0, count=9)
    incidents = await h.open_incidents(JOB)
    assert len(incidents) == 2, f"the relaunch's straggler was taken for the last launch's: {incidents}"
    assert incidents[0]["culprit_rank"] == 2 and "straggler" in incidents[0]["root_cause"]
