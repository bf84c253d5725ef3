"""Numeric faults: the watched metrics of each rank's heartbeats, checked for NaN, infinities and spikes.

The agent sees every heartbeat the SDK sends (at most one per rank every 0.1 s, and at once for the first non-finite
value: the SDK never coalesces that one away), so it is where a metric is watched; the detector only hears of a fault.
A spike is a finite value whose robust z-score against the rank's recent values, (value - median) / (1.4826 * MAD),
reaches the job's threshold: the median and the median absolute deviation ignore the outliers a mean and a standard
deviation would chase. Only upward spikes count (a loss that suddenly falls is no fault). A rank trips once per
launch: its ranks are stopped and relaunched (a new restart epoch) by the recovery that follows.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from reprise_common.events import NumericKind, NumericWatch, RankNumeric

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normally distributed values
RELATIVE_SCALE_FLOOR = 1e-3  # a flat metric (MAD 0) measures spikes against 0.1 % of its median instead
MAX_WATCHED_RANKS = 4096


@dataclass(frozen=True, slots=True)
class NumericTrip:
    """A watched metric that went wrong on one rank: what, when, and against what."""

    metric: str
    kind: NumericKind
    value: float | None  # None for NaN and infinities (JSON has neither)
    step: int
    last_good_step: int | None
    median: float | None = None
    z: float | None = None

    def event(self, *, node_id: str, job_id: str, rank: int, restart_epoch: int) -> RankNumeric:
        """The `rank.numeric` event that announces this trip."""
        return RankNumeric(
            source=node_id,
            node_id=node_id,
            job_id=job_id,
            rank=rank,
            restart_epoch=restart_epoch,
            metric=self.metric,
            kind=self.kind,
            value=self.value,
            step=self.step,
            last_good_step=self.last_good_step,
            median=self.median,
            z=self.z,
        )


@dataclass(slots=True)
class _RankWatch:
    restart_epoch: int
    last_good_step: int | None = None
    tripped: bool = False
    recent: dict[str, deque[float]] = field(default_factory=dict)


class NumericWatcher:
    """Each rank's watched metrics within its launch; `observe` answers a trip at most once per rank and launch."""

    def __init__(self, *, max_ranks: int = MAX_WATCHED_RANKS) -> None:
        self.max_ranks = max_ranks
        self._ranks: dict[tuple[str, int], _RankWatch] = {}

    def observe(
        self, watch: NumericWatch, *, job_id: str, rank: int, restart_epoch: int, step: int, metrics: dict[str, float]
    ) -> NumericTrip | None:
        """Check one heartbeat's metrics; the trip it makes (the first of the rank's launch), else None."""
        state = self._state(job_id, rank, restart_epoch)
        if state is None or state.tripped:
            return None
        for name in watch.metrics:
            value = metrics.get(name)
            if value is None:
                continue
            trip = self._judge(watch, state, name, value, step)
            if trip is not None:
                state.tripped = True
                return trip
        if any(name in metrics for name in watch.metrics):
            state.last_good_step = step if state.last_good_step is None else max(step, state.last_good_step)
        return None

    def forget(self, job_id: str) -> None:
        """Drop a job's ranks (stopped, or about to be relaunched)."""
        for key in [k for k in self._ranks if k[0] == job_id]:
            del self._ranks[key]

    def _state(self, job_id: str, rank: int, restart_epoch: int) -> _RankWatch | None:
        key = (job_id, rank)
        state = self._ranks.get(key)
        if state is not None and restart_epoch < state.restart_epoch:
            return None  # a rank of an earlier launch, still talking while it is stopped
        if state is None or restart_epoch > state.restart_epoch:
            if state is None and len(self._ranks) >= self.max_ranks:
                return None
            state = self._ranks[key] = _RankWatch(restart_epoch)
        return state

    @staticmethod
    def _judge(watch: NumericWatch, state: _RankWatch, name: str, value: float, step: int) -> NumericTrip | None:
        if math.isnan(value):
            return NumericTrip(name, NumericKind.NAN, None, step, state.last_good_step)
        if math.isinf(value):
            return NumericTrip(name, NumericKind.INF, None, step, state.last_good_step)
        recent = state.recent.get(name)
        if recent is None:
            recent = state.recent[name] = deque(maxlen=watch.window)
        trip = None
        if watch.spike_z is not None and len(recent) >= watch.min_samples:
            middle = median(recent)
            spread = median(abs(v - middle) for v in recent) * MAD_TO_SIGMA
            scale = max(spread, abs(middle) * RELATIVE_SCALE_FLOOR, 1e-12)
            z = (value - middle) / scale
            if z >= watch.spike_z:
                trip = NumericTrip(name, NumericKind.SPIKE, value, step, state.last_good_step, middle, round(z, 2))
        if trip is None:
            recent.append(value)
        return trip
