"""The demo's timeline picture: rank 0's step over time, the faults, and each recovery's phases (PNG, Agg)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from reprise_cli.demo.models import DemoRun, FaultRun

# Recovery steps drawn as one phase each (the short bookkeeping steps join the stop).
BOOKKEEPING = ("detected", "locked", "stopping_ranks", "isolating", "placing", "restoring")
PHASES: list[tuple[str, tuple[str, ...], str]] = [
    ("detection (fault → incident)", (), "#f4a261"),
    ("stop, isolate, place, restore", BOOKKEEPING, "#e76f51"),
    ("launch", ("launching",), "#9b5de5"),
    ("verify (ranks start, pass the checkpoint)", ("verifying",), "#2a9d8f"),
]


def _x(at: datetime | str, origin: datetime) -> float:
    moment = datetime.fromisoformat(at) if isinstance(at, str) else at
    return (moment - origin).total_seconds()


def _phase_spans(fault: FaultRun, origin: datetime) -> list[tuple[int, float, float]]:
    """(phase index, start, end) in seconds since origin, for one fault's detection and recovery steps."""
    spans: list[tuple[int, float, float]] = []
    opened = (fault.incident or {}).get("opened_at")
    if opened:
        spans.append((0, _x(fault.injected_at, origin), _x(opened, origin)))
    for step in (fault.recovery or {}).get("steps", []):
        if step.get("ended_at") is None:
            continue
        index = next((i for i, (_, names, _c) in enumerate(PHASES) if step["step"] in names), None)
        if index is not None:
            spans.append((index, _x(step["started_at"], origin), _x(step["ended_at"], origin)))
    return spans


def _recovery_span(recovery: dict[str, Any], origin: datetime) -> tuple[float, float]:
    """From a recovery's first symptom to its last step's end, in seconds since origin."""
    steps = recovery.get("steps") or [{"started_at": recovery["started_at"], "ended_at": recovery["finished_at"]}]
    ends = [s.get("ended_at") or s["started_at"] for s in steps]
    return _x(steps[0]["started_at"], origin), max(_x(e, origin) for e in ends)


def draw(run: DemoRun, path: Path) -> Path:
    """Write the timeline PNG to path and return it."""
    origin = run.submitted_at
    figure = Figure(figsize=(13, 5.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    _draw_steps(axes, run, origin)
    _draw_faults(axes, run.faults, origin)
    for number, recovery in enumerate(run.unplanned):
        start, end = _recovery_span(recovery, origin)
        label = "unplanned recovery (no injected fault)" if number == 0 else None
        axes.axvspan(start, end, facecolor="none", edgecolor="#6c757d", hatch="//", label=label, linewidth=0)
    if run.finished_at is not None:
        axes.axvline(_x(run.finished_at, origin), color="#2a9d8f", linewidth=1.0, linestyle=":")
    verdict = "equal to" if run.params_equal else "DIFFERENT from"
    axes.set_title(
        f"Reprise demo, {origin:%Y-%m-%d %H:%M} UTC: {len(run.faults)} fault{'' if len(run.faults) == 1 else 's'}; "
        f"final parameters {verdict} the fault-free reference",
        fontsize=10,
    )
    axes.set_xlabel("seconds since the job was submitted")
    axes.set_ylabel("training step (rank 0)")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def _draw_steps(axes: Axes, run: DemoRun, origin: datetime) -> None:
    """Rank 0's step over time, one line per restart epoch."""
    epochs = sorted({s.epoch for s in run.samples})
    for epoch in epochs:
        points = [(_x(s.at, origin), s.step) for s in run.samples if s.epoch == epoch and s.step is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, color="#264653", linewidth=1.8, label="rank 0's step" if epoch == epochs[0] else None)


def _draw_faults(axes: Axes, faults: list[FaultRun], origin: datetime) -> None:
    """Each injected fault: its detection and recovery phases, a dashed line where it struck, and its label."""
    labelled: set[int] = set()
    for number, fault in enumerate(faults, start=1):
        for index, start, end in _phase_spans(fault, origin):
            label = PHASES[index][0] if index not in labelled else None
            labelled.add(index)
            axes.axvspan(start, max(end, start + 0.05), color=PHASES[index][2], alpha=0.35, label=label, linewidth=0)
        at = _x(fault.injected_at, origin)
        axes.axvline(at, color="#d62828", linewidth=1.2, linestyle="--")
        axes.annotate(
            f"{number}. {fault.plan.fault}\n{fault.node_id}",
            xy=(at, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -4),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="#d62828",
        )
