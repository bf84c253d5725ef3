"""Which earlier recovery a late symptom belongs to: the newest that relaunched the job after the symptom, if any."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.clock import utcnow
from reprise_common.db import make_engine
from reprise_orchestrator import schema
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import JobCreate
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.models import Recovery, RecoveryStep

T0 = utcnow()


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def recoveries(database_url: str) -> Iterator[tuple[Engine, str]]:
    """A job with three recoveries: relaunched at +10 s, relaunched at +20 s, and the newest, not launched yet."""
    engine = make_engine(database_url)
    schema.upgrade(engine)
    with Session(engine) as session:
        spec = JobCreate(name="j", node_count=1, command=["true"])
        job = jobs.create(session, spec=spec, placement=[{"rank": 0, "node_id": "n", "gpu": 0}])
        launched = {"r1": 10, "r2": 20, "r3": None}
        for index, (recovery_id, at) in enumerate(launched.items()):
            steps = [{"step": RecoveryStep.DETECTED, "started_at": _at(5 + 10 * index).isoformat()}]
            if at is not None:
                steps.append({"step": RecoveryStep.LAUNCHING, "started_at": _at(at).isoformat()})
            recovery = Recovery(
                id=recovery_id, job_id=job.id, fence=index + 1, owner="o", steps=steps, started_at=_at(5 + 10 * index)
            )
            session.add(recovery)
        session.commit()
        yield engine, job.id
    engine.dispose()


@pytest.mark.parametrize(
    ("symptom_s", "covered_by"),
    [
        (19.0, "r2"),  # from the ranks r2 relaunched: not a new fault
        (3.0, "r2"),  # older still: the newest relaunch after it is r2's
        (21.0, None),  # after the newest relaunch: a new fault (r3 has not launched anything yet)
    ],
)
def test_a_late_symptom_belongs_to_the_newest_relaunch_after_it(
    recoveries: tuple[Engine, str], symptom_s: float, covered_by: str | None
) -> None:
    engine, job = recoveries
    with Session(engine) as session:
        found = service.covering(session, job_id=job, symptom_at=_at(symptom_s))
        assert (found.id if found is not None else None) == covered_by
