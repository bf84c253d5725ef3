"""Hangs of jobs whose ranks report no steps (a script without the SDK), judged on their agents' stack samples.

Such a rank stays in the `startup` phase for ever. Past its startup grace, a rank its agent samples (RankStatus.where)
is no longer timed by the startup limit: its job is hung when every live rank has stood idle at the same stack (or
stopped) for longer than the limit, at least one of them inside a torch.distributed call. A rank that works (its
stack moves, or it uses CPU, I/O or, on NVML, its GPU) is no hang, and neither are its peers waiting for it: an
evaluation on one rank while the others wait in a barrier is training. The culprit is named as from a hang's
captured stacks (stacks.culprit): a stopped process, else the rank outside the collective the others wait in.
Called only at a close look at a job with such ranks (HangWatch), never per report.
"""

from __future__ import annotations

from collections.abc import Iterable

from reprise_detector.progress.book import JobTrack, RankTrack
from reprise_detector.progress.hangs import StackHang
from reprise_detector.progress.limits import STARTUP, HangLimits
from reprise_detector.stacks import StackView, culprit


class SteplessJudge:
    """Times the ranks that report no steps by their stack samples, after the startup grace (hangs.StackTimer)."""

    def __init__(self, *, limit_s: float, grace_s: float) -> None:
        self.limit_s = limit_s
        self.grace_s = grace_s

    def times(self, track: RankTrack, now: float) -> bool:
        """Whether a rank is timed by its stack samples: no step, sampled by its agent, past the startup grace."""
        sampled = track.step is None and track.phase == STARTUP and bool(track.where)
        return sampled and now - track.phase_since > self.grace_s

    def judge(self, job: JobTrack, limits: HangLimits, now: float) -> StackHang | None:
        """The job's stack hang: None while a live rank moves (or is not sampled) or none waits in a collective."""
        live = [(rank, track) for rank, track in job.ranks.items() if track.alive]
        still = {rank: _still_since(track, now, self) for rank, track in live}
        if not live or any(since is None for since in still.values()):
            return None
        if not any(track.waits_in for _, track in live):
            return None  # every rank stands still outside any collective: a pause of the script's own, not a hang
        limit = limits.timeout_s if limits.timeout_s is not None else self.limit_s
        since = max(s for s in still.values() if s is not None)
        if now - since <= limit:
            return StackHang(deadline=since + limit, since=since, limit=limit)
        rank, reason = _blame(live, still)
        return StackHang(since + limit, since, limit, rank, reason, tuple(sorted(still)))


def _still_since(track: RankTrack, now: float, judge: SteplessJudge) -> float | None:
    """Since when a live rank stands still: a stopped process since it stopped; a sampled one since its samples
    first showed it idle at its stack; None when it moves, or is timed otherwise (it reports steps)."""
    if track.stopped_since is not None:
        return track.stopped_since
    if not judge.times(track, now):
        return None
    return track.still_since


def _blame(live: Iterable[tuple[int, RankTrack]], still: dict[int, float | None]) -> tuple[int, str]:
    """The culprit as the hang's stacks would name it (stacks.culprit), else the rank that stood still first."""
    ranks = list(live)
    views = [StackView(r, t.node_id, t.proc_state, t.waits_in or None, t.where, "") for r, t in ranks]
    verdict = culprit(views)
    if verdict is not None:
        return verdict.rank, f"{verdict.reason} (stack samples)"
    first = min(ranks, key=lambda pair: (still[pair[0]] or 0.0, pair[0]))
    waits = first[1].waits_in or "its stack"
    return first[0], f"every rank stands still, none outside {waits}; it stood still first (stack samples)"
