"""The registry's engines and schema: Alembic migrations at start, and SQLite writes that never see "locked"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from reprise_common.db import make_engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# SQLModel keeps every service's tables in one metadata; the registry's migrations own only these.
TABLES = frozenset(
    {"checkpoints", "checkpoint_files", "checkpoint_ranks", "checkpoint_pins", "checkpoint_events", "job_world_sizes"}
)


def owned(item: Any, name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
    """Alembic's include_object filter: the registry's tables and what belongs to them, nothing else."""
    if type_ == "table":
        return name in TABLES
    table = getattr(item, "table", None)
    return table is None or table.name in TABLES


def make_write_engine(url: str) -> Engine:
    """An engine for transactions that write.

    On SQLite a deferred transaction that reads and then writes fails at once with "database is locked" when another
    writer committed in between (the busy timeout cannot help: the read snapshot is stale). Starting every write
    transaction with BEGIN IMMEDIATE takes the write lock first, so writers queue on the busy timeout instead.
    """
    engine = make_engine(url)
    if engine.dialect.name != "sqlite":
        return engine

    @event.listens_for(engine, "connect")
    def _no_implicit_begin(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver must not open its own deferred transaction

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration, built in code (no alembic.ini to ship or find)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (idempotent); run at every start instead of create_all."""
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Take the schema back to `revision` (tests and operators rolling back a release)."""
    with engine.begin() as connection:
        command.downgrade(alembic_config(connection), revision)
