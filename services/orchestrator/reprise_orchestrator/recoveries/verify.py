"""Verifying a recovery's new epoch by the signals the job gives.

A job that reports steps through the SDK passes when every rank reports a step at or past the restored checkpoint's.
A job that reports none (a plain torchrun script) passes when every rank stays alive, not stopped, for the policy's
settle time, each using CPU or moving I/O in its second half (the agents' reports carry each live rank's CPU time
and I/O bytes: a rank sleeping between small collectives uses little CPU, but its sockets move): rendezvous,
restore and the first steps fail within that time when they fail at all. Either way, every rank exiting 0 is a
finished job, never a failure; a rank exiting otherwise fails the attempt. `judge` decides on one look at the ranks;
`watch` looks until it decides, the timeout passes, or the incident learned something.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from reprise_common.clock import Clock
from reprise_common.report_view import STOPPED_STATES, RankSeen
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs.models import RecoveryPolicy, VerifyBy
from reprise_orchestrator.recoveries.records import Resumed, Then, Verified, VerifyPath

POLL_S = 0.25
NEWS_EVERY_S = 1.0  # how often a long wait looks for what the incident learned meanwhile


class Verdict(StrEnum):
    """What one look at the new epoch's ranks decided."""

    WAIT = "wait"  # nothing yet: look again
    PASSED = "passed"  # the epoch trains, or finished (the data's path says which)
    DEAD = "dead"  # a rank exited other than 0
    TIMED_OUT = "timed_out"  # the policy's verify_timeout_s passed first
    LEARNED = "learned"  # the incident learned something: a new attempt plans with it


@dataclass(frozen=True)
class Judgement:
    """A verdict with its record and, for an attempt that must be made again, the reason."""

    verdict: Verdict
    data: Verified
    detail: str = ""

    @property
    def then(self) -> Then:
        """What the verifying step's result asks for next."""
        return Then.NEXT if self.verdict is Verdict.PASSED else Then.RETRY


@dataclass(frozen=True)
class Watch:
    """What a verifying step waits for: the job's ranks of one epoch, the step to pass, the policy's bounds."""

    job_id: str
    epoch: int
    wanted: frozenset[int]
    target: int
    policy: RecoveryPolicy
    sdk_seen: bool = False  # a rank of the job reported SDK progress before this epoch


@dataclass
class Settle:
    """The settle time of a job verified without steps: when every rank was first seen running, and each one's CPU
    time at its middle."""

    seconds: float
    min_share: float
    since: float | None = None
    middle_at: float | None = None
    middle: dict[int, RankSeen] = field(default_factory=dict)  # each rank as the reports showed it at the middle
    idle: list[int] = field(default_factory=list)  # ranks that used too little CPU in the last settle time

    def restart(self) -> None:
        """Start the settle time again (a rank is not running, or was idle)."""
        self.since = self.middle_at = None
        self.middle = {}

    def evidence(self, running: Mapping[int, RankSeen], now: float) -> Evidence | None:
        """The CPU seconds and I/O bytes each running rank used in the settle time's second half, once it passed with
        every rank working (its CPU share at least `min_share`, or its I/O grew: a rank that sleeps between small
        collectives uses little CPU, but its sockets move); None until then."""
        if self.since is None:
            self.since = now
        if self.middle_at is None:
            if now - self.since >= self.seconds / 2:
                self.middle_at, self.middle = now, dict(running)
            return None
        # A rank whose node has not reported since the middle is waited for: its CPU time has not been read again.
        if now - self.since < self.seconds or any(running[r] is self.middle.get(r) for r in running):
            return None
        before = {r: self.middle.get(r) for r in running}
        used = {r: _used(b.cpu_s if b else None, running[r].cpu_s) for r, b in before.items()}
        moved = {r: _moved(b.io_bytes if b else None, running[r].io_bytes) for r, b in before.items()}
        least = self.min_share * (now - self.middle_at)
        self.idle = sorted(r for r, u in used.items() if u is not None and u < least and not moved[r])
        if self.idle:
            self.restart()
            return None
        cpu = {str(r): None if u is None else round(u, 3) for r, u in sorted(used.items())}
        return Evidence(cpu, {str(r): m for r, m in sorted(moved.items())})


def _used(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else max(0.0, after - before)


def _moved(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else max(0, after - before)


@dataclass(frozen=True)
class Evidence:
    """What each rank used in the settle time's second half, by rank (None: not known)."""

    cpu_s: dict[str, float | None]
    io_bytes: dict[str, int | None]


def by_steps(watch: Watch, ranks: Mapping[int, RankSeen]) -> bool:
    """True when the SDK's steps are the proof: the policy says so, or (auto) a rank of the job reported progress,
    before this epoch or in it."""
    if watch.policy.verify_by is not VerifyBy.AUTO:
        return watch.policy.verify_by is VerifyBy.STEPS
    return watch.sdk_seen or any(s.step is not None for s in ranks.values())


def judge(seen: Mapping[int, RankSeen], watch: Watch, settle: Settle, now: float) -> Judgement:
    """One look at the epoch's ranks (`seen`: the reported ones, by rank)."""
    ranks = {r: seen[r] for r in sorted(watch.wanted) if r in seen}
    finished = [r for r, s in ranks.items() if not s.alive and s.exit_code == 0]
    dead = [r for r, s in ranks.items() if not s.alive and s.exit_code != 0]
    data = Verified(target_step=watch.target, finished=finished)
    if dead:
        return Judgement(Verdict.DEAD, data.model_copy(update={"dead_ranks": dead}))
    if len(finished) == len(watch.wanted):
        return Judgement(Verdict.PASSED, data.model_copy(update={"path": VerifyPath.COMPLETED}))
    if by_steps(watch, ranks):
        return _judge_steps(ranks, watch, data)
    return _judge_settle(ranks, watch, settle, now, data)


def _judge_steps(ranks: Mapping[int, RankSeen], watch: Watch, data: Verified) -> Judgement:
    done = set(data.finished)
    ready = {r for r, s in ranks.items() if r in done or (s.step is not None and s.step >= watch.target)}
    if ready == watch.wanted:
        steps = {str(r): ranks[r].step for r in sorted(watch.wanted)}
        update = {"path": VerifyPath.STEPS, "steps": steps, "resumed": _resumed(ranks)}
        return Judgement(Verdict.PASSED, data.model_copy(update=update))
    return Judgement(Verdict.WAIT, data.model_copy(update={"missing": sorted(watch.wanted - ready)}))


def _resumed(ranks: Mapping[int, RankSeen]) -> Resumed | None:
    """What the ranks said of their state's source (they decide together: the lowest rank that said it speaks)."""
    said = next((ranks[r] for r in sorted(ranks) if ranks[r].resumed_via), None)
    if said is None:
        return None
    return Resumed(via=said.resumed_via, step=said.resumed_step, why=said.resumed_why)


def _judge_settle(ranks: Mapping[int, RankSeen], watch: Watch, settle: Settle, now: float, data: Verified) -> Judgement:
    running = {r: s for r, s in ranks.items() if s.alive and s.proc_state not in STOPPED_STATES}
    if len(running) + len(data.finished) < len(watch.wanted):  # one not reported yet, or stopped
        settle.restart()
        missing = sorted(watch.wanted - set(running) - set(data.finished))
        return Judgement(Verdict.WAIT, data.model_copy(update={"missing": missing}))
    used = settle.evidence(running, now)
    if used is None:
        return Judgement(Verdict.WAIT, data.model_copy(update={"missing": list(settle.idle)}))
    settled = {"path": VerifyPath.SETTLED, "settle_s": settle.seconds, "cpu_s": used.cpu_s, "io_bytes": used.io_bytes}
    return Judgement(Verdict.PASSED, data.model_copy(update=settled))


def _timed_out(last: Judgement, watch: Watch, ranks: Mapping[int, RankSeen]) -> Judgement:
    timeout, missing = watch.policy.verify_timeout_s, last.data.missing
    if by_steps(watch, ranks):
        detail = f"ranks {missing} did not pass step {watch.target} within {timeout:g} s"
    else:
        settle = watch.policy.settle_s()
        detail = f"ranks {missing} were not alive and working for {settle:g} s in a row within {timeout:g} s"
    return Judgement(Verdict.TIMED_OUT, last.data, detail)


async def watch(
    inventory: Inventory, clock: Clock, what: Watch, *, news_event: asyncio.Event, news: Callable[[], str]
) -> Judgement:
    """Look at the epoch's ranks as reports arrive until a verdict other than WAIT; between looks, read what the
    incident learned (when `news_event` is set, at least every NEWS_EVERY_S)."""
    settle = Settle(what.policy.settle_s(), what.policy.verify_cpu_share)
    deadline = clock.monotonic() + what.policy.verify_timeout_s
    next_news = clock.monotonic() + NEWS_EVERY_S
    while True:
        seen = inventory.ranks_of(what.job_id, restart_epoch=what.epoch)
        now = clock.monotonic()
        found = judge(seen, what, settle, now)
        if found.verdict is not Verdict.WAIT:
            return found
        if news_event.is_set() or now >= next_news:
            news_event.clear()
            next_news = now + NEWS_EVERY_S
            learned = news()
            if learned:
                return Judgement(Verdict.LEARNED, Verified(target_step=what.target, learned=learned), learned)
        if now > deadline:
            return _timed_out(found, what, seen)
        await inventory.next_reports(POLL_S)  # at once when a report lands, at the latest after POLL_S
