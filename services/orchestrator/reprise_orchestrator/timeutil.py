"""Timestamps read back from SQL: SQLite drops the zone, every stored time is UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def as_utc(value: datetime) -> datetime:
    """The same instant, UTC-aware."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
