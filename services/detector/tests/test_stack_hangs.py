"""Hangs of jobs without steps (no SDK), judged on the agents' stack samples (stack_hangs), table-driven with an
injected clock: past the startup grace the startup limit no longer applies; the job is hung when every rank has stood
still for the limit with one in a collective, and the rank outside it is named."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from reprise_common.clock import ManualClock
from reprise_common.events import RankStatus
from reprise_detector.progress.book import ProgressBook
from reprise_detector.progress.hangs import HangWatch
from reprise_detector.progress.limits import HangLimits, LimitReason
from reprise_detector.stack_hangs import SteplessJudge

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
LIMITS = HangLimits(floor_s=10, startup_s=100)
JUDGE = SteplessJudge(limit_s=30, grace_s=20)
ALL_REDUCE = ("all_reduce (distributed_c10d.py:3252)", "all_reduce")
BLOCKED = ("wait_while (train.py:34)", "")
BUSY = ("forward (linear.py:125)", "")


def _status(rank: int, place: tuple[str, str], still_s: float | None, age: float, state: str = "S") -> RankStatus:
    where, waits_in = place
    return RankStatus(
        job_id="job-s", rank=rank, phase_age_s=age, proc_state=state, where=where, waits_in=waits_in, still_s=still_s
    )


def _watch(clock: ManualClock, judge: SteplessJudge | None = JUDGE) -> tuple[ProgressBook, HangWatch]:
    book = ProgressBook(clock)
    return book, HangWatch(clock=clock, book=book, defaults=LIMITS, stepless=judge)


# rank 0, rank 1 (place, seconds still), seconds since launch, hung?, culprit
CASES = [
    ((ALL_REDUCE, 29), (BLOCKED, 40), 200, False, None),  # rank 0 not yet still for the limit
    ((ALL_REDUCE, 31), (BLOCKED, 40), 200, True, 1),  # the rank outside the collective its peer waits in
    ((ALL_REDUCE, 31), (BUSY, 0), 200, False, None),  # rank 1 works (an evaluation): its peer waits for it
    ((BLOCKED, 60), (BLOCKED, 60), 200, False, None),  # both paused outside any collective: the script's own pause
    ((ALL_REDUCE, 60), (ALL_REDUCE, 50), 200, True, 0),  # both in it, no rank outside: the one still first
    ((ALL_REDUCE, 0), (BUSY, 0), 150, False, None),  # past the startup limit, training: no hang
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_job_without_steps_is_hung_when_its_ranks_stand_still_in_a_collective_for_the_limit(
    case: tuple[tuple[tuple[str, str], float], tuple[tuple[str, str], float], float, bool, int | None],
) -> None:
    first, second, since_launch, hung, culprit = case
    clock = ManualClock(T0)
    book, watch = _watch(clock)
    for rank, (place, still) in enumerate((first, second)):
        book.update(f"node-{rank}", _status(rank, place, still, since_launch))
    found = watch.check()
    assert bool(found) is hung, found
    if found:
        [symptom] = found
        assert (symptom.rank, symptom.limit_reason, symptom.node_id) == (culprit, "stepless", f"node-{culprit}")
        assert "stack samples" in symptom.culprit_reason


def test_before_its_grace_and_without_samples_a_job_without_steps_keeps_the_startup_limit() -> None:
    clock = ManualClock(T0)
    book, watch = _watch(clock)
    for rank in range(2):  # in the grace: not timed by its samples, though they say hung
        book.update("node-1", _status(rank, ALL_REDUCE if rank else BLOCKED, 60, 10))
    assert watch.check() == []
    book, watch = _watch(ManualClock(T0))
    for rank in range(2):  # never sampled (no py-spy): the startup limit, as before
        book.update("node-1", RankStatus(job_id="job-s", rank=rank, phase_age_s=101, proc_state="S"))
    [hung] = watch.check()
    assert hung.limit_reason == LimitReason.STARTUP.value


def test_a_stopped_rank_of_a_job_without_steps_is_caught_at_the_training_limit_past_its_grace() -> None:
    clock = ManualClock(T0)
    book, watch = _watch(clock)
    book.update("node-0", _status(0, ALL_REDUCE, 5, 300))
    book.update("node-1", RankStatus(job_id="job-s", rank=1, phase_age_s=300, proc_state="T", proc_state_age_s=11))
    [hung] = watch.check()
    assert (hung.rank, hung.limit_reason) == (1, LimitReason.FLOOR.value)


def test_the_job_is_looked_at_again_as_soon_as_a_rank_stands_still() -> None:
    clock = ManualClock(T0)
    book, watch = _watch(clock)
    for rank in range(2):
        book.update("node-1", _status(rank, BUSY, 0, 200))
    assert watch.check() == []
    assert book.jobs["job-s"].next_check > clock.monotonic()
    book.update("node-1", _status(0, ALL_REDUCE, 1, 201))
    assert book.jobs["job-s"].next_check == 0.0  # due at once: its deadline may be sooner than the last look said
