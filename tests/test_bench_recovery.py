"""bench/recovery_track.py: when the next fault is due; each fault's restart and progress from rank 0's lines; a cell's
rounds pooled; bench/bench_recovery.py: the order the runs go in."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from datetime import UTC, datetime

import pytest

from bench.bench_recovery import schedule
from bench.common import machine_info
from bench.recovery_render import render
from bench.recovery_track import QUICK, SCRIPT_COLLECTIVE_TIMEOUT_S, CellRun, FaultRecord, FaultTracker, System, pooled
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


def run_of(took: list[float], *, at: float, digest: str | None = "abc") -> CellRun:
    """A run of the fast cell whose faults took `took` seconds each to training again."""
    records = [FaultRecord(step=25 + 10 * i, injected_at=at + i, progressed_at=at + i + t) for i, t in enumerate(took)]
    run = CellRun(System.FAST, Fault.RANK_CRASH, launched_at=at, records=records, digest=digest, load_average=[1.0])
    run.finished_at = at + 60.0
    return run


def test_a_cells_rounds_pool_their_faults_and_keep_each_rounds_own_figures() -> None:
    cell = pooled([run_of([0.4, 0.6, 0.5], at=1000.0), run_of([0.9, 0.3], at=2000.0)])
    figures = cell.figures("abc")
    assert figures["faults_injected"] == 5 and figures["faults_recovered"] == 5
    assert figures["time_to_progress_s_median"] == 0.5 and figures["time_to_progress_s_range"] == [0.3, 0.9]
    assert [f["round"] for f in figures["faults"]] == [1, 1, 1, 2, 2]
    assert [(r["round"], r["time_to_progress_s_median"]) for r in figures["rounds"]] == [(1, 0.5), (2, 0.6)]
    assert figures["wall_s"] == 120.0 and figures["load_average_1m"] == [1.0, 1.0]
    assert figures["final_equal_to_reference"] is True


def test_pooled_rounds_that_ended_apart_are_not_equal_to_the_reference() -> None:
    cell = pooled([run_of([0.4], at=1000.0), run_of([0.5], at=2000.0, digest="other")])
    assert cell.figures("abc")["final_equal_to_reference"] is None
    assert cell.figures("abc")["finished"] is False
    assert any("different parameters" in note for note in cell.notes)
    unfinished = pooled([run_of([0.4], at=1000.0), run_of([0.5], at=2000.0, digest=None)])
    assert unfinished.figures("abc")["final_equal_to_reference"] is None


def test_further_rounds_run_the_compared_pairs_again_in_the_reverse_order() -> None:
    only_fast = [s for s, _ in schedule([(System.FAST, Fault.HANG), (System.FAST_CONTAINER, Fault.HANG)], 2)]
    assert only_fast == [System.FAST, System.FAST_CONTAINER, System.FAST_CONTAINER, System.FAST]
    row = [s for s, f in schedule([(s, Fault.XID79) for s in System], 3)]
    cold, fast = System.COLD, System.FAST
    boxed_cold, boxed_fast = System.COLD_CONTAINER, System.FAST_CONTAINER
    assert row == [cold, boxed_cold, fast, boxed_fast, System.PEER, System.LOOP,
                   boxed_fast, fast, boxed_cold, cold, cold, boxed_cold, fast, boxed_fast]  # fmt: skip
    assert schedule([(System.FAST, Fault.HANG)], 2) == [(System.FAST, Fault.HANG)]  # no partner: nothing to compare


def test_the_table_gives_each_container_ratio_pooled_and_round_by_round() -> None:
    bare = pooled([run_of([0.4, 0.4], at=1000.0), run_of([0.5, 0.5], at=3000.0)])
    boxed = pooled([run_of([0.6, 0.6], at=2000.0), run_of([0.5, 0.5], at=2500.0)])
    boxed.system = System.FAST_CONTAINER
    cells = {"fast": {"rank_crash": bare.figures("abc")}, "fast-container": {"rank_crash": boxed.figures("abc")}}
    document = {
        "machine": machine_info(),
        "figures": {"settings": dataclasses.asdict(QUICK), "quick": False, "torch": "x", "cells": cells},
    }
    table = render(document)
    assert (
        "rank crash: 1.22 x the processes' (pooled over 2 rounds in alternating order; round by round 1.50, 1.00)"
        in (table)
    )
    assert "| rank crash | Reprise fast path, containers | 4 of 4 | 0.55 s (0.50 s to 0.60 s) |" in table
    first, last = (datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds") for at in (1000.0, 2000.0))
    assert f"(its cells measured from {first} to {last})" in table  # each cell's first round


def test_the_collective_timeout_is_the_scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fleet projection estimates the loop's unrecovered hang with it: it must follow the script.
    spec = importlib.util.spec_from_file_location("ddp_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    assert module.COLLECTIVE_TIMEOUT.total_seconds() == SCRIPT_COLLECTIVE_TIMEOUT_S
