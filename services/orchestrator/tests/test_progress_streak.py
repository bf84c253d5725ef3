"""The guard against recoveries that get nowhere (`max_recoveries_without_progress`) counts only what Reprise can
see: a recovery restoring no newer checkpoint counts for a job that reports steps or checkpoints, and never for a
plain script that reports neither (it resumes from its own snapshot, which Reprise does not know of); the restoring
step's note says where such a job starts again. Run as the orchestrator runs it (RecoverySteps.restore) on SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.db import make_engine
from reprise_orchestrator import schema
from reprise_orchestrator.jobs import service as jobs
from reprise_orchestrator.jobs.models import Job, JobCreate
from reprise_orchestrator.locks import LockHandle
from reprise_orchestrator.recoveries.records import Baseline, Restored
from reprise_orchestrator.recoveries.run import RecoveryRun
from reprise_orchestrator.recoveries.steps import RecoverySteps
from reprise_orchestrator.registry_client import RestorePick, RestorePoint

from . import incidents
from .test_verify_signals import deps_of


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[Engine]:
    found = make_engine(sqlite_url)
    schema.upgrade(found)
    yield found
    found.dispose()


@dataclass
class Registry:
    """The registry's answer for the job: its newest validated checkpoint's step, or none."""

    step: int | None

    async def restore_point(self, job_id: str, *, before_step: int | None = None) -> RestorePick:
        if self.step is None:
            return RestorePick(point=None)
        return RestorePick(point=RestorePoint(checkpoint_id=1, step=self.step, path="/ckpt", digests_checked=True))

    async def pin(self, checkpoint_id: int, *, holder: str, ttl_s: float) -> bool:
        return True


def restore(engine: Engine, *, sdk_seen: bool, restores: int | None, streak: int, last: int | None) -> tuple[Job, str]:
    """One restoring step of a job whose last recovery restored `last` after `streak` without progress; the job as
    stored after it, and the step's note."""
    deps = deps_of(engine)
    deps.registry = Registry(restores)  # type: ignore[assignment]
    with Session(engine) as session:
        job = jobs.create(session, spec=JobCreate(name="j", node_count=1, command=["python", "train.py"]), placement=[])
    baseline = Baseline(sdk_seen=sdk_seen, no_progress_streak=streak, last_restore_step=last)
    run = RecoveryRun(LockHandle(job.id, "token", 1), "rec-1", job, incidents.incident(job_id=job.id), baseline)
    with Session(engine) as session:  # the job as the last recovery left it; this one holds its fence
        jobs.update_fenced(
            session, job_id=job.id, fence=0, max_fence=1, no_progress_streak=streak, last_restore_step=last
        )
    result = asyncio.run(RecoverySteps(deps).restore(run))
    assert isinstance(result.data, Restored)
    with Session(engine) as session:
        stored = session.get(Job, job.id)
        assert stored is not None
        return stored, result.data.note


def test_a_plain_script_without_checkpoints_never_counts_toward_the_no_progress_guard(engine: Engine) -> None:
    job, note = restore(engine, sdk_seen=False, restores=None, streak=2, last=None)
    assert job.no_progress_streak == 2  # four faults of a plain script are four recoveries, not a loop
    assert "where its script resumes" in note, note


def test_a_job_using_the_sdk_without_a_checkpoint_yet_counts_as_before(engine: Engine) -> None:
    job, note = restore(engine, sdk_seen=True, restores=None, streak=2, last=None)
    assert job.no_progress_streak == 3
    assert "restarts from its start" in note, note


@pytest.mark.parametrize(("restores", "last", "streak"), [(20, 10, 0), (10, 10, 3), (None, 10, 3)])
def test_a_plain_script_whose_checkpoints_reprise_knows_is_counted_by_them(
    engine: Engine, restores: int | None, last: int, streak: int
) -> None:
    job, _ = restore(engine, sdk_seen=False, restores=restores, streak=2, last=last)
    assert job.no_progress_streak == streak
