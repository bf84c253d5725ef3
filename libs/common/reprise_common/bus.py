"""The one NATS/JetStream wrapper: connect and reconnect, provision streams, publish with dedup ids, durable pull
consumers with explicit ack / nak-with-delay / term, dead letters, and request/reply for commands."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, RetentionPolicy, StreamConfig

from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import DeadLetter, Event, Wire, parse_event
from reprise_common.logging import get_logger
from reprise_common.metrics import (
    BUS_CONNECTED,
    BUS_RECONNECTS,
    DEAD_LETTERS,
    EVENTS_CONSUMED,
    EVENTS_PUBLISHED,
    subject_kind,
)
from reprise_common.settings import ServiceSettings
from reprise_common.subjects import STREAMS, StreamSpec, dead_letter

log = get_logger("reprise.bus")
W = TypeVar("W", bound=Wire)
_MAX_DEAD_PAYLOAD = 64 * 1024
_STREAM_EXISTS_DIFFERENTLY = 10058


class Outcome(StrEnum):
    """What a consumer's handler decided for one message."""

    ACK = "ack"
    RETRY = "retry"  # nak with a delay; redelivered up to max_deliver times, then dead-lettered
    REJECT = "reject"  # dead-letter now; retrying cannot help (raise MalformedEventError to give the reason)


@dataclass(frozen=True)
class Delivery:
    """Where a consumed event came from and how often it has been delivered."""

    subject: str
    num_delivered: int
    stream_seq: int


Handler = Callable[[Event, Delivery], Awaitable[Outcome]]


def stream_config(spec: StreamSpec) -> StreamConfig:
    """The JetStream configuration for one of Reprise's streams."""
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        max_age=spec.max_age_s,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        duplicate_window=spec.duplicate_window_s,
    )


class Bus:
    """One connection to NATS for one service; safe to use from many tasks."""

    @classmethod
    def for_service(cls, settings: ServiceSettings, service: str) -> Bus:
        """The bus of a platform service, with its NATS identity from its settings."""
        return cls(url=settings.nats_url, service=service, nkey_seed_file=settings.nats_nkey_seed_file)

    def __init__(
        self,
        *,
        url: str,
        service: str,
        streams: Sequence[StreamSpec] = STREAMS,
        nkey_seed_file: Path | None = None,
        inbox_prefix: str | None = None,
        provision: bool = True,
    ) -> None:
        self.url = url
        self.service = service
        self.streams = tuple(streams)
        self.nkey_seed_file = nkey_seed_file
        self.inbox_prefix = inbox_prefix
        self.provision = provision  # agents publish only: their permissions do not allow managing streams
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._consumers: list[Consumer] = []
        self.generation = 0  # bumped on every (re)connect so consumers know to rebuild subscriptions
        self.dead_letter_count = 0
        self._closing = False

    # --- connection -------------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """True while the client holds a live connection."""
        return self._nc is not None and self._nc.is_connected

    @property
    def nc(self) -> Client:
        """The underlying client; raises BusError before connect()."""
        if self._nc is None:
            raise BusError("not connected to NATS: call connect() first")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context; raises BusError before connect()."""
        if self._js is None:
            raise BusError("not connected to NATS: call connect() first")
        return self._js

    async def connect(self, *, attempts: int | None = None, retry_s: float = 0.5) -> None:
        """Connect (retrying while the server is not up yet), then provision streams; reconnects forever after."""
        tries = 0
        while True:
            tries += 1
            try:
                self._nc = await nats.connect(
                    servers=[self.url],
                    name=self.service,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    ping_interval=2,
                    max_outstanding_pings=2,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error,
                    **self._identity(),
                )
                break
            except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
                if attempts is not None and tries >= attempts:
                    raise BusError(f"cannot reach NATS at {self.url}: {exc}") from exc
                await asyncio.sleep(retry_s)
        self._js = self._nc.jetstream(timeout=5)
        BUS_CONNECTED.labels(self.service).set(1)
        if self.provision:
            await self.ensure_streams()
        self.generation += 1

    def _identity(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.nkey_seed_file is not None:
            if not self.nkey_seed_file.is_file():
                raise BusError(f"NATS identity file {self.nkey_seed_file} not found: create it with `reprise creds`")
            options["nkeys_seed"] = str(self.nkey_seed_file)
        if self.inbox_prefix is not None:
            options["inbox_prefix"] = self.inbox_prefix
        return options

    async def _on_disconnected(self) -> None:
        BUS_CONNECTED.labels(self.service).set(0)
        if not self._closing:
            log.warning("disconnected from NATS", extra={"url": self.url})

    async def _on_reconnected(self) -> None:
        BUS_CONNECTED.labels(self.service).set(1)
        BUS_RECONNECTS.labels(self.service).inc()
        log.info("reconnected to NATS", extra={"url": self.url})
        if not self.provision:
            self.generation += 1
            return
        try:
            await self.ensure_streams()
        except (BusError, nats.errors.Error, TimeoutError) as exc:
            log.warning("could not re-provision streams after reconnect", extra={"error": str(exc)})
        self.generation += 1

    async def _on_error(self, exc: Exception) -> None:
        log.debug("nats client error", extra={"error": repr(exc)})

    async def ensure_streams(self) -> None:
        """Create each stream, or update it to the wanted configuration; safe to call any number of times."""
        for spec in self.streams:
            config = stream_config(spec)
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != _STREAM_EXISTS_DIFFERENTLY:
                    raise BusError(f"cannot provision stream {spec.name}: {exc}") from exc
                await self.js.update_stream(config)

    async def close(self) -> None:
        """Stop consumers (each finishes its in-flight message), then drain the connection."""
        self._closing = True
        await asyncio.gather(*(c.stop() for c in self._consumers))
        self._consumers.clear()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await self._nc.drain()
        BUS_CONNECTED.labels(self.service).set(0)

    # --- publishing -------------------------------------------------------------------------------------------
    async def publish(self, subject: str, event: Event, *, msg_id: str | None = None, timeout: float = 5.0) -> int:
        """Publish to JetStream with ``Nats-Msg-Id`` (the event id unless given) so a retry is deduplicated.

        Returns the stream sequence. Raises BusError when the server does not confirm.
        """
        headers = {"Nats-Msg-Id": msg_id or event.event_id}
        try:
            ack = await self.js.publish(subject, event.to_bytes(), timeout=timeout, headers=headers)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"publish to {subject} failed: {exc!r}") from exc
        EVENTS_PUBLISHED.labels(self.service, subject_kind(subject)).inc()
        return int(ack.seq)

    async def request(self, subject: str, message: Wire, reply_type: type[W], *, timeout: float = 5.0) -> W:
        """Send a request over core NATS and parse the reply; raises BusError on no responder or timeout."""
        try:
            msg = await self.nc.request(subject, message.model_dump_json().encode(), timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise BusError(f"no responder on {subject}") from exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"request to {subject} failed: {exc!r}") from exc
        return reply_type.model_validate_json(msg.data)

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[Wire]]) -> Any:
        """Answer requests on a subject; a handler's error is answered as such, never crashes the service."""

        async def on_msg(msg: Msg) -> None:
            reply = await handler(msg.data)
            if msg.reply:
                await msg.respond(reply.model_dump_json().encode())

        return await self.nc.subscribe(subject, cb=on_msg)

    # --- consuming --------------------------------------------------------------------------------------------
    def consumer(
        self,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: Handler,
        batch: int = 64,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        retry_delay_s: float = 0.5,
        deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
    ) -> Consumer:
        """A durable pull consumer; call ``start()`` on it to run it in the background."""
        consumer = Consumer(
            bus=self,
            stream=stream,
            durable=durable,
            filter_subject=filter_subject,
            handler=handler,
            batch=batch,
            max_deliver=max_deliver,
            ack_wait_s=ack_wait_s,
            retry_delay_s=retry_delay_s,
            deliver_policy=deliver_policy,
        )
        self._consumers.append(consumer)
        return consumer

    async def dead_letter(
        self, *, consumer: str, subject: str, data: bytes, reason: str, key: str, delivered: int
    ) -> None:
        """Keep a message we could not use, with the reason, on the dead-letter stream, and count it."""
        self.dead_letter_count += 1
        DEAD_LETTERS.labels(self.service, consumer, reason.split(":", 1)[0][:40]).inc()
        letter = DeadLetter(
            source=self.service,
            original_subject=subject,
            reason=reason,
            payload=data[:_MAX_DEAD_PAYLOAD].decode("utf-8", errors="replace"),
            delivered=delivered,
        )
        log.warning("dead-lettered a message", extra={"subject": subject, "reason": reason, "consumer": consumer})
        try:
            await self.publish(dead_letter(self.service), letter, msg_id=f"dl:{key}")
        except BusError as exc:
            # The count above still records it; the message itself stays in its source stream until max age.
            log.error("could not store a dead letter", extra={"error": str(exc), "subject": subject})


class Consumer:
    """A durable JetStream pull consumer that never crashes on a bad message and survives server restarts."""

    def __init__(
        self,
        *,
        bus: Bus,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: Handler,
        batch: int,
        max_deliver: int,
        ack_wait_s: float,
        retry_delay_s: float,
        deliver_policy: DeliverPolicy,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.handler = handler
        self.batch = batch
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self.retry_delay_s = retry_delay_s
        self.deliver_policy = deliver_policy
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Run the fetch loop in a background task."""
        self._task = asyncio.create_task(self._run(), name=f"consumer:{self.durable}")
        return self._task

    async def stop(self) -> None:
        """Stop fetching; the message being handled is finished and acknowledged first."""
        self._stopping.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver + 1,  # one more than we retry, so we can dead-letter the last one
            deliver_policy=self.deliver_policy,
            filter_subject=self.filter_subject,
        )
        return await self.bus.js.pull_subscribe(
            self.filter_subject, durable=self.durable, stream=self.stream, config=config
        )

    async def _run(self) -> None:
        sub: JetStreamContext.PullSubscription | None = None
        generation = -1
        while not self._stopping.is_set():
            try:
                if sub is None or generation != self.bus.generation:
                    if sub is not None:
                        with contextlib.suppress(nats.errors.Error, TimeoutError):
                            await sub.unsubscribe()
                    generation = self.bus.generation
                    sub = await self._subscribe()
                msgs = await self._fetch_unless_stopped(sub)
            except TimeoutError:
                continue
            except (nats.errors.Error, BusError) as exc:
                log.debug(
                    "consumer fetch failed; will resubscribe",
                    extra={"consumer": self.durable, "error": repr(exc)},
                )
                sub = None
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._dispatch(msg)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await sub.unsubscribe()

    async def _fetch_unless_stopped(self, sub: JetStreamContext.PullSubscription) -> list[Msg]:
        """Fetch a batch, giving up at once when stop() is called (unprocessed messages are redelivered)."""
        fetch = asyncio.ensure_future(self._fetch_batch(sub))
        stopped = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not fetch.done():
            fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, nats.errors.Error):
                await fetch
            return []
        stopped.cancel()
        return fetch.result()

    async def _fetch_batch(self, sub: JetStreamContext.PullSubscription) -> list[Msg]:
        """Long-poll for one message, then take what else is already waiting without a wait.

        A long-polling fetch of a whole batch that returns with fewer messages leaves its pull request open on the
        server, and nats-py can lose what that request later receives until the ack wait redelivers it (30 s).
        """
        msgs = await sub.fetch(1, timeout=1.0, heartbeat=0.25)
        if self.batch > 1 and msgs and msgs[-1].metadata.num_pending:
            with contextlib.suppress(TimeoutError):
                msgs += await sub.fetch(min(self.batch - 1, msgs[-1].metadata.num_pending), timeout=0.05)
        return msgs

    async def _dispatch(self, msg: Msg) -> None:
        meta = msg.metadata
        delivery = Delivery(subject=msg.subject, num_delivered=meta.num_delivered, stream_seq=meta.sequence.stream)
        key = f"{self.stream}:{delivery.stream_seq}"
        try:
            event = parse_event(msg.data)
        except MalformedEventError as exc:
            await self._reject(msg, delivery, key, f"malformed: {exc.reason}")
            return
        try:
            outcome = await self.handler(event, delivery)
        except MalformedEventError as exc:  # the handler found the event unusable and says why
            EVENTS_CONSUMED.labels(self.bus.service, self.durable, Outcome.REJECT.value).inc()
            await self._reject(msg, delivery, key, f"unusable: {exc.reason}")
            return
        except Exception as exc:  # a handler bug must not kill the consumer; the message is retried
            log.exception("handler failed", extra={"consumer": self.durable, "subject": msg.subject})
            outcome = Outcome.RETRY
            reason = f"handler error: {exc!r}"
        else:
            reason = "handler rejected"
        EVENTS_CONSUMED.labels(self.bus.service, self.durable, outcome.value).inc()
        try:
            if outcome is Outcome.ACK:
                await msg.ack()
            elif outcome is Outcome.RETRY and delivery.num_delivered < self.max_deliver:
                await msg.nak(delay=self.retry_delay_s * delivery.num_delivered)
            else:
                if outcome is Outcome.RETRY:
                    reason = f"gave up after {delivery.num_delivered} deliveries: {reason}"
                await self._reject(msg, delivery, key, reason)
        except nats.errors.Error as exc:
            log.warning("could not settle a message; it will be redelivered", extra={"error": repr(exc)})

    async def _reject(self, msg: Msg, delivery: Delivery, key: str, reason: str) -> None:
        await self.bus.dead_letter(
            consumer=self.durable,
            subject=delivery.subject,
            data=msg.data,
            reason=reason,
            key=key,
            delivered=delivery.num_delivered,
        )
        await msg.term()
