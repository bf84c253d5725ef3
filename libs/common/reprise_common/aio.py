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


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that a library turned into another error.

    A client may turn a cancel that lands in its socket read into its own timeout or connection error (redis-py does):
    code that catches such errors and goes on (a retry, a loop that survives a failed pass) calls this first, or the
    task it runs in never stops and whoever awaits its cancellation (a service's shutdown) waits for ever.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
