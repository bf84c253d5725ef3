"""Every service's migrations build exactly the schema its models describe, on SQLite and PostgreSQL, up, down and up
again; a database whose tables a service made before it had migrations is adopted; all services share one database,
each touching only its own tables and keeping its revision in its own version table."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import inspect
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from reprise_common.db import make_engine
from reprise_common.migrations import Migrations
from reprise_detector import schema as detector_schema
from reprise_detector.app import create_app as detector_app  # noqa: F401 - each app imports its table models
from reprise_notifier import schema as notifier_schema
from reprise_notifier.app import create_app as notifier_app  # noqa: F401
from reprise_orchestrator import schema as orchestrator_schema
from reprise_orchestrator.app import create_app as orchestrator_app  # noqa: F401
from reprise_registry import db as registry_db
from reprise_registry.app import create_app as registry_app  # noqa: F401

SERVICES: dict[str, Migrations] = {
    "registry": registry_db.MIGRATIONS,
    "detector": detector_schema.MIGRATIONS,
    "orchestrator": orchestrator_schema.MIGRATIONS,
    "notifier": notifier_schema.MIGRATIONS,
}


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def _revision(engine: Engine, migrations: Migrations) -> str:
    with engine.connect() as connection:
        return str(connection.exec_driver_sql(f"SELECT version_num FROM {migrations.version_table}").scalar_one())


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    found = make_engine(database_url)
    yield found
    found.dispose()


def test_each_service_has_its_own_version_table() -> None:
    assert len({m.version_table for m in SERVICES.values()}) == len(SERVICES)
    owned = [table for m in SERVICES.values() for table in m.tables]
    assert len(owned) == len(set(owned))  # no table belongs to two services


@pytest.mark.parametrize("service", SERVICES)
def test_upgrade_builds_the_models_schema_and_downgrade_removes_it(engine: Engine, service: str) -> None:
    migrations = SERVICES[service]
    migrations.upgrade(engine)
    migrations.upgrade(engine)  # a second start finds nothing to do
    assert _tables(engine) == migrations.tables | {migrations.version_table}
    assert _revision(engine, migrations) == migrations.head()
    drift = migrations.drift(engine, SQLModel.metadata)
    assert drift == [], f"models and migrations differ: {drift}"
    migrations.downgrade(engine, "base")
    assert _tables(engine) == {migrations.version_table}
    migrations.upgrade(engine)  # on PostgreSQL this fails if the downgrade left types (enums) behind
    assert migrations.tables <= _tables(engine)


@pytest.mark.parametrize("service", ["detector", "orchestrator", "notifier"])  # the registry always had migrations
def test_a_database_made_before_migrations_is_adopted(engine: Engine, service: str) -> None:
    migrations = SERVICES[service]
    # What the release before migrations made: the baseline's tables (it describes exactly those), no version table.
    migrations.upgrade(engine, migrations.baseline)
    with engine.begin() as connection:
        connection.exec_driver_sql(f"DROP TABLE {migrations.version_table}")
    migrations.upgrade(engine)  # without the stamp this would fail: the baseline's tables already exist
    assert _revision(engine, migrations) == migrations.head()
    assert migrations.drift(engine, SQLModel.metadata) == []


def test_every_service_shares_one_database(engine: Engine) -> None:
    for migrations in SERVICES.values():
        migrations.upgrade(engine)
    for migrations in SERVICES.values():
        assert migrations.tables | {migrations.version_table} <= _tables(engine)
        assert migrations.drift(engine, SQLModel.metadata) == []
    SERVICES["detector"].downgrade(engine, "base")  # takes only its own tables away
    assert not SERVICES["detector"].tables & _tables(engine)
    for name in ("registry", "orchestrator", "notifier"):
        assert SERVICES[name].tables <= _tables(engine)
        assert SERVICES[name].drift(engine, SQLModel.metadata) == []


def test_every_recovery_outcome_can_be_stored(engine: Engine) -> None:
    """The outcome column's database type holds every member of the enum (PostgreSQL keeps the type's own list)."""
    from sqlmodel import Session, select

    from reprise_orchestrator.jobs.models import Job
    from reprise_orchestrator.recoveries.models import Outcome, Recovery

    orchestrator_schema.MIGRATIONS.upgrade(engine)
    with Session(engine) as session:
        session.add(Job(id="job-1", name="j", spec={"nodes": ["n"], "command": ["x"]}))
        session.commit()
        for index, outcome in enumerate(Outcome):
            session.add(Recovery(id=f"r-{index}", job_id="job-1", fence=index, owner="o", outcome=outcome))
            session.commit()
        stored = {r.outcome for r in session.exec(select(Recovery)).all()}
    assert stored == set(Outcome)
