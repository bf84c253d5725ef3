"""Schema migrations with Alembic, one set per service, run at every start instead of `create_all`.

A service keeps its revisions in `<package>/migrations/` (`env.py`, `script.py.mako`, `versions/`), describes them
with a `Migrations` (the folder, the tables it owns, its version table) and calls `upgrade(engine)` when it starts.
Services may share one database: each set creates, alters and compares only its own tables and records its revision
in a version table of its own. A database made before its service had migrations (the service's tables created by
`create_all`, no version table) is taken to be at the baseline revision, which describes exactly those tables, and is
upgraded from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData, inspect
from sqlalchemy.engine import Connection, Engine


@dataclass(frozen=True)
class Migrations:
    """One service's migrations: where its revisions live, the tables they own, where its revision is recorded."""

    directory: Path
    tables: frozenset[str]
    version_table: str = "alembic_version"
    baseline: str = "0001"  # the revision a database made by create_all before migrations existed is at

    def owns(self, item: Any, name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
        """Alembic's include_object filter: this service's tables and what belongs to them, nothing else."""
        if type_ == "table":
            return name in self.tables
        table = getattr(item, "table", None)
        return table is None or table.name in self.tables

    def config(self, connection: Connection | None = None) -> Config:
        """Alembic's configuration, built in code (no alembic.ini to ship or find)."""
        config = Config()
        config.set_main_option("script_location", str(self.directory))
        config.attributes["connection"] = connection
        return config

    def upgrade(self, engine: Engine, revision: str = "head") -> None:
        """Bring this service's tables to `revision` (idempotent): what a service does at every start."""
        with _migrating(engine) as connection:
            config = self.config(connection)
            if self._made_by_create_all(connection):
                command.stamp(config, self.baseline)
            command.upgrade(config, revision)

    def head(self) -> str:
        """The newest revision: where `upgrade` brings the tables."""
        head = ScriptDirectory.from_config(self.config()).get_current_head()
        if head is None:
            raise RuntimeError(f"no revisions in {self.directory}")
        return head

    def downgrade(self, engine: Engine, revision: str) -> None:
        """Take this service's tables back to `revision` (tests, and operators rolling back a release)."""
        with _migrating(engine) as connection:
            command.downgrade(self.config(connection), revision)

    def run(self, context: Any, metadata: MetaData) -> None:
        """The body of the service's `env.py` (`context`: the `alembic.context` it imports): migrate on the connection
        `upgrade`/`downgrade` handed over."""
        connection = context.config.attributes.get("connection")
        if connection is None:
            raise RuntimeError("run migrations through Migrations.upgrade(engine), which passes a connection")
        context.configure(connection=connection, target_metadata=metadata, **self._options(connection))
        with context.begin_transaction():
            context.run_migrations()

    def drift(self, engine: Engine, metadata: MetaData) -> list[Any]:
        """How this service's tables in the database differ from the models (empty: they match)."""
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts=self._options(connection))
            return list(compare_metadata(context, metadata))

    def _options(self, connection: Connection) -> dict[str, Any]:
        return {
            "render_as_batch": connection.dialect.name == "sqlite",  # SQLite alters a table by copying it
            "compare_type": True,
            "include_object": self.owns,
            "version_table": self.version_table,
        }

    def _made_by_create_all(self, connection: Connection) -> bool:
        existing = set(inspect(connection).get_table_names())
        return self.version_table not in existing and bool(existing & self.tables)


@contextmanager
def _migrating(engine: Engine) -> Iterator[Connection]:
    """A connection in a transaction for migrations. On SQLite, foreign keys are off while they run and checked
    before the commit: SQLite alters a table by copying it and dropping the old one, which with foreign keys on would
    delete (or refuse to delete) the rows that point at it."""
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        try:
            with connection.begin():
                yield connection
                if sqlite:
                    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"migrations left rows pointing at nothing: {broken[:5]}")
        finally:
            if sqlite:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()
