"""bench/recovery_track.py: when the next fault is due; each fault's restart and progress from rank 0's lines."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from bench.recovery_track import QUICK, SCRIPT_COLLECTIVE_TIMEOUT_S, CellRun, FaultTracker, System
from bench.vs_torchrun_common import SCRIPT, Fault

SETTINGS = dataclasses.replace(QUICK, faults=2, checkpoint_every=10, fault_step=25)


def step(number: int, at: float | None = None) -> str:
    return f"step {number} t={at if at is not None else 1000.0 + number:.6f}"


def start(world: int, first_step: int) -> str:
    return f"world {world}: starting at step {first_step} from scratch"


def test_faults_hit_aligned_steps_after_each_recovery_at_full_world() -> None:
    tracker = FaultTracker(SETTINGS)
    tracker.feed(start(4, 1))
    due = []
    for number in range(1, 26):
        tracker.feed(step(number))
        due.append(number) if tracker.due(step(number)) else None
    assert due == [25]
    record = tracker.injected(2000.0, "SIGKILL rank 3")
    assert record.step == 25 and tracker.recovering
    assert not tracker.due(step(35))  # no fault while the last one is not recovered
    tracker.feed(step(26, at=2000.1))  # a step rank 0 finished before the fault hit: not progress
    assert tracker.recovering
    tracker.feed(start(3, 21))  # restarted smaller: resumed from the step-20 checkpoint
    tracker.feed(step(21, at=2007.5))
    assert not tracker.recovering
    assert record.figures()["time_to_progress_s"] == 7.5 and record.figures()["steps_redone"] == 5
    assert record.resumed_world_size == 3
    assert not tracker.due(step(25)) and not tracker.due(step(35))  # not the full world: the next fault waits
    tracker.feed(start(4, 31))
    assert not tracker.due(step(31)) and tracker.due(step(35))
    tracker.injected(3000.0, "again")
    assert not tracker.due(step(45))  # every planned fault injected


def test_a_restart_in_place_without_a_start_line_is_a_step_seen_again() -> None:
    tracker = FaultTracker(SETTINGS)
    tracker.feed(start(4, 1))
    tracker.feed(step(25))
    record = tracker.injected(2000.0, "SIGKILL rank 3")
    tracker.feed(step(21, at=2001.25))
    assert record.resumed_from_step == 20 and record.progressed_at == 2001.25


def test_cell_figures_take_medians_over_the_recovered_faults() -> None:
    tracker = FaultTracker(dataclasses.replace(SETTINGS, faults=3))
    tracker.feed(start(4, 1))
    for began, took in ((100.0, 8.0), (200.0, 6.0), (300.0, None)):
        tracker.feed(step(25))
        tracker.injected(began, "")
        if took is not None:
            tracker.feed(start(4, 21))
            tracker.feed(step(21, at=began + took))
    cell = CellRun(System.COLD, Fault.RANK_CRASH, launched_at=50.0, records=tracker.records, digest="abc")
    figures = cell.figures("abc")
    assert figures["faults_injected"] == 3 and figures["faults_recovered"] == 2
    assert figures["time_to_progress_s_median"] == 7.0 and figures["time_to_progress_s_range"] == [6.0, 8.0]
    assert figures["final_equal_to_reference"] is True
    assert cell.figures("other")["final_equal_to_reference"] is False


def test_the_collective_timeout_is_the_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet projection estimates the loop's unrecovered hang with it: it must follow the script.
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    assert module.COLLECTIVE_TIMEOUT.total_seconds() == SCRIPT_COLLECTIVE_TIMEOUT_S
