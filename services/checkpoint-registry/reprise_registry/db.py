"""The registry's engines and schema: Alembic migrations at start, and SQLite writes that never see "locked"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from reprise_common.db import make_engine
from reprise_common.migrations import Migrations

# SQLModel keeps every service's tables in one metadata; the registry's migrations own only these. Its revisions are
# recorded in Alembic's default version table (the registry had migrations first).
MIGRATIONS = Migrations(
    directory=Path(__file__).resolve().parent / "migrations",
    tables=frozenset(
        {
            "checkpoints",
            "checkpoint_files",
            "checkpoint_ranks",
            "checkpoint_pins",
            "checkpoint_events",
            "job_world_sizes",
        }
    ),
)
upgrade = MIGRATIONS.upgrade  # at every start, instead of create_all
downgrade = MIGRATIONS.downgrade


@dataclass(frozen=True)
class Engines:
    """Reads on one engine, writes on another (BEGIN IMMEDIATE on SQLite); the same engine on PostgreSQL."""

    read: Engine
    write: Engine


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
