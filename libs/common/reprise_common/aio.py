"""Small asyncio helpers shared by services and tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def poll_until(predicate: Callable[[], object], *, timeout_s: float, interval_s: float = 0.02) -> bool:
    """Check predicate until it holds or timeout_s passes; True when it held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return bool(predicate())
