"""Rank progress from node reports, and the two stages that read it: hang detection and stragglers.

Times are the detector's injected clock. A rank's progress "stopped" when its step last advanced; the agent's
heartbeat age back-dates the first sight of a step, so a detector that starts late does not think a stalled rank
has just moved.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Protocol

import msgspec

from reprise_common.clock import Clock
from reprise_common.events import RankStatus
from reprise_common.report_view import STOPPED_STATES, RankSeen
from reprise_detector.derived import JobHung, RankStraggling

STARTUP, CHECKPOINTING = "startup", "checkpointing"
# The SDK's phase names (reprise_sdk.phase) that have limits of their own; any other phase is timed as training.
EVALUATING = frozenset({"eval", "evaluation", "evaluating", "validation"})
LOADING_DATA = frozenset({"data_loading", "loading_data", "dataloading"})
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
    while they wait to be folded into them (see the watch's FOLD_EVERY_S).

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
    from report to report, not to a new restart epoch.
    This runs for every rank of every report, a node's ranks in one loop: what rarely changes (epoch, phase, process
    state) is compared before anything is written for it.
    """
    folded = 0
    to_judge: list[RankTrack] = []
    for track, status in zip(tracks, statuses, strict=True):
        if status.rank != track.rank or status.job_id != track.job_id:
            break
        step, was_step, epoch = status.step, track.step, status.restart_epoch
        # A new step is progress, and so is a new launch of the rank: its step counts again from where it restored, and
        # the same number as the replaced process's last step is no stall. It resets the stall, the phase clock and the
        # CPU count of the stall.
        if step != was_step or epoch != track.restart_epoch:
            if epoch != track.restart_epoch:  # a new process (maybe elsewhere): the old one's slowness is not its own
                track.slow_streak, track.straggling, track.restart_epoch = 0, False, epoch
                track.where, track.waits_in, track.still_since = "", "", None
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


# --- hangs ------------------------------------------------------------------------------------------------------
class LimitReason(StrEnum):
    """Which limit applies to a rank's stall."""

    STARTUP = "startup"  # still starting: its own, long limit
    CHECKPOINTING = "checkpointing"  # saving a checkpoint: its own limit
    EVALUATING = "evaluating"  # an evaluation pass: its own limit
    LOADING_DATA = "loading_data"  # (re)building a data loader or reading a shard: its own limit
    LEARNED = "learned"  # k x the job's rolling p99 step time
    FLOOR = "floor"  # the learned limit would be shorter than the floor (or nothing is learned yet)
    OVERRIDE = "override"  # the job's own fixed timeout
    STEPLESS = "stepless"  # no steps (no SDK): its ranks' stacks stood still in a collective (stack_hangs)


@dataclass(frozen=True)
class HangLimits:
    """Defaults, and a job's own values where it set them."""

    floor_s: float = 15.0
    k: float = 3.0
    startup_s: float = 900.0
    checkpointing_s: float = 1800.0
    evaluating_s: float = 1800.0
    loading_data_s: float = 900.0
    timeout_s: float | None = None

    @property
    def least(self) -> float:
        """The shortest limit any rank can have under these limits (a learned limit is never below the floor)."""
        own = min(self.startup_s, self.checkpointing_s, self.evaluating_s, self.loading_data_s)
        return min(own, self.floor_s, self.timeout_s if self.timeout_s is not None else math.inf)

    def of_phase(self, reason: LimitReason) -> float:
        """The limit of a phase that has its own (PHASE_LIMITS)."""
        value: float = getattr(self, PHASE_FIELDS[reason])
        return value


PHASE_FIELDS: Mapping[LimitReason, str] = {  # the HangLimits field of each phase with a limit of its own
    LimitReason.STARTUP: "startup_s",
    LimitReason.CHECKPOINTING: "checkpointing_s",
    LimitReason.EVALUATING: "evaluating_s",
    LimitReason.LOADING_DATA: "loading_data_s",
}


PHASE_LIMITS: Mapping[str, LimitReason] = {
    STARTUP: LimitReason.STARTUP,
    CHECKPOINTING: LimitReason.CHECKPOINTING,
    "restoring": LimitReason.CHECKPOINTING,  # reading a checkpoint back (examples/ddp_train.py): checkpoint I/O too
    **dict.fromkeys(EVALUATING, LimitReason.EVALUATING),
    **dict.fromkeys(LOADING_DATA, LimitReason.LOADING_DATA),
}


def limit_for(track: RankTrack, job_p99_s: float | None, limits: HangLimits) -> tuple[float, LimitReason, float]:
    """(limit, why, since): the stall limit for a rank in its phase, and the monotonic time its stall is timed from."""
    own = PHASE_LIMITS.get(track.phase)
    if own is None:
        since = max(track.advanced_at, track.phase_since)  # leaving a long phase restarts the clock
    elif track.stopped_since is not None:  # stopped, it makes no progress in its phase either: the training
        since = max(track.advanced_at, track.stopped_since)  # limit, from when it was first seen stopped
    else:  # a phase with a limit of its own, timed from the phase's start
        return limits.of_phase(own), own, track.phase_since
    if limits.timeout_s is not None:
        return limits.timeout_s, LimitReason.OVERRIDE, since
    learned = limits.k * job_p99_s if job_p99_s else 0.0
    if learned > limits.floor_s:
        return learned, LimitReason.LEARNED, since
    return limits.floor_s, LimitReason.FLOOR, since


# A stalled rank whose process the kernel holds (stopped, or stuck in uninterruptible sleep) is the hang's cause, not
# a victim: its peers wait in a collective, in ordinary sleep. Failing that, a rank burning CPU without progress
# while its peers idle (a livelock, a spin) is. Only then does "stopped first" decide, which is a guess when every
# rank stops at the same step.
HELD_STATES: Mapping[str, str] = {
    "T": "its process is stopped (state T)",
    "t": "its process is stopped by a tracer (state t)",
    "D": "its process is stuck in uninterruptible sleep (state D)",
}
MAX_SKIP_S = 30.0  # the longest a job goes without a close look at its ranks
BUSY_SHARE = 0.5  # a spinning rank used at least this share of one core during its stall ...
PEERS_IDLE_FACTOR = 0.25  # ... and every other stalled rank less than this fraction of its share


@dataclass(frozen=True)
class Stall:
    """One rank stalled past its limit: since when (monotonic), and its track."""

    since: float
    rank: int
    track: RankTrack


def hang_culprit(stalls: list[Stall], now: float) -> tuple[Stall, str]:
    """The stalled rank to blame, and why; `stalls` is sorted by when each stopped (earliest first)."""
    for stall in stalls:
        if stall.track.proc_state in HELD_STATES:
            return stall, HELD_STATES[stall.track.proc_state]
    shares = {s.rank: _cpu_share(s, now) for s in stalls}
    known = {rank: share for rank, share in shares.items() if share is not None}
    if len(known) >= 2:
        busiest = max(known, key=lambda rank: known[rank])
        top = known[busiest]
        if top >= BUSY_SHARE and all(v < top * PEERS_IDLE_FACTOR for r, v in known.items() if r != busiest):
            stall = next(s for s in stalls if s.rank == busiest)
            return stall, f"busy without progress ({top:.0%} of a core) while its peers wait"
    return stalls[0], "stopped first"


def _cpu_share(stall: Stall, now: float) -> float | None:
    track = stall.track
    if track.cpu_s is None or track.cpu_at_advance is None or now <= stall.since:
        return None
    return (track.cpu_s - track.cpu_at_advance) / (now - stall.since)


StallSeen = tuple[float, int, RankTrack, float, LimitReason]  # since, rank, track, limit, why


def _stall_order(stall: StallSeen) -> tuple[float, int, int]:
    """Earliest stall first; at the same moment the rank at the lower step, then the lower rank."""
    since, rank, track, *_ = stall
    return since, track.step if track.step is not None else -1, rank


def _stopped_at(stall: StallSeen) -> float:
    """When the rank stopped making progress: its last step (its stall may count from later: a phase, a stop)."""
    since, _, track, *_ = stall
    return min(since, track.advanced_at)


@dataclass(frozen=True)
class StackHang:
    """What the samples of a step-less job say: when it passes its limit, and whether and whom to blame then."""

    deadline: float  # monotonic time every rank will have stood still for the limit, if none moves
    since: float  # monotonic time the last of them was first seen still
    limit: float
    rank: int | None = None  # the culprit, once the limit has passed
    reason: str = ""
    stalled: tuple[int, ...] = ()


class StackTimer(Protocol):
    """What times the ranks of a job without steps by their stack samples (stack_hangs.SteplessJudge)."""

    def times(self, track: RankTrack, now: float) -> bool:
        """Whether a rank is timed by its stack samples rather than by its phase."""
        ...

    def judge(self, job: JobTrack, limits: HangLimits, now: float) -> StackHang | None:
        """The job's stack hang, if its samples show one coming or passed."""
        ...


class HangWatch:
    """Stage: check() returns a JobHung for each job with a rank stalled beyond its limit (once per stall)."""

    def __init__(
        self, *, clock: Clock, book: ProgressBook, defaults: HangLimits, stepless: StackTimer | None = None
    ) -> None:
        self.clock = clock
        self.book = book
        self.defaults = defaults
        self.stepless = stepless  # times ranks without steps by their stack samples (None: by their phase only)
        self.unfinished = False  # the last check() spent its budget before every due job had its look
        self.next_due: float | None = None  # the soonest deadline of a watched job after the last check()
        # Folds the reports a job's nodes sent since their last fold (JobTrack.waiting) into its tracks, before a
        # close look judges them (set by the watch, which reads reports; None: every report is folded as it arrives).
        self.settle: Callable[[JobTrack], None] | None = None
        # How far behind the reading of reports is, in seconds (set by the runtime: its report follower's lag_s).
        # Stalls are judged as of that long ago: a rank whose node's report waits unread is not hung for the delay.
        self.lag: Callable[[], float] = lambda: 0.0
        # Whether a node's reports are overdue as of a moment (set by the app: liveness's word). A rank on such a node
        # is not judged: its progress is unknown, not stalled, and its node's silence is liveness's to judge (a cut
        # management link must not make its job hung while the job's other ranks advance).
        self.unheard: Callable[[str, float], bool] = lambda _node, _now: False

    def check(
        self, overrides: Mapping[str, HangLimits] | None = None, *, budget_s: float | None = None
    ) -> list[JobHung]:
        """Jobs that just became hung.

        A job is looked at closely only once one of its ranks can have passed its limit (the earliest
        stall + limit seen at the last look, and at least every MAX_SKIP_S), so a pass costs O(jobs), not O(ranks).
        Jobs placed together come due together, though (a close look at a job of 512 ranks takes about a
        millisecond): with `budget_s` the pass stops once its close looks spent that much processor time (at least one
        look is made) and sets `unfinished`; the jobs not looked at stay due for the next call.
        """
        found: list[JobHung] = []
        lag = self.lag()
        now = self.clock.monotonic() - lag
        started, looked = time.perf_counter(), False
        self.unfinished = False
        soonest = math.inf
        for job_id, job in self.book.jobs.items():
            limits = (overrides or {}).get(job_id, self.defaults)
            if job.hung or not job.ranks:
                continue
            # Limits other than those of the last look: what it computed with them no longer holds.
            due = job.next_check if job.limits is None or limits == job.limits else 0.0
            joined_due = job.joined_since + limits.least if job.joined_since < math.inf else math.inf  # none joined
            if now < due and now < joined_due:
                soonest = min(soonest, job.deadline, joined_due)
                continue
            if looked and budget_s is not None and time.perf_counter() - started >= budget_s:
                self.unfinished = True
                break
            looked = True
            job.limits = limits
            if job.waiting and self.settle is not None:
                self.settle(job)
            if not all(t.alive for t in job.ranks.values()):
                continue  # a dead rank is a crash, reported as such
            hung = self._judge(job_id, job, limits, now, lag)
            if hung is not None:
                job.hung = True
                found.append(hung)
            else:
                soonest = min(soonest, job.deadline)
        self.next_due = None if self.unfinished or soonest == math.inf else soonest
        return found

    def _judge(self, job_id: str, job: JobTrack, limits: HangLimits, now: float, lag: float) -> JobHung | None:
        """A close look at a job (`now`: the monotonic moment it is judged as of, `lag` seconds ago)."""
        p99s = [t.p99_s for t in job.ranks.values() if t.p99_s]
        job_p99 = max(p99s) if p99s else None
        stalls: list[StallSeen] = []
        # A learned limit that shrinks is caught up with within the cap; a random share of it keeps the jobs' close
        # looks from bunching up in one pass (at 20,000 nodes a pass over every rank holds the loop for ~0.5 s).
        due = now + MAX_SKIP_S * (0.5 + 0.5 * random.random())  # noqa: S311 - spreading work, not a secret
        deadline = math.inf
        stepless, sampled = self.stepless, False
        unknown_before = self._unheard_nodes(job, now)
        for rank, track in job.ranks.items():
            if not track.alive or track.advanced_at < unknown_before.get(track.node_id, -math.inf):
                continue  # an ended process is not hung (its exit is a symptom of its own), nor one whose progress is
                # unknown: its node's reports do not arrive while ranks on heard nodes advance (liveness judges that)
            limit, why, since = limit_for(track, job_p99, limits)
            if why is LimitReason.STARTUP and stepless is not None and stepless.times(track, now):
                sampled = True  # no steps, past its grace: timed by its stack samples below, not by its phase
                continue
            stalls.append((since, rank, track, limit, why))
            deadline = min(deadline, since + limit)
        stack = stepless.judge(job, limits, now) if stepless is not None and sampled else None
        job.deadline = deadline if stack is None else min(deadline, stack.deadline)
        job.next_check = min(due, job.deadline)
        job.joined_since = math.inf
        over = [o for o in stalls if now - o[0] > o[3]]
        if not over:
            return self._stack_hung(job_id, job, stack, now, lag) if stack is not None else None
        first = min(over, key=_stall_order)
        since, _, _, limit, why = first
        # Ranks that stopped within one step time of the first stopped together, whether or not their own limit has
        # passed yet: a check at the first deadline finds one rank over its limit, and the frozen rank (whose stall
        # counts from when its report first showed it stopped) must still be among those the culprit is chosen from.
        grace = max(job_p99 or 0.0, 1.0)
        stopped = _stopped_at(first)
        together = [
            Stall(o[0], o[1], o[2]) for o in sorted(stalls, key=_stall_order) if _stopped_at(o) - stopped <= grace
        ]
        culprit, blame = hang_culprit(together, now)
        stalled = [s.rank for s in together]
        return self._hung(
            job_id, job, rank=culprit.rank, blame=blame, stalled_ranks=stalled, timing=(since, limit, why), now=now,
            lag=lag,
        )  # fmt: skip

    def _unheard_nodes(self, job: JobTrack, now: float) -> dict[str, float]:
        """The job's nodes whose reports are overdue, each with the last step of a rank on a heard node: a rank there
        that stopped before it is of unknown progress (a cut management link), not stalled. Empty when all are heard."""
        nodes = {track.node_id for track in job.ranks.values()}
        silent = {node_id for node_id in nodes if self.unheard(node_id, now)}
        if not silent:
            return {}
        heard = [t.advanced_at for t in job.ranks.values() if t.alive and t.node_id not in silent]
        moving = max(heard, default=-math.inf)
        return dict.fromkeys(silent, moving)

    def _stack_hung(self, job_id: str, job: JobTrack, stack: StackHang, now: float, lag: float) -> JobHung | None:
        """The hang of a job without steps that its stack samples show, once its limit has passed (stack_hangs)."""
        if stack.rank is None:
            return None
        timing = (stack.since, stack.limit, LimitReason.STEPLESS)
        return self._hung(
            job_id, job, rank=stack.rank, blame=stack.reason, stalled_ranks=list(stack.stalled), timing=timing,
            now=now, lag=lag,
        )  # fmt: skip

    def _hung(
        self,
        job_id: str,
        job: JobTrack,
        *,
        rank: int,
        blame: str,
        stalled_ranks: list[int],
        timing: tuple[float, float, LimitReason],
        now: float,
        lag: float,
    ) -> JobHung:
        """The symptom of a hang: `rank` to blame, its stall timed from `since` against `limit` (`timing`)."""
        since, limit, why = timing
        track = job.ranks[rank]
        steps = [t.step for t in job.ranks.values() if t.step is not None]
        top = max(steps, default=None)
        lagging = sorted(r for r, t in job.ranks.items() if top is not None and t.step is not None and t.step < top)
        stalled = now - since
        # The launch is part of the stall's identity: a relaunch from the same checkpoint can freeze at the same step
        # in the same phase, and without its epoch that hang would be taken for a redelivery of the last one.
        epoch = track.restart_epoch
        return JobHung(
            event_id=f"hang:{job_id}:{epoch}:{rank}:{track.step}:{track.phase}"[:128],
            time=self.clock.now() - timedelta(seconds=lag + stalled - limit),
            node_id=track.node_id,
            job_id=job_id,
            rank=rank,
            stalled_ranks=sorted(stalled_ranks),
            lagging_ranks=lagging,
            culprit_reason=blame,
            step=track.step,
            phase=track.phase,
            stalled_s=stalled,
            limit_s=limit,
            limit_reason=why.value,
        )


# --- stragglers -------------------------------------------------------------------------------------------------
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
