"""Which earlier recovery a late symptom belongs to: the newest that replaced the ranks it came from, if any.

By restart epoch when the symptom names one (a rank of an epoch older than the one a recovery launched was replaced
by it, however late its death was noticed), else by time (a symptom older than the newest relaunch).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.clock import utcnow
from reprise_common.db import make_engine
from reprise_common.events import Culprit, RankAssignment
from reprise_orchestrator import schema
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import JobCreate
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import Launched, StepRecord
from reprise_orchestrator.recoveries.states import RecoveryStep

from . import incidents

T0 = utcnow()


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _detected(at: datetime, job_id: str) -> StepRecord:
    incident = incidents.incident(
        incident_id="inc", job_id=job_id, culprit=Culprit(node_id="n", rank=0), first_symptom_at=at
    )
    return StepRecord(step=RecoveryStep.DETECTED, started_at=at, ended_at=at, data=incident)


@pytest.fixture
def recoveries(database_url: str) -> Iterator[tuple[Engine, str]]:
    """A job with three recoveries: epoch 1 launched at +10 s, epoch 2 at +20 s, and the newest, not launched yet."""
    engine = make_engine(database_url)
    schema.upgrade(engine)
    with Session(engine) as session:
        spec = JobCreate(name="j", node_count=1, command=["true"])
        job = jobs.create(session, spec=spec, placement=[RankAssignment(rank=0, node_id="n", gpu=0, local_rank=0)])
        launched = {"r1": 10, "r2": 20, "r3": None}
        for index, (recovery_id, at) in enumerate(launched.items()):
            steps = [_detected(_at(5 + 10 * index), job.id)]
            if at is not None:
                launch = Launched(restart_epoch=index + 1)
                steps.append(StepRecord(step=RecoveryStep.LAUNCHING, started_at=_at(at), ended_at=_at(at), data=launch))
            opened_at = _at(5 + 10 * index)
            recovery = Recovery(id=recovery_id, job_id=job.id, fence=index + 1, owner="o", started_at=opened_at)
            service.insert_claimed(session, recovery=recovery, steps=steps)
        session.commit()
        yield engine, job.id
    engine.dispose()


@pytest.mark.parametrize(
    ("symptom_s", "epoch", "covered_by"),
    [
        (19.0, None, "r2"),  # from the ranks r2 relaunched: not a new fault
        (3.0, None, "r2"),  # older still: the newest relaunch after it is r2's
        (21.0, None, None),  # after the newest relaunch: a new fault (r3 has not launched anything yet)
        (25.0, 1, "r2"),  # noticed after r2's relaunch, but a rank of epoch 1, which r2 replaced
        (25.0, 0, "r2"),  # older epochs too
        (25.0, 2, None),  # a rank r2 launched: a new fault
        (15.0, 2, None),  # by epoch even when its clock says earlier
    ],
)
def test_a_late_symptom_belongs_to_the_recovery_that_replaced_its_ranks(
    recoveries: tuple[Engine, str], symptom_s: float, epoch: int | None, covered_by: str | None
) -> None:
    engine, job = recoveries
    with Session(engine) as session:
        found = service.covering(session, job_id=job, symptom_at=_at(symptom_s), restart_epoch=epoch)
        assert (found.id if found is not None else None) == covered_by
