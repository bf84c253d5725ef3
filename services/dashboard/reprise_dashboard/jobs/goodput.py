"""Goodput so far: the share of a job's wall time that was not lost to recoveries.

goodput = (wall time - recovery downtime) / wall time, where
- wall time runs from the job's submission to now, or to its end once it failed or was cancelled;
- a recovery's downtime runs from its fault's first symptom (the start of its `detected` step) until training was
  progressing again (the end of its last step); a recovery still under way counts until now, and one that failed or
  holds the job for a human counts until the job's end (nothing trains after it);
- overlapping downtimes count once, and only inside the wall time.
Work recomputed from the restored checkpoint is not subtracted, so this is an upper bound of the job's ETTR.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from reprise_dashboard.jobs.models import JobRecord, RecoveryRecord

DEFINITION = (
    "Goodput so far = (wall time - recovery downtime) ÷ wall time. Wall time runs from submission to now (to the "
    "job's end once it failed or was cancelled). A recovery's downtime runs from its fault's first symptom until "
    "training progressed again; one still under way counts until now, one that failed or holds the job counts until "
    "the job's end. Work recomputed since the restored checkpoint is not subtracted: this is an upper bound of ETTR."
)


@dataclass(frozen=True)
class Goodput:
    """A job's goodput so far and the times it comes from."""

    wall_s: float
    downtime_s: float

    @property
    def ratio(self) -> float | None:
        """Goodput as a fraction of wall time; None before any wall time passed."""
        if self.wall_s <= 0:
            return None
        return max(0.0, min(1.0, (self.wall_s - self.downtime_s) / self.wall_s))


def job_end(job: JobRecord, *, now: datetime) -> datetime:
    """Where the job's wall time stops: its last update once it ended, else now."""
    return job.updated_at if job.ended else now


def downtime_interval(recovery: RecoveryRecord, *, until: datetime) -> tuple[datetime, datetime]:
    """The span a recovery kept the job from training; `until` is now, or the job's end."""
    start = min([recovery.started_at, *(s.started_at for s in recovery.steps)])
    if not recovery.recovered:
        return start, until
    ends = [s.ended_at or s.started_at for s in recovery.steps]
    if recovery.finished_at is not None:
        ends.append(recovery.finished_at)
    return start, min(max(ends, default=start), until)


def merged_seconds(intervals: Sequence[tuple[datetime, datetime]], *, lo: datetime, hi: datetime) -> float:
    """Seconds covered by the union of the intervals, clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total = 0.0
    current: tuple[datetime, datetime] | None = None
    for start, end in clipped:
        if current is not None and start <= current[1]:
            current = (current[0], max(current[1], end))
            continue
        if current is not None:
            total += (current[1] - current[0]).total_seconds()
        current = (start, end)
    if current is not None:
        total += (current[1] - current[0]).total_seconds()
    return total


def goodput(job: JobRecord, recoveries: Sequence[RecoveryRecord], *, now: datetime) -> Goodput:
    """The job's goodput so far from its recoveries (see the module's definition)."""
    end = job_end(job, now=now)
    wall = max(0.0, (end - job.created_at).total_seconds())
    intervals = [downtime_interval(r, until=end) for r in recoveries]
    return Goodput(wall_s=wall, downtime_s=merged_seconds(intervals, lo=job.created_at, hi=end))
