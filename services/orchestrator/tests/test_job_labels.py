"""Finding jobs by label: an index lookup in job_label, filled when a job is created and, for jobs stored before,
by the migration that made the table; on SQLite and PostgreSQL alike."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import insert
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from reprise_common.clock import utcnow
from reprise_common.db import make_engine
from reprise_common.events import RankAssignment
from reprise_orchestrator import schema
from reprise_orchestrator.jobs import service
from reprise_orchestrator.jobs.models import Job, JobCreate, JobLabel

ADDED_AFTER_0001 = {"reserved_nodes", "master_addr", "backend"}  # job columns of later revisions
JOBS = {
    "a": {"team": "ml", "example.com/tier": "gold", "empty": ""},
    "b": {"team": "web", "example.com/tier": "gold"},
    "c": {},
}


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """The orchestrator's tables with three jobs: a and b labelled, c without labels (as before labels existed)."""
    found = make_engine(database_url)
    schema.upgrade(found, "0001")  # jobs stored before labels had a table of their own: the upgrade copies them
    start = utcnow()
    with Session(found) as session:
        for index, (name, labels) in enumerate(JOBS.items()):
            spec = JobCreate(name=name, node_count=1, command=["true"], labels=labels).model_dump(mode="json")
            if not labels:
                del spec["labels"]  # a spec stored before jobs had labels
            job = Job(id=f"job-{name}", name=name, spec=spec, created_at=start + timedelta(seconds=index))
            row = {c.name: getattr(job, c.name) for c in Job.__table__.columns if c.name not in ADDED_AFTER_0001}
            session.execute(insert(Job.__table__).values(**row))  # the columns revision 0001 had, no more
        session.commit()
    schema.upgrade(found)
    yield found
    found.dispose()


@pytest.mark.parametrize(
    ("selectors", "names"),
    [
        ([], ["c", "b", "a"]),
        ([("team", "ml")], ["a"]),
        ([("example.com/tier", "gold")], ["b", "a"]),
        ([("example.com/tier", "gold"), ("team", "web")], ["b"]),
        ([("team", "ml"), ("team", "web")], []),
        ([("team", "m")], []),  # equality, not a prefix
        ([("team", "ML")], []),  # values are case-sensitive
        ([("empty", "")], ["a"]),
        ([("tier", "gold")], []),  # the prefix is part of the key
    ],
)
def test_label_filter(engine: Engine, selectors: list[tuple[str, str]], names: list[str]) -> None:
    with Session(engine) as session:
        found = service.get_all(session, labels=selectors)
        assert [job.name for job in found] == names
        assert all(job.labels == JOBS[job.name] for job in found)  # a spec without labels reads as none


def test_a_new_job_is_found_by_its_labels_and_a_discarded_one_leaves_none(engine: Engine) -> None:
    with Session(engine) as session:
        spec = JobCreate(name="d", node_count=1, command=["true"], labels={"team": "ml", "queue": "batch"})
        job = service.create(session, spec=spec, placement=[RankAssignment(rank=0, node_id="n", gpu=0, local_rank=0)])
        assert [j.name for j in service.get_all(session, labels=[("team", "ml"), ("queue", "batch")])] == ["d"]
        assert [j.name for j in service.get_all(session, labels=[("team", "ml")])] == ["d", "a"]
        service.discard(session, job)
        assert session.exec(select(JobLabel).where(JobLabel.job_id == job.id)).all() == []
        assert [j.name for j in service.get_all(session, labels=[("team", "ml")])] == ["a"]
