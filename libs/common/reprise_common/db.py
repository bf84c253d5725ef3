"""SQL engines for services that keep state: SQLite by default (WAL, busy timeout), PostgreSQL at scale; and a
session per request for their routes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import JSON, DateTime, Table, event, func, text
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.types import TypeDecorator
from sqlmodel import Session, SQLModel, col, create_engine, select
from sqlmodel.sql.expression import SelectOfScalar

SQLITE_BUSY_TIMEOUT_MS = 30_000
# The widest integer SQLite (INTEGER) and PostgreSQL (BIGINT) store: every id, offset and count a request carries is
# bounded by it, so a larger one is a 422 naming the field rather than an overflow in the driver (a 500).
SQL_INT_MAX = 2**63 - 1
# Bound values per INSERT statement: SQLite allows 32,766 since 3.32 (999 before), PostgreSQL 65,535.
MAX_BOUND_VALUES = {"sqlite": 32_766, "postgresql": 65_535}
SQLITE_OLD_MAX_BOUND_VALUES = 999
# Connections per engine: request handlers (threads) may hold at most REQUEST_SESSIONS of them at once, so the event
# loop's own database work (a service's consumers, its reconciler) always finds one free and never waits on the pool.
POOL_SIZE, POOL_OVERFLOW = 10, 20
REQUEST_SESSIONS = 16
_UNSET = object()


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware timestamp stored in UTC; SQLite keeps no zone, so values read back are marked UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        """Refuse naive times; store UTC (without a zone on SQLite, which cannot keep one)."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: Reprise stores UTC-aware timestamps only")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        """Every timestamp read back is UTC-aware."""
        if value is None:
            return None
        stamp: datetime = value
        return stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp.astimezone(UTC)


class TypedJSON(TypeDecorator[Any]):
    """A JSON column that holds one pydantic type: checked and written as JSON, read back as that type (never as bare
    dicts read by key). The schema sees plain JSON, so changing a column to it needs no migration."""

    impl = JSON
    cache_ok = True

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model  # named as the parameter: SQLAlchemy builds the statement cache key from it
        self._adapter: TypeAdapter[Any] = TypeAdapter(model)

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        """Validate plain values (models of the type are valid already) and dump to JSON-compatible values."""
        if value is None:
            return None
        if not _built(value):
            value = self._adapter.validate_python(value)
        return self._adapter.dump_python(value, mode="json")

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        """Parse the stored JSON back into the type."""
        return None if value is None else self._adapter.validate_python(value)


def _built(value: Any) -> bool:
    """True for a pydantic model, or a list of them: what the code built is valid already (a dict may not be)."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(item, BaseModel) for item in value)
    return isinstance(value, BaseModel)


def normalise_url(url: str) -> str:
    """Use the psycopg 3 driver for plain postgresql:// URLs."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def make_engine(url: str) -> Engine:
    """An engine for the URL; SQLite files get their directory created and concurrency-friendly pragmas."""
    url = normalise_url(url)
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=POOL_SIZE,
            max_overflow=POOL_OVERFLOW,
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with Session(engine) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def get_engine(request: Request) -> Engine:
    """The service's engine (its app's `state.engine`), for a route."""
    engine: Engine = request.app.state.engine
    return engine


def get_session(engine: Annotated[Engine, Depends(get_engine)]) -> Iterator[Session]:
    """A database session for one request."""
    with session_scope(engine) as session:
        yield session


# The session closes when the handler returns, before the answer is sent (sending waits for the event loop, which must
# never wait for a connection a finished handler still holds), and at most REQUEST_SESSIONS handlers hold one at once.
SessionDep = Annotated[Session, Depends(get_session, scope="function", max_concurrency=REQUEST_SESSIONS)]


def db_check(engine: Engine) -> Callable[[], Awaitable[bool]]:
    """Readiness check: the database answers SELECT 1."""

    def ping() -> bool:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True

    async def check() -> bool:
        return await asyncio.to_thread(ping)

    return check


Row = TypeVar("Row")


def page_newest_first(
    session: Session, query: SelectOfScalar[Row], *, newest: Any, tiebreak: Any, offset: int, limit: int
) -> tuple[list[Row], int]:
    """One page of a filtered query, newest first (ties in a stable order), and how many rows match in all."""
    count = session.exec(select(func.count()).select_from(query.subquery())).one()
    page = query.order_by(col(newest).desc(), col(tiebreak)).offset(offset).limit(limit)
    return list(session.exec(page).all()), int(count)


def _converted(column: list[Any], process: Callable[[Any], Any] | None) -> list[Any]:
    """A column's values as the driver takes them; a value shared by consecutive rows (the time a batch was received)
    is converted once."""
    if process is None:
        return column
    out: list[Any] = []
    last, converted = _UNSET, None
    for value in column:
        if value is not last:
            last, converted = value, process(value)
        out.append(converted)
    return out


def insert_rows(connection: Connection, target: Table | type[SQLModel], rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert many rows (the same keys in each) as a few multi-row INSERT statements.

    Each value goes through its column type's bind processing, as SQLAlchemy's own executemany would do it, but the
    statement is built once per chunk rather than its parameters once per row, and the driver runs one statement per
    chunk instead of one step per row (SQLite's driver lets go of the GIL at every step: in a thread beside a busy
    event loop each step can wait a switch interval to get it back). IntegrityError as any INSERT. Columns with a
    default computed in Python must be given in the rows.
    """
    if not rows:
        return
    table: Table = target if isinstance(target, Table) else target.__table__  # type: ignore[attr-defined]
    dialect = connection.dialect
    names = list(rows[0])
    unset = [c.name for c in table.columns if c.name not in rows[0] and c.default is not None]
    if unset:  # SQLAlchemy fills those in Python; a hand-built statement would leave them to the database
        raise ValueError(f"insert_rows needs a value for {', '.join(unset)} in every row (they have defaults)")
    processors = [table.c[name].type.dialect_impl(dialect).bind_processor(dialect) for name in names]
    marker = {"qmark": "?", "format": "%s", "pyformat": "%s"}[dialect.paramstyle or "qmark"]
    limit = MAX_BOUND_VALUES.get(dialect.name, SQLITE_OLD_MAX_BOUND_VALUES)
    if dialect.name == "sqlite" and dialect.dbapi is not None and dialect.dbapi.sqlite_version_info < (3, 32):
        limit = SQLITE_OLD_MAX_BOUND_VALUES
    per_statement = max(1, limit // len(names))
    preparer = dialect.identifier_preparer
    quoted = ", ".join(preparer.quote(name) for name in names)
    head = f"INSERT INTO {preparer.format_table(table)} ({quoted}) VALUES "  # noqa: S608 - quoted names, bound values
    one = "(" + ", ".join([marker] * len(names)) + ")"
    for start in range(0, len(rows), per_statement):
        chunk = rows[start : start + per_statement]
        columns = [
            _converted([row[name] for row in chunk], process) for name, process in zip(names, processors, strict=True)
        ]
        values = [value for row in zip(*columns, strict=True) for value in row]
        connection.exec_driver_sql(head + ", ".join([one] * len(chunk)), tuple(values))
