"""Stalled ranks: the order they stopped in, and the culprit of a hang among them (held by the kernel, else busy
without progress while its peers idle, else the first to stop)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from reprise_detector.progress.book import RankTrack
from reprise_detector.progress.limits import LimitReason

# A stalled rank whose process the kernel holds (stopped, or stuck in uninterruptible sleep) is the hang's cause, not
# a victim: its peers wait in a collective, in ordinary sleep. Failing that, a rank burning CPU without progress
# while its peers idle (a livelock, a spin) is. Only then does "stopped first" decide, which is a guess when every
# rank stops at the same step.
HELD_STATES: Mapping[str, str] = {
    "T": "its process is stopped (state T)",
    "t": "its process is stopped by a tracer (state t)",
    "D": "its process is stuck in uninterruptible sleep (state D)",
}
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


def stall_order(stall: StallSeen) -> tuple[float, int, int]:
    """Earliest stall first; at the same moment the rank at the lower step, then the lower rank."""
    since, rank, track, *_ = stall
    return since, track.step if track.step is not None else -1, rank


def stopped_at(stall: StallSeen) -> float:
    """When the rank stopped making progress: its last step (its stall may count from later: a phase, a stop)."""
    since, _, track, *_ = stall
    return min(since, track.advanced_at)
