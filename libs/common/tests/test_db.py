"""Bulk inserts as multi-row statements store what SQLAlchemy's own executemany stores, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import JSON, Boolean, Column, Integer, MetaData, String, Table, insert, select
from sqlalchemy.exc import IntegrityError

from reprise_common import db
from reprise_common.db import UTCDateTime, insert_rows, make_engine

METADATA = MetaData()
ROWS = Table(
    "bulk_rows",
    METADATA,
    Column("id", String(32), primary_key=True),
    Column("at", UTCDateTime, nullable=True),
    Column("flag", Boolean, nullable=False),
    Column("count", Integer, nullable=True),
    Column("extra", JSON, nullable=True),
    Column("note", String(64), nullable=False),
)
WHEN = datetime(2026, 11, 30, 7, 0, 0, 250_000, tzinfo=UTC)


def _rows(prefix: str, count: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{prefix}{n}",
            "at": None if n % 5 == 0 else WHEN + timedelta(seconds=n),
            "flag": n % 2 == 0,
            "count": None if n % 3 == 0 else n,
            "extra": None if n % 4 == 0 else {"n": n, "tags": ["a", "b"]},
            "note": f"it's row {n} ?%s",  # placeholder-like text is a value, never SQL
        }
        for n in range(count)
    ]


@pytest.mark.parametrize("count", [1, 7, 2500])
def test_multi_row_inserts_store_what_an_executemany_stores(database_url: str, count: int) -> None:
    engine = make_engine(database_url)
    METADATA.create_all(engine)
    with engine.begin() as connection:
        connection.execute(insert(ROWS), _rows("a", count))
        insert_rows(connection, ROWS, _rows("b", count))
    with engine.connect() as connection:
        stored = {row.id: row._asdict() for row in connection.execute(select(ROWS))}
    engine.dispose()
    assert len(stored) == 2 * count
    for n in range(count):
        assert {**stored[f"b{n}"], "id": None} == {**stored[f"a{n}"], "id": None}
    assert stored[f"b{count - 1}"]["note"].endswith("?%s")


def test_rows_beyond_one_statements_limit_are_split(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(db.MAX_BOUND_VALUES, "sqlite", 20)  # 3 rows of 6 values per statement
    engine = make_engine(sqlite_url)
    METADATA.create_all(engine)
    with engine.begin() as connection:
        insert_rows(connection, ROWS, _rows("c", 10))
    with engine.connect() as connection:
        assert sorted(connection.execute(select(ROWS.c.id)).scalars()) == sorted(f"c{n}" for n in range(10))
    engine.dispose()


def test_a_duplicate_key_fails_the_whole_insert(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    METADATA.create_all(engine)
    with pytest.raises(IntegrityError), engine.begin() as connection:
        insert_rows(connection, ROWS, _rows("d", 3) + _rows("d", 1))
    with engine.connect() as connection:
        assert connection.execute(select(ROWS.c.id)).all() == []
    engine.dispose()
