"""Alembic migrations build exactly the schema the models describe, on SQLite and PostgreSQL, up and down."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlmodel import SQLModel

from reprise_registry import db
from reprise_registry.app import create_app  # noqa: F401 - imports every table model

TABLES = {
    "checkpoints",
    "checkpoint_files",
    "checkpoint_ranks",
    "checkpoint_pins",
    "checkpoint_events",
    "job_world_sizes",
    "alembic_version",
}


def _drift(engine: object) -> list[object]:
    with engine.connect() as connection:  # type: ignore[attr-defined]
        context = MigrationContext.configure(connection, opts={"compare_type": True, "include_object": db.owned})
        return list(compare_metadata(context, SQLModel.metadata))


def test_upgrade_builds_the_models_schema_and_downgrade_removes_it(database_url: str) -> None:
    engine = db.make_write_engine(database_url)
    try:
        db.upgrade(engine)
        db.upgrade(engine)  # a second start finds nothing to do
        assert set(inspect(engine).get_table_names()) == TABLES
        drift = _drift(engine)
        assert drift == [], f"models and migrations differ: {drift}"
        db.downgrade(engine, "base")
        assert set(inspect(engine).get_table_names()) == {"alembic_version"}
        db.upgrade(engine)
        assert "checkpoints" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
