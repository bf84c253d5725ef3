"""What one running notifier holds, shared by the lifespan, the consumers and the workers (the routes are handed
its engine and routing: reprise_common.db.SessionDep, deps.py)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from nats.js.api import DeliverPolicy
from sqlalchemy.engine import Engine

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.consumer import Consumer
from reprise_common.db import session_scope
from reprise_common.logging import get_logger
from reprise_common.service import Background
from reprise_notifier.deliveries import service as outbox
from reprise_notifier.deliveries.flows import Worker
from reprise_notifier.deliveries.transport import Transport
from reprise_notifier.ingest import Ingest
from reprise_notifier.routing import Routing
from reprise_notifier.settings import NotifierSettings

log = get_logger("reprise.notifier.runtime")

INCIDENTS_DURABLE = "notifier-incidents"
RECOVERIES_DURABLE = "notifier-recoveries"
CONSUMER_RETRY_DELAY_S = 1.0  # a recovery waiting for its incident is redelivered after 1 s, 2 s, ...


@dataclass
class Runtime:
    """The notifier's engine, bus, routing, ingest and one worker per destination."""

    settings: NotifierSettings
    engine: Engine
    bus: Bus
    clock: Clock
    routing: Routing
    transport: Transport
    ingest: Ingest
    workers: dict[str, Worker]
    background: Background
    consumers: list[Consumer] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start_workers(self) -> None:
        """Start sending what the outbox holds (no NATS needed for that); name alerts left for unknown destinations."""
        for name, worker in self.workers.items():
            self.tasks.append(asyncio.create_task(worker.run(self.stopping), name=f"deliver:{name}"))
        if not self.workers:
            log.warning("no destination configured: alerts go nowhere (docs/notifier.md)")
        pending = await asyncio.to_thread(self._pending)
        for name, count in sorted(pending.items()):
            if name not in self.workers:  # the routes changed since they were queued: they wait for it to come back
                log.warning(
                    "alerts pending for a destination no longer configured", extra={"destination": name, "count": count}
                )

    def _pending(self) -> dict[str, int]:
        with session_scope(self.engine) as session:
            return outbox.count_pending(session)

    def wake(self, names: set[str]) -> None:
        """Tell the workers of these destinations that new alerts wait."""
        for name in names:
            worker = self.workers.get(name)
            if worker is not None:
                worker.wake.set()

    async def start_consumers(self) -> None:
        """Consume incident and recovery changes into the outbox."""
        self.consumers = [
            self._consumer(subjects.INCIDENTS_STREAM, INCIDENTS_DURABLE, subjects.INCIDENTS_ALL),
            self._consumer(subjects.RECOVERIES_STREAM, RECOVERIES_DURABLE, subjects.RECOVERIES_ALL),
        ]
        for consumer in self.consumers:
            await consumer.open()

    def _consumer(self, stream: str, durable: str, filter_subject: str) -> Consumer:
        return self.bus.batch_consumer(
            stream=stream,
            durable=durable,
            filter_subject=filter_subject,
            handler=self.ingest.handle_batch,
            batch=64,
            max_deliver=self.settings.ingest_max_deliver,
            ack_wait_s=self.settings.ack_wait_s,
            retry_delay_s=CONSUMER_RETRY_DELAY_S,
            # A new notifier announces what happens from now on, not a week of history; once created, the durable
            # consumer resumes where it stopped, so nothing published while the notifier is down is missed.
            deliver_policy=DeliverPolicy.NEW,
        )

    async def stop(self) -> None:
        """Stop consuming (each consumer settles what it holds), then let each worker finish its request."""
        await asyncio.gather(*(c.stop() for c in self.consumers))
        self.stopping.set()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.transport.aclose()

    async def consuming(self) -> bool:
        """Readiness: the durable consumers exist, so every event published from now on reaches the outbox."""
        return self.background.started.is_set()

    async def wait_started(self, timeout: float) -> None:
        """Wait until NATS is connected and the consumers run; TimeoutError otherwise."""
        await asyncio.wait_for(self.background.started.wait(), timeout=timeout)
