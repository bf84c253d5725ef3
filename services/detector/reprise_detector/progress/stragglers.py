"""The straggler judgement: StragglerWatch compares each rank's step time with its job's median, and warns of a rank
slow for enough reports in a row (once, until it speeds up)."""

from __future__ import annotations

import statistics
from enum import StrEnum

from reprise_common.clock import Clock
from reprise_detector.kinds.rank_straggling import RankStraggling
from reprise_detector.progress.book import JobTrack, ProgressBook, RankTrack


class StragglerVerdict(StrEnum):
    """What one report says about a rank's speed."""

    UNKNOWN = "unknown"  # no step time, or too few ranks to compare
    NORMAL = "normal"
    SLOW = "slow"  # above the factor, not yet for enough reports in a row
    STRAGGLER = "straggler"  # just crossed the count: report it (once, until it speeds up)


def _median_due(job: JobTrack) -> bool:
    """Whether the job's median step time is to be recomputed: a round of statuses was folded since, or it is unknown
    and more ranks have a step time now."""
    return job.updates - job.median_updates >= len(job.ranks) or (
        job.median_s is None and job.timed != job.median_timed
    )


# Bound once: looking a member up on its enum class costs about 0.2 µs, and judge() runs for every rank of every report.
_UNKNOWN, _NORMAL = StragglerVerdict.UNKNOWN, StragglerVerdict.NORMAL
_SLOW, _STRAGGLER = StragglerVerdict.SLOW, StragglerVerdict.STRAGGLER


class StragglerWatch:
    """Stage: after each report, compare each of its ranks with the job median; N slow reports in a row → warning."""

    def __init__(self, *, clock: Clock, book: ProgressBook, factor: float, reports: int) -> None:
        self.clock = clock
        self.book = book
        self.factor = factor
        self.reports = reports

    def slow_above(self, job: JobTrack) -> float | None:
        """The step time above which a rank of the job is slow (factor x the job's median, refreshed when due); None
        while the median is unknown. A rank at or below it, with no slow streak, is NORMAL: judge() changes nothing."""
        median = self.median(job) if _median_due(job) else job.median_s
        return None if median is None else self.factor * median

    def judge(self, job: JobTrack, track: RankTrack, reports: int = 1) -> StragglerVerdict:
        """Update the rank's streak from its latest step time and say what it is; `reports`: how many of its node's
        reports this look stands for (those since the rank was last looked at, the latest included).

        A rank is looked at when its latest status is folded, which may be a few reports after the last look. A slow
        look extends a streak by every report since the last look (the rank was slow at both ends of them); the first
        slow look counts as one report, since those before it may have been fast.
        """
        limit = self.slow_above(job)
        step_time = track.step_time_s
        if step_time is None or limit is None:
            return _UNKNOWN
        if step_time <= limit:
            if track.slow_streak:
                track.slow_streak, track.straggling = 0, False
            return _NORMAL
        track.slow_streak += reports if track.slow_streak else 1
        if track.slow_streak >= self.reports and not track.straggling:
            track.straggling = True
            return _STRAGGLER
        return _SLOW

    @staticmethod
    def median(job: JobTrack) -> float | None:
        """The job's median step time (None with fewer than 3 ranks to compare), recomputed once per round; while it is
        unknown, also when another rank reported a step time (a node's statuses are folded seconds apart: its next
        fold must not wait a round of folds for the median)."""
        if _median_due(job):
            times = [t.step_time_s for t in job.ranks.values() if t.step_time_s]
            job.median_s = statistics.median(times) if len(times) >= 3 else None
            job.median_updates, job.median_timed = job.updates, job.timed
        return job.median_s

    def finding(self, job_id: str, rank: int) -> RankStraggling:
        """The warning symptom for a rank judged a straggler."""
        job = self.book.jobs[job_id]
        track = job.ranks[rank]
        median = job.median_s or 0.0
        # The launch is part of the id, as for hangs: a relaunch restored from an older checkpoint can turn slow at
        # the same step again, and without its epoch that straggler would be taken for a redelivery of the last one.
        epoch = track.restart_epoch
        return RankStraggling(
            event_id=f"straggler:{job_id}:{epoch}:{rank}:{track.step}"[:128],
            time=self.clock.now(),
            node_id=track.node_id,
            job_id=job_id,
            rank=rank,
            step_time_s=track.step_time_s or 0.0,
            median_s=median,
            reports=track.slow_streak,
        )
