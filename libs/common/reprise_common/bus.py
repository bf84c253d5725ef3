"""The one NATS/JetStream wrapper: connect and reconnect, provision streams, publish with dedup ids, durable pull
consumers with explicit ack / nak-with-delay / term, dead letters, request/reply for commands, and snapshots (node
reports) published and followed on core NATS."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from reprise_common import provision
from reprise_common.advisories import connection_name
from reprise_common.connection import open_connection
from reprise_common.consumer import (  # Delivery, Handler and Outcome are part of this module's interface
    BatchHandler,
    Consumer,
    Delivery,
    Handler,
    Outcome,
    one_at_a_time,
)
from reprise_common.errors import BusError, NotConnectedError
from reprise_common.events import DeadLetter, Event, Wire
from reprise_common.fanout import request_many, request_one
from reprise_common.follow import PENDING_MSGS, Follower, SnapshotHandler
from reprise_common.logging import get_logger
from reprise_common.metrics import (
    BUS_CONNECTED,
    BUS_RECONNECTS,
    DEAD_LETTERS,
    EVENTS_PUBLISHED,
    SLOW_CONSUMER_DROPS,
    subject_kind,
)
from reprise_common.settings import ServiceSettings
from reprise_common.subjects import STREAMS, STREAMS_OWNER, StreamSpec, dead_letter, inbox_prefix

__all__ = ["Bus", "Consumer", "Delivery", "Handler", "Outcome"]
log = get_logger("reprise.bus")
W = TypeVar("W", bound=Wire)
_MAX_DEAD_PAYLOAD = 64 * 1024
_SLOW_CONSUMER_LOG_EVERY_S = 60.0
PUBLISH_RETRY_MIN_S, PUBLISH_RETRY_MAX_S = 0.05, 0.5  # a publish no stream answered is tried again, pausing so long


class Bus:
    """One connection to NATS for one service; safe to use from many tasks."""

    @classmethod
    def for_service(
        cls, settings: ServiceSettings, service: str, *, provision: bool = True, identity: str | None = None
    ) -> Bus:
        """The bus of a platform service, with its NATS identity from its settings and that identity's own reply
        inbox (`identity`: the service whose identity it is, when a second connection of it has another name)."""
        return cls(
            url=settings.nats_url,
            service=service,
            nkey_seed_file=settings.nats_nkey_seed_file,
            provision=provision,
            replicas=settings.nats_stream_replicas,
            inbox_prefix=inbox_prefix(identity or service),
            updates_streams=(identity or service) == STREAMS_OWNER,
        )

    def __init__(
        self,
        *,
        url: str,
        service: str,
        streams: Sequence[StreamSpec] = STREAMS,
        nkey_seed_file: Path | None = None,
        inbox_prefix: str | None = None,
        provision: bool = True,
        replicas: int = 1,
        updates_streams: bool = True,
    ) -> None:
        self.url = url  # one server, or a cluster's members comma-separated
        self.replicas = replicas
        self.service = service
        self.streams = tuple(streams)
        self.nkey_seed_file = nkey_seed_file
        self.inbox_prefix = inbox_prefix
        self.provision = provision  # agents publish only: their permissions do not allow managing streams
        self.updates_streams = updates_streams  # else it creates a missing stream, and leaves one that exists alone
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._consumers: list[Consumer] = []
        self._followers: list[Follower] = []
        self._slow_logged: dict[str, float] = {}  # subject kind -> when a drop was last logged (loop time)
        self.generation = 0  # bumped on every (re)connect so consumers know to rebuild subscriptions
        # bumped when the connection drops: after a reconnect the client is connected a moment before `generation`
        # moves (streams are provisioned first), and a reader must not take that moment for an unbroken connection
        self.disconnects = 0
        self.dead_letter_count = 0
        self._closing = False
        self._reprovision: asyncio.Task[None] | None = None  # provisioning retried after a reconnect

    # --- connection -------------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """True while the client holds a live connection."""
        return self._nc is not None and self._nc.is_connected

    @property
    def nc(self) -> Client:
        """The underlying client; raises BusError before connect()."""
        if self._nc is None:
            raise NotConnectedError("not connected to NATS: call connect() first")
        return self._nc

    @property
    def connection(self) -> str:
        """This connection as the server names it in its advisories (connection_name); "" when not connected."""
        nc = self._nc
        if nc is None or not nc.is_connected or nc.client_id is None:
            return ""
        return connection_name(str(nc._server_info.get("server_id", "")), nc.client_id)

    @property
    def max_payload(self) -> int:
        """The largest message the server accepts (its max_payload, as it announced it); BusError before connect()."""
        return int(self.nc.max_payload)

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context; raises BusError before connect()."""
        if self._js is None:
            raise NotConnectedError("not connected to NATS: call connect() first")
        return self._js

    async def connect(self, *, attempts: int | None = None, retry_s: float = 0.5) -> None:
        """Connect (retrying while the server is not up yet), then provision streams; reconnects forever after."""
        self._nc = await open_connection(
            self.url, name=self.service, options=self._options, attempts=attempts, retry_s=retry_s
        )
        self._js = self._nc.jetstream(timeout=5)
        BUS_CONNECTED.labels(self.service).set(1)
        if self.provision:
            await self._provision(attempts=attempts, retry_s=retry_s)
        self.generation += 1

    async def _provision(self, *, attempts: int | None, retry_s: float) -> None:
        """ensure_streams, retried while JetStream is not available yet (provision_when_formed)."""
        await provision.provision_when_formed(self.ensure_streams, url=self.url, attempts=attempts, retry_s=retry_s)

    def _options(self) -> dict[str, Any]:
        """The client's callbacks, and this service's identity (its file is looked for at each try)."""
        options: dict[str, Any] = {
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "error_cb": self._on_error,
        }
        if self.nkey_seed_file is not None:
            if not self.nkey_seed_file.is_file():
                raise BusError(f"NATS identity file {self.nkey_seed_file} not found: create it with `reprise creds`")
            options["nkeys_seed"] = str(self.nkey_seed_file)
        if self.inbox_prefix is not None:
            options["inbox_prefix"] = self.inbox_prefix
        return options

    async def _on_disconnected(self) -> None:
        self.disconnects += 1
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
            # e.g. a restarted server whose JetStream is not ready yet, or a whole cluster still forming: streams it
            # lost would otherwise never come back. Expected after a restart, so not a warning; a refusal for good is.
            log.info(
                "JetStream not ready after the reconnect: provisioning streams in the background",
                extra={"error": str(exc)},
            )
            if self._reprovision is None or self._reprovision.done():
                self._reprovision = asyncio.create_task(self._provision_again(), name="reprovision")
        self.generation += 1

    async def _provision_again(self) -> None:
        """Provision in the background until JetStream answers (consumers retry their own subscriptions meanwhile)."""
        try:
            await self._provision(attempts=None, retry_s=1.0)
        except (BusError, nats.errors.Error) as exc:  # refused for good, or the connection dropped again
            log.warning("gave up provisioning streams after the reconnect", extra={"error": str(exc)})
            return
        log.info("streams provisioned again after the reconnect")

    async def _on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self._slow_consumer(exc)
            return
        log.debug("nats client error", extra={"error": repr(exc)})

    def _slow_consumer(self, exc: nats.errors.SlowConsumerError) -> None:
        """Count a message nats-py dropped for a full subscription; log it at most once a minute per subject kind."""
        kind = subject_kind(exc.subject)
        SLOW_CONSUMER_DROPS.labels(self.service, kind).inc()
        for follower in self._followers:
            if follower.subscription is exc.sub:
                follower.dropped += 1
        now = asyncio.get_running_loop().time()
        if now - self._slow_logged.get(kind, -_SLOW_CONSUMER_LOG_EVERY_S) >= _SLOW_CONSUMER_LOG_EVERY_S:
            self._slow_logged[kind] = now
            log.warning("slow consumer: dropping messages", extra={"subject": exc.subject, "kind": kind})

    async def ensure_streams(self) -> None:
        """Create each stream, or (the streams' owner only) update it to the wanted configuration; safe to call any
        number of times (provision.ensure_streams)."""
        await provision.ensure_streams(
            self.js, self.streams, replicas=self.replicas, updates_streams=self.updates_streams
        )

    async def close(self) -> None:
        """Stop consumers (each finishes its in-flight message), then drain the connection."""
        self._closing = True
        if self._reprovision is not None:
            self._reprovision.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reprovision
        await asyncio.gather(*(c.stop() for c in self._consumers), *(f.stop() for f in self._followers))
        self._consumers.clear()
        self._followers.clear()
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
        data, loop = event.to_bytes(), asyncio.get_running_loop()
        deadline, pause = loop.time() + timeout, PUBLISH_RETRY_MIN_S
        while True:
            try:
                ack = await self.js.publish(subject, data, timeout=max(deadline - loop.time(), 0.01), headers=headers)
                break
            except nats.js.errors.NoStreamResponseError as exc:
                # No stream answered: JetStream has no leader for it this moment (an election, a restart) or it is
                # being provisioned. The message id makes the retry safe; it is tried again until the timeout.
                if loop.time() + pause >= deadline:
                    raise BusError(f"publish to {subject} failed: {exc!r}") from exc
                await asyncio.sleep(pause)
                pause = min(pause * 2, PUBLISH_RETRY_MAX_S)
            except (nats.errors.Error, TimeoutError) as exc:
                raise BusError(f"publish to {subject} failed: {exc!r}") from exc
        EVENTS_PUBLISHED.labels(self.service, subject_kind(subject)).inc()
        return int(ack.seq)

    async def publish_snapshot(self, subject: str, event: Event) -> None:
        """Publish a snapshot (a node report) on core NATS: not stored, not confirmed; only the latest one counts.

        Raises BusError when not connected (the caller skips this snapshot: the next one comes soon) or when the
        client cannot take it.
        """
        if not self.connected:
            raise NotConnectedError(f"not connected: snapshot on {subject} skipped")
        try:
            await self.nc.publish(subject, event.to_bytes())
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject} failed: {exc!r}") from exc
        EVENTS_PUBLISHED.labels(self.service, subject_kind(subject)).inc()

    async def request(self, subject: str, message: Wire, reply_type: type[W], *, timeout: float = 5.0) -> W:
        """Send a request over core NATS and parse the reply.

        Raises NoRespondersError when nothing listens, RequestTimeoutError when no reply came in time, BadReplyError
        for a reply of the wrong shape, and BusError for anything else the client refused (see fanout.py).
        """
        return await request_one(self.nc, subject, message, reply_type, timeout=timeout)

    async def request_many(
        self, messages: Mapping[str, Wire], reply_type: type[W], *, timeout: float = 5.0
    ) -> dict[str, W | BusError]:
        """Send one request per subject at once; each subject's parsed reply, or the BusError saying why none came.

        The errors are `request()`'s classes (NoRespondersError when nothing listens, RequestTimeoutError when the
        deadline passed first); see fanout.py.
        """
        return await request_many(self.nc, messages, reply_type, timeout=timeout)

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[Wire]], *, queue: str = "") -> Any:
        """Answer requests on a subject (one member of `queue` answers each, when given); a handler's error is
        answered as such, never crashes the service."""

        async def on_msg(msg: Msg) -> None:
            reply = await handler(msg.data)
            if msg.reply:
                await msg.respond(reply.model_dump_json().encode())

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

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
        """A durable pull consumer of single events; call ``start()`` on it to run it in the background."""
        return self.batch_consumer(
            stream=stream,
            durable=durable,
            filter_subject=filter_subject,
            handler=one_at_a_time(handler),
            batch=batch,
            max_deliver=max_deliver,
            ack_wait_s=ack_wait_s,
            retry_delay_s=retry_delay_s,
            deliver_policy=deliver_policy,
        )

    def batch_consumer(
        self,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        handler: BatchHandler,
        batch: int = 64,
        parse: bool = True,
        prefetch: bool = False,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
        retry_delay_s: float = 0.5,
        deliver_policy: DeliverPolicy = DeliverPolicy.ALL,
        progress_every_s: float | None = None,
    ) -> Consumer:
        """A durable pull consumer whose handler decides whole batches; ``start()`` or ``await open()`` runs it."""
        consumer = Consumer(
            bus=self,
            stream=stream,
            durable=durable,
            filter_subject=filter_subject,
            handler=handler,
            batch=batch,
            parse=parse,
            prefetch=prefetch,
            max_deliver=max_deliver,
            ack_wait_s=ack_wait_s,
            retry_delay_s=retry_delay_s,
            deliver_policy=deliver_policy,
            progress_every_s=progress_every_s,
        )
        self._consumers.append(consumer)
        return consumer

    def follow(
        self,
        subject: str,
        *,
        handler: SnapshotHandler,
        batch: int = 512,
        linger_s: float = 0.005,
        pending_msgs: int = PENDING_MSGS,
    ) -> Follower:
        """Follow snapshots on core NATS: the latest message per subject, in batches; ``await open()`` starts it."""
        follower = Follower(
            bus=self, subject=subject, handler=handler, batch=batch, linger_s=linger_s, pending_msgs=pending_msgs
        )
        self._followers.append(follower)
        return follower

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
