"""Following snapshots (node reports) on core NATS: the latest message of each subject, handed over in batches.

A snapshot is worth only its latest value, so it is not stored and not acknowledged. The subscription's callback
does one dict store per message; a task hands what has gathered to the handler every few milliseconds (at once when
`batch` subjects are waiting), so the handler's fixed costs are paid per batch, not per message. When the handler
falls behind, a newer message of a subject replaces the older one still waiting (counted as superseded), so what
waits never exceeds one message per subject; what overflows the client's pending limits before the callback runs is
dropped by nats-py and counted by the bus (`reprise_bus_slow_consumer_dropped_total`).

A handler that falls behind reads every subject late, the more so the more subjects wait: `lag_s()` says how late,
so that the silence of a subject is not taken for its sender's when the reader is the one behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from reprise_common.connection import Connection
from reprise_common.logging import get_logger
from reprise_common.metrics import SNAPSHOTS, subject_kind

log = get_logger("reprise.follow")

SnapshotHandler = Callable[[dict[str, bytes]], Awaitable[None]]
"""Handles a batch: subject -> its latest payload."""

# Room for bursts while the event loop is busy: about 10 s of 20,000 reports/s of 2 KB before nats-py drops any.
PENDING_MSGS = 200_000
PENDING_BYTES = 512 * 1024 * 1024
_CATCH_UP_ROUNDS = 1000  # at most this many rounds of reads (of up to 256 KiB each) before a batch is handed over
# A round of reads that brings fewer messages than this is the live stream, not a backlog: the catch-up ends there. A
# backlog brings a full read (256 KiB: about a hundred 2 KB reports) at each turn of the loop; the live stream brings
# what arrived during the round, a few at 50,000 reports/s.
_LIVE_ROUND = 32


class Follower:
    """A core NATS subscription whose latest message per subject goes to the handler in batches."""

    def __init__(
        self,
        *,
        bus: Connection,
        subject: str,
        handler: SnapshotHandler,
        batch: int = 512,
        linger_s: float = 0.005,
        pending_msgs: int = PENDING_MSGS,
        pending_bytes: int = PENDING_BYTES,
    ) -> None:
        self.bus = bus
        self.subject = subject
        self.handler = handler
        self.batch = batch
        self.linger_s = linger_s  # how long a first message waits for others to join its batch
        self.pending_msgs = pending_msgs
        self.pending_bytes = pending_bytes
        self.received = 0
        self.handled = 0  # handed to the handler, which has returned
        self.superseded = 0
        self._superseded_counted = 0  # of those, added to the metric so far
        self.dropped = 0  # counted by the bus from nats-py's slow-consumer errors
        self._waiting: dict[str, bytes] = {}
        # lag_s(): subjects that joined what waits, over the follower's life (a newer message of a waiting one does
        # not join), and how many of them were taken; at each take, how many had joined by then, and when.
        self._joined = 0
        self._taken = 0
        self._takes: deque[tuple[int, float]] = deque()
        self._read_until = time.monotonic()  # every message received before this was handed over
        self._arrived = asyncio.Event()
        self._full = asyncio.Event()
        self._stopping = False
        self._busy = False
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        kind = subject_kind(subject)
        self._handled_metric = SNAPSHOTS.labels(bus.service, kind, "handled")
        self._superseded_metric = SNAPSHOTS.labels(bus.service, kind, "superseded")

    @property
    def subscription(self) -> Subscription | None:
        """The core subscription (a slow-consumer error names it); None before open()."""
        return self._sub

    @property
    def idle(self) -> bool:
        """True when nothing waits for the handler and the handler is not running."""
        return not self._waiting and not self._busy

    async def open(self) -> None:
        """Subscribe now (every message published from here on is seen), then hand over batches in the background."""
        self._sub = await self.bus.nc.subscribe(
            self.subject,
            cb=self._on_msg,
            pending_msgs_limit=self.pending_msgs,
            pending_bytes_limit=self.pending_bytes,
        )
        await self.bus.nc.flush()  # the server has the subscription before open() returns
        self._task = asyncio.create_task(self._run(), name=f"follow:{self.subject}")

    async def stop(self) -> None:
        """Unsubscribe; the batch being handled is finished, what still waits is dropped (a snapshot goes stale)."""
        self._stopping = True
        self._arrived.set()
        self._full.set()
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _on_msg(self, msg: Msg) -> None:
        waiting = self._waiting
        self.received += 1
        if msg.subject in waiting:
            self.superseded += 1  # the metric is moved once per batch (_run): a backlog supersedes thousands a second
        else:
            if not waiting:  # all received before it was handed over: the follower is behind by this one only
                self._read_until = time.monotonic()
            self._joined += 1
        waiting[msg.subject] = msg.data
        self._arrived.set()
        if len(waiting) >= self.batch:
            self._full.set()

    async def _run(self) -> None:
        while True:
            await self._arrived.wait()
            if len(self._waiting) < self.batch and not self._stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.linger_s)
            await self._catch_up()
            if self._stopping:
                return
            batch = self._take()
            self._busy = True
            try:
                await self.handler(batch)
            except Exception:  # a handler bug must not stop the subscription; the next snapshots come anyway
                log.exception("snapshot handler failed", extra={"subject": self.subject, "size": len(batch)})
            finally:
                self._busy = False
            self.handled += len(batch)
            self._handled_metric.inc(len(batch))
            if self.superseded != self._superseded_counted:
                self._superseded_metric.inc(self.superseded - self._superseded_counted)
                self._superseded_counted = self.superseded

    async def _catch_up(self) -> None:
        """Let the connection hand over what it has already read, so that a backlog collapses into the latest
        message of each subject before the handler spends time on older ones.

        A message takes three turns of the event loop from the socket to the callback (read, parse, callback); reading
        is cheap next to handling, so this ends quickly even under a sustained overload. It ends as soon as a round
        brings only the live stream (_LIVE_ROUND): under a steady stream some message arrives in every round, and
        waiting for a round that brings none held the batch for a thousand rounds (half a second at 50,000 reports/s).
        """
        for _ in range(_CATCH_UP_ROUNDS):
            before = self.received
            for _ in range(3):
                await asyncio.sleep(0)
            if self.received - before < _LIVE_ROUND:
                return

    def lag_s(self) -> float:
        """How far behind the handler is: the seconds since the moment before which every message received has been
        handed to it (0 while nothing waits). A subject whose message waits has sent nothing the handler has not been
        handed for at most this long."""
        if not self._waiting:
            return 0.0
        return max(0.0, time.monotonic() - self._read_until)

    def _take(self) -> dict[str, bytes]:
        """The `batch` subjects that have waited longest (with their latest message), or all when fewer wait."""
        waiting = self._waiting
        self._takes.append((self._joined, time.monotonic()))
        if len(waiting) <= self.batch:
            self._waiting = {}
            self._arrived.clear()
            self._full.clear()
            taken = waiting
        else:
            taken = dict(itertools.islice(waiting.items(), self.batch))
            for subject in taken:
                del waiting[subject]
            if len(waiting) < self.batch:
                self._full.clear()
        # Subjects are taken in the order they joined: once as many were taken as had joined at an earlier take,
        # every message received before that take has been handed over.
        self._taken += len(taken)
        takes = self._takes
        while takes and takes[0][0] <= self._taken:
            self._read_until = takes.popleft()[1]
        return taken
