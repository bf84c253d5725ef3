"""The one clock: injected everywhere so tests control time."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


def utcnow() -> datetime:
    """The current time, UTC-aware."""
    return datetime.now(UTC)


class Clock(Protocol):
    """Wall time for records, monotonic time for durations, and sleeping."""

    def now(self) -> datetime: ...

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def now(self) -> datetime:
        """UTC-aware wall time."""
        return utcnow()

    def monotonic(self) -> float:
        """Seconds from an arbitrary, never-decreasing origin."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """Sleep on the event loop."""
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock that moves only when a test says so."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._mono = 0.0

    def now(self) -> datetime:
        """The frozen wall time."""
        return self._now

    def monotonic(self) -> float:
        """The frozen monotonic time."""
        return self._mono

    def advance(self, seconds: float) -> None:
        """Move both clocks forward."""
        self._now += timedelta(seconds=seconds)
        self._mono += seconds

    async def sleep(self, seconds: float) -> None:
        """Advance instead of waiting, yielding once to the loop."""
        self.advance(seconds)
        await asyncio.sleep(0)
