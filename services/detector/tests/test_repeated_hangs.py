"""A job recovered from hangs several times in quick succession: each launch's freeze is a hang of its own.

`make bench-hang-limits` found the miss: a job restarted from the same checkpoint runs the same steps again, so its
next freeze can fall on the same step in the same phase (its evaluation at step 700, say) as the freeze before. Each
launch's hang must still open an incident of its own.
"""

from __future__ import annotations

from typing import Any

from reprise_common import subjects
from reprise_common.clock import ManualClock, utcnow
from reprise_common.events import JobPlacement, RankAssignment, RankStatus

Harness = Any  # tests/conftest.py
StartDetector = Any
JOB, NODE = "job-r", "node-1"


def _rank(rank: int, epoch: int, step: int | None, phase: str, *, ages: float = 0, **fields: Any) -> RankStatus:
    """A rank's status; `ages`: seconds since its step's heartbeat and since its phase began (as the agent says)."""
    return RankStatus(
        job_id=JOB, rank=rank, restart_epoch=epoch, step=step, phase=phase, heartbeat_age_s=ages, phase_age_s=ages,
        **fields,
    )  # fmt: skip


async def _report(h: Harness, *ranks: RankStatus) -> None:
    await h.report(NODE, list(ranks))
    await h.settled()
    await h.runtime.watcher.tick()


async def _place(h: Harness, clock: ManualClock, epoch: int) -> None:
    """Place the job's two ranks on the node, at the detector's (manual) time, as a recovery's relaunch does."""
    ranks = [RankAssignment(rank=r, node_id=NODE, gpu=r, local_rank=r) for r in (0, 1)]
    placement = JobPlacement(
        source="orchestrator", time=clock.now(), job_id=JOB, restart_epoch=epoch, world_size=2, ranks=ranks
    )
    seq = await h.agents.publish(subjects.placement(JOB), placement)
    assert await h.runtime.placements.wait_for_seq(seq, timeout=10)


async def _launch_and_freeze(h: Harness, clock: ManualClock, epoch: int) -> None:
    """Epoch `epoch` is placed (the previous launch's ranks still listed, dead, for a report), restores from step
    600, trains to step 700 and evaluates there; rank 1 is frozen in the evaluation, and 16 s pass."""
    await _place(h, clock, epoch)
    if epoch > 0:  # the stopped ranks of the launch before (SIGTERM; the frozen one SIGKILL), reported late
        stopped = [_rank(r, epoch - 1, None, "startup", alive=False, exit_code=code) for r, code in ((0, -15), (1, -9))]
        await _report(h, *stopped)
    await _report(h, _rank(0, epoch, None, "startup"), _rank(1, epoch, None, "startup"))
    clock.advance(1)
    await _report(h, _rank(0, epoch, 600, "restoring"), _rank(1, epoch, 600, "restoring"))
    for step in (650, 700):
        clock.advance(1)
        await _report(h, _rank(0, epoch, step, "training"), _rank(1, epoch, step, "training"))
    # Step 700 ends in an evaluation (its heartbeat says so), and a second later rank 1 is frozen in it. Each report
    # carries the ages the agent's does: the detector folds a node's reports a few seconds apart, and reads from them
    # when the step, the phase and the stop began.
    for stopped_s in (None, 0, 4, 8, 12, 16):  # how long the agent's samples have shown rank 1 stopped
        clock.advance(4 if stopped_s else 1)
        ages = 1 + (stopped_s if stopped_s is not None else -1)
        others = _rank(0, epoch, 700, "eval", ages=ages, proc_state="S")
        if stopped_s is None:
            await _report(h, others, _rank(1, epoch, 700, "eval", ages=ages, proc_state="S"))
        else:
            frozen = _rank(1, epoch, 700, "eval", ages=ages, proc_state="T", proc_state_age_s=stopped_s)
            await _report(h, others, frozen)


async def test_each_launch_freezing_at_the_same_step_and_phase_opens_a_hang_of_its_own(
    start_detector: StartDetector, sqlite_url: str
) -> None:
    clock = ManualClock(utcnow())
    h = await start_detector(
        sqlite_url, clock=clock, hang_check_interval_s=0.001, watch_interval_s=3600, node_lost_after_s=3600
    )
    for epoch in range(3):  # the first launch, then two quick recoveries
        await _launch_and_freeze(h, clock, epoch)
        incidents = await h.open_incidents(JOB)
        assert len(incidents) == epoch + 1, f"launch {epoch}: {len(incidents)} incidents for {epoch + 1} freezes"
        newest = incidents[0]
        assert newest["category"] == "hang" and newest["culprit_rank"] == 1
        assert "stopped (state T)" in newest["root_cause"]
