"""The geometry of a recovery's timeline chart: one bar per step on a shared time axis, drawn as inline SVG.

Positions are computed here (and tested) so the template only places rectangles and text.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from reprise_common.events import RecoveryStep
from reprise_dashboard.jobs.models import RecoveryRecord

NICE_STEPS_S = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200)


@dataclass(frozen=True)
class Frame:
    """The chart's size: a label column on the left, then the plot; one row per step."""

    width: float = 760.0
    label_width: float = 150.0
    row_height: float = 20.0
    axis_height: float = 22.0
    min_bar: float = 2.0  # a step that took no measurable time is still visible
    max_ticks: int = 6

    @property
    def plot_width(self) -> float:
        """The width of the time axis."""
        return self.width - self.label_width


@dataclass(frozen=True)
class Bar:
    """One step drawn as a rectangle."""

    step: RecoveryStep
    attempt: int
    row: int
    x: float
    y: float
    width: float
    seconds: float
    running: bool  # the step has not ended: its bar grows to now

    @property
    def label(self) -> str:
        """The row's label: the step, and its attempt when it is a retry."""
        return self.step.value.replace("_", " ") + (f" (attempt {self.attempt})" if self.attempt > 1 else "")


@dataclass(frozen=True)
class Tick:
    """A mark on the time axis."""

    x: float
    seconds: float


@dataclass(frozen=True)
class Timeline:
    """Everything the SVG needs."""

    recovery_id: str
    frame: Frame
    bars: list[Bar]
    ticks: list[Tick]
    span_s: float

    @property
    def height(self) -> float:
        """The SVG's height: a row per step plus the axis."""
        return len(self.bars) * self.frame.row_height + self.frame.axis_height


def tick_step(span_s: float, max_ticks: int) -> float:
    """The smallest nice spacing that puts at most max_ticks marks on the span."""
    for candidate in NICE_STEPS_S:
        if span_s / candidate <= max_ticks:
            return float(candidate)
    return float(NICE_STEPS_S[-1] * (int(span_s / NICE_STEPS_S[-1] / max_ticks) + 1))


def layout(recovery: RecoveryRecord, *, now: datetime, frame: Frame | None = None) -> Timeline:
    """Bars and ticks for a recovery's steps; steps still running extend to now."""
    frame = frame or Frame()
    if not recovery.steps:
        return Timeline(recovery_id=recovery.id, frame=frame, bars=[], ticks=[], span_s=0.0)
    origin = min(s.started_at for s in recovery.steps)
    end = max(s.ended_at or now for s in recovery.steps)
    span = max((end - origin).total_seconds(), 0.001)
    scale = frame.plot_width / span
    bars = []
    for row, step in enumerate(recovery.steps):
        offset = max(0.0, (step.started_at - origin).total_seconds())
        seconds = step.seconds(now)
        x = min(frame.label_width + offset * scale, frame.width - frame.min_bar)
        width = min(max(frame.min_bar, seconds * scale), frame.width - x)
        bars.append(
            Bar(
                step=step.step,
                attempt=step.attempt,
                row=row,
                x=round(x, 2),
                y=row * frame.row_height,
                width=round(width, 2),
                seconds=seconds,
                running=step.ended_at is None,
            )
        )
    spacing = tick_step(span, frame.max_ticks)
    count = int(span / spacing + 1e-9) + 1
    ticks = [Tick(x=round(frame.label_width + i * spacing * scale, 2), seconds=i * spacing) for i in range(count)]
    return Timeline(recovery_id=recovery.id, frame=frame, bars=bars, ticks=ticks, span_s=span)
