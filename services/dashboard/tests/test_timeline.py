"""The recovery timeline's geometry: bars proportional to time on one axis, visible when tiny, growing while running."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from reprise_dashboard.jobs.models import RecoveryRecord
from reprise_dashboard.jobs.timeline import Frame, layout, tick_step

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
FRAME = Frame(width=760, label_width=150, row_height=20, min_bar=2, max_ticks=6)  # 610 px of plot


def at(seconds: float) -> datetime:
    """T0 plus seconds."""
    return T0 + timedelta(seconds=seconds)


def recovery(*spans: tuple[str, float, float | None, int]) -> RecoveryRecord:
    """A recovery whose steps are (step, start, end, attempt) in seconds after T0."""
    steps: list[dict[str, Any]] = [
        {"step": name, "attempt": attempt, "started_at": at(start), "ended_at": None if end is None else at(end)}
        for name, start, end, attempt in spans
    ]
    return RecoveryRecord(id="rec-1", job_id="job-1", step=spans[-1][0], steps=steps, started_at=T0)


def test_bars_are_proportional_on_one_axis() -> None:
    timeline = layout(
        recovery(("detected", 0, 2, 1), ("stopping_ranks", 2, 5, 1), ("launching", 5, 10, 1)),
        now=at(60),
        frame=FRAME,
    )
    scale = 610 / 10
    assert [(b.step, b.row, b.y) for b in timeline.bars] == [
        ("detected", 0, 0),
        ("stopping_ranks", 1, 20),
        ("launching", 2, 40),
    ]
    assert [(b.x, b.width) for b in timeline.bars] == [
        pytest.approx((150, 2 * scale)),
        pytest.approx((150 + 2 * scale, 3 * scale)),
        pytest.approx((150 + 5 * scale, 5 * scale)),
    ]
    assert timeline.bars[-1].x + timeline.bars[-1].width == pytest.approx(760)  # the last step ends at the edge
    assert timeline.span_s == pytest.approx(10)
    assert timeline.height == 3 * 20 + FRAME.axis_height
    assert not any(b.running for b in timeline.bars)


def test_a_step_that_took_no_time_stays_visible_inside_the_frame() -> None:
    timeline = layout(recovery(("detected", 0, 4, 1), ("running", 4, 4, 1)), now=at(60), frame=FRAME)
    last = timeline.bars[-1]
    assert last.width == FRAME.min_bar
    assert last.x + last.width <= FRAME.width


def test_a_running_step_grows_to_now() -> None:
    timeline = layout(recovery(("detected", 0, 1, 1), ("verifying", 1, None, 1)), now=at(5), frame=FRAME)
    running = timeline.bars[-1]
    assert running.running and running.seconds == pytest.approx(4)
    assert timeline.span_s == pytest.approx(5)
    assert running.x + running.width == pytest.approx(760)


def test_retries_are_labelled_with_their_attempt() -> None:
    timeline = layout(recovery(("launching", 0, 1, 1), ("launching", 3, 4, 2)), now=at(5), frame=FRAME)
    assert [b.label for b in timeline.bars] == ["launching", "launching (attempt 2)"]


def test_ticks_are_nice_and_span_the_axis() -> None:
    timeline = layout(recovery(("detected", 0, 10, 1)), now=at(10), frame=FRAME)
    assert [t.seconds for t in timeline.ticks] == [0, 2, 4, 6, 8, 10]
    assert (timeline.ticks[0].x, timeline.ticks[-1].x) == pytest.approx((150, 760))


@pytest.mark.parametrize(
    ("span_s", "spacing"),
    [(0.5, 0.1), (10, 2), (45, 10), (600, 120), (3 * 3600, 1800), (100_000, 21_600)],
)
def test_tick_step(span_s: float, spacing: float) -> None:
    assert tick_step(span_s, 6) == spacing
    assert span_s / spacing <= 6


def test_a_recovery_without_steps_has_no_bars() -> None:
    empty = RecoveryRecord(id="rec-0", job_id="job-1", step="detected", started_at=T0)
    timeline = layout(empty, now=at(1), frame=FRAME)
    assert (timeline.bars, timeline.ticks, timeline.height) == ([], [], FRAME.axis_height)
