"""Checkpoint-interval arithmetic (see the design reference): Young, Daly and the expected ETTR.

All times in seconds. M is the job's mean time between failures: node MTBF divided by the job's node count.
"""

from __future__ import annotations

import math

SECONDS_PER_DAY = 86400.0


def job_mtbf_s(*, node_count: int, failures_per_node_day: float) -> float:
    """M = 1 / (N · r_f): the job fails whenever any of its nodes does."""
    return SECONDS_PER_DAY / (node_count * failures_per_node_day)


def young_interval_s(*, save_cost_s: float, mtbf_s: float) -> float:
    """Young: T ≈ √(2δM)."""
    return math.sqrt(2 * save_cost_s * mtbf_s)


def daly_interval_s(*, save_cost_s: float, mtbf_s: float) -> float:
    """Daly: T = √(2δM)·[1 + ⅓·√(δ/2M) + (1/9)·(δ/2M)] - δ for δ < 2M; otherwise T = M."""
    delta, m = save_cost_s, mtbf_s
    if delta >= 2 * m:
        return m
    ratio = delta / (2 * m)
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


def expected_ettr(*, interval_s: float, save_cost_s: float, mtbf_s: float, restart_overhead_s: float) -> float:
    """E[ETTR] ≈ [1 - N·r_f·(u0 + Δt/2)] / (1 + w/Δt), with N·r_f = 1/M; never below 0."""
    lost = (restart_overhead_s + interval_s / 2) / mtbf_s
    return max(0.0, (1 - lost) / (1 + save_cost_s / interval_s))
