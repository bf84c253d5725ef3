"""bench/ettr.py: the fleet projection's arithmetic against values worked out by hand, and its inputs from the cells."""

from __future__ import annotations

from typing import Any

import pytest

from bench import ettr
from bench.recovery_track import SCRIPT_COLLECTIVE_TIMEOUT_S, System


def test_llama3_rate_per_node_day() -> None:
    # 419 interruptions / (54 days x 2,048 nodes of 8 GPUs) = 419 / 110,592
    assert ettr.llama3_per_node_day() == pytest.approx(0.0037887, rel=1e-4)


def test_projection_at_16k_gpus_and_the_llama3_rate() -> None:
    # By hand: N·r = 2,048 x 419/110,592 = 7.759 failures a day, so M = 54 x 86,400 / 419 = 11,135.08 s.
    # Daly, δ = 60 s: √(2·60·11,135.08) = 1,155.94; δ/2M = 0.0026942, √ = 0.051906;
    # T = 1,155.94 x (1 + 0.017302 + 0.000299) - 60 = 1,116.29 s.
    # ETTR, u0 = 10 s: (1 - (10 + 558.15)/11,135.08) / (1 + 60/1,116.29) = 0.948976 / 1.053750 = 0.90057.
    rate = next(r for r in ettr.RATES if r.name == "Llama 3")
    projection = ettr.project(gpus=16_384, rate=rate, save_cost=60.0, restart_overhead=10.0)
    assert projection.nodes == 2_048
    assert projection.failures_per_day == pytest.approx(7.759, abs=1e-3)
    assert projection.mtbf_s == pytest.approx(11_135.08, abs=0.01)
    assert projection.interval_s == pytest.approx(1_116.29, abs=0.01)
    assert projection.ettr == pytest.approx(0.90057, abs=1e-5)


def test_projection_at_1k_gpus_and_the_high_rate() -> None:
    # By hand: 128 nodes x 0.0065 = 0.832 failures a day, M = 86,400 / 0.832 = 103,846.15 s; δ = 60 s:
    # √(2·60·103,846.15) = 3,530.10; δ/2M = 0.00028889, √ = 0.016997; T = 3,530.10 x 1.0056977 - 60 = 3,490.20 s.
    # ETTR, u0 = 2 s: (1 - (2 + 1,745.10)/103,846.15) / (1 + 60/3,490.20) = 0.983176 / 1.017191 = 0.96656.
    rate = next(r for r in ettr.RATES if r.per_node_day == 6.5e-3)
    projection = ettr.project(gpus=1_024, rate=rate, save_cost=60.0, restart_overhead=2.0)
    assert projection.mtbf_s == pytest.approx(103_846.15, abs=0.01)
    assert projection.interval_s == pytest.approx(3_490.20, abs=0.01)
    assert projection.ettr == pytest.approx(0.96656, abs=1e-5)


def cell(median: float | None, *, detect: float | None = None, **extra: Any) -> dict[str, Any]:
    """A recovery cell as bench_recovery saves it, with only what the projection reads."""
    return {"time_to_progress_s_median": median, "time_to_detect_s_median": detect, **extra}


def test_overheads_average_the_fault_kinds_and_estimate_an_unrecovered_hang() -> None:
    cells = {
        "cold": {"rank_crash": cell(8.0, detect=0.1), "hang": cell(12.0, detect=3.1)},
        "loop": {"rank_crash": cell(14.0, detect=0.2), "hang": cell(None)},
        "fast": {"rank_crash": cell(None, skipped="no --in-place yet")},
    }
    found = ettr.overheads(cells)
    assert set(found) == {System.COLD, System.LOOP}  # a skipped system is not projected
    assert found[System.COLD].restart_overhead_s == pytest.approx(10.0)
    assert found[System.COLD].detection_s == pytest.approx(1.6)
    # The loop's hang never recovered in the run: the collective timeout plus its crash recovery, marked estimated.
    assert found[System.LOOP].per_fault_s["hang"] == pytest.approx(SCRIPT_COLLECTIVE_TIMEOUT_S + 14.0)
    assert found[System.LOOP].restart_overhead_s == pytest.approx((14.0 + SCRIPT_COLLECTIVE_TIMEOUT_S + 14.0) / 2)
    assert "hang" in found[System.LOOP].estimated


def test_save_cost_is_the_median_of_the_measured_ones() -> None:
    cells = {"cold": {"a": cell(1.0, save_cost_s=0.03), "b": cell(1.0, save_cost_s=0.05)}, "fast": {"a": cell(1.0)}}
    cells["fast"]["b"] = cell(1.0, save_cost_s=0.04)
    assert ettr.save_cost_s(cells) == pytest.approx(0.04)


def test_a_faster_restart_never_projects_a_lower_ettr() -> None:
    for rate in ettr.RATES:
        for gpus in ettr.GPU_COUNTS:
            slow = ettr.project(gpus=gpus, rate=rate, save_cost=0.05, restart_overhead=20.0)
            fast = ettr.project(gpus=gpus, rate=rate, save_cost=0.05, restart_overhead=1.0)
            assert fast.interval_s == slow.interval_s  # the advisor's interval does not depend on u0
            assert fast.ettr > slow.ettr


def test_no_step_lost_projection_at_16k_gpus_and_the_llama3_rate() -> None:
    # By hand: M = 11,135.08 s as above; f = 0.1 of the failures need the checkpoint, so M' = M / f = 111,350.84 s.
    # Daly, δb = 6 s: √(2·6·111,350.84) = 1,155.95; δb/2M' = 2.6942e-5, √ = 0.0051906;
    # T = 1,155.95 x (1 + 0.0017302 + 0.0000030) - 6 = 1,151.95 s.
    # ETTR, u0 = 1 s: (1 - 1/11,135.08 - 0.1 x 1,151.95/(2 x 11,135.08)) / (1 + 6/1,151.95) = 0.994738 / 1.005209
    # = 0.98958.
    rate = next(r for r in ettr.RATES if r.name == "Llama 3")
    projection = ettr.project_no_step_lost(
        gpus=16_384, rate=rate, blocking_save_s=6.0, fallback_share=0.1, restart_overhead=1.0
    )
    assert projection.mtbf_s == pytest.approx(11_135.08, abs=0.01)
    assert projection.interval_s == pytest.approx(1_151.95, abs=0.01)
    assert projection.ettr == pytest.approx(0.98958, abs=1e-5)


def test_every_failure_falling_back_is_the_plain_projection() -> None:
    rate = next(r for r in ettr.RATES if r.name == "Llama 3")
    plain = ettr.project(gpus=131_072, rate=rate, save_cost=60.0, restart_overhead=1.3)
    same = ettr.project_no_step_lost(
        gpus=131_072, rate=rate, blocking_save_s=60.0, fallback_share=1.0, restart_overhead=1.3
    )
    assert same.ettr == pytest.approx(plain.ettr, rel=1e-12) and same.interval_s == pytest.approx(plain.interval_s)
