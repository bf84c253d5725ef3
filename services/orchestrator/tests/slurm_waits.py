"""Waiting on a real Slurm cluster in tests: read until a reading holds, with a bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(read: Callable[[], Awaitable[T]], holds: Callable[[T], bool], *, timeout_s: float = 30.0) -> T:
    """Read until `holds` says yes; the last reading either way (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    value = await read()
    while not holds(value) and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        value = await read()
    return value
