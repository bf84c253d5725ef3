"""What every cell of bench_recovery shares: its settings, the faults of one run read off rank 0's lines, the figures.

A cell is one run of the example under one system with several faults of one kind. The tracker reads rank 0's lines
in the order they were written and says when the next fault is due: at a step S past the last fault's step with
S ≡ fault_step (mod checkpoint_every), once training has moved again after the last fault at the full world size
(and whatever else the system waits for: warm standbys back, a lost node's replacement joined). So every fault redoes
the same number of steps, and no fault hits a recovery still under way.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from bench.vs_torchrun_common import START_LINE, Fault, Settings, step_of

SCRIPT_COLLECTIVE_TIMEOUT_S = 300.0  # examples/ddp_train.py's COLLECTIVE_TIMEOUT: a frozen peer fails the others then


class System(StrEnum):
    """The ways of running the same script through the same faults."""

    COLD = "cold"  # Reprise, restart_mode cold, no standbys
    FAST = "fast"  # Reprise, restart_mode auto, --in-place, warm standbys; every rank restores the checkpoint
    PEER = "peer"  # as fast, and the ranks go on from the survivors' state (reprise_sdk.torch.replica)
    LOOP = "loop"  # `until torchrun ...; do :; done`
    COLD_CONTAINER = "cold-container"  # as cold, each rank in a container (bench/recovery_containers.py)
    FAST_CONTAINER = "fast-container"  # as fast, each rank in a container; warm standbys in containers

    @property
    def in_place(self) -> bool:
        """Reprise's fast path: surviving ranks restart in their processes, warm standbys take the others."""
        return self in (System.FAST, System.PEER, System.FAST_CONTAINER)

    @property
    def in_containers(self) -> bool:
        """The job's ranks run in containers on the stack's own dockerd."""
        return self in (System.COLD_CONTAINER, System.FAST_CONTAINER)

    @property
    def standbys(self) -> bool:
        """The agents keep warm standbys for the job's replacement ranks (in containers: of the job's image, the
        spares' too)."""
        return self.in_place


FAULTS = (Fault.RANK_CRASH, Fault.XID79, Fault.HANG, Fault.NODE_LOSS)
CONTAINER_PAIRS = ((System.FAST_CONTAINER, System.FAST), (System.COLD_CONTAINER, System.COLD))  # ratios reported


@dataclass(frozen=True)
class RecoverySettings(Settings):
    """The training run and the fault schedule, the same for every cell."""

    faults: int = 5  # faults per cell
    standbys: int = 2  # warm standbys per node on the fast path
    standby_refill_delay_s: float = 2.0  # the agents' REPRISE_STANDBY_REFILL_DELAY_S (10 s by default)
    ready_timeout_s: float = 240.0  # how long a system may take to be whole again (standbys, a replacement node)

    def spares(self, fault: Fault) -> int:
        """Reprise's spare nodes: a cordoned (XID 79) or lost node stays out, so one spare per fault."""
        return self.faults if fault in (Fault.XID79, Fault.NODE_LOSS) else 1


FULL = RecoverySettings(
    steps=800, checkpoint_every=10, fault_step=25, step_sleep=0.05, hang_timeout_s=3.0, hang_bound_s=60.0,
    max_restarts=8, run_timeout_s=900.0, faults=5,
)  # fmt: skip
QUICK = RecoverySettings(
    steps=60, checkpoint_every=10, fault_step=25, step_sleep=0.05, hang_timeout_s=3.0, hang_bound_s=30.0,
    max_restarts=4, run_timeout_s=420.0, faults=1,
)  # fmt: skip


@dataclass
class FaultRecord:
    """One fault of a cell: when it hit, when it was noticed, where training restarted and when it moved again."""

    step: int
    injected_at: float
    detail: str = ""
    detected_at: float | None = None
    detected_by: str = ""
    restarted: bool = False
    resumed_from_step: int | None = None
    resumed_world_size: int | None = None
    progressed_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        """This fault's figures, one key each."""
        return {
            "fault_step": self.step,
            "time_to_detect_s": _since(self.injected_at, self.detected_at),
            "time_to_progress_s": _since(self.injected_at, self.progressed_at),
            "resumed_from_step": self.resumed_from_step,
            "resumed_world_size": self.resumed_world_size,
            "steps_redone": None if self.resumed_from_step is None else max(0, self.step - self.resumed_from_step),
            "injected": self.detail,
            "detected_by": self.detected_by,
            **self.extra,
        }


def _since(start: float, moment: float | None) -> float | None:
    return None if moment is None else round(moment - start, 3)


class FaultTracker:
    """Follows rank 0's lines: the world size, the faults injected, each one's restart and first step after it."""

    def __init__(self, settings: RecoverySettings) -> None:
        self.settings = settings
        self.records: list[FaultRecord] = []
        self.world: int | None = None
        self.last_step = 0

    @property
    def recovering(self) -> bool:
        """A fault was injected and training has not moved past its restart yet."""
        return bool(self.records) and self.records[-1].progressed_at is None

    def feed(self, line: str) -> None:
        """Take one line of rank 0, in the order they were written."""
        if start := START_LINE.search(line):
            self.world = int(start.group(1))
            if self.recovering:
                record = self.records[-1]
                record.restarted = True
                record.resumed_world_size, record.resumed_from_step = self.world, int(start.group(2)) - 1
            return
        step = step_of(line)
        if step is None:
            return
        number, stamp = step
        if self.recovering:
            record = self.records[-1]
            if not record.restarted and number <= record.step:  # a restart that printed no start line: a step again
                record.restarted, record.resumed_from_step = True, number - 1
                record.resumed_world_size = self.world
            if record.restarted:
                record.progressed_at = stamp
        self.last_step = number

    def due(self, line: str) -> bool:
        """True when `line` is the step at which the next fault should hit (the system's own readiness aside)."""
        step = step_of(line)
        if step is None or self.recovering or len(self.records) >= self.settings.faults:
            return False
        number, settings = step[0], self.settings
        past = number > (self.records[-1].step if self.records else 0) and number >= settings.fault_step
        aligned = number % settings.checkpoint_every == settings.fault_step % settings.checkpoint_every
        return past and aligned and self.world == settings.world_size

    def injected(self, at: float, detail: str) -> FaultRecord:
        """Record a fault injected at `at` (unix time) at the last step read."""
        self.records.append(FaultRecord(step=self.last_step, injected_at=at, detail=detail))
        return self.records[-1]


@dataclass
class CellRun:
    """One cell: a system, a fault kind, the faults of its run and how the run ended."""

    system: System
    fault: Fault
    launched_at: float
    records: list[FaultRecord] = field(default_factory=list)
    digest: str | None = None
    finished_at: float | None = None
    skipped: str = ""
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    load_average: list[float] = field(default_factory=lambda: [round(os.getloadavg()[0], 2)])
    rounds: list[dict[str, Any]] = field(default_factory=list)  # a pooled cell's runs, each one's own summary

    def figures(self, reference: str | None) -> dict[str, Any]:
        """The cell's figures: medians over its faults, then each fault's."""
        faults = [record.figures() for record in self.records]
        chose = any("restart_path" in f for f in faults)  # Reprise's cells: the path each recovery took
        paths = Counter(str((f.get("restart_path") or {}).get("restart_mode", "?")) for f in faults) if chose else {}
        progress = [f["time_to_progress_s"] for f in faults if f["time_to_progress_s"] is not None]
        detect = [f["time_to_detect_s"] for f in faults if f["time_to_detect_s"] is not None]
        redone = [f["steps_redone"] for f in faults if f["steps_redone"] is not None]
        launching = [s for f in faults if (s := (f.get("recovery_steps_s") or {}).get("launching")) is not None]
        return {
            "measured_at": datetime.fromtimestamp(self.launched_at, UTC).isoformat(timespec="seconds"),
            "skipped": self.skipped or None,
            "faults_injected": len(faults),
            "faults_recovered": len(progress),
            "time_to_progress_s_median": _median(progress),
            "time_to_progress_s_range": [min(progress), max(progress)] if progress else None,
            "time_to_detect_s_median": _median(detect),
            "steps_redone_median": _median(redone),
            "launching_s_median": _median(launching),  # the recovery's launch step: the ranks (re)started
            "finished": self.digest is not None,
            "final_equal_to_reference": None if self.digest is None or reference is None else self.digest == reference,
            "wall_s": round(self.finished_at - self.launched_at, 2) if self.finished_at else None,
            "params_sha256": self.digest,
            "load_average_1m": self.load_average,
            "notes": self.notes,
            "restart_paths": dict(paths),
            **self.extra,
            "rounds": self.rounds,
            "faults": faults,
        }

    def summary(self) -> dict[str, Any]:
        """This run alone, as a pooled cell lists it among its rounds."""
        figures = self.figures(None)
        kept = ("measured_at", "faults_recovered", "time_to_progress_s_median", "wall_s", "load_average_1m")
        # quiet_before: how long the machine was waited for before the run, and how busy it was
        return {key: figures.get(key) for key in (*kept, "params_sha256", "quiet_before")}


def pooled(runs: list[CellRun]) -> CellRun:
    """Several runs of one cell as one: their faults together, each marked with its round; the final parameters only
    where every run reached the same ones (a round that did not, says so in the notes); the standbys' memory and the
    save cost of the first run. One run is itself."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    cell = CellRun(first.system, first.fault, launched_at=first.launched_at, extra=dict(first.extra), load_average=[])
    for number, run in enumerate(runs, start=1):
        for record in run.records:
            cell.records.append(dataclasses.replace(record, extra={**record.extra, "round": number}))
        cell.notes += [f"round {number}: {note}" for note in run.notes]
        cell.load_average += run.load_average
        cell.rounds.append({"round": number, **run.summary()})
        if run.skipped:
            cell.skipped = run.skipped
    digests = {run.digest for run in runs}
    cell.digest = first.digest if len(digests) == 1 else None
    if len(digests) > 1:
        cell.notes.append(f"the rounds ended with different parameters: {sorted(str(d) for d in digests)}")
    walls = [run.finished_at - run.launched_at for run in runs if run.finished_at]
    cell.finished_at = first.launched_at + sum(walls) if len(walls) == len(runs) else None  # wall_s: the runs' sum
    return cell


def _median(values: list[float] | list[int]) -> float | None:
    return round(float(statistics.median(values)), 3) if values else None
