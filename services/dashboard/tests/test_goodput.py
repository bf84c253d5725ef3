"""Goodput so far, computed from a job's recoveries: table-driven, times relative to the job's submission."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from reprise_dashboard.jobs.goodput import goodput, merged_seconds
from reprise_dashboard.jobs.models import JobRecord, RecoveryRecord

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    """T0 plus seconds."""
    return T0 + timedelta(seconds=seconds)


def job(state: str = "running", *, updated: float = 0.0) -> JobRecord:
    """A job submitted at T0."""
    return JobRecord(id="job-1", name="train", state=state, created_at=T0, updated_at=at(updated))


def recovery(*spans: tuple[str, float, float | None], finished: float | None = None) -> RecoveryRecord:
    """A recovery whose steps are (step, start, end) in seconds after T0; its step is the last one's."""
    steps: list[dict[str, Any]] = [
        {"step": name, "started_at": at(start), "ended_at": None if end is None else at(end)}
        for name, start, end in spans
    ]
    return RecoveryRecord(
        id=f"rec-{spans[0][1]}",
        job_id="job-1",
        step=spans[-1][0],
        steps=steps,
        started_at=at(spans[0][1]),
        finished_at=None if finished is None else at(finished),
    )


RECOVERED_100_160 = recovery(
    ("detected", 100, 101), ("locked", 101, 101.5), ("stopping_ranks", 101.5, 110), ("launching", 110, 150),
    ("verifying", 150, 160), ("running", 160, 160), finished=160,
)  # fmt: skip

CASES = [
    pytest.param(job(), [], 600, (600, 0), 1.0, id="no recovery: all of the wall time is goodput"),
    pytest.param(job(), [RECOVERED_100_160], 600, (600, 60), 0.9, id="a recovery from first symptom to running"),
    pytest.param(
        job("recovering"),
        [recovery(("detected", 500, 501), ("stopping_ranks", 501, None))],
        600,
        (600, 100),
        500 / 600,
        id="a recovery under way counts until now",
    ),
    pytest.param(
        job("failed", updated=300),
        [recovery(("detected", 200, 201), ("failed", 250, 250), finished=250)],
        1000,
        (300, 100),
        200 / 300,
        id="a failed job's wall time stops at its end, and the failed recovery runs to it",
    ),
    pytest.param(
        job("held", updated=210),
        [recovery(("detected", 200, 201), ("held", 210, 210), finished=210)],
        600,
        (600, 400),
        200 / 600,
        id="a recovery that holds the job for a human keeps it down until now",
    ),
    pytest.param(
        job(),
        [RECOVERED_100_160, recovery(("detected", 150, 151), ("running", 200, 200), finished=200)],
        600,
        (600, 100),
        500 / 600,
        id="overlapping recoveries count once",
    ),
    pytest.param(
        job(),
        [recovery(("detected", -30, 1), ("running", 20, 20), finished=20)],
        100,
        (100, 20),
        0.8,
        id="a first symptom before the submission is clipped to it",
    ),
]


@pytest.mark.parametrize(("record", "recoveries", "now", "expected", "ratio"), CASES)
def test_goodput(
    record: JobRecord,
    recoveries: list[RecoveryRecord],
    now: float,
    expected: tuple[float, float],
    ratio: float,
) -> None:
    found = goodput(record, recoveries, now=at(now))
    assert (found.wall_s, found.downtime_s) == pytest.approx(expected)
    assert found.ratio == pytest.approx(ratio)


def test_no_wall_time_has_no_ratio() -> None:
    assert goodput(job(), [], now=T0).ratio is None


def test_merged_seconds_unions_and_clips() -> None:
    spans = [(at(0), at(10)), (at(5), at(15)), (at(20), at(30)), (at(40), at(50))]
    assert merged_seconds(spans, lo=at(2), hi=at(45)) == pytest.approx(13 + 10 + 5)
    assert merged_seconds([(at(10), at(5))], lo=at(0), hi=at(100)) == 0.0  # an inverted span is no downtime
