"""Live updates: incident and recovery changes from NATS, pushed to every open browser as server-sent events.

A core NATS subscription is enough: JetStream delivers each published message to plain subscribers of its subject
too, and a browser that missed something (the dashboard restarted, the connection dropped) reloads what it shows
when its event stream reconnects. Nothing here is stored or acknowledged.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import MalformedEventError
from reprise_common.events import IncidentChange, RecoveryChange, parse_event
from reprise_common.logging import get_logger

log = get_logger("reprise.dashboard.live")
STREAMS_OPEN = Gauge("reprise_dashboard_event_streams", "Browsers holding an /events stream")
PUSHED = Counter("reprise_dashboard_events_pushed_total", "Changes pushed to browsers, by topic", ["topic"])
QUEUE_SIZE = 256  # per browser; a browser this far behind loses the oldest changes (each one only asks to reload)


@dataclass(frozen=True)
class LiveMessage:
    """One change as a server-sent event: `event: <topic>`, the event id, the change as JSON."""

    topic: str
    event_id: str
    data: dict[str, Any]

    @classmethod
    def of(cls, event: IncidentChange | RecoveryChange) -> LiveMessage:
        """The message for an incident or recovery change."""
        topic = "incident" if isinstance(event, IncidentChange) else "recovery"
        return cls(topic=topic, event_id=event.event_id, data=event.model_dump(mode="json"))

    def render(self) -> str:
        """The text/event-stream frame."""
        return f"id: {self.event_id}\nevent: {self.topic}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n"


class LiveFeed:
    """Follows the changes on NATS and hands each to every subscribed stream."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[LiveMessage | None]] = set()
        self._subscriptions: list[Any] = []
        self.following = asyncio.Event()

    async def start(self, bus: Bus) -> None:
        """Subscribe to every incident and recovery change (the client restores subscriptions after a reconnect)."""
        for subject in (subjects.INCIDENTS_ALL, subjects.RECOVERIES_ALL):
            self._subscriptions.append(await bus.nc.subscribe(subject, cb=self._on_message))
        self.following.set()

    async def _on_message(self, msg: Any) -> None:
        try:
            event = parse_event(msg.data)
        except MalformedEventError as exc:  # a bad message must not end anyone's stream
            log.info("ignoring a malformed change", extra={"subject": msg.subject, "reason": exc.reason})
            return
        if isinstance(event, IncidentChange | RecoveryChange):
            self.push(LiveMessage.of(event))

    def push(self, message: LiveMessage) -> None:
        """Hand a message to every stream; a stream that is far behind drops its oldest message."""
        PUSHED.labels(message.topic).inc()
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(message)

    @contextmanager
    def subscribe(self) -> Iterator[asyncio.Queue[LiveMessage | None]]:
        """A queue of messages for one stream while the block runs."""
        queue: asyncio.Queue[LiveMessage | None] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._queues.add(queue)
        STREAMS_OPEN.inc()
        try:
            yield queue
        finally:
            self._queues.discard(queue)
            STREAMS_OPEN.dec()

    def close(self) -> None:
        """End every stream (each gets None)."""
        for queue in self._queues:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(None)

    async def following_check(self) -> bool:
        """Readiness: the subscriptions exist."""
        return self.following.is_set()


async def event_stream(feed: LiveFeed, *, keepalive_s: float) -> AsyncIterator[str]:
    """The body of GET /events: a retry hint, then each change, with a comment when idle so proxies keep it open."""
    with feed.subscribe() as queue:
        yield "retry: 2000\n: connected\n\n"
        while True:
            try:
                message = await asyncio.wait_for(queue.get(), timeout=keepalive_s)
            except TimeoutError:
                yield ": keepalive\n\n"
                continue
            if message is None:
                return
            yield message.render()
