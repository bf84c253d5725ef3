"""The demo's numbers and picture from a made-up run: detection, recovery, recomputation, time lost, goodput."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from reprise_cli.demo import report
from reprise_cli.demo.models import DemoRun, Fault, FaultPlan, FaultRun
from reprise_cli.demo.report import fault_numbers, goodput
from reprise_cli.demo.sampler import Sample
from reprise_cli.demo.timeline import draw
from reprise_cli.demo.training import Reference, Training, job_spec

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    """T0 plus seconds."""
    return T0 + timedelta(seconds=seconds)


# Steps 1..10 one a second, a fault at 9.5 s, a relaunch from checkpoint step 5 whose rank 0 runs steps 6..15 from 20 s.
SAMPLES = [Sample(at(t), 0, t + 1) for t in range(10)] + [
    Sample(at(15), 1, None),  # the new launch's rank 0 before its first step
    *(Sample(at(20 + i), 1, 6 + i) for i in range(10)),
]


def crash(*, recovered: bool = True) -> FaultRun:
    """A rank crash at 9.5 s whose recovery restored step 5 and was verified at 21 s."""
    steps = [
        {"step": "restoring", "started_at": at(10).isoformat(), "ended_at": at(10.5).isoformat(),
         "data": {"checkpoint": {"id": 1, "step": 5, "path": "/ckpt/step-5"}}},
        {"step": "verifying", "started_at": at(11).isoformat(), "ended_at": at(21).isoformat(), "data": {}},
    ]  # fmt: skip
    return FaultRun(
        plan=FaultPlan(Fault.RANK_CRASH, 1),
        node_id="node-2",
        epoch=0,
        injected_at=at(9.5),
        detail="killed rank 1",
        incident={"id": "i1", "opened_at": at(9.75).isoformat()},
        recovery={"id": "r1", "outcome": "recovered" if recovered else "attempts_spent", "steps": steps},
    )


def test_a_faults_numbers_come_from_its_incident_its_recovery_and_rank_0s_steps() -> None:
    numbers = fault_numbers(crash(), SAMPLES)
    assert numbers.detection_s == pytest.approx(0.25)
    assert numbers.recovery_s == pytest.approx(11.5)  # to the end of verifying
    assert (numbers.step_at_fault, numbers.restored_step, numbers.recomputed) == (10, 5, 5)
    assert numbers.lost_s == pytest.approx(14.5)  # back at step 10 at 24 s


def test_a_failed_recovery_has_no_recovery_time_nor_time_lost() -> None:
    numbers = fault_numbers(crash(recovered=False), SAMPLES)
    assert (numbers.recovery_s, numbers.lost_s) == (None, None)
    assert numbers.detection_s == pytest.approx(0.25)


def test_goodput_counts_only_time_spent_past_the_furthest_step() -> None:
    result = goodput(SAMPLES, final_step=15)
    assert result is not None
    assert result.wall_s == pytest.approx(29.0)  # first step at 0 s, step 15 at 29 s
    assert result.progress_s == pytest.approx(9.0 + 5.0)  # steps 2..10, then 11..15; re-trained 6..10 are not
    assert result.ratio == pytest.approx(14 / 29)


def test_goodput_needs_a_finished_run() -> None:
    assert goodput(SAMPLES, final_step=16) is None
    assert goodput([], final_step=1) is None


def test_the_timeline_draws_faults_recoveries_and_an_unplanned_recovery(tmp_path: Path) -> None:
    fault = crash()
    unplanned = {
        "id": "r2",
        "outcome": "recovered",
        "started_at": at(25).isoformat(),
        "finished_at": at(27).isoformat(),
        "steps": [{"step": "detected", "started_at": at(24.5).isoformat(), "ended_at": at(25).isoformat()}],
    }
    reference = Reference(digest="d", wall_s=1.0, output=tmp_path / "final.pt")
    run = DemoRun(
        training=Training(steps=15),
        reference=reference,
        job={"id": "job-1"},
        submitted_at=at(-5),
        faults=[fault],
        samples=SAMPLES,
        recoveries=[fault.recovery or {}, unplanned],
        digest="d",
        finished_at=at(29),
    )
    assert [r["id"] for r in run.unplanned] == ["r2"]
    picture = draw(run, tmp_path / "timeline.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_shows_both_paths_as_bench_recovery_last_measured_them(tmp_path: Path) -> None:
    saved = tmp_path / "recovery.json"
    cells = {
        "fast": {"rank_crash": {"time_to_progress_s_median": 0.385}, "hang": {"time_to_progress_s_median": None}},
        "cold": {"rank_crash": {"time_to_progress_s_median": 5.421}, "xid79": {"time_to_progress_s_median": 5.4}},
    }
    saved.write_text(json.dumps({"machine": {"date": "2026-12-04T12:02:00+00:00"}, "figures": {"cells": cells}}))
    assert report.bench_comparison(saved) == [
        "both paths, fault -> training again (median of 5), from make bench-recovery of 2026-12-04 12:02 UTC:",
        "  fast path rank crash 0.39 s, XID 79 -, hang -, node loss -",
        "  cold      rank crash 5.42 s, XID 79 5.40 s, hang -, node loss -",
    ]
    assert report.bench_comparison(tmp_path / "none.json") == []  # never measured here: nothing to show
    saved.write_text("{")
    assert report.bench_comparison(saved) == []


def test_a_cold_demo_job_restarts_cold_and_without_the_in_place_flag(tmp_path: Path) -> None:
    fast = job_spec(Training(), name="a", nodes=4, min_nodes=3, work_dir=tmp_path)
    cold = job_spec(Training(in_place=False), name="a", nodes=4, min_nodes=3, work_dir=tmp_path)
    assert (fast["policy"]["restart_mode"], "--in-place" in fast["command"]) == ("auto", True)
    assert (cold["policy"]["restart_mode"], "--in-place" in cold["command"]) == ("cold", False)
    assert cold["env"] == {}  # no copies in memory to restore from
