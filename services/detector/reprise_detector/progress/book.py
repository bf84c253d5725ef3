"""The progress book: each job's ranks' tracks, fed by the rank statuses of node reports (fold).

Times are the detector's injected clock. A rank's progress "stopped" when its step last advanced; the agent's
heartbeat age back-dates the first sight of a step, so a detector that starts late does not think a stalled rank
has just moved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from reprise_common.clock import Clock
from reprise_common.events import RankStatus
from reprise_common.report_view import STOPPED_STATES, RankSeen
from reprise_detector.progress.limits import HangLimits

RankProgress = RankSeen | RankStatus  # a rank's status as a report read on the hot path, or as the schema builds it


class RankTrack(msgspec.Struct, gc=False):
    """What the detector knows of one rank's progress: the values of its latest status it reads, and what they alone
    do not say.

    Values, not the status they came from: a fold compares a new status with the rank's own track (one object), and
    the status is freed with its report, while it is still in the processor's cache. Plain values only, so that the
    garbage collector never scans the hundreds of thousands of them a large fleet keeps (a full collection would pause
    the event loop for each).
    """

    job_id: str
    rank: int
    node_id: str
    step: int | None  # the latest step reported
    restart_epoch: int | None  # the launch of the rank that reported it
    phase: str  # the latest phase reported
    alive: bool  # whether the process was alive at the latest report
    proc_state: str  # the process's scheduler state in the latest report ("" unknown)
    cpu_s: float | None  # its CPU seconds in the latest report
    advanced_at: float  # monotonic time the step last changed (or the phase began, before any step)
    phase_since: float
    cpu_at_advance: float | None  # its CPU seconds when the step last changed
    p99_s: float | None  # the latest step-time p99 reported (a status without one keeps it)
    step_time_s: float | None  # the latest step time reported (last, else p50)
    slow_streak: int = 0
    straggling: bool = False
    stopped_since: float | None = None  # monotonic time its process was first seen stopped (state T/t), in a row
    where: str = ""  # a rank without steps: its main thread's frame at its agent's last stack sample (stack_hangs)
    waits_in: str = ""  # ... the torch.distributed call it is in there
    still_since: float | None = None  # ... monotonic time its samples first showed it idle at that stack, in a row


@dataclass(slots=True)
class JobTrack:
    """Every rank of one job, and whether a hang is already reported for the current stall."""

    ranks: dict[int, RankTrack] = field(default_factory=dict)
    hung: bool = False
    updates: int = 0  # rank statuses folded in so far
    median_s: float | None = None  # the job's median step time, refreshed about once per round of reports
    median_updates: int = -1
    timed: int = 0  # ranks that have reported a step time (while the median is unknown, it is recomputed as this grows)
    median_timed: int = 0
    # Monotonic time before which no rank can pass its limit, as of the last close look (0: look at the next pass;
    # inf before the first look, which joined_since brings).
    next_check: float = math.inf
    deadline: float = math.inf  # monotonic time its first rank passes its limit, as of the last close look
    limits: HangLimits | None = None  # the limits next_check was computed with
    # The earliest stall start of the ranks that joined since the last close look (limit_for's `since` is never
    # earlier): none of them can pass a limit before it plus the least limit, and no close look is due for them before.
    # A fresh detector meets a job's nodes over seconds, and looking at the job as each rank joined meant a close look
    # at every job at every pass while the detector was busiest.
    joined_since: float = math.inf
    waiting: set[str] = field(default_factory=set)  # nodes whose latest report may wait unfolded (NodeRanks.unread)


class NodeRanks(msgspec.Struct, gc=False):
    """One node's ranks of one job: their tracks in the order its reports list them, and its latest report's ranks
    while they wait to be folded into them (see node_reports.FOLD_EVERY_S).

    A node lists the same ranks in the same order report after report, so a report is folded into these tracks (each
    checked against its status's job and rank) without a placement and a book lookup per rank. Not scanned by the
    garbage collector (one per node; the job's `waiting` names nodes, not these, so it is in no cycle).
    """

    job: JobTrack
    tracks: tuple[RankTrack, ...]
    version: int  # the placement map's version the tracks were looked up at (another: look them up again)
    fold_at: float  # monotonic time from which the node's next report is folded as it arrives
    unread: msgspec.Raw | None = None  # the ranks (JSON) of the latest report, not yet folded
    unread_at: float = 0.0  # monotonic time that report arrived
    unread_reports: int = 0  # reports since the last fold (the unread one included)


class ProgressBook:
    """job -> rank -> progress, fed by the rank statuses of node reports."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.jobs: dict[str, JobTrack] = {}

    def update(self, node_id: str, status: RankProgress, now: float | None = None) -> tuple[JobTrack, RankTrack]:
        """Fold one rank status into the book (`now`: the monotonic time it arrived, the clock's by default); a step
        change or a new restart epoch resets the stall (and a reported hang)."""
        if now is None:
            now = self.clock.monotonic()
        job = self.jobs.get(status.job_id)
        if job is None:
            job = self.jobs[status.job_id] = JobTrack()
        track = job.ranks.get(status.rank)
        if track is None:
            track = job.ranks[status.rank] = _first_track(node_id, status, now)
            job.updates += 1
            job.timed += track.step_time_s is not None
            job.joined_since = min(job.joined_since, track.advanced_at, track.phase_since)  # see JobTrack
            return job, track
        if track.node_id is not node_id:  # the same string object, report after report (msgspec sets cost 60 ns)
            track.node_id = node_id
        fold(job, (track,), (status,), now)
        return job, track

    def forget(self, job_id: str) -> None:
        """Drop a job that no longer runs here."""
        self.jobs.pop(job_id, None)


def fold(
    job: JobTrack,
    tracks: Sequence[RankTrack],
    statuses: Sequence[RankProgress],
    now: float,
    slow_above: float = math.inf,
) -> tuple[int, list[RankTrack]]:
    """Fold ranks' new statuses into their tracks, pairwise in order, while each status is of its track's rank (`now`:
    the monotonic time they arrived); a step change or a new restart epoch resets the stall (and a reported hang).
    Returns how many were folded (counted in JobTrack.updates), and those of them a straggler judgement may change: a
    slow streak, or a step time above `slow_above`.

    Updated in place (a report of 8 ranks a second per node must not churn objects); straggler state carries over
    from report to report, not to a new restart epoch. This runs for every rank of every report, a node's ranks in one
    loop: what rarely changes (epoch, phase, process state) is compared before anything is written for it.
    """
    folded = 0
    to_judge: list[RankTrack] = []
    for track, status in zip(tracks, statuses, strict=True):
        if status.rank != track.rank or status.job_id != track.job_id:
            break
        step, was_step, epoch = status.step, track.step, status.restart_epoch
        # A new step is progress, and so is a new launch of the rank: its step counts again from where it restored, and
        # the same number as the replaced process's last step is no stall. It resets the stall, phase clock, CPU count.
        if step != was_step or epoch != track.restart_epoch:
            if epoch != track.restart_epoch:  # a new process (maybe elsewhere): the old one's slowness is not its own
                _relaunched(track, epoch)
            track.step = step
            track.advanced_at, track.phase_since = _dated(status, now)
            track.cpu_at_advance = status.cpu_s
            if job.hung:
                job.hung = False
        elif track.cpu_at_advance is None:
            track.cpu_at_advance = status.cpu_s
        track.cpu_s = status.cpu_s
        if status.phase != track.phase or status.alive is not track.alive or status.proc_state or track.proc_state:
            _fold_state(job, track, status, now, same_step=step == was_step)
        p99 = status.step_time_p99_s
        if p99 and p99 != track.p99_s:
            track.p99_s = p99
        step_time = status.step_time_last_s or status.step_time_p50_s
        if step_time and step_time != track.step_time_s:
            if track.step_time_s is None:
                job.timed += 1
            track.step_time_s = step_time
        if track.slow_streak or (track.step_time_s or 0.0) > slow_above:
            to_judge.append(track)
        folded += 1
    job.updates += folded
    return folded, to_judge


def _relaunched(track: RankTrack, epoch: int | None) -> None:
    """fold() for a new launch of a rank: what was known of the replaced process (its speed, its stack) is dropped."""
    track.slow_streak, track.straggling, track.restart_epoch = 0, False, epoch
    track.where, track.waits_in, track.still_since = "", "", None


def _fold_state(job: JobTrack, track: RankTrack, status: RankProgress, now: float, *, same_step: bool) -> None:
    """fold() for what changes rarely: the phase, whether the process is alive, its scheduler state (on the common
    path: the same phase, alive, state "" for unknown or running)."""
    if status.phase != track.phase:
        if same_step:
            track.phase_since = now - (status.phase_age_s or 0.0)
        track.phase = status.phase
        job.next_check = 0.0  # another phase, another limit: what was computed for the old one no longer holds
    if status.alive is not track.alive:
        track.alive = status.alive
    if status.proc_state or track.proc_state:
        _fold_proc_state(job, track, status, track.proc_state, now)
        track.proc_state = status.proc_state
    if status.still_s is not None or track.still_since is not None:  # sampled with its process state (stack_sampler)
        _fold_where(job, track, status, now)


def _fold_where(job: JobTrack, track: RankTrack, status: RankProgress, now: float) -> None:
    """Note where a rank without steps stands and since when it stands still there (stack_hangs); a status without a
    sample keeps the place known, not the stillness."""
    if status.where:
        track.where, track.waits_in = status.where, status.waits_in
    since = now - status.still_s if status.still_s else None
    if since is not None and track.still_since is None:
        job.next_check = 0.0  # it may pass its limit sooner than the job's last look said
    track.still_since = since


def _first_track(node_id: str, status: RankProgress, now: float) -> RankTrack:
    """A rank's track from its first status; the heartbeat age back-dates its step, the phase age its phase."""
    advanced, phase_since = _dated(status, now)
    return RankTrack(
        job_id=status.job_id,
        rank=status.rank,
        node_id=node_id,
        step=status.step,
        restart_epoch=status.restart_epoch,
        phase=status.phase,
        alive=status.alive,
        proc_state=status.proc_state,
        cpu_s=status.cpu_s,
        advanced_at=advanced,
        phase_since=phase_since,
        cpu_at_advance=status.cpu_s,
        p99_s=status.step_time_p99_s,
        step_time_s=status.step_time_last_s or status.step_time_p50_s,
        stopped_since=_state_since(status, now) if status.proc_state in STOPPED_STATES else None,
        where=status.where,
        waits_in=status.waits_in,
        still_since=now - status.still_s if status.still_s else None,
    )


def _dated(status: RankProgress, now: float) -> tuple[float, float]:
    """(advanced_at, phase_since) of a status that shows a new step (`now`: when it arrived): its heartbeat's age dates
    the step, its phase's age the phase. A status that does not say its phase's age had its phase since its heartbeat
    at least: dated at its arrival, the stall of a status folded seconds later would count from the fold."""
    beat = now - (status.heartbeat_age_s or 0.0)
    phase_since = now - status.phase_age_s if status.phase_age_s is not None else beat
    return (beat if status.step is not None else phase_since), phase_since


def _fold_proc_state(job: JobTrack, track: RankTrack, status: RankProgress, was: str, now: float) -> None:
    """Note since when a rank's process is stopped (state T/t), in a row; a stopped process is timed as training,
    whatever its phase."""
    if status.proc_state not in STOPPED_STATES:
        track.stopped_since = None
    elif track.stopped_since is None or was not in STOPPED_STATES:
        track.stopped_since = _state_since(status, now)
        job.next_check = 0.0


def _state_since(status: RankProgress, now: float) -> float:
    """When the agent first saw the process in its state: the state's age back-dates it (a status read some time after
    it arrived, or an agent that does not say: when it arrived)."""
    return now - (status.proc_state_age_s or 0.0)
