"""Durable JetStream pull consumers: explicit ack after the handler's work, nak with delay on a transient failure,
dead letter (and term) for what can never be used, and a rebuilt subscription after every reconnect.

A handler decides a whole batch at once (one transaction for many messages); `one_at_a_time` adapts a handler of
single events.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from reprise_common.connection import Connection
from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import Event, parse_event
from reprise_common.logging import get_logger
from reprise_common.metrics import EVENTS_CONSUMED
from reprise_common.provision import ensure_consumer
from reprise_common.pull import PullInbox

log = get_logger("reprise.consumer")
FIRST_WAIT_S = 1.0  # how long a fetch waits (long-polls) for the first message of a batch
MORE_WAIT_S = 0.05  # then how long it waits for each further message while the consumer has more pending
PENDING_BYTES = 256 * 1024 * 1024  # what the inbox may hold before the client drops messages (none get near it)


class Outcome(StrEnum):
    """What a handler decided for one message."""

    ACK = "ack"
    RETRY = "retry"  # nak with a delay; redelivered up to max_deliver times, then dead-lettered
    REJECT = "reject"  # dead-letter now; retrying cannot help (raise MalformedEventError to give the reason)


@dataclass(frozen=True)
class Delivery:
    """Where a consumed event came from and how often it has been delivered."""

    subject: str
    num_delivered: int
    stream_seq: int
    stored_ns: int = 0  # when the stream stored it (the server's clock), ns since the epoch; 0 when unknown


Handler = Callable[[Event, Delivery], Awaitable[Outcome]]
_V1_ACK_TOKENS = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>


def delivery_of(msg: Msg) -> Delivery:
    """Where a JetStream message came from, how often it has been delivered and when it was stored, from its ack
    subject.

    Only the numbers needed are read, as integers: nats-py's `metadata` converts every token (the timestamp to a
    datetime), which was a tenth of a storm's time. The newer subject form (with domain and account) has nats-py's
    token positions.
    """
    tokens = msg.reply.split(".")
    if len(tokens) == _V1_ACK_TOKENS and tokens[0] == Msg.Ack.Prefix0 and tokens[1] == Msg.Ack.Prefix1:
        return Delivery(
            subject=msg.subject, num_delivered=int(tokens[4]), stream_seq=int(tokens[5]), stored_ns=int(tokens[7])
        )
    meta = msg.metadata  # raises for a message that is not from JetStream
    stored_ns = round(meta.timestamp.timestamp() * 1_000_000_000)
    return Delivery(
        subject=msg.subject, num_delivered=meta.num_delivered, stream_seq=meta.sequence.stream, stored_ns=stored_ns
    )


@dataclass(frozen=True)
class Item:
    """One message of a batch: its parsed event (None when the consumer does not parse) and where it came from."""

    event: Event | None
    delivery: Delivery
    data: bytes


@dataclass(frozen=True)
class Verdict:
    """The handler's decision for one item; a REJECT carries the reason for the dead letter."""

    outcome: Outcome
    reason: str = ""


@dataclass(frozen=True)
class Batch:
    """A fetched batch: how many messages came, and the ones to hand over (malformed ones were dead-lettered)."""

    fetched: int
    msgs: list[Msg]
    items: list[Item]


ACK = Verdict(Outcome.ACK)
BatchHandler = Callable[[list[Item]], Awaitable[list[Verdict]]]


class Consumer:
    """A durable JetStream pull consumer: fetch up to `batch` messages, hand them to the handler together, settle each
    as it says. It never crashes on a bad message and rebuilds its subscription after a reconnect."""

    def __init__(
        self,
        *,
        bus: Connection,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: BatchHandler,
        batch: int,
        parse: bool = True,
        prefetch: bool = False,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        retry_delay_s: float = 0.5,
        deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
        progress_every_s: float | None = None,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.handler = handler
        self.batch = batch
        self.parse = parse  # a handler that filters on the subject first parses only what it keeps
        # Fetch the next batch while the handler works on one: for a handler that is quick next to the ack wait, as
        # the fetched batch's ack wait runs while it waits its turn.
        self.prefetch = prefetch
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.retry_delay_s = retry_delay_s
        self.deliver_policy = deliver_policy
        # While a fetched batch is held (handled, or waiting its turn), tell the server every this many seconds that
        # it is in progress: the ack wait can then be short, so that a consumer that dies with a batch in hand has
        # it redelivered (to a restarted or another consumer) after seconds, not after a long ack wait.
        self.progress_every_s = progress_every_s
        self._held: list[Batch] = []
        self.acked = 0  # messages acknowledged after the handler's work, since the start
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Fetch in the background (the durable consumer is created by the task)."""
        self._task = asyncio.create_task(self._run(None), name=f"consumer:{self.durable}")
        return self._task

    async def open(self) -> asyncio.Task[None]:
        """Create the durable consumer now (nothing published from here on is missed), then fetch in the background."""
        sub = await self._subscribe()
        self._task = asyncio.create_task(self._run(sub), name=f"consumer:{self.durable}")
        return self._task

    async def stop(self) -> None:
        """Stop fetching; the batch being handled is finished and settled first, one fetched ahead is given back."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _subscribe(self) -> PullInbox:
        """Create the durable consumer if it is missing (or apply the limits it should have), and an inbox to pull
        from it."""
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver + 1,
            max_ack_pending=max(10_000, self.batch * 4),
            deliver_policy=self.deliver_policy,
            filter_subject=self.filter_subject,
        )
        await ensure_consumer(self.bus.js, self.stream, config)
        inbox = PullInbox(
            self.bus.nc,
            stream=self.stream,
            consumer=self.durable,
            pending_msgs=max(10_000, self.batch * 4),
            pending_bytes=PENDING_BYTES,
        )
        await inbox.open()
        return inbox

    async def _keep_in_progress(self, every_s: float) -> None:
        """Tell the server every `every_s` that the messages of the batches held are still being worked on."""
        while True:
            await asyncio.sleep(every_s)
            for batch in list(self._held):
                for msg in batch.msgs:
                    with contextlib.suppress(nats.errors.Error):
                        await msg.in_progress()

    async def _run(self, first: PullInbox | None) -> None:
        progress = None
        if self.progress_every_s is not None:
            progress = asyncio.create_task(
                self._keep_in_progress(self.progress_every_s), name=f"progress:{self.durable}"
            )
        try:
            await self._fetch_and_dispatch(first)
        finally:
            if progress is not None:
                progress.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await progress

    async def _fetch_and_dispatch(self, first: PullInbox | None) -> None:
        sub = first
        generation = self.bus.generation
        ahead: asyncio.Future[Batch] | None = None  # the next batch, fetched (and read) while the handler works
        while not self._stopping.is_set():
            try:
                if ahead is None:  # else it was fetched on the subscription of the batch before
                    if sub is None or generation != self.bus.generation:
                        if sub is not None:  # a stale subscription would hold up the connection's drain at shutdown
                            with contextlib.suppress(nats.errors.Error, TimeoutError):
                                await sub.close()
                        generation = self.bus.generation
                        sub = await self._subscribe()
                    ahead = asyncio.ensure_future(self._fetch(sub))
                batch = await ahead
            except TimeoutError:
                continue
            except (nats.errors.Error, BusError) as exc:
                # a BusError (pull requests went unanswered, or the consumer refused them) is rare and worth seeing;
                # a client error comes with every disconnect, which the bus already logs
                level = logging.WARNING if isinstance(exc, BusError) else logging.DEBUG
                log.log(level, "fetch failed; will resubscribe", extra={"consumer": self.durable, "error": repr(exc)})
                if sub is not None:
                    with contextlib.suppress(nats.errors.Error, TimeoutError):
                        await sub.close()
                sub = None
                await asyncio.sleep(0.5)
                continue
            finally:
                ahead = None
            if batch.fetched:
                if self.prefetch:  # acknowledged only after their own batch: the fetch overlaps the handler's work
                    assert sub is not None  # the batch came through it
                    ahead = asyncio.ensure_future(self._fetch(sub))
                await self._dispatch(batch)
        if ahead is not None:
            with contextlib.suppress(TimeoutError, nats.errors.Error, BusError):
                await self._give_back(await ahead)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await sub.close()

    async def _give_back(self, batch: Batch) -> None:
        """Messages fetched ahead but not handled (the consumer stops): redelivered now, not after the ack wait."""
        for msg in batch.msgs:
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
        self._release(batch)

    def _release(self, batch: Batch) -> None:
        self._held = [held for held in self._held if held is not batch]

    async def _fetch(self, sub: PullInbox) -> Batch:
        """The next batch, read; an empty one when the consumer stops first."""
        fetch = asyncio.ensure_future(sub.fetch(self.batch, timeout=FIRST_WAIT_S, linger=MORE_WAIT_S))
        stopped = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not fetch.done():
            fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, nats.errors.Error):
                await fetch
            return Batch(0, [], [])
        stopped.cancel()
        return await self._read(fetch.result())

    async def _read(self, msgs: list[Msg]) -> Batch:
        """Where each message came from, and its event (parsed here, while the handler may still be busy with the
        batch before); a malformed one is dead-lettered at once."""
        items: list[Item] = []
        kept: list[Msg] = []
        for msg in msgs:
            delivery = delivery_of(msg)
            event: Event | None = None
            if self.parse:
                try:
                    event = parse_event(msg.data)
                except MalformedEventError as exc:
                    await self._reject(msg, delivery, f"malformed: {exc.reason}")
                    continue
            items.append(Item(event, delivery, msg.data))
            kept.append(msg)
        batch = Batch(len(msgs), kept, items)
        if kept:
            self._held.append(batch)  # settled or given back later
        return batch

    async def _dispatch(self, batch: Batch) -> None:
        if not batch.items:
            return
        try:
            await self._handle(batch)
        finally:
            self._release(batch)

    async def _handle(self, batch: Batch) -> None:
        try:
            verdicts = await self.handler(batch.items)
        except Exception:  # a handler bug must not kill the consumer; the batch is retried
            log.exception("batch handler failed", extra={"consumer": self.durable, "size": len(batch.items)})
            verdicts = [Verdict(Outcome.RETRY, "handler error")] * len(batch.items)
        for msg, item, verdict in zip(batch.msgs, batch.items, verdicts, strict=True):
            await self._settle(msg, item.delivery, verdict)
        for outcome, count in collections.Counter(v.outcome for v in verdicts).items():
            EVENTS_CONSUMED.labels(self.bus.service, self.durable, outcome.value).inc(count)

    async def _settle(self, msg: Msg, delivery: Delivery, verdict: Verdict) -> None:
        try:
            if verdict.outcome is Outcome.ACK:
                await msg.ack()
                self.acked += 1
            elif verdict.outcome is Outcome.RETRY and delivery.num_delivered < self.max_deliver:
                await msg.nak(delay=self.retry_delay_s * delivery.num_delivered)
            else:
                reason = verdict.reason or "handler rejected"
                if verdict.outcome is Outcome.RETRY:
                    reason = f"gave up after {delivery.num_delivered} deliveries: {reason}"
                await self._reject(msg, delivery, reason)
        except nats.errors.Error as exc:
            log.warning("could not settle a message; it will be redelivered", extra={"error": repr(exc)})

    async def _reject(self, msg: Msg, delivery: Delivery, reason: str) -> None:
        await self.bus.dead_letter(
            consumer=self.durable,
            subject=delivery.subject,
            data=msg.data,
            reason=reason,
            key=f"{self.stream}:{delivery.stream_seq}",
            delivered=delivery.num_delivered,
        )
        await msg.term()


def one_at_a_time(handler: Handler) -> BatchHandler:
    """A batch handler that hands each event to `handler` in order; its errors are settled per message."""

    async def handle(items: list[Item]) -> list[Verdict]:
        return [await _verdict(handler, item) for item in items]

    return handle


def side_by_side(handler: Handler, key: Callable[[Event], str]) -> BatchHandler:
    """A batch handler that hands the events of different keys to `handler` at the same time, and those of one key
    in order (e.g. one job's incidents one after the other, different jobs' together); errors settle per message."""

    async def in_order(items: list[tuple[int, Item]]) -> list[tuple[int, Verdict]]:
        return [(index, await _verdict(handler, item)) for index, item in items]

    async def handle(items: list[Item]) -> list[Verdict]:
        by_key: dict[str, list[tuple[int, Item]]] = {}
        for index, item in enumerate(items):
            assert item.event is not None  # per-event handlers always get parsed events
            by_key.setdefault(key(item.event), []).append((index, item))
        verdicts: list[Verdict] = [ACK] * len(items)
        for group in await asyncio.gather(*(in_order(group) for group in by_key.values())):
            for index, verdict in group:
                verdicts[index] = verdict
        return verdicts

    return handle


async def _verdict(handler: Handler, item: Item) -> Verdict:
    assert item.event is not None  # per-event handlers always get parsed events
    try:
        return Verdict(await handler(item.event, item.delivery))
    except MalformedEventError as exc:  # the handler found the event unusable and says why
        return Verdict(Outcome.REJECT, f"unusable: {exc.reason}")
    except Exception as exc:  # a handler bug must not kill the consumer; the message is retried
        log.exception("handler failed", extra={"subject": item.delivery.subject})
        return Verdict(Outcome.RETRY, f"handler error: {exc!r}")
