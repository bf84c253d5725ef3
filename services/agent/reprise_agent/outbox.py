"""Bounded buffering of discrete events while NATS is unreachable; the oldest is dropped (and counted) when full."""

from __future__ import annotations

import asyncio
from collections import deque

from prometheus_client import Counter, Gauge

from reprise_common.aio import poll_until
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.events import Event

OUTBOX_DROPPED = Counter("reprise_agent_outbox_dropped_total", "Events dropped because the outbox was full")
OUTBOX_DEPTH = Gauge("reprise_agent_outbox_depth", "Events waiting to be published")


class Outbox:
    """Publishes events in order; a failed publish is retried with the same message id (deduplicated)."""

    def __init__(self, bus: Bus, *, capacity: int, retry_s: float = 0.5) -> None:
        self.bus = bus
        self.retry_s = retry_s
        self._queue: deque[tuple[str, Event]] = deque()
        self.capacity = capacity
        self.dropped = 0
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, subject: str, event: Event) -> None:
        """Queue an event for publishing (never blocks)."""
        if len(self._queue) >= self.capacity:
            self._queue.popleft()
            self.dropped += 1
            OUTBOX_DROPPED.inc()
        self._queue.append((subject, event))
        OUTBOX_DEPTH.set(len(self._queue))
        self._wake.set()

    async def run(self) -> None:
        """Publish until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                subject, event = self._queue[0]
                try:
                    await self.bus.publish(subject, event)
                except BusError:
                    await asyncio.sleep(self.retry_s)
                    continue
                self._queue.popleft()
                OUTBOX_DEPTH.set(len(self._queue))

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued is published (or the timeout passes); True when empty."""
        return await poll_until(lambda: not self._queue, timeout_s=timeout_s)
