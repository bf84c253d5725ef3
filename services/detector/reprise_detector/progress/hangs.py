"""The hang judgement: HangWatch finds the jobs with a rank stalled past its limit (limit_for), once per stall, and
names the culprit among the ranks that stopped together (stalls); ranks without steps are timed by their stack
samples instead (StackTimer, implemented by stack_hangs)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from reprise_common.clock import Clock
from reprise_detector.kinds.job_hung import JobHung
from reprise_detector.progress.book import JobTrack, ProgressBook, RankTrack
from reprise_detector.progress.limits import PHASE_LIMITS, HangLimits, LimitReason
from reprise_detector.progress.stalls import Stall, StallSeen, hang_culprit, stall_order, stopped_at

MAX_SKIP_S = 30.0  # the longest a job goes without a close look at its ranks


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
        first = min(over, key=stall_order)
        since, _, _, limit, why = first
        # Ranks that stopped within one step time of the first stopped together, whether or not their own limit has
        # passed yet: a check at the first deadline finds one rank over its limit, and the frozen rank (whose stall
        # counts from when its report first showed it stopped) must still be among those the culprit is chosen from.
        grace = max(job_p99 or 0.0, 1.0)
        stopped = stopped_at(first)
        together = [
            Stall(o[0], o[1], o[2]) for o in sorted(stalls, key=stall_order) if stopped_at(o) - stopped <= grace
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
