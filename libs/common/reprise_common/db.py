"""SQL engines for services that keep state: SQLite by default (WAL, busy timeout), PostgreSQL at scale."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import DateTime, event, func, text
from sqlalchemy.engine import Dialect, Engine
from sqlalchemy.types import TypeDecorator
from sqlmodel import Session, col, create_engine, select
from sqlmodel.sql.expression import SelectOfScalar

SQLITE_BUSY_TIMEOUT_MS = 30_000


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
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


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
